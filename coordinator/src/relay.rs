//! The image relay: a `docker save` archive on its way from the host agent that exported it to the
//! node agents that import it. Agents only dial out, so neither side can reach the other; the
//! coordinator spools the archive to a file under its state dir (`relay/<key>.tar`) as it arrives.
//!
//! Nodes read while the host still writes: each reader follows the spool up to the bytes written so
//! far (a `watch` channel carries the count) and waits for more, so a delivery costs the slower of
//! the export and the imports rather than their sum. The file, not memory, absorbs the difference
//! between the writer's and each reader's pace, so memory stays bounded by one chunk per stream
//! whatever the image's size. The converge that chose the key [`Relay::expect`]s it before either
//! side starts and [`Relay::discard`]s it after its delivery, whatever the outcome.

use bytes::BytesMut;
use kiln_proto::v1 as pb;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Bytes read or written at a time; the writer also publishes progress at this grain, so a reader
/// wakes once per MiB, not once per network frame.
const CHUNK: usize = 1 << 20;

/// Where one spool stands.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Progress {
    /// Expected, not yet begun: readers wait.
    Waiting,
    /// This many bytes are in the file and readable.
    Writing(u64),
    /// Complete at this many bytes.
    Done(u64),
    /// The export failed; readers end with this.
    Failed(String),
}

/// Where relayed archives are spooled, and the spools open now.
#[derive(Debug, Clone)]
pub struct Relay {
    dir: PathBuf,
    open: Arc<Mutex<HashMap<String, watch::Sender<Progress>>>>,
}

impl Relay {
    /// Opens the spool, emptying it: whatever a previous run left belonged to converges that
    /// died with it (they are marked failed at start), and nothing else would ever delete it.
    pub fn open(dir: PathBuf) -> std::io::Result<Relay> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Relay { dir, open: Default::default() })
    }

    /// The spool file of `key`; `None` for a key that could name a path outside the spool dir.
    fn path(&self, key: &str) -> Option<PathBuf> {
        let safe = !key.is_empty()
            && key.len() <= 200
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        safe.then(|| self.dir.join(format!("{key}.tar")))
    }

    /// Opens `key` for one delivery: one export may then write it, and imports may read it from the
    /// moment it does. A key nobody expected is refused to both sides.
    pub fn expect(&self, key: &str) {
        self.open.lock().unwrap().insert(key.to_string(), watch::Sender::new(Progress::Waiting));
    }

    /// Ends `key` as failed, so readers waiting on it stop with `why` instead of waiting forever.
    pub fn fail(&self, key: &str, why: &str) {
        if let Some(progress) = self.open.lock().unwrap().get(key) {
            progress.send_if_modified(|p| match p {
                Progress::Done(_) => false,
                _ => {
                    *p = Progress::Failed(why.to_string());
                    true
                }
            });
        }
    }

    /// Closes `key` and deletes its archive; a missing one is fine (the export may never have started).
    pub async fn discard(&self, key: &str) {
        self.fail(key, "the delivery that spooled it has ended");
        self.open.lock().unwrap().remove(key);
        if let Some(path) = self.path(key) {
            let _ = tokio::fs::remove_file(path).await;
        }
    }

    fn spool(&self, key: &str) -> Result<(PathBuf, watch::Sender<Progress>), Status> {
        let path = self
            .path(key)
            .ok_or_else(|| Status::invalid_argument(format!("relay key {key:?} must be 1–200 of [A-Za-z0-9_-]")))?;
        let progress = self.open.lock().unwrap().get(key).cloned().ok_or_else(|| {
            Status::not_found(format!("no delivery expects relay key {key} — it ended, or never began"))
        })?;
        Ok((path, progress))
    }
}

/// The `ImageRelay` gRPC service.
#[derive(Debug, Clone)]
pub struct RelayService {
    pub relay: Relay,
}

