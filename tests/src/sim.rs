//! Simulated build hosts, the omicron way: one machine has one Docker daemon, a farm has hundreds
//! of agents. A [`SimHost`] implements the same `HostStore` trait as Docker — builds take a set
//! time, images and labels live in memory, failures can be injected — and a [`SimFarm`] runs N of
//! them as real agents (`kiln_agent::run_with`) over real gRPC to a real served coordinator. The
//! scheduler's tests and the farm benchmark use it; adapter tests keep using the real daemon.

use async_trait::async_trait;
use kiln_agent::host::{BuildSpec, Built, HostError, HostStore, ImageInfo, PushProgress, Pushed, Removal};
use kiln_core::sweep::ListedImage;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// One build as the simulation saw it.
#[derive(Clone, Debug)]
pub struct BuildRecord {
    pub tag: String,
    pub started: Instant,
    /// Microseconds since the epoch, to compare with the coordinator's own clock readings.
    pub started_us: u64,
    /// `None`: still running, or stopped before it finished (cancelled, agent killed).
    pub finished: Option<Instant>,
}

/// A build host in memory.
#[derive(Debug)]
pub struct SimHost {
    pub name: String,
    build_time: Mutex<Duration>,
    images: Mutex<BTreeMap<String, ListedImage>>,
    running: AtomicU32,
    /// The most builds this host ever ran at once.
    pub max_running: AtomicU32,
    builds: Mutex<Vec<BuildRecord>>,
    /// Builds of tags containing one of these fail (the build's own fault).
    fail: Mutex<Vec<String>>,
    /// While set, builds never finish: a build host wedged mid-build.
    pub hang: AtomicBool,
    /// Builds of tags containing one of these never finish.
    hang_of: Mutex<Vec<String>>,
    /// Inspections of refs containing one of these wait until [`SimHost::clear_hangs`]: a
    /// delivery's read-back held in progress.
    hold_inspects_of: Mutex<Vec<String>>,
    /// Labeled listings answered here.
    pub listings: AtomicU32,
}

impl SimHost {
    pub fn new(name: &str, build_time: Duration) -> Arc<SimHost> {
        Arc::new(SimHost {
            name: name.to_string(),
            build_time: Mutex::new(build_time),
            images: Mutex::new(BTreeMap::new()),
            running: AtomicU32::new(0),
            max_running: AtomicU32::new(0),
            builds: Mutex::new(Vec::new()),
            fail: Mutex::new(Vec::new()),
            hang: AtomicBool::new(false),
            hang_of: Mutex::new(Vec::new()),
            hold_inspects_of: Mutex::new(Vec::new()),
            listings: AtomicU32::new(0),
        })
    }

    pub fn set_build_time(&self, time: Duration) {
        *self.build_time.lock().unwrap() = time;
    }

    /// Builds of any tag containing `pattern` fail from now on.
    pub fn fail_builds_of(&self, pattern: &str) {
        self.fail.lock().unwrap().push(pattern.to_string());
    }

    /// Builds of any tag containing `pattern` never finish from now on (until the task is dropped).
    pub fn hang_builds_of(&self, pattern: &str) {
        self.hang_of.lock().unwrap().push(pattern.to_string());
    }

    /// Inspections of any ref containing `pattern` wait from now on, until [`SimHost::clear_hangs`].
    pub fn hold_inspects_of(&self, pattern: &str) {
        self.hold_inspects_of.lock().unwrap().push(pattern.to_string());
    }

    /// Builds held by [`SimHost::hang_builds_of`] and inspections held by
    /// [`SimHost::hold_inspects_of`] finish now.
    pub fn clear_hangs(&self) {
        self.hang_of.lock().unwrap().clear();
        self.hold_inspects_of.lock().unwrap().clear();
    }

    /// Every build begun here, in order.
    pub fn builds(&self) -> Vec<BuildRecord> {
        self.builds.lock().unwrap().clone()
    }

    pub fn running(&self) -> u32 {
        self.running.load(Ordering::SeqCst)
    }

    /// Whether an image wears `tag` here.
    pub fn holds(&self, tag: &str) -> bool {
        self.images.lock().unwrap().values().any(|i| i.refs.iter().any(|r| r == tag))
    }
}

/// Counts a build as running for as long as it is, however it ends (cancelled builds included).
struct Running<'a> {
    host: &'a SimHost,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.host.running.fetch_sub(1, Ordering::SeqCst);
    }
}

