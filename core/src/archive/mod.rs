//! The canonical context archive (DESIGN.md "Specs"): how a context travels from the CLI to the
//! coordinator's content store and on to the agent that builds it.
//!
//! [`pack`] writes ustar by hand rather than through the `tar` crate's builder, because the archive is
//! a spec two hosts must reproduce byte for byte: entries in digest order, mtime 0, uid/gid 0, no
//! user names, mode 0644/0755 only, and a pax `path`/`linkpath` record exactly when a name does not fit
//! ustar's 100-byte field. It carries exactly the entries the digest covered.
//!
//! [`unpack`] reads with the `tar` crate (past RUSTSEC-2021-0080, -2026-0067 and -2026-0068) but
//! never lets it write: every entry is checked and created here, inside an empty directory, with
//! parents that Kiln itself created as directories, so no entry can ever be written through a
//! symlink or outside the target, whatever the crate's own checks do. The entries are hashed as they
//! are written and the digest compared with the claimed one: a tag can never address bytes it does
//! not name.

mod unpack;
mod ustar;

pub use unpack::{unpack, verify, verify_listed, Unpacked, ENTRY_METADATA_MAX};

use crate::digest::{Entry, EntryKind, StreamHasher, Tree, TreeDigest};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// Why an archive could not be packed or unpacked. Every variant names the entry or file.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("context {root}: cannot read {path} while packing")]
    Read {
        root: PathBuf,
        path: String,
        #[source]
        err: io::Error,
    },
    #[error("context {root}: {path} changed while packing ({expected} bytes when walked, {actual} now) — re-run once the context is quiet")]
    Changed { root: PathBuf, path: String, expected: u64, actual: u64 },
    #[error("cannot write the archive")]
    Write(#[source] io::Error),
    #[error("archive is not a readable tar stream")]
    Corrupt(#[source] io::Error),
    #[error("archive entry {path}: {why} — the archive was not made by `kiln pack`; nothing was built from it")]
    Refused { path: String, why: String },
    #[error("cannot unpack into {target}: {why}")]
    Target { target: PathBuf, why: String },
    #[error("unpacking entry {path} into {target}")]
    Create {
        target: PathBuf,
        path: String,
        #[source]
        err: io::Error,
    },
    #[error(
        "archive entry after {after}: the headers and pax or long-name records of the next entry exceed {} — \
         a canonical archive needs a few KiB there; refused, nothing was built from it",
        kib(*limit)
    )]
    MetadataTooLarge { after: String, limit: u64 },
    #[error("archive holds tree {actual}, but {expected} was claimed — refused; re-upload the context (`kiln pack`) so its digest matches")]
    DigestMismatch { expected: TreeDigest, actual: TreeDigest },
}

/// `1 MiB`, `64 KiB`: a limit as a reader would write it.
fn kib(bytes: u64) -> String {
    match bytes % (1 << 20) {
        0 => format!("{} MiB", bytes >> 20),
        _ => format!("{} KiB", bytes.div_ceil(1024)),
    }
}

/// What [`pack`] wrote: the digest of the entries as read while packing, and the archive's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packed {
    pub digest: TreeDigest,
    pub bytes: u64,
}

/// Packs `tree` (as [`crate::digest::walk_tree`] returned it) into the canonical archive.
///
/// The digest is recomputed from the bytes actually packed, so a caller that compares it with the
/// digest it addressed the image by catches a file edited between the two reads.
pub fn pack(tree: &Tree, out: impl Write) -> Result<Packed, ArchiveError> {
    let mut files = |entry: &Entry| -> Result<Box<dyn Read>, ArchiveError> {
        let shown = || String::from_utf8_lossy(&entry.path).into_owned();
        let on_disk = tree.root.join(OsStr::from_bytes(&entry.path));
        let read_err = |err| ArchiveError::Read { root: tree.root.clone(), path: shown(), err };
        let file = File::open(&on_disk).map_err(read_err)?;
        let actual = file.metadata().map_err(read_err)?.len();
        if actual != entry.size {
            return Err(ArchiveError::Changed { root: tree.root.clone(), path: shown(), expected: entry.size, actual });
        }
        Ok(Box::new(file))
    };
    pack_with(&tree.root, &tree.entries, &mut files, out)
}

