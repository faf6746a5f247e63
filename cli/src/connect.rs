//! Reaching a coordinator: dialing on the retry ladder, and turning transport failures into
//! messages that name the address and the OS error (DESIGN.md "Talking across the network").
//!
//! Two kinds of call, two rules. Reads (status, images, agents, the start of logs) are asked again
//! on any transport failure. `Up` is an action: it is sent again only when the connection was never
//! made, because a converge the coordinator did receive must not be started twice.

use std::error::Error as StdError;
use std::future::Future;
use std::time::{Duration, Instant};

use kiln_core::retry::{retry_measured, Attempt, Clock, Ladder, LadderConfig};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{ClientTlsConfig, Endpoint};

use crate::error::CliError;

/// A channel to a coordinator that carries the user's token on every call.
pub type Channel = InterceptedService<tonic::transport::Channel, Bearer>;

/// Adds `authorization: Bearer <token>` to every call, when there is a token, and the calling
/// span's `traceparent` when tracing is on (the coordinator's span of the call becomes its child).
#[derive(Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token itself.
        f.write_str(if self.0.is_some() { "Bearer(…)" } else { "Bearer(none)" })
    }
}

impl Bearer {
    pub fn new(token: Option<&str>) -> Result<Bearer, CliError> {
        let value = token
            .map(|t| {
                format!("Bearer {}", t.trim())
                    .parse()
                    .map_err(|_| CliError::BadToken { why: "it holds characters no header may carry".to_string() })
            })
            .transpose()?;
        Ok(Bearer(value))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        kiln_telemetry::inject(request.metadata_mut());
        Ok(request)
    }
}

/// How the CLI proves itself to a served coordinator: whose CA to trust, and the user's token.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    /// PEM of the CA the coordinator's certificate must chain to; `None`: the system's roots.
    pub ca_pem: Option<String>,
    pub token: Option<String>,
}

impl Credentials {
    /// From `--ca FILE` (or `KILN_CA`) and the token in `KILN_TOKEN`, `--token-file`, or
    /// `~/.config/kiln/token`, in that order. A token file readable by others is refused, as ssh
    /// refuses such a key: a token is a password.
    pub fn load(ca: Option<&std::path::Path>, token_file: Option<&std::path::Path>) -> Result<Credentials, CliError> {
        let ca_pem = ca
            .map(|path| {
                std::fs::read_to_string(path).map_err(|err| CliError::Credentials { path: path.to_owned(), err })
            })
            .transpose()?;
        if let Some(token) = std::env::var("KILN_TOKEN").ok().filter(|t| !t.trim().is_empty()) {
            return Ok(Credentials { ca_pem, token: Some(token.trim().to_string()) });
        }
        let default = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".config/kiln/token"));
        let (path, explicit) = match (token_file, default) {
            (Some(path), _) => (path.to_owned(), true),
            (None, Some(path)) => (path, false),
            (None, None) => return Ok(Credentials { ca_pem, token: None }),
        };
        let meta = match std::fs::metadata(&path) {
            Ok(meta) => meta,
            Err(_) if !explicit => return Ok(Credentials { ca_pem, token: None }),
            Err(err) => return Err(CliError::Credentials { path, err }),
        };
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(CliError::TokenFileOpen { path, mode });
        }
        let token = std::fs::read_to_string(&path).map_err(|err| CliError::Credentials { path: path.clone(), err })?;
        Ok(Credentials { ca_pem, token: Some(token.trim().to_string()).filter(|t| !t.is_empty()) })
    }
}

/// A connected coordinator: its address (for messages) and a channel to it.
#[derive(Clone, Debug)]
pub struct Link {
    pub url: String,
    /// How messages name it: `the coordinator at http://…`, or the embedded one by its home —
    /// never a loopback address the user did not give.
    pub at: String,
    pub channel: Channel,
    /// How long transport failures of reads are retried.
    pub window: Duration,
    /// Several coordinators were given (`--coordinator a,b`): a farm that fails over, whose
    /// active one this link reached.
    pub farm: bool,
}

/// A single attempt never waits longer than this for the TCP handshake, so an address that drops
/// packets becomes a retry (and, at the window's end, a message) instead of the kernel's 2 minutes.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Parses `url` into an endpoint with Kiln's timeouts; a malformed one is a usage error. An
/// `https://` URL speaks TLS, trusting `ca_pem` (else the system's roots).
pub fn endpoint(url: &str) -> Result<Endpoint, CliError> {
    endpoint_with(url, None)
}

