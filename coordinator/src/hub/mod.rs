//! The agent hub: one `Connect` stream per builder agent, and the registry of who is connected.
//!
//! The converge engine hands a task to an [`AgentConn`] and awaits its result; the agent streams
//! progress (build log lines, bytes pushed) and answers once. An agent that goes silent past its
//! lease, or whose stream breaks, is dropped from the registry, and every task it held fails with
//! [`TaskFailure::Lost`] naming it — the engine never waits on a dead agent.

use crate::model::{AgentId, AgentRole, AgentRow};
use crate::state::StateStore;
use crate::task::{Progress, Task, TaskFailure, TaskOutcome};
use kiln_proto::v1 as pb;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

mod inventory;
pub use inventory::{Inventory, StreamId};

use crate::trust::Principal;

/// The coordinator's version; agents of the same major version are accepted.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

type Outbound = mpsc::Sender<Result<pb::CoordinatorMessage, Status>>;

/// Who is connected.
pub struct Hub {
    /// By id, so that listings come out in id order without a sort: every converge lists them
    /// (placement), and a farm has a thousand.
    agents: Mutex<BTreeMap<String, Arc<AgentConn>>>,
    changed: Notify,
    store: Arc<dyn StateStore>,
    heartbeat: Duration,
    lease: Duration,
    deadline: Duration,
    /// The build queue: host agents join it as they connect.
    pub schedule: Arc<crate::schedule::Scheduler>,
    /// What every connected agent holds, both ways round.
    pub inventory: Arc<Inventory>,
    next_stream: AtomicU64,
}

/// How often a draining agent's stream looks whether anything is left for it.
const DRAIN_CHECK: Duration = Duration::from_millis(100);

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").field("agents", &self.agents.lock().unwrap().len()).finish()
    }
}

/// One connected agent.
#[derive(Debug)]
pub struct AgentConn {
    pub id: String,
    pub role: AgentRole,
    /// What the hello announced, replaced by every later `Stores` message.
    stores: Mutex<Vec<pb::StoreInfo>>,
    pub platforms: Vec<String>,
    /// Platforms it runs through emulation only (binfmt_misc handlers), as it announced.
    pub emulates: Vec<String>,
    pub version: String,
    /// Role node: the cluster it announced; a `nodes` target of that name delivers to it.
    pub cluster: String,
    tx: Outbound,
    pending: Mutex<HashMap<String, Pending>>,
    last_seen_ms: AtomicU64,
    next_task: AtomicU64,
    /// Woken when a newer stream of the same agent replaced this one.
    closed: Notify,
    /// Context digests of the build tasks this agent runs now: the contexts it may download.
    building: Mutex<HashMap<String, usize>>,
    /// A verified agent: when its certificate was issued (a revocation covers it when later).
    issued_ms: Option<u64>,
    /// Builds it runs at once, as it announced (at least 1).
    pub slots: u32,
    /// This connection of the agent: its inventory (the refs of its last labeled listing and of
    /// every build since, and the contexts it built) is kept under it in `inventory`. Placement
    /// reads that, never a live listing.
    pub stream: StreamId,
    inventory: Arc<Inventory>,
    /// A task with no sign of life for this long is given up as stalled.
    deadline: Duration,
    /// It said `GoingAway`: it finishes what it runs and takes nothing new.
    draining: AtomicBool,
}

#[derive(Debug)]
struct Pending {
    progress: mpsc::UnboundedSender<Progress>,
    done: oneshot::Sender<pb::TaskResult>,
    /// The last sign of life: a progress message, or a heartbeat naming the task.
    alive: Arc<Mutex<Instant>>,
}

impl AgentConn {
    pub fn is_host(&self) -> bool {
        matches!(self.role, AgentRole::Host | AgentRole::Both)
    }

    /// The stores the agent holds now, in the order it announced them.
    pub fn stores(&self) -> Vec<pb::StoreInfo> {
        self.stores.lock().unwrap().clone()
    }

