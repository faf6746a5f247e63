//! The coordinator's HTTP side (`kiln-coordinator --http ADDR`): `/metrics` for Prometheus and
//! the status page at `/`. Off unless an address is given, and never in the CLI's embedded mode:
//! a developer's `kiln up` opens no port beyond the loopback gRPC one it needs.
//!
//! Plain HTTP/1 through axum's router on hyper (both already built for tonic).
//! - `/` — the status page (`view` gathers, `render` writes HTML from `page.html`), read-only;
//!   `/api/status` the same as JSON; `/api/converges/{id}/events?after=N` a converge's log (`log`).
//! - `/login`, `/logout` — when the coordinator serves TLS, the page and its JSON need a session
//!   opened with a user token (`auth`); with `--dev` they are open, as its gRPC API is.
//! - `/metrics` — open: Prometheus scrapes without credentials. It names owners and stores, so
//!   bind `--http` to loopback or an operator's network, as the deploy files do.
//! - `/healthz`, `/readyz` — open, for probes: alive, and active (a standby is not ready).

mod auth;
mod log;
mod render;
mod view;

use std::net::SocketAddr;
use std::sync::{Arc, LazyLock};

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{middleware, Extension, Form, Json, Router};
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::engine::Engine;
use crate::model::ConvergeId;
use crate::state::leadership::Activity;
use crate::state::StateError;
use crate::trust::Principal;
pub(crate) use auth::Gate;
use render::LogPart;

/// The HTTP listener while it runs; dropping it stops it and every connection it holds.
#[derive(Debug)]
pub(crate) struct Listening(tokio::task::JoinHandle<()>);

