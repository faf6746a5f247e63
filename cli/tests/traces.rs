//! Traces across the three processes (issue 12): `kiln-coordinator --dev`, a host `kiln-agent` on
//! the real Docker daemon and `kiln up`, the shipped binaries, each exporting by OTLP/gRPC to a
//! collector stand-in in this test. One converge is one trace: the agent's build span reaches the
//! coordinator's converge span, and that the CLI's command span, by their parent links. Without
//! `OTEL_EXPORTER_OTLP_ENDPOINT` nothing is sent.

use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kiln_e2e::otlp::{Collector, Span};

/// A binary of this workspace, built beside `kiln` by `cargo test --workspace`.
fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_kiln")).with_file_name(name);
    assert!(path.is_file(), "{} is not built — run `cargo test --workspace`", path.display());
    path
}

/// How every process of a test is told to trace: to `endpoint`, in batches sent every 100 ms;
/// `None` leaves tracing off.
fn tracing_env(cmd: &mut Command, endpoint: Option<&str>) {
    for var in ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"] {
        cmd.env_remove(var);
    }
    if let Some(endpoint) = endpoint {
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint).env("OTEL_BSP_SCHEDULE_DELAY", "100");
    }
}

/// A process stopped by its PID: SIGTERM when the test asks, SIGKILL if the test ends first.
struct Process(Child);

impl Process {
    /// SIGTERM, then its exit, which must be clean and come within `within`.
    fn terminate(mut self, within: Duration) {
        let pid = self.0.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success(), "kill -TERM {pid}");
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "process {pid} exited with {status} after SIGTERM");
                return;
            }
            assert!(Instant::now() < deadline, "process {pid} still runs {within:?} after SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A served coordinator (`--dev`, loopback) and a host agent on the real daemon, as processes.
struct Farm {
    url: String,
    coordinator: Process,
    agent: Process,
}

fn farm(tmp: &Path, endpoint: Option<&str>) -> Farm {
    let mut cmd = Command::new(bin("kiln-coordinator"));
    cmd.args(["--dev", "--listen", "127.0.0.1:0", "--farm", &kiln_e2e::fixture::unique("traces")])
        .arg("--state")
        .arg(tmp.join("state"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    tracing_env(&mut cmd, endpoint);
    let mut coordinator = Process(cmd.spawn().unwrap());
    let mut line = String::new();
    BufReader::new(coordinator.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line}")).to_string();
    let url = format!("http://{addr}");
    let mut cmd = Command::new(bin("kiln-agent"));
    cmd.args(["--coordinator", &url, "--id", &kiln_e2e::fixture::unique("traces-host-")])
        .arg("--scratch")
        .arg(tmp.join("scratch"))
        .arg("--state")
        .arg(tmp.join("agent"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    tracing_env(&mut cmd, endpoint);
    let agent = Process(cmd.spawn().unwrap());
    Farm { url, coordinator, agent }
}

impl Farm {
    /// Stops the agent first: a coordinator's graceful stop waits for its open streams.
    fn stop(self) {
        self.agent.terminate(Duration::from_secs(20));
        self.coordinator.terminate(Duration::from_secs(20));
    }
}

/// `kiln up DIR` against the farm, which must converge.
fn up(url: &str, dir: &Path, endpoint: Option<&str>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(["--coordinator", url, "--connect-timeout", "30", "up"]).arg(dir);
    cmd.env_remove("KILN_TOKEN").env("HOME", "/nonexistent").env("NO_COLOR", "1");
    tracing_env(&mut cmd, endpoint);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "kiln up failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A one-image instance `FROM scratch` whose content no earlier run built, so the agent builds.
fn instance(tmp: &Path) -> PathBuf {
    let dir = tmp.join("instance");
    let content = kiln_e2e::fixture::unique("traced ");
    kiln_e2e::sim::write_instance(&dir, &kiln_e2e::fixture::unique("traces"), None, &[("web", &content)]);
    dir
}

/// `span`'s ancestors, nearest first, as far as the received spans link.
fn ancestors<'a>(span: &'a Span, by_id: &HashMap<&str, &'a Span>) -> Vec<&'a Span> {
    let mut chain = Vec::new();
    let mut at = span;
    while let Some(parent) = by_id.get(at.parent.as_str()) {
        assert!(chain.len() < 100, "a parent cycle above {span:?}");
        chain.push(*parent);
        at = parent;
    }
    chain
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_converge_is_one_trace_from_the_cli_through_the_coordinator_into_the_agents_build() {
    let collector = Collector::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = instance(tmp.path());
    let endpoint = collector.endpoint.clone();
    let farm = farm(tmp.path(), Some(&endpoint));
    let url = farm.url.clone();
    // The processes are waited on by blocking calls; the collector serves on this runtime meanwhile.
    tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || {
            up(&url, &dir, Some(&endpoint));
            farm.stop();
        }
    })
    .await
    .unwrap();
    // Each process sent its last batch before it exited.
    let spans = collector.spans();
    kiln_e2e::fixture::remove_built(&dir);

    let services = |trace: &str| -> BTreeSet<&str> {
        spans.iter().filter(|s| s.trace == trace).map(|s| s.service.as_str()).collect()
    };
    let all_three: BTreeSet<&str> = ["kiln", "kiln-agent", "kiln-coordinator"].into();
    let traces: BTreeSet<&str> = spans.iter().map(|s| s.trace.as_str()).collect();
    let spanning: Vec<&str> = traces.iter().copied().filter(|t| services(t) == all_three).collect();
    let names = |service: &str| -> Vec<&str> {
        spans.iter().filter(|s| s.service == service).map(|s| s.name.as_str()).collect()
    };
    assert_eq!(
        spanning.len(),
        1,
        "exactly one trace should span the CLI, the coordinator and the agent; kiln sent {:?}, the coordinator {:?}, the agent {:?}",
        names("kiln"),
        names("kiln-coordinator"),
        names("kiln-agent"),
    );
    let trace = spanning[0];
    let by_id: HashMap<&str, &Span> = spans.iter().filter(|s| s.trace == trace).map(|s| (s.id.as_str(), s)).collect();
    let build = spans
        .iter()
        .find(|s| s.trace == trace && s.service == "kiln-agent" && s.name == "build")
        .unwrap_or_else(|| panic!("no agent build span in the trace: {:?}", by_id.values().collect::<Vec<_>>()));
    let chain = ancestors(build, &by_id);
    let named: Vec<String> = chain.iter().map(|s| format!("{} ({})", s.name, s.service)).collect();
    let converge = chain
        .iter()
        .position(|s| s.service == "kiln-coordinator" && s.name == "converge up")
        .unwrap_or_else(|| panic!("the agent's build does not reach the converge: build ← {}", named.join(" ← ")));
    let root = chain.last().unwrap();
    assert!(
        root.service == "kiln" && root.name == "kiln up" && root.parent.is_empty(),
        "the converge's chain should end at the CLI's `kiln up`: build ← {}",
        named.join(" ← ")
    );
    assert!(chain.len() > converge + 1, "the CLI's span sits above the converge: {}", named.join(" ← "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_otlp_endpoint_nothing_is_exported() {
    let collector = Collector::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = instance(tmp.path());
    let farm = farm(tmp.path(), None);
    let url = farm.url.clone();
    tokio::task::spawn_blocking({
        let dir = dir.clone();
        move || {
            up(&url, &dir, None);
            farm.stop();
        }
    })
    .await
    .unwrap();
    kiln_e2e::fixture::remove_built(&dir);
    assert_eq!(collector.exports(), 0, "spans arrived with tracing off: {:?}", collector.spans());
}
