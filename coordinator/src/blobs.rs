//! File blobs by blake3 content hash, the other half of the content store (DESIGN.md "The
//! converge", step 4): a context arrives as its entry list plus the blobs the store lacks, so a
//! one-file edit uploads one blob and a second developer with the same tree uploads none.
//!
//! A blob is hashed as it arrives and stored only under the hash its bytes have; a blob that lies
//! about its hash is refused and nothing is stored under that name. A context is stored once its
//! entry list hashes to its tree digest and every blob the list names is held; `Download` then
//! assembles the canonical archive from the list and the blobs (`kiln_core::archive::pack_with`,
//! which re-hashes each blob as it reads it), byte for byte what the CLI would have packed, so
//! agents verify and unpack it unchanged.
//!
//! Blobs are collected by reachability: one is kept while a stored context's entry list names it,
//! or while it was asked about (`FindMissingBlobs`) or uploaded for a context that a converge on
//! this coordinator is waiting for and holds a live `kiln-context:<digest>` claim on — the upload
//! in flight. Asking, the start of an upload and a collection all take the content store's landing
//! lock, so a collection sees a hold entirely before or after it: never a blob reported present
//! and then deleted under its asker. Blobs sent for a context no converge awaits (a tool, a
//! stray client) are held by nothing until a context names them, so holds never outgrow the
//! converges waiting for uploads.

use kiln_core::digest::{ContentHash, Entry, EntryKind, TreeDigest};
use kiln_proto::v1 as pb;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use tonic::Status;

/// Most hashes one `FindMissingBlobs` call may ask about (2 MiB of hashes with framing).
pub const FIND_MAX: usize = 1 << 16;

/// The blob directory and what in-flight uploads hold in it.
#[derive(Debug)]
pub struct Blobs {
    dir: PathBuf,
    /// Blobs named by a context not yet stored, by that context's digest: held while the
    /// context's claim is live, dropped when the context lands or its claim is gone.
    pending: std::sync::Mutex<HashMap<String, HashSet<[u8; 32]>>>,
    /// Contexts converges here wait for, with how many converges wait for each.
    awaited: std::sync::Mutex<HashMap<String, usize>>,
}

/// A converge's wait for its contexts: while it lives, blobs sent for them are held.
#[derive(Debug)]
pub struct Awaiting<'a> {
    blobs: &'a Blobs,
    contexts: Vec<String>,
}

impl Drop for Awaiting<'_> {
    /// The wait is over (landed, given up or cancelled): what was held for a context nobody else
    /// waits for is let go, and a stored context's list holds its blobs from here on.
    fn drop(&mut self) {
        let mut awaited = self.blobs.awaited.lock().unwrap();
        let mut pending = self.blobs.pending.lock().unwrap();
        for context in &self.contexts {
            if let Some(count) = awaited.get_mut(context) {
                *count -= 1;
                if *count == 0 {
                    awaited.remove(context);
                    pending.remove(context);
                }
            }
        }
    }
}

/// What one `UploadBlobs` call stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Received {
    pub blobs: u64,
    pub bytes: u64,
}

impl Blobs {
    /// Opens `dir`; with `clean_up`, removing half-written blobs a crash left. They are written
    /// in a directory of their own ([`INCOMING`], beside the blobs so a rename lands them), so
    /// finding them never lists the blobs: a store of 100,000 files would cost every embedded
    /// command's start a long `readdir`.
    pub fn open(dir: PathBuf, clean_up: bool) -> std::io::Result<Blobs> {
        let incoming = dir.join(INCOMING);
        std::fs::create_dir_all(&incoming)?;
        if clean_up {
            for entry in std::fs::read_dir(&incoming)? {
                let _ = std::fs::remove_file(entry?.path());
            }
        }
        Ok(Blobs {
            dir,
            pending: std::sync::Mutex::new(HashMap::new()),
            awaited: std::sync::Mutex::new(HashMap::new()),
        })
    }

