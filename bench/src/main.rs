//! `kiln-bench`: Kiln's benchmarks and their baselines, run side by side on this machine.
//! Each subcommand generates its own data in a scratch directory, times Kiln and the baselines in
//! interleaved rounds and prints medians, ratios against the goals, and a markdown table
//! (BENCHMARKS.md at the repo root records the results). Shared timing code is in [`util`].

mod blob_upload;
mod converge;
mod delivery;
mod digest;
mod failover;
mod farm;
mod mirror;
mod observe;
mod pack;
mod platforms;
mod stat_cache;
mod state_writes;
mod sweep_plan;
mod trust;
mod upload;
mod util;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "kiln-bench", about = "Kiln's benchmarks against their baselines")]
struct Cli {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Debug, Subcommand)]
enum Bench {
    /// Tree digest: small files (warm, optionally cold) vs cat and a Node hash; a big file vs b3sum.
    Digest(digest::Args),
    /// The no-op path with a warm stat cache vs `git status` and `find`; cold cache vs tree digest v1.
    StatCache(stat_cache::Args),
    /// Archive pack of a small-file tree vs `tar --sort=name`.
    Pack(pack::Args),
    /// Sweep planning: 100k listed images × 1,000 stores × 10k roots through the pure planner.
    SweepPlan(sweep_plan::Args),
    /// A no-op `kiln up` of a recorded 3-image instance vs hashing its contexts alone.
    NoopUp(converge::NoopArgs),
    /// A cold `kiln up` (upload, verify, build, label) vs `docker build` of the same context.
    ColdBuild(converge::ColdArgs),
    /// Context upload over loopback (pack, gRPC, verify, store) vs a plain TCP copy; peak RSS.
    Upload(upload::Args),
    /// Per-file uploads: a one-file edit of a 1 GiB / 2,000-file context vs its first upload; the first vs the archive upload and a TCP copy.
    BlobUpload(blob_upload::Args),
    /// Delivery to `nodes` and `kind` clusters: an image every node holds; a large image to 3 nodes vs `docker save | ctr import`.
    Delivery(delivery::Args),
    /// What trust costs: a no-op `kiln up` and an upload over TLS with a token vs in plaintext.
    Trust(trust::Args),
    /// The scheduler under load: 1,000 simulated agents, 200 concurrent converges of 5 images.
    Farm(farm::FarmArgs),
    /// A farm on PostgreSQL: kill -9 → first successful `kiln up` on the standby; no-op up on PostgreSQL vs SQLite.
    Failover(failover::Args),
    /// Parallel placement: a 20-image converge on 4 simulated agents vs one agent, sequential.
    Parallel(farm::ParallelArgs),
    /// What observability costs: a no-op `kiln up` (the binary) with metrics listeners and OTLP traces on vs off.
    Observe(observe::Args),
    /// The SQLite state under 200 concurrent converges' writes: group commit vs a transaction per call.
    StateWrites(state_writes::Args),
    /// `kiln mirror` of a two-platform pinned image between local registries vs docker pull+tag+push of one platform.
    Mirror(mirror::Args),
    /// A two-platform FROM scratch image to a registry on two agents vs the two single-platform converges in a row.
    Platforms(platforms::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Bench::Digest(args) => digest::run(&args),
        Bench::StatCache(args) => stat_cache::run(&args),
        Bench::Pack(args) => pack::run(&args),
        Bench::SweepPlan(args) => sweep_plan::run(&args),
        Bench::NoopUp(args) => converge::noop_up(&args),
        Bench::ColdBuild(args) => converge::cold_build(&args),
        Bench::Upload(args) => upload::run(&args),
        Bench::BlobUpload(args) => blob_upload::run(&args),
        Bench::Delivery(args) => delivery::run(&args),
        Bench::Trust(args) => trust::run(&args),
        Bench::Farm(args) => farm::farm(&args),
        Bench::Parallel(args) => farm::parallel(&args),
        Bench::Failover(args) => failover::run(&args),
        Bench::Observe(args) => observe::run(&args),
        Bench::StateWrites(args) => state_writes::run(&args),
        Bench::Mirror(args) => mirror::run(&args),
        Bench::Platforms(args) => platforms::run(&args),
    }
}