    fn row(&self) -> AgentRow {
        AgentRow {
            id: AgentId(self.id.clone()),
            role: self.role,
            stores: self.stores().iter().map(|s| s.id.clone()).collect(),
            platforms: self.platforms.clone(),
            version: self.version.clone(),
            last_seen_ms: self.last_seen_ms(),
        }
    }

    /// It said `GoingAway`: it finishes what it runs and takes nothing new.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// When the agent's last message (a heartbeat, progress, an answer) arrived.
    pub fn last_seen_ms(&self) -> u64 {
        self.last_seen_ms.load(Ordering::Relaxed)
    }

    /// Whether the agent's last listing, or a build since, showed `reference`.
    pub fn holds(&self, reference: &HeldRef) -> bool {
        self.inventory.holds(self.stream, reference)
    }

    /// Sends one task and waits for its result, handing every progress message to `on_progress`.
    ///
    /// A task with no sign of life for the agent's deadline fails as stalled; dropping the future
    /// (a cancelled converge) tells the agent to stop the task.
    pub async fn run(
        &self,
        converge: &str,
        task: Task,
        on_progress: impl FnMut(Progress),
    ) -> Result<TaskOutcome, TaskFailure> {
        let task_id = format!("{}-{}", self.id, self.next_task.fetch_add(1, Ordering::Relaxed));
        let name = task.name();
        let span = tracing::info_span!("task", otel.name = %format!("task {name}"), task = %task_id, agent = %self.id);
        self.run_traced(converge, task_id, task, on_progress, &span).instrument(span.clone()).await
    }

    async fn run_traced(
        &self,
        converge: &str,
        task_id: String,
        task: Task,
        mut on_progress: impl FnMut(Progress),
        span: &tracing::Span,
    ) -> Result<TaskOutcome, TaskFailure> {
        // A context goes only to a host agent running a build of it, for as long as it runs.
        let built = match &task {
            Task::Build(b) => Some((b.tag.clone(), b.context.to_string())),
            _ => None,
        };
        let _building = built.as_ref().map(|(_, digest)| Building::start(self, digest.clone()));
        let (progress_tx, mut progress_rx) = mpsc::unbounded_channel();
        let (done_tx, mut done_rx) = oneshot::channel();
        let alive = Arc::new(Mutex::new(Instant::now()));
        let pending = Pending { progress: progress_tx, done: done_tx, alive: alive.clone() };
        self.pending.lock().unwrap().insert(task_id.clone(), pending);
        let mut outstanding = Outstanding { conn: self, task_id: Some(task_id.clone()) };
        // The agent's spans join this one: the stream's metadata cannot carry a per-task context.
        let traceparent = kiln_telemetry::traceparent(span);
        let task = pb::Task {
            task_id: task_id.clone(),
            converge_id: converge.to_string(),
            kind: Some(task.into()),
            traceparent,
        };
        let msg = pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Task(task)) };
        if self.tx.send(Ok(msg)).await.is_err() {
            outstanding.settled();
            return Err(TaskFailure::Lost { agent: self.id.clone() });
        }
        let check = (self.deadline / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
        let result = loop {
            tokio::select! {
                Some(p) = progress_rx.recv() => {
                    *alive.lock().unwrap() = Instant::now();
                    on_progress(p)
                }
                done = &mut done_rx => break done,
                () = tokio::time::sleep(check) => {
                    let silent = alive.lock().unwrap().elapsed();
                    if silent >= self.deadline {
                        // `outstanding` tells the agent to stop it, in case it still runs.
                        return Err(TaskFailure::Stalled { agent: self.id.clone(), secs: silent.as_secs() });
                    }
                }
            }
        };
        outstanding.settled();
        // Progress sent just before the result still counts.
        while let Ok(p) = progress_rx.try_recv() {
            on_progress(p);
        }
        let agent = self.id.clone();
        let outcome = match result {
            Err(_) => return Err(TaskFailure::Lost { agent }),
            Ok(pb::TaskResult { outcome: None, .. }) => return Err(TaskFailure::Empty { agent }),
            Ok(pb::TaskResult { outcome: Some(outcome), .. }) => TaskOutcome::try_from(outcome)
                .map_err(|e| TaskFailure::Failed { agent, kind: e.kind, message: e.message, step: e.step })?,
        };
        match &outcome {
            TaskOutcome::Built { .. } => {
                if let Some((tag, context)) = built {
                    self.inventory.built(self.stream, HeldRef::of(&tag), context);
                }
            }
            TaskOutcome::Listing(l) => {
                let refs = l.images.iter().flat_map(|i| i.refs.iter().map(|r| normalized(r))).collect();
                self.inventory.listed(self.stream, refs);
            }
            _ => {}
        }
        Ok(outcome)
    }

    /// Whether the agent runs a build of the context `digest` now.
    pub fn builds(&self, digest: &str) -> bool {
        self.building.lock().unwrap().get(digest).is_some_and(|n| *n > 0)
    }

    fn deliver(&self, msg: pb::agent_message::Body) {
        use pb::agent_message::Body;
        match msg {
            Body::Progress(p) => {
                if let Some(pending) = self.pending.lock().unwrap().get(&p.task_id) {
                    let _ = pending.progress.send(p.into());
                }
            }
            Body::Result(r) => {
                if let Some(pending) = self.pending.lock().unwrap().remove(&r.task_id) {
                    let _ = pending.done.send(r);
                }
            }
            Body::Stores(s) => *self.stores.lock().unwrap() = s.stores,
            Body::Heartbeat(beat) => {
                let pending = self.pending.lock().unwrap();
                let now = Instant::now();
                for id in &beat.running {
                    if let Some(p) = pending.get(id) {
                        *p.alive.lock().unwrap() = now;
                    }
                }
            }
            Body::Hello(_) | Body::GoingAway(_) => {}
        }
    }
}

