//! `kiln-bench farm` and `kiln-bench parallel` (issue 9): the scheduler under a farm's load, with
//! simulated build hosts (`kiln_e2e::sim`) over real gRPC to a real coordinator on loopback — this
//! machine has one Docker daemon, a farm has a thousand.
//!
//! - `farm`: N simulated agents connected and heartbeating; M concurrent converges of K images,
//!   each build taking a set time. Measured: the latency of a no-op `Up` under that load, task
//!   dispatch latency (queued → the build starting on its agent), converges per second, the
//!   builds' makespan against the ideal (total build time / total slots), the process's peak RSS
//!   and CPU time (coordinator and every simulated agent together: an upper bound).
//! - `parallel`: one converge of 20 images on 4 agents × 1 slot, against the same converge on one
//!   agent × 1 slot — the one-host-sequential schedule the coordinator had before.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiln_e2e::sim::{write_instance, SimFarm};
use kiln_e2e::wire;

use crate::util::{self, Contestant};

#[derive(Debug, clap::Args)]
pub struct FarmArgs {
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    #[arg(long, default_value_t = 1)]
    slots: u32,
    #[arg(long, default_value_t = 200)]
    converges: usize,
    #[arg(long, default_value_t = 5)]
    images: usize,
    #[arg(long, default_value_t = 200)]
    build_ms: u64,
    /// Keep the coordinator's state on a throwaway PostgreSQL cluster instead of SQLite.
    #[arg(long)]
    postgres: bool,
    /// Run the coordinator as its own process (`kiln-coordinator` beside this binary; SQLite state,
    /// or the throwaway PostgreSQL with `--postgres`), at a nice level 10 below this process's: run the bench under `nice -n 10` and the
    /// coordinator gets the CPU it would have on a machine of its own, while the simulated agents
    /// and clients share what is left. Dispatch latency is then not measured (its queue times live
    /// in the coordinator's process).
    #[arg(long)]
    external: bool,
    /// Simulated agents keep no contexts (`kiln-agent --context-cache 0`): every build of the
    /// measured round downloads and verifies its context again, as a farm rebuilding contexts
    /// its agents have not seen would. By default they keep what they built in the untimed round.
    #[arg(long)]
    cold_contexts: bool,
}

#[derive(Debug, clap::Args)]
pub struct ParallelArgs {
    #[arg(long, default_value_t = 20)]
    images: usize,
    #[arg(long, default_value_t = 4)]
    agents: usize,
    #[arg(long, default_value_t = 500)]
    build_ms: u64,
    /// Measured runs per contestant (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

const UP_P99_GOAL_MS: f64 = 50.0;
const DISPATCH_P99_GOAL_MS: f64 = 20.0;
const MAKESPAN_GOAL: f64 = 1.15;
const SPEEDUP_GOAL: f64 = 3.5;

fn instance_images(n: usize, salt: &str) -> Vec<(String, String)> {
    (0..n).map(|i| (format!("img{i}"), format!("{salt} {i}"))).collect()
}

fn write(dir: &Path, instance: &str, images: &[(String, String)]) {
    let refs: Vec<(&str, &str)> = images.iter().map(|(n, c)| (n.as_str(), c.as_str())).collect();
    write_instance(dir, instance, Some(&format!("team-{instance}")), &refs);
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    util::percentile(sorted, p).unwrap_or(f64::NAN)
}

/// Peak RSS (MiB) and user+system CPU seconds of this process.
fn rss_and_cpu() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1));
    let rss = hwm.and_then(|kb| kb.parse::<f64>().ok()).unwrap_or(0.0) / 1024.0;
    (rss, cpu_seconds("self"))
}

/// This process's nice level.
fn own_nice() -> i32 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // After the command's `)`: state is field 0, nice is field 16.
    let nice = stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().nth(16).map(str::to_owned));
    nice.and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// User + system CPU seconds of process `pid` (`self`: this one) so far.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // After the command's `)`: state is field 0, utime 11, stime 12; 100 ticks per second.
    (ticks(11) + ticks(12)) / 100.0
}

