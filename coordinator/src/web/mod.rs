//! The coordinator's HTTP side (`kiln-coordinator --http ADDR`): `/metrics` for Prometheus,
//! `/healthz` and `/readyz` for probes, and later the status page. Off unless an address is given, and never in the CLI's embedded mode:
//! a developer's `kiln up` opens no port beyond the loopback gRPC one it needs.
//!
//! Plain HTTP/1 through axum's router on hyper (both already built for tonic). What it serves is
//! read-only and holds no secret, but does name owners and stores: bind it to loopback or an
//! operator's network, as the deploy files do.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::engine::Engine;
use crate::state::leadership::Activity;

/// The HTTP listener while it runs; dropping it stops it and every connection it holds.
#[derive(Debug)]
pub(crate) struct Listening(tokio::task::JoinHandle<()>);

impl Drop for Listening {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Binds `addr` and serves the coordinator's pages from `engine` until the returned handle drops.
pub(crate) async fn start(
    addr: SocketAddr,
    engine: Arc<Engine>,
    activity: watch::Receiver<Activity>,
) -> std::io::Result<Listening> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    Ok(Listening(tokio::spawn(serve(listener, router(engine).merge(probes(activity))))))
}

fn router(engine: Arc<Engine>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(engine)
}

/// Probes for process managers that cannot speak gRPC over TLS (the kubelet's `grpc:` probe is
/// plaintext only): `/healthz` answers while the process serves; `/readyz` only while this
/// coordinator is the farm's active one — a standby is alive but must get no traffic.
fn probes(activity: watch::Receiver<Activity>) -> Router {
    Router::new().route("/healthz", get(|| async { "ok\n" })).route("/readyz", get(ready)).with_state(activity)
}

async fn ready(State(activity): State<watch::Receiver<Activity>>) -> impl IntoResponse {
    match &*activity.borrow() {
        Activity::Active => (StatusCode::OK, "active\n".to_string()),
        Activity::Standby { active: Some(addr) } => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("standing by; the active coordinator is at {addr}\n"))
        }
        Activity::Standby { active: None } => {
            (StatusCode::SERVICE_UNAVAILABLE, "standing by; no coordinator holds the farm's lease yet\n".to_string())
        }
    }
}

async fn metrics(State(engine): State<Arc<Engine>>, headers: HeaderMap) -> impl IntoResponse {
    engine.metrics.observe(&engine).await;
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
    let (content_type, body) = engine.metrics.encode(accept);
    ([(header::CONTENT_TYPE, content_type)], body)
}

/// Accepts until dropped. Connections live in a `JoinSet`, so they end with the listener rather
/// than outliving the coordinator on a scraper's keep-alive.
async fn serve(listener: TcpListener, app: Router) {
    let mut connections = JoinSet::new();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of file descriptors, most likely: wait rather than spin on the error.
                tracing::warn!(error = %err, "HTTP accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        connections.spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
        });
        while connections.try_join_next().is_some() {}
    }
}
