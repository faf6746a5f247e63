//! The tree digest (DESIGN.md "Specs"): blake3 over a canonical stream of a context's entries.
//!
//! The stream is the contract between the CLI that addresses a context and the agent that builds it,
//! so it is spelled out here once, in [`StreamHasher`], and both the walker ([`walk`]) and the archive
//! reader (`crate::archive`) feed it. Entries come in byte order of their `/`-separated relative path;
//! each contributes:
//!
//! | entry     | bytes                                                                     |
//! |-----------|---------------------------------------------------------------------------|
//! | directory | `b'd'`, path length (u64 LE), path                                        |
//! | file      | `b'f'`, path length, path, content length (u64 LE), blake3 of the content (32 bytes) |
//! | exec file | `b'x'`, same as a file (the executable bit is build input: `COPY` keeps it) |
//! | symlink   | `b'l'`, path length, path, target length (u64 LE), target bytes           |
//!
//! Lengths make the stream unambiguous; no mtime, owner or other mode bit enters it.
//!
//! **Spec v2.** The stream is hashed in blake3's key-derivation mode under [`TREE_DIGEST_CONTEXT`],
//! and a file contributes its content *hash* (plain blake3, what `b3sum` prints), where v1 hashed a
//! plain blake3 stream that carried the contents themselves. So the digest is a function of the
//! entry list (type, path, size, hash or target): a stat cache ([`cache`]) can vouch for a file
//! without reading it, and uploads can go file by file. The derivation context separates the two
//! versions: no v2 digest can equal the v1 digest of any tree, so a tag made under v1 can never
//! be mistaken for one made under v2 (a v1 stream of a file whose 32 bytes happen to be another
//! file's hash would otherwise read the same as that file's v2 entry).

mod cache;
pub mod diff;
mod feed;
mod io;
pub mod list;
pub mod vectors;
mod walk;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub use cache::{
    cache_file_for, digest_dir_cached, digest_dir_vouched, settled, stamp_now, vouched_file_for, CacheKey, CacheUse,
    FileStat, Rejected, StatCache, Summary,
};
pub use feed::{digest_entries, digest_tree, hash_tree, Hashed};
pub use walk::{digest_dir, walk_tree, Tree, WalkFilter, WalkOptions};

/// The blake3 key-derivation context of the v2 tree digest (DESIGN.md "Specs"). Changing the
/// stream's encoding means a new context string, so digests of different versions never meet.
pub const TREE_DIGEST_CONTEXT: &str = "kiln.dev 2026-12-01 tree digest v2";

/// The version of the tree digest spec this build computes and checks.
pub const TREE_DIGEST_VERSION: u32 = 2;

/// A full 32-byte tree digest. Displays as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TreeDigest(pub [u8; 32]);

impl TreeDigest {
    /// The first 12 hex characters: the part of a content tag that names the content.
    pub fn short12(&self) -> String {
        self.to_string()[..12].to_string()
    }
}

impl fmt::Display for TreeDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for TreeDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TreeDigest({self})")
    }
}

impl FromStr for TreeDigest {
    type Err = DigestParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.strip_prefix("blake3:").unwrap_or(s);
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| DigestParseError(s.to_string()))?;
        Ok(TreeDigest(out))
    }
}

#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not a tree digest: expected 64 hex characters (as `kiln digest` prints)")]
pub struct DigestParseError(String);

/// What kind of entry a path is. Anything else (socket, device, fifo) is refused by the walker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EntryKind {
    Dir,
    File,
    ExecFile,
    Symlink,
}

impl EntryKind {
    pub fn type_byte(self) -> u8 {
        match self {
            EntryKind::Dir => b'd',
            EntryKind::File => b'f',
            EntryKind::ExecFile => b'x',
            EntryKind::Symlink => b'l',
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            EntryKind::Dir => "dir",
            EntryKind::File => "file",
            EntryKind::ExecFile => "exec",
            EntryKind::Symlink => "symlink",
        }
    }
}

