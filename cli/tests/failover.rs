//! A farm of two coordinators on one real PostgreSQL (DESIGN.md "High availability"), as real
//! processes: the active one killed with SIGKILL mid-converge, or frozen with SIGSTOP past its
//! lease. The build host is a simulated one (`kiln_e2e::sim`) behind the real agent loop, so a
//! build can be held in progress for as long as the test needs; everything else is the shipped
//! binaries over real gRPC.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_coordinator::model::{ConvergeState, TokenRow};
use kiln_coordinator::state::{PostgresStore, StateStore};
use kiln_e2e::postgres::Postgres;
use kiln_e2e::process::Proc;
use kiln_e2e::sim::{write_instance, SimHost};

/// A binary of this workspace, built beside `kiln` by `cargo test --workspace`.
fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_kiln")).with_file_name(name);
    assert!(path.is_file(), "{} is not built — run `cargo test --workspace`", path.display());
    path
}

/// The longest a standby may take to lead after the active coordinator dies (the bound).
const TAKEOVER: Duration = Duration::from_secs(15);

/// A `kiln-coordinator` process on a free loopback port, stopped by its PID when dropped.
struct Coordinator {
    proc: Proc,
    url: String,
    /// Its plain-HTTP listener (`--http`): `/readyz` for the kubelet.
    http: String,
    _data: tempfile::TempDir,
}

impl Coordinator {
    /// Serves the farm in `database` with a lease of `ttl`; returns at once (it may stand by).
    fn start(database: &str, ttl: &str) -> Coordinator {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
        let data = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(bin("kiln-coordinator"));
        cmd.args(["--dev", "--farm", "failover", "--lease-ttl", ttl, "--affinity-wait", "0"])
            .args(["--state", database, "--data-dir", data.path().to_str().unwrap()])
            .args(["--listen", &format!("127.0.0.1:{port}"), "--http", &http]);
        let proc = Proc::spawn("kiln-coordinator", cmd);
        Coordinator { proc, url: format!("http://127.0.0.1:{port}"), http, _data: data }
    }

    /// The status line's code of `GET /readyz` (what the kubelet's readiness probe asks).
    fn ready(&self) -> u16 {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(&self.http).unwrap();
        stream.write_all(b"GET /readyz HTTP/1.0\r\nHost: kiln\r\n\r\n").unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        reply.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
    }

    fn signal(&self, signal: &str) {
        self.proc.signal(signal);
    }

    /// Its exit status and everything it wrote to stderr, once it exits (within `within`).
    fn exit(&mut self, within: Duration) -> Option<(std::process::ExitStatus, String)> {
        self.proc.exit(within)
    }
}

/// What the coordinator at `url` says of itself on the standard gRPC health service.
async fn serving(url: &str) -> Option<bool> {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};
    let channel = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await.ok()?;
    let reply = HealthClient::new(channel).check(HealthCheckRequest { service: "kiln.v1.Kiln".into() }).await.ok()?;
    Some(reply.into_inner().status == ServingStatus::Serving as i32)
}

