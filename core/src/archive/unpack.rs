//! Unpacking an untrusted archive into an empty directory.
//!
//! Containment does not rest on the `tar` crate: it only parses. Every path is checked here (relative,
//! no `.`/`..`/empty components, strictly after the previous entry), every parent is a directory this
//! function created, files are opened `O_CREAT|O_EXCL|O_NOFOLLOW`, and only directories, regular files
//! and symlinks that stay inside the root exist. So no entry — however its pax records spell it — can
//! reach outside the target or through a link.
//!
//! Memory does not grow with what a hostile archive claims: the records the `tar` crate buffers
//! whole (pax and GNU long-name records) are cut off at [`ENTRY_METADATA_MAX`], content streams
//! through one fixed buffer, and the parent check remembers only what can still be a parent (at
//! most one entry per length of the latest path), never every entry seen.

use super::ArchiveError;
use crate::digest::{check_link_target, EntryKind, StreamHasher, TreeDigest};
use std::cell::Cell;
use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::rc::Rc;

/// The most bytes read between one entry's content and the next entry's: padding, headers, and
/// the pax and GNU long-name records describing the next entry, which the `tar` crate buffers
/// whole before it returns the entry. A canonical archive needs a few KiB there (a pax `path`
/// record as long as the longest path); without a bound, one 300 MB pax record was 300 MB of an
/// unauthenticated coordinator's memory per upload.
pub const ENTRY_METADATA_MAX: u64 = 1 << 20;

/// What [`unpack`] wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unpacked {
    /// The tree digest of the entries written, hashed as they were written.
    pub digest: TreeDigest,
    pub entries: u64,
    pub content_bytes: u64,
}

/// Unpacks the canonical archive read from `input` into `target`, which must be an empty directory
/// or not exist yet. With `expected`, a different digest is refused (`DigestMismatch`); the caller
/// then discards `target`, which holds only what was checked above.
pub fn unpack(input: impl Read, target: &Path, expected: Option<&TreeDigest>) -> Result<Unpacked, ArchiveError> {
    prepare_target(target)?;
    read_archive(input, Some(target), expected, None).map(|(unpacked, _)| unpacked)
}

/// Checks an archive exactly as [`unpack`] would — every entry, every path, every link, and the
/// digest — without writing anything: how the coordinator accepts an upload at stream speed.
pub fn verify(input: impl Read, expected: &TreeDigest) -> Result<Unpacked, ArchiveError> {
    read_archive(input, None, Some(expected), None).map(|(unpacked, _)| unpacked)
}

/// [`verify`], also keeping the archive's entry list in its canonical encoding
/// ([`crate::digest::list`]) when it takes at most `limit` bytes: the coordinator keeps it so a
/// later converge can name the files that moved, without reading the archive again.
pub fn verify_listed(
    input: impl Read,
    expected: &TreeDigest,
    limit: usize,
) -> Result<(Unpacked, Option<Vec<u8>>), ArchiveError> {
    read_archive(input, None, Some(expected), Some(limit))
}

