//! Who may look at the status page. A coordinator serving TLS verifies its callers (DESIGN.md
//! "Trust"), so its page does too: a user token of any role (viewer and up) posted once to
//! `/login` opens a session; without TLS (`--dev`) the page is open, as the gRPC API is.
//!
//! The cookie holds a random session id, never the token: a user's token may be a member's or an
//! admin's, good for `kiln up` and `kiln gc` over gRPC, while a session id only reads this page,
//! lives 12 hours at most, dies with the process and on "log out". Each request checks the
//! session's token again (through the guard's [`Verifier`], so a revoked or expired token stops
//! working here within the same 2 s as over gRPC). Sessions are in memory: a restart or a failover
//! asks for the token again, which is cheaper than a table every coordinator must share.
//!
//! The cookie is `HttpOnly` (no script reads it) and `SameSite=Strict` (no other site's page
//! sends it, so the page's reads cannot be ridden cross-site). It is `Secure` only when a
//! TLS-terminating proxy says the browser spoke https (`X-Forwarded-Proto: https`): this listener
//! itself speaks plain HTTP, and a browser never sends a `Secure` cookie back over plain HTTP, so
//! marking it always would make logging in impossible without a proxy. Over plain HTTP the session
//! id crosses the wire in the clear — why `--http` belongs on loopback (an SSH tunnel, a port
//! forward) or behind such a proxy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};

use crate::trust::{Principal, Verifier};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "kiln_session";
/// How long a session lives, however active: a forgotten browser tab does not keep access.
const SESSION_FOR: Duration = Duration::from_secs(12 * 3600);
/// Sessions kept at most; past it the expired go first, then the oldest.
const MAX_SESSIONS: usize = 10_000;

/// How callers are checked.
#[derive(Debug)]
pub(crate) enum Gate {
    /// `--dev`: no TLS, no tokens, everyone is the embedded principal.
    Open,
    /// TLS: a session opened with a valid user token.
    Tokens(Arc<Verifier>),
}

#[derive(Debug)]
struct Session {
    token: String,
    until: Instant,
}

/// The page's sessions.
#[derive(Debug)]
pub(crate) struct Auth {
    gate: Gate,
    sessions: Mutex<HashMap<String, Session>>,
}

/// Why a request was refused; never says more than that the caller must log in, or come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// No session, or one that ended: log in (again), for the reason given.
    Login(&'static str),
    /// Tokens cannot be checked now (the state store is unavailable): nobody's fault, try again.
    Unavailable,
}