impl Hub {
    /// `lease`: how long an agent may be silent; `deadline`: how long a task may show no sign of
    /// life; `affinity_wait`: how long a build waits for a warm agent.
    pub fn new(store: Arc<dyn StateStore>, lease: Duration, deadline: Duration, affinity_wait: Duration) -> Hub {
        let inventory = Arc::new(Inventory::default());
        Hub {
            agents: Mutex::new(BTreeMap::new()),
            changed: Notify::new(),
            store,
            heartbeat: (lease / 3).max(Duration::from_millis(100)),
            lease,
            schedule: crate::schedule::Scheduler::new(affinity_wait, inventory.clone()),
            inventory,
            next_stream: AtomicU64::new(1),
            deadline,
        }
    }

    /// Connected agents that take work, in id order: a draining one is left out.
    pub fn connected(&self) -> Vec<Arc<AgentConn>> {
        self.agents.lock().unwrap().values().filter(|a| !a.is_draining()).cloned().collect()
    }

    /// Every agent whose stream is open, in id order, draining ones too: who is there, as
    /// `kiln agents` and the status page show it, where [`Hub::connected`] is who takes work.
    pub fn present(&self) -> Vec<Arc<AgentConn>> {
        self.agents.lock().unwrap().values().cloned().collect()
    }