    pub fn path(&self, hash: &[u8; 32]) -> PathBuf {
        self.dir.join(hex::encode(hash))
    }

    /// Marks `contexts` awaited by one more converge until the guard is dropped. Call before the
    /// client is asked for them, so its first `FindMissingBlobs` already holds.
    pub fn expect(&self, contexts: &[String]) -> Awaiting<'_> {
        let mut awaited = self.awaited.lock().unwrap();
        for context in contexts {
            *awaited.entry(context.clone()).or_default() += 1;
        }
        Awaiting { blobs: self, contexts: contexts.to_vec() }
    }

    /// Holds `hashes` for `context` until it lands or its wait ends, if a converge awaits it.
    /// Call under the landing lock.
    pub(crate) fn hold(&self, context: &str, hashes: impl IntoIterator<Item = [u8; 32]>) {
        if !self.awaited.lock().unwrap().contains_key(context) {
            return;
        }
        self.pending.lock().unwrap().entry(context.to_string()).or_default().extend(hashes);
    }

    /// The context landed: its stored entry list holds its blobs from now on.
    pub(crate) fn landed(&self, context: &str) {
        self.pending.lock().unwrap().remove(context);
    }

    /// The hashes among `hashes` not stored, in the order given (each once).
    pub fn missing(&self, hashes: &[[u8; 32]]) -> Vec<[u8; 32]> {
        let mut seen = HashSet::new();
        hashes.iter().filter(|h| seen.insert(**h) && !self.path(h).is_file()).copied().collect()
    }

    /// The first file entry of `entries` whose blob is not stored at its size, and how many are missing.
    pub fn first_absent<'e>(&self, entries: &'e [Entry]) -> Option<(&'e Entry, usize)> {
        let absent: Vec<&Entry> = entries
            .iter()
            .filter(|e| matches!(e.kind, EntryKind::File | EntryKind::ExecFile))
            .filter(|e| {
                let Some(hash) = e.hash else { return true };
                std::fs::metadata(self.path(&hash.0)).map_or(true, |m| m.len() != e.size)
            })
            .collect();
        absent.first().map(|e| (*e, absent.len()))
    }

    /// Stores the blobs of one `UploadBlobs` stream. Blocking: run on a blocking thread, fed
    /// message by message; memory is one message plus one blob's hasher.
    pub fn receive(
        &self,
        batches: std::sync::mpsc::Receiver<pb::BlobBatch>,
        max_upload_bytes: u64,
    ) -> Result<Received, Status> {
        let mut open: Option<Open> = None;
        let mut got = Received::default();
        let result = (|| {
            for batch in batches {
                for piece in batch.pieces {
                    self.piece(&mut open, piece, max_upload_bytes, &mut got)?;
                }
            }
            match &open {
                Some(blob) => Err(Status::invalid_argument(format!(
                    "blob {} ended after {} of its {} bytes — the upload stream stopped mid-blob",
                    hex::encode(blob.hash),
                    blob.written,
                    blob.size
                ))),
                None => Ok(got),
            }
        })();
        if let Some(blob) = open {
            let _ = std::fs::remove_file(&blob.tmp);
        }
        result
    }

    fn piece(
        &self,
        open: &mut Option<Open>,
        piece: pb::BlobPiece,
        max_upload_bytes: u64,
        got: &mut Received,
    ) -> Result<(), Status> {
        let hash: [u8; 32] = piece.hash.as_slice().try_into().map_err(|_| {
            Status::invalid_argument(format!(
                "blob piece names a hash of {} bytes; blake3 hashes are 32",
                piece.hash.len()
            ))
        })?;
        let shown = hex::encode(hash);
        let io = |e: std::io::Error| Status::internal(format!("storing blob {shown}: {e}"));
        if piece.offset.checked_add(piece.data.len() as u64).is_none_or(|end| end > piece.size) {
            return Err(Status::invalid_argument(format!(
                "blob {shown}: a piece at offset {} of {} bytes passes the blob's size {}",
                piece.offset,
                piece.data.len(),
                piece.size
            )));
        }
        // One call holds at most what one archive upload may: a client cannot fill the disk
        // through a single stream any more than through `Upload`.
        if piece.offset == 0 && got.bytes.saturating_add(piece.size) > max_upload_bytes {
            return Err(Status::resource_exhausted(format!(
                "blob {shown} refused: with it this upload passes this coordinator's limit of {max_upload_bytes} \
                 bytes per upload — exclude build outputs and data from the context in .dockerignore, or have \
                 the farm's admin raise --max-upload-bytes",
            )));
        }
        if piece.offset == 0 {
            if let Some(blob) = open.as_ref() {
                return Err(Status::invalid_argument(format!(
                    "blob {shown} started while blob {} was at {} of {} bytes — pieces of two blobs interleaved",
                    hex::encode(blob.hash),
                    blob.written,
                    blob.size
                )));
            }
            if piece.data.len() as u64 == piece.size {
                // A whole blob in one piece, the common case for small files: hashed in place.
                check(&hash, ContentHash(*blake3::hash(&piece.data).as_bytes()))?;
                let target = self.path(&hash);
                if !target.is_file() {
                    let tmp = self.tmp(&hash);
                    let written = std::fs::write(&tmp, &piece.data).and_then(|()| std::fs::rename(&tmp, &target));
                    if let Err(err) = written {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(io(err));
                    }
                }
                got.blobs += 1;
                got.bytes += piece.size;
                return Ok(());
            }
            let tmp = self.tmp(&hash);
            let file = std::fs::File::create(&tmp).map_err(io)?;
            *open = Some(Open { hash, size: piece.size, written: 0, hasher: blake3::Hasher::new(), file, tmp });
        }
        let blob = match open.as_mut() {
            Some(blob) if blob.hash == hash && blob.written == piece.offset => blob,
            _ => {
                return Err(Status::invalid_argument(format!(
                    "blob {shown}: a piece at offset {} does not continue the blob in progress",
                    piece.offset
                )))
            }
        };
        blob.hasher.update(&piece.data);
        blob.file.write_all(&piece.data).map_err(io)?;
        blob.written += piece.data.len() as u64;
        if blob.written == blob.size {
            let blob = open.take().expect("the open blob");
            let finished = check(&blob.hash, ContentHash(*blob.hasher.finalize().as_bytes()))
                .and_then(|()| std::fs::rename(&blob.tmp, self.path(&blob.hash)).map_err(io));
            if let Err(err) = finished {
                let _ = std::fs::remove_file(&blob.tmp);
                return Err(err);
            }
            got.blobs += 1;
            got.bytes += blob.size;
        }
        Ok(())
    }

    fn tmp(&self, hash: &[u8; 32]) -> PathBuf {
        self.dir.join(INCOMING).join(format!("{}-{:08x}", hex::encode(hash), fastrand::u32(..)))
    }

    /// Deletes every stored blob that `reachable` does not name and no pending context whose claim
    /// is live (`live`) holds; pending contexts without a live claim are dropped. Call under the
    /// landing lock. Returns (blobs, bytes) taken, or that would be with `dry_run`.
    pub(crate) fn collect(
        &self,
        reachable: &HashSet<[u8; 32]>,
        live: &dyn Fn(&str) -> bool,
        dry_run: bool,
    ) -> std::io::Result<(u64, u64)> {
        // Listed before the pending set is read: a blob an upload renamed into the listing was
        // registered before it, so it is in the set read next.
        let mut stored = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(hash) = name.to_str().and_then(|n| hex::decode(n).ok()).and_then(|h| <[u8; 32]>::try_from(h).ok())
            else {
                if !dry_run {
                    forsaken_upload(&entry);
                }
                continue; // the uploads' directory, or something Kiln did not name: never touched
            };
            stored.push((hash, entry.path()));
        }
        let held: HashSet<[u8; 32]> = {
            let mut pending = self.pending.lock().unwrap();
            if !dry_run {
                pending.retain(|context, _| live(context));
            }
            pending.iter().filter(|(context, _)| live(context)).flat_map(|(_, hashes)| hashes.iter().copied()).collect()
        };
        let (mut blobs, mut bytes) = (0, 0);
        for (hash, path) in stored {
            if reachable.contains(&hash) || held.contains(&hash) {
                continue;
            }
            let len = std::fs::metadata(&path).map_or(0, |m| m.len());
            if !dry_run && std::fs::remove_file(&path).is_err() {
                continue;
            }
            blobs += 1;
            bytes += len;
        }
        Ok((blobs, bytes))
    }

    /// Assembles the canonical archive of `entries` from the blobs into `out`. Blocking.
    pub fn assemble(&self, entries: &[Entry], out: impl Write) -> Result<u64, kiln_core::archive::ArchiveError> {
        use kiln_core::archive::ArchiveError;
        let mut open = |entry: &Entry| -> Result<Box<dyn std::io::Read>, ArchiveError> {
            let shown = String::from_utf8_lossy(&entry.path).into_owned();
            let Some(hash) = entry.hash else {
                return Err(ArchiveError::Refused { path: shown, why: "the entry list names no content hash".into() });
            };
            let file = std::fs::File::open(self.path(&hash.0)).map_err(|err| ArchiveError::Read {
                root: self.dir.clone(),
                path: format!("{shown} (blob {hash})"),
                err,
            })?;
            Ok(Box::new(std::io::BufReader::with_capacity(256 << 10, file)))
        };
        Ok(kiln_core::archive::pack_with(&self.dir, entries, &mut open, out)?.bytes)
    }

    /// Drops a blob whose bytes were found not to be its hash's (a disk that lied), so the next
    /// `FindMissingBlobs` asks for it again.
    pub fn forget(&self, hash: &ContentHash) {
        let _ = std::fs::remove_file(self.path(&hash.0));
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Where blobs are written before they are renamed into place, beside them.
const INCOMING: &str = ".incoming";

/// Removes `entry` if it is a temp file an older coordinator wrote beside the blobs
/// (`.upload-<hash>-<n>`) and left there over an hour ago: no upload runs that long, and nothing
/// but a collection ever lists this directory to find it.
fn forsaken_upload(entry: &std::fs::DirEntry) {
    if !entry.file_name().to_string_lossy().starts_with(".upload-") {
        return;
    }
    let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    if age.is_some_and(|age| age > std::time::Duration::from_secs(3600)) {
        let _ = std::fs::remove_file(entry.path());
    }
}

/// A blob being received in pieces.
struct Open {
    hash: [u8; 32],
    size: u64,
    written: u64,
    hasher: blake3::Hasher,
    file: std::fs::File,
    tmp: PathBuf,
}

fn check(claimed: &[u8; 32], actual: ContentHash) -> Result<(), Status> {
    if actual.0 == *claimed {
        return Ok(());
    }
    Err(Status::invalid_argument(format!(
        "blob {} refused: its bytes hash to {actual} — nothing was stored under it; the client's file changed \
         while it was sent, or the client is broken",
        hex::encode(claimed)
    )))
}

/// The file hashes an entry list names.
pub fn named(entries: &[Entry]) -> impl Iterator<Item = [u8; 32]> + '_ {
    entries.iter().filter_map(|e| e.hash.map(|h| h.0))
}

