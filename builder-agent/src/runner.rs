//! `run`: the agent as a library — connects to the coordinator, says hello, executes the tasks it
//! is sent, and reconnects forever on the retry ladder when the stream breaks. The CLI's embedded
//! mode, `kiln-agent` the binary and the tests start this same function.
//!
//! An agent serves one store: a host store ([`run`], [`run_with`]: builds, pushes, lists, untags)
//! or a node store ([`run_node`], [`run_node_with`]: lists and removes; see `node::tasks`). The
//! session loop is the same; only the hello and the task dispatch differ.

use crate::host::{DockerStore, HostStore};
use crate::metrics::AgentMetrics;
use crate::node::{NodeConfig, NodeStore, RemovalMode};
use crate::tasks;
use kiln_core::refs::PlatformSet;
use kiln_core::retry::{Ladder, LadderConfig};
use kiln_proto::v1 as pb;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// What an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The coordinator's URL, e.g. `http://127.0.0.1:7070`; a farm's several coordinators as a
    /// comma-separated list, of which the agent finds the active one.
    pub coordinator: String,
    /// Stable id of this agent (defaults to the host name).
    pub agent_id: String,
    /// Where contexts are downloaded and verified before a build.
    pub scratch_dir: PathBuf,
    /// Role node: the cluster this node belongs to, announced in the hello; a `nodes` target of
    /// that name delivers here. Empty for a host agent.
    pub cluster: String,
    /// An enrolled agent's key, certificate and farm CA: every connection is mutual TLS with them
    /// (`https://` coordinators). `None`: plaintext, to an embedded or `--dev` coordinator.
    pub identity: Option<crate::enroll::Identity>,
    /// Builds this agent runs at once (`--slots`); 0: one per core.
    pub slots: u32,
    /// Bytes of verified context archives kept for the next build of the same context
    /// (`--context-cache`); 0 keeps none.
    pub context_cache: u64,
    /// Where `/metrics` is served over plain HTTP (`--metrics`); `None`, as in embedded mode: no listener.
    pub metrics: Option<std::net::SocketAddr>,
    /// Where the standard gRPC health service is served in plaintext (`--health`); `None`: not served.
    pub health: Option<std::net::SocketAddr>,
    /// How long running tasks may finish after a shutdown signal before they are handed back.
    pub drain_grace: Duration,
    /// The platforms it announces: native and emulated.
    pub platforms: Platforms,
}

/// The platforms an agent announces in its hello.
#[derive(Clone, Debug, Default)]
pub struct Platforms {
    /// What it runs natively (OCI form); empty: this machine's (`--platform`, e.g. a node agent
    /// on an arm64 node reached from elsewhere).
    pub native: Vec<String>,
    /// Where binfmt_misc is read for the platforms it emulates; `None`: the kernel's
    /// (`/proc/sys/fs/binfmt_misc`).
    pub binfmt_root: Option<PathBuf>,
}

impl Platforms {
    pub fn native(&self) -> Vec<String> {
        match self.native.is_empty() {
            true => vec![PlatformSet::host().oci()],
            false => self.native.clone(),
        }
    }

    pub fn emulated(&self) -> Vec<String> {
        let root = self.binfmt_root.clone().unwrap_or_else(|| PathBuf::from(crate::emulation::BINFMT_ROOT));
        crate::emulation::emulated_platforms(&root, &self.native())
    }
}

impl AgentConfig {
    /// A host agent of `coordinator` as most callers run it: plaintext (no identity), one build
    /// slot per core, no `/metrics` or health listener, the default drain grace, and this
    /// machine's platforms. Callers change what differs with struct update syntax.
    pub fn new(
        coordinator: impl Into<String>,
        agent_id: impl Into<String>,
        scratch_dir: impl Into<PathBuf>,
    ) -> AgentConfig {
        AgentConfig {
            coordinator: coordinator.into(),
            agent_id: agent_id.into(),
            scratch_dir: scratch_dir.into(),
            cluster: String::new(),
            identity: None,
            slots: 0,
            context_cache: crate::contexts::DEFAULT_BUDGET,
            metrics: None,
            health: None,
            drain_grace: crate::DRAIN_GRACE,
            platforms: Platforms::default(),
        }
    }

    /// The coordinators' URLs, in the order given.
    pub fn coordinators(&self) -> Vec<String> {
        coordinator_urls(&self.coordinator)
    }

