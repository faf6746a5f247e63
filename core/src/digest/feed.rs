//! Hashing a walked tree: each file's content hash (recalled from the stat cache, or read), then
//! the canonical stream over the entry list.
//!
//! Files are independent under spec v2, so small files are read *and* hashed in parallel on the
//! I/O pool, each into a per-thread buffer; the stream over the entries is then fed strictly in
//! entry order, so the digest cannot depend on the number of threads or on scheduling. A file of
//! 1 MiB or more is hashed from a memory map by blake3's rayon path (one file, every core).

use super::cache::StatCache;
use super::walk::{unreadable, Tree};
use super::{hash_file_mmap, ContentHash, DigestError, Entry, EntryKind, EntryListError, StreamHasher, TreeDigest};
use rayon::prelude::*;
use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Files from this size on are hashed from a memory map by several threads.
const BIG_FILE: u64 = 1 << 20;

/// What [`hash_tree`] did: the digest, and how many file hashes it read from disk and how many
/// the stat cache vouched for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hashed {
    pub digest: TreeDigest,
    pub read: usize,
    pub recalled: usize,
}

/// Fills in the content hash of every file entry of `tree` — from `cache` where it vouches for the
/// file's stat, else by reading the file — and digests the entry list.
pub fn hash_tree(tree: &mut Tree, cache: Option<&StatCache>) -> Result<Hashed, DigestError> {
    let mut todo = Vec::new();
    let mut recalled = 0;
    let mut cursor = cache.map(StatCache::cursor);
    for (i, e) in tree.entries.iter_mut().enumerate() {
        if !is_file(e) {
            continue;
        }
        e.hash = match (&mut cursor, &e.stat) {
            (Some(cursor), Some(stat)) => cursor.recall(&e.path, stat),
            _ => None,
        };
        match e.hash {
            Some(_) => recalled += 1,
            None => todo.push(i),
        }
    }
    let hashes = read_hashes(&tree.root, &tree.entries, &todo)?;
    for (&i, hash) in todo.iter().zip(hashes) {
        tree.entries[i].hash = Some(hash);
    }
    let digest = digest_entries(&tree.entries).map_err(|err| match err {
        EntryListError::Unordered(err) => DigestError::Unordered { root: tree.root.clone(), err },
        EntryListError::Unhashed { .. } => unreachable!("every file entry was hashed above"),
    })?;
    Ok(Hashed { digest, read: todo.len(), recalled })
}

/// Hashes `tree` by reading every file, whatever hashes its entries already carry.
pub fn digest_tree(tree: &Tree) -> Result<TreeDigest, DigestError> {
    let mut tree = tree.clone();
    Ok(hash_tree(&mut tree, None)?.digest)
}

/// The tree digest of an entry list whose files carry their content hashes: no file is read.
pub fn digest_entries(entries: &[Entry]) -> Result<TreeDigest, EntryListError> {
    let mut hasher = StreamHasher::new();
    feed_entries(&mut hasher, entries)?;
    Ok(hasher.finish())
}

fn is_file(e: &Entry) -> bool {
    matches!(e.kind, EntryKind::File | EntryKind::ExecFile)
}

fn on_disk(root: &Path, rel: &[u8]) -> PathBuf {
    root.join(OsStr::from_bytes(rel))
}

/// The content hashes of the entries at `todo` (indices of file entries), in that order. Errors
/// name the first failing entry in order, so the same broken tree always names the same path.
fn read_hashes(root: &Path, entries: &[Entry], todo: &[usize]) -> Result<Vec<ContentHash>, DigestError> {
    let small: Vec<io::Result<ContentHash>> = super::io::blocking(|| {
        todo.par_iter()
            .map_init(Vec::new, |buf, &i| {
                let e = &entries[i];
                match e.size >= BIG_FILE {
                    // Placeholder, replaced below: big files are hashed one at a time, each by
                    // every core, rather than sixteen at once from the I/O pool.
                    true => Ok(ContentHash([0; 32])),
                    false => read_small(&on_disk(root, &e.path), e.size, buf),
                }
            })
            .collect()
    });
    let mut out = Vec::with_capacity(todo.len());
    for (&i, result) in todo.iter().zip(small) {
        let e = &entries[i];
        let hash = match e.size >= BIG_FILE {
            true => hash_file_mmap(&on_disk(root, &e.path), e.size),
            false => result,
        };
        out.push(hash.map_err(|err| unreadable(root, &e.path, err))?);
    }
    Ok(out)
}

/// Reads and hashes a small file of the walked size `len`, refusing one that is no longer that
/// size: the entry list already promised that many content bytes.
fn read_small(path: &Path, len: u64, buf: &mut Vec<u8>) -> io::Result<ContentHash> {
    // O_NOFOLLOW: a file swapped for a symlink since the walk must not pull in what it points at.
    let mut file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    let want = len as usize;
    // One byte more than the walked size, so that growth shows up; a read that stops short at
    // exactly the walked size is, for a regular file, its end. That saves the second `read` that
    // would only confirm EOF — a syscall per file is a good part of a small-file tree's cost.
    buf.resize(want + 1, 0);
    let mut got = 0;
    loop {
        let n = match file.read(&mut buf[got..]) {
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        got += n;
        if n == 0 || got >= want {
            break;
        }
    }
    if got != want {
        return Err(io::Error::other(format!(
            "file changed size while the context was digested (walked as {want} bytes)"
        )));
    }
    Ok(ContentHash::of(&buf[..want]))
}

/// Feeds an entry list (canonical order, files hashed) to `hasher`: the one walk over entries
/// that both a digest and a kept list (`list::encode`) are made by.
pub(super) fn feed_entries(hasher: &mut StreamHasher, entries: &[Entry]) -> Result<(), EntryListError> {
    for e in entries {
        hasher.check_order(&e.path)?;
        match e.kind {
            EntryKind::Dir => hasher.dir(&e.path),
            EntryKind::Symlink => hasher.symlink(&e.path, &e.link_target),
            EntryKind::File | EntryKind::ExecFile => {
                let hash =
                    e.hash.as_ref().ok_or_else(|| EntryListError::Unhashed { path: super::list::shown(&e.path) })?;
                hasher.file_hashed(&e.path, e.kind == EntryKind::ExecFile, e.size, hash);
            }
        }
    }
    Ok(())
}
