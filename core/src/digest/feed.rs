//! Reading a walked tree's contents into the one [`StreamHasher`], fast and in canonical order.
//!
//! Small files are read by rayon in windows of consecutive entries (bounded in bytes and in count,
//! so memory stays bounded however large the tree), and each window is hashed strictly in entry
//! order while the next one is being read: the reads run in parallel, the stream never does, so
//! the digest cannot depend on the number of threads or on scheduling. A file of 1 MiB or more
//! is its own window and goes through [`StreamHasher::file_mmap`] (blake3's mmap + rayon path).

use super::walk::{unreadable, Tree};
use super::{DigestError, Entry, EntryKind, StreamHasher, TreeDigest};
use rayon::prelude::*;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Files from this size on are hashed from a memory map by several threads.
const BIG_FILE: u64 = 1 << 20;
/// Bounds of one window of small files: enough entries to keep every thread busy between
/// hand-offs, few enough bytes that two windows in memory (hashed + being read) stay small.
const WINDOW_BYTES: u64 = 32 << 20;
const WINDOW_ENTRIES: usize = 2048;

/// Hashes `tree`'s entries and contents as the canonical stream (see [`super`]).
pub fn digest_tree(tree: &Tree) -> Result<TreeDigest, DigestError> {
    let windows = plan(&tree.entries);
    let mut hasher = StreamHasher::new();
    let mut loaded = match windows.first() {
        Some(w) => read_window(tree, w.clone())?,
        None => Vec::new(),
    };
    for (i, window) in windows.iter().enumerate() {
        let next = windows.get(i + 1).cloned();
        let current = std::mem::take(&mut loaded);
        let (fed, prefetched) = rayon::join(
            || feed_window(tree, &mut hasher, window.clone(), current),
            || next.map(|w| read_window(tree, w)).transpose(),
        );
        // The window being hashed comes first in the stream, so its error is the one to report.
        fed?;
        loaded = prefetched?.unwrap_or_default();
    }
    Ok(hasher.finish())
}

/// Splits entries into consecutive windows; a big file is always alone in its own.
fn plan(entries: &[Entry]) -> Vec<Range<usize>> {
    let mut windows = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let is_file = matches!(e.kind, EntryKind::File | EntryKind::ExecFile);
        if is_file && e.size >= BIG_FILE {
            if start < i {
                windows.push(start..i);
            }
            windows.push(i..i + 1);
            start = i + 1;
            bytes = 0;
            continue;
        }
        if is_file {
            bytes += e.size;
        }
        if i + 1 - start >= WINDOW_ENTRIES || bytes >= WINDOW_BYTES {
            windows.push(start..i + 1);
            start = i + 1;
            bytes = 0;
        }
    }
    if start < entries.len() {
        windows.push(start..entries.len());
    }
    windows
}

fn is_big(e: &Entry) -> bool {
    matches!(e.kind, EntryKind::File | EntryKind::ExecFile) && e.size >= BIG_FILE
}

fn on_disk(root: &Path, rel: &[u8]) -> PathBuf {
    root.join(OsStr::from_bytes(rel))
}

/// Reads the contents of a window's small files, one buffer per file in entry order (directories
/// and symlinks get an empty one). Errors are reported for the first failing entry in order, so
/// the same broken tree always names the same path.
fn read_window(tree: &Tree, window: Range<usize>) -> Result<Vec<Vec<u8>>, DigestError> {
    let entries = &tree.entries[window];
    if entries.len() == 1 && is_big(&entries[0]) {
        return Ok(Vec::new());
    }
    let read: Vec<io::Result<Vec<u8>>> = super::io::blocking(|| {
        entries
            .par_iter()
            .map(|e| match e.kind {
                EntryKind::File | EntryKind::ExecFile => read_small(&on_disk(&tree.root, &e.path), e.size),
                EntryKind::Dir | EntryKind::Symlink => Ok(Vec::new()),
            })
            .collect()
    });
    read.into_iter().zip(entries).map(|(r, e)| r.map_err(|err| unreadable(&tree.root, &e.path, err))).collect()
}

/// Reads a file that the walk saw as `size` bytes, refusing it if it is no longer that size: the
/// header already promised `size` bytes of content to the stream.
fn read_small(path: &Path, size: u64) -> io::Result<Vec<u8>> {
    // O_NOFOLLOW: a file swapped for a symlink since the walk must not pull in what it points at.
    let mut file: File = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    let mut buf = vec![0u8; size as usize];
    file.read_exact(&mut buf).map_err(|err| match err.kind() {
        io::ErrorKind::UnexpectedEof => changed_size(size),
        _ => err,
    })?;
    let mut probe = [0u8; 1];
    if file.read(&mut probe)? != 0 {
        return Err(changed_size(size));
    }
    Ok(buf)
}

fn changed_size(size: u64) -> io::Error {
    io::Error::other(format!("file changed size while the context was digested (walked as {size} bytes)"))
}

fn feed_window(
    tree: &Tree,
    hasher: &mut StreamHasher,
    window: Range<usize>,
    contents: Vec<Vec<u8>>,
) -> Result<(), DigestError> {
    let entries = &tree.entries[window];
    if entries.len() == 1 && is_big(&entries[0]) {
        let e = &entries[0];
        check_order(tree, hasher, e)?;
        let exec = e.kind == EntryKind::ExecFile;
        return hasher
            .file_mmap(&e.path, exec, e.size, &on_disk(&tree.root, &e.path))
            .map_err(|err| unreadable(&tree.root, &e.path, err));
    }
    for (e, content) in entries.iter().zip(contents) {
        check_order(tree, hasher, e)?;
        match e.kind {
            EntryKind::Dir => hasher.dir(&e.path),
            EntryKind::Symlink => hasher.symlink(&e.path, &e.link_target),
            EntryKind::File | EntryKind::ExecFile => {
                hasher.file(&e.path, e.kind == EntryKind::ExecFile, e.size);
                hasher.content(&content);
            }
        }
    }
    Ok(())
}

/// A `Tree` built by hand (its fields are public) could list entries out of order; hashing it
/// would give a digest no walk of that tree produces, so it is refused instead.
fn check_order(tree: &Tree, hasher: &StreamHasher, e: &Entry) -> Result<(), DigestError> {
    hasher.check_order(&e.path).map_err(|err| DigestError::Unordered { root: tree.root.clone(), err })
}
