//! The seal (DESIGN.md "Specs"): a tree produced by a staging command must record nothing about
//! where or when it was staged before it is hashed.
//!
//! Why: the tree digest addresses the staged tree, so a file that names its own scratch directory (a
//! package manager's shim baking the staging path into a search path) or the minute it was written
//! (a `.modules.yaml`-style record) makes one input hash to many addresses, and "present implies
//! current" stops being true. The seal deletes the declared where-and-when files, rewrites the staging
//! path — in every spelling it has, as given and as resolved — to the path the tree will have inside
//! the image, refuses a symlink that names the staging path, and fails loudly on a non-UTF-8 file that
//! holds it: rewriting bytes it cannot read as text would be a blind guess. When no in-image path is
//! declared, a text file holding the staging path is refused too, for the same reason: any path put
//! in its place would be a guess at where the Dockerfile copies the tree. Nothing else is excluded
//! from the hash, so a staging step that starts varying again re-tags in the open.

use crate::ignore::DockerIgnore;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// What to seal, and how.
#[derive(Clone, Debug)]
pub struct SealSpec {
    /// The directory the staging command wrote to, as the caller names it. Its resolved spelling
    /// (symlinks followed) is added by [`seal`]: tools record either.
    pub staging_path: PathBuf,
    /// Where-and-when files to delete, as `.dockerignore`-style patterns relative to the staged root
    /// (e.g. `node_modules/.modules.yaml`, `**/.bin`).
    pub delete: Vec<String>,
    /// The path the staged tree has inside the image; the staging path is rewritten to it. `None`:
    /// nobody said where the tree lands, so a file holding the staging path is refused instead.
    pub in_image_path: Option<String>,
}

/// What [`seal`] changed, for the converge's log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SealReport {
    pub deleted: Vec<String>,
    pub rewritten: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("seal of {root}: cannot read or write {path}")]
    Io {
        root: PathBuf,
        path: String,
        #[source]
        err: io::Error,
    },
    #[error("seal of {root}: symlink {path} names the staging path ({target}) — the staged tree must not point at where it was staged")]
    SymlinkNamesStaging { root: PathBuf, path: String, target: String },
    #[error("seal of {root}: {path} holds the staging path {staging} but is not UTF-8 text, so it cannot be rewritten safely — declare it as a where-and-when file to delete, or stage without absolute paths")]
    NonUtf8 { root: PathBuf, path: String, staging: String },
    #[error("seal of {root}: {path} holds the staging path {staging} — list it among the where-and-when files to delete, or declare the path the tree has in the image so the seal rewrites it there")]
    HoldsStaging { root: PathBuf, path: String, staging: String },
    #[error("seal of {root}: a delete pattern is invalid")]
    Pattern {
        root: PathBuf,
        #[source]
        err: crate::ignore::IgnoreError,
    },
}

/// Seals the staged tree at `root` in place (see the module docs).
pub fn seal(root: &Path, spec: &SealSpec) -> Result<SealReport, SealError> {
    let io_err = |path: &Path, err| SealError::Io { root: root.to_path_buf(), path: shown(root, path), err };
    let patterns = DockerIgnore::parse(&spec.delete.join("\n"))
        .map_err(|err| SealError::Pattern { root: root.to_path_buf(), err })?;
    let mut spellings = vec![spec.staging_path.as_os_str().as_bytes().to_vec()];
    if let Ok(resolved) = fs::canonicalize(&spec.staging_path) {
        spellings.push(resolved.as_os_str().as_bytes().to_vec());
    }
    // A trailing slash is not part of the path; longer spellings go first so a spelling that is a
    // prefix of another never rewrites half of it.
    for s in &mut spellings {
        while s.len() > 1 && s.ends_with(b"/") {
            s.pop();
        }
    }
    spellings.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    spellings.dedup();

    let mut report = SealReport::default();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let mut items: Vec<_> =
            fs::read_dir(&dir).map_err(|e| io_err(&dir, e))?.collect::<Result<_, _>>().map_err(|e| io_err(&dir, e))?;
        items.sort_by_key(|e| e.file_name());
        for item in items {
            let path = item.path();
            let rel = shown(root, &path);
            let meta = fs::symlink_metadata(&path).map_err(|e| io_err(&path, e))?;
            if patterns.is_excluded(&rel) {
                if meta.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) }
                    .map_err(|e| io_err(&path, e))?;
                report.deleted.push(rel);
                continue;
            }
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&path).map_err(|e| io_err(&path, e))?;
                if spellings.iter().any(|s| contains(target.as_os_str().as_bytes(), s)) {
                    return Err(SealError::SymlinkNamesStaging {
                        root: root.to_path_buf(),
                        path: rel,
                        target: target.display().to_string(),
                    });
                }
            } else if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() && rewrite_file(root, &path, &rel, &spellings, spec.in_image_path.as_deref())? {
                report.rewritten.push(rel);
            }
        }
    }
    report.deleted.sort();
    report.rewritten.sort();
    Ok(report)
}

/// Rewrites every spelling of the staging path in one file; true when the file changed.
fn rewrite_file(
    root: &Path,
    path: &Path,
    rel: &str,
    spellings: &[Vec<u8>],
    to: Option<&str>,
) -> Result<bool, SealError> {
    let io_err = |err| SealError::Io { root: root.to_path_buf(), path: rel.to_string(), err };
    let bytes = fs::read(path).map_err(io_err)?;
    let Some(found) = spellings.iter().find(|s| contains(&bytes, s)) else {
        return Ok(false);
    };
    let Ok(mut text) = String::from_utf8(bytes) else {
        return Err(SealError::NonUtf8 {
            root: root.to_path_buf(),
            path: rel.to_string(),
            staging: String::from_utf8_lossy(found).into_owned(),
        });
    };
    let Some(to) = to else {
        return Err(SealError::HoldsStaging {
            root: root.to_path_buf(),
            path: rel.to_string(),
            staging: String::from_utf8_lossy(found).into_owned(),
        });
    };
    for s in spellings {
        // A spelling that is not UTF-8 cannot occur in UTF-8 text.
        if let Ok(s) = std::str::from_utf8(s) {
            text = text.replace(s, to);
        }
    }
    // Write in place: the file keeps its mode (the executable bit is build input).
    fs::write(path, text).map_err(io_err)?;
    Ok(true)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root).unwrap_or(path).to_string_lossy().into_owned()
}