/// The tree digest of a context whose blobs these are, checked.
pub fn context_digest(context: &str) -> Result<TreeDigest, Status> {
    context.parse().map_err(|e: kiln_core::digest::DigestParseError| {
        Status::invalid_argument(format!("blobs must name the context they are for: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(data: &[u8], whole: &[u8], offset: usize) -> pb::BlobPiece {
        pb::BlobPiece {
            hash: blake3::hash(whole).as_bytes().to_vec(),
            size: whole.len() as u64,
            offset: offset as u64,
            data: data.to_vec().into(),
        }
    }

    fn receive(blobs: &Blobs, batches: Vec<Vec<pb::BlobPiece>>) -> Result<Received, Status> {
        let (tx, rx) = std::sync::mpsc::sync_channel(batches.len().max(1));
        for pieces in batches {
            tx.send(pb::BlobBatch { context: String::new(), pieces }).unwrap();
        }
        drop(tx);
        blobs.receive(rx, 1 << 30)
    }

    /// Every file under the blob directory, temp files included.
    fn files(blobs: &Blobs) -> Vec<String> {
        let names = |dir: &Path| -> Vec<String> {
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect()
        };
        let mut all: Vec<String> = names(blobs.dir()).into_iter().filter(|n| n != INCOMING).collect();
        all.extend(names(&blobs.dir().join(INCOMING)).into_iter().map(|n| format!("{INCOMING}/{n}")));
        all.sort();
        all
    }

    #[test]
    fn a_half_written_blob_a_crash_left_is_removed_when_the_store_opens_again() {
        let tmp = tempfile::tempdir().unwrap();
        let blobs = Blobs::open(tmp.path().join("blobs"), true).unwrap();
        let got = receive(&blobs, vec![vec![piece(b"kept", b"kept", 0)]]).unwrap();
        assert_eq!(got.blobs, 1);
        let torn = blobs.tmp(&[9; 32]);
        std::fs::write(&torn, b"half").unwrap();
        assert_eq!(files(&blobs).len(), 2, "{:?}", files(&blobs));
        let reopened = Blobs::open(tmp.path().join("blobs"), true).unwrap();
        assert_eq!(
            files(&reopened),
            [hex::encode(blake3::hash(b"kept").as_bytes())],
            "the torn one went, the blob stayed"
        );
    }

    #[test]
    fn small_blobs_share_a_message_and_a_big_one_arrives_in_pieces() {
        let tmp = tempfile::tempdir().unwrap();
        let blobs = Blobs::open(tmp.path().join("blobs"), true).unwrap();
        let big: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let got = receive(
            &blobs,
            vec![
                vec![piece(b"a", b"a", 0), piece(b"bb", b"bb", 0), piece(&big[..1000], &big, 0)],
                vec![piece(&big[1000..2500], &big, 1000)],
                vec![piece(&big[2500..], &big, 2500)],
            ],
        )
        .unwrap();
        assert_eq!(got, Received { blobs: 3, bytes: 3003 });
        for data in [&b"a"[..], b"bb", &big] {
            let hash = *blake3::hash(data).as_bytes();
            assert_eq!(std::fs::read(blobs.path(&hash)).unwrap(), data);
        }
        assert_eq!(files(&blobs).len(), 3, "no temp file is left: {:?}", files(&blobs));
    }

    #[test]
    fn a_blob_that_lies_or_stops_midway_is_refused_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let blobs = Blobs::open(tmp.path().join("blobs"), true).unwrap();
        let mut lying = piece(b"honest", b"honest", 0);
        lying.data = b"h0nest".to_vec().into();
        let err = receive(&blobs, vec![vec![lying]]).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("refused"), "{err:?}");

        let big = vec![7u8; 4096];
        let mut forged = big.clone();
        forged[4000] = 8;
        let err =
            receive(&blobs, vec![vec![piece(&forged[..2048], &big, 0)], vec![piece(&forged[2048..], &big, 2048)]])
                .unwrap_err();
        assert!(err.message().contains("refused"), "{err:?}");

        let err = receive(&blobs, vec![vec![piece(&big[..2048], &big, 0)]]).unwrap_err();
        assert!(err.message().contains("stopped mid-blob"), "{err:?}");
        let err = receive(&blobs, vec![vec![piece(&big[..2048], &big, 0), piece(&big[..10], &big, 0)]]).unwrap_err();
        assert!(err.message().contains("interleaved"), "{err:?}");
        assert!(files(&blobs).is_empty(), "nothing stored, no temp file left: {:?}", files(&blobs));
    }
}
