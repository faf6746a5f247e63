//! Helpers the fuzz targets share: a scratch directory per process and a listing of what a tree
//! on disk holds, so a target can check what an unpack wrote (and where).

use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A directory for one fuzzing process, on tmpfs when there is one (every input writes files).
pub fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let builder = tempfile::Builder::new().prefix("kiln-fuzz-").tempdir_in(shm);
    builder.or_else(|_| tempfile::tempdir()).expect("a scratch directory")
}

/// What one entry on disk is.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Found {
    Dir,
    File {
        mode: u32,
        content: Vec<u8>,
    },
    Symlink {
        target: Vec<u8>,
    },
    /// A socket, fifo or device: nothing an unpack may ever create.
    Other,
}

/// Every entry under `root` (not `root` itself), by `/`-separated relative path, sorted.
pub fn list_tree(root: &Path) -> Vec<(Vec<u8>, Found)> {
    let mut out = Vec::new();
    walk(root, Vec::new(), &mut out);
    out.sort();
    out
}

fn walk(dir: &Path, rel: Vec<u8>, out: &mut Vec<(Vec<u8>, Found)>) {
    let Ok(read) = fs::read_dir(dir) else {
        return;
    };
    for dirent in read.flatten() {
        let mut path = rel.clone();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(dirent.file_name().as_bytes());
        let on_disk = dirent.path();
        let Ok(meta) = fs::symlink_metadata(&on_disk) else {
            continue;
        };
        let kind = meta.file_type();
        let found = if kind.is_symlink() {
            let target = fs::read_link(&on_disk).map(|t| t.as_os_str().as_bytes().to_vec()).unwrap_or_default();
            Found::Symlink { target }
        } else if kind.is_dir() {
            walk(&on_disk, path.clone(), out);
            Found::Dir
        } else if kind.is_file() {
            use std::os::unix::fs::PermissionsExt;
            Found::File { mode: meta.permissions().mode() & 0o7777, content: fs::read(&on_disk).unwrap_or_default() }
        } else {
            Found::Other
        };
        out.push((path, found));
    }
}

/// `root` joined with a raw relative path.
pub fn join(root: &Path, rel: &[u8]) -> PathBuf {
    root.join(OsStr::from_bytes(rel))
}

/// Empties `dir` (keeping it), whatever an input left in it.
pub fn empty_dir(dir: &Path) {
    if let Ok(read) = fs::read_dir(dir) {
        for dirent in read.flatten() {
            let path = dirent.path();
            match fs::symlink_metadata(&path) {
                Ok(meta) if meta.is_dir() => {
                    make_writable(&path);
                    let _ = fs::remove_dir_all(&path);
                }
                _ => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }
}

fn make_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
    if let Ok(read) = fs::read_dir(dir) {
        for dirent in read.flatten() {
            if dirent.file_type().is_ok_and(|t| t.is_dir()) {
                make_writable(&dirent.path());
            }
        }
    }
}