impl Refused {
    pub fn why(self) -> &'static str {
        match self {
            Refused::Login(why) => why,
            Refused::Unavailable => "tokens cannot be checked now (the state store is unavailable): try again",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Refused::Login(_) => StatusCode::UNAUTHORIZED,
            Refused::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl Auth {
    pub fn new(gate: Gate) -> Auth {
        Auth { gate, sessions: Mutex::new(HashMap::new()) }
    }

    pub fn is_open(&self) -> bool {
        matches!(self.gate, Gate::Open)
    }

    /// The principal behind the request's session cookie.
    pub async fn principal(&self, headers: &HeaderMap) -> Result<Principal, Refused> {
        let verifier = match &self.gate {
            Gate::Open => return Ok(Principal::Embedded),
            Gate::Tokens(verifier) => verifier,
        };
        let Some(id) = cookie(headers, COOKIE) else {
            return Err(Refused::Login("no session: log in with your token"));
        };
        let token = {
            let sessions = self.sessions.lock().unwrap();
            match sessions.get(id) {
                Some(session) if session.until > Instant::now() => session.token.clone(),
                _ => return Err(Refused::Login("the session is unknown or expired: log in again")),
            }
        };
        match verifier.user(&token).await {
            Ok(Some(user)) => Ok(user),
            Ok(None) => {
                // Revoked or expired since the login: the session goes with it.
                self.sessions.lock().unwrap().remove(id);
                Err(Refused::Login(
                    "the session's token is no longer valid (revoked or expired): log in with a new one",
                ))
            }
            Err(_) => Err(Refused::Unavailable),
        }
    }

    /// Opens a session for `token` if it names a user now: the session id and who it is.
    pub async fn login(&self, token: &str) -> Result<(String, Principal), Refused> {
        let Gate::Tokens(verifier) = &self.gate else { return Ok((String::new(), Principal::Embedded)) };
        let user = match verifier.user(token.trim()).await {
            Ok(Some(user)) => user,
            Ok(None) => {
                return Err(Refused::Login("not a valid token: unknown, expired or revoked — ask an admin for one"))
            }
            Err(_) => return Err(Refused::Unavailable),
        };
        let id = session_id();
        let mut sessions = self.sessions.lock().unwrap();
        if sessions.len() >= MAX_SESSIONS {
            let now = Instant::now();
            sessions.retain(|_, s| s.until > now);
            if sessions.len() >= MAX_SESSIONS {
                let oldest = sessions.iter().min_by_key(|(_, s)| s.until).map(|(id, _)| id.clone());
                sessions.remove(&oldest.unwrap_or_default());
            }
        }
        sessions.insert(id.clone(), Session { token: token.trim().to_string(), until: Instant::now() + SESSION_FOR });
        Ok((id, user))
    }

    /// Ends the request's session, if it has one.
    pub fn logout(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, COOKIE) {
            self.sessions.lock().unwrap().remove(id);
        }
    }
}

/// 256 random bits, hex: unguessable, and worthless once the process ends.
fn session_id() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut bytes).expect("the system's random source works");
    hex::encode(bytes)
}

/// The value of cookie `name`, from every `Cookie` header.
fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The `Set-Cookie` value for session `id` (empty: the one that deletes it).
pub(crate) fn set_cookie(id: &str, headers: &HeaderMap) -> HeaderValue {
    let https = headers.get("x-forwarded-proto").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let max_age = if id.is_empty() { 0 } else { SESSION_FOR.as_secs() };
    let secure = if https { "; Secure" } else { "" };
    let value = format!("{COOKIE}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}");
    HeaderValue::from_str(&value).expect("a session id is hex")
}

/// In front of the page and its JSON: the caller's principal goes into the request's extensions,
/// or the request is refused — a page by a redirect to `/login`, JSON by `401`.
pub(crate) async fn require(State(web): State<Arc<super::Web>>, mut request: Request, next: Next) -> Response {
    match web.auth.principal(request.headers()).await {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Err(refused) => {
            tracing::debug!(path = %request.uri().path(), why = refused.why(), "status page refused");
            if request.uri().path().starts_with("/api/") {
                let body = serde_json::json!({ "error": refused.why(), "login": "/login" }).to_string();
                (refused.status(), [(header::CONTENT_TYPE, "application/json")], body).into_response()
            } else if refused == Refused::Unavailable {
                (refused.status(), refused.why()).into_response()
            } else {
                Redirect::to("/login").into_response()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cookie_is_found_among_others_and_headers() {
        let mut headers = HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("theme=dark; kiln_sessionx=no"));
        headers.append(header::COOKIE, HeaderValue::from_static("a=b; kiln_session=abc123"));
        assert_eq!(cookie(&headers, COOKIE), Some("abc123"));
        assert_eq!(cookie(&HeaderMap::new(), COOKIE), None);
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_secure_only_behind_https() {
        let plain = set_cookie("ab", &HeaderMap::new());
        assert_eq!(plain, "kiln_session=ab; Path=/; HttpOnly; SameSite=Strict; Max-Age=43200");
        let mut proxied = HeaderMap::new();
        proxied.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert!(set_cookie("ab", &proxied).to_str().unwrap().ends_with("; Secure"));
        assert!(set_cookie("", &HeaderMap::new()).to_str().unwrap().contains("Max-Age=0"));
    }

    #[test]
    fn session_ids_are_long_and_differ() {
        let (a, b) = (session_id(), session_id());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