pub fn endpoint_with(url: &str, ca_pem: Option<&str>) -> Result<Endpoint, CliError> {
    let bad = |why: &str| CliError::BadUrl { url: url.to_string(), why: why.to_string() };
    let (tls, rest) = match url.split_once("://") {
        Some(("http", rest)) => (false, rest),
        Some(("https", rest)) => (true, rest),
        _ => return Err(bad("write it as https://host:port (or http://host:port for a --dev coordinator)")),
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(bad("it names no host — write it as https://host:port"));
    }
    let mut endpoint =
        Endpoint::from_shared(url.to_string()).map_err(|_| bad("it is not a URL — write it as https://host:port"))?;
    if tls {
        let config = match ca_pem {
            Some(pem) => ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pem)),
            None => ClientTlsConfig::new().with_native_roots(),
        };
        endpoint =
            endpoint.tls_config(config).map_err(|err| bad(&format!("its TLS settings are not usable: {err}")))?;
    }
    let endpoint = endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        // A converge can stream silence for minutes during a long build step; keepalives let a dead
        // coordinator be noticed without cutting a quiet one off.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true)
        // Uploads stream 1 MiB chunks: windows smaller than a chunk stall on every update.
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(16 << 20)
        .tcp_nodelay(true);
    Ok(endpoint)
}

/// Connects to `url`, retrying refused or failed connections on the ladder for `window`.
pub async fn dial(url: &str, window: Duration) -> Result<Link, CliError> {
    dial_with(url, window, &Credentials::default()).await
}

/// [`dial`] with credentials: the CA to trust, and the token every call carries.
///
/// `url` may list a farm's several coordinators, comma-separated: the one that is active is found.
pub async fn dial_with(url: &str, window: Duration, credentials: &Credentials) -> Result<Link, CliError> {
    let urls: Vec<&str> = url.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
    if urls.len() > 1 {
        return dial_farm(&urls, window, credentials).await;
    }
    let url = urls.first().copied().unwrap_or(url);
    let endpoint = endpoint_with(url, credentials.ca_pem.as_deref())?;
    let bearer = Bearer::new(credentials.token.as_deref())?;
    let channel = on_ladder("kiln.connect", url, window, || {
        let endpoint = endpoint.clone();
        async move {
            endpoint.connect().await.map_err(|err| {
                let why = reason(&err);
                // A plaintext client meeting a TLS server (or the other way round) is not a
                // transient failure: say what it is instead of retrying it for the whole window.
                if looks_like_tls_mismatch(&why) {
                    Attempt::Fatal(why)
                } else {
                    Attempt::Retry(why)
                }
            })
        }
    })
    .await
    .map_err(|err| match err {
        CliError::Unreachable { at, reason } if looks_like_tls_mismatch(&reason) => {
            CliError::TlsMismatch { at, reason }
        }
        other => other,
    })?;
    let channel = InterceptedService::new(channel, bearer);
    Ok(Link { url: url.to_string(), at: format!("the coordinator at {url}"), channel, window, farm: false })
}

/// Connects to the active one of a farm's coordinators: each is asked, in turn, whether it serves
/// (the standard gRPC health check, which a standby answers NOT_SERVING); none yet — a failover
/// in progress — is retried on the ladder for `window`.
async fn dial_farm(urls: &[&str], window: Duration, credentials: &Credentials) -> Result<Link, CliError> {
    let endpoints = urls
        .iter()
        .map(|url| Ok((url.to_string(), endpoint_with(url, credentials.ca_pem.as_deref())?)))
        .collect::<Result<Vec<_>, CliError>>()?;
    let bearer = Bearer::new(credentials.token.as_deref())?;
    let all = urls.join(",");
    let (url, channel) = on_ladder("kiln.connect", &all, window, || {
        let endpoints = endpoints.clone();
        async move {
            let mut why = Vec::new();
            for (url, endpoint) in endpoints {
                match endpoint.connect().await {
                    Err(err) => why.push(format!("{url}: {}", reason(&err))),
                    Ok(channel) => match serving(channel.clone()).await {
                        Ok(true) => return Ok((url, channel)),
                        Ok(false) => why.push(format!("{url} stands by")),
                        Err(status) => why.push(format!("{url}: {}", status.message())),
                    },
                }
            }
            Err(Attempt::Retry(format!("no coordinator is active: {}", why.join("; "))))
        }
    })
    .await?;
    let channel = InterceptedService::new(channel, bearer);
    Ok(Link { at: format!("the coordinator at {url}"), url, channel, window, farm: true })
}

/// Whether the coordinator on `channel` serves the Kiln API: the active one of its farm.
async fn serving(channel: tonic::transport::Channel) -> Result<bool, tonic::Status> {
    use tonic_health::pb::{health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest};
    let request = HealthCheckRequest { service: "kiln.v1.Kiln".to_string() };
    let reply = HealthClient::new(channel).check(request).await?.into_inner();
    Ok(reply.status == ServingStatus::Serving as i32)
}

