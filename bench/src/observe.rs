//! `kiln-bench observe`: what observability costs (issue 12). A no-op `kiln up` — the `kiln`
//! binary, timed as a whole process — against a served coordinator with its metrics listener
//! (`--http`) and a host agent with its own (`--metrics`), all three processes exporting traces by
//! OTLP/gRPC to a collector stand-in on loopback in this process; against the same farm with
//! metrics listeners and tracing off. The coordinators and agents are the shipped binaries
//! (`--dev`, loopback), the agents on the real Docker daemon, with the exporter's defaults (a batch
//! every 5 s) except that the CLI flushes its trace before it exits, as it always does.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kiln_core::manifest::Manifest;
use kiln_e2e::otlp::Collector;

use crate::converge::{built_refs, write_context, write_manifest, Cleanup};
use crate::util::{self, Contestant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Measured runs per contestant (the median is reported). A run takes tens of milliseconds,
    /// and the difference sought is a few: many runs, so the machine's noise averages out.
    #[arg(long, default_value_t = 101)]
    runs: usize,
    /// Files per built image (2 images, 4 KiB each).
    #[arg(long, default_value_t = 200)]
    files: usize,
}

/// The goal: observability adds at most 5 % or 3 ms to a no-op `kiln up` at the median.
const GOAL_RATIO: f64 = 1.05;
const GOAL_MS: f64 = 3.0;

/// A binary built beside this one (`cargo build --release -p kiln-bench -p kiln -p kiln-coordinator -p kiln-agent`).
fn bin(name: &str) -> Result<PathBuf> {
    let path = std::env::current_exe()?.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{} is not built — cargo build --release -p kiln-bench -p kiln -p kiln-coordinator -p kiln-agent",
            path.display()
        );
    }
    Ok(path)
}

/// Where a process sends its traces; `None`: tracing off (the variables removed, not just empty).
fn traced(cmd: &mut Command, endpoint: Option<&str>) {
    for var in ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_BSP_SCHEDULE_DELAY"] {
        cmd.env_remove(var);
    }
    if let Some(endpoint) = endpoint {
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
    }
}

/// A process stopped with SIGTERM (so it flushes its spans), or killed if the bench fails first.
struct Process(Child);

