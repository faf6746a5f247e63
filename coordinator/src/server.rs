//! `serve`: the coordinator as a library. The CLI's embedded mode, `kiln-coordinator` the binary
//! and every test start this same function on a listener they bound themselves.

use crate::api::KilnService;
use crate::contexts::{ContentService, Contexts};
use crate::engine::Engine;
use crate::hub::{Hub, HubService};
use crate::relay::{Relay, RelayService};
use crate::state::leadership::{self, Activity, Held, LeasePolicy, Lost};
use crate::state::StateStore;
use kiln_proto::v1 as pb;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::Duration;
use tokio::sync::watch;

/// What a coordinator needs to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Where the SQLite state and the content-addressed context store live.
    pub state_dir: PathBuf,
    /// The farm's PostgreSQL database (`--state postgres://…`), instead of SQLite in `state_dir`;
    /// the context store and the relay's spool stay in `state_dir`.
    pub database: Option<String>,
    /// The lease by which one of a farm's coordinators is active (trivially held on SQLite).
    pub lease: LeasePolicy,
    /// The farm id every image this coordinator builds is labeled with (`kiln.dev/farm`).
    pub farm: String,
    /// How long a converge's claim on its refs lives without renewal.
    pub claim_lease: Duration,
    /// How long an agent may stay silent before its tasks are failed.
    pub agent_lease: Duration,
    /// The cluster whose namespaces get `kiln-images` and whose objects are roots; none in embedded mode.
    pub kubernetes: Option<crate::kube::KubeConfig>,
    /// Serve reads only, beside another coordinator that owns the state (a second `kiln status`
    /// while an embedded `kiln up` runs): nothing is marked failed at start, no leftover is
    /// cleaned, and every call that would change something is refused.
    pub read_only: bool,
    /// TLS and verified callers (DESIGN.md "Trust"). `None`: plaintext, and every caller is the
    /// embedded principal — the in-process default, and `--dev` on loopback.
    pub tls: Option<ServerTls>,
    /// The most bytes one context upload may carry; an upload passing it is refused at once and
    /// its partial file deleted, so an unauthenticated client cannot fill the disk with one claim.
    pub max_upload_bytes: u64,
    /// A task with no sign of life this long (no progress, not named by its agent's heartbeats)
    /// is given up and its build queued again elsewhere.
    pub task_deadline: Duration,
    /// The URL clients and agents reach this coordinator by (`--advertise`), which its standbys
    /// name to callers; by default the scheme and the address it listens on.
    pub advertise: Option<String>,
    /// How long a stopping coordinator (SIGTERM) lets running calls end before it fails what is
    /// left and hands on the lease.
    pub shutdown_grace: Duration,
    /// How long a build waits for a warm agent (one holding its image or its context's layers)
    /// before it takes any free one.
    pub affinity_wait: Duration,
    /// Where `/metrics` is served over plain HTTP (`--http`); `None`, as in embedded mode: no listener.
    pub http: Option<std::net::SocketAddr>,
}

/// A served coordinator's TLS material: its certificate chain and key, the CA its agents'
/// client certificates must chain to, and — when the farm's own CA key is here — the authority
/// that enrolls agents (an operator's PKI may keep its CA key elsewhere: then agents get their
/// certificates from it instead).
#[derive(Clone)]
pub struct ServerTls {
    pub cert_pem: String,
    pub key_pem: String,
    pub client_ca_pem: String,
    pub authority: Option<Arc<crate::trust::pki::Authority>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("enrolls", &self.authority.is_some()).finish_non_exhaustive()
    }
}

/// [`Config::max_upload_bytes`] unless configured: far above any source tree, well below a disk.
pub const DEFAULT_MAX_UPLOAD_BYTES: u64 = 8 << 30;