/// The active coordinator a standby named in its answer, if the answer came from one.
pub fn standby_named(status: &tonic::Status) -> Option<Option<String>> {
    status.metadata().get("kiln-standby")?;
    Some(status.metadata().get("kiln-active").and_then(|v| v.to_str().ok()).map(str::to_string))
}

/// Whether a connection failure reads as TLS on one side and plaintext (or another CA) on the other.
fn looks_like_tls_mismatch(why: &str) -> bool {
    let why = why.to_ascii_lowercase();
    ["invalid peer certificate", "unknownissuer", "corrupt message", "invalidcontenttype", "received corrupt", "tls"]
        .iter()
        .any(|needle| why.contains(needle))
}

/// Runs `op` on the retry ladder; prints ADR-0042's routability line when retrying cost something,
/// and turns a give-up into [`CliError::Unreachable`] naming `url` and the last reason.
pub async fn on_ladder<T, F, Fut>(seat: &str, url: &str, window: Duration, mut op: F) -> Result<T, CliError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Attempt<String>>>,
{
    let mut ladder = Ladder::new(LadderConfig::with_window(window), seed());
    // Said as it happens, so a coordinator that is not there never looks like a hang: the first
    // retry comes a quarter second after the first failure.
    let attempt = std::sync::atomic::AtomicU32::new(0);
    let started = Instant::now();
    let said = |reason: &str| {
        let n = attempt.load(std::sync::atomic::Ordering::Relaxed) + 1;
        if n == 2 || n.is_multiple_of(5) {
            eprintln!(
                "kiln: cannot reach {url} yet — retrying (attempt {n}, {reason}; giving up in {} s)",
                window.saturating_sub(started.elapsed()).as_secs().max(1)
            );
        }
    };
    let op = || {
        let next = op();
        let (attempt, said) = (&attempt, &said);
        async move {
            let outcome = next.await;
            attempt.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Err(Attempt::Retry(reason)) = &outcome {
                said(reason);
            }
            outcome
        }
    };
    match retry_measured(&mut ladder, &TokioClock, op).await {
        Ok(done) => {
            if let Some(line) = done.routability_line(seat, url) {
                eprintln!("{line}");
            }
            Ok(done.value)
        }
        Err(gave_up) => {
            if gave_up.attempts > 1 {
                eprintln!("{}", gave_up.routability_line(seat, url));
            }
            Err(CliError::Unreachable { at: format!("the coordinator at {url}"), reason: gave_up.last })
        }
    }
}

/// How a call may be re-sent after a transport failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An idempotent read: re-asked on any transport failure (tonic's `Unavailable`).
    Read,
    /// An action: re-sent only when the connection was never made, since one that reached the
    /// coordinator must not run twice.
    Action,
}

/// Makes `call` on the ladder according to its [`Kind`]. A status that is the coordinator's own
/// answer (anything but a transport failure) is never retried and fails as [`CliError::Refused`].
pub async fn call<T, F, Fut>(link: &Link, call: &'static str, kind: Kind, mut op: F) -> Result<T, CliError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    // The status that stopped the ladder is kept whole (its code decides the exit code); the
    // ladder itself only needs a line of text.
    let stopped = std::sync::Mutex::new(None);
    let seat = format!("kiln.{call}");
    let result = on_ladder(&seat, &link.url, link.window, || {
        let attempt = op();
        let stopped = &stopped;
        async move {
            match attempt.await {
                Ok(value) => Ok(value),
                Err(status) => {
                    // A standby did nothing, so any call may be asked again — of it, once it
                    // takes over; one that named the active coordinator sends the user there.
                    let standby = standby_named(&status);
                    let retry = status.code() == tonic::Code::Unavailable
                        && (kind == Kind::Read || never_delivered(&status) || standby == Some(None));
                    let retry = retry && !matches!(standby, Some(Some(_)));
                    if retry {
                        return Err(Attempt::Retry(reason(&status)));
                    }
                    *stopped.lock().unwrap() = Some(status);
                    Err(Attempt::Fatal(String::new()))
                }
            }
        }
    })
    .await;
    match (result, stopped.into_inner().unwrap()) {
        (Ok(value), _) => Ok(value),
        (Err(_), Some(status)) => Err(refused_by(link, call, status)),
        (Err(err), None) => Err(err),
    }
}

/// The coordinator's error answer to `call`, or — for a transport failure — the unreachable
/// address with the OS's reason.
pub fn refused_by(link: &Link, call: &'static str, status: tonic::Status) -> CliError {
    // A plaintext client at a TLS server connects, then reads the server's TLS bytes as broken
    // HTTP/2 frames: say what it is rather than "h2 protocol error".
    // Which of h2's errors surfaces first varies ("h2 protocol error", "operation was canceled"),
    // so any connection-level failure of a plaintext call is read as this.
    let transport = std::error::Error::source(&status).is_some();
    if transport && link.url.starts_with("http://") && status.code() != tonic::Code::Unavailable {
        return CliError::TlsMismatch {
            at: link.at.clone(),
            reason: format!("the connection broke as soon as it was used ({})", status.message()),
        };
    }
    if let Some(Some(active)) = standby_named(&status) {
        return CliError::Standby { at: link.at.clone(), active };
    }
    if status.code() == tonic::Code::Unavailable {
        return CliError::Unreachable { at: link.at.clone(), reason: reason(&status) };
    }
    CliError::Refused { at: link.at.clone(), call, code: status.code(), message: status.message().to_string() }
}

