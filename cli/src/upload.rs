//! Step 4 of the converge on the CLI's side: upload a context the coordinator lacks. [`send`]
//! sends it per file (`crate::blobs`: only the blobs the coordinator lacks, plus the entry list)
//! and falls back to [`upload`], the canonical archive whole, when the coordinator is older than
//! per-file uploads or the entry list is too long to keep. The archive path stays for those two:
//! removing it would strand every context a new coordinator cannot take per file.
//!
//! [`upload`] sends the archive in chunks of at most [`CHUNK`] bytes with the digest on the first.
//!
//! The archive is never held whole: a blocking thread walks and packs the context into a
//! [`ChunkWriter`] that hands each chunk to a bounded channel, and the gRPC request stream drains
//! it, so memory stays at a few chunks whatever the context's size. The context is walked again
//! (not reused from the addressing walk) and the packed digest compared with the one the image was
//! addressed by: a file edited in between fails the upload here, naming the context, instead of
//! reaching the coordinator as bytes the tag does not address.
//!
//! A failed pack must not look like a finished upload, so the stream never *ends* after a failure:
//! it stalls on [`Piece::Abort`] and the caller drops the call, which resets it on the wire.

use std::io::{self, Write};
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::connect::Channel;
use kiln_core::archive::{self, ArchiveError, Packed};
use kiln_core::digest::{walk_tree, DigestError, TreeDigest};
use kiln_proto::v1::content_store_client::ContentStoreClient;
use kiln_proto::v1::UploadChunk;
use tokio::sync::mpsc;
use tokio_stream::Stream;

use crate::request::ContextSource;

/// The largest chunk sent: well under gRPC's 4 MiB default message limit on every server.
pub const CHUNK: usize = 1 << 20;

/// Chunks in flight between the packing thread and the wire.
const DEPTH: usize = 4;

/// Why one context could not be uploaded. The caller names the context directory.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("cannot walk it again")]
    Walk(#[source] DigestError),
    #[error("cannot pack it")]
    Pack(#[source] ArchiveError),
    #[error("it changed since it was addressed (tree {now} now) — re-run `kiln up` once it is quiet")]
    Changed { now: TreeDigest },
    #[error("the coordinator refused it: {message}")]
    Refused { message: String },
    #[error("the connection to the coordinator broke: {reason}")]
    Broken {
        reason: String,
        /// The connection was never made, so nothing of the upload was received: it may be sent again.
        never_delivered: bool,
    },
    #[error("the coordinator stored tree {stored}, not the one sent")]
    WrongDigest { stored: String },
    #[error("the packing thread panicked")]
    Panicked,
}

/// What travels from the packing thread to the request stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece {
    Data(Vec<u8>),
    /// Packing failed: the stream must stall, never end, so the call is dropped rather than
    /// completed with a truncated archive.
    Abort,
}

/// A `Write` that cuts what is written into chunks of exactly [`CHUNK`] bytes (the last one
/// shorter) and sends each into a bounded channel, blocking while the channel is full.
#[derive(Debug)]
pub struct ChunkWriter {
    tx: mpsc::Sender<Piece>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    pub fn new(tx: mpsc::Sender<Piece>) -> ChunkWriter {
        ChunkWriter { tx, buf: Vec::with_capacity(CHUNK) }
    }

