//! `kiln-bench failover` (issue 10): what a farm on PostgreSQL costs and how fast it recovers.
//!
//! - **Failover time**: two `kiln-coordinator` processes on one PostgreSQL with the default lease
//!   (6 s), a simulated build host following them; the active one is killed with SIGKILL and the
//!   clock runs until the first `kiln up` (the CLI library, given both addresses) succeeds on the
//!   new one. The killed one comes back as the standby, and the next round kills the other.
//! - **No-op `kiln up`** against a served coordinator on PostgreSQL vs the same on SQLite, each
//!   in this process on loopback with a simulated host (so the daemon's listing time, the same
//!   for both, does not hide the state's cost).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiln::{Connect, OutputMode, UpArgs};
use kiln_e2e::postgres::Postgres;
use kiln_e2e::sim::{write_instance, SimHost};

use crate::util::{self, Contestant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Failover rounds (kill -9 → first successful `kiln up`).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Measured no-op runs per backend (the median is reported).
    #[arg(long, default_value_t = 30)]
    runs: usize,
}

const MAX_GOAL_S: f64 = 15.0;
const MEDIAN_GOAL_S: f64 = 8.0;
const NOOP_RATIO_GOAL: f64 = 1.5;

pub fn run(args: &Args) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-failover-")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let postgres = Postgres::start();
    let (pg_ratio, pg_noop, sqlite_noop) = noop(&rt, &postgres, scratch.path(), args.runs)?;
    let takeovers = failovers(&rt, &postgres, scratch.path(), args.rounds)?;

    let secs: Vec<f64> = takeovers.iter().map(Duration::as_secs_f64).collect();
    let max = secs.iter().cloned().fold(0.0, f64::max);
    let median = util::median(&takeovers).as_secs_f64();
    println!("## A farm on PostgreSQL: failover and the state's cost\n");
    println!(
        "Failover: kill -9 of the active coordinator → first successful `kiln up` on the new one, default lease (6 s TTL), {} rounds:",
        args.rounds
    );
    println!("- each: {}", secs.iter().map(|s| format!("{s:.1} s")).collect::<Vec<_>>().join(", "));
    println!(
        "- median {median:.1} s (goal ≤ {MEDIAN_GOAL_S} s) — {}; max {max:.1} s (goal ≤ {MAX_GOAL_S} s) — {}",
        met(median <= MEDIAN_GOAL_S),
        met(max <= MAX_GOAL_S)
    );
    println!(
        "\nNo-op `kiln up` (2 recorded images, simulated host, {} runs): PostgreSQL {} vs SQLite {}: {pg_ratio:.2}× (goal ≤ {NOOP_RATIO_GOAL}×) — {}",
        args.runs,
        util::fmt(pg_noop),
        util::fmt(sqlite_noop),
        met(pg_ratio <= NOOP_RATIO_GOAL)
    );
    Ok(())
}

fn met(yes: bool) -> &'static str {
    if yes {
        "met"
    } else {
        "MISSED"
    }
}

/// No-op `kiln up` on each backend, interleaved; returns (PostgreSQL / SQLite, PG median, SQLite median).
fn noop(
    rt: &tokio::runtime::Runtime,
    postgres: &Postgres,
    scratch: &Path,
    runs: usize,
) -> Result<(f64, Duration, Duration)> {
    let database = rt.block_on(postgres.create_database());
    let pg = rt.block_on(served(scratch.join("pg-data"), Some(database.url.clone())))?;
    let sqlite = rt.block_on(served(scratch.join("sqlite-data"), None))?;
    let dir = scratch.join("noop");
    write_instance(&dir, "noop", None, &[("one", "one v1"), ("two", "two v1")]);
    let up = |url: &str| -> Result<Duration> {
        let started = Instant::now();
        up_once(rt, url, &dir)?;
        Ok(started.elapsed())
    };
    up(&pg.url).context("the first converge on PostgreSQL")?;
    up(&sqlite.url).context("the first converge on SQLite")?;
    let mut contestants = vec![
        Contestant::new("no-op kiln up, PostgreSQL state", || up(&pg.url)),
        Contestant::new("no-op kiln up, SQLite state", || up(&sqlite.url)),
    ];
    util::rounds(&mut contestants, runs, 2, || Ok(()))?;
    util::print_table("No-op `kiln up`: PostgreSQL vs SQLite", &contestants);
    let (p, s) = (contestants[0].median(), contestants[1].median());
    Ok((p.as_secs_f64() / s.as_secs_f64(), p, s))
}

