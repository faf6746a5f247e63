//! `kiln::up` and `kiln::logs` over real gRPC, against a *scripted stand-in* for the coordinator's
//! CLI-facing services (`Kiln.Up`, `Kiln.Logs`, `ContentStore.Upload`).
//!
//! The stand-in exists only because `kiln_coordinator::serve` is not implemented yet; it makes no
//! decisions — it asks for every built image's context, checks each upload the way the coordinator
//! must (unpack, recompute the digest), and replays a fixed script. What it proves is the CLI's
//! side of the wire: contexts are uploaded when asked, concurrently and verifiably, events are
//! shown and returned, and each ending maps to its exit code. Once the real coordinator lands, the
//! end-to-end suite in `tests/` runs `kiln::up` against it and this file should go.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use kiln::render::plain::Plain;
use kiln::{Connect, EventKind, Exit, Outcome, OutputMode, UpArgs};
use kiln_proto::v1::content_store_server::{ContentStore, ContentStoreServer};
use kiln_proto::v1::kiln_server::{Kiln, KilnServer};
use kiln_proto::v1::Outcome as WireOutcome;
use kiln_proto::v1::*;
use tokio::sync::{mpsc, Notify};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Script {
    /// Ask for every context, build each image, succeed.
    Converge,
    /// Ask for every context, then fail the worker's build.
    FailWorker,
    /// Refuse every upload, as a coordinator does when the archive does not match its digest.
    RefuseUploads,
    /// End the event stream after STARTED, as a coordinator that crashed would.
    Vanish,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<ConvergeEvent, Status>> + Send>>;

#[derive(Default)]
struct Seen {
    request: Option<UpRequest>,
    /// Digest claimed on the first chunk → digest the unpacked archive has, and its size.
    uploads: BTreeMap<String, (String, u64)>,
    events: Vec<ConvergeEvent>,
}

struct StandIn {
    script: Script,
    seen: Arc<Mutex<Seen>>,
    uploaded: Arc<Notify>,
    scratch: PathBuf,
}

fn event(kind: converge_event::Kind, image: &str, message: &str) -> ConvergeEvent {
    ConvergeEvent {
        converge_id: "c-1".into(),
        kind: kind as i32,
        image: image.into(),
        message: message.into(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl Kiln for StandIn {
    type UpStream = EventStream;
    type DownStream = EventStream;
    type GcStream = EventStream;
    type LogsStream = EventStream;

    async fn up(&self, request: Request<UpRequest>) -> Result<Response<EventStream>, Status> {
        use converge_event::Kind as K;
        let request = request.into_inner();
        let built: Vec<ImageSpec> =
            request.images.iter().filter(|i| i.kind == image_spec::Kind::Built as i32).cloned().collect();
        self.seen.lock().unwrap().request = Some(request);
        let (tx, rx) = mpsc::channel(16);
        let (script, seen, uploaded) = (self.script, self.seen.clone(), self.uploaded.clone());
        tokio::spawn(async move {
            let mut seq = 0;
            // Numbers the event and keeps it for `Logs`, as the coordinator persists what it streams.
            let mut emit = |e: ConvergeEvent| {
                seq += 1;
                let e = ConvergeEvent { seq, at_ms: 1_700_000_000_000 + seq, ..e };
                seen.lock().unwrap().events.push(e.clone());
                Ok(e)
            };
            let _ = tx.send(emit(event(K::Started, "", ""))).await;
            if script == Script::Vanish {
                return;
            }
            let contexts: Vec<String> = built.iter().map(|i| i.context_digest.clone()).collect();
            let wanted = contexts.len();
            let _ = tx.send(emit(ConvergeEvent { contexts, ..event(K::NeedContexts, "", "") })).await;
            if script == Script::RefuseUploads {
                // Hold the stream open: the CLI must fail on the refused upload, not on the stream.
                std::future::pending::<()>().await;
            }
            while seen.lock().unwrap().uploads.len() < wanted {
                uploaded.notified().await;
            }
            for image in &built {
                let _ = tx.send(emit(event(K::Building, &image.name, ""))).await;
                let _ = tx.send(emit(event(K::BuildLog, &image.name, "#1 FROM scratch"))).await;
                if script == Script::FailWorker && image.name == "worker" {
                    let _ = tx.send(emit(event(K::Failed, "worker", "build failed: RUN exited 1"))).await;
                    let end = ConvergeEvent {
                        outcome: WireOutcome::Failed as i32,
                        ..event(K::Finished, "", "worker: build failed")
                    };
                    let _ = tx.send(emit(end)).await;
                    return;
                }
                let _ = tx.send(emit(ConvergeEvent { millis: 1_500, ..event(K::Built, &image.name, "") })).await;
            }
            let end = ConvergeEvent { outcome: WireOutcome::Succeeded as i32, ..event(K::Finished, "", "") };
            let _ = tx.send(emit(end)).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn logs(&self, request: Request<LogsRequest>) -> Result<Response<EventStream>, Status> {
        if request.into_inner().converge_id != "c-1" {
            return Err(Status::not_found("no converge c-2 — `kiln status` lists the recent ones"));
        }
        let events = self.seen.lock().unwrap().events.clone();
        Ok(Response::new(Box::pin(tokio_stream::iter(events.into_iter().map(Ok)))))
    }

    async fn down(&self, _: Request<DownRequest>) -> Result<Response<EventStream>, Status> {
        Err(Status::unimplemented("down"))
    }
    async fn gc(&self, _: Request<GcRequest>) -> Result<Response<EventStream>, Status> {
        Err(Status::unimplemented("gc"))
    }
    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        Err(Status::unimplemented("status"))
    }
    async fn images(&self, _: Request<ImagesRequest>) -> Result<Response<ImagesReply>, Status> {
        Err(Status::unimplemented("images"))
    }
    async fn agents(&self, _: Request<AgentsRequest>) -> Result<Response<AgentsReply>, Status> {
        Err(Status::unimplemented("agents"))
    }
}

#[tonic::async_trait]
impl ContentStore for StandIn {
    type DownloadStream = Pin<Box<dyn Stream<Item = Result<DownloadChunk, Status>> + Send>>;

    async fn upload(&self, request: Request<Streaming<UploadChunk>>) -> Result<Response<UploadReply>, Status> {
        let mut chunks = request.into_inner();
        let mut claimed = None;
        let mut archive = Vec::new();
        while let Some(chunk) = chunks.message().await? {
            assert!(chunk.data.len() <= kiln::upload::CHUNK);
            claimed.get_or_insert(chunk.digest);
            archive.extend_from_slice(&chunk.data);
        }
        let claimed = claimed.ok_or_else(|| Status::invalid_argument("empty upload"))?;
        if self.script == Script::RefuseUploads {
            return Err(Status::invalid_argument(format!("archive does not hold tree {claimed}")));
        }
        let into = self.scratch.join(&claimed);
        let unpacked = kiln_core::archive::unpack(&archive[..], &into, None)
            .map_err(|err| Status::invalid_argument(format!("bad archive: {err}")))?;
        let bytes = archive.len() as u64;
        self.seen.lock().unwrap().uploads.insert(claimed.clone(), (unpacked.digest.to_string(), bytes));
        // A permit, not a broadcast: the converge task may be between its check and its wait.
        self.uploaded.notify_one();
        Ok(Response::new(UploadReply { digest: claimed, bytes }))
    }

    async fn find_missing(&self, _: Request<FindMissingRequest>) -> Result<Response<FindMissingReply>, Status> {
        Err(Status::unimplemented("find_missing"))
    }
    async fn download(&self, _: Request<DownloadRequest>) -> Result<Response<Self::DownloadStream>, Status> {
        Err(Status::unimplemented("download"))
    }
}

struct Running {
    url: String,
    seen: Arc<Mutex<Seen>>,
    _scratch: tempfile::TempDir,
}

async fn start(script: Script) -> Running {
    let scratch = tempfile::tempdir().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let standin = Arc::new(StandIn {
        script,
        seen: seen.clone(),
        uploaded: Arc::new(Notify::new()),
        scratch: scratch.path().to_path_buf(),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tonic::transport::Server::builder()
        .add_service(KilnServer::from_arc(standin.clone()))
        .add_service(ContentStoreServer::from_arc(standin))
        .serve_with_incoming(TcpListenerStream::new(listener));
    tokio::spawn(server);
    Running { url, seen, _scratch: scratch }
}

fn hello() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/hello")
}

fn args(url: &str) -> UpArgs {
    UpArgs { dir: hello(), force: false, connect: Connect::remote(url), output: OutputMode::Quiet }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_uploads_what_is_asked_and_converges() {
    let coordinator = start(Script::Converge).await;
    let mut plain = Plain::new(Vec::new());
    let outcome = kiln::up_with(&args(&coordinator.url), &mut plain).await.expect("the converge runs");
    assert_eq!((outcome.outcome, outcome.exit(), outcome.failure.clone()), (Outcome::Succeeded, Exit::Converged, None));
    assert_eq!(outcome.converge_id, "c-1");

    let seen = coordinator.seen.lock().unwrap();
    let request = seen.request.as_ref().unwrap();
    assert_eq!(request.instance, "hello");
    assert_eq!(request.images.len(), 4);
    assert!(request.requested_by.contains('@'));
    let built: Vec<&ImageSpec> = request.images.iter().filter(|i| i.kind == image_spec::Kind::Built as i32).collect();
    assert_eq!(seen.uploads.len(), 2, "both contexts uploaded");
    for image in built {
        let (unpacked, bytes) = &seen.uploads[&image.context_digest];
        assert_eq!(unpacked, &image.context_digest, "{}: the archive holds the tree it claims", image.name);
        assert!(*bytes >= 1024);
    }

    let kinds: Vec<EventKind> = outcome.events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds.first(), Some(&EventKind::Started));
    assert_eq!(kinds.last(), Some(&EventKind::Finished));
    assert_eq!(outcome.events.len(), seen.events.len(), "every event is returned");

    let shown = String::from_utf8(plain.into_inner()).unwrap();
    assert!(shown.starts_with("converge c-1 started\nuploading 2 context(s): web, worker\n"), "{shown}");
    assert!(shown.contains("web      built in 1.5 s\n") && shown.contains("worker | #1 FROM scratch\n"), "{shown}");
    assert!(shown.ends_with("converged\n"), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_build_exits_1_naming_the_image_and_logs_replays_it_alike() {
    let coordinator = start(Script::FailWorker).await;
    let mut live = Plain::new(Vec::new());
    let outcome = kiln::up_with(&args(&coordinator.url), &mut live).await.unwrap();
    assert_eq!(outcome.exit(), Exit::Failed);
    assert_eq!(outcome.failure.as_ref().unwrap().to_string(), "worker: build failed: RUN exited 1");

    let logs = kiln::LogsArgs {
        converge_id: "c-1".into(),
        follow: false,
        connect: Connect::remote(&coordinator.url),
        output: OutputMode::Quiet,
    };
    let mut replay = Plain::new(Vec::new());
    let replayed = kiln::logs_with(&logs, &mut replay).await.unwrap();
    assert_eq!(replayed, outcome.events);
    let (live, replay) =
        (String::from_utf8(live.into_inner()).unwrap(), String::from_utf8(replay.into_inner()).unwrap());
    // The live run names contexts by image; a replay, without the manifest, by digest.
    let without_uploads =
        |text: &str| text.lines().filter(|l| !l.starts_with("uploading")).collect::<Vec<_>>().join("\n");
    assert_eq!(without_uploads(&live), without_uploads(&replay));
    assert!(
        live.contains("worker   failed: build failed: RUN exited 1\n── last 1 log line(s) of worker ──\n"),
        "{live}"
    );

    let missing = kiln::LogsArgs { converge_id: "c-2".into(), ..logs };
    let err = kiln::logs_with(&missing, &mut Plain::new(Vec::new())).await.unwrap_err();
    assert_eq!(err.exit(), Exit::Failed);
    assert!(err.to_string().contains("refused Logs: no converge c-2"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_upload_fails_the_cli_naming_the_context_dir() {
    let coordinator = start(Script::RefuseUploads).await;
    let err = kiln::up(args(&coordinator.url)).await.unwrap_err();
    assert_eq!(err.exit(), Exit::Failed);
    let message = kiln::error::report(&err);
    let web = hello().join("web").canonicalize().unwrap();
    let worker = hello().join("worker").canonicalize().unwrap();
    assert!(
        message.starts_with(&format!("cannot upload context {} (tree ", web.display()))
            || message.starts_with(&format!("cannot upload context {} (tree ", worker.display())),
        "{message}"
    );
    assert!(message.contains(": the coordinator refused it: archive does not hold tree "), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_ends_before_finished_is_a_failure_pointing_at_logs() {
    let coordinator = start(Script::Vanish).await;
    let err = kiln::up(args(&coordinator.url)).await.unwrap_err();
    assert_eq!(err.exit(), Exit::Failed);
    assert_eq!(
        err.to_string(),
        format!(
            "the coordinator at {} ended the events of converge c-1 before it finished — `kiln logs c-1` shows how it ended",
            coordinator.url
        )
    );
}