impl Process {
    fn terminate(mut self) -> Result<()> {
        let pid = self.0.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().context("kill -TERM")?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.0.try_wait()?.is_none() {
            if Instant::now() > deadline {
                bail!("process {pid} still runs 20 s after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `kiln-coordinator --dev` and a host `kiln-agent`, observed (metrics listeners, traces to
/// `endpoint`) or not.
struct Served {
    url: String,
    coordinator: Process,
    agent: Process,
    // Kept open: the coordinator's stdout is a pipe, and a closed one would fail its next line.
    _stdout: BufReader<ChildStdout>,
}

impl Served {
    fn start(dir: &Path, farm: &str, endpoint: Option<&str>) -> Result<Served> {
        let mut cmd = Command::new(bin("kiln-coordinator")?);
        cmd.args(["--dev", "--listen", "127.0.0.1:0", "--farm", farm]).arg("--state").arg(dir.join("state"));
        if endpoint.is_some() {
            cmd.args(["--http", "127.0.0.1:0"]);
        }
        traced(&mut cmd, endpoint);
        let mut coordinator = Process(cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn()?);
        let mut stdout = BufReader::new(coordinator.0.stdout.take().context("the coordinator's stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("listening on ") else {
            bail!("kiln-coordinator said {line:?} instead of where it listens");
        };
        let url = format!("http://{addr}");
        let mut cmd = Command::new(bin("kiln-agent")?);
        cmd.args(["--coordinator", &url, "--id", &format!("{farm}-host")])
            .arg("--scratch")
            .arg(dir.join("scratch"))
            .arg("--state")
            .arg(dir.join("agent"));
        if endpoint.is_some() {
            cmd.args(["--metrics", "127.0.0.1:0"]);
        }
        traced(&mut cmd, endpoint);
        let agent = Process(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn()?);
        Ok(Served { url, coordinator, agent, _stdout: stdout })
    }

    /// Agent first: a coordinator's graceful stop waits for its open streams.
    fn stop(self) -> Result<()> {
        self.agent.terminate()?;
        self.coordinator.terminate()
    }
}

pub fn run(args: &Args) -> Result<()> {
    let scratch = util::scratch_dir("kiln-bench-observe-")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let collector = rt.block_on(Collector::start());
    let mut cleanup = Cleanup::default();
    // One instance per farm, of different content: neither farm holds the other's images.
    let instance = |label: &str, seed: u64| -> Result<PathBuf> {
        let dir = scratch.path().join(label).join("instance");
        let names = vec!["a".to_string(), "b".to_string()];
        for (i, name) in names.iter().enumerate() {
            write_context(&dir.join(name), args.files, 4096, seed + i as u64)?;
        }
        write_manifest(&dir, &format!("observe{label}{:08x}", fastrand::u32(..)), &names)?;
        Ok(dir)
    };
    let (on_dir, off_dir) = (instance("on", 0x6f6e)?, instance("off", 0x6f6666)?);
    for dir in [&on_dir, &off_dir] {
        cleanup.refs.extend(built_refs(&Manifest::load(dir)?)?);
    }
    let suffix = format!("{:08x}", fastrand::u32(..));
    let on = Served::start(&scratch.path().join("on"), &format!("observe-on-{suffix}"), Some(&collector.endpoint))?;
    let off = Served::start(&scratch.path().join("off"), &format!("observe-off-{suffix}"), None)?;

    // The user's stat cache lives under the scratch directory, as warm for one farm as the other.
    let up = |url: &str, dir: &Path, endpoint: Option<&str>| -> Result<Duration> {
        let mut cmd = Command::new(bin("kiln")?);
        cmd.args(["--coordinator", url, "--connect-timeout", "30", "up"]).arg(dir);
        cmd.env("HOME", scratch.path()).env("XDG_CACHE_HOME", scratch.path().join("cache")).env_remove("KILN_TOKEN");
        traced(&mut cmd, endpoint);
        util::time_command(cmd.stderr(Stdio::null()))
    };
    let (on_url, off_url, endpoint) = (on.url.clone(), off.url.clone(), collector.endpoint.clone());
    up(&on_url, &on_dir, Some(&endpoint)).context("the first converge, observed")?;
    up(&off_url, &off_dir, None).context("the first converge, unobserved")?;
    let mut contestants = vec![
        Contestant::new("no-op kiln up, metrics + traces on", || up(&on_url, &on_dir, Some(&endpoint))),
        Contestant::new("no-op kiln up, both off", || up(&off_url, &off_dir, None)),
    ];
    util::rounds(&mut contestants, args.runs, 2, || Ok(()))?;
    let (observed, plain) = (contestants[0].median(), contestants[1].median());
    // Both ran in the same round, one after the other: the difference within a round cancels what
    // the machine's load did to that round, which the two medians taken apart do not.
    let mut paired: Vec<f64> = contestants[0]
        .times
        .iter()
        .zip(&contestants[1].times)
        .map(|(on, off)| (on.as_secs_f64() - off.as_secs_f64()) * 1e3)
        .collect();
    paired.sort_by(f64::total_cmp);
    let paired_ms = paired[paired.len() / 2];
    // Stopped before the spans are counted: each flushes what it still buffers on SIGTERM.
    on.stop()?;
    off.stop()?;

    // Every traced `kiln up` must have been one trace through all three processes, or the cost
    // measured is not the cost of tracing.
    let spans = collector.spans();
    let mut traces: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> = Default::default();
    for span in &spans {
        traces.entry(span.trace.as_str()).or_default().insert(span.service.as_str());
    }
    let whole = traces.values().filter(|services| services.len() == 3).count();
    let ups = args.runs + 2 + 1;
    if whole < ups {
        bail!("{ups} traced `kiln up`s made only {whole} traces through kiln, the coordinator and the agent");
    }

    let added_ms = (observed.as_secs_f64() - plain.as_secs_f64()) * 1e3;
    let ratio = observed.as_secs_f64() / plain.as_secs_f64();
    println!("## The cost of observability\n");
    println!(
        "2 built images × {} files × 4 KiB, target `local`; `kiln up` timed as a process; {} runs each, medians; \
         {} spans in {whole} three-process traces received.",
        args.files,
        args.runs,
        spans.len()
    );
    util::print_table("No-op `kiln up`: metrics + traces on vs off", &contestants);
    let met = ratio <= GOAL_RATIO || added_ms <= GOAL_MS;
    println!(
        "\n- added at the median: {added_ms:.1} ms, {:+.1} % (goal ≤ {:.0} % or ≤ {GOAL_MS} ms) — {}",
        (ratio - 1.0) * 100.0,
        (GOAL_RATIO - 1.0) * 100.0,
        if met { "met" } else { "MISSED" }
    );
    println!("- median of the per-round differences (on − off, same round): {paired_ms:.1} ms");
    drop(cleanup);
    Ok(())
}
