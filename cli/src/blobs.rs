//! Step 4 of the converge, per file: a context the coordinator lacks travels as the blobs (files
//! by blake3 content hash) it does not hold plus the context's entry list, so a one-file edit sends
//! one blob and a tree another developer already sent sends none.
//!
//! `FindMissingBlobs` is asked in batches of [`FIND_BATCH`] hashes; the missing blobs go over
//! [`STREAMS`] `UploadBlobs` calls at once, each a blocking reader thread that fills messages of
//! up to [`MESSAGE`] bytes — many small files whole in one message, a big one in consecutive
//! pieces — into a bounded channel, so memory stays at a few messages per stream whatever the
//! context's size. Every blob is hashed again as it is read: a file edited since the context was
//! addressed fails the upload here, naming the context, before its last piece leaves (the
//! coordinator would refuse it too). Then `PutContext` sends the entry list.
//!
//! A coordinator older than per-file uploads answers UNIMPLEMENTED; so does a context whose entry
//! list is too long to keep: both go back to the whole-archive `Upload` ([`Outcome::Fallback`]).

use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::connect::Channel;
use crate::request::ContextSource;
use crate::upload::UploadError;
use kiln_core::archive::ArchiveError;
use kiln_core::digest::{cache_file_for, digest_dir, digest_dir_cached, EntryKind, Tree, TreeDigest};
use kiln_proto::v1 as pb;
use kiln_proto::v1::content_store_client::ContentStoreClient;
use tokio::sync::mpsc;
use tokio_stream::Stream;

/// Blob bytes per `UploadBlobs` message: under the coordinator's 2 MiB decoding limit with room
/// for the pieces' framing.
pub const MESSAGE: usize = 1 << 20;
/// `UploadBlobs` calls at once: one HTTP/2 stream's flow window and one reader thread are each
/// a ceiling a single stream hits well below loopback's speed.
pub const STREAMS: usize = 4;
/// Hashes per `FindMissingBlobs` call (the coordinator takes up to 65,536).
pub const FIND_BATCH: usize = 16_384;
/// The longest entry list sent as one (the coordinator keeps lists up to 16 MiB).
pub const LIST_MAX: usize = 16 << 20;
/// Messages in flight between a reader thread and its stream.
const DEPTH: usize = 4;

/// What a per-file upload sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sent {
    /// Blobs sent, of `of` distinct blobs the context names.
    pub blobs: u64,
    pub of: u64,
    /// Blob bytes sent, and the entry list's.
    pub bytes: u64,
    pub list_bytes: u64,
}

/// How a per-file upload ended.
#[derive(Debug)]
pub enum Outcome {
    Sent(Sent),
    /// The coordinator cannot take this context per file: send the archive instead.
    Fallback,
}

/// One distinct blob: its hash, size and one file that holds it.
#[derive(Clone, Debug)]
struct Blob {
    hash: [u8; 32],
    size: u64,
    path: Vec<u8>,
}

/// Uploads `source` (tree `digest`) per file. `progress` receives `(digest, blob bytes sent so far)`.
pub async fn upload(
    client: ContentStoreClient<Channel>,
    digest: &str,
    source: &ContextSource,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
) -> Result<Outcome, UploadError> {
    let expected: TreeDigest = digest.parse().map_err(|_| UploadError::WrongDigest { stored: digest.to_string() })?;
    let tree = match &source.tree {
        Some(tree) => tree.clone(),
        None => {
            let (dir, walk, cache) = (source.dir.clone(), source.walk.clone(), source.stat_cache.clone());
            let walked = tokio::task::spawn_blocking(move || match cache {
                Some(cache) => {
                    digest_dir_cached(&dir, &walk, &cache_file_for(&cache, &dir)).map(|(t, h, _)| (t, h.digest))
                }
                None => digest_dir(&dir, &walk),
            })
            .await;
            let (tree, now) = walked.map_err(|_| UploadError::Panicked)?.map_err(UploadError::Walk)?;
            if now != expected {
                return Err(UploadError::Changed { now });
            }
            Arc::new(tree)
        }
    };
    let list = kiln_core::digest::list::encode(&tree.entries)
        .map_err(|err| UploadError::Refused { message: format!("its entry list cannot be encoded: {err}") })?;
    if list.len() > LIST_MAX {
        return Ok(Outcome::Fallback);
    }
    if kiln_core::digest::list::digest_of(&list) != expected {
        return Err(UploadError::Changed { now: kiln_core::digest::list::digest_of(&list) });
    }
    let blobs = distinct_blobs(&tree);
    let Some(missing) = find_missing(client.clone(), digest, &blobs).await? else { return Ok(Outcome::Fallback) };
    let sent_bytes = Arc::new(AtomicU64::new(0));
    let mut calls = tokio::task::JoinSet::new();
    for share in split(missing.clone(), STREAMS) {
        let (client, tree, digest) = (client.clone(), tree.clone(), digest.to_string());
        let (progress, sent_bytes) = (progress.clone(), sent_bytes.clone());
        calls.spawn(upload_share(client, digest, tree, share, progress, sent_bytes));
    }
    while let Some(joined) = calls.join_next().await {
        // The first failure drops the other calls with the set, resetting them on the wire.
        joined.map_err(|_| UploadError::Panicked)??;
    }
    put_list(client, digest, list.clone()).await?;
    Ok(Outcome::Sent(Sent {
        blobs: missing.len() as u64,
        of: blobs.len() as u64,
        bytes: missing.iter().map(|b| b.size).sum(),
        list_bytes: list.len() as u64,
    }))
}