pub fn farm(args: &FarmArgs) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-farm-")?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let build = Duration::from_millis(args.build_ms);
    eprintln!("starting a coordinator and {} simulated agents …", args.agents);
    let started = Instant::now();
    // Durable (fsync on, as SQLite's state is), and with `--external` at the coordinator's
    // priority: a farm's database has a machine of its own too. Backends inherit the postmaster's.
    let postgres = args.postgres.then(kiln_e2e::postgres::Postgres::start_durable);
    if let (Some(pg), true) = (&postgres, args.external) {
        // `renice -n` sets the level, not a step: the coordinator's is this process's less ten
        // (`External::start`), so PostgreSQL's is computed the same way. (Until 2026-12-07 it was
        // set to -10, ten levels above the coordinator under `nice -n 10`, and the database's
        // burst starved the coordinator and, twenty levels down, the agents and the probe.)
        let level = (own_nice() - 10).to_string();
        std::process::Command::new("renice").args(["-n", &level, "-p", &pg.pid().to_string()]).status()?;
    }
    let database = postgres.as_ref().map(|pg| rt.block_on(pg.create_database()).url);
    let external = args.external.then(|| External::start(scratch.path(), database.as_deref())).transpose()?;
    let cold = args.cold_contexts;
    let agent = move |config: &mut kiln_agent::AgentConfig| {
        if cold {
            config.context_cache = 0;
        }
    };
    let farm = match &external {
        Some(coordinator) => rt.block_on(SimFarm::join_with(&coordinator.url, args.agents, args.slots, build, agent)),
        None => {
            rt.block_on(SimFarm::start_with(args.agents, args.slots, build, |config| config.database = database, agent))
        }
    };
    eprintln!(
        "  connected in {} ({} state{})",
        util::fmt(started.elapsed()),
        if args.postgres { "PostgreSQL" } else { "SQLite" },
        if args.external { ", coordinator in its own process" } else { "" }
    );

    // The probe: a recorded instance whose no-op converge is timed while the load runs.
    let probe = scratch.path().join("probe");
    write(&probe, "probe", &instance_images(2, "probe"));
    // The clients are the developers' CLIs, on machines of their own in a farm: here they get a
    // runtime apart from the coordinator's and the simulated agents', and the probe one of its own,
    // so a client's work never holds up an agent's answer or the probe's own round trip.
    let clients = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let cli = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (probe_request, probe_contexts) = wire::up_request(&probe, false);
    let first = cli.block_on(wire::up_prepared(&farm.url, probe_request.clone(), &probe_contexts));
    if !wire::succeeded(&first) {
        bail!("the probe's first converge failed: {first:#?}");
    }
    // Each client's walk and hashing is done before the clock starts: it happens on the
    // developer's machine, and the measured round is the coordinator's.
    let prepared: Vec<Prepared> = (0..args.converges)
        .map(|i| {
            let dir = scratch.path().join(format!("c{i:04}"));
            write(&dir, &format!("load{i:04}"), &instance_images(args.images, &format!("load {i}")));
            let (request, contexts) = wire::up_request(&dir, false);
            Prepared { dir, request, contexts: std::sync::Arc::new(contexts) }
        })
        .collect();
    // Every context uploaded once first, with builds instant: the measured round is the
    // scheduler's, not the upload path's (`kiln-bench upload` measures that). It rebuilds
    // everything (`--force`), so every image is a build task again.
    for agent in &farm.agents {
        agent.store.set_build_time(Duration::ZERO);
    }
    clients.block_on(run_all(&farm.url, &prepared, false))?;
    for agent in &farm.agents {
        agent.store.set_build_time(build);
    }
    let before_builds = farm.builds().len();
    // With `KILN_BENCH_METRICS=FILE`, the page before the load too (`FILE.before`): the load's
    // own state calls are the difference.
    if let (Some(c), Some(out)) = (&external, std::env::var_os("KILN_BENCH_METRICS")) {
        let mut before = std::path::PathBuf::from(out).into_os_string();
        before.push(".before");
        std::fs::write(before, c.metrics_page()?)?;
    }
    let (_, cpu_before) = rss_and_cpu();
    let coordinator_before = external.as_ref().map_or(0.0, External::cpu_seconds);
    // `KILN_BENCH_PERF=FILE`: a `perf record` of the coordinator over the load alone.
    let perf = match (&external, std::env::var_os("KILN_BENCH_PERF")) {
        (Some(c), Some(out)) => Some(
            std::process::Command::new("perf")
                .args(["record", "-F", "1999", "-g", "-p", &c.child.id().to_string(), "-o"])
                .arg(out)
                .stderr(std::process::Stdio::null())
                .spawn()?,
        ),
        _ => None,
    };

    let load_started = Instant::now();
    let url = farm.url.clone();
    let load = clients.spawn({
        let prepared = prepared.clone();
        async move { run_all(&url, &prepared, true).await }
    });
    let mut up_ms: Vec<f64> = Vec::new();
    while !load.is_finished() {
        let t = Instant::now();
        let events = cli.block_on(wire::up_prepared(&farm.url, probe_request.clone(), &probe_contexts));
        if !wire::succeeded(&events) {
            bail!("a no-op converge under load failed: {events:#?}");
        }
        up_ms.push(t.elapsed().as_secs_f64() * 1e3);
        eprintln!(
            "  no-op up {:.1} ms at {:.2} s into the load",
            up_ms[up_ms.len() - 1],
            load_started.elapsed().as_secs_f64()
        );
        if up_ms[up_ms.len() - 1] > UP_P99_GOAL_MS {
            let start = events.first().map_or(0, |e| e.at_ms);
            for e in &events {
                eprintln!("    +{} ms {:?} {} {}", e.at_ms - start, e.kind(), e.image, e.message);
            }
        }
    }
    clients.block_on(load)??;
    if let Some(mut perf) = perf {
        let _ = std::process::Command::new("kill").args(["-INT", &perf.id().to_string()]).status();
        let _ = perf.wait();
    }
    let load_secs = load_started.elapsed().as_secs_f64();
    // `KILN_BENCH_METRICS=FILE`: the coordinator's `/metrics` after the load — its state calls'
    // durations by method say where a converge waited.
    if let (Some(c), Some(out)) = (&external, std::env::var_os("KILN_BENCH_METRICS")) {
        std::fs::write(&out, c.metrics_page()?)?;
    }
    let (rss, cpu_after) = rss_and_cpu();
    let coordinator_cpu = external.as_ref().map(|c| (c.cpu_seconds() - coordinator_before, c.cpu_seconds()));

    let builds: Vec<_> = farm.builds().into_iter().skip(before_builds).collect();
    let expected = args.converges * args.images;
    if builds.len() != expected {
        let mut seen = std::collections::HashMap::<&str, Vec<&str>>::new();
        for (agent, b) in &builds {
            seen.entry(b.tag.as_str()).or_default().push(agent.as_str());
        }
        let twice: Vec<_> = seen.iter().filter(|(_, a)| a.len() > 1).take(5).collect();
        bail!("{} builds ran under load, {expected} expected; built more than once: {twice:?}", builds.len());
    }
    // Builds per agent: a line of builds behind one warm agent shows here as a makespan of
    // several builds.
    let busiest = {
        let mut per_agent = std::collections::HashMap::<&str, usize>::new();
        for (agent, _) in &builds {
            *per_agent.entry(agent.as_str()).or_default() += 1;
        }
        (per_agent.values().copied().max().unwrap_or(0), per_agent.len())
    };
    let first_start = builds.iter().map(|(_, b)| b.started).min().unwrap();
    let last_end = builds.iter().filter_map(|(_, b)| b.finished).max().unwrap();
    let makespan = (last_end - first_start).as_secs_f64();
    let total_slots = args.agents as f64 * f64::from(args.slots);
    let ideal = (expected as f64 * build.as_secs_f64() / total_slots).max(build.as_secs_f64());
    // Dispatch: from a build task joining the queue to its build starting on its agent.
    let queued: std::collections::HashMap<String, (u64, u64)> = kiln_coordinator::metrics::dispatches()
        .into_iter()
        .map(|d| (d.reference, (d.enqueued_us, d.granted_us)))
        .collect();
    let mut dispatch_ms: Vec<f64> = Vec::new();
    let mut decide_ms: Vec<f64> = Vec::new();
    let mut enqueued: Vec<u64> = Vec::new();
    for (_, b) in &builds {
        if let Some((enq, granted)) = queued.get(&b.tag) {
            dispatch_ms.push(b.started_us.saturating_sub(*enq) as f64 / 1e3);
            decide_ms.push(granted.saturating_sub(*enq) as f64 / 1e3);
            enqueued.push(*enq);
        }
    }
    let spread = (enqueued.iter().max().unwrap_or(&0) - enqueued.iter().min().unwrap_or(&0)) as f64 / 1e6;
    for v in [&mut up_ms, &mut dispatch_ms, &mut decide_ms] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    let last_enqueue_to_end = {
        let last = *enqueued.iter().max().unwrap_or(&0);
        let end_us = builds.iter().map(|(_, b)| b.started_us).max().unwrap_or(0) + build.as_micros() as u64;
        end_us.saturating_sub(last) as f64 / 1e6
    };

    println!("## The farm under load (simulated agents)\n");
    println!(
        "{} simulated agents × {} slot(s) connected and heartbeating to one coordinator on loopback; {} concurrent converges × {} images (contexts uploaded beforehand; every image rebuilt with `--force`{}), simulated builds of {} ms.\n",
        args.agents,
        args.slots,
        args.converges,
        args.images,
        if cold { ", agents keeping no contexts" } else { ", agents holding the contexts they built before" },
        args.build_ms
    );
    println!("| measure | value | goal |\n|---|---|---|");
    println!(
        "| no-op `Up` under load, p50 / p99 ({} samples) | {:.1} / {:.1} ms | p99 ≤ {UP_P99_GOAL_MS} ms |",
        up_ms.len(),
        percentile(&up_ms, 0.5),
        percentile(&up_ms, 0.99)
    );
    if external.is_none() {
        println!(
            "| dispatch: queued → build starts on its agent, p50 / p99 | {:.1} / {:.1} ms | p99 ≤ {DISPATCH_P99_GOAL_MS} ms |",
            percentile(&dispatch_ms, 0.5),
            percentile(&dispatch_ms, 0.99)
        );
        println!(
            "| of which the queue's decision (queued → slot granted), p50 / p99 | {:.2} / {:.2} ms | |",
            percentile(&decide_ms, 0.5),
            percentile(&decide_ms, 0.99)
        );
    }
    println!("| converges/s | {:.1} | |", args.converges as f64 / load_secs);
    println!(
        "| builds' makespan (first build start → last build end) vs ideal {ideal:.3} s | {makespan:.3} s = {:.2}× | ≤ {MAKESPAN_GOAL}× |",
        makespan / ideal
    );
    if external.is_none() {
        println!("| build tasks joining the queue: first → last (the converges' own arrival) | {spread:.3} s | |");
        println!(
            "| last task queued → last build ends | {last_enqueue_to_end:.3} s (one build is {:.3} s) | |",
            build.as_secs_f64()
        );
    }
    println!("| builds on the busiest agent (agents that built) | {} ({}) | |", busiest.0, busiest.1);
    println!("| process peak RSS (coordinator + {} simulated agents) | {rss:.0} MiB | |", args.agents);
    println!(
        "| process CPU during the load (coordinator + agents) | {:.1} s over {load_secs:.1} s | |",
        cpu_after - cpu_before
    );
    if let Some((load, whole)) = coordinator_cpu {
        println!("| the coordinator process's CPU during the load / whole run | {load:.2} s over {load_secs:.1} s / {whole:.1} s | |");
    }
    rt.block_on(farm.stop());
    Ok(())
}

