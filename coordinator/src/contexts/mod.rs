//! The content store: build contexts by tree digest, so a second developer converging the same
//! sources uploads nothing. A context is stored either as its entry list (`<digest>.list`) over
//! file blobs by content hash (`blobs/`, [`crate::blobs`]: what the CLI sends, only the blobs the
//! store lacks), or whole as a canonical archive (`<digest>.tar`: the `Upload` of a CLI older than
//! per-file uploads, or of a context whose entry list passes [`ENTRY_LIST_MAX`]).
//!
//! An archive upload is accepted only after `kiln_core::archive::verify` has walked every entry and
//! recomputed the digest; a per-file one only once its list hashes to the digest and every blob
//! was hashed as it arrived. Either way nothing is stored under a digest it does not hold.

mod service;

pub use service::ContentService;

use crate::model::ContextRow;
use crate::state::StateStore;
use kiln_core::digest::TreeDigest;
use kiln_proto::v1 as pb;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tonic::{Status, Streaming};

const CHUNK: usize = 1 << 20;

/// The longest entry list kept per context (its canonical stream: about 50 bytes plus the path
/// per entry, so some 150 000 files). Longer lists are not kept — that context's changes are then
/// told by tree digest alone — so one upload can hold no more than this in memory for it.
pub const ENTRY_LIST_MAX: usize = 16 << 20;

/// The largest message the content store decodes: the CLI's 1 MiB upload chunk, with room for
/// its framing and a client that cuts a little differently. Each message is held whole until
/// decoded, so this is what one stream can make the coordinator buffer beyond its flow window.
pub(crate) const UPLOAD_MESSAGE_MAX: usize = 2 << 20;

/// The context files and their index.
pub struct Contexts {
    dir: PathBuf,
    pub(crate) store: Arc<dyn StateStore>,
    /// Each context that lands, by digest. A converge waiting for its uploads looks again only
    /// when one of its own arrives: a wake-up of every waiter per upload had one round of 200
    /// converges ask the state which contexts it holds 157,000 times.
    arrived: tokio::sync::broadcast::Sender<String>,
    /// Held while a context is collected and while an upload lands, so an upload that arrives
    /// just after its row was collected is never deleted with the old file.
    landing: tokio::sync::Mutex<()>,
    /// `Config::max_upload_bytes`: an upload is refused the moment it passes this.
    max_upload_bytes: u64,
    metrics: Arc<crate::metrics::Metrics>,
    pub(crate) blobs: crate::blobs::Blobs,
}

/// What a collection of the content store took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collected {
    pub contexts: u64,
    /// Bytes of contexts and of blobs taken.
    pub bytes: u64,
    /// File blobs no stored context names and no upload in flight holds.
    pub blobs: u64,
}

impl std::fmt::Debug for Contexts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contexts").field("dir", &self.dir).finish()
    }
}

