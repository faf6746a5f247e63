//! The agent's own `/metrics` (`kiln-agent --metrics ADDR`): how long its builds take, how many
//! of its slots are busy, what Kiln holds on each store it serves, and removals that failed.
//!
//! One [`AgentMetrics`] per running agent, made in `run` and kept across reconnects (a counter
//! must not restart because the coordinator did). The store gauges are set from the listings the
//! agent already answers — the coordinator lists every store before each sweep and decision — so
//! measuring costs no extra call to Docker or containerd.
//!
//! The serving loop mirrors the coordinator's `web` module; the two crates share no library
//! beneath them that may open sockets (`core` is pure), and thirty lines do not make one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use kiln_core::sweep::LABEL_KIND;
use kiln_proto::v1 as pb;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    /// `built` or `failed` (a cancelled build is neither: it is not observed).
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Source {
    /// `cache` (an archive this agent verified before) or `coordinator` (downloaded and verified).
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Store {
    /// The store's id as announced: `docker@AGENT`, `kind:NODE@AGENT`, `containerd@AGENT`, `cri@AGENT`.
    store: String,
}

/// The agent's instruments, registered under `kiln_agent_`.
#[derive(Debug)]
pub(crate) struct AgentMetrics {
    registry: Registry,
    build_seconds: Family<Outcome, Histogram, fn() -> Histogram>,
    slots_busy: Gauge,
    store_images: Family<Store, Gauge>,
    store_bytes: Family<Store, Gauge>,
    removal_failures: Family<Store, Counter>,
    contexts: Family<Source, Counter>,
}

impl AgentMetrics {
    /// `slots`: the builds this agent runs at once, as it announces them (0 for a node agent).
    pub(crate) fn new(slots: u32) -> AgentMetrics {
        // 0.1 s to ~40 min: a cached build answers in well under a second, a cold one in minutes.
        let build_seconds: Family<Outcome, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.1, 2.5, 12)));
        let mut m = AgentMetrics {
            registry: Registry::with_prefix("kiln_agent"),
            build_seconds,
            slots_busy: Gauge::default(),
            store_images: Family::default(),
            store_bytes: Family::default(),
            removal_failures: Family::default(),
            contexts: Family::default(),
        };
        let slots_gauge: Gauge = Gauge::default();
        slots_gauge.set(i64::from(slots));
        let r = &mut m.registry;
        r.register(
            "build_duration_seconds",
            "Build tasks from fetching the context to the built image, by outcome",
            m.build_seconds.clone(),
        );
        r.register("build_slots", "Builds this agent runs at once", slots_gauge);
        r.register("build_slots_busy", "Builds running now", m.slots_busy.clone());
        r.register(
            "store_images",
            "Kiln's images (labeled kiln.dev/kind) on each store at its last listing",
            m.store_images.clone(),
        );
        r.register(
            "store_bytes",
            "Bytes of Kiln's images on each store at its last listing, shared layers once",
            m.store_bytes.clone(),
        );
        r.register("removal_failures", "Removals a store refused, by store", m.removal_failures.clone());
        r.register("build_contexts", "Build contexts placed for a build, by where they came from", m.contexts.clone());
        m
    }

    /// Where a build's context came from: this agent's cache, or the coordinator.
    pub(crate) fn context_placed(&self, placed: crate::contexts::Placed) {
        let source = match placed {
            crate::contexts::Placed::Held => "cache",
            crate::contexts::Placed::Fetched => "coordinator",
        };
        self.contexts.get_or_create(&Source { source }).inc();
    }

    /// A build starting: busy until the returned guard drops, however the task ends.
    pub(crate) fn building(&self) -> Building<'_> {
        self.slots_busy.inc();
        Building { metrics: self, started: Instant::now() }
    }

    /// What a task's answer says about its store: a listing sets its gauges, a removal counts
    /// its failures.
    pub(crate) fn answered(&self, store: &str, outcome: &pb::task_result::Outcome) {
        let store = Store { store: store.to_string() };
        match outcome {
            pb::task_result::Outcome::Listing(listing) => {
                let (images, bytes) = kiln_held(&listing.images);
                self.store_images.get_or_create(&store).set(images as i64);
                self.store_bytes.get_or_create(&store).set(bytes as i64);
            }
            pb::task_result::Outcome::Removed(removed) if !removed.failures.is_empty() => {
                self.removal_failures.get_or_create(&store).inc_by(removed.failures.len() as u64);
            }
            _ => {}
        }
    }

    fn encode(&self, accept: &str) -> (&'static str, String) {
        use prometheus_client::encoding::{prometheus_text, text};
        let mut body = String::new();
        // Writing into a String cannot fail.
        if accept.contains("application/openmetrics-text") {
            let _ = text::encode(&mut body, &self.registry);
            ("application/openmetrics-text; version=1.0.0; charset=utf-8", body)
        } else {
            let _ = prometheus_text::encode(&mut body, &self.registry);
            (prometheus_text::CONTENT_TYPE, body)
        }
    }
}

/// A build in flight; see [`AgentMetrics::building`].
pub(crate) struct Building<'a> {
    metrics: &'a AgentMetrics,
    started: Instant,
}

impl Building<'_> {
    pub(crate) fn finished(self, built: bool) {
        let outcome = Outcome { outcome: if built { "built" } else { "failed" } };
        self.metrics.build_seconds.get_or_create(&outcome).observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for Building<'_> {
    fn drop(&mut self) {
        self.metrics.slots_busy.dec();
    }
}

/// Kiln's images in a listing and their bytes: each layer once by its chain when the store
/// listed layers (images share their bases), else each image whole.
fn kiln_held(images: &[pb::ListedImage]) -> (usize, u64) {
    let ours: Vec<&pb::ListedImage> = images.iter().filter(|i| i.labels.contains_key(LABEL_KIND)).collect();
    let mut layers: HashMap<&str, u64> = HashMap::new();
    let mut whole = 0;
    for image in &ours {
        match image.layers.is_empty() {
            true => whole += image.bytes,
            false => layers.extend(image.layers.iter().map(|l| (l.chain.as_str(), l.bytes))),
        }
    }
    (ours.len(), whole + layers.values().sum::<u64>())
}

/// The `/metrics` listener while it runs; dropping it stops it and its connections.
#[derive(Debug)]
pub(crate) struct Listening(tokio::task::JoinHandle<()>);

impl Drop for Listening {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Binds `addr` and serves `/metrics` until the returned handle drops.
pub(crate) async fn start(addr: SocketAddr, metrics: Arc<AgentMetrics>) -> std::io::Result<Listening> {
    use axum::http::{header, HeaderMap};
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics");
    let handler = |axum::extract::State(metrics): axum::extract::State<Arc<AgentMetrics>>, headers: HeaderMap| async move {
        let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
        let (content_type, body) = metrics.encode(accept);
        ([(header::CONTENT_TYPE, content_type)], body)
    };
    let app = axum::Router::new().route("/metrics", axum::routing::get(handler)).with_state(metrics);
    let serve =
        kiln_telemetry::http::serve(listener, move |_| hyper_util::service::TowerToHyperService::new(app.clone()));
    Ok(Listening(tokio::spawn(serve)))
}