impl Drop for Listening {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What every handler shares.
#[derive(Debug)]
pub(crate) struct Web {
    engine: Arc<Engine>,
    auth: auth::Auth,
    known: Arc<view::Known>,
    /// Whether this coordinator leads its farm: a standby's page says where the active one is.
    activity: watch::Receiver<Activity>,
}

impl Web {
    /// Everything the page shows, as `who` may see it.
    async fn status(&self, who: &Principal) -> Result<view::Status, StateError> {
        let standby = match &*self.activity.borrow() {
            Activity::Standby { active } => Some(active.clone().unwrap_or_default()),
            Activity::Active => None,
        };
        view::gather(&self.engine, &self.known, who, self.auth.is_open(), standby).await
    }
}

/// Where a request came from, for the audit log's logins.
#[derive(Debug, Clone, Copy)]
struct PeerAddr(SocketAddr);

/// Binds `addr` and serves the coordinator's pages from `engine` until the returned handle drops;
/// `gate` says who may look at the status page.
pub(crate) async fn start(
    addr: SocketAddr,
    engine: Arc<Engine>,
    gate: Gate,
    activity: watch::Receiver<Activity>,
) -> std::io::Result<Listening> {
    let listener = crate::listen::listen_on(addr)?;
    let open = matches!(gate, Gate::Open);
    tracing::info!(addr = %listener.local_addr()?, login = !open, "serving the status page, /metrics, /healthz and /readyz");
    let probes = probes(activity.clone());
    let web = Arc::new(Web { engine, auth: auth::Auth::new(gate), known: Default::default(), activity });
    Ok(Listening(tokio::spawn(serve(listener, router(web).merge(probes)))))
}

fn router(web: Arc<Web>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/status", get(status))
        .route("/api/converges/{id}/events", get(events))
        .route_layer(middleware::from_fn_with_state(web.clone(), auth::require))
        .route("/login", get(login_form).post(login))
        .route("/logout", post(logout))
        .layer(middleware::map_response(protect))
        // After the layers: Prometheus needs no session, and its text needs no page headers.
        .route("/metrics", get(metrics))
        .with_state(web)
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

async fn metrics(State(web): State<Arc<Web>>, headers: HeaderMap) -> impl IntoResponse {
    let engine = &web.engine;
    engine.metrics.observe(engine).await;
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
    let (content_type, body) = engine.metrics.encode(accept);
    ([(header::CONTENT_TYPE, content_type)], body)
}

#[derive(Debug, Default, Deserialize)]
struct PageQuery {
    /// The converge whose log to show instead of the newest.
    converge: Option<String>,
    /// The script's refresh: the live sections only.
    live: Option<String>,
}

async fn page(State(web): State<Arc<Web>>, Extension(who): Extension<Principal>, query: Query<PageQuery>) -> Response {
    let status = match web.status(&who).await {
        Ok(status) => status,
        Err(err) => return unavailable(&err),
    };
    if query.live.is_some() {
        return Html(render::page(&status, LogPart::Omit)).into_response();
    }
    let picked = query.converge.is_some();
    let log = match query.0.converge.or(status.follow.clone()) {
        Some(id) => match read_log(&web.engine, &id, None, usize::MAX).await {
            Ok(log) => log,
            Err(err) => return unavailable(&err),
        },
        None => None,
    };
    Html(render::page(&status, LogPart::Show(log.as_ref(), picked))).into_response()
}

async fn status(State(web): State<Arc<Web>>, Extension(who): Extension<Principal>) -> Response {
    match web.status(&who).await {
        Ok(status) => Json(status).into_response(),
        Err(err) => unavailable(&err),
    }
}

#[derive(Debug, Deserialize)]
struct After {
    after: Option<u64>,
}

async fn events(State(web): State<Arc<Web>>, Path(id): Path<String>, Query(after): Query<After>) -> Response {
    match read_log(&web.engine, &id, after.after, log::PAGE).await {
        Ok(Some(log)) => Json(log).into_response(),
        Ok(None) => {
            let error = format!("no converge {id} — the status page lists recent ones");
            (StatusCode::NOT_FOUND, Json(serde_json::json!({ "error": error }))).into_response()
        }
        Err(err) => unavailable(&err),
    }
}

/// A converge's events after `after`, at most `limit` of them; `None` when there is no such converge.
async fn read_log(engine: &Engine, id: &str, after: Option<u64>, limit: usize) -> Result<Option<log::Log>, StateError> {
    let id = ConvergeId::from(id);
    let Some(converge) = engine.store.converge(&id).await? else { return Ok(None) };
    let mut events = engine.store.events(&id, after).await?;
    let more = events.len() > limit;
    events.truncate(limit);
    Ok(Some(log::Log {
        converge: id.to_string(),
        instance: converge.instance,
        state: converge.state.name(),
        events: events.iter().map(log::line).collect(),
        more,
    }))
}

fn unavailable(err: &StateError) -> Response {
    let error = format!("the coordinator's state cannot be read now: {}", kiln_core::error_chain(err));
    (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({ "error": error }))).into_response()
}

async fn login_form(State(web): State<Arc<Web>>, headers: HeaderMap) -> Response {
    if web.auth.is_open() || web.auth.principal(&headers).await.is_ok() {
        return Redirect::to("/").into_response();
    }
    Html(render::login(None)).into_response()
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(
    State(web): State<Arc<Web>>,
    headers: HeaderMap,
    peer: Option<Extension<PeerAddr>>,
    Form(form): Form<LoginForm>,
) -> Response {
    if web.auth.is_open() {
        return Redirect::to("/").into_response();
    }
    let address = peer.map(|p| p.0 .0.to_string()).unwrap_or_default();
    match web.auth.login(&form.token).await {
        Ok((session, user)) => {
            crate::api::audit(&web.engine, user.actor(), "login", "status page", address, "ok".into()).await;
            let cookie = auth::set_cookie(&session, &headers);
            (StatusCode::SEE_OTHER, [(header::LOCATION, HeaderValue::from_static("/")), (header::SET_COOKIE, cookie)])
                .into_response()
        }
        // Refusals are logged, not audited: anyone who reaches the port could fill the audit log.
        Err(refused) => {
            tracing::warn!(peer = %address, why = refused.why(), "status page login refused");
            (refused.status(), Html(render::login(Some(refused.why())))).into_response()
        }
    }
}

async fn logout(State(web): State<Arc<Web>>, headers: HeaderMap, peer: Option<Extension<PeerAddr>>) -> Response {
    if let Ok(user @ Principal::User { .. }) = web.auth.principal(&headers).await {
        let address = peer.map(|p| p.0 .0.to_string()).unwrap_or_default();
        crate::api::audit(&web.engine, user.actor(), "logout", "status page", address, "ok".into()).await;
    }
    web.auth.logout(&headers);
    let cookie = auth::set_cookie("", &headers);
    (StatusCode::SEE_OTHER, [(header::LOCATION, HeaderValue::from_static("/login")), (header::SET_COOKIE, cookie)])
        .into_response()
}

/// The page's Content-Security-Policy: only its own inline script and styles run (by hash), so
/// markup that ever slipped past escaping still could not execute; it talks only to its origin
/// and cannot be framed (clickjacking).
static CSP: LazyLock<HeaderValue> = LazyLock::new(|| {
    let page = include_str!("page.html");
    let login = include_str!("login.html");
    let policy = format!(
        "default-src 'none'; script-src {}; style-src {} {}; connect-src 'self'; img-src 'self'; \
         form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        inline_hash(page, "<script>", "</script>"),
        inline_hash(page, "<style>", "</style>"),
        inline_hash(login, "<style>", "</style>"),
    );
    HeaderValue::from_str(&policy).expect("a policy of ASCII")
});

/// `'sha256-…'` of the text between `open` and `close` in `html`, as CSP hashes an inline element.
fn inline_hash(html: &str, open: &str, close: &str) -> String {
    use base64::Engine as _;
    use sha2::Digest as _;
    let inner = html.split_once(open).and_then(|(_, rest)| rest.split_once(close)).map_or("", |(inner, _)| inner);
    format!("'sha256-{}'", base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(inner)))
}

async fn protect(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, CSP.clone());
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // What the page shows is live and may be private: never kept by the browser or a proxy.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Accepts until dropped; each request carries its peer's address for the audit log.
async fn serve(listener: TcpListener, app: Router) {
    kiln_telemetry::http::serve(listener, move |peer| {
        let app = app.clone();
        hyper::service::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(PeerAddr(peer));
            tower::ServiceExt::oneshot(app.clone(), request)
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_hashes_the_inline_script_and_styles() {
        let policy = CSP.to_str().unwrap();
        assert_eq!(policy.matches("'sha256-").count(), 3, "{policy}");
        assert!(!policy.contains("unsafe-inline"));
        assert_ne!(
            inline_hash(include_str!("page.html"), "<script>", "</script>"),
            inline_hash("", "<script>", "</script>")
        );
    }
}
