//! `kiln-e2e`: the harness for end-to-end tests against the real Docker daemon, a real registry
//! (Debian's `docker-registry`) and real containerd (../shared/COMPONENTS.md).
//!
//! A [`Farm`] is a coordinator and a host agent started in-process — the same `serve` and `run`
//! production uses — on a free loopback port, with its state under a temp `KILN_HOME`. Its agent's
//! host store is the real Docker daemon, wrapped in [`Counting`] so a test can assert how many
//! builds and pushes a converge really sent to Docker. [`Registry`] starts a registry on a free
//! port and stops it by its PID; [`postgres::Postgres`] a throwaway PostgreSQL cluster the same way;
//! [`browser::ChromeDriver`] headless Chromium's WebDriver, for the status page.
//! [`containerd::Containerd`] runs one containerd per simulated node. [`otlp::Collector`]
//! receives the spans of processes that trace. [`oci::push_two_platform`] pushes a two-platform
//! image straight into a registry, the upstream a pinned image comes from. [`Counting`] is the
//! Docker host store, counting its calls, that the farm's agent and the converge benchmarks run.

pub mod browser;
pub mod containerd;
pub mod counting;
pub mod docker;
pub mod fixture;
pub mod http;
pub mod kind;
pub mod oci;
pub mod otlp;
pub mod postgres;
pub mod process;
pub mod registry;
pub mod sim;
pub mod trust;
pub mod wire;

use kiln_agent::host::HostStore;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use counting::{BuildPause, Calls, Counting};
pub use registry::Registry;

/// A coordinator and one host agent, in-process, on a free loopback port.
#[derive(Debug)]
pub struct Farm {
    pub home: PathBuf,
    pub farm_id: String,
    pub url: String,
    pub store: Arc<Counting>,
    /// The coordinator runs on a runtime of its own, so a test can crash it: dropping the runtime
    /// drops every task it had (converges in flight included) with no chance to clean up.
    coordinator: Option<(oneshot::Sender<()>, JoinHandle<()>, tokio::runtime::Runtime)>,
    pub claim_lease: std::time::Duration,
    agent: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
    /// Node agents started with [`Farm::start_node`], and host agents with [`Farm::start_host`].
    nodes: Vec<(oneshot::Sender<()>, JoinHandle<()>)>,
    /// [`Farm::start_observed`]: where the coordinator (`--http`) and the agent (`--metrics`)
    /// serve `/metrics`.
    pub coordinator_metrics: Option<std::net::SocketAddr>,
    pub agent_metrics: Option<std::net::SocketAddr>,
}

/// A loopback address whose port was free a moment ago, for a listener the code under test binds.
pub fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

impl Farm {
    /// Starts a farm whose state lives under `home` (its `state/` and `scratch/`).
    pub async fn start(home: &Path) -> Farm {
        Farm::start_with(home, false).await
    }

    /// A farm whose coordinator and agent also serve `/metrics`, each on a free loopback port.
    pub async fn start_observed(home: &Path) -> Farm {
        Farm::start_with(home, true).await
    }

    async fn start_with(home: &Path, observed: bool) -> Farm {
        let farm_id = kiln_core::farm::embedded_farm_id("e2e", home);
        let store = Arc::new(Counting::connect().await.expect("the Docker daemon must run for end-to-end tests"));
        let mut farm = Farm {
            home: home.to_path_buf(),
            farm_id,
            url: String::new(),
            store,
            coordinator: None,
            claim_lease: std::time::Duration::from_secs(600),
            agent: None,
            nodes: Vec::new(),
            coordinator_metrics: observed.then(free_addr),
            agent_metrics: observed.then(free_addr),
        };
        farm.start_coordinator().await;
        farm.start_agent().await;
        farm
    }