/// Each content hash once, with the first file that holds it.
fn distinct_blobs(tree: &Tree) -> Vec<Blob> {
    let mut seen = std::collections::HashSet::new();
    tree.entries
        .iter()
        .filter(|e| matches!(e.kind, EntryKind::File | EntryKind::ExecFile))
        .filter_map(|e| e.hash.map(|h| Blob { hash: h.0, size: e.size, path: e.path.clone() }))
        .filter(|b| seen.insert(b.hash))
        .collect()
}

/// The blobs the coordinator lacks, or `None` when it does not know per-file uploads.
async fn find_missing(
    mut client: ContentStoreClient<Channel>,
    digest: &str,
    blobs: &[Blob],
) -> Result<Option<Vec<Blob>>, UploadError> {
    let mut missing = Vec::new();
    for batch in blobs.chunks(FIND_BATCH) {
        let request = pb::FindMissingBlobsRequest {
            context: digest.to_string(),
            hashes: batch.iter().map(|b| b.hash.to_vec()).collect(),
        };
        let reply = match client.find_missing_blobs(request).await {
            Ok(reply) => reply.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => return Ok(None),
            Err(status) => return Err(crate::upload::wire_error(status)),
        };
        let lacking: std::collections::HashSet<Vec<u8>> = reply.missing.into_iter().collect();
        missing.extend(batch.iter().filter(|b| lacking.contains(b.hash.as_slice())).cloned());
    }
    Ok(Some(missing))
}

/// `blobs` dealt into at most `n` shares of about equal bytes, biggest first.
fn split(mut blobs: Vec<Blob>, n: usize) -> Vec<Vec<Blob>> {
    blobs.sort_by_key(|b| std::cmp::Reverse(b.size));
    let mut shares: Vec<(u64, Vec<Blob>)> = vec![(0, Vec::new()); n.max(1)];
    for blob in blobs {
        let least = shares.iter_mut().min_by_key(|(bytes, _)| *bytes).expect("at least one share");
        least.0 += blob.size;
        least.1.push(blob);
    }
    shares.into_iter().map(|(_, share)| share).filter(|share| !share.is_empty()).collect()
}

/// One `UploadBlobs` call carrying `share`.
async fn upload_share(
    mut client: ContentStoreClient<Channel>,
    digest: String,
    tree: Arc<Tree>,
    share: Vec<Blob>,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
    sent: Arc<AtomicU64>,
) -> Result<(), UploadError> {
    let (tx, rx) = mpsc::channel(DEPTH);
    let context = digest.clone();
    let mut reader = tokio::task::spawn_blocking(move || read_blobs(&tree, &context, share, tx));
    let stream = BatchStream { rx, aborted: false, sent, progress, name: digest };
    let call = client.upload_blobs(stream);
    tokio::pin!(call);
    let joined =
        |res: Result<Result<(), UploadError>, tokio::task::JoinError>| res.unwrap_or(Err(UploadError::Panicked));
    tokio::select! {
        res = &mut reader => {
            joined(res)?;
            call.await.map_err(crate::upload::wire_error)?;
        }
        reply = &mut call => {
            reply.map_err(crate::upload::wire_error)?;
            joined(reader.await)?;
        }
    }
    Ok(())
}

/// What travels from a reader thread to its request stream.
enum Piece {
    Batch(pb::BlobBatch),
    /// Reading failed: the stream stalls, never ends, so the call is dropped rather than
    /// completed (see `crate::upload`).
    Abort,
}

/// Reads `share`'s files under `tree.root` into batches. Blocking; sends [`Piece::Abort`] last on failure.
fn read_blobs(tree: &Tree, context: &str, share: Vec<Blob>, tx: mpsc::Sender<Piece>) -> Result<(), UploadError> {
    let abort = tx.clone();
    let mut batch = Batcher { tx, context: Some(context.to_string()), pieces: Vec::new(), bytes: 0 };
    let result = share.iter().try_for_each(|blob| read_blob(tree, blob, &mut batch)).and_then(|()| batch.flush());
    if result.is_err() {
        let _ = abort.blocking_send(Piece::Abort);
    }
    result
}