/// The one reader behind [`unpack`] and [`verify`]; with no `target` it creates nothing; with
/// `listing`, it keeps the entry list up to that many bytes.
fn read_archive(
    input: impl Read,
    target: Option<&Path>,
    expected: Option<&TreeDigest>,
    listing: Option<usize>,
) -> Result<(Unpacked, Option<Vec<u8>>), ArchiveError> {
    let shown_target = target.unwrap_or(Path::new("<verify>"));
    let meter = Meter::default();
    let mut archive = tar::Archive::new(Metered { inner: input, meter: meter.clone() });
    let mut ancestry = Ancestry::default();
    let mut hasher = listing.map_or_else(StreamHasher::new, StreamHasher::recording);
    let mut stats = (0u64, 0u64);
    let mut buf = vec![0u8; 256 * 1024];
    let mut entries = archive.entries().map_err(ArchiveError::Corrupt)?;
    loop {
        // Armed only while the crate looks for the next entry: content is streamed by the loop
        // below through `buf`, and may be as long as the entry says.
        meter.arm(ENTRY_METADATA_MAX);
        let item = entries.next();
        meter.disarm();
        let Some(item) = item else { break };
        let mut entry = item.map_err(|err| match meter.exceeded() {
            true => ArchiveError::MetadataTooLarge { after: ancestry.last_shown(), limit: ENTRY_METADATA_MAX },
            false => ArchiveError::Corrupt(err),
        })?;
        let raw = entry.path_bytes().into_owned();
        let refuse = |why: &str| ArchiveError::Refused {
            path: String::from_utf8_lossy(&raw).into_owned(),
            why: why.to_string(),
        };
        let kind = match entry.header().entry_type() {
            tar::EntryType::Directory => EntryKind::Dir,
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let mode = entry.header().mode().map_err(ArchiveError::Corrupt)?;
                if mode & 0o111 != 0 {
                    EntryKind::ExecFile
                } else {
                    EntryKind::File
                }
            }
            tar::EntryType::Symlink => EntryKind::Symlink,
            tar::EntryType::Link => return Err(refuse("hardlinks are not allowed")),
            tar::EntryType::Char | tar::EntryType::Block => return Err(refuse("device files are not allowed")),
            tar::EntryType::Fifo => return Err(refuse("fifos are not allowed")),
            other => return Err(refuse(&format!("entry type {other:?} is not allowed"))),
        };
        // Content on anything but a file would be skipped unseen by the crate, inside the budget
        // meant for the next entry's records; a canonical archive never has it.
        if !matches!(kind, EntryKind::File | EntryKind::ExecFile) && entry.size() != 0 {
            return Err(refuse("a directory or symlink entry carries content"));
        }
        let path = clean_path(&raw, kind).map_err(&refuse)?;
        hasher.check_order(&path).map_err(|e| refuse(&e.to_string()))?;
        ancestry.advance(&path);
        ensure_parents(target, &path, &mut ancestry).map_err(|r| match r {
            ParentError::Refused(why) => refuse(why),
            ParentError::Io(err) => create_err(shown_target, &raw, err),
        })?;
        let dest = target.map(|t| t.join(OsStr::from_bytes(&path)));
        let target = shown_target;
        match kind {
            EntryKind::Dir => {
                if let Some(dest) = &dest {
                    fs::create_dir(dest).map_err(|e| create_err(target, &raw, e))?;
                }
                hasher.dir(&path);
            }
            EntryKind::Symlink => {
                let link = entry.link_name_bytes().map(|l| l.into_owned()).unwrap_or_default();
                check_link_target(&path, &link).map_err(&refuse)?;
                if let Some(dest) = &dest {
                    std::os::unix::fs::symlink(OsStr::from_bytes(&link), dest)
                        .map_err(|e| create_err(target, &raw, e))?;
                }
                hasher.symlink(&path, &link);
            }
            EntryKind::File | EntryKind::ExecFile => {
                let exec = kind == EntryKind::ExecFile;
                let size = entry.size();
                let mut file = match &dest {
                    Some(dest) => Some(
                        OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .custom_flags(libc::O_NOFOLLOW)
                            .mode(0o600)
                            .open(dest)
                            .map_err(|e| create_err(target, &raw, e))?,
                    ),
                    None => None,
                };
                hasher.file(&path, exec, size);
                loop {
                    let n = entry.read(&mut buf).map_err(ArchiveError::Corrupt)?;
                    if n == 0 {
                        break;
                    }
                    hasher.content(&buf[..n]);
                    if let Some(file) = &mut file {
                        file.write_all(&buf[..n]).map_err(|e| create_err(target, &raw, e))?;
                    }
                }
                if hasher.owed() != 0 {
                    return Err(refuse("content is shorter than its header says"));
                }
                if let Some(file) = &file {
                    let mode = if exec { 0o755 } else { 0o644 };
                    file.set_permissions(fs::Permissions::from_mode(mode)).map_err(|e| create_err(target, &raw, e))?;
                }
                stats.1 += size;
            }
        }
        ancestry.insert(path.len(), kind);
        stats.0 += 1;
    }
    let (digest, list) = hasher.finish_recorded();
    if let Some(expected) = expected {
        if *expected != digest {
            return Err(ArchiveError::DigestMismatch { expected: *expected, actual: digest });
        }
    }
    Ok((Unpacked { digest, entries: stats.0, content_bytes: stats.1 }, list))
}