/// `kiln-coordinator --dev` on a free loopback port, SQLite state under `dir`, stopped when dropped.
struct External {
    child: std::process::Child,
    url: String,
    /// `--http`: its `/metrics`, read after the load with `KILN_BENCH_METRICS=FILE`.
    http: std::net::SocketAddr,
}

impl External {
    fn start(dir: &Path, database: Option<&str>) -> Result<External> {
        let binary = std::env::current_exe()?.with_file_name("kiln-coordinator");
        if !binary.is_file() {
            bail!("{} is not built — cargo build --release -p kiln-coordinator", binary.display());
        }
        let addr = kiln_e2e::free_addr();
        let http = kiln_e2e::free_addr();
        // Ten nice levels above this process's: the bench runs under `nice -n 10`.
        let mut command = std::process::Command::new("nice");
        command.args(["-n", "-10"]).arg(&binary).args([
            "--dev",
            "--farm",
            "bench",
            "--listen",
            &addr.to_string(),
            "--http",
            &http.to_string(),
        ]);
        match database {
            Some(url) => command.args(["--state", url]).arg("--data-dir").arg(dir.join("coordinator-data")),
            None => command.arg("--state").arg(dir.join("coordinator")),
        };
        let child = command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        Ok(External { child, url: format!("http://{addr}"), http })
    }

