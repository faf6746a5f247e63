//! `POST /images/{name}/push`, spoken directly rather than through bollard.
//!
//! bollard 0.21's `PushImageInfo` keeps only `status`, `progressDetail` and `errorDetail`: the `id`
//! that says *which* layer a progress line is about, and the `aux` record carrying the manifest
//! digest, are dropped while decoding. Layers push in parallel, so progress without its layer id
//! cannot even be summed. This module sends the one request itself over the daemon's socket and
//! reads Docker's JSON-lines stream whole. It speaks HTTP/1.0, so the daemon answers with a plain
//! body closed at the end (no chunked encoding to decode).

use super::{PushProgress, Pushed};
use serde::Deserialize;
use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc::Sender;

/// Where the daemon listens, for the requests this crate makes without bollard.
#[derive(Clone, Debug)]
pub(super) enum Endpoint {
    Unix(PathBuf),
    Tcp(String),
}

impl Endpoint {
    /// `unix:///path` or `tcp://host:port` (`http://` alike); `None` for schemes needing TLS.
    pub(super) fn from_host(host: &str) -> Option<Endpoint> {
        if let Some(path) = host.strip_prefix("unix://") {
            return Some(Endpoint::Unix(PathBuf::from(path)));
        }
        let addr = host.strip_prefix("tcp://").or_else(|| host.strip_prefix("http://"))?;
        Some(Endpoint::Tcp(addr.trim_end_matches('/').to_string()))
    }
}

/// Why a push did not finish.
#[derive(Debug)]
pub(super) enum PushFailure {
    /// The connection could not be made.
    Connect(io::Error),
    /// The connection broke while the push ran.
    Lost(io::Error),
    /// The daemon said no: its message, as it wrote it.
    Daemon(String),
}

/// Pushes `name:tag`, sending each layer's progress to `progress` (a closed receiver is ignored).
pub(super) async fn push(
    endpoint: &Endpoint,
    api_version: &str,
    name: &str,
    tag: &str,
    progress: &Sender<PushProgress>,
) -> Result<Pushed, PushFailure> {
    // An empty auth object: loopback registries need none, and older daemons refuse a push that
    // carries no X-Registry-Auth header at all. "e30=" is base64 of "{}".
    let request = format!(
        "POST /v{api_version}/images/{name}/push?tag={tag} HTTP/1.0\r\nHost: docker\r\n\
         X-Registry-Auth: e30=\r\nContent-Length: 0\r\n\r\n"
    );
    match endpoint {
        Endpoint::Unix(path) => {
            let stream = tokio::net::UnixStream::connect(path).await.map_err(PushFailure::Connect)?;
            exchange(stream, &request, progress).await
        }
        Endpoint::Tcp(addr) => {
            let stream = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(PushFailure::Connect)?;
            exchange(stream, &request, progress).await
        }
    }
}

async fn exchange(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    request: &str,
    progress: &Sender<PushProgress>,
) -> Result<Pushed, PushFailure> {
    stream.write_all(request.as_bytes()).await.map_err(PushFailure::Lost)?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).await.map_err(PushFailure::Lost)?;
    let status: u16 = line.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    loop {
        line.clear();
        if reader.read_line(&mut line).await.map_err(PushFailure::Lost)? == 0 || line.trim().is_empty() {
            break;
        }
    }
    if status != 200 {
        let mut body = String::new();
        reader.read_to_string(&mut body).await.map_err(PushFailure::Lost)?;
        let message = serde_json::from_str::<ApiError>(&body).map(|e| e.message).unwrap_or(body);
        return Err(PushFailure::Daemon(format!("HTTP {status}: {}", message.trim())));
    }
    let mut tally = Tally::default();
    loop {
        line.clear();
        if reader.read_line(&mut line).await.map_err(PushFailure::Lost)? == 0 {
            break;
        }
        let Ok(message) = serde_json::from_str::<Message>(line.trim()) else {
            continue;
        };
        if let Some(update) = tally.take(message)? {
            // A listener that went away must not stop the push it was watching.
            let _ = progress.send(update).await;
        }
    }
    Ok(tally.finish())
}

#[derive(Deserialize)]
struct ApiError {
    message: String,
}

/// One line of Docker's JSON message stream, as much of it as a push uses.
#[derive(Debug, Default, Deserialize)]
struct Message {
    status: Option<String>,
    id: Option<String>,
    #[serde(rename = "progressDetail")]
    progress_detail: Option<Detail>,
    #[serde(rename = "errorDetail")]
    error_detail: Option<ErrorDetail>,
    error: Option<String>,
    aux: Option<Aux>,
}

