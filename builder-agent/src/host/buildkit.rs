//! `POST /build?version=2`: a build by the daemon's BuildKit, spoken directly over its socket.
//!
//! Why BuildKit: the classic builder turns every label of the build request into a `LABEL` step of
//! its own, each creating and committing a container (about a second apiece on these daemons), and
//! Kiln stamps four; BuildKit writes them into the image config with no step at all. Why not
//! through bollard: bollard 0.21 refuses a BuildKit build without a client session, which a build
//! whose context is the request body (the verified archive, nothing else) does not need.
//!
//! The request is HTTP/1.0 with a `Content-Length`, so the body streams from disk unchunked and
//! the daemon answers with a plain body it closes at the end. The answer is Docker's JSON lines:
//! `moby.buildkit.trace` records carry a base64 protobuf `StatusResponse` (steps started, cached,
//! failed, and their output), `moby.image.id` the image built, `error` a failure.

use super::body::BuildBody;
use super::push::Endpoint;
use super::{BuildSpec, DockerStore, HostError};
use base64::Engine as _;
use futures_util::StreamExt;
use kiln_proto::buildkit::StatusResponse;
use serde::Deserialize;
use std::collections::HashMap;
use std::io;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::mpsc::Sender;

/// What a BuildKit build came to, when it did not fail.
#[derive(Debug)]
pub(super) enum Outcome {
    /// The tag now names the image built.
    Built,
    /// The daemon has no BuildKit (its answer says why); the caller builds the classic way.
    Unsupported(String),
}

impl DockerStore {
    /// Builds `spec` from `body` with BuildKit, streaming its log to `log`.
    pub(super) async fn build_with_buildkit(
        &self,
        body: BuildBody,
        spec: &BuildSpec,
        log: &Sender<String>,
    ) -> Result<Outcome, HostError> {
        let json = |map: &std::collections::BTreeMap<String, String>| serde_json::to_string(map).unwrap_or_default();
        let mut params = vec![
            ("version", "2".to_string()),
            ("t", spec.tag.clone()),
            ("dockerfile", body.dockerfile.clone()),
            ("buildargs", json(&spec.args)),
            ("labels", json(&spec.labels)),
        ];
        if spec.no_cache {
            params.push(("nocache", "1".to_string()));
        }
        if let Some(target) = &spec.target {
            params.push(("target", target.clone()));
        }
        if let Some(platform) = &spec.platform {
            params.push(("platform", platform.clone()));
        }
        let api_version = self.docker.client_version().to_string();
        let failed = |step: Option<String>, message: &str| HostError::BuildFailed {
            tag: spec.tag.clone(),
            step: match step {
                Some(step) => format!("{step} — {}", message.trim()),
                None => format!("its start (before any step ran) — {}", message.trim()),
            },
        };
        match build(&self.endpoint, &api_version, &query(&params), body, log).await {
            Ok(_) => Ok(Outcome::Built),
            Err(BuildKitFailure::Refused(status, message)) if unsupported(status, &message) => {
                Ok(Outcome::Unsupported(format!("HTTP {status}: {message}")))
            }
            Err(BuildKitFailure::Refused(status, message)) => Err(failed(None, &format!("HTTP {status}: {message}"))),
            Err(BuildKitFailure::Failed { step, message }) => Err(failed(step, &message)),
            Err(BuildKitFailure::Connect(source)) => {
                Err(HostError::Unreachable { host: self.host().to_string(), source: source.into() })
            }
            Err(BuildKitFailure::Lost(source)) => {
                Err(HostError::Lost { host: self.host().to_string(), op: "build", object: spec.tag.clone(), source })
            }
        }
    }
}

/// Whether a refusal says the daemon cannot build with BuildKit at all (disabled, or too old to
/// know `version=2`), as opposed to refusing this build.
fn unsupported(status: u16, message: &str) -> bool {
    let message = message.to_lowercase();
    (400..600).contains(&status) && (message.contains("buildkit") || message.contains("builder version"))
}

/// Why a BuildKit build did not produce an image.
#[derive(Debug)]
pub(super) enum BuildKitFailure {
    Connect(io::Error),
    Lost(io::Error),
    /// The daemon refused the request itself (HTTP status and message), before building.
    Refused(u16, String),
    /// The build ran and failed: the step that failed (or the last begun) and the daemon's reason.
    Failed {
        step: Option<String>,
        message: String,
    },
}

