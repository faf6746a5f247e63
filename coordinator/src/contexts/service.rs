//! The content store's gRPC side ([`ContentService`]): uploads, per-file blobs, presence checks,
//! and downloads — an archive file streamed as stored, or one assembled from an entry list over
//! blobs as it is sent.

use super::{Contexts, CHUNK, ENTRY_LIST_MAX};
use kiln_core::digest::TreeDigest;
use kiln_proto::v1 as pb;
use std::sync::Arc;
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

impl Contexts {
    /// Streams the canonical archive of a context stored as an entry list over blobs, assembled
    /// as it is sent. A blob missing or not its hash's fails the download and forgets the context
    /// (and the lying blob), so the next converge asks the CLI for them again.
    async fn download_assembled(
        self: Arc<Self>,
        digest: TreeDigest,
    ) -> Result<Response<ReceiverStream<Result<pb::DownloadChunk, Status>>>, Status> {
        let list = tokio::fs::read(self.list_path(&digest)).await.map_err(|_| {
            Status::not_found(format!("context {digest} is not stored — re-run `kiln up` to upload it"))
        })?;
        let entries = kiln_core::digest::list::decode_for(&list, &digest).map_err(|e| {
            Status::internal(format!("kept entry list of context {digest}: {}", kiln_core::error_chain(&e)))
        })?;
        let (tx, rx) = mpsc::channel(4);
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let out = ChunkSender { tx: tx.clone(), buf: Vec::with_capacity(CHUNK) };
            let result = self.blobs.assemble(&entries, out);
            if let Err(err) = result {
                if let kiln_core::archive::ArchiveError::Refused { path, .. } = &err {
                    if let Some(hash) =
                        entries.iter().find(|e| String::from_utf8_lossy(&e.path) == *path).and_then(|e| e.hash)
                    {
                        self.blobs.forget(&hash);
                    }
                }
                tracing::warn!(%digest, error = %kiln_core::error_chain(&err), "a stored context could not be assembled; forgotten");
                handle.block_on(self.forget(&digest));
                let message = format!(
                    "assembling context {digest}: {} — re-run `kiln up` to upload it again",
                    kiln_core::error_chain(&err)
                );
                let _ = tx.blocking_send(Err(Status::internal(message)));
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A `Write` that sends what is written as `DownloadChunk`s of [`CHUNK`] bytes, blocking while
/// the stream's channel is full.
struct ChunkSender {
    tx: mpsc::Sender<Result<pb::DownloadChunk, Status>>,
    buf: Vec<u8>,
}

impl ChunkSender {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Ok(pb::DownloadChunk { data: data.into() }))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the download was dropped"))
    }
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let n = bytes.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&bytes[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    /// `pack_with` flushes once, at the end: the last short chunk goes then.
    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

/// The `ContentStore` gRPC service.
#[derive(Debug, Clone)]
pub struct ContentService {
    pub contexts: Arc<Contexts>,
    /// Who runs which build now: a context goes only to an agent building it.
    pub hub: Arc<crate::hub::Hub>,
}

impl ContentService {
    /// A context's bytes are someone's source: they go to the host agent building it, and to the
    /// users whose team owns an instance whose record names it (or who own one themselves).
    async fn may_download(&self, principal: &crate::trust::Principal, digest: &str) -> Result<(), Status> {
        use crate::trust::Principal;
        let allowed = match principal {
            Principal::Embedded => true,
            Principal::User { role: crate::trust::Role::Admin, .. } => true,
            Principal::Agent { id, .. } => self.hub.agent(id).is_some_and(|a| a.builds(digest)),
            Principal::User { name, team, .. } => {
                let store = &self.contexts.store;
                let records = store.records().await.map_err(|e| Status::unavailable(kiln_core::error_chain(&e)))?;
                let mut owned = false;
                for (current, previous) in &records {
                    let names = std::iter::once(current)
                        .chain(previous.as_ref())
                        .flat_map(|r| &r.images)
                        .any(|i| i.context.as_deref() == Some(digest));
                    if !names {
                        continue;
                    }
                    if let Some(owner) = store
                        .owner(&current.instance)
                        .await
                        .map_err(|e| Status::unavailable(kiln_core::error_chain(&e)))?
                    {
                        owned |= match &owner.team {
                            Some(t) => team.as_deref() == Some(t.as_str()),
                            None => owner.user == *name,
                        };
                    }
                }
                owned
            }
            Principal::Anonymous => false,
        };
        if allowed {
            return Ok(());
        }
        Err(Status::permission_denied(format!(
            "{} may not download context {digest}: contexts go to the host agent building them and to their instances' owners",
            principal.actor()
        )))
    }
}

#[tonic::async_trait]
impl pb::content_store_server::ContentStore for ContentService {
    async fn find_missing(
        &self,
        request: Request<pb::FindMissingRequest>,
    ) -> Result<Response<pb::FindMissingReply>, Status> {
        let missing = self.contexts.missing(&request.into_inner().digests).await?;
        Ok(Response::new(pb::FindMissingReply { missing }))
    }

    async fn upload(&self, request: Request<Streaming<pb::UploadChunk>>) -> Result<Response<pb::UploadReply>, Status> {
        let mut chunks = request.into_inner();
        let first = chunks.message().await?.ok_or_else(|| Status::invalid_argument("upload carried no chunk"))?;
        let digest: TreeDigest = first
            .digest
            .parse()
            .map_err(|e: kiln_core::digest::DigestParseError| Status::invalid_argument(e.to_string()))?;
        let bytes = self.contexts.accept(digest, chunks, first.data.to_vec()).await?;
        Ok(Response::new(pb::UploadReply { digest: digest.to_string(), bytes }))
    }

    async fn find_missing_blobs(
        &self,
        request: Request<pb::FindMissingBlobsRequest>,
    ) -> Result<Response<pb::FindMissingBlobsReply>, Status> {
        let request = request.into_inner();
        let hashes = request
            .hashes
            .iter()
            .map(|h| {
                <[u8; 32]>::try_from(h.as_slice()).map_err(|_| {
                    Status::invalid_argument(format!(
                        "a hash of {} bytes was asked about; blake3 hashes are 32",
                        h.len()
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let missing = self.contexts.find_missing_blobs(&request.context, hashes).await?;
        Ok(Response::new(pb::FindMissingBlobsReply { missing: missing.into_iter().map(|h| h.to_vec()).collect() }))
    }

    async fn upload_blobs(
        &self,
        request: Request<Streaming<pb::BlobBatch>>,
    ) -> Result<Response<pb::UploadBlobsReply>, Status> {
        let received = self.contexts.accept_blobs(request.into_inner()).await?;
        Ok(Response::new(pb::UploadBlobsReply { blobs: received.blobs, bytes: received.bytes }))
    }

    async fn put_context(
        &self,
        request: Request<Streaming<pb::ContextListChunk>>,
    ) -> Result<Response<pb::UploadReply>, Status> {
        let mut chunks = request.into_inner();
        let first = chunks.message().await?.ok_or_else(|| Status::invalid_argument("PutContext carried no chunk"))?;
        let digest: TreeDigest = first
            .digest
            .parse()
            .map_err(|e: kiln_core::digest::DigestParseError| Status::invalid_argument(e.to_string()))?;
        let mut list = first.entries.to_vec();
        while let Some(chunk) = chunks.message().await? {
            if list.len() + chunk.entries.len() > ENTRY_LIST_MAX {
                return Err(Status::resource_exhausted(format!(
                    "entry list of context {digest} passes {} MiB — upload it as an archive (ContentStore.Upload)",
                    ENTRY_LIST_MAX >> 20
                )));
            }
            list.extend_from_slice(&chunk.entries);
        }
        let bytes = self.contexts.put_list(digest, list).await?;
        Ok(Response::new(pb::UploadReply { digest: digest.to_string(), bytes }))
    }

    type DownloadStream = ReceiverStream<Result<pb::DownloadChunk, Status>>;

    async fn download(&self, request: Request<pb::DownloadRequest>) -> Result<Response<Self::DownloadStream>, Status> {
        let principal = crate::trust::Principal::of(&request);
        let want = request.into_inner().digest;
        let digest: TreeDigest =
            want.parse().map_err(|e: kiln_core::digest::DigestParseError| Status::invalid_argument(e.to_string()))?;
        self.may_download(&principal, &want).await?;
        let path = self.contexts.path(&digest);
        if !path.is_file() && self.contexts.list_path(&digest).is_file() {
            return self.contexts.clone().download_assembled(digest).await;
        }
        let mut file = tokio::fs::File::open(&path).await.map_err(|_| {
            Status::not_found(format!("context {digest} is not stored — re-run `kiln up` to upload it"))
        })?;
        let mut left = file.metadata().await.map_or(0, |m| m.len());
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                // Sized by what is left (a stored context never changes): a 2 KiB context costs
                // 2 KiB, not two zeroed 1 MiB chunks — a thousand downloads at once made that the
                // coordinator's largest cost.
                let want = if left > 0 { left.min(CHUNK as u64) as usize } else { 64 << 10 };
                let mut buf = vec![0u8; want];
                match file.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        left = left.saturating_sub(n as u64);
                        buf.truncate(n);
                        if tx.send(Ok(pb::DownloadChunk { data: buf.into() })).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(format!("reading context {digest}: {e}")))).await;
                        break;
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