/// The blake3 hash of one file's contents — what `b3sum` prints for it, and what a file entry
/// contributes to the tree digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContentHash(pub [u8; 32]);

impl ContentHash {
    pub fn of(bytes: &[u8]) -> ContentHash {
        ContentHash(*blake3::hash(bytes).as_bytes())
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({self})")
    }
}

/// One entry a digest covered. `path` is relative to the context root, `/`-separated raw bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub path: Vec<u8>,
    pub kind: EntryKind,
    /// Content length of a file; target length of a symlink; 0 for a directory.
    pub size: u64,
    /// The symlink's target bytes (empty for other kinds).
    pub link_target: Vec<u8>,
    /// A file's `lstat` as the walk saw it, which the stat cache compares; `None` for other kinds
    /// and for entries that did not come from a walk.
    pub stat: Option<FileStat>,
    /// A file's content hash, once [`hash_tree`] or [`digest_dir`] has computed or recalled it.
    pub hash: Option<ContentHash>,
}

/// How many buffered stream bytes [`StreamHasher`] collects before hashing them.
const PENDING_FLUSH: usize = 64 << 10;

/// Slices of file content from this size on are hashed by blake3's multi-threaded path: one big
/// file's hash may use every core.
const RAYON_SLICE: usize = 1 << 20;

/// Encodes the canonical entry stream into blake3. Callers must present entries in strictly
/// increasing byte order of path; [`StreamHasher::check_order`] enforces it for untrusted input.
///
/// A file entry is given either with its hash ([`StreamHasher::file_hashed`], when the hash is
/// known: the stat cache, a read done elsewhere) or with its contents ([`StreamHasher::file`] then
/// [`StreamHasher::content`], as the archive reader streams them); both encode the same bytes.
#[derive(Debug)]
pub struct StreamHasher {
    hasher: blake3::Hasher,
    /// Stream bytes not yet given to blake3. Entries are a few dozen bytes each; handing blake3
    /// [`PENDING_FLUSH`] bytes at once lets it hash many chunks at once with SIMD. Buffering
    /// changes when bytes are hashed, never which bytes.
    pending: Vec<u8>,
    last_path: Option<Vec<u8>>,
    /// The content hash of the file entry in progress, while its contents stream in.
    file: Option<blake3::Hasher>,
    /// Bytes of file content still owed by the entry in progress.
    owed: u64,
    /// The content hash of the last file entry completed.
    last_file: Option<ContentHash>,
    /// A copy of the stream, while it stays under its limit ([`StreamHasher::recording`]).
    record: Option<Recording>,
}