/// A stream of events that broke mid-way: a transport failure (the coordinator died or the
/// connection was cut) is [`CliError::WentAway`]; an answer the coordinator sent is as
/// [`refused_by`] says.
pub fn broke(link: &Link, call: &'static str, converge_id: &str, status: tonic::Status) -> CliError {
    // A status the coordinator sent has no source; one made from a transport error has one.
    let transport = std::error::Error::source(&status).is_some() || status.code() == tonic::Code::Unavailable;
    if transport && link.farm && standby_named(&status).is_none() {
        return CliError::FailedOver {
            at: link.at.clone(),
            converge_id: converge_id.to_string(),
            reason: reason(&status),
        };
    }
    if transport {
        return CliError::WentAway {
            at: link.at.clone(),
            converge_id: converge_id.to_string(),
            reason: reason(&status),
        };
    }
    refused_by(link, call, status)
}

/// True when `err` says the connection was never made (so the request cannot have been received).
pub fn never_delivered(err: &(dyn StdError + 'static)) -> bool {
    use std::io::ErrorKind::*;
    chain(err)
        .filter_map(|e| e.downcast_ref::<std::io::Error>())
        .any(|io| matches!(io.kind(), ConnectionRefused | AddrNotAvailable | HostUnreachable | NetworkUnreachable))
}

/// The OS's word for a transport failure (`connection refused`), found beneath tonic's and hyper's
/// wrappers; failing that, the innermost cause's text, which is never the bare "transport error".
pub fn reason(err: &(dyn StdError + 'static)) -> String {
    if let Some(io) = chain(err).find_map(|e| e.downcast_ref::<std::io::Error>()) {
        return io_reason(io);
    }
    let innermost = chain(err).last().map(|e| e.to_string()).unwrap_or_default();
    if innermost.is_empty() {
        "the connection failed without a reason".to_string()
    } else {
        innermost
    }
}

/// `strerror` without its `(os error N)` suffix, lowercased like the rest of Kiln's messages.
fn io_reason(io: &std::io::Error) -> String {
    match io.raw_os_error() {
        Some(errno) => {
            let text = std::io::Error::from_raw_os_error(errno).to_string();
            let text = text.split(" (os error").next().unwrap_or(&text).to_string();
            let mut chars = text.chars();
            match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => format!("os error {errno}"),
            }
        }
        None if io.kind() == std::io::ErrorKind::TimedOut => "timed out".to_string(),
        None => io.to_string(),
    }
}

fn chain<'a>(err: &'a (dyn StdError + 'static)) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(err), |&e| e.source())
}

fn seed() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos());
    u64::from(std::process::id()) << 32 | u64::from(nanos.unwrap_or(0))
}

/// The ladder's clock on tokio time, so a paused test clock drives it.
pub(crate) struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn sleep(&self, duration: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(duration)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_without_a_scheme_or_host_are_usage_errors_naming_the_form() {
        for url in ["127.0.0.1:7070", "http://", "https://", "ftp://x"] {
            let err = endpoint(url).expect_err(url);
            assert_eq!(err.exit(), crate::Exit::Usage, "{url}");
            assert!(err.to_string().contains(url), "{err}");
        }
        assert!(endpoint("http://127.0.0.1:7070").is_ok(), "a --dev coordinator");
        assert!(endpoint("https://farm.example:7070").is_ok(), "a served coordinator speaks TLS");
    }

    #[test]
    fn the_reason_is_the_os_error_beneath_the_wrappers() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl StdError for Wrapper {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        // 111 is Linux's ECONNREFUSED; the message shows its strerror, lowercased.
        let refused = Wrapper(std::io::Error::from_raw_os_error(111));
        assert_eq!(reason(&refused), "connection refused");
        assert!(never_delivered(&refused));
        let reset = Wrapper(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!never_delivered(&reset), "a reset may come after the request left");
    }

    #[tokio::test]
    async fn a_closed_port_is_unreachable_after_the_window_naming_the_address() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let err = dial(&url, Duration::from_secs(2)).await.expect_err("nothing listens");
        assert_eq!(err.exit(), crate::Exit::Unreachable);
        assert_eq!(err.to_string(), format!("cannot reach the coordinator at {url}: connection refused"));
    }
}
