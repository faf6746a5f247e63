//! The in-process farm the converge benchmarks run against: the real coordinator (`serve`) and a
//! real host agent (`run_with`) on a free loopback port — the shape of `kiln-e2e`'s `Farm`. The
//! agent's Docker store is wrapped so the benchmark can count every call it sends to Docker,
//! listings and inspects included (a no-op converge claims to send Docker nothing at all, so a
//! count of builds alone could not check it), and time the builds, so a converge's wall time can
//! be split into Docker's share and Kiln's.

use anyhow::{bail, Context, Result};
use async_trait::async_trait;
use kiln_agent::host::{BuildSpec, Built, DockerStore, HostError, HostStore, ImageInfo, PushProgress, Pushed, Removal};
use kiln_coordinator::ServeError;
use kiln_core::sweep::ListedImage;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// The real Docker host store, counting every call and timing builds.
#[derive(Debug)]
pub struct CountingStore {
    inner: DockerStore,
    builds: AtomicU64,
    pushes: AtomicU64,
    lists: AtomicU64,
    inspects: AtomicU64,
    removes: AtomicU64,
    build_nanos: AtomicU64,
}

/// The calls a store received, or received between two snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    pub builds: u64,
    pub pushes: u64,
    pub lists: u64,
    pub inspects: u64,
    pub removes: u64,
    /// Wall time spent inside Docker's build call (bollard's request until its stream ends).
    pub build_time: Duration,
}

impl Calls {
    pub fn since(self, before: Calls) -> Calls {
        Calls {
            builds: self.builds - before.builds,
            pushes: self.pushes - before.pushes,
            lists: self.lists - before.lists,
            inspects: self.inspects - before.inspects,
            removes: self.removes - before.removes,
            build_time: self.build_time - before.build_time,
        }
    }
}

impl std::fmt::Display for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} build(s), {} push(es), {} listing(s), {} inspect(s), {} removal(s)",
            self.builds, self.pushes, self.lists, self.inspects, self.removes
        )
    }
}

impl CountingStore {
    pub async fn connect() -> Result<CountingStore> {
        let inner = DockerStore::connect_local().await.context("connecting to the Docker daemon")?;
        Ok(CountingStore {
            inner,
            builds: AtomicU64::new(0),
            pushes: AtomicU64::new(0),
            lists: AtomicU64::new(0),
            inspects: AtomicU64::new(0),
            removes: AtomicU64::new(0),
            build_nanos: AtomicU64::new(0),
        })
    }

    pub fn calls(&self) -> Calls {
        Calls {
            builds: self.builds.load(Ordering::SeqCst),
            pushes: self.pushes.load(Ordering::SeqCst),
            lists: self.lists.load(Ordering::SeqCst),
            inspects: self.inspects.load(Ordering::SeqCst),
            removes: self.removes.load(Ordering::SeqCst),
            build_time: Duration::from_nanos(self.build_nanos.load(Ordering::SeqCst)),
        }
    }
}

#[async_trait]
impl HostStore for CountingStore {
    async fn build(
        &self,
        context_archive: &Path,
        spec: &BuildSpec,
        log: mpsc::Sender<String>,
    ) -> Result<Built, HostError> {
        self.builds.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        let built = self.inner.build(context_archive, spec, log).await;
        self.build_nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::SeqCst);
        built
    }
    async fn list_labeled(&self) -> Result<Vec<ListedImage>, HostError> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list_labeled().await
    }
    async fn list_with_layers(&self) -> Result<Vec<ListedImage>, HostError> {
        self.inner.list_with_layers().await
    }
    async fn tag(&self, id: &str, reference: &str) -> Result<(), HostError> {
        self.inner.tag(id, reference).await
    }
    async fn inspect(&self, reference: &str) -> Result<Option<ImageInfo>, HostError> {
        self.inspects.fetch_add(1, Ordering::SeqCst);
        self.inner.inspect(reference).await
    }
    async fn push(&self, reference: &str, progress: mpsc::Sender<PushProgress>) -> Result<Pushed, HostError> {
        self.pushes.fetch_add(1, Ordering::SeqCst);
        self.inner.push(reference, progress).await
    }
    async fn remove_tag(&self, reference: &str) -> Result<Removal, HostError> {
        self.removes.fetch_add(1, Ordering::SeqCst);
        self.inner.remove_tag(reference).await
    }
    async fn remove_image(&self, id: &str) -> Result<Removal, HostError> {
        self.removes.fetch_add(1, Ordering::SeqCst);
        self.inner.remove_image(id).await
    }
    async fn export(&self, reference: &str) -> Result<kiln_agent::host::ExportStream, HostError> {
        self.inner.export(reference).await
    }
    async fn kind_load(
        &self,
        cluster: &str,
        reference: &str,
        id: &str,
        name: &str,
    ) -> Result<kiln_agent::host::KindLoad, HostError> {
        self.inner.kind_load(cluster, reference, id, name).await
    }
    async fn kind_nodes(&self) -> Result<Vec<kiln_agent::host::KindNode>, HostError> {
        self.inner.kind_nodes().await
    }
    async fn images_in_use(&self) -> Result<Vec<String>, HostError> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.images_in_use().await
    }
    async fn ping(&self) -> Result<(), HostError> {
        self.inner.ping().await
    }
}

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
    pub store: Arc<CountingStore>,
    agent_stop: oneshot::Sender<()>,
    agent: JoinHandle<Result<(), kiln_agent::RunError>>,
}

impl Farm {
    /// Starts both with their state under `home` (`state/`, `scratch/`) and waits for the agent;
    /// `nodelay` as in [`Coordinator::start`].
    pub async fn start(home: &Path, nodelay: bool) -> Result<Farm> {
        let farm_id = kiln_core::farm::embedded_farm_id("kiln-bench", home);
        let coordinator = Coordinator::start(&home.join("state"), &farm_id, nodelay).await?;
        let store = Arc::new(CountingStore::connect().await?);
        let config = kiln_agent::AgentConfig {
            slots: 0,
            coordinator: coordinator.url.clone(),
            agent_id: "bench-agent".to_string(),
            scratch_dir: home.join("scratch"),
            cluster: String::new(),
            identity: None,
            metrics: None,
            health: None,
            drain_grace: kiln_agent::DRAIN_GRACE,
            platforms: Default::default(),
        };
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