/// Waits until the coordinator at `url` serves; how long that took.
async fn until_serving(url: &str, within: Duration) -> Duration {
    let started = Instant::now();
    while serving(url).await != Some(true) {
        assert!(started.elapsed() < within, "{url} did not become the active coordinator within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

/// A simulated build host running the real agent loop against the farm's coordinators `urls`.
fn agent(urls: &str, scratch: &Path) -> (Arc<SimHost>, tokio::sync::oneshot::Sender<()>) {
    let host = SimHost::new("sim-failover", Duration::from_millis(50));
    let config = kiln_agent::AgentConfig {
        slots: 4,
        ..kiln_agent::AgentConfig::new(urls.to_string(), "sim-failover", scratch.to_path_buf())
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let store: Arc<dyn kiln_agent::host::HostStore> = host.clone();
    tokio::spawn(async move {
        let _ = kiln_agent::run_with(config, store, async {
            let _ = stopped.await;
        })
        .await;
    });
    (host, stop)
}

/// Waits until the coordinator at `url` lists the agent as connected.
async fn until_agent_connected(url: &str, within: Duration) {
    let started = Instant::now();
    loop {
        let channel = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await;
        if let Ok(channel) = channel {
            let mut client = kiln_proto::v1::kiln_client::KilnClient::new(channel);
            if let Ok(reply) = client.agents(kiln_proto::v1::AgentsRequest {}).await {
                if reply.into_inner().agents.iter().any(|a| a.connected) {
                    return;
                }
            }
        }
        assert!(started.elapsed() < within, "the agent did not connect to {url} within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `kiln` as a user runs it, against the coordinators `urls`.
fn kiln(urls: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.arg("--coordinator").arg(urls).args(["--connect-timeout", "30"]).args(args);
    cmd.env_remove("KILN_TOKEN").env("HOME", "/nonexistent").env("NO_COLOR", "1");
    cmd
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Everything the farm's state holds that a failover must not lose: records, claims, pins, tokens.
#[derive(Debug, PartialEq)]
struct Kept {
    records: Vec<String>,
    claims: Vec<String>,
    pins: Vec<String>,
    tokens: Vec<String>,
}

async fn kept(state: &PostgresStore, database: &str) -> Kept {
    let records = state.records().await.unwrap();
    // Read as an operator would, with SQL: listing live claims through the state prunes expired
    // ones, a write only the active coordinator may make.
    let (client, connection) = tokio_postgres::connect(database, tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    let rows = client.query("SELECT converge_id, reference, expires_ms FROM claims ORDER BY 1, 2", &[]).await.unwrap();
    let claims = rows
        .iter()
        .map(|r| format!("{} {} {}", r.get::<_, String>(0), r.get::<_, String>(1), r.get::<_, i64>(2)))
        .collect();
    drop(client);
    let _ = connection.await;
    Kept {
        records: records.iter().map(|(r, _)| format!("{r:?}")).collect(),
        claims,
        pins: state.pins().await.unwrap().iter().map(|p| format!("{p:?}")).collect(),
        tokens: state.tokens().await.unwrap().iter().map(|t| format!("{t:?}")).collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_active_coordinator_mid_converge_fails_over_and_loses_nothing() {
    let database = Postgres::shared().create_database().await;
    let state = PostgresStore::connect(&database.url).await.unwrap();
    // Rows written before any coordinator leads: a token, as an admin mints one.
    let token = TokenRow {
        id: "t-failover".into(),
        hash: "not-a-real-hash".into(),
        user: "ada".into(),
        role: kiln_coordinator::trust::Role::Member,
        team: None,
        created_ms: 1,
        expires_ms: None,
        revoked_ms: None,
    };
    state.put_token(token).await.unwrap();

    let a = Coordinator::start(&database.url, "3s");
    until_serving(&a.url, TAKEOVER).await;
    let mut b = Coordinator::start(&database.url, "3s");
    let farm = format!("{},{}", a.url, b.url);
    let work = tempfile::tempdir().unwrap();
    let (host, _stop_agent) = agent(&farm, &work.path().join("scratch"));
    until_agent_connected(&a.url, TAKEOVER).await;

    // The standby answers, and names the active one: to a probe, and to a user who reached it alone.
    // It was just started: wait until it answers at all (on a loaded machine its listener may
    // come up after the agent connected to the active one), then it must say "not serving".
    let started = Instant::now();
    let mut answer = serving(&b.url).await;
    while answer.is_none() && started.elapsed() < TAKEOVER {
        tokio::time::sleep(Duration::from_millis(50)).await;
        answer = serving(&b.url).await;
    }
    assert_eq!(answer, Some(false), "the second coordinator stands by");
    assert_eq!((a.ready(), b.ready()), (200, 503), "readiness: only the active coordinator gets traffic");
    let status = kiln(&b.url, &["status"]).output().unwrap();
    assert!(!status.status.success());
    assert!(
        text(&status).contains(&format!("stands by; the farm's active coordinator is at {}", a.url)),
        "{}",
        text(&status)
    );

    // A converge that lands (a record), a pin, then one left mid-build: one image built, one hanging.
    write_instance(&work.path().join("steady"), "steady", None, &[("steady", "steady v1")]);
    let up = kiln(&farm, &["up", work.path().join("steady").to_str().unwrap()]).output().unwrap();
    assert!(up.status.success(), "{}", text(&up));
    let steady = state.record("steady").await.unwrap().expect("steady recorded");
    let pinned = steady.images[0].reference.clone();
    let pin = kiln(&farm, &["pin", &pinned]).output().unwrap();
    assert!(pin.status.success(), "{}", text(&pin));

    host.hang_builds_of("slowpoke");
    write_instance(&work.path().join("web"), "web", None, &[("quick", "quick v1"), ("slowpoke", "slow v1")]);
    let converge = kiln(&farm, &["up", work.path().join("web").to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !(host.running() >= 1 && host.builds().iter().any(|b| b.tag.contains("quick") && b.finished.is_some())) {
        assert!(started.elapsed() < Duration::from_secs(30), "the converge of web never got mid-build");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let quick = host.builds().into_iter().find(|b| b.tag.contains("quick")).unwrap().tag;
    let before = kept(&state, &database.url).await;
    assert!(before.claims.iter().any(|c| c.contains(&quick)), "the running converge claims what it built: {before:?}");

    // SIGKILL the active coordinator mid-build.
    a.signal("-KILL");
    let killed = Instant::now();
    let took = until_serving(&b.url, TAKEOVER).await;
    eprintln!("standby took over {:?} after the kill", killed.elapsed().max(took));
    assert_eq!(b.ready(), 200, "the new active coordinator is ready");

    // The user of the broken converge is told what happened and what to do.
    let out = converge.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("coordinator failed over during the converge; run `kiln up` again"), "{}", text(&out));

    // The earlier converge shows failed, with that reason; nothing written before the kill is lost.
    let converges = state.converges(Some("web"), 10).await.unwrap();
    assert_eq!(converges.len(), 1);
    match &converges[0].state {
        ConvergeState::Failed { reason } => assert!(reason.contains("failed over"), "{reason}"),
        other => panic!("the converge the dead coordinator ran is {other:?}, not failed"),
    }
    assert_eq!(kept(&state, &database.url).await, before, "a record, claim, pin or token changed across the failover");

    // A sweep by the new active coordinator keeps what the dead one's converge claimed.
    until_agent_connected(&b.url, TAKEOVER).await;
    let gc = kiln(&farm, &["gc"]).output().unwrap();
    assert!(gc.status.success(), "{}", text(&gc));
    assert!(host.holds(&quick), "the sweep removed {quick}, claimed by the converge the dead coordinator ran");

    // The agent follows to the new active coordinator, and a new converge of web succeeds there.
    // Its slowpoke context went to the dead coordinator's disk only: the farm's index knows it,
    // the new active one has no bytes of it, so it is asked for again rather than built from nothing.
    host.clear_hangs();
    let mut host_builds = host.builds().len();
    write_instance(&work.path().join("web"), "web", None, &[("quick", "quick v2"), ("slowpoke", "slow v1")]);
    let again = kiln(&farm, &["up", work.path().join("web").to_str().unwrap()]).output().unwrap();
    assert!(again.status.success(), "{}", text(&again));
    host_builds = host.builds().len() - host_builds;
    assert_eq!(host_builds, 2, "the new converge built its two images on the agent that followed");
    assert!(state.record("web").await.unwrap().is_some());
    assert!(b.exit(Duration::from_millis(10)).is_none(), "the new active coordinator keeps serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frozen_coordinator_that_lost_its_lease_writes_nothing_when_it_wakes_and_steps_down() {
    let database = Postgres::shared().create_database().await;
    let state = PostgresStore::connect(&database.url).await.unwrap();
    let mut a = Coordinator::start(&database.url, "3s");
    until_serving(&a.url, TAKEOVER).await;
    let b = Coordinator::start(&database.url, "3s");
    let farm = format!("{},{}", a.url, b.url);
    let work = tempfile::tempdir().unwrap();
    let (host, _stop_agent) = agent(&a.url, &work.path().join("scratch"));
    until_agent_connected(&a.url, TAKEOVER).await;

    // A converge whose build is running on A's agent when A freezes; the build then finishes,
    // and its result waits in the socket for A to wake.
    host.hang_builds_of("frozen");
    write_instance(&work.path().join("web"), "web", None, &[("frozen", "v1")]);
    let mut converge = kiln(&a.url, &["up", work.path().join("web").to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while host.running() == 0 {
        assert!(started.elapsed() < Duration::from_secs(30), "the build never started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.signal("-STOP");
    until_serving(&b.url, TAKEOVER).await;
    let leader = state.current_leader().await.unwrap().expect("a leader");
    assert_eq!(leader.addr, b.url, "the standby holds the lease");
    let before = (state.records().await.unwrap().len(), state.converges(Some("web"), 10).await.unwrap());
    // The build completes while A sleeps: on waking, A has a result to record.
    host.set_build_time(Duration::from_millis(1));
    host.clear_hangs();
    let started = Instant::now();
    while host.builds().iter().all(|b| b.finished.is_none()) {
        assert!(started.elapsed() < Duration::from_secs(10), "the frozen build never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    a.signal("-CONT");
    let (status, stderr) = a.exit(Duration::from_secs(20)).expect("the woken coordinator stepped down");
    assert!(!status.success());
    // Which it notices first depends on the wake-up: its own clock past the lease, or the
    // database's refusal of its token. Either way it says it lost the lease and stops.
    assert!(stderr.contains("stopped serving: its lease on the farm was"), "it says why it stopped: {stderr}");
    // Nothing it tried landed: no record of web, and its converge is only as B's takeover left it.
    assert!(state.record("web").await.unwrap().is_none(), "the fenced coordinator recorded web");
    let after = (state.records().await.unwrap().len(), state.converges(Some("web"), 10).await.unwrap());
    assert_eq!(after, before, "the fenced coordinator changed the farm's state after it lost the lease");
    assert_eq!(state.current_leader().await.unwrap().map(|l| l.token), Some(leader.token));
    let _ = converge.kill();
    let _ = converge.wait();
    drop(farm);
}

/// SIGTERM — what systemd and the kubelet send — stops the active coordinator cleanly and hands
/// the lease on at once, rather than leaving the farm to wait out its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_stops_the_active_coordinator_cleanly_and_the_standby_leads_at_once() {
    let database = Postgres::shared().create_database().await;
    let state = PostgresStore::connect(&database.url).await.unwrap();
    let mut a = Coordinator::start(&database.url, "10s");
    until_serving(&a.url, TAKEOVER).await;
    let b = Coordinator::start(&database.url, "10s");
    // B is standing by, not merely starting: it answers health.
    let started = Instant::now();
    while serving(&b.url).await != Some(false) {
        assert!(started.elapsed() < TAKEOVER, "the second coordinator never stood by");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let token = state.current_leader().await.unwrap().expect("A leads").token;

    a.signal("-TERM");
    let (status, stderr) = a.exit(Duration::from_secs(15)).expect("the coordinator stopped on SIGTERM");
    assert!(status.success(), "a SIGTERM is a clean stop: {status}\n{stderr}");
    // Resigned, not left to lapse: the moment A is gone, the lease is no longer A's.
    let after = state.current_leader().await.unwrap().map(|l| l.addr);
    assert_ne!(after.as_deref(), Some(a.url.as_str()), "A left its lease to lapse instead of resigning it");
    until_serving(&b.url, TAKEOVER).await;
    let leader = state.current_leader().await.unwrap().expect("B leads");
    assert_eq!((leader.addr, leader.token), (b.url.clone(), token + 1));
}