impl Config {
    pub fn new(state_dir: impl Into<PathBuf>, farm: impl Into<String>) -> Config {
        Config {
            state_dir: state_dir.into(),
            database: None,
            lease: LeasePolicy::default(),
            farm: farm.into(),
            claim_lease: Duration::from_secs(600),
            agent_lease: Duration::from_secs(30),
            kubernetes: None,
            read_only: false,
            tls: None,
            max_upload_bytes: DEFAULT_MAX_UPLOAD_BYTES,
            task_deadline: Duration::from_secs(30),
            affinity_wait: Duration::from_secs(2),
            advertise: None,
            shutdown_grace: Duration::from_secs(10),
            http: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot open the coordinator's state in {dir}")]
    State {
        dir: PathBuf,
        #[source]
        err: crate::state::StateError,
    },
    #[error("cannot create the context store in {dir}")]
    Contexts {
        dir: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("cannot create the image relay's spool in {dir}")]
    Relay {
        dir: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("the gRPC server stopped")]
    Transport(#[source] tonic::transport::Error),
    #[error("the TLS material is not usable")]
    Tls(#[source] tonic::transport::Error),
    #[error("cannot serve HTTP (/metrics) on {addr}")]
    Http {
        addr: std::net::SocketAddr,
        #[source]
        err: std::io::Error,
    },
    #[error("this coordinator stopped serving: its lease on the farm was {0}; restart it to stand by")]
    Lost(Lost),
}

/// Serves the coordinator's gRPC services on `listener` until `shutdown` resolves.
///
/// On a farm's PostgreSQL state it serves at once but stands by until it holds the farm's lease:
/// meanwhile every call but health is answered `Unavailable` with where the active coordinator
/// is, and health says NOT_SERVING. It stops serving if the lease is lost (the state refuses its
/// writes from then on anyway); its process manager starts it again, as a standby.
///
/// On taking the lease every converge the state still shows running is marked failed: its
/// coordinator died under it. Its claims are left to expire on their lease, so a sweep cannot
/// take what it was about to deliver while its client may still be retrying.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let dir = config.state_dir.clone();
    let state_err = |err| ServeError::State { dir: dir.clone(), err };
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let store = crate::state::open(&dir, config.database.as_deref(), !config.read_only).await.map_err(state_err)?;
    let store = crate::state::Timed::wrap(store, metrics.state_seconds.clone());
    let advertise = config.advertise.clone().unwrap_or_else(|| default_advertise(&listener, config.tls.is_some()));
    let holder = leadership::holder_id();
    // One attempt before serving: the embedded coordinator (always leading) and a farm's first
    // coordinator never answer a call as a standby.
    let first = match config.read_only {
        true => None,
        false => leadership::try_lead(store.clone(), &holder, &advertise, config.lease).await.map_err(state_err)?,
    };
    let (activity_tx, activity) = watch::channel(Activity::Standby { active: None });
    let (health, health_service) = tonic_health::server::health_reporter();
    let reason = if config.database.is_some() {
        "coordinator failed over during the converge; run `kiln up` again"
    } else {
        "the coordinator restarted while it ran; run `kiln up` again"
    };
    let mut held = None;
    if config.read_only {
        // A read-only coordinator changes nothing, so it takes no lease: it serves beside the leader.
        activity_tx.send_replace(Activity::Active);
        health.set_serving::<pb::kiln_server::KilnServer<KilnService>>().await;
    } else if let Some(first) = first {
        fail_running(&*store, reason).await.map_err(state_err)?;
        activity_tx.send_replace(Activity::Active);
        health.set_serving::<pb::kiln_server::KilnServer<KilnService>>().await;
        held = Some(first);
    } else {
        health.set_not_serving::<pb::kiln_server::KilnServer<KilnService>>().await;
    }
    let contexts_dir = dir.join("contexts");
    let contexts = Contexts::open(contexts_dir.clone(), store.clone(), !config.read_only, metrics.clone())
        .map_err(|err| ServeError::Contexts { dir: contexts_dir, err })?
        .with_upload_limit(config.max_upload_bytes);
    let verifier = Arc::new(crate::trust::Verifier::new(store.clone()));
    let mode = if config.tls.is_some() { crate::trust::Mode::Verified } else { crate::trust::Mode::Open };
    // The status page checks its sessions' tokens through the guard's verifier: one cache, so a
    // revocation reaches the page and the API alike.
    let page_gate = match mode {
        crate::trust::Mode::Verified => crate::web::Gate::Tokens(verifier.clone()),
        crate::trust::Mode::Open => crate::web::Gate::Open,
    };
    let guard = crate::trust::Guard { mode, verifier, activity: activity.clone() };
    let enrollment = crate::trust::enroll::EnrollService {
        store: store.clone(),
        authority: config.tls.as_ref().and_then(|t| t.authority.clone()),
    };
    let tls = config.tls.clone();
    let hub = Arc::new(Hub::new(store.clone(), config.agent_lease, config.task_deadline, config.affinity_wait));
    if tls.is_some() {
        // A revocation written by `kiln-coordinator agent revoke` (another process) drops the
        // agent's live stream within a few seconds.
        let (hub, store) = (hub.clone(), store.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                if let Ok(revoked) = store.revoked_agents().await {
                    hub.drop_revoked(&revoked);
                }
            }
        });
    }
    let relay_dir = dir.join("relay");
    let relay = Relay::open(relay_dir.clone()).map_err(|err| ServeError::Relay { dir: relay_dir, err })?;
    let lease = config.lease;
    let grace = config.shutdown_grace;
    let standing_by = !config.read_only && held.is_none();
    let engine = Arc::new(Engine {
        store: store.clone(),
        hub: hub.clone(),
        contexts: Arc::new(contexts),
        relay: relay.clone(),
        config,
        running: Default::default(),
        metrics,
        registries: Default::default(),
    });
    let _http = match engine.config.http {
        Some(addr) => {
            let pages = crate::web::start(addr, engine.clone(), page_gate, activity.clone()).await;
            Some(pages.map_err(|err| ServeError::Http { addr, err })?)
        }
        None => None,
    };
    let contexts = engine.contexts.clone();
    // Leading: the lease taken above, or — for a standby — the one it waits for. Ends when the
    // lease is lost, with why; the lease itself stays in `slot`, for a clean stop to resign it.
    let slot = Arc::new(std::sync::Mutex::new(held));
    let leading = {
        let slot = slot.clone();
        async move {
            let signal = slot.lock().unwrap_or_else(PoisonError::into_inner).as_ref().map(Held::lost_signal);
            let signal = match signal {
                Some(signal) => signal,
                None if !standing_by => return std::future::pending().await,
                None => {
                    let held = leadership::lead(store.clone(), &holder, &advertise, lease, &activity_tx).await?;
                    fail_running(&*store, reason).await?;
                    activity_tx.send_replace(Activity::Active);
                    health.set_serving::<pb::kiln_server::KilnServer<KilnService>>().await;
                    let signal = held.lost_signal();
                    *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(held);
                    signal
                }
            };
            let lost = signal.await;
            health.set_not_serving::<pb::kiln_server::KilnServer<KilnService>>().await;
            Ok::<_, crate::state::StateError>(lost)
        }
    };
    // Nagle off: a converge is a few small messages, and each would wait ~40 ms for an ACK.
    // Windows larger than one 1 MiB upload chunk, so a context streams without stalling; frames up
    // to 1 MiB, so a chunk crosses in one frame instead of sixty-four (+17 % upload throughput).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        // Client certificates are optional at the handshake: users come with tokens, agents with
        // certificates; the guard decides per call what each may do.
        let config = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(tls.cert_pem, tls.key_pem))
            .client_ca_root(tonic::transport::Certificate::from_pem(tls.client_ca_pem))
            .client_auth_optional(true);
        server = server.tls_config(config).map_err(ServeError::Tls)?;
    }
    let (drain, draining) = tokio::sync::oneshot::channel::<()>();
    let serving = server
        .trace_fn(request_span)
        .layer(guard)
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(16 << 20))
        .max_frame_size(Some(1 << 20))
        .add_service(health_service)
        .add_service(pb::kiln_server::KilnServer::new(KilnService { engine: engine.clone() }))
        // Every message is decoded whole before a handler sees it, so its size is a buffer an
        // unauthenticated client chooses: uploads are cut in 1 MiB chunks, and a message of the other
        // services stays at tonic's 4 MiB default.
        .add_service(
            pb::content_store_server::ContentStoreServer::new(ContentService { contexts, hub: hub.clone() })
                .max_decoding_message_size(crate::contexts::UPLOAD_MESSAGE_MAX),
        )
        .add_service(pb::agent_hub_server::AgentHubServer::new(HubService { hub }))
        .add_service(pb::image_relay_server::ImageRelayServer::new(RelayService { relay }))
        .add_service(pb::enrollment_server::EnrollmentServer::new(enrollment))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = draining.await;
        });
    tokio::pin!(serving, leading, shutdown);
    tokio::select! {
        served = &mut serving => served.map_err(ServeError::Transport)?,
        // A lost lease stops everything at once: every write would be refused anyway, and a call
        // left running here would only tell its client something the farm no longer holds.
        outcome = &mut leading => {
            return Err(match outcome {
                Ok(lost) => ServeError::Lost(lost),
                Err(err) => ServeError::State { dir, err },
            })
        }
        () = &mut shutdown => {
            // SIGTERM: no new calls; running converges get the grace period to end, then what
            // is left is failed with a reason and the lease handed on at once.
            let _ = drain.send(());
            if tokio::time::timeout(grace, &mut serving).await.is_err() {
                tracing::warn!(grace_s = grace.as_secs(), "calls still running after the shutdown grace period; ending them");
            }
        }
    }
    let held = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let Some(held) = held {
        if let Err(err) =
            fail_running(&*engine.store, "the coordinator shut down during the converge; run `kiln up` again").await
        {
            tracing::warn!(error = %kiln_core::error_chain(&err), "could not mark the running converges failed");
        }
        if let Err(err) = held.resign().await {
            tracing::warn!(error = %kiln_core::error_chain(&err), "could not resign the farm's lease");
        }
    }
    Ok(())
}