/// Where [`pack_with`] reads a file entry's contents from.
pub type OpenFile<'a> = dyn FnMut(&Entry) -> Result<Box<dyn Read>, ArchiveError> + 'a;

/// Packs `entries` (canonical order) into the canonical archive, reading each file's contents from
/// `open` — the context's folder ([`pack`]), or a content store's blobs by hash. The bytes are the
/// same either way, so an archive assembled from blobs is the archive the CLI would have packed.
///
/// A file whose bytes do not hash to the entry's content hash (when the entry carries one) is
/// refused as it is packed: an assembled archive never carries a blob that lies about its hash.
pub fn pack_with(
    root: &std::path::Path,
    entries: &[Entry],
    open: &mut OpenFile<'_>,
    out: impl Write,
) -> Result<Packed, ArchiveError> {
    let mut out = CountingWriter { inner: out, count: 0 };
    let mut hasher = StreamHasher::new();
    let mut buf = vec![0u8; 256 * 1024];
    for entry in entries {
        let shown = || String::from_utf8_lossy(&entry.path).into_owned();
        match entry.kind {
            EntryKind::Dir => {
                hasher.dir(&entry.path);
                ustar::write_header(&mut out, &entry.path, entry.kind, 0, b"").map_err(ArchiveError::Write)?;
            }
            EntryKind::Symlink => {
                hasher.symlink(&entry.path, &entry.link_target);
                ustar::write_header(&mut out, &entry.path, entry.kind, 0, &entry.link_target)
                    .map_err(ArchiveError::Write)?;
            }
            EntryKind::File | EntryKind::ExecFile => {
                let mut file = open(entry)?;
                let read_err = |err| ArchiveError::Read { root: root.to_path_buf(), path: shown(), err };
                hasher.file(&entry.path, entry.kind == EntryKind::ExecFile, entry.size);
                ustar::write_header(&mut out, &entry.path, entry.kind, entry.size, b"").map_err(ArchiveError::Write)?;
                let mut left = entry.size;
                while left > 0 {
                    let want = buf.len().min(left as usize);
                    let n = file.read(&mut buf[..want]).map_err(read_err)?;
                    if n == 0 {
                        return Err(ArchiveError::Changed {
                            root: root.to_path_buf(),
                            path: shown(),
                            expected: entry.size,
                            actual: entry.size - left,
                        });
                    }
                    hasher.content(&buf[..n]);
                    out.write_all(&buf[..n]).map_err(ArchiveError::Write)?;
                    left -= n as u64;
                }
                if let (Some(want), Some(got)) = (entry.hash, hasher.last_file_hash()) {
                    if want != got {
                        return Err(ArchiveError::Refused {
                            path: shown(),
                            why: format!("its bytes hash to {got}, not {want}"),
                        });
                    }
                }
                ustar::write_padding(&mut out, entry.size).map_err(ArchiveError::Write)?;
            }
        }
    }
    ustar::write_end(&mut out).map_err(ArchiveError::Write)?;
    out.flush().map_err(ArchiveError::Write)?;
    Ok(Packed { digest: hasher.finish(), bytes: out.count })
}

/// The size of the archive [`pack_with`] would write for `entries`, without reading a file.
pub fn packed_size(entries: &[Entry]) -> u64 {
    let mut out = CountingWriter { inner: io::sink(), count: 0 };
    for entry in entries {
        let link: &[u8] = if entry.kind == EntryKind::Symlink { &entry.link_target } else { b"" };
        let size = if matches!(entry.kind, EntryKind::File | EntryKind::ExecFile) { entry.size } else { 0 };
        let _ = ustar::write_header(&mut out, &entry.path, entry.kind, size, link);
        out.count += size.div_ceil(512) * 512;
    }
    let _ = ustar::write_end(&mut out);
    out.count
}

struct CountingWriter<W> {
    inner: W,
    count: u64,
}

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
