//! The in-process farm the converge benchmarks run against: the real coordinator (`serve`) and a
//! real host agent (`run_with`) on a free loopback port — the shape of `kiln-e2e`'s `Farm`. The
//! agent's Docker store is `kiln-e2e`'s [`Counting`], so the benchmark can count every call it sends to Docker,
//! listings and inspects included (a no-op converge claims to send Docker nothing at all, so a
//! count of builds alone could not check it), and time the builds, so a converge's wall time can
//! be split into Docker's share and Kiln's.

use anyhow::{bail, Context, Result};
use kiln_agent::host::HostStore;
use kiln_coordinator::ServeError;
pub use kiln_e2e::{Calls, Counting};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A coordinator serving on a free loopback port, on the caller's runtime.
#[derive(Debug)]
pub struct Coordinator {
    pub url: String,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Coordinator {
    /// Starts serving at once; the state (SQLite, contexts) lives in `state_dir`.
    ///
    /// `nodelay` sets `TCP_NODELAY` on the listening socket, which Linux copies to every accepted
    /// connection. `kiln-coordinator` and the embedded coordinator bind a plain listener (Nagle on),
    /// so the benchmarks measure that by default; the flag shows what turning Nagle off would gain.
    pub async fn start(state_dir: &Path, farm: &str, nodelay: bool) -> Result<Coordinator> {
        let listener = loopback_listener(nodelay)?;
        let url = format!("http://{}", listener.local_addr()?);
        let config = kiln_coordinator::Config::new(state_dir, farm);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(kiln_coordinator::serve(listener, config, async {
            let _ = stopped.await;
        }));
        Ok(Coordinator { url, stop, task })
    }

    pub async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.task.await.context("the coordinator task panicked")?.context("the coordinator failed")
    }
}

/// A listener on a free loopback port; `nodelay` as in [`Coordinator::start`]. Must be called on
/// a runtime (the listener registers with its reactor).
pub fn loopback_listener(nodelay: bool) -> Result<tokio::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_nodelay(nodelay)?;
    socket.bind("127.0.0.1:0".parse()?)?;
    socket.listen(1024).context("listening on a loopback port")
}

/// A coordinator and one host agent over the counting Docker store.
#[derive(Debug)]
pub struct Farm {
    pub coordinator: Coordinator,
    pub store: Arc<Counting>,
    agent_stop: oneshot::Sender<()>,
    agent: JoinHandle<Result<(), kiln_agent::RunError>>,
}

impl Farm {
    /// Starts both with their state under `home` (`state/`, `scratch/`) and waits for the agent;
    /// `nodelay` as in [`Coordinator::start`].
    pub async fn start(home: &Path, nodelay: bool) -> Result<Farm> {
        let farm_id = kiln_core::farm::embedded_farm_id("kiln-bench", home);
        let coordinator = Coordinator::start(&home.join("state"), &farm_id, nodelay).await?;
        let store = Arc::new(Counting::connect().await.context("connecting to the Docker daemon")?);
        let config = kiln_agent::AgentConfig::new(coordinator.url.clone(), "bench-agent", home.join("scratch"));
        let (agent_stop, stopped) = oneshot::channel::<()>();
        let host: Arc<dyn HostStore> = store.clone();
        let agent = tokio::spawn(kiln_agent::run_with(config, host, async {
            let _ = stopped.await;
        }));
        wait_for_agent(&coordinator.url).await?;
        Ok(Farm { coordinator, store, agent_stop, agent })
    }

    pub fn calls(&self) -> Calls {
        self.store.calls()
    }

    pub async fn stop(self) -> Result<()> {
        let _ = self.agent_stop.send(());
        self.agent.await.context("the agent task panicked")?.context("the agent failed")?;
        self.coordinator.stop().await
    }
}

/// Polls `Agents` until one is connected: a converge started before would wait for it and time
/// the agent's start-up instead of the converge.
async fn wait_for_agent(url: &str) -> Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?.connect_lazy();
    let mut client = kiln_proto::v1::kiln_client::KilnClient::new(channel);
    for _ in 0..200 {
        if let Ok(reply) = client.agents(kiln_proto::v1::AgentsRequest {}).await {
            if reply.into_inner().agents.iter().any(|a| a.connected) {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("the agent never connected to the coordinator at {url}")
}