impl Contexts {
    /// Opens the store in `dir`; with `clean_up`, removing what a coordinator killed mid-upload
    /// left behind: an `.upload-*` file is never a context, and no upload runs before the server
    /// starts (a read-only coordinator beside a running one must not clean up).
    pub fn open(
        dir: PathBuf,
        store: Arc<dyn StateStore>,
        clean_up: bool,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> std::io::Result<Contexts> {
        std::fs::create_dir_all(&dir)?;
        let entries = if clean_up { std::fs::read_dir(&dir)?.collect() } else { Vec::new() };
        for entry in entries {
            let entry = entry?;
            if entry.file_name().to_string_lossy().starts_with(".upload-") {
                tracing::info!(file = %entry.path().display(), "removing an upload a crash left behind");
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let blobs = crate::blobs::Blobs::open(dir.join("blobs"), clean_up)?;
        Ok(Contexts {
            blobs,
            dir,
            store,
            arrived: tokio::sync::broadcast::channel(1024).0,
            landing: tokio::sync::Mutex::new(()),
            max_upload_bytes: crate::server::DEFAULT_MAX_UPLOAD_BYTES,
            metrics,
        })
    }

    /// Refuses any upload of more than `bytes`.
    pub fn with_upload_limit(mut self, bytes: u64) -> Contexts {
        self.max_upload_bytes = bytes;
        self
    }

    /// Collects by reachability: every stored context that `keep` (the records' current and
    /// previous generations) does not name and no live claim holds is deleted, row and file.
    /// With `dry_run`, only counts what would go.
    pub async fn collect(
        &self,
        keep: &std::collections::HashSet<String>,
        now_ms: u64,
        dry_run: bool,
    ) -> Result<Collected, crate::state::StateError> {
        let claims: std::collections::HashSet<String> =
            self.store.live_claims(now_ms).await?.into_iter().map(|c| c.reference).collect();
        let mut collected = Collected::default();
        for row in self.store.contexts().await? {
            let claim = format!("{}{}", crate::engine::CONTEXT_CLAIM_PREFIX, row.digest);
            if keep.contains(&row.digest) || claims.contains(&claim) {
                continue;
            }
            if !dry_run {
                let _landing = self.landing.lock().await;
                if !self.store.delete_context_unless_claimed(&row.digest, &claim, now_ms).await? {
                    continue;
                }
                if let Ok(digest) = row.digest.parse::<TreeDigest>() {
                    let _ = tokio::fs::remove_file(self.path(&digest)).await;
                    let _ = tokio::fs::remove_file(self.list_path(&digest)).await;
                }
            }
            collected.contexts += 1;
            collected.bytes += row.bytes;
        }
        let (blobs, bytes) = self.collect_blobs(&claims, keep, dry_run).await?;
        collected.blobs = blobs;
        collected.bytes += bytes;
        Ok(collected)
    }

    /// The blob half of [`Contexts::collect`]: every blob no context still stored names (in a dry
    /// run, none that would stay) and no upload in flight under a live claim holds.
    async fn collect_blobs(
        &self,
        claims: &std::collections::HashSet<String>,
        keep: &std::collections::HashSet<String>,
        dry_run: bool,
    ) -> Result<(u64, u64), crate::state::StateError> {
        let _landing = self.landing.lock().await;
        let mut reachable = std::collections::HashSet::new();
        for row in self.store.contexts().await? {
            let claim = format!("{}{}", crate::engine::CONTEXT_CLAIM_PREFIX, row.digest);
            let stays = !dry_run || keep.contains(&row.digest) || claims.contains(&claim);
            let Ok(digest) = row.digest.parse::<TreeDigest>() else { continue };
            if !stays {
                continue;
            }
            if let Some(entries) = self.entries(&digest).await? {
                reachable.extend(crate::blobs::named(&entries));
            }
        }
        let live = |context: &str| claims.contains(&format!("{}{context}", crate::engine::CONTEXT_CLAIM_PREFIX));
        // A blob directory that cannot be listed collects nothing this time; the contexts were.
        Ok(self.blobs.collect(&reachable, &live, dry_run).unwrap_or_else(|err| {
            tracing::warn!(dir = %self.blobs.dir().display(), error = %err, "blobs not collected");
            (0, 0)
        }))
    }

    /// Where a context stored as an entry list over blobs keeps its list (its presence marks the
    /// context stored on this coordinator's disk, as `<digest>.tar` does for a whole archive).
    pub fn list_path(&self, digest: &TreeDigest) -> PathBuf {
        self.dir.join(format!("{digest}.list"))
    }

    /// The blobs among `hashes` not stored, held for `context` until it lands or its claim goes.
    pub async fn find_missing_blobs(&self, context: &str, hashes: Vec<[u8; 32]>) -> Result<Vec<[u8; 32]>, Status> {
        crate::blobs::context_digest(context)?;
        if hashes.len() > crate::blobs::FIND_MAX {
            return Err(Status::invalid_argument(format!(
                "{} hashes asked at once; ask at most {} per call",
                hashes.len(),
                crate::blobs::FIND_MAX
            )));
        }
        let _landing = self.landing.lock().await;
        self.blobs.hold(context, hashes.iter().copied());
        Ok(self.blobs.missing(&hashes))
    }

    /// Stores one `UploadBlobs` stream's blobs, each hashed as it arrives.
    async fn accept_blobs(
        self: &Arc<Self>,
        mut batches: Streaming<pb::BlobBatch>,
    ) -> Result<crate::blobs::Received, Status> {
        let Some(first) = batches.message().await? else { return Ok(Default::default()) };
        crate::blobs::context_digest(&first.context)?;
        {
            let _landing = self.landing.lock().await;
            self.blobs.hold(&first.context, first.pieces.iter().filter_map(|p| p.hash.as_slice().try_into().ok()));
        }
        let context = first.context.clone();
        let (tx, rx) = std::sync::mpsc::sync_channel::<pb::BlobBatch>(8);
        let me = self.clone();
        let max = self.max_upload_bytes;
        let writer = tokio::task::spawn_blocking(move || me.blobs.receive(rx, max));
        let mut next = Some(first);
        loop {
            let batch = match next.take() {
                Some(b) => b,
                None => match batches.message().await {
                    Ok(Some(b)) => b,
                    Ok(None) => break,
                    Err(status) => {
                        drop(tx);
                        let _ = writer.await;
                        return Err(status);
                    }
                },
            };
            // Every blob is held before it can be renamed into the store (see `crate::blobs`).
            {
                let _landing = self.landing.lock().await;
                self.blobs.hold(&context, batch.pieces.iter().filter_map(|p| p.hash.as_slice().try_into().ok()));
            }
            if tx.send(batch).is_err() {
                break; // the writer stopped: its verdict says why
            }
        }
        drop(tx);
        let received = writer.await.map_err(|e| Status::internal(e.to_string()))??;
        self.metrics.uploaded_bytes.inc_by(received.bytes);
        Ok(received)
    }

    /// Stores `digest` as its entry list `list` over blobs the store holds.
    pub async fn put_list(&self, digest: TreeDigest, list: Vec<u8>) -> Result<u64, Status> {
        let entries = kiln_core::digest::list::decode_for(&list, &digest).map_err(|err| {
            Status::invalid_argument(format!(
                "entry list of context {digest} refused: {}",
                kiln_core::error_chain(&err)
            ))
        })?;
        let landing = self.landing.lock().await;
        if let Some((entry, count)) = self.blobs.first_absent(&entries) {
            return Err(Status::failed_precondition(format!(
                "context {digest}: {count} file blob(s) it names are not stored (first: {}) — upload them                  (ContentStore.UploadBlobs) and put the context again",
                String::from_utf8_lossy(&entry.path)
            )));
        }
        let bytes = kiln_core::archive::packed_size(&entries);
        let io = |e: std::io::Error| Status::internal(format!("storing context {digest}: {e}"));
        let internal = |e: crate::state::StateError| Status::internal(e.to_string());
        self.store.put_context_entries(&digest.to_string(), list.clone()).await.map_err(internal)?;
        let tmp = self.dir.join(format!(".upload-{digest}-{:08x}.list", fastrand::u32(..)));
        tokio::fs::write(&tmp, &list).await.map_err(io)?;
        tokio::fs::rename(&tmp, self.list_path(&digest)).await.map_err(io)?;
        let row = ContextRow { digest: digest.to_string(), bytes, stored_at_ms: 0 };
        self.store.put_context(row).await.map_err(internal)?;
        self.blobs.landed(&digest.to_string());
        drop(landing);
        let _ = self.arrived.send(digest.to_string());
        Ok(bytes)
    }

    /// The bytes of the file `wanted` (a path relative to the context's root) of a stored context,
    /// whichever way it is stored: from its blob when the context is an entry list over blobs,
    /// from the archive otherwise. `None` when the context or the file is not there. Blocking.
    pub fn read_file(&self, digest: &TreeDigest, wanted: &str) -> Option<Vec<u8>> {
        let wanted = wanted.trim_start_matches("./");
        if let Ok(list) = std::fs::read(self.list_path(digest)) {
            let entries = kiln_core::digest::list::decode_for(&list, digest).ok()?;
            let entry = entries.iter().find(|e| e.path == wanted.as_bytes())?;
            let bytes = std::fs::read(self.blobs.path(&entry.hash.as_ref()?.0)).ok()?;
            // Read again after the upload checked it: a blob changed on disk is not trusted.
            return (kiln_core::digest::ContentHash::of(&bytes) == *entry.hash.as_ref()?).then_some(bytes);
        }
        let file = std::fs::File::open(self.path(digest)).ok()?;
        let mut tar = tar::Archive::new(std::io::BufReader::new(file));
        for entry in tar.entries().ok()? {
            let mut entry = entry.ok()?;
            if entry.path().ok()?.to_string_lossy().trim_start_matches("./") == wanted {
                let mut bytes = Vec::new();
                entry.read_to_end(&mut bytes).ok()?;
                return Some(bytes);
            }
        }
        None
    }

    pub fn path(&self, digest: &TreeDigest) -> PathBuf {
        self.dir.join(format!("{digest}.tar"))
    }

    /// The digests among `digests` that are not stored (indexed and on disk), in the order given.
    pub async fn missing(&self, digests: &[String]) -> Result<Vec<String>, Status> {
        let unknown = self.store.missing_contexts(digests).await.map_err(|e| Status::internal(e.to_string()))?;
        let mut missing = Vec::new();
        for d in digests {
            let on_disk =
                d.parse::<TreeDigest>().is_ok_and(|t| self.path(&t).is_file() || self.list_path(&t).is_file());
            if (unknown.contains(d) || !on_disk) && !missing.contains(d) {
                missing.push(d.clone());
            }
        }
        Ok(missing)
    }

    /// The entry list kept for `digest`, if one is and it is that tree's: a list that does not
    /// hash to its digest is never used to name files (and is logged, since it means a bug).
    pub async fn entries(
        &self,
        digest: &TreeDigest,
    ) -> Result<Option<Vec<kiln_core::digest::Entry>>, crate::state::StateError> {
        let Some(stream) = self.store.context_entries(&digest.to_string()).await? else { return Ok(None) };
        match kiln_core::digest::list::decode_for(&stream, digest) {
            Ok(entries) => Ok(Some(entries)),
            Err(err) => {
                tracing::warn!(%digest, error = %err, "a kept entry list does not match its context; ignored");
                Ok(None)
            }
        }
    }

    /// Drops a stored context whose bytes an agent refused, so `missing` asks for it again.
    pub async fn forget(&self, digest: &TreeDigest) {
        let _ = tokio::fs::remove_file(self.path(digest)).await;
        let _ = tokio::fs::remove_file(self.list_path(digest)).await;
    }

    /// Waits until every digest is stored, or `timeout` passes; returns those still missing.
    pub async fn wait_for(&self, digests: &[String], timeout: Duration) -> Result<Vec<String>, Status> {
        let deadline = tokio::time::Instant::now() + timeout;
        // Listening before the first look: nothing lands unheard between the two.
        let mut arrivals = self.arrived.subscribe();
        let mut missing = self.missing(digests).await?;
        while !missing.is_empty() {
            match tokio::time::timeout_at(deadline, arrivals.recv()).await {
                Err(_elapsed) => break,
                Ok(Ok(digest)) if !missing.contains(&digest) => continue,
                // One of ours landed, or arrivals were missed (lagged): look again.
                Ok(_) => missing = self.missing(&missing).await?,
            }
        }
        Ok(missing)
    }

    async fn accept(
        &self,
        digest: TreeDigest,
        mut chunks: Streaming<pb::UploadChunk>,
        first: Vec<u8>,
    ) -> Result<u64, Status> {
        let tmp = self.dir.join(format!(".upload-{digest}-{:08x}", fastrand::u32(..)));
        let result = self.receive(&tmp, digest, &mut chunks, first).await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
    }

    async fn receive(
        &self,
        tmp: &Path,
        digest: TreeDigest,
        chunks: &mut Streaming<pb::UploadChunk>,
        first: Vec<u8>,
    ) -> Result<u64, Status> {
        let io = |e: std::io::Error| Status::internal(format!("storing context {digest}: {e}"));
        let mut file = tokio::fs::File::create(tmp).await.map_err(io)?;
        // Verification reads the bytes as they arrive, on a blocking thread, so an upload costs
        // one pass over the data rather than a write followed by a re-read.
        let (tx, rx) = std::sync::mpsc::sync_channel::<bytes::Bytes>(16);
        let verifier = tokio::task::spawn_blocking(move || {
            let reader = ChannelReader { rx, current: bytes::Bytes::new() };
            kiln_core::archive::verify_listed(reader, &digest, ENTRY_LIST_MAX)
        });
        let mut total = 0u64;
        let mut next = Some(bytes::Bytes::from(first));
        loop {
            let data = match next.take() {
                Some(d) => d,
                None => match chunks.message().await? {
                    Some(chunk) => chunk.data,
                    None => break,
                },
            };
            total += data.len() as u64;
            if total > self.max_upload_bytes {
                // Before the chunk is written: the partial file `accept` deletes never passes the limit.
                return Err(Status::resource_exhausted(format!(
                    "upload of context {digest} refused: it passed this coordinator's limit of {} per context \
                     — exclude build outputs and data from the context in .dockerignore, or have the farm's \
                     admin raise the limit (kiln-coordinator --max-upload-bytes)",
                    shown_bytes(self.max_upload_bytes)
                )));
            }
            file.write_all(&data).await.map_err(io)?;
            if tx.send(data).is_err() {
                break; // the verifier stopped early: its verdict says why
            }
        }
        drop(tx);
        // No fsync before answering: a context lost or torn by a crash is caught by the agent's
        // verification before any build, and forgotten then (`Contexts::forget`) so the next
        // converge uploads it again.
        file.flush().await.map_err(io)?;
        let verdict = verifier.await.map_err(|e| Status::internal(e.to_string()))?;
        let list = match verdict {
            Ok((_, list)) => list,
            Err(err) => {
                return Err(Status::invalid_argument(format!(
                    "upload of context {digest} refused: {}",
                    kiln_core::error_chain(&err)
                )))
            }
        };
        let landing = self.landing.lock().await;
        // Before the row: a context is never indexed without the list its upload gave, so a
        // converge that finds it stored also finds which files it holds.
        if let Some(list) = list {
            let keeping = self.store.put_context_entries(&digest.to_string(), list).await;
            keeping.map_err(|e| Status::internal(e.to_string()))?;
        }
        tokio::fs::rename(tmp, self.path(&digest)).await.map_err(io)?;
        let row = ContextRow { digest: digest.to_string(), bytes: total, stored_at_ms: 0 };
        self.store.put_context(row).await.map_err(|e| Status::internal(e.to_string()))?;
        drop(landing);
        self.metrics.uploaded_bytes.inc_by(total);
        // Nobody waiting is no error.
        let _ = self.arrived.send(digest.to_string());
        Ok(total)
    }
}

/// `8 GiB`, `10 MiB`, `1500 bytes`: a limit as its reader would write it.
fn shown_bytes(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

struct ChannelReader {
    rx: std::sync::mpsc::Receiver<bytes::Bytes>,
    current: bytes::Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.recv() {
                Ok(next) => self.current = next,
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}
