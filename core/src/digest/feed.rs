//! Reading a walked tree's contents into the one [`StreamHasher`], fast and in canonical order.
//!
//! Small files are read in windows of consecutive entries (bounded in bytes and in count, so
//! memory stays bounded however large the tree), each window by many threads into one reused
//! buffer, and hashed strictly in entry order while the next window is being read: the reads run
//! in parallel, the stream never does, so the digest cannot depend on the number of threads or on
//! scheduling. A file of 1 MiB or more is its own window and goes through
//! [`StreamHasher::file_mmap`] (blake3's mmap + rayon path).

use super::walk::{unreadable, Tree};
use super::{DigestError, Entry, EntryKind, StreamHasher, TreeDigest};
use rayon::prelude::*;
use std::ffi::OsStr;
use std::fs::OpenOptions;
use std::io::{self, Read};
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Files from this size on are hashed from a memory map by several threads.
const BIG_FILE: u64 = 1 << 20;
/// Bounds of one window of small files: enough entries to keep every I/O thread busy between
/// hand-offs, few enough bytes that two windows in memory (hashed + being read) stay small.
const WINDOW_BYTES: u64 = 32 << 20;
const WINDOW_ENTRIES: usize = 2048;

/// Hashes `tree`'s entries and contents as the canonical stream (see [`super`]).
pub fn digest_tree(tree: &Tree) -> Result<TreeDigest, DigestError> {
    let windows = plan(&tree.entries);
    let mut hasher = StreamHasher::new();
    let mut loaded = Loaded::default();
    let mut spare = Loaded::default();
    if let Some(first) = windows.first() {
        read_window(tree, first.clone(), &mut loaded)?;
    }
    for (i, window) in windows.iter().enumerate() {
        let next = windows.get(i + 1).cloned();
        let (fed, prefetched) = rayon::join(
            || feed_window(tree, &mut hasher, window.clone(), &loaded),
            || match next {
                Some(next) => read_window(tree, next, &mut spare),
                None => Ok(()),
            },
        );
        // The window being hashed comes first in the stream, so its error is the one to report.
        fed?;
        prefetched?;
        std::mem::swap(&mut loaded, &mut spare);
    }
    Ok(hasher.finish())
}

/// A window's file contents: one buffer, reused from window to window so that reading 20,000
/// small files does not mean 20,000 allocations (and their page faults), and where each file's
/// bytes lie in it.
#[derive(Default)]
struct Loaded {
    arena: Vec<u8>,
    /// Per entry of the window, in order; empty for directories and symlinks.
    spans: Vec<Range<usize>>,
}

/// Splits entries into consecutive windows; a big file is always alone in its own.
fn plan(entries: &[Entry]) -> Vec<Range<usize>> {
    let mut windows = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, e) in entries.iter().enumerate() {
        if is_big(e) {
            if start < i {
                windows.push(start..i);
            }
            windows.push(i..i + 1);
            start = i + 1;
            bytes = 0;
            continue;
        }
        if is_file(e) {
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

fn is_file(e: &Entry) -> bool {
    matches!(e.kind, EntryKind::File | EntryKind::ExecFile)
}

fn is_big(e: &Entry) -> bool {
    is_file(e) && e.size >= BIG_FILE
}

fn on_disk(root: &Path, rel: &[u8]) -> PathBuf {
    root.join(OsStr::from_bytes(rel))
}

/// Reads the contents of a window's small files into `into`. Errors are reported for the first
/// failing entry in order, so the same broken tree always names the same path.
fn read_window(tree: &Tree, window: Range<usize>, into: &mut Loaded) -> Result<(), DigestError> {
    let entries = &tree.entries[window];
    into.spans.clear();
    if entries.len() == 1 && is_big(&entries[0]) {
        return Ok(());
    }
    // Each file gets one byte more than its walked size, so that growth shows up (read_into).
    let mut total = 0;
    for e in entries {
        let room = if is_file(e) { e.size as usize + 1 } else { 0 };
        into.spans.push(total..total + room);
        total += room;
    }
    if into.arena.len() < total {
        into.arena.resize(total, 0);
    }
    let mut slots = Vec::with_capacity(entries.len());
    let mut rest = &mut into.arena[..total];
    for span in &into.spans {
        let (slot, tail) = rest.split_at_mut(span.len());
        slots.push(slot);
        rest = tail;
    }
    let read: Vec<io::Result<()>> = super::io::blocking(|| {
        slots
            .into_par_iter()
            .zip(entries)
            .map(|(slot, e)| if is_file(e) { read_into(&on_disk(&tree.root, &e.path), slot) } else { Ok(()) })
            .collect()
    });
    for ((r, e), span) in read.into_iter().zip(entries).zip(into.spans.iter_mut()) {
        r.map_err(|err| unreadable(&tree.root, &e.path, err))?;
        // Drop the growth-detection byte: what remains is exactly the content.
        span.end = span.end.saturating_sub(1).max(span.start);
    }
    Ok(())
}

/// Fills `slot` (the walked size plus one byte) from the file at `path`, refusing a file that is
/// no longer the walked size: the stream already promised that many content bytes.
fn read_into(path: &Path, slot: &mut [u8]) -> io::Result<()> {
    // O_NOFOLLOW: a file swapped for a symlink since the walk must not pull in what it points at.
    let mut file = OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    let want = slot.len() - 1;
    // Filling the extra byte means the file grew, and a read that stops short at exactly the
    // walked size is, for a regular file, its end. That saves the second `read` that would only
    // confirm EOF — and a syscall per file is a good part of the cost of a small-file tree.
    let mut got = 0;
    loop {
        let n = match file.read(&mut slot[got..]) {
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
    Ok(())
}

fn feed_window(
    tree: &Tree,
    hasher: &mut StreamHasher,
    window: Range<usize>,
    loaded: &Loaded,
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
    for (e, span) in entries.iter().zip(&loaded.spans) {
        check_order(tree, hasher, e)?;
        match e.kind {
            EntryKind::Dir => hasher.dir(&e.path),
            EntryKind::Symlink => hasher.symlink(&e.path, &e.link_target),
            EntryKind::File | EntryKind::ExecFile => {
                hasher.file(&e.path, e.kind == EntryKind::ExecFile, e.size);
                hasher.content(&loaded.arena[span.clone()]);
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
