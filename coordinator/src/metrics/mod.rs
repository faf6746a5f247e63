//! What the coordinator measures of itself: the Prometheus instruments behind `/metrics` (served
//! by `web`), and the dispatch log benchmarks read (`dispatches`).
//!
//! One [`Metrics`] per served coordinator, made in `serve` and handed to the parts that count —
//! never a global: two coordinators in one process (the tests, the CLI's second read-only one)
//! must not add into each other's counters. Gauges of what is true *now* (agents, queue, claims)
//! are not kept up to date by hand: [`Metrics::observe`] reads them from the hub and the state at
//! every scrape, so they cannot drift from what they describe.
//!
//! The dispatch log stays a process-wide static: the benchmarks that read it run a farm through
//! the CLI's embedded mode and hold no handle to its coordinator.

mod dispatches;
pub(crate) mod names;

pub use dispatches::{dispatches, Dispatch};
pub(crate) use dispatches::{enqueued, granted};

use names::{ConvergeLabels, JobLabels, Method, Reason, Role, Store, TargetLabel};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A family of histograms sharing one bucket layout.
pub(crate) type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// The coordinator's instruments, registered under `kiln_`.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `kiln_converges_total{kind, outcome, owner}`: ups, downs and gcs as they end.
    pub(crate) converges: Family<ConvergeLabels, Counter>,
    pub(crate) converge_seconds: Histograms<JobLabels>,
    /// Built images by why they were built (`built`, `rebuilt_gone`).
    pub(crate) builds: Family<Reason, Counter>,
    /// Built images whose build was skipped, by why (`recorded`, `held`, `held_by_farm`, `gone`).
    pub(crate) skips: Family<Reason, Counter>,
    /// From a build task entering the farm's queue to its slot.
    pub(crate) dispatch_seconds: Histogram,
    pub(crate) queue_depth: Gauge,
    pub(crate) queue_oldest_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub(crate) slots: Gauge,
    pub(crate) slots_busy: Gauge,
    pub(crate) agents: Family<Role, Gauge>,
    pub(crate) claims: Gauge,
    pub(crate) uploaded_bytes: Counter,
    pub(crate) delivered_bytes: Family<TargetLabel, Counter>,
    pub(crate) sweep_removals: Family<Store, Counter>,
    pub(crate) freed_bytes: Family<Store, Counter>,
    pub(crate) not_swept: Family<Store, Counter>,
    pub(crate) state_seconds: Histograms<Method>,
    /// A converge's labeled listing of a host store, from the ask to the answer: what a no-op
    /// converge to `local` waits on besides its one write.
    pub(crate) host_listing_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        // 50 ms to ~20 min: a no-op converge is a few milliseconds of work plus its RPCs, a cold
        // build of a big image many minutes.
        let converge_seconds: Histograms<JobLabels> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.05, 2.5, 12)));
        // 1 ms to ~17 min: a free slot answers at once, a busy farm queues for minutes.
        let dispatch_seconds = Histogram::new(exponential_buckets(0.001, 4.0, 11));
        // 0.1 ms to ~26 s: SQLite answers in microseconds, a PostgreSQL farm in milliseconds, and
        // the slow tail is what this histogram is for.
        let state_seconds: Histograms<Method> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 4.0, 10)));
        // 0.5 ms to ~16 s, doubling: an idle agent answers in a millisecond or two, one behind a
        // busy farm in tens of them, and the tail is what matters to the waiting developer.
        let host_listing_seconds = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let mut m = Metrics {
            registry: Registry::with_prefix("kiln"),
            converges: Family::default(),
            converge_seconds,
            builds: Family::default(),
            skips: Family::default(),
            dispatch_seconds,
            queue_depth: Gauge::default(),
            queue_oldest_seconds: Gauge::default(),
            slots: Gauge::default(),
            slots_busy: Gauge::default(),
            agents: Family::default(),
            claims: Gauge::default(),
            uploaded_bytes: Counter::default(),
            delivered_bytes: Family::default(),
            sweep_removals: Family::default(),
            freed_bytes: Family::default(),
            not_swept: Family::default(),
            state_seconds,
            host_listing_seconds,
        };
        let r = &mut m.registry;
        r.register("converges", "Converges (up, down, gc) that ended, by kind, outcome and owner", m.converges.clone());
        r.register(
            "converge_duration_seconds",
            "How long converges ran, by kind and outcome",
            m.converge_seconds.clone(),
        );
        r.register(
            "builds",
            "Images built, by reason: built (the decision), rebuilt_gone (gone at its use)",
            m.builds.clone(),
        );
        r.register(
            "skips",
            "Images whose build was skipped, by reason: recorded, held, held_by_farm, gone",
            m.skips.clone(),
        );
        r.register(
            "dispatch_latency_seconds",
            "From a build task entering the queue to its slot on an agent",
            m.dispatch_seconds.clone(),
        );
        r.register("queue_depth", "Build tasks waiting for a slot", m.queue_depth.clone());
        r.register(
            "queue_oldest_wait_seconds",
            "How long the longest-waiting build task has waited",
            m.queue_oldest_seconds.clone(),
        );
        r.register("build_slots", "Build slots the connected host agents announced", m.slots.clone());
        r.register("build_slots_busy", "Build slots taken now", m.slots_busy.clone());
        r.register("agents_connected", "Agents connected now, by role", m.agents.clone());
        r.register("claims_live", "Claims (refs and contexts) whose lease has not expired", m.claims.clone());
        r.register("uploaded_bytes", "Context bytes received and verified", m.uploaded_bytes.clone());
        r.register(
            "delivered_bytes",
            "Image bytes moved to a target (pushed, exported to nodes), by target",
            m.delivered_bytes.clone(),
        );
        r.register(
            "sweep_removals",
            "Removals (untags, or whole ids) a sweep made, as the re-listing confirmed, by store",
            m.sweep_removals.clone(),
        );
        r.register(
            "sweep_freed_bytes",
            "Bytes a sweep freed, as the re-listing confirmed, by store",
            m.freed_bytes.clone(),
        );
        r.register("sweep_failures", "Planned removals that did not happen, by store", m.not_swept.clone());
        r.register("state_call_duration_seconds", "State store (database) calls, by method", m.state_seconds.clone());
        r.register(
            "host_listing_duration_seconds",
            "A converge's labeled listing of a host store, from the ask to the answer",
            m.host_listing_seconds.clone(),
        );
        m
    }

    /// The exposition: OpenMetrics when the scraper asks for it (Prometheus does), else the
    /// classic text format (curl, older scrapers). Returns the content type and the body.
    pub fn encode(&self, accept: &str) -> (&'static str, String) {
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

    /// Reads the gauges of what is true now from the hub, the queue and the state. A claim count
    /// the state cannot give is left as it was: a failed scrape of one gauge should not fail all.
    pub(crate) async fn observe(&self, engine: &crate::engine::Engine) {
        use crate::model::AgentRole;
        let agents = engine.hub.connected();
        for role in [AgentRole::Host, AgentRole::Node, AgentRole::Both] {
            let n = agents.iter().filter(|a| a.role == role).count();
            self.agents.get_or_create(&Role { role: role.name() }).set(n as i64);
        }
        let waiting: Vec<_> = engine.hub.schedule.tasks().into_iter().filter(|t| t.agent.is_empty()).collect();
        self.queue_depth.set(waiting.len() as i64);
        let oldest = waiting.iter().map(|t| t.since.elapsed()).max().unwrap_or_default();
        self.queue_oldest_seconds.set(oldest.as_secs_f64());
        let (slots, busy) = engine.hub.schedule.slots();
        self.slots.set(i64::from(slots));
        self.slots_busy.set(i64::from(busy));
        if let Ok(claims) = engine.store.live_claims(crate::engine::now_ms()).await {
            self.claims.set(claims.len() as i64);
        }
    }

    /// Counts a build skipped for `reason`.
    pub(crate) fn skipped(&self, reason: &crate::model::Reason) {
        self.skips.get_or_create(&Reason::skip(reason)).inc();
    }

    /// Counts an image built for `reason`.
    pub(crate) fn built(&self, reason: &crate::model::Reason) {
        self.builds.get_or_create(&Reason::build(reason)).inc();
    }

    pub(crate) fn delivered(&self, target: String, bytes: u64) {
        self.delivered_bytes.get_or_create(&TargetLabel { target }).inc_by(bytes);
    }

    /// Counts one store's sweep as its re-listing confirmed it: removals (untags, or ids on a
    /// CRI-only node), the bytes that came back, and the planned removals that did not happen.
    pub(crate) fn swept(&self, store: &str, removals: u64, bytes: u64, failed: u64) {
        let store = Store { store: store.to_string() };
        self.sweep_removals.get_or_create(&store).inc_by(removals);
        self.freed_bytes.get_or_create(&store).inc_by(bytes);
        self.not_swept.get_or_create(&store).inc_by(failed);
    }
}