    /// Waits until some agent (dis)connects, or `timeout` passes.
    pub async fn changed(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.changed.notified()).await;
    }

    fn register(&self, conn: Arc<AgentConn>) {
        // A reconnecting agent replaces its old stream. The old one is told and closed — never
        // left connected but unregistered — and its tasks fail as lost, to be run elsewhere.
        self.inventory.join(conn.stream);
        let old = self.agents.lock().unwrap().insert(conn.id.clone(), conn.clone());
        if let Some(old) = old.filter(|old| !Arc::ptr_eq(old, &conn)) {
            let why = format!("agent {} connected again; this older stream is closed", old.id);
            let _ = old.tx.try_send(Err(Status::aborted(why)));
            old.closed.notify_one();
            old.pending.lock().unwrap().clear();
            self.schedule.left(&old);
            self.inventory.leave(old.stream);
        }
        if conn.is_host() {
            self.schedule.joined(conn);
        }
        self.changed.notify_waiters();
    }

    /// Drops `conn`; true when it was the agent's current stream (not one a newer stream replaced).
    fn unregister(&self, conn: &Arc<AgentConn>) -> bool {
        let mut agents = self.agents.lock().unwrap();
        let current = agents.get(&conn.id).is_some_and(|current| Arc::ptr_eq(current, conn));
        if current {
            agents.remove(&conn.id);
        }
        drop(agents);
        // Dropping the senders fails every waiting task with `Lost`.
        conn.pending.lock().unwrap().clear();
        self.schedule.left(conn);
        self.inventory.leave(conn.stream);
        self.changed.notify_waiters();
        current
    }
}

/// A task sent and not yet answered. Dropped unsettled — the converge was cancelled, or the task
/// stalled — it is forgotten here and the agent is told to stop it.
struct Outstanding<'a> {
    conn: &'a AgentConn,
    task_id: Option<String>,
}

impl Outstanding<'_> {
    fn settled(&mut self) {
        if let Some(id) = self.task_id.take() {
            self.conn.pending.lock().unwrap().remove(&id);
        }
    }
}

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        let Some(task_id) = self.task_id.take() else { return };
        self.conn.pending.lock().unwrap().remove(&task_id);
        let cancel =
            pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Cancel(pb::Cancel { task_id })) };
        // Best effort: a full or closed stream means the agent is going away anyway.
        let _ = self.conn.tx.try_send(Ok(cancel));
    }
}

/// One build of a context on an agent, counted while it runs.
struct Building<'a> {
    conn: &'a AgentConn,
    digest: String,
}

impl<'a> Building<'a> {
    fn start(conn: &'a AgentConn, digest: String) -> Building<'a> {
        *conn.building.lock().unwrap().entry(digest.clone()).or_default() += 1;
        Building { conn, digest }
    }
}

impl Drop for Building<'_> {
    fn drop(&mut self) {
        let mut building = self.conn.building.lock().unwrap();
        if let Some(n) = building.get_mut(&self.digest) {
            *n -= 1;
            if *n == 0 {
                building.remove(&self.digest);
            }
        }
    }
}

/// The stores a verified agent may announce: its own (every store id ends `@<agent id>`), and a
/// node agent no host store. Anything else is dropped: an agent cannot be handed another's tasks
/// by naming its store.
fn own_stores(principal: &Principal, stores: Vec<pb::StoreInfo>) -> Vec<pb::StoreInfo> {
    let Principal::Agent { id, role, .. } = principal else { return stores };
    let suffix = format!("@{id}");
    stores
        .into_iter()
        .filter(|s| {
            let ours = s.id.ends_with(&suffix);
            let host_store = matches!(s.kind(), pb::store_info::Kind::Host | pb::store_info::Kind::Unspecified);
            let allowed = ours && !(*role == AgentRole::Node && host_store);
            if !allowed {
                tracing::warn!(agent = %id, store = %s.id, "an agent announced a store that is not its own; ignored");
            }
            allowed
        })
        .collect()
}

impl Hub {
    /// A connected agent by id.
    pub fn agent(&self, id: &str) -> Option<Arc<AgentConn>> {
        self.agents.lock().unwrap().get(id).cloned()
    }