    /// The slots announced: as configured, else one per core.
    pub fn slots(&self) -> u32 {
        match self.slots {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            n => n,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("agent {agent}: cannot reach the Docker daemon")]
    Docker {
        agent: String,
        #[source]
        err: crate::host::HostError,
    },
    #[error("agent {agent}: cannot reach the node's image store")]
    Node {
        agent: String,
        #[source]
        err: crate::node::NodeError,
    },
    #[error("agent {agent}: the coordinator at {url} refused it: {why}")]
    Refused { agent: String, url: String, why: String },
    #[error("agent {agent}: {url} is not a valid coordinator URL — use http://host:port")]
    BadUrl { agent: String, url: String },
    #[error("agent {agent}: its enrolled identity is not usable — enroll again with `kiln-agent --join`")]
    Identity {
        agent: String,
        #[source]
        err: crate::enroll::EnrollError,
    },
    #[error("agent {agent}: cannot serve /metrics on {addr}")]
    Metrics {
        agent: String,
        addr: std::net::SocketAddr,
        #[source]
        err: std::io::Error,
    },
    #[error("agent {agent}: cannot serve grpc.health.v1 on {addr}")]
    Health {
        agent: String,
        addr: std::net::SocketAddr,
        #[source]
        err: std::io::Error,
    },
    #[error("agent {agent}: cannot create its scratch directory {dir}")]
    Scratch {
        agent: String,
        dir: PathBuf,
        #[source]
        err: std::io::Error,
    },
}

/// Runs the agent against the local Docker daemon until `shutdown` resolves.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), RunError> {
    let store =
        DockerStore::connect_local().await.map_err(|err| RunError::Docker { agent: config.agent_id.clone(), err })?;
    run_with(config, Arc::new(store), shutdown).await
}

/// Runs the agent with the host store given; `run` passes the local Docker daemon.
pub async fn run_with(
    config: AgentConfig,
    store: Arc<dyn HostStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    serve(config, Served::Host(store), shutdown).await
}

/// Runs a node agent (role `node`) over the node store `node` names, until `shutdown` resolves.
pub async fn run_node(
    config: AgentConfig,
    node: NodeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let store = node.connect().await.map_err(|err| RunError::Node { agent: config.agent_id.clone(), err })?;
    run_node_with(config, store, shutdown).await
}

/// Runs a node agent with the node store given.
pub async fn run_node_with(
    config: AgentConfig,
    store: Arc<dyn NodeStore>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    serve(config, Served::Node(store), shutdown).await
}

/// The one store an agent serves.
#[derive(Clone)]
enum Served {
    Host(Arc<dyn HostStore>),
    Node(Arc<dyn NodeStore>),
}

/// Where one session sends its tasks.
enum Dispatch {
    Host(Arc<tasks::TaskContext>),
    Node(Arc<crate::node::tasks::NodeContext>),
}

async fn serve(
    config: AgentConfig,
    served: Served,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    std::fs::create_dir_all(&config.scratch_dir).map_err(|err| RunError::Scratch {
        agent: config.agent_id.clone(),
        dir: config.scratch_dir.clone(),
        err,
    })?;
    remove_leftovers(&config.scratch_dir);
    let urls = config.coordinators();
    let bad_url = |url: &str| RunError::BadUrl { agent: config.agent_id.clone(), url: url.to_string() };
    if urls.is_empty() {
        return Err(bad_url(&config.coordinator));
    }
    let slots = match served {
        Served::Host(_) => config.slots(),
        Served::Node(_) => 0,
    };
    let metrics = Arc::new(AgentMetrics::new(slots));
    // Kept across reconnects, like the metrics: a coordinator's restart does not make a verified
    // archive less so.
    let contexts = Arc::new(crate::contexts::ContextCache::open(&config.scratch_dir, config.context_cache));
    let _listening = match config.metrics {
        Some(addr) => Some(crate::metrics::start(addr, metrics.clone()).await.map_err(|err| RunError::Metrics {
            agent: config.agent_id.clone(),
            addr,
            err,
        })?),
        None => None,
    };
    let health = match config.health {
        Some(addr) => crate::health::Health::start(addr).await.map_err(|err| RunError::Health {
            agent: config.agent_id.clone(),
            addr,
            err,
        })?,
        None => crate::health::Health::default(),
    };
    let mut shutdown: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(shutdown);
    let mut ladder = Ladder::new(LadderConfig::forever(), fastrand::u64(..));
    let mut failing_since: Option<Instant> = None;
    // Which of the farm's coordinators is tried next, and the active one a standby named.
    let mut next = 0;
    let mut redirect: Option<String> = None;
    let mut standby_seen = false;
    loop {
        let url = redirect.take().unwrap_or_else(|| urls[next % urls.len()].clone());
        let mut endpoint =
            Endpoint::from_shared(url.clone()).map_err(|_| bad_url(&url))?.connect_timeout(Duration::from_secs(5));
        // Read per session: a renewed certificate is used from the next connection on.
        if let Some(identity) = &config.identity {
            let tls = identity.tls().map_err(|err| RunError::Identity { agent: config.agent_id.clone(), err })?;
            endpoint = endpoint.tls_config(tls).map_err(|_| bad_url(&url))?;
        }
        let ended =
            session(&config, &url, &endpoint, served.clone(), (&metrics, &contexts), &health, &mut shutdown).await;
        health.not_ready().await;
        let why = match ended {
            Session::Stopped => return Ok(()),
            Session::Refused(why) => return Err(RunError::Refused { agent: config.agent_id.clone(), url, why }),
            Session::Standby { active } => {
                tracing::info!(agent = %config.agent_id, %url, %active, "that coordinator stands by; going to the active one");
                standby_seen = true;
                redirect = Some(active);
                // The active one is tried at once; the list resumes after the standby.
                next += 1;
                continue;
            }
            Session::Broken { was_connected, why } => {
                if was_connected {
                    ladder.reset();
                    failing_since = None;
                    standby_seen = false;
                }
                next += 1;
                why
            }
        };
        let since = *failing_since.get_or_insert_with(Instant::now);
        let mut sleep = ladder.next_sleep(since.elapsed()).unwrap_or(Duration::from_secs(5));
        if standby_seen {
            // A standby answered: a failover is under way and ends within a lease's TTL, so the
            // agent asks often rather than backing off past the moment the farm is back.
            sleep = sleep.min(FAILOVER_POLL);
        }
        tracing::warn!(agent = %config.agent_id, %url, %why, retry_ms = sleep.as_millis() as u64, "coordinator stream lost; reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = &mut shutdown => return Ok(()),
        }
    }
}