/// The stream as it was hashed, kept so an entry list can be stored beside what it addresses.
#[derive(Debug)]
struct Recording {
    bytes: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl Default for StreamHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamHasher {
    pub fn new() -> Self {
        StreamHasher {
            hasher: blake3::Hasher::new_derive_key(TREE_DIGEST_CONTEXT),
            pending: Vec::new(),
            last_path: None,
            file: None,
            owed: 0,
            last_file: None,
            record: None,
        }
    }

    /// A hasher that also keeps the stream it hashes — the entry list in its canonical encoding
    /// ([`list`]) — up to `limit` bytes; past that it keeps nothing, so a context of millions
    /// of files costs no more memory than hashing it did.
    pub fn recording(limit: usize) -> Self {
        let mut hasher = Self::new();
        hasher.record = Some(Recording { bytes: Vec::new(), limit, overflowed: false });
        hasher
    }

    /// Refuses an entry that is not strictly after the previous one: a reordered or repeated entry
    /// would hash a different stream from the one its tree would produce.
    pub fn check_order(&self, path: &[u8]) -> Result<(), OrderError> {
        match &self.last_path {
            Some(prev) if prev.as_slice() >= path => Err(OrderError {
                previous: String::from_utf8_lossy(prev).into_owned(),
                path: String::from_utf8_lossy(path).into_owned(),
            }),
            _ => Ok(()),
        }
    }

    fn header(&mut self, kind: EntryKind, path: &[u8]) {
        assert_eq!(self.owed, 0, "previous file's content was not fully hashed");
        self.push(&[kind.type_byte()]);
        self.push(&(path.len() as u64).to_le_bytes());
        self.push(path);
        match &mut self.last_path {
            Some(last) => {
                last.clear();
                last.extend_from_slice(path);
            }
            None => self.last_path = Some(path.to_vec()),
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        if let Some(record) = &mut self.record {
            if !record.overflowed && record.bytes.len() + bytes.len() <= record.limit {
                record.bytes.extend_from_slice(bytes);
            } else {
                record.overflowed = true;
                record.bytes = Vec::new();
            }
        }
        if self.pending.capacity() == 0 {
            self.pending.reserve(PENDING_FLUSH + 4096);
        }
        self.pending.extend_from_slice(bytes);
        if self.pending.len() >= PENDING_FLUSH {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if !self.pending.is_empty() {
            self.hasher.update(&self.pending);
            self.pending.clear();
        }
    }

    pub fn dir(&mut self, path: &[u8]) {
        self.header(EntryKind::Dir, path);
    }

    pub fn symlink(&mut self, path: &[u8], target: &[u8]) {
        self.header(EntryKind::Symlink, path);
        self.push(&(target.len() as u64).to_le_bytes());
        self.push(target);
    }

    /// A whole file entry whose content hash is already known.
    pub fn file_hashed(&mut self, path: &[u8], executable: bool, len: u64, hash: &ContentHash) {
        let kind = if executable { EntryKind::ExecFile } else { EntryKind::File };
        self.header(kind, path);
        self.push(&len.to_le_bytes());
        self.push(&hash.0);
        self.last_file = Some(*hash);
    }

    /// Starts a file entry of `len` bytes; its content follows through [`StreamHasher::content`].
    pub fn file(&mut self, path: &[u8], executable: bool, len: u64) {
        let kind = if executable { EntryKind::ExecFile } else { EntryKind::File };
        self.header(kind, path);
        self.push(&len.to_le_bytes());
        self.owed = len;
        self.file = Some(blake3::Hasher::new());
        if len == 0 {
            self.end_file();
        }
    }

    /// Feeds file content. Large slices go through blake3's multi-threaded path.
    pub fn content(&mut self, bytes: &[u8]) {
        assert!(bytes.len() as u64 <= self.owed, "file content longer than declared");
        let file = self.file.as_mut().expect("content outside a file entry");
        if bytes.len() >= RAYON_SLICE {
            file.update_rayon(bytes);
        } else {
            file.update(bytes);
        }
        self.owed -= bytes.len() as u64;
        if self.owed == 0 {
            self.end_file();
        }
    }

    fn end_file(&mut self) {
        let hash = ContentHash(*self.file.take().expect("a file entry in progress").finalize().as_bytes());
        self.push(&hash.0);
        self.last_file = Some(hash);
    }

    /// Bytes of the current file entry not yet hashed.
    pub fn owed(&self) -> u64 {
        self.owed
    }

    /// The content hash of the last file entry whose contents were all given.
    pub fn last_file_hash(&self) -> Option<ContentHash> {
        self.last_file
    }

    pub fn finish(self) -> TreeDigest {
        self.finish_recorded().0
    }

    /// The digest, and the stream it hashed when this hasher was [`recording`](Self::recording)
    /// and the stream stayed within its limit.
    pub fn finish_recorded(mut self) -> (TreeDigest, Option<Vec<u8>>) {
        assert_eq!(self.owed, 0, "last file's content was not fully hashed");
        self.flush();
        let stream = self.record.take().filter(|r| !r.overflowed).map(|r| r.bytes);
        (TreeDigest(*self.hasher.finalize().as_bytes()), stream)
    }
}

/// Hashes one file's contents from a path on disk via a memory map and blake3's rayon path (a big
/// file's hash uses every core), refusing a file that is no longer `len` bytes long: the entry
/// list already promised that size.
pub fn hash_file_mmap(on_disk: &std::path::Path, len: u64) -> std::io::Result<ContentHash> {
    let mut hasher = blake3::Hasher::new();
    hasher.update_mmap_rayon(on_disk)?;
    let read = hasher.count();
    if read != len {
        return Err(std::io::Error::other(format!("file changed size while hashed: {len} then {read} bytes")));
    }
    Ok(ContentHash(*hasher.finalize().as_bytes()))
}

#[derive(Debug, thiserror::Error)]
#[error("entry `{path}` comes after `{previous}`: entries must be in strictly increasing byte order of path")]
pub struct OrderError {
    pub previous: String,
    pub path: String,
}

/// Why a context could not be digested. Every variant names the path.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    #[error("context {root}: cannot read {path}")]
    Unreadable {
        root: PathBuf,
        path: String,
        #[source]
        err: std::io::Error,
    },
    #[error("context {root}: symlink {path} -> {target}: {why} — make it relative and inside the context")]
    SymlinkEscapes { root: PathBuf, path: String, target: String, why: &'static str },
    #[error("context {root}: {path} is a {what}, which cannot be part of a build context — remove it or add it to .dockerignore")]
    SpecialFile { root: PathBuf, path: String, what: &'static str },
    #[error("context {root}: .dockerignore is invalid")]
    Ignore {
        root: PathBuf,
        #[source]
        err: crate::ignore::IgnoreError,
    },
    #[error("context {root} is not a directory")]
    NotADirectory { root: PathBuf },
    #[error("context {root}: entries are not in canonical order — build the tree with `walk_tree`")]
    Unordered {
        root: PathBuf,
        #[source]
        err: OrderError,
    },
}

/// Why an entry list could not be digested without reading files.
#[derive(Debug, thiserror::Error)]
pub enum EntryListError {
    #[error(transparent)]
    Unordered(#[from] OrderError),
    #[error("file entry {path} has no content hash — hash the tree (`hash_tree`) before digesting its entry list")]
    Unhashed { path: String },
}

/// The one rule for symlinks in a context, shared by the walk (which refuses to address such a
/// tree) and the archive reader (which refuses to unpack one): the target is relative, climbs first
/// (`../..`) without leaving the root, and then only descends. A `..` after a name could climb out
/// of a directory reached through another link, which lexical resolution cannot see, so it is
/// refused rather than resolved.
pub fn check_link_target(path: &[u8], target: &[u8]) -> Result<(), &'static str> {
    if target.is_empty() {
        return Err("the target is empty");
    }
    if target.starts_with(b"/") {
        return Err("the target is absolute");
    }
    let mut depth: usize = path.split(|&b| b == b'/').count() - 1;
    let mut descending = false;
    for part in target.split(|&b| b == b'/') {
        match part {
            b"" | b"." => {}
            b".." if descending => return Err("the target climbs (`..`) after naming a directory; write it as ../x/y"),
            b".." => depth = depth.checked_sub(1).ok_or("the target points outside the root")?,
            _ => descending = true,
        }
    }
    Ok(())
}

#[cfg(test)]
mod link_tests {
    use super::check_link_target as check;

    #[test]
    fn links_are_judged_from_their_own_directory() {
        assert!(check(b"a/b/l", b"../c").is_ok());
        assert!(check(b"a/b/l", b"../../c").is_ok());
        assert!(check(b"a/l", b"./b/./c").is_ok());
        assert!(check(b"l", b"a//b").is_ok());
        assert!(check(b"a/b/l", b"../../../c").is_err());
        assert!(check(b"l", b"..").is_err());
        assert!(check(b"l", b"../x").is_err());
        assert!(check(b"l", b"/etc/passwd").is_err());
        assert!(check(b"l", b"").is_err());
        // Climbing out and back in by name still left the root on the way.
        assert!(check(b"a/l", b"../../ctx/a").is_err());
    }

    #[test]
    fn a_climb_after_a_name_is_refused() {
        // `up` may itself be a link to `..`: `up/../x` would then leave the root.
        assert!(check(b"d/l", b"up/../x").is_err());
        assert!(check(b"l", b"x/../../y").is_err());
        assert!(check(b"a/l", b"./b/./../c").is_err());
    }
}