/// Sends the build and streams its log to `log` as lines; the id of the image built.
pub(super) async fn build(
    endpoint: &Endpoint,
    api_version: &str,
    query: &str,
    body: BuildBody,
    log: &Sender<String>,
) -> Result<String, BuildKitFailure> {
    match endpoint {
        Endpoint::Unix(path) => {
            let stream = tokio::net::UnixStream::connect(path).await.map_err(BuildKitFailure::Connect)?;
            exchange(stream, api_version, query, body, log).await
        }
        Endpoint::Tcp(addr) => {
            let stream = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(BuildKitFailure::Connect)?;
            exchange(stream, api_version, query, body, log).await
        }
    }
}

async fn exchange(
    stream: impl AsyncRead + AsyncWrite + Unpin,
    api_version: &str,
    query: &str,
    body: BuildBody,
    log: &Sender<String>,
) -> Result<String, BuildKitFailure> {
    let (read, mut write) = tokio::io::split(stream);
    let head = format!(
        "POST /v{api_version}/build?{query} HTTP/1.0\r\nHost: docker\r\nContent-Type: application/x-tar\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    // The daemon may answer (a refusal) before reading the whole body; reading and writing at once
    // means neither side waits on the other.
    let send = async move {
        write.write_all(head.as_bytes()).await?;
        let mut chunks = Box::pin(body.into_stream());
        while let Some(chunk) = chunks.next().await {
            write.write_all(&chunk?).await?;
        }
        write.flush().await
    };
    let (sent, answer) = tokio::join!(send, read_answer(read, log));
    let id = answer?;
    sent.map_err(BuildKitFailure::Lost)?;
    Ok(id)
}

async fn read_answer(read: impl AsyncRead + Unpin, log: &Sender<String>) -> Result<String, BuildKitFailure> {
    let mut reader = BufReader::new(read);
    let mut line = String::new();
    reader.read_line(&mut line).await.map_err(BuildKitFailure::Lost)?;
    let status: u16 = line.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    loop {
        line.clear();
        if reader.read_line(&mut line).await.map_err(BuildKitFailure::Lost)? == 0 || line.trim().is_empty() {
            break;
        }
    }
    if status != 200 {
        let mut body = String::new();
        let _ = reader.read_to_string(&mut body).await;
        let message = serde_json::from_str::<ApiError>(&body).map(|e| e.message).unwrap_or(body);
        return Err(BuildKitFailure::Refused(status, message.trim().to_string()));
    }
    let mut progress = Progress::default();
    let mut id = None;
    loop {
        line.clear();
        if reader.read_line(&mut line).await.map_err(BuildKitFailure::Lost)? == 0 {
            break;
        }
        let Ok(message) = serde_json::from_str::<Message>(line.trim()) else {
            continue;
        };
        match progress.take(message) {
            Taken::Lines(lines) => {
                for line in lines {
                    // A listener that went away must not stop the build it was watching.
                    let _ = log.send(line).await;
                }
            }
            Taken::Image(built) => id = Some(built),
            Taken::Error(message) => return Err(BuildKitFailure::Failed { step: progress.failed_step(), message }),
        }
    }
    id.ok_or_else(|| BuildKitFailure::Failed {
        step: progress.failed_step(),
        message: "the daemon ended the build without naming an image".to_string(),
    })
}

/// [`read_answer`] over a daemon's whole answer held in memory: the image id, or the failure as
/// Debug text. Exposed (through `host::buildkit_answer`) for the `buildkit_status` fuzz target in
/// `fuzz/`, which feeds it arbitrary bytes; not an API.
#[doc(hidden)]
pub async fn decode_answer(answer: &[u8], log: &Sender<String>) -> Result<String, String> {
    read_answer(answer, log).await.map_err(|failure| format!("{failure:?}"))
}

#[derive(Deserialize)]
struct ApiError {
    message: String,
}

/// One line of the build's JSON stream, as much of it as Kiln reads.
#[derive(Debug, Default, Deserialize)]
struct Message {
    id: Option<String>,
    aux: Option<serde_json::Value>,
    error: Option<String>,
    stream: Option<String>,
}

enum Taken {
    Lines(Vec<String>),
    Image(String),
    Error(String),
}

/// The most of one step's output held back waiting for its newline.
const PARTIAL_MAX: usize = 16 << 10;

/// The steps seen so far, numbered in the order they appeared (`#3`, as `docker build` prints them).
#[derive(Debug, Default)]
struct Progress {
    steps: HashMap<String, Step>,
    /// The last step begun, and the first that reported an error.
    last_started: Option<String>,
    failed: Option<String>,
    /// Output of a step not yet ended by a newline, per step.
    partial: HashMap<String, String>,
}

#[derive(Debug)]
struct Step {
    number: usize,
    name: String,
    started: bool,
    done: bool,
}

impl Progress {
    fn take(&mut self, message: Message) -> Taken {
        if let Some(error) = message.error {
            return Taken::Error(error);
        }
        match (message.id.as_deref(), message.aux) {
            (Some("moby.image.id"), Some(aux)) => match aux.get("ID").and_then(|id| id.as_str()) {
                Some(id) => Taken::Image(id.to_string()),
                None => Taken::Lines(Vec::new()),
            },
            (Some("moby.buildkit.trace"), Some(serde_json::Value::String(encoded))) => {
                let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.as_bytes());
                match decoded.ok().and_then(|bytes| StatusResponse::parse(&bytes)) {
                    Some(status) => Taken::Lines(self.status(status)),
                    None => Taken::Lines(Vec::new()),
                }
            }
            // `Successfully tagged …` and the like.
            _ => Taken::Lines(
                message.stream.map(|s| s.trim_end().to_string()).filter(|s| !s.is_empty()).into_iter().collect(),
            ),
        }
    }

    /// The log lines one status update adds: a step's start (or cache hit), its output, its error.
    fn status(&mut self, status: StatusResponse) -> Vec<String> {
        let mut lines = Vec::new();
        let mut ended = Vec::new();
        for vertex in status.vertexes {
            let number = self.steps.len() + 1;
            let step = self.steps.entry(vertex.digest.clone()).or_insert_with(|| Step {
                number,
                name: vertex.name.clone(),
                started: false,
                done: false,
            });
            if !step.started && (vertex.started.is_some() || vertex.cached) {
                step.started = true;
                let cached = if vertex.cached { " (cached)" } else { "" };
                lines.push(format!("#{} {}{cached}", step.number, step.name));
                self.last_started = Some(vertex.digest.clone());
            }
            if !vertex.error.is_empty() {
                lines.push(format!("#{} ERROR: {}", step.number, vertex.error));
                self.failed.get_or_insert(vertex.digest.clone());
                ended.push(vertex.digest);
            } else if vertex.completed.is_some() && !step.done {
                step.done = true;
                ended.push(vertex.digest);
            }
        }
        for out in status.logs {
            let number = self.steps.get(&out.vertex).map(|s| s.number).unwrap_or(0);
            let partial = self.partial.entry(out.vertex).or_default();
            partial.push_str(&String::from_utf8_lossy(&out.msg));
            while let Some(end) = partial.find('\n') {
                let text: String = partial.drain(..=end).collect();
                lines.push(format!("#{number} {}", text.trim_end_matches(['\n', '\r'])));
            }
            // Output that never ends its line (a progress bar redrawn with `\r`) would otherwise
            // be held for the whole build: past a bound it is shown as it is.
            while partial.len() > PARTIAL_MAX {
                let mut cut = PARTIAL_MAX;
                while !partial.is_char_boundary(cut) {
                    cut -= 1;
                }
                let text: String = partial.drain(..cut).collect();
                lines.push(format!("#{number} {text}"));
            }
        }
        // A step's last words may lack a newline (`printf 'error: …'; exit 1`): shown when it ends.
        for digest in ended {
            if let Some(text) = self.partial.remove(&digest).filter(|text| !text.is_empty()) {
                let number = self.steps.get(&digest).map(|s| s.number).unwrap_or(0);
                lines.push(format!("#{number} {}", text.trim_end_matches('\r')));
            }
        }
        lines
    }

    /// The step to blame: the first that reported an error, else the last begun.
    fn failed_step(&self) -> Option<String> {
        let digest = self.failed.as_ref().or(self.last_started.as_ref())?;
        self.steps.get(digest).map(|s| s.name.clone())
    }
}