/// How often an agent asks again while a farm fails over.
const FAILOVER_POLL: Duration = Duration::from_millis(300);

/// How long a shutting-down agent lets its running tasks finish (`--drain-grace`): under the
/// kubelet's default 30 s termination grace, so the agent hands back what is left before SIGKILL.
pub const DRAIN_GRACE: Duration = Duration::from_secs(25);

/// The URLs of `--coordinator a,b,c`: a farm's coordinators, of which one is active.
pub fn coordinator_urls(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|url| !url.is_empty()).map(str::to_string).collect()
}

/// Context archives an agent killed mid-build left in its scratch directory: no task runs before
/// the agent connects, so every one of them is a leftover. Only names the agent itself writes
/// (`<64 hex>-<8 hex>.tar`) are touched.
fn remove_leftovers(scratch: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(scratch) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let ours = name.strip_suffix(".tar").and_then(|stem| stem.split_once('-')).is_some_and(|(digest, nonce)| {
            digest.len() == 64 && nonce.len() == 8 && digest.bytes().chain(nonce.bytes()).all(|b| b.is_ascii_hexdigit())
        });
        if ours {
            tracing::info!(file = %entry.path().display(), "removing a context archive a crash left behind");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

enum Session {
    Stopped,
    Refused(String),
    /// The coordinator reached stands by; `active` is where the farm's active one serves.
    Standby {
        active: String,
    },
    Broken {
        was_connected: bool,
        why: String,
    },
}

/// The hello: who the agent is and the stores it holds now (`host_stores` for a host agent).
fn hello(config: &AgentConfig, served: &Served, host_stores: Vec<pb::StoreInfo>) -> pb::AgentMessage {
    let (role, stores) = match served {
        Served::Host(_) => (pb::Role::Host, host_stores),
        Served::Node(node) => (
            pb::Role::Node,
            vec![pb::StoreInfo {
                id: node_store_id(&config.agent_id, node.removal_mode()),
                kind: pb::store_info::Kind::Node as i32,
                cluster: config.cluster.clone(),
            }],
        ),
    };
    pb::AgentMessage {
        body: Some(pb::agent_message::Body::Hello(pb::Hello {
            agent_id: config.agent_id.clone(),
            role: role as i32,
            stores,
            platforms: config.platforms.native(),
            emulates: match served {
                Served::Host(_) => config.platforms.emulated(),
                Served::Node(_) => Vec::new(),
            },
            version: env!("CARGO_PKG_VERSION").to_string(),
            cluster: config.cluster.clone(),
            slots: config.slots(),
        })),
    }
}

/// A node store's id in the hello: `containerd@<agent>` when it can untag, `cri@<agent>` when it
/// removes whole ids only. Until `StoreInfo` carries the removal mode, the prefix is how the
/// coordinator can tell which one the sweep planner must assume.
pub fn node_store_id(agent_id: &str, removal: RemovalMode) -> String {
    match removal {
        RemovalMode::PerRef => format!("containerd@{agent_id}"),
        RemovalMode::PerId => format!("cri@{agent_id}"),
    }
}

async fn session(
    config: &AgentConfig,
    url: &str,
    endpoint: &Endpoint,
    served: Served,
    (metrics, contexts): (&Arc<AgentMetrics>, &Arc<crate::contexts::ContextCache>),
    health: &crate::health::Health,
    shutdown: &mut Pin<Box<dyn Future<Output = ()> + Send>>,
) -> Session {
    let broken = |was_connected, why: String| Session::Broken { was_connected, why };
    let channel: Channel = tokio::select! {
        c = endpoint.connect() => match c {
            Ok(c) => c,
            Err(e) => return broken(false, format!("connect {url}: {}", source_text(&e))),
        },
        _ = &mut *shutdown => return Session::Stopped,
    };
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(256);
    let host_stores = match &served {
        Served::Host(store) => crate::stores::host_stores(&config.agent_id, &**store).await,
        Served::Node(_) => Vec::new(),
    };
    let _ = tx.send(hello(config, &served, host_stores.clone())).await;
    if let Some(identity) = &config.identity {
        match crate::enroll::renew_if_due(url, channel.clone(), identity, now_ms()).await {
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(agent = %config.agent_id, error = %kiln_core::error_chain(&err), "certificate renewal failed; retried at the next connection")
            }
        }
    }
    let mut client = pb::agent_hub_client::AgentHubClient::new(channel.clone());
    let mut inbound = match client.connect(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            // A standby answers with where the active coordinator is; one naming itself is no lead.
            let active = status.metadata().get("kiln-active").and_then(|v| v.to_str().ok()).map(str::to_string);
            return match active {
                Some(active) if status.code() == tonic::Code::Unavailable && active != url => {
                    Session::Standby { active }
                }
                _ => broken(false, format!("connect {url}: {}", status.message())),
            };
        }
    };
    let heartbeat = match inbound.message().await {
        Ok(Some(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Welcome(w)) })) => {
            if !w.refused.is_empty() {
                return Session::Refused(w.refused);
            }
            Duration::from_millis(w.heartbeat_ms.max(100))
        }
        Ok(_) => return broken(false, "the coordinator did not welcome the agent".to_string()),
        Err(status) => return broken(false, status.message().to_string()),
    };
    tracing::info!(agent = %config.agent_id, %url, "connected to the coordinator");
    health.connected().await;
    let dispatch = match served {
        Served::Host(store) => Dispatch::Host(Arc::new(tasks::TaskContext {
            store,
            agent_id: config.agent_id.clone(),
            announced: std::sync::Mutex::new(host_stores),
            content: pb::content_store_client::ContentStoreClient::new(channel.clone()),
            relay: pb::image_relay_client::ImageRelayClient::new(channel),
            scratch: config.scratch_dir.clone(),
            contexts: contexts.clone(),
            out: tx.clone(),
            metrics: metrics.clone(),
        })),
        Served::Node(store) => Dispatch::Node(Arc::new(crate::node::tasks::NodeContext {
            store_id: node_store_id(&config.agent_id, store.removal_mode()),
            store,
            relay: pb::image_relay_client::ImageRelayClient::new(channel),
            out: tx.clone(),
            metrics: metrics.clone(),
        })),
    };
    // The session's tasks: a `Cancel` stops one, and all stop with the session — a coordinator that
    // lost this stream may hand them to another agent, and a task never runs twice at once.
    let running = Running::default();
    let mut beat = tokio::time::interval(heartbeat);
    let mut refresh = tokio::time::interval(crate::stores::REFRESH);
    refresh.tick().await;
    // One look for kind nodes at a time: a daemon slow to answer must not pile them up.
    let mut announcing: Option<tokio::task::JoinHandle<()>> = None;
    // Set by a shutdown signal: when the drain must end, running tasks or not. It ends sooner
    // when the coordinator says `Drained`: only it knows whether a delivery is still to come
    // for an image this agent just built.
    let mut draining: Option<tokio::time::Instant> = None;
    // A stream lost while draining ends the agent: it was stopping anyway.
    let lost = |draining: Option<_>, why: String| match draining {
        Some(_) => Session::Stopped,
        None => broken(true, why),
    };
    loop {
        tokio::select! {
            _ = &mut *shutdown, if draining.is_none() => {
                let tasks = running.ids().len();
                tracing::info!(agent = %config.agent_id, tasks, grace_s = config.drain_grace.as_secs(), "shutting down: finishing running tasks");
                let reason = format!("agent shutting down; finishing its {tasks} running task(s) within {} s", config.drain_grace.as_secs());
                let bye = pb::GoingAway { reason };
                let _ = tx.send(pb::AgentMessage { body: Some(pb::agent_message::Body::GoingAway(bye)) }).await;
                draining = Some(tokio::time::Instant::now() + config.drain_grace);
                health.not_ready().await;
            }
            _ = tokio::time::sleep_until(draining.unwrap_or_else(tokio::time::Instant::now)), if draining.is_some() => {
                // Dropping `running` stops them; the closed stream hands them back to the
                // coordinator, which runs them on another agent.
                tracing::warn!(agent = %config.agent_id, tasks = ?running.ids(), "drain grace over: handing back the tasks still running");
                return Session::Stopped;
            }
            _ = beat.tick() => {
                let hb = pb::Heartbeat { at_ms: 0, running: running.ids() };
                if tx.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Heartbeat(hb)) }).await.is_err() {
                    return lost(draining, "outbound stream closed".to_string());
                }
            }
            _ = refresh.tick() => {
                if let (Dispatch::Host(ctx), true) = (&dispatch, announcing.as_ref().is_none_or(|a| a.is_finished())) {
                    let ctx = ctx.clone();
                    announcing = Some(tokio::spawn(async move { crate::stores::announce(&ctx).await }));
                }
            }
            msg = inbound.message() => match msg {
                Ok(Some(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Drained(_)) })) if draining.is_some() => {
                    tracing::info!(agent = %config.agent_id, "drained: the coordinator has nothing left for this agent");
                    return Session::Stopped;
                }
                Ok(Some(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Task(task)) }))
                    if draining.is_some() && matches!(task.kind, Some(pb::task::Kind::Build(_))) =>
                {
                    // A new build, placed before our `GoingAway` arrived: refused untouched, to
                    // run elsewhere. Anything else is the rest of work under way here (the
                    // delivery of an image this agent built) and runs.
                    let error = pb::TaskError {
                        kind: pb::task_error::Kind::Draining as i32,
                        message: format!("agent {} is shutting down and takes no new task", config.agent_id),
                        step: 0,
                    };
                    let result = pb::TaskResult { task_id: task.task_id, outcome: Some(pb::task_result::Outcome::Error(error)) };
                    let _ = tx.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Result(result)) }).await;
                }
                Ok(Some(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Task(task)) })) => {
                    let id = task.task_id.clone();
                    let work: Pin<Box<dyn Future<Output = ()> + Send>> = match &dispatch {
                        Dispatch::Host(ctx) => Box::pin(tasks::execute(ctx.clone(), task)),
                        Dispatch::Node(ctx) => Box::pin(crate::node::tasks::execute(ctx.clone(), task)),
                    };
                    running.spawn(id, work);
                }
                Ok(Some(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Cancel(cancel)) })) => {
                    if running.cancel(&cancel.task_id) {
                        tracing::info!(agent = %config.agent_id, task = %cancel.task_id, "task cancelled by the coordinator");
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) => return lost(draining, "the coordinator closed the stream".to_string()),
                Err(status) => return lost(draining, status.message().to_string()),
            }
        }
    }
}