fn create_err(target: &Path, raw: &[u8], err: io::Error) -> ArchiveError {
    ArchiveError::Create { target: target.to_path_buf(), path: String::from_utf8_lossy(raw).into_owned(), err }
}

fn prepare_target(target: &Path) -> Result<(), ArchiveError> {
    let fail = |why: String| ArchiveError::Target { target: target.to_path_buf(), why };
    match fs::symlink_metadata(target) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => fs::create_dir_all(target).map_err(|e| fail(e.to_string())),
        Err(e) => Err(fail(e.to_string())),
        Ok(meta) if !meta.is_dir() => Err(fail("it exists and is not a directory".into())),
        Ok(_) => {
            let mut items = fs::read_dir(target).map_err(|e| fail(e.to_string()))?;
            match items.next() {
                None => Ok(()),
                Some(_) => Err(fail("it is not empty — unpack into a new or empty directory".into())),
            }
        }
    }
}

/// The canonical relative path of an entry, or why it is refused. Directories may carry one
/// trailing `/`; nothing else is forgiven, since a canonical archive never needs it.
fn clean_path(raw: &[u8], kind: EntryKind) -> Result<Vec<u8>, &'static str> {
    let path = match (kind, raw.strip_suffix(b"/")) {
        (EntryKind::Dir, Some(p)) => p,
        _ => raw,
    };
    if path.is_empty() {
        return Err("empty path");
    }
    if path.starts_with(b"/") {
        return Err("absolute paths are not allowed");
    }
    for part in path.split(|&b| b == b'/') {
        match part {
            b"" => return Err("empty path component"),
            b"." => return Err("`.` components are not allowed"),
            b".." => return Err("`..` components are not allowed"),
            _ => {}
        }
    }
    Ok(path.to_vec())
}

enum ParentError {
    Refused(&'static str),
    Io(io::Error),
}

/// Makes sure every parent of `path` is a directory this unpack created, creating missing ones
/// (Docker's walk leaves out an excluded directory whose excepted children it still sends).
/// `ancestry` has advanced to `path`.
fn ensure_parents(target: Option<&Path>, path: &[u8], ancestry: &mut Ancestry) -> Result<(), ParentError> {
    let mut end = 0;
    while let Some(pos) = path[end..].iter().position(|&b| b == b'/') {
        let parent = &path[..end + pos];
        match ancestry.kind(parent.len()) {
            Some(EntryKind::Dir) => {}
            Some(EntryKind::Symlink) => return Err(ParentError::Refused("it would be written through a symlink")),
            Some(_) => return Err(ParentError::Refused("its parent is a file")),
            None => {
                if let Some(target) = target {
                    fs::create_dir(target.join(OsStr::from_bytes(parent))).map_err(ParentError::Io)?;
                }
                ancestry.insert(parent.len(), EntryKind::Dir);
            }
        }
        end += pos + 1;
    }
    Ok(())
}

/// The entries (given and implied) that may still be the parent of a later entry, each with its
/// kind.
///
/// Entries arrive in strictly increasing byte order, and the paths under `a/` sort between `a` and
/// `a0` (`/` is the byte before `0`). So once an entry has passed `a0`, no later entry can sit
/// under `a`; and every entry still able to is a prefix of the latest path followed there by a
/// byte up to `/`. Those are kept as lengths into the latest path: what is remembered is bounded
/// by that path's length, whatever the number of entries. (A map of every path seen grew with the
/// archive: a hostile one of millions of long directory names cost gigabytes.)
#[derive(Debug, Default)]
struct Ancestry {
    last: Vec<u8>,
    /// Prefixes of `last`, by length, ascending.
    open: Vec<(usize, EntryKind)>,
}

impl Ancestry {
    /// Moves to `path`, which sorts after the last one, forgetting what can no longer be a parent.
    fn advance(&mut self, path: &[u8]) {
        let common = self.last.iter().zip(path).take_while(|(a, b)| a == b).count();
        self.open.retain(|&(len, _)| len <= common && path.get(len).is_some_and(|&b| b <= b'/'));
        self.last.clear();
        self.last.extend_from_slice(path);
    }