    /// Closes the stream of every connected agent whose certificate a revocation covers: it is
    /// refused at its next connection too, by the guard.
    pub fn drop_revoked(&self, revoked: &[(String, u64)]) {
        let agents: Vec<Arc<AgentConn>> = self.agents.lock().unwrap().values().cloned().collect();
        for conn in agents {
            let Some(issued) = conn.issued_ms else { continue };
            if revoked.iter().any(|(id, at)| *id == conn.id && issued <= *at) {
                tracing::warn!(agent = %conn.id, "agent revoked; its stream is closed");
                let _ = conn.tx.try_send(Err(Status::permission_denied(format!("agent {} was revoked", conn.id))));
                conn.closed.notify_one();
                conn.pending.lock().unwrap().clear();
            }
        }
    }
}

/// A ref in the spelling agents' inventories are kept in. Made once per plan or task: placement
/// asks a thousand agents about one ref, and parsing it for each cost the farm most of its CPU.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HeldRef(String);

impl HeldRef {
    pub fn of(reference: &str) -> HeldRef {
        HeldRef(normalized(reference))
    }
}

/// One spelling per ref: Docker lists `x:t` where a plan may say `docker.io/library/x:t`.
fn normalized(reference: &str) -> String {
    kiln_core::refs::ImageRef::parse(reference).map_or_else(|_| reference.to_string(), |r| r.normalized())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn major(version: &str) -> &str {
    version.split('.').next().unwrap_or(version)
}

/// The `AgentHub` gRPC service.
#[derive(Debug, Clone)]
pub struct HubService {
    pub hub: Arc<Hub>,
}

#[tonic::async_trait]
impl pb::agent_hub_server::AgentHub for HubService {
    type ConnectStream = ReceiverStream<Result<pb::CoordinatorMessage, Status>>;

    async fn connect(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let principal = Principal::of(&request);
        let mut inbound = request.into_inner();
        let mut hello = match inbound.message().await? {
            Some(pb::AgentMessage { body: Some(pb::agent_message::Body::Hello(hello)) }) => hello,
            Some(_) => return Err(Status::invalid_argument("an agent's first message must be `hello`")),
            None => return Err(Status::invalid_argument("agent stream closed before `hello`")),
        };
        if hello.agent_id.is_empty() {
            return Err(Status::invalid_argument("hello.agent_id is empty — every agent needs a stable id"));
        }
        // A verified agent is who its certificate says: its id, role and cluster are the farm's.
        if let Principal::Agent { id, role, cluster, .. } = &principal {
            if hello.agent_id != *id {
                return Err(Status::permission_denied(format!(
                    "agent certificate names {id}, but its hello says {} — an agent id is bound to its certificate",
                    hello.agent_id
                )));
            }
            hello.role = match role {
                AgentRole::Node => pb::Role::Node,
                AgentRole::Host => pb::Role::Host,
                AgentRole::Both => pb::Role::Both,
            } as i32;
            hello.cluster = cluster.clone();
        }
        hello.stores = own_stores(&principal, std::mem::take(&mut hello.stores));
        let (tx, rx) = mpsc::channel(64);
        let hub = self.hub.clone();
        let refused = (major(&hello.version) != major(VERSION)).then(|| {
            format!(
                "agent {} speaks kiln {} but this coordinator is {VERSION}; run agents of major version {}",
                hello.agent_id,
                hello.version,
                major(VERSION)
            )
        });
        let welcome = pb::Welcome {
            coordinator_version: VERSION.to_string(),
            heartbeat_ms: hub.heartbeat.as_millis() as u64,
            refused: refused.clone().unwrap_or_default(),
        };
        let _ =
            tx.send(Ok(pb::CoordinatorMessage { body: Some(pb::coordinator_message::Body::Welcome(welcome)) })).await;
        if refused.is_some() {
            return Ok(Response::new(ReceiverStream::new(rx)));
        }
        let role = match hello.role() {
            pb::Role::Node => AgentRole::Node,
            pb::Role::Both => AgentRole::Both,
            _ => AgentRole::Host,
        };
        let conn = Arc::new(AgentConn {
            id: hello.agent_id.clone(),
            role,
            stores: Mutex::new(hello.stores.clone()),
            platforms: hello.platforms.clone(),
            emulates: hello.emulates.clone(),
            version: hello.version.clone(),
            cluster: hello.cluster.clone(),
            tx,
            pending: Mutex::new(HashMap::new()),
            last_seen_ms: AtomicU64::new(now_ms()),
            next_task: AtomicU64::new(1),
            closed: Notify::new(),
            building: Mutex::new(HashMap::new()),
            issued_ms: match &principal {
                Principal::Agent { issued_ms, .. } => Some(*issued_ms),
                _ => None,
            },
            slots: hello.slots.max(1),
            stream: hub.next_stream.fetch_add(1, Ordering::Relaxed),
            inventory: hub.inventory.clone(),
            deadline: hub.deadline,
            draining: Default::default(),
        });
        if let Err(err) = hub.store.upsert_agent(conn.row()).await {
            tracing::warn!(agent = %conn.id, error = %err, "could not record agent");
        }
        hub.register(conn.clone());
        tracing::info!(agent = %conn.id, role = %role, "agent connected");
        tokio::spawn(async move {
            let lease = hub.lease;
            let mut told_drained = false;
            loop {
                let draining = conn.draining.load(Ordering::Relaxed) && !told_drained;
                let message = tokio::select! {
                    message = tokio::time::timeout(lease, inbound.message()) => message,
                    () = conn.closed.notified() => break,
                    () = tokio::time::sleep(DRAIN_CHECK), if draining => {
                        // Nothing running and no slot held for a delivery still to come: it may go.
                        if conn.pending.lock().unwrap().is_empty() && !hub.schedule.holds_slot(&conn.id) {
                            tracing::info!(agent = %conn.id, "agent drained: nothing left for it");
                            let drained = pb::coordinator_message::Body::Drained(pb::Drained {});
                            let _ = conn.tx.send(Ok(pb::CoordinatorMessage { body: Some(drained) })).await;
                            told_drained = true;
                        }
                        continue;
                    }
                };
                match message {
                    Ok(Ok(Some(msg))) => {
                        conn.last_seen_ms.store(now_ms(), Ordering::Relaxed);
                        match msg.body {
                            Some(pb::agent_message::Body::GoingAway(bye)) => {
                                // It finishes its running tasks (their results still come on this
                                // stream) and closes the stream itself; nothing new is placed on it.
                                tracing::info!(agent = %conn.id, reason = %bye.reason, "agent draining");
                                conn.draining.store(true, Ordering::Relaxed);
                                hub.schedule.left(&conn);
                                hub.changed.notify_waiters();
                            }
                            Some(pb::agent_message::Body::Stores(mut stores)) => {
                                stores.stores = own_stores(&principal, stores.stores);
                                let ids: Vec<&str> = stores.stores.iter().map(|s| s.id.as_str()).collect();
                                tracing::info!(agent = %conn.id, stores = ?ids, "agent's stores changed");
                                conn.deliver(pb::agent_message::Body::Stores(stores));
                                if let Err(err) = hub.store.upsert_agent(conn.row()).await {
                                    tracing::warn!(agent = %conn.id, error = %err, "could not record agent");
                                }
                            }
                            Some(body) => conn.deliver(body),
                            // A message kind from a newer agent: ignored, as the proto promises.
                            None => {}
                        }
                    }
                    Ok(Ok(None)) | Ok(Err(_)) => break,
                    Err(_) => {
                        tracing::warn!(agent = %conn.id, lease_ms = lease.as_millis() as u64, "agent silent past its lease");
                        break;
                    }
                }
            }
            // The row keeps when the agent was last heard from, so `kiln agents` and the status
            // page say when a gone agent went; a stream a newer one replaced leaves the row alone.
            if hub.unregister(&conn) {
                if let Err(err) = hub.store.upsert_agent(conn.row()).await {
                    tracing::warn!(agent = %conn.id, error = %err, "could not record agent");
                }
            }
            tracing::info!(agent = %conn.id, "agent disconnected");
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