/// The tasks one session runs, by id. Dropped with the session, it stops them all.
#[derive(Default)]
struct Running {
    tasks: Arc<std::sync::Mutex<std::collections::HashMap<String, tokio::task::AbortHandle>>>,
}

impl Running {
    fn spawn(&self, id: String, work: Pin<Box<dyn Future<Output = ()> + Send>>) {
        let tasks = self.tasks.clone();
        let key = id.clone();
        // Held while inserting, so a task that ends at once cannot remove itself before it is in.
        let mut held = self.tasks.lock().unwrap();
        let handle = tokio::spawn(async move {
            work.await;
            tasks.lock().unwrap().remove(&key);
        });
        held.insert(id, handle.abort_handle());
    }

    fn cancel(&self, id: &str) -> bool {
        let handle = self.tasks.lock().unwrap().remove(id);
        handle.map(|h| h.abort()).is_some()
    }

    fn ids(&self) -> Vec<String> {
        self.tasks.lock().unwrap().keys().cloned().collect()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for (_, handle) in self.tasks.lock().unwrap().drain() {
            handle.abort();
        }
    }
}

/// The innermost cause of a transport error: `connection refused (os error 111)`, not `transport error`.
fn source_text(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        last = s.to_string();
        source = s.source();
    }
    last
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