fn image_id(tag: &str) -> String {
    format!("sha256:{}", blake3::hash(tag.as_bytes()).to_hex())
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

#[async_trait]
impl HostStore for SimHost {
    async fn build(&self, _archive: &Path, spec: &BuildSpec, log: mpsc::Sender<String>) -> Result<Built, HostError> {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        let index = {
            let mut builds = self.builds.lock().unwrap();
            let record =
                BuildRecord { tag: spec.tag.clone(), started: Instant::now(), started_us: now_us(), finished: None };
            builds.push(record);
            builds.len() - 1
        };
        let _running = Running { host: self };
        let _ = log.send(format!("sim {}: building {}", self.name, spec.tag)).await;
        let time = *self.build_time.lock().unwrap();
        tokio::time::sleep(time).await;
        let hangs = |tag: &str| self.hang_of.lock().unwrap().iter().any(|p| tag.contains(p.as_str()));
        while self.hang.load(Ordering::SeqCst) || hangs(&spec.tag) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if self.fail.lock().unwrap().iter().any(|p| spec.tag.contains(p.as_str())) {
            return Err(HostError::BuildFailed {
                tag: spec.tag.clone(),
                step: "Step 1/1 : RUN false: the simulation fails this build".to_string(),
            });
        }
        let id = image_id(&spec.tag);
        let mut images = self.images.lock().unwrap();
        // The tag moves to the new image, as Docker's does.
        for image in images.values_mut() {
            image.refs.retain(|r| *r != spec.tag);
        }
        let image = images.entry(id.clone()).or_insert_with(|| ListedImage {
            id: id.clone(),
            refs: Vec::new(),
            digests: Vec::new(),
            labels: spec.labels.clone(),
            bytes: 1_000,
            layers: Vec::new(),
        });
        image.refs.push(spec.tag.clone());
        drop(images);
        self.builds.lock().unwrap()[index].finished = Some(Instant::now());
        Ok(Built { id })
    }

    async fn list_labeled(&self) -> Result<Vec<ListedImage>, HostError> {
        self.listings.fetch_add(1, Ordering::SeqCst);
        Ok(self.images.lock().unwrap().values().filter(|i| !i.refs.is_empty()).cloned().collect())
    }

    async fn tag(&self, id: &str, reference: &str) -> Result<(), HostError> {
        if let Some(image) = self.images.lock().unwrap().get_mut(id) {
            image.refs.push(reference.to_string());
        }
        Ok(())
    }

    async fn inspect(&self, reference: &str) -> Result<Option<ImageInfo>, HostError> {
        while self.hold_inspects_of.lock().unwrap().iter().any(|p| reference.contains(p.as_str())) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let images = self.images.lock().unwrap();
        let found = images.values().find(|i| i.refs.iter().any(|r| r == reference) || i.id == reference);
        Ok(found.map(|i| ImageInfo {
            id: i.id.clone(),
            bytes: i.bytes,
            labels: i.labels.clone(),
            user: None,
            repo_tags: i.refs.clone(),
            repo_digests: Vec::new(),
        }))
    }

    async fn push(&self, reference: &str, _progress: mpsc::Sender<PushProgress>) -> Result<Pushed, HostError> {
        match self.holds(reference) {
            true => Ok(Pushed { digest: None, bytes: 0 }),
            false => Err(HostError::PushFailed { reference: reference.to_string(), why: "no such image".into() }),
        }
    }

    async fn remove_tag(&self, reference: &str) -> Result<Removal, HostError> {
        let mut images = self.images.lock().unwrap();
        let mut removed = Removal::Absent;
        for image in images.values_mut() {
            let before = image.refs.len();
            image.refs.retain(|r| r != reference);
            if image.refs.len() < before {
                removed = Removal::Removed;
            }
        }
        images.retain(|_, i| !i.refs.is_empty());
        Ok(removed)
    }

    async fn remove_image(&self, id: &str) -> Result<Removal, HostError> {
        match self.images.lock().unwrap().remove(id) {
            Some(_) => Ok(Removal::Removed),
            None => Ok(Removal::Absent),
        }
    }

    async fn images_in_use(&self) -> Result<Vec<String>, HostError> {
        Ok(Vec::new())
    }

    async fn ping(&self) -> Result<(), HostError> {
        Ok(())
    }

    async fn export(&self, reference: &str) -> Result<kiln_agent::host::ExportStream, HostError> {
        Err(HostError::PushFailed { reference: reference.to_string(), why: "a simulated host exports nothing".into() })
    }

    async fn kind_load(
        &self,
        cluster: &str,
        reference: &str,
        _id: &str,
        _name: &str,
    ) -> Result<kiln_agent::host::KindLoad, HostError> {
        Err(HostError::NoKindNodes { cluster: format!("{cluster} (simulated host, cannot load {reference})") })
    }
}

/// One simulated agent: a `SimHost` behind the real agent loop.
#[derive(Debug)]
pub struct SimAgent {
    pub id: String,
    pub store: Arc<SimHost>,
    task: Option<JoinHandle<()>>,
    stop: Option<oneshot::Sender<()>>,
}

/// A served coordinator on a free loopback port and N simulated host agents connected to it.
#[derive(Debug)]
pub struct SimFarm {
    pub url: String,
    pub state: tempfile::TempDir,
    pub agents: Vec<SimAgent>,
    coordinator: Option<(oneshot::Sender<()>, JoinHandle<()>)>,
}

impl SimFarm {
    /// A coordinator (configured by `configure`) and `agents` simulated hosts with `slots` each
    /// and builds of `build_time`; returns once every agent is connected.
    pub async fn start(
        agents: usize,
        slots: u32,
        build_time: Duration,
        configure: impl FnOnce(&mut kiln_coordinator::Config),
    ) -> SimFarm {
        SimFarm::start_with(agents, slots, build_time, configure, |_| {}).await
    }

    /// [`SimFarm::start`], with every agent's configuration changed by `agent` before it starts.
    pub async fn start_with(
        agents: usize,
        slots: u32,
        build_time: Duration,
        configure: impl FnOnce(&mut kiln_coordinator::Config),
        agent: impl Fn(&mut kiln_agent::AgentConfig),
    ) -> SimFarm {
        let state = tempfile::tempdir().expect("temp dir");
        let listener = kiln_coordinator::listen("127.0.0.1:0").await.expect("bind loopback");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let mut config = kiln_coordinator::Config::new(state.path().join("state"), "sim-farm");
        configure(&mut config);
        let (stop, stopped) = oneshot::channel::<()>();
        let coordinator = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(err) = kiln_coordinator::serve(listener, config, shutdown).await {
                panic!("simulated farm's coordinator failed: {}", kiln_core::error_chain(&err));
            }
        });
        let mut farm = SimFarm { url, state, agents: Vec::new(), coordinator: Some((stop, coordinator)) };
        for i in 0..agents {
            farm.add_agent_with(&format!("sim-{i:04}"), slots, build_time, &agent);
        }
        farm.wait_connected(agents).await;
        farm
    }

    /// `agents` simulated hosts joining the coordinator already serving at `url` (another process:
    /// `kiln-bench farm --external`); returns once every agent is connected.
    pub async fn join(url: &str, agents: usize, slots: u32, build_time: Duration) -> SimFarm {
        SimFarm::join_with(url, agents, slots, build_time, |_| {}).await
    }

    /// [`SimFarm::join`], with every agent's configuration changed by `agent` before it starts.
    pub async fn join_with(
        url: &str,
        agents: usize,
        slots: u32,
        build_time: Duration,
        agent: impl Fn(&mut kiln_agent::AgentConfig),
    ) -> SimFarm {
        let state = tempfile::tempdir().expect("temp dir");
        let mut farm = SimFarm { url: url.to_string(), state, agents: Vec::new(), coordinator: None };
        for i in 0..agents {
            farm.add_agent_with(&format!("sim-{i:04}"), slots, build_time, &agent);
        }
        farm.wait_connected(agents).await;
        farm
    }

    /// Starts one more simulated agent (not waited for).
    pub fn add_agent(&mut self, id: &str, slots: u32, build_time: Duration) -> Arc<SimHost> {
        self.add_agent_with(id, slots, build_time, |_| {})
    }

    /// [`SimFarm::add_agent`], with its configuration changed by `configure` (its `/metrics`, its
    /// context cache) before it starts.
    pub fn add_agent_with(
        &mut self,
        id: &str,
        slots: u32,
        build_time: Duration,
        configure: impl FnOnce(&mut kiln_agent::AgentConfig),
    ) -> Arc<SimHost> {
        let store = SimHost::new(id, build_time);
        let mut config = kiln_agent::AgentConfig {
            slots,
            ..kiln_agent::AgentConfig::new(self.url.clone(), id.to_string(), self.state.path().join("scratch").join(id))
        };
        configure(&mut config);
        let (stop, stopped) = oneshot::channel::<()>();
        let shared: Arc<dyn HostStore> = store.clone();
        let task = tokio::spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            let _ = kiln_agent::run_with(config, shared, shutdown).await;
        });
        self.agents.push(SimAgent { id: id.to_string(), store: store.clone(), task: Some(task), stop: Some(stop) });
        store
    }

    /// Kills agent `i` the way a crash does: its loop is dropped mid-whatever, its stream breaks
    /// without a goodbye.
    pub fn kill(&mut self, i: usize) {
        let agent = &mut self.agents[i];
        agent.stop.take();
        if let Some(task) = agent.task.take() {
            task.abort();
        }
    }

    /// Tells agent `i` to stop the way SIGTERM does: it says `GoingAway`, finishes what it runs
    /// (handing it back past its drain grace), then exits.
    pub fn stop_agent(&mut self, i: usize) {
        if let Some(stop) = self.agents[i].stop.take() {
            let _ = stop.send(());
        }
    }

    /// Waits until the coordinator lists `n` connected agents.
    pub async fn wait_connected(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if self.connected().await >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {} of {n} simulated agents connected in 60 s",
                self.connected().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// How many agents the coordinator sees connected.
    pub async fn connected(&self) -> usize {
        let Ok(mut client) = self.client().await else { return 0 };
        match client.agents(kiln_proto::v1::AgentsRequest {}).await {
            Ok(reply) => reply.into_inner().agents.iter().filter(|a| a.connected).count(),
            Err(_) => 0,
        }
    }

    pub async fn client(
        &self,
    ) -> Result<kiln_proto::v1::kiln_client::KilnClient<tonic::transport::Channel>, tonic::transport::Error> {
        let channel =
            tonic::transport::Endpoint::from_shared(self.url.clone()).expect("url").tcp_nodelay(true).connect().await?;
        Ok(kiln_proto::v1::kiln_client::KilnClient::new(channel))
    }

    /// Every build every agent began, with the agent's id.
    pub fn builds(&self) -> Vec<(String, BuildRecord)> {
        let mut all: Vec<(String, BuildRecord)> =
            self.agents.iter().flat_map(|a| a.store.builds().into_iter().map(|b| (a.id.clone(), b))).collect();
        all.sort_by_key(|(_, b)| b.started);
        all
    }

    pub async fn stop(mut self) {
        for agent in &mut self.agents {
            if let Some(stop) = agent.stop.take() {
                let _ = stop.send(());
            }
            if let Some(task) = agent.task.take() {
                let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
            }
        }
        if let Some((stop, task)) = self.coordinator.take() {
            let _ = stop.send(());
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }
}

/// Writes an instance folder: `kiln.toml` naming `images` (name, content, FROM base or none) built
/// `FROM scratch` (or FROM their base) for a `local` target. Each context holds one file, so
/// different content gives a different address.
pub fn write_instance(dir: &Path, instance: &str, team: Option<&str>, images: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).expect("instance dir");
    let mut toml = String::new();
    if let Some(team) = team {
        toml.push_str(&format!("team = \"{team}\"\n"));
    }
    toml.push_str(&format!("instance = \"{instance}\"\n\n[target]\nkind = \"local\"\n"));
    for (name, content) in images {
        let context = dir.join(name);
        std::fs::create_dir_all(&context).expect("context dir");
        std::fs::write(context.join("Dockerfile"), "FROM scratch\nCOPY f /f\n").expect("Dockerfile");
        std::fs::write(context.join("f"), content).expect("context file");
        toml.push_str(&format!("\n[built.{name}]\ncontext = \"{name}\"\n"));
    }
    std::fs::write(dir.join("kiln.toml"), toml).expect("kiln.toml");
}