/// Every call's span, around the guard and the handler: named by its RPC, and a child of the
/// caller's span when the call carries a `traceparent` (the CLI's command, an agent's task).
/// Health checks get none: a probe every few seconds would bury the converges in one-span traces.
fn request_span(request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path();
    if path.starts_with("/grpc.health.v1.Health/") {
        return tracing::Span::none();
    }
    let span = tracing::info_span!("rpc", otel.name = %path.trim_start_matches('/'), otel.kind = "server");
    kiln_telemetry::follow_headers(&span, request.headers());
    span
}

/// Fails the converges the state shows running, with `reason`: on becoming the active coordinator
/// (its predecessor's, which nothing drives any more) and on stopping (its own, past the grace).
async fn fail_running(store: &dyn StateStore, reason: &str) -> Result<(), crate::state::StateError> {
    for id in store.fail_in_flight(reason).await? {
        tracing::warn!(converge = %id, "converge was in flight when its coordinator stopped; marked failed");
    }
    Ok(())
}

/// The URL a coordinator is reached by when `--advertise` is not given: the scheme it speaks and
/// the address it listens on — with the host's name instead of a wildcard address.
fn default_advertise(listener: &tokio::net::TcpListener, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    match listener.local_addr() {
        Ok(addr) if addr.ip().is_unspecified() => {
            let host = leadership::holder_id();
            let host = host.rsplit_once('/').map_or(host.as_str(), |(h, _)| h);
            format!("{scheme}://{host}:{}", addr.port())
        }
        Ok(addr) => format!("{scheme}://{addr}"),
        Err(_) => format!("{scheme}://unknown"),
    }
}