/// `key=value&…` with every value percent-encoded, for the build's query string.
pub(super) fn query(params: &[(&str, String)]) -> String {
    let encode = |value: &str| {
        value
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    params.iter().map(|(key, value)| format!("{key}={}", encode(value))).collect::<Vec<_>>().join("&")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_proto::buildkit::{Timestamp, Vertex, VertexLog};

    fn trace(status: StatusResponse) -> Message {
        let encoded = base64::engine::general_purpose::STANDARD.encode(status.to_bytes());
        Message { id: Some("moby.buildkit.trace".into()), aux: Some(encoded.into()), ..Default::default() }
    }

    fn vertex(digest: &str, name: &str, started: bool, error: &str) -> Vertex {
        Vertex {
            digest: digest.into(),
            name: name.into(),
            started: started.then_some(Timestamp { seconds: 1, nanos: 0 }),
            error: error.into(),
            ..Default::default()
        }
    }

    fn lines(taken: Taken) -> Vec<String> {
        match taken {
            Taken::Lines(lines) => lines,
            _ => panic!("expected log lines"),
        }
    }

    #[test]
    fn steps_are_numbered_once_their_output_is_reassembled_and_a_failure_names_its_step() {
        let mut progress = Progress::default();
        let first = trace(StatusResponse { vertexes: vec![vertex("d1", "[1/2] FROM base", true, "")], logs: vec![] });
        assert_eq!(lines(progress.take(first)), ["#1 [1/2] FROM base"]);
        let run = StatusResponse {
            vertexes: vec![vertex("d1", "[1/2] FROM base", true, ""), vertex("d2", "[2/2] RUN make", true, "")],
            logs: vec![VertexLog { vertex: "d2".into(), msg: b"compil".to_vec() }],
        };
        assert_eq!(lines(progress.take(trace(run))), ["#2 [2/2] RUN make"]);
        let more = StatusResponse {
            vertexes: vec![vertex("d2", "[2/2] RUN make", true, "exit code: 2")],
            logs: vec![VertexLog { vertex: "d2".into(), msg: b"ing\nfailed\n".to_vec() }],
        };
        assert_eq!(lines(progress.take(trace(more))), ["#2 ERROR: exit code: 2", "#2 compiling", "#2 failed"]);
        let error =
            Message { error: Some("executor failed running [make]: exit code: 2".into()), ..Default::default() };
        assert!(matches!(progress.take(error), Taken::Error(m) if m.contains("exit code: 2")));
        assert_eq!(progress.failed_step().as_deref(), Some("[2/2] RUN make"));
    }

    #[test]
    fn the_image_id_comes_from_its_aux_record_and_a_failure_before_any_step_names_none() {
        let mut progress = Progress::default();
        let id = serde_json::from_str::<Message>(r#"{"id":"moby.image.id","aux":{"ID":"sha256:ab"}}"#).unwrap();
        assert!(matches!(progress.take(id), Taken::Image(id) if id == "sha256:ab"));
        assert_eq!(progress.failed_step(), None);
    }

    #[test]
    fn a_step_s_last_line_without_a_newline_is_shown_when_the_step_ends() {
        let mut progress = Progress::default();
        let run = StatusResponse {
            vertexes: vec![vertex("d1", "[1/1] RUN fail", true, "")],
            logs: vec![VertexLog { vertex: "d1".into(), msg: b"first\nerror: no such file".to_vec() }],
        };
        assert_eq!(lines(progress.take(trace(run))), ["#1 [1/1] RUN fail", "#1 first"]);
        let failed =
            StatusResponse { vertexes: vec![vertex("d1", "[1/1] RUN fail", true, "exit code: 1")], logs: vec![] };
        assert_eq!(lines(progress.take(trace(failed))), ["#1 ERROR: exit code: 1", "#1 error: no such file"]);
        assert!(progress.partial.is_empty());
    }

    #[test]
    fn output_that_never_ends_its_line_is_shown_in_bounded_pieces() {
        let mut progress = Progress::default();
        let bar = "\r[=====>   ] 42%".repeat(4096);
        let run = StatusResponse {
            vertexes: vec![vertex("d1", "[1/1] RUN fetch", true, "")],
            logs: vec![VertexLog { vertex: "d1".into(), msg: bar.clone().into_bytes() }],
        };
        let shown = lines(progress.take(trace(run)));
        assert!(shown.len() > 2, "{} lines", shown.len());
        assert!(shown.iter().all(|line| line.len() <= PARTIAL_MAX + 3));
        assert!(progress.partial["d1"].len() <= PARTIAL_MAX);
        let held: usize = shown[1..].iter().map(|line| line.len() - 3).sum::<usize>() + progress.partial["d1"].len();
        assert_eq!(held, bar.len(), "nothing is lost");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        let q = query(&[("t", "a/b:1".into()), ("labels", r#"{"k":"v w"}"#.into())]);
        assert_eq!(q, "t=a%2Fb%3A1&labels=%7B%22k%22%3A%22v%20w%22%7D");
    }
}
