//! Multi-platform builds: a two-platform (`linux/amd64` + `linux/arm64`) `FROM scratch` image of
//! `--mb` MB converged to a local registry by a farm of two host agents, one announcing amd64 and
//! one arm64 (both on this machine's daemon) — one build task per platform, each pushed, then the
//! index — vs the two single-platform converges of the same context, one after the other, on the
//! same farm (each on the agent of its platform). Both go through the real coordinator, agents,
//! Docker daemon and registry (`kiln-e2e`'s farm); both sides start each run from a changed
//! marker file, so every run builds and pushes anew (the big file is uploaded once, for both).
//! Goal: the two-platform converge ≤ 0.65× the two single ones.

use crate::util::{self, Contestant};
use anyhow::{bail, Result};
use kiln_e2e::wire::{succeeded, up};
use kiln_e2e::{Farm, Registry};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Size of the image's one big file, in MB.
    #[arg(long, default_value_t = 200)]
    mb: usize,
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// An instance folder building `app` for `platforms` into `registry`, its context holding `big`.
fn instance(root: &Path, name: &str, platforms: &[&str], registry: &str, big: &Path) -> Result<PathBuf> {
    let dir = root.join(name);
    std::fs::create_dir_all(dir.join("app"))?;
    let list = platforms.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", ");
    let toml = format!(
        "instance = \"{name}\"\nplatforms = [{list}]\n\n[target]\nkind = \"registry\"\nregistry = \"{registry}\"\n\n\
         [built.app]\ncontext = \"app\"\n"
    );
    std::fs::write(dir.join("kiln.toml"), toml)?;
    std::fs::write(dir.join("app/Dockerfile"), "FROM scratch\nCOPY . /data/\n")?;
    std::fs::hard_link(big, dir.join("app/payload"))?;
    Ok(dir)
}

/// One converge of `dir` after changing its marker: every run builds and pushes anew.
async fn converge(url: &str, dir: &Path) -> Result<Duration> {
    std::fs::write(dir.join("app/marker"), format!("{:016x}", fastrand::u64(..)))?;
    let started = Instant::now();
    let events = up(url, dir, false).await;
    let took = started.elapsed();
    if !succeeded(&events) {
        bail!("kiln up {} failed: {:?}", dir.display(), events.last());
    }
    Ok(took)
}

pub fn run(args: &Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let scratch = util::scratch_dir("kiln-bench-platforms")?;
    let registry = Registry::start();
    let big = scratch.path().join("payload");
    let mut content = vec![0u8; args.mb << 20];
    fastrand::fill(&mut content);
    std::fs::write(&big, &content)?;
    drop(content);

    let mut farm = rt.block_on(Farm::start(&scratch.path().join("home")));
    // The second agent announces arm64: the farm of an amd64 and an arm64 build host (on this
    // one daemon, which builds a RUN-less arm64 image natively enough).
    rt.block_on(farm.start_host("bench-arm64-host", &["linux/arm64"]));
    let root = scratch.path();
    let both = instance(root, "mp-both", &["linux/amd64", "linux/arm64"], &registry.addr, &big)?;
    let amd = instance(root, "mp-amd64", &["linux/amd64"], &registry.addr, &big)?;
    let arm = instance(root, "mp-arm64", &["linux/arm64"], &registry.addr, &big)?;
    let url = farm.url.clone();
    let mut contestants = [
        Contestant::new(format!("kiln up, 2 platforms × {} MB, 2 agents", args.mb), || {
            rt.block_on(converge(&url, &both))
        }),
        Contestant::new(format!("kiln up amd64, then arm64 ({} MB)", args.mb), || {
            Ok(rt.block_on(converge(&url, &amd))? + rt.block_on(converge(&url, &arm))?)
        }),
    ];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    util::print_table("a two-platform FROM scratch image converged to a local registry", &contestants);
    let ratio = contestants[0].median().as_secs_f64() / contestants[1].median().as_secs_f64().max(1e-9);
    let met = if ratio <= 0.65 { "met" } else { "MISSED" };
    println!("- two-platform converge / two single-platform converges: {ratio:.2}× (goal ≤ 0.65×) — {met}");
    drop(contestants);
    rt.block_on(farm.stop());
    Ok(())
}