#[tonic::async_trait]
impl pb::image_relay_server::ImageRelay for RelayService {
    async fn put(&self, request: Request<Streaming<pb::RelayChunk>>) -> Result<Response<pb::RelayPutReply>, Status> {
        let mut inbound = request.into_inner();
        let first = inbound.message().await?.ok_or_else(|| Status::invalid_argument("relay put without a chunk"))?;
        let (path, progress) = self.relay.spool(&first.key)?;
        let began = progress.send_if_modified(|p| {
            let waiting = *p == Progress::Waiting;
            if waiting {
                *p = Progress::Writing(0);
            }
            waiting
        });
        if !began {
            return Err(Status::already_exists(format!("relay key {} is already being written", first.key)));
        }
        let result = spool(&path, first.data, &mut inbound, &progress).await;
        match &result {
            Ok(bytes) => progress.send_replace(Progress::Done(*bytes)),
            Err(status) => progress.send_replace(Progress::Failed(status.message().to_string())),
        };
        Ok(Response::new(pb::RelayPutReply { bytes: result? }))
    }

    type GetStream = ReceiverStream<Result<pb::RelayChunk, Status>>;

    async fn get(&self, request: Request<pb::RelayGetRequest>) -> Result<Response<Self::GetStream>, Status> {
        let key = request.into_inner().key;
        let (path, progress) = self.relay.spool(&key)?;
        // Only the receiver goes along: once the relay drops the key, `changed` ends the reader.
        let progress = progress.subscribe();
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            if let Err(status) = follow(path, progress, &tx).await {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Writes the archive to `path` in chunks of [`CHUNK`], publishing each chunk's end once it is in
/// the file; the total bytes.
async fn spool(
    path: &std::path::Path,
    first: bytes::Bytes,
    inbound: &mut Streaming<pb::RelayChunk>,
    progress: &watch::Sender<Progress>,
) -> Result<u64, Status> {
    let write_err =
        |e: std::io::Error| Status::internal(format!("cannot write the relay spool {}: {e}", path.display()));
    let mut file = tokio::fs::File::create(path).await.map_err(write_err)?;
    let mut pending = BytesMut::from(&first[..]);
    let mut written = 0u64;
    loop {
        let next = inbound.message().await?;
        if let Some(chunk) = &next {
            pending.extend_from_slice(&chunk.data);
        }
        if pending.len() >= CHUNK || (next.is_none() && !pending.is_empty()) {
            file.write_all(&pending).await.map_err(write_err)?;
            // tokio hands writes to a blocking thread; flushing waits until they are in the file.
            file.flush().await.map_err(write_err)?;
            written += pending.len() as u64;
            pending.clear();
            progress.send_replace(Progress::Writing(written));
        }
        if next.is_none() {
            return Ok(written);
        }
    }
}

/// Streams the spool at `path` to `tx`, following it while it is written, until it is done.
async fn follow(
    path: PathBuf,
    mut progress: watch::Receiver<Progress>,
    tx: &mpsc::Sender<Result<pb::RelayChunk, Status>>,
) -> Result<(), Status> {
    let read_err = |e: std::io::Error| Status::internal(format!("cannot read the relay spool: {e}"));
    let mut file: Option<tokio::fs::File> = None;
    let mut sent = 0u64;
    let mut buf = vec![0u8; CHUNK];
    loop {
        let state = progress.borrow_and_update().clone();
        let (available, done) = match state {
            Progress::Waiting => (0, false),
            Progress::Writing(n) => (n, false),
            Progress::Done(n) => (n, true),
            Progress::Failed(why) => {
                return Err(Status::aborted(format!("the export feeding this relay failed: {why}")))
            }
        };
        while sent < available {
            let file = match &mut file {
                Some(file) => file,
                None => {
                    let mut opened = tokio::fs::File::open(&path).await.map_err(read_err)?;
                    opened.seek(std::io::SeekFrom::Start(sent)).await.map_err(read_err)?;
                    file.insert(opened)
                }
            };
            let want = ((available - sent) as usize).min(CHUNK);
            let n = file.read(&mut buf[..want]).await.map_err(read_err)?;
            if n == 0 {
                return Err(Status::internal("the relay spool is shorter than written — was it deleted?"));
            }
            sent += n as u64;
            let chunk = pb::RelayChunk { key: String::new(), data: bytes::Bytes::copy_from_slice(&buf[..n]) };
            if tx.send(Ok(chunk)).await.is_err() {
                return Ok(());
            }
        }
        if done {
            return Ok(());
        }
        if progress.changed().await.is_err() {
            return Err(Status::aborted("the delivery that spooled this archive has ended"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::image_relay_client::ImageRelayClient;
    use tonic::transport::Channel;

    #[test]
    fn a_key_that_could_leave_the_spool_dir_names_no_file() {
        let relay = Relay { dir: PathBuf::from("/spool"), open: Default::default() };
        assert_eq!(relay.path("abc123-conv_1"), Some(PathBuf::from("/spool/abc123-conv_1.tar")));
        for bad in ["", "../x", "a/b", "a.b", &"k".repeat(201)] {
            assert_eq!(relay.path(bad), None, "{bad:?}");
        }
    }

    /// The relay service on a free loopback port, as agents reach it.
    async fn serve(relay: Relay) -> ImageRelayClient<Channel> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let service = pb::image_relay_server::ImageRelayServer::new(RelayService { relay });
        tokio::spawn(tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming));
        ImageRelayClient::new(Channel::from_shared(url).unwrap().connect_lazy())
    }

    async fn read_all(client: &mut ImageRelayClient<Channel>, key: &str) -> Result<Vec<u8>, Status> {
        let mut chunks = client.get(pb::RelayGetRequest { key: key.to_string() }).await?.into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = chunks.message().await? {
            out.extend_from_slice(&chunk.data);
        }
        Ok(out)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_that_start_before_the_writer_follow_it_to_the_last_byte() {
        let spool = tempfile::tempdir().unwrap();
        let relay = Relay::open(spool.path().join("relay")).unwrap();
        relay.expect("k1");
        let client = serve(relay.clone()).await;
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let mut client = client.clone();
                tokio::spawn(async move { read_all(&mut client, "k1").await })
            })
            .collect();
        // 3.5 MiB in uneven frames, with pauses, so readers catch up with the writer and must wait.
        let archive: Vec<u8> = (0..(7 * CHUNK / 2)).map(|i| (i * 31 % 251) as u8).collect();
        let (tx, rx) = mpsc::channel(4);
        let frames = archive.clone();
        tokio::spawn(async move {
            for (n, frame) in frames.chunks(300_001).enumerate() {
                let key = if n == 0 { "k1".to_string() } else { String::new() };
                tx.send(pb::RelayChunk { key, data: bytes::Bytes::copy_from_slice(frame) }).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        });
        let put = client.clone().put(ReceiverStream::new(rx)).await.unwrap().into_inner();
        assert_eq!(put.bytes, archive.len() as u64);
        for reader in readers {
            assert!(reader.await.unwrap().unwrap() == archive, "every reader gets the archive, byte for byte");
        }
        // A reader arriving after the end reads the finished spool.
        assert!(read_all(&mut client.clone(), "k1").await.unwrap() == archive);
        relay.discard("k1").await;
        assert_eq!(read_all(&mut client.clone(), "k1").await.unwrap_err().code(), tonic::Code::NotFound);
        assert!(!spool.path().join("relay/k1.tar").exists(), "discard deletes the spool file");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_export_ends_waiting_readers_with_its_reason_and_unexpected_keys_are_refused() {
        let spool = tempfile::tempdir().unwrap();
        let relay = Relay::open(spool.path().join("relay")).unwrap();
        relay.expect("k2");
        let mut client = serve(relay.clone()).await;
        let mut waiting = client.clone();
        let reader = tokio::spawn(async move { read_all(&mut waiting, "k2").await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        relay.fail("k2", "docker save of app:1 failed");
        let err = reader.await.unwrap().unwrap_err();
        assert!(err.message().contains("docker save of app:1 failed"), "{err:?}");

        let chunk = pb::RelayChunk { key: "nobody-expects-me".to_string(), data: bytes::Bytes::from_static(b"x") };
        let refused = client.put(tokio_stream::iter(vec![chunk])).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
        assert!(!spool.path().join("relay/nobody-expects-me.tar").exists(), "nothing was written for it");
    }
}