/// A fake agent, as a stranger's probe would write one: it says hello as a host with `slots`
/// slots, heartbeats forever, and never answers a task nor names one in its heartbeats.
pub async fn silent_agent(url: &str, id: &str, slots: u32) -> JoinHandle<()> {
    use kiln_proto::v1 as pb;
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(16);
    let hello = pb::Hello {
        agent_id: id.to_string(),
        role: pb::Role::Host as i32,
        stores: vec![pb::StoreInfo {
            id: format!("docker@{id}"),
            kind: pb::store_info::Kind::Host as i32,
            cluster: String::new(),
        }],
        version: env!("CARGO_PKG_VERSION").to_string(),
        slots,
        ..Default::default()
    };
    tx.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Hello(hello)) }).await.expect("queue hello");
    let channel = tonic::transport::Endpoint::from_shared(url.to_string()).expect("url").connect_lazy();
    let mut client = pb::agent_hub_client::AgentHubClient::new(channel);
    let mut inbound =
        client.connect(tokio_stream::wrappers::ReceiverStream::new(rx)).await.expect("connect").into_inner();
    tokio::spawn(async move {
        let mut beat = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = beat.tick() => {
                    let hb = pb::Heartbeat { at_ms: 0, running: Vec::new() };
                    if tx.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Heartbeat(hb)) }).await.is_err() {
                        return;
                    }
                }
                message = inbound.message() => if !matches!(message, Ok(Some(_))) { return },
            }
        }
    })
}