    /// The coordinator's `/metrics` page now.
    fn metrics_page(&self) -> Result<Vec<u8>> {
        let page =
            std::process::Command::new("curl").args(["-fsS", &format!("http://{}/metrics", self.http)]).output()?;
        Ok(page.stdout)
    }

    /// User + system CPU seconds of the coordinator so far.
    fn cpu_seconds(&self) -> f64 {
        cpu_seconds(&self.child.id().to_string())
    }
}

impl Drop for External {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One load converge's request, made before the clock starts.
#[derive(Clone)]
struct Prepared {
    dir: std::path::PathBuf,
    request: kiln_proto::v1::UpRequest,
    contexts: std::sync::Arc<wire::Contexts>,
}

/// Runs every instance's converge at once; fails if any fails.
async fn run_all(url: &str, prepared: &[Prepared], force: bool) -> Result<()> {
    let mut running = tokio::task::JoinSet::new();
    for p in prepared {
        let (url, p) = (url.to_string(), p.clone());
        running.spawn(async move {
            let request = kiln_proto::v1::UpRequest { force, ..p.request };
            (p.dir, wire::up_prepared(&url, request, &p.contexts).await)
        });
    }
    while let Some(joined) = running.join_next().await {
        let (dir, events) = joined.context("a converge panicked")?;
        for e in events.iter().filter(|e| {
            matches!(
                e.kind(),
                kiln_proto::v1::converge_event::Kind::Requeued | kiln_proto::v1::converge_event::Kind::Note
            )
        }) {
            eprintln!("  {}: {} {}", dir.display(), e.image, e.message);
        }
        if !wire::succeeded(&events) {
            bail!("the converge of {} failed: {:?}", dir.display(), events.last());
        }
    }
    Ok(())
}

pub fn parallel(args: &ParallelArgs) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-parallel-")?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let build = Duration::from_millis(args.build_ms);
    let run = std::cell::Cell::new(0u32);
    let converge = |agents: usize| -> Result<Duration> {
        run.set(run.get() + 1);
        let farm = rt.block_on(SimFarm::start(agents, 1, build, |_| {}));
        let dir = scratch.path().join(format!("run{}", run.get()));
        write(&dir, &format!("par{}", run.get()), &instance_images(args.images, &format!("run {}", run.get())));
        let started = Instant::now();
        let events = rt.block_on(wire::up(&farm.url, &dir, false));
        let took = started.elapsed();
        if !wire::succeeded(&events) {
            bail!("the converge failed: {:?}", events.last());
        }
        rt.block_on(farm.stop());
        Ok(took)
    };
    let mut contestants = vec![
        Contestant::new(format!("{} agents × 1 slot, in parallel", args.agents), || converge(args.agents)),
        Contestant::new("1 agent × 1 slot (one host, sequential)", || converge(1)),
    ];
    util::rounds(&mut contestants, args.runs, 0, || Ok(()))?;
    let speedup = contestants[1].median().as_secs_f64() / contestants[0].median().as_secs_f64();
    println!("## Parallel placement (simulated agents)\n");
    println!(
        "One converge of {} images (simulated builds of {} ms, contexts uploaded in the run); {} runs each, medians.",
        args.images, args.build_ms, args.runs
    );
    util::print_table("A 20-image converge", &contestants);
    println!("\n- speed-up of parallel placement: {speedup:.2}× (goal ≥ {SPEEDUP_GOAL}×)");
    Ok(())
}