    /// The kind of the prefix of the latest path that is `len` bytes long, if it was seen.
    fn kind(&self, len: usize) -> Option<EntryKind> {
        let at = self.open.binary_search_by_key(&len, |&(l, _)| l).ok()?;
        Some(self.open[at].1)
    }

    /// Records the prefix of the latest path that is `len` bytes long (the whole path included).
    fn insert(&mut self, len: usize, kind: EntryKind) {
        match self.open.binary_search_by_key(&len, |&(l, _)| l) {
            Ok(at) => self.open[at].1 = kind,
            Err(at) => self.open.insert(at, (len, kind)),
        }
    }

    /// The latest path, for a message about what follows it.
    fn last_shown(&self) -> String {
        match self.last.is_empty() {
            true => "(the first)".to_string(),
            false => String::from_utf8_lossy(&self.last).into_owned(),
        }
    }
}

/// How many bytes the reader may still hand the `tar` crate; shared between the reader, which the
/// crate owns, and the loop that arms it.
#[derive(Clone, Debug, Default)]
struct Meter(Rc<(Cell<Option<u64>>, Cell<bool>)>);

impl Meter {
    fn arm(&self, limit: u64) {
        self.0 .0.set(Some(limit));
    }
    fn disarm(&self) {
        self.0 .0.set(None);
    }
    /// True once a read was refused for the budget: the crate's error then means "too long".
    fn exceeded(&self) -> bool {
        self.0 .1.get()
    }
}

/// The archive's reader, refusing to read past the meter's budget while it is armed.
struct Metered<R> {
    inner: R,
    meter: Meter,
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let budget = &self.meter.0 .0;
        match budget.get() {
            None => self.inner.read(buf),
            Some(0) if !buf.is_empty() => {
                self.meter.0 .1.set(true);
                Err(io::Error::new(io::ErrorKind::InvalidData, "the entry's records are over the limit"))
            }
            Some(left) => {
                let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                let n = self.inner.read(&mut buf[..want])?;
                budget.set(Some(left - n as u64));
                Ok(n)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ancestry_remembers_only_what_can_still_be_a_parent() {
        let mut ancestry = Ancestry::default();
        ancestry.advance(b"a");
        ancestry.insert(1, EntryKind::Dir);
        ancestry.advance(b"a-x"); // sorts between `a` and `a/…`: `a` may still have children
        ancestry.insert(3, EntryKind::File);
        ancestry.advance(b"a/b");
        assert_eq!(ancestry.kind(1), Some(EntryKind::Dir));
        assert_eq!(ancestry.kind(3), None, "`a-x` is forgotten once `a/b` passed it");
        ancestry.insert(3, EntryKind::Symlink);
        ancestry.advance(b"a/b/c");
        assert_eq!(ancestry.kind(3), Some(EntryKind::Symlink));
        ancestry.advance(b"b");
        assert_eq!(ancestry.open, [], "nothing under `a` can follow `b`");

        // A hundred thousand sibling directories: one is remembered at a time.
        for i in 0..100_000u32 {
            let path = format!("d/{i:08}");
            ancestry.advance(path.as_bytes());
            if i == 0 {
                ancestry.insert(1, EntryKind::Dir);
            }
            ancestry.insert(path.len(), EntryKind::Dir);
            assert!(ancestry.open.len() <= 2);
        }
    }

    #[test]
    fn paths_must_be_canonical() {
        assert!(clean_path(b"a/b", EntryKind::File).is_ok());
        assert_eq!(clean_path(b"a/", EntryKind::Dir).unwrap(), b"a");
        assert!(clean_path(b"a/", EntryKind::File).is_err());
        assert!(clean_path(b"/a", EntryKind::File).is_err());
        assert!(clean_path(b"a/../b", EntryKind::File).is_err());
        assert!(clean_path(b"./a", EntryKind::File).is_err());
        assert!(clean_path(b"a//b", EntryKind::File).is_err());
    }
}