    async fn start_coordinator(&mut self) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        // Keep the port across restarts, so the agent's reconnect finds the new coordinator.
        if self.url.is_empty() {
            self.url = format!("http://{}", listener.local_addr().unwrap());
        }
        let addr = self.url.trim_start_matches("http://").to_string();
        drop(listener);
        let mut config = kiln_coordinator::Config::new(self.home.join("state"), self.farm_id.clone());
        config.claim_lease = self.claim_lease;
        config.http = self.coordinator_metrics;
        let (tx, rx) = oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let task = runtime.spawn(async move {
            // A crashed runtime lets go of its socket in the background: retry for a moment.
            let mut listener = None;
            for _ in 0..100 {
                match kiln_coordinator::listen(&addr).await {
                    Ok(l) => {
                        listener = Some(l);
                        break;
                    }
                    Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
                }
            }
            let listener = listener.expect("coordinator port is free again");
            kiln_coordinator::serve(listener, config, async {
                let _ = rx.await;
            })
            .await
            .expect("coordinator serves");
        });
        self.coordinator = Some((tx, task, runtime));
    }

    /// Kills the coordinator mid-flight: its runtime and every task on it are dropped at once.
    pub fn crash_coordinator(&mut self) {
        if let Some((_, _, runtime)) = self.coordinator.take() {
            runtime.shutdown_background();
        }
    }

    /// Starts the coordinator again on the same port and state, and waits for the agent to return.
    pub async fn restart_coordinator(&mut self) {
        self.start_coordinator().await;
        self.wait_for_agent().await;
    }

    async fn start_agent(&mut self) {
        let config = kiln_agent::AgentConfig {
            // One build at a time: these tests assert the order of a converge's events on the
            // real daemon, and parallel builds finish in whatever order Docker takes. The
            // scheduler's parallelism is tested with simulated hosts (`sim`, `tests/schedule.rs`).
            slots: 1,
            metrics: self.agent_metrics,
            // binfmt_misc read from under the farm's home, where a test lays out the handlers it
            // needs: the machine's own would make a test's outcome depend on what it installed.
            platforms: kiln_agent::Platforms { native: Vec::new(), binfmt_root: Some(self.binfmt_root()) },
            ..kiln_agent::AgentConfig::new(self.url.clone(), "e2e-agent", self.home.join("scratch"))
        };
        let (tx, rx) = oneshot::channel::<()>();
        let store: Arc<dyn HostStore> = self.store.clone();
        let task = tokio::spawn(async move {
            kiln_agent::run_with(config, store, async {
                let _ = rx.await;
            })
            .await
            .expect("agent runs");
        });
        self.agent = Some((tx, task));
        self.wait_for_agent().await;
    }

    /// Starts a node agent `agent_id` of `cluster` serving `store` (the real `run_node_with`) and
    /// waits until the coordinator lists it as connected.
    pub async fn start_node(&mut self, cluster: &str, agent_id: &str, store: Arc<dyn kiln_agent::node::NodeStore>) {
        self.start_node_on(cluster, agent_id, store, &[]).await
    }

    /// [`Farm::start_node`] for a node agent announcing `platforms` (OCI form; empty: this
    /// machine's), as `kiln-agent --platform` would on a node of another architecture.
    pub async fn start_node_on(
        &mut self,
        cluster: &str,
        agent_id: &str,
        store: Arc<dyn kiln_agent::node::NodeStore>,
        platforms: &[&str],
    ) {
        let config = self.agent_config(agent_id, 0, cluster, platforms, None);
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            kiln_agent::run_node_with(config, store, async {
                let _ = rx.await;
            })
            .await
            .expect("node agent runs");
        });
        self.nodes.push((tx, task));
        self.wait_connected(agent_id).await;
    }

    /// Starts a second host agent `agent_id` (one slot) over the farm's Docker store, so a
    /// converge's tasks can run on two agents at once, announcing `platforms` (empty: this
    /// machine's) — e.g. an arm64 build host, which on this daemon builds what needs no RUN;
    /// waits until it is connected.
    pub async fn start_host(&mut self, agent_id: &str, platforms: &[&str]) {
        let config = self.agent_config(agent_id, 1, "", platforms, Some(self.binfmt_root()));
        let (tx, rx) = oneshot::channel::<()>();
        let store: Arc<dyn HostStore> = self.store.clone();
        let task = tokio::spawn(async move {
            kiln_agent::run_with(config, store, async {
                let _ = rx.await;
            })
            .await
            .expect("agent runs");
        });
        self.nodes.push((tx, task));
        self.wait_connected(agent_id).await;
    }

    /// An extra agent's configuration: this farm's coordinator, a scratch dir of its own, and
    /// `platforms` announced (empty: this machine's).
    fn agent_config(
        &self,
        agent_id: &str,
        slots: u32,
        cluster: &str,
        platforms: &[&str],
        binfmt_root: Option<PathBuf>,
    ) -> kiln_agent::AgentConfig {
        kiln_agent::AgentConfig {
            slots,
            cluster: cluster.to_string(),
            platforms: kiln_agent::Platforms { native: platforms.iter().map(|p| p.to_string()).collect(), binfmt_root },
            ..kiln_agent::AgentConfig::new(
                self.url.clone(),
                agent_id.to_string(),
                self.home.join("scratch").join(agent_id),
            )
        }
    }

    async fn wait_connected(&self, agent_id: &str) {
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone()).unwrap().connect_lazy();
        let mut client = kiln_proto::v1::kiln_client::KilnClient::new(channel);
        for _ in 0..200 {
            if let Ok(reply) = client.agents(kiln_proto::v1::AgentsRequest {}).await {
                if reply.into_inner().agents.iter().any(|a| a.id == agent_id && a.connected) {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("agent {agent_id} never connected to {}", self.url);
    }

    /// Where the farm's host agent reads binfmt_misc (absent: it emulates nothing).
    pub fn binfmt_root(&self) -> PathBuf {
        self.home.join("binfmt_misc")
    }

    pub fn exports(&self) -> usize {
        self.store.exports.load(Ordering::SeqCst)
    }

    /// Waits until the coordinator lists the agent as connected.
    pub async fn wait_for_agent(&self) {
        let channel = tonic::transport::Endpoint::from_shared(self.url.clone()).unwrap().connect_lazy();
        let mut client = kiln_proto::v1::kiln_client::KilnClient::new(channel);
        for _ in 0..200 {
            if let Ok(reply) = client.agents(kiln_proto::v1::AgentsRequest {}).await {
                if reply.into_inner().agents.iter().any(|a| a.connected) {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("the agent never connected to {}", self.url);
    }

    pub fn builds(&self) -> usize {
        self.store.builds.load(Ordering::SeqCst)
    }

    pub fn pushes(&self) -> usize {
        self.store.pushes.load(Ordering::SeqCst)
    }

    /// Stops the coordinator and the agent, waiting for both.
    pub async fn stop(&mut self) {
        for (tx, task) in self.nodes.drain(..) {
            let _ = tx.send(());
            let _ = task.await;
        }
        if let Some((tx, task)) = self.agent.take() {
            let _ = tx.send(());
            let _ = task.await;
        }
        if let Some((tx, task, runtime)) = self.coordinator.take() {
            let _ = tx.send(());
            let _ = task.await;
            // Waits for the runtime's tasks and blocking reads to be dropped, and with them the
            // state store: a wipe deletes its file next, and an SQLite connection closing after
            // the new coordinator made the file anew would take the new file's WAL with it
            // (SQLite deletes `<db>-wal` by name when its last connection closes).
            tokio::task::spawn_blocking(move || runtime.shutdown_timeout(std::time::Duration::from_secs(30)))
                .await
                .unwrap();
        }
    }

    /// Stops everything, deletes the coordinator's state (records, contexts) and starts again on
    /// the same `home`: the farm id, derived from it, stays the same.
    pub async fn wipe_state_and_restart(&mut self) {
        self.stop().await;
        std::fs::remove_dir_all(self.home.join("state")).unwrap();
        self.start_coordinator().await;
        self.start_agent().await;
    }
}

/// Milliseconds since the epoch, as the coordinator stamps claims.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64
}