    /// Sends what is buffered; the writer is done.
    pub fn finish(mut self) -> io::Result<()> {
        self.send()
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Piece::Data(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the upload stream was closed"))
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let n = bytes.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&bytes[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    /// Chunks are cut by size only, so a flush sends nothing early.
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Walks and packs `source` into `tx`, checking the packed digest against `expected`. Blocking. On
/// any failure an [`Piece::Abort`] is sent last, so the stream stalls instead of ending.
pub fn pack_chunks(
    source: &ContextSource,
    expected: &TreeDigest,
    tx: mpsc::Sender<Piece>,
) -> Result<Packed, UploadError> {
    let abort = tx.clone();
    let result = (|| {
        let tree = walk_tree(&source.dir, &source.walk).map_err(UploadError::Walk)?;
        let mut writer = ChunkWriter::new(tx);
        let packed = archive::pack(&tree, &mut writer).map_err(UploadError::Pack)?;
        if packed.digest != *expected {
            return Err(UploadError::Changed { now: packed.digest });
        }
        writer.finish().map_err(|err| UploadError::Pack(ArchiveError::Write(err)))?;
        Ok(packed)
    })();
    if result.is_err() {
        let _ = abort.blocking_send(Piece::Abort);
    }
    result
}

/// The request stream of `ContentStore.Upload`: the chunks in order, the digest on the first.
#[derive(Debug)]
pub struct UploadStream {
    rx: mpsc::Receiver<Piece>,
    digest: Option<String>,
    aborted: bool,
    sent: u64,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
    name: String,
}

impl UploadStream {
    /// `progress`, when given, receives `(digest, bytes sent so far)` after each chunk.
    pub fn new(
        rx: mpsc::Receiver<Piece>,
        digest: String,
        progress: Option<mpsc::UnboundedSender<(String, u64)>>,
    ) -> Self {
        UploadStream { rx, name: digest.clone(), digest: Some(digest), aborted: false, sent: 0, progress }
    }
}

impl Stream for UploadStream {
    type Item = UploadChunk;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<UploadChunk>> {
        if self.aborted {
            return Poll::Pending;
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Piece::Data(data))) => {
                self.sent += data.len() as u64;
                if let Some(progress) = &self.progress {
                    let _ = progress.send((self.name.clone(), self.sent));
                }
                let digest = self.digest.take().unwrap_or_default();
                Poll::Ready(Some(UploadChunk { digest, data: data.into() }))
            }
            Poll::Ready(Some(Piece::Abort)) => {
                self.aborted = true;
                Poll::Pending
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Uploads the context `source` under `digest` (64 hex). Returns the archive's size.
pub async fn upload(
    mut client: ContentStoreClient<Channel>,
    digest: String,
    source: ContextSource,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
) -> Result<u64, UploadError> {
    let expected: TreeDigest = digest.parse().map_err(|_| UploadError::WrongDigest { stored: digest.clone() })?;
    let (tx, rx) = mpsc::channel(DEPTH);
    let mut packer = tokio::task::spawn_blocking(move || pack_chunks(&source, &expected, tx));
    let call = client.upload(UploadStream::new(rx, digest.clone(), progress));
    tokio::pin!(call);

    let joined = |res: Result<Result<Packed, UploadError>, tokio::task::JoinError>| match res {
        Ok(packed) => packed,
        Err(_) => Err(UploadError::Panicked),
    };
    let (packed, reply) = tokio::select! {
        res = &mut packer => {
            let packed = joined(res)?;
            (packed, call.await)
        }
        reply = &mut call => {
            // The call ended first: on success the stream had ended, so the packer is done too.
            let reply = reply.map_err(wire_error)?;
            (joined(packer.await)?, Ok(reply))
        }
    };
    let reply = reply.map_err(wire_error)?.into_inner();
    if !reply.digest.is_empty() && reply.digest != digest {
        return Err(UploadError::WrongDigest { stored: reply.digest });
    }
    Ok(packed.bytes)
}

/// What one context's upload sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Uploaded {
    Blobs(crate::blobs::Sent),
    Archive { bytes: u64 },
}

impl Uploaded {
    /// The line a converge prints for it: what moved, so a one-file edit visibly sends one blob.
    pub fn words(&self, digest: &str) -> String {
        let short: String = digest.chars().take(12).collect();
        match self {
            Uploaded::Blobs(sent) => format!(
                "context {short}: sent {} of {} file blob(s) ({} bytes) and its entry list ({} bytes)",
                sent.blobs, sent.of, sent.bytes, sent.list_bytes
            ),
            Uploaded::Archive { bytes } => format!("context {short}: sent as one archive ({bytes} bytes)"),
        }
    }
}

/// Uploads the context per file, or as one archive when the coordinator cannot take it per file.
pub async fn send(
    client: ContentStoreClient<Channel>,
    digest: String,
    source: ContextSource,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
) -> Result<Uploaded, UploadError> {
    match crate::blobs::upload(client.clone(), &digest, &source, progress.clone()).await? {
        crate::blobs::Outcome::Sent(sent) => Ok(Uploaded::Blobs(sent)),
        crate::blobs::Outcome::Fallback => {
            Ok(Uploaded::Archive { bytes: upload(client, digest, source, progress).await? })
        }
    }
}

/// [`send`] on the retry ladder: an upload whose connection was never made (refused, unreachable)
/// is an action that was never delivered, so it is sent again, as every call is (DESIGN.md "Talking
/// across the network"); one that broke after bytes left is not. The routability line is printed
/// when a retry cost something.
pub async fn upload_on_ladder(
    client: ContentStoreClient<Channel>,
    digest: String,
    source: ContextSource,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
    url: &str,
    window: std::time::Duration,
) -> Result<Uploaded, UploadError> {
    use kiln_core::retry::{Attempt, Ladder, LadderConfig};
    let mut ladder = Ladder::new(LadderConfig::with_window(window), u64::from(std::process::id()));
    let last = std::sync::Mutex::new(None);
    let result = kiln_core::retry::retry_measured(&mut ladder, &crate::connect::TokioClock, || {
        let (client, digest, source, progress, last) =
            (client.clone(), digest.clone(), source.clone(), progress.clone(), &last);
        async move {
            match send(client, digest, source, progress).await {
                Ok(bytes) => Ok(bytes),
                Err(err) => {
                    let retry = matches!(err, UploadError::Broken { never_delivered: true, .. });
                    let text = err.to_string();
                    *last.lock().unwrap() = Some(err);
                    Err(if retry { Attempt::Retry(text) } else { Attempt::Fatal(text) })
                }
            }
        }
    })
    .await;
    match result {
        Ok(done) => {
            if let Some(line) = done.routability_line("kiln.upload", url) {
                eprintln!("{line}");
            }
            Ok(done.value)
        }
        Err(gave_up) => {
            if gave_up.attempts > 1 {
                eprintln!("{}", gave_up.routability_line("kiln.upload", url));
            }
            Err(last.into_inner().unwrap().unwrap_or(UploadError::Panicked))
        }
    }
}

pub(crate) fn wire_error(status: tonic::Status) -> UploadError {
    if status.code() == tonic::Code::Unavailable {
        let never_delivered = crate::connect::never_delivered(&status);
        UploadError::Broken { reason: crate::connect::reason(&status), never_delivered }
    } else {
        UploadError::Refused { message: status.message().to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::digest::{digest_dir, WalkOptions};
    use tokio_stream::StreamExt;

    fn context() -> (tempfile::TempDir, ContextSource, TreeDigest) {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("Dockerfile"), "FROM scratch\nCOPY . /\n").unwrap();
        // Not a multiple of the chunk size, so the last chunk is short; not compressible to nothing.
        let big: Vec<u8> = (0..(2 * CHUNK + 12_345)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(tmp.path().join("big.bin"), big).unwrap();
        std::fs::create_dir(tmp.path().join("etc")).unwrap();
        std::fs::write(tmp.path().join("etc/small"), "x").unwrap();
        let walk = WalkOptions { dockerfile: Some("Dockerfile".into()) };
        let (_, digest) = digest_dir(tmp.path(), &walk).unwrap();
        let source = ContextSource {
            dir: tmp.path().to_path_buf(),
            walk,
            images: vec!["app".into()],
            archive_bytes: 0,
            tree: None,
            stat_cache: None,
        };
        (tmp, source, digest)
    }

    fn packed_whole(source: &ContextSource) -> Vec<u8> {
        let tree = walk_tree(&source.dir, &source.walk).unwrap();
        let mut whole = Vec::new();
        archive::pack(&tree, &mut whole).unwrap();
        whole
    }

    #[tokio::test]
    async fn the_chunks_are_at_most_a_mebibyte_and_concatenate_to_the_archive() {
        let (_tmp, source, digest) = context();
        let (tx, rx) = mpsc::channel(DEPTH);
        let (ptx, mut prx) = mpsc::unbounded_channel();
        let packer = {
            let source = source.clone();
            tokio::task::spawn_blocking(move || pack_chunks(&source, &digest, tx))
        };
        let chunks: Vec<UploadChunk> = UploadStream::new(rx, digest.to_string(), Some(ptx)).collect().await;
        let packed = packer.await.unwrap().unwrap();

        assert!(chunks.len() >= 3, "{} chunks", chunks.len());
        assert!(chunks.iter().all(|c| !c.data.is_empty() && c.data.len() <= CHUNK));
        assert!(chunks[..chunks.len() - 1].iter().all(|c| c.data.len() == CHUNK), "only the last is short");
        assert_eq!(chunks[0].digest, digest.to_string(), "the first chunk names the digest");
        assert!(chunks[1..].iter().all(|c| c.digest.is_empty()), "only the first does");
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.data.iter().copied()).collect();
        assert_eq!(joined, packed_whole(&source));
        assert_eq!(packed.bytes, joined.len() as u64);
        assert_eq!(packed.digest, digest);

        let mut last = 0;
        while let Ok((name, sent)) = prx.try_recv() {
            assert_eq!(name, digest.to_string());
            assert!(sent > last);
            last = sent;
        }
        assert_eq!(last, joined.len() as u64, "progress counts every byte sent");
    }

    #[test]
    fn a_context_edited_since_it_was_addressed_aborts_instead_of_ending() {
        let (_tmp, source, digest) = context();
        std::fs::write(source.dir.join("etc/small"), "edited").unwrap();
        let (tx, mut rx) = mpsc::channel(64);
        let err = pack_chunks(&source, &digest, tx).unwrap_err();
        assert!(matches!(err, UploadError::Changed { .. }), "{err}");
        let mut pieces = Vec::new();
        while let Some(piece) = rx.blocking_recv() {
            pieces.push(piece);
        }
        assert_eq!(pieces.last(), Some(&Piece::Abort), "the stream is told to stall, not to end");
    }

    #[tokio::test]
    async fn an_aborted_stream_stalls_after_what_it_already_sent() {
        let (tx, rx) = mpsc::channel(4);
        tx.send(Piece::Data(vec![1, 2, 3])).await.unwrap();
        tx.send(Piece::Abort).await.unwrap();
        drop(tx);
        let mut stream = UploadStream::new(rx, "d".into(), None);
        assert_eq!(stream.next().await.map(|c| c.data.to_vec()), Some(vec![1, 2, 3]));
        // The sender is gone, so a stream that ignored the abort would now be Ready(None).
        let mut cx = Context::from_waker(std::task::Waker::noop());
        for _ in 0..3 {
            assert!(Pin::new(&mut stream).poll_next(&mut cx).is_pending(), "after an abort it neither yields nor ends");
        }
    }
}
