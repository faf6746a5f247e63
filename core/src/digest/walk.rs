//! TODO: being written — parallel walk and read feeding `StreamHasher`.
use super::{DigestError, Entry, TreeDigest};
use std::path::{Path, PathBuf};

/// Options of a walk: which Dockerfile path (relative to the root) is always kept, as Docker keeps
/// it even when `.dockerignore` names it.
#[derive(Clone, Debug, Default)]
pub struct WalkOptions {
    pub dockerfile: Option<String>,
}

/// A walked context: its root and its entries in canonical order (exactly what the digest covers
/// and the archive carries).
#[derive(Clone, Debug)]
pub struct Tree {
    pub root: PathBuf,
    pub entries: Vec<Entry>,
}

pub fn walk_tree(_root: &Path, _opts: &WalkOptions) -> Result<Tree, DigestError> {
    todo!()
}

pub fn digest_tree(_tree: &Tree) -> Result<TreeDigest, DigestError> {
    todo!()
}