fn up_once(rt: &tokio::runtime::Runtime, url: &str, dir: &Path) -> Result<()> {
    let args = UpArgs {
        dir: dir.to_path_buf(),
        force: false,
        dry_run: false,
        connect: Connect { retry_window: Duration::from_secs(2), ..Connect::remote(url.to_string()) },
        output: OutputMode::Quiet,
    };
    let outcome = rt.block_on(kiln::up(args))?;
    if outcome.outcome != kiln::Outcome::Succeeded {
        bail!("the converge failed: {:?}", outcome.failure);
    }
    Ok(())
}

/// An in-process served coordinator (plaintext, loopback) with one simulated host.
struct Served {
    url: String,
    _stop: tokio::sync::oneshot::Sender<()>,
    _agent: tokio::sync::oneshot::Sender<()>,
}

async fn served(dir: PathBuf, database: Option<String>) -> Result<Served> {
    let listener = kiln_coordinator::listen("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let mut config = kiln_coordinator::Config::new(dir.join("state"), "bench-failover");
    config.database = database;
    config.affinity_wait = Duration::ZERO;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(kiln_coordinator::serve(listener, config, async {
        let _ = stopped.await;
    }));
    let agent = agent(&url, &dir.join("scratch"));
    Ok(Served { url, _stop: stop, _agent: agent })
}

/// A simulated build host behind the real agent loop, following the coordinators `urls`.
fn agent(urls: &str, scratch: &Path) -> tokio::sync::oneshot::Sender<()> {
    let host: Arc<dyn kiln_agent::host::HostStore> = SimHost::new("bench-sim", Duration::from_millis(20));
    let config = kiln_agent::AgentConfig {
        slots: 2,
        ..kiln_agent::AgentConfig::new(urls.to_string(), "bench-sim", scratch.to_path_buf())
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(kiln_agent::run_with(config, host, async {
        let _ = stopped.await;
    }));
    stop
}

/// A `kiln-coordinator` process, killed when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn coordinator(database: &str, port: u16, data: &Path) -> Result<Process> {
    let bin = std::env::current_exe()?.with_file_name("kiln-coordinator");
    if !bin.is_file() {
        bail!("{} is not built — cargo build --release -p kiln-coordinator -p kiln-bench", bin.display());
    }
    let child = Command::new(bin)
        .args(["--dev", "--farm", "bench-failover", "--state", database, "--listen", &format!("127.0.0.1:{port}")])
        .arg("--data-dir")
        .arg(data)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(Process(child))
}

/// `rounds` kills of the active coordinator; each: the time to the first successful `kiln up`.
fn failovers(
    rt: &tokio::runtime::Runtime,
    postgres: &Postgres,
    scratch: &Path,
    rounds: usize,
) -> Result<Vec<Duration>> {
    let database = rt.block_on(postgres.create_database());
    let ports: Vec<u16> =
        (0..2).map(|_| Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())).collect::<Result<_>>()?;
    let urls: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let farm = urls.join(",");
    let data = |i: usize| scratch.join(format!("coordinator-{i}"));
    let mut procs = vec![Some(coordinator(&database.url, ports[0], &data(0))?)];
    // The first one leads before the second starts, so the second stands by.
    std::thread::sleep(Duration::from_secs(1));
    procs.push(Some(coordinator(&database.url, ports[1], &data(1))?));
    let _agent = rt.block_on(async { agent(&farm, &scratch.join("failover-scratch")) });
    let dir = scratch.join("failover");
    write_instance(&dir, "failover", None, &[("one", "one v1")]);
    wait_up(rt, &farm, &dir)?;
    let mut took = Vec::new();
    let mut active = 0;
    for round in 0..rounds {
        // Let the standby settle into standing by before the kill.
        std::thread::sleep(Duration::from_secs(1));
        let killed = Instant::now();
        procs[active] = None;
        wait_up(rt, &farm, &dir).with_context(|| format!("round {round}: no coordinator took over"))?;
        took.push(killed.elapsed());
        eprintln!("  round {round}: {:.1} s", killed.elapsed().as_secs_f64());
        procs[active] = Some(coordinator(&database.url, ports[active], &data(active))?);
        active = 1 - active;
    }
    Ok(took)
}

/// Runs `kiln up` against `farm` until one succeeds (within 60 s).
fn wait_up(rt: &tokio::runtime::Runtime, farm: &str, dir: &Path) -> Result<()> {
    let started = Instant::now();
    loop {
        match up_once(rt, farm, dir) {
            Ok(()) => return Ok(()),
            Err(_) if started.elapsed() < Duration::from_secs(60) => std::thread::sleep(Duration::from_millis(100)),
            Err(err) => return Err(err.context("no `kiln up` succeeded for 60 s; the last one failed")),
        }
    }
}
