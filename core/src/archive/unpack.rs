//! Unpacking an untrusted archive into an empty directory.
//!
//! Containment does not rest on the `tar` crate: it only parses. Every path is checked here (relative,
//! no `.`/`..`/empty components, strictly after the previous entry), every parent is a directory this
//! function created, files are opened `O_CREAT|O_EXCL|O_NOFOLLOW`, and only directories, regular files
//! and symlinks that stay inside the root exist. So no entry — however its pax records spell it — can
//! reach outside the target or through a link.

use super::ArchiveError;
use crate::digest::{check_link_target, EntryKind, StreamHasher, TreeDigest};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

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
    read_archive(input, Some(target), expected)
}

/// Checks an archive exactly as [`unpack`] would — every entry, every path, every link, and the
/// digest — without writing anything: how the coordinator accepts an upload at stream speed.
pub fn verify(input: impl Read, expected: &TreeDigest) -> Result<Unpacked, ArchiveError> {
    read_archive(input, None, Some(expected))
}

/// The one reader behind [`unpack`] and [`verify`]; with no `target` it creates nothing.
fn read_archive(
    input: impl Read,
    target: Option<&Path>,
    expected: Option<&TreeDigest>,
) -> Result<Unpacked, ArchiveError> {
    let shown_target = target.unwrap_or(Path::new("<verify>"));
    let mut archive = tar::Archive::new(input);
    let mut created: HashMap<Vec<u8>, EntryKind> = HashMap::new();
    let mut hasher = StreamHasher::new();
    let mut stats = (0u64, 0u64);
    let mut buf = vec![0u8; 256 * 1024];
    for item in archive.entries().map_err(ArchiveError::Corrupt)? {
        let mut entry = item.map_err(ArchiveError::Corrupt)?;
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
        let path = clean_path(&raw, kind).map_err(&refuse)?;
        hasher.check_order(&path).map_err(|e| refuse(&e.to_string()))?;
        ensure_parents(target, &path, &mut created).map_err(|r| match r {
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
        created.insert(path, kind);
        stats.0 += 1;
    }
    let digest = hasher.finish();
    if let Some(expected) = expected {
        if *expected != digest {
            return Err(ArchiveError::DigestMismatch { expected: *expected, actual: digest });
        }
    }
    Ok(Unpacked { digest, entries: stats.0, content_bytes: stats.1 })
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
fn ensure_parents(
    target: Option<&Path>,
    path: &[u8],
    created: &mut HashMap<Vec<u8>, EntryKind>,
) -> Result<(), ParentError> {
    let mut end = 0;
    while let Some(pos) = path[end..].iter().position(|&b| b == b'/') {
        let parent = &path[..end + pos];
        match created.get(parent) {
            Some(EntryKind::Dir) => {}
            Some(EntryKind::Symlink) => return Err(ParentError::Refused("it would be written through a symlink")),
            Some(_) => return Err(ParentError::Refused("its parent is a file")),
            None => {
                if let Some(target) = target {
                    fs::create_dir(target.join(OsStr::from_bytes(parent))).map_err(ParentError::Io)?;
                }
                created.insert(parent.to_vec(), EntryKind::Dir);
            }
        }
        end += pos + 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
