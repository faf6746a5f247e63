//! An agent told to stop — SIGTERM, what systemd and the kubelet send — as real processes: the
//! shipped `kiln-coordinator` (plaintext, SQLite), `kiln-agent` on the real Docker daemon and
//! `kiln up`. The agent says `GoingAway`, takes no new task, finishes the build it runs and then
//! exits; one whose drain grace runs out hands the build back, and another agent builds it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kiln_e2e::docker;
use kiln_e2e::fixture::{reference, unique, write};
use kiln_e2e::process::Proc;
use kiln_proto::v1 as pb;

/// A binary of this workspace, built beside `kiln` by `cargo test --workspace`.
fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_kiln")).with_file_name(name);
    assert!(path.is_file(), "{} is not built — run `cargo test --workspace`", path.display());
    path
}

/// A served coordinator on a free loopback port; its URL.
fn coordinator(home: &Path) -> (Proc, String) {
    let addr = kiln_e2e::free_addr();
    let mut cmd = Command::new(bin("kiln-coordinator"));
    cmd.args(["--dev", "--farm", "drain", "--affinity-wait", "0", "--listen", &addr.to_string()]);
    cmd.arg("--state").arg(home.join("state"));
    (Proc::spawn("kiln-coordinator", cmd), format!("http://{addr}"))
}

/// A host agent `id` on the local Docker daemon; where its gRPC health service listens.
fn agent(url: &str, id: &str, home: &Path, grace: &str) -> (Proc, String) {
    let health = kiln_e2e::free_addr();
    let mut cmd = Command::new(bin("kiln-agent"));
    cmd.args(["--coordinator", url, "--id", id, "--slots", "1", "--drain-grace", grace]);
    cmd.arg("--scratch").arg(home.join(id)).arg("--health").arg(health.to_string());
    (Proc::spawn(id, cmd), format!("http://{health}"))
}

/// What the agent's health service says of `service` (`""`: the process; `kiln.v1.AgentHub`:
/// connected and taking work); `None` when nothing answers.
async fn health(url: &str, service: &str) -> Option<bool> {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};
    let channel = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await.ok()?;
    let reply = HealthClient::new(channel).check(HealthCheckRequest { service: service.into() }).await.ok()?;
    Some(reply.into_inner().status == ServingStatus::Serving as i32)
}

async fn until_health(url: &str, service: &str, want: bool, within: Duration) {
    let started = Instant::now();
    while health(url, service).await != Some(want) {
        assert!(started.elapsed() < within, "{url} {service:?} did not turn {want} within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the coordinator shows `reference` building on `agent`.
async fn until_building_on(url: &str, reference: &str, agent: &str, within: Duration) {
    let started = Instant::now();
    loop {
        if let Ok(channel) = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await {
            let mut client = pb::kiln_client::KilnClient::new(channel);
            if let Ok(reply) = client.ps(pb::PsRequest::default()).await {
                let tasks = reply.into_inner().converges.into_iter().flat_map(|c| c.tasks);
                if tasks.into_iter().any(|t| t.reference == reference && t.state == "building" && t.agent == agent) {
                    return;
                }
            }
        }
        assert!(started.elapsed() < within, "{reference} did not start building on {agent} within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An instance of one image whose build runs `seconds` (a `RUN sleep` on the busybox base).
fn slow_instance(dir: &Path, seconds: u32) {
    let instance = unique("drain");
    let manifest = format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.slow]\ncontext = \"slow\"\n");
    write(dir, "kiln.toml", &manifest);
    // The instance's name in the step keeps the build from Docker's cache: it really runs.
    let dockerfile = format!("FROM {}\nRUN echo {instance} && sleep {seconds}\n", docker::busybox_base());
    write(dir, "slow/Dockerfile", &dockerfile);
}

/// `kiln up` in `dir` against `url`, running in the background.
fn up(url: &str, dir: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["--coordinator", url, "--connect-timeout", "30", "up"])
        .current_dir(dir)
        .env_remove("KILN_TOKEN")
        .env("HOME", "/nonexistent")
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn finished(child: std::process::Child) -> (bool, String) {
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_told_to_stop_finishes_its_build_and_then_exits() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("inst");
    slow_instance(&dir, 4);
    let building = reference(&dir, "slow");
    let (_coordinator, url) = coordinator(home.path());
    let (mut a, a_health) = agent(&url, "drain-a", home.path(), "60s");
    until_health(&a_health, "kiln.v1.AgentHub", true, Duration::from_secs(30)).await;

    let converge = up(&url, &dir);
    until_building_on(&url, &building, "drain-a", Duration::from_secs(60)).await;
    a.signal("-TERM");
    // Draining: alive, but no longer taking work.
    until_health(&a_health, "kiln.v1.AgentHub", false, Duration::from_secs(5)).await;
    assert_eq!(health(&a_health, "").await, Some(true), "a draining agent is still alive");
    assert!(a.running(), "the agent waits for its build instead of exiting at once");

    let (ok, out) = finished(converge);
    assert!(ok, "the build the agent was running finished and the converge succeeded:\n{out}");
    assert!(!out.contains("queued again"), "nothing was handed back:\n{out}");
    assert!(docker::image_id(&building).is_some(), "{building} was built");
    let (status, stderr) = a.exit(Duration::from_secs(10)).expect("the agent exits once its build is done");
    assert!(status.success(), "a drained agent exits cleanly: {status}\n{stderr}");
    assert!(stderr.contains("drained"), "{stderr}");
    docker::remove(&building);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_drain_grace_runs_out_hands_its_build_to_another_agent() {
    let home = tempfile::tempdir().unwrap();
    let dir = home.path().join("inst");
    slow_instance(&dir, 8);
    let building = reference(&dir, "slow");
    let (_coordinator, url) = coordinator(home.path());
    let (mut a, a_health) = agent(&url, "drain-a", home.path(), "1s");
    until_health(&a_health, "kiln.v1.AgentHub", true, Duration::from_secs(30)).await;

    let converge = up(&url, &dir);
    until_building_on(&url, &building, "drain-a", Duration::from_secs(60)).await;
    let (_b, b_health) = agent(&url, "drain-b", home.path(), "1s");
    until_health(&b_health, "kiln.v1.AgentHub", true, Duration::from_secs(30)).await;
    a.signal("-TERM");
    let (status, stderr) = a.exit(Duration::from_secs(10)).expect("the agent exits when its grace runs out");
    assert!(status.success(), "{status}\n{stderr}");
    assert!(stderr.contains("handing back"), "{stderr}");

    let (ok, out) = finished(converge);
    assert!(ok, "another agent built what the stopped one handed back:\n{out}");
    assert!(out.contains("queued again"), "the build was queued again:\n{out}");
    assert!(docker::image_id(&building).is_some(), "{building} was built");
    docker::remove(&building);
}