#[derive(Debug, Default, Deserialize)]
struct Detail {
    current: Option<i64>,
    total: Option<i64>,
}

#[derive(Debug, Deserialize)]
struct ErrorDetail {
    message: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Aux {
    #[serde(rename = "Digest")]
    digest: Option<String>,
}

/// What a push's messages add up to.
#[derive(Debug, Default)]
struct Tally {
    /// The furthest each layer got; a layer the registry already had never appears.
    sent: HashMap<String, u64>,
    digest: Option<String>,
}

impl Tally {
    /// Folds one message in; returns the progress update it carries, or the failure it reports.
    fn take(&mut self, message: Message) -> Result<Option<PushProgress>, PushFailure> {
        if let Some(why) = message.error_detail.and_then(|d| d.message).or(message.error) {
            return Err(PushFailure::Daemon(why));
        }
        if let Some(digest) = message.aux.and_then(|aux| aux.digest) {
            self.digest = Some(digest);
        } else if let Some(digest) = message.status.as_deref().and_then(digest_in_status) {
            self.digest.get_or_insert(digest);
        }
        let (Some(layer), Some(detail)) = (message.id, message.progress_detail) else {
            return Ok(None);
        };
        let (Some(current), Some(total)) = (detail.current, detail.total) else {
            return Ok(None);
        };
        let current = u64::try_from(current).unwrap_or(0);
        let sent = self.sent.entry(layer.clone()).or_default();
        *sent = (*sent).max(current);
        Ok(Some(PushProgress { layer, current, total: u64::try_from(total).unwrap_or(0) }))
    }

    fn finish(self) -> Pushed {
        Pushed { digest: self.digest, bytes: self.sent.values().sum() }
    }
}

/// The digest in Docker's closing status line, `<tag>: digest: sha256:<hex> size: <n>`.
fn digest_in_status(status: &str) -> Option<String> {
    let rest = &status[status.find("digest: ")? + "digest: ".len()..];
    let digest = rest.split_whitespace().next()?;
    digest.starts_with("sha256:").then(|| digest.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(json: &str) -> Message {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn progress_is_kept_per_layer_and_the_digest_comes_from_aux() {
        let mut tally = Tally::default();
        let lines = [
            r#"{"status":"The push refers to repository [127.0.0.1:5000/x]"}"#,
            r#"{"status":"Preparing","progressDetail":{},"id":"aaa"}"#,
            r#"{"status":"Layer already exists","progressDetail":{},"id":"bbb"}"#,
            r#"{"status":"Pushing","progressDetail":{"current":512,"total":2048},"progress":"[=> ]","id":"aaa"}"#,
            r#"{"status":"Pushing","progressDetail":{"current":2048,"total":2048},"progress":"[==>]","id":"aaa"}"#,
            r#"{"status":"Pushed","progressDetail":{},"id":"aaa"}"#,
            r#"{"status":"t: digest: sha256:0123 size: 528"}"#,
            r#"{"progressDetail":{},"aux":{"Tag":"t","Digest":"sha256:4567","Size":528}}"#,
        ];
        let mut updates = Vec::new();
        for line in lines {
            updates.extend(tally.take(message(line)).map_err(|e| format!("{e:?}")).unwrap());
        }
        assert_eq!(
            updates,
            vec![
                PushProgress { layer: "aaa".into(), current: 512, total: 2048 },
                PushProgress { layer: "aaa".into(), current: 2048, total: 2048 },
            ]
        );
        assert_eq!(tally.finish(), Pushed { digest: Some("sha256:4567".into()), bytes: 2048 });
    }

    #[test]
    fn an_error_line_fails_the_push_with_the_daemons_message() {
        let mut tally = Tally::default();
        let failed = tally.take(message(r#"{"errorDetail":{"message":"denied"},"error":"denied"}"#));
        assert!(matches!(failed, Err(PushFailure::Daemon(why)) if why == "denied"));
    }

    #[test]
    fn the_status_line_digest_is_used_when_no_aux_arrives() {
        assert_eq!(digest_in_status("t: digest: sha256:ab size: 1").as_deref(), Some("sha256:ab"));
        assert_eq!(digest_in_status("Pushed"), None);
    }
}