fn read_blob(tree: &Tree, blob: &Blob, batch: &mut Batcher) -> Result<(), UploadError> {
    let shown = || String::from_utf8_lossy(&blob.path).into_owned();
    let read_err = |err| UploadError::Pack(ArchiveError::Read { root: tree.root.clone(), path: shown(), err });
    let mut file = std::fs::File::open(tree.root.join(std::ffi::OsStr::from_bytes(&blob.path))).map_err(read_err)?;
    let mut hasher = blake3::Hasher::new();
    let mut offset = 0u64;
    loop {
        let want = (blob.size - offset).min(MESSAGE as u64) as usize;
        if want > MESSAGE - batch.bytes && !batch.pieces.is_empty() {
            batch.flush()?;
        }
        let mut data = vec![0u8; want];
        file.read_exact(&mut data).map_err(|err| match err.kind() {
            std::io::ErrorKind::UnexpectedEof => UploadError::Pack(ArchiveError::Changed {
                root: tree.root.clone(),
                path: shown(),
                expected: blob.size,
                actual: offset,
            }),
            _ => read_err(err),
        })?;
        hasher.update(&data);
        let end = offset + want as u64 == blob.size;
        // Before the last piece leaves: a file edited since it was hashed is never sent whole.
        if end && *hasher.finalize().as_bytes() != blob.hash {
            return Err(UploadError::Pack(ArchiveError::Changed {
                root: tree.root.clone(),
                path: shown(),
                expected: blob.size,
                actual: blob.size,
            }));
        }
        batch.push(pb::BlobPiece { hash: blob.hash.to_vec(), size: blob.size, offset, data: data.into() });
        offset += want as u64;
        if end {
            return Ok(());
        }
    }
}

/// Fills messages up to [`MESSAGE`] bytes.
struct Batcher {
    tx: mpsc::Sender<Piece>,
    /// The context digest, on the first message only.
    context: Option<String>,
    pieces: Vec<pb::BlobPiece>,
    bytes: usize,
}

impl Batcher {
    fn push(&mut self, piece: pb::BlobPiece) {
        self.bytes += piece.data.len();
        self.pieces.push(piece);
    }

    fn flush(&mut self) -> Result<(), UploadError> {
        if self.pieces.is_empty() && self.context.is_none() {
            return Ok(());
        }
        let batch = pb::BlobBatch {
            context: self.context.take().unwrap_or_default(),
            pieces: std::mem::take(&mut self.pieces),
        };
        self.bytes = 0;
        self.tx
            .blocking_send(Piece::Batch(batch))
            .map_err(|_| UploadError::Broken { reason: "the upload stream was closed".into(), never_delivered: false })
    }
}

/// The request stream of one `UploadBlobs` call.
struct BatchStream {
    rx: mpsc::Receiver<Piece>,
    aborted: bool,
    sent: Arc<AtomicU64>,
    progress: Option<mpsc::UnboundedSender<(String, u64)>>,
    name: String,
}

impl Stream for BatchStream {
    type Item = pb::BlobBatch;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<pb::BlobBatch>> {
        if self.aborted {
            return Poll::Pending;
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Piece::Batch(batch))) => {
                let bytes: u64 = batch.pieces.iter().map(|p| p.data.len() as u64).sum();
                let total = self.sent.fetch_add(bytes, Ordering::Relaxed) + bytes;
                if let Some(progress) = &self.progress {
                    let _ = progress.send((self.name.clone(), total));
                }
                Poll::Ready(Some(batch))
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

/// `PutContext`: the entry list in pieces of at most [`MESSAGE`] bytes.
async fn put_list(mut client: ContentStoreClient<Channel>, digest: &str, list: Vec<u8>) -> Result<(), UploadError> {
    let list = bytes::Bytes::from(list);
    let mut chunks = Vec::new();
    let mut at = 0;
    loop {
        let end = (at + MESSAGE).min(list.len());
        let digest = if at == 0 { digest.to_string() } else { String::new() };
        chunks.push(pb::ContextListChunk { digest, entries: list.slice(at..end) });
        at = end;
        if at >= list.len() {
            break;
        }
    }
    let reply = client.put_context(tokio_stream::iter(chunks)).await.map_err(crate::upload::wire_error)?.into_inner();
    if reply.digest != digest {
        return Err(UploadError::WrongDigest { stored: reply.digest });
    }
    Ok(())
}
