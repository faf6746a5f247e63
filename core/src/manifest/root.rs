//! The instance's root: the folder a manifest may take contexts and Dockerfiles from.
//!
//! A manifest often comes from a repository someone else wrote. Without a bound,
//! `context = "../../.ssh"`, a context directory symlinked to `/etc` or
//! `dockerfile = "../../../../etc/hostname"` would ship files from outside the checkout to a shared
//! farm the moment its reader runs `kiln up`. So every context and Dockerfile must resolve — symlinks
//! followed — inside the root: the enclosing git work tree (the nearest folder, from the manifest's
//! own upward, that holds `.git`; found by looking, never by running git, so a hostile repository's
//! git config runs nothing), else the manifest's folder. `root = "../.."` names it explicitly, so
//! widening it is a line a reviewer sees.

use std::fmt;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use toml::Spanned;

use super::error::{Escape, ManifestError, Problem};
use super::resolve::Ctx;

/// How the root was chosen, for messages: a user who did not write `root` should learn where the
/// bound came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootOrigin {
    /// The nearest folder holding `.git`, from the manifest's folder upward.
    GitWorkTree,
    /// No git work tree encloses the manifest: its own folder.
    ManifestFolder,
    /// `root = "<given>"` in the manifest.
    Given(String),
}

impl fmt::Display for RootOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RootOrigin::GitWorkTree => f.write_str("the git work tree holding the manifest"),
            RootOrigin::ManifestFolder => f.write_str("the manifest's folder, as no git work tree holds it"),
            RootOrigin::Given(given) => write!(f, "root = {given:?}"),
        }
    }
}

/// The resolved root, and the manifest's folder it was found from (both absolute, symlinks resolved).
pub(super) struct Root {
    pub(super) path: PathBuf,
    pub(super) origin: RootOrigin,
    folder: PathBuf,
}

impl Root {
    /// Refuses `resolved` (a context or Dockerfile, canonical) unless it lies inside the root.
    /// `given` is the path as the manifest wrote it; `span` is where the error points.
    pub(super) fn contain(
        &self,
        ctx: &Ctx<'_>,
        span: Range<usize>,
        key: &'static str,
        section: String,
        given: &str,
        resolved: &Path,
    ) -> Result<(), ManifestError> {
        if resolved.starts_with(&self.path) {
            return Ok(());
        }
        let common = common_ancestor(&self.path, resolved);
        let widen =
            super::built::relative_from(&self.folder, &common).unwrap_or_else(|| common.to_string_lossy().into_owned());
        let problem = Problem::OutsideRoot(Box::new(Escape {
            key,
            section,
            given: given.to_string(),
            resolved: resolved.to_path_buf(),
            root: self.path.clone(),
            origin: self.origin.clone(),
            widen,
        }));
        Err(ctx.at(span, problem))
    }
}

/// Finds the root: `root = "…"` when given (relative to the manifest's folder, which it must hold),
/// else the enclosing git work tree, else the manifest's folder.
pub(super) fn resolve_root(ctx: &Ctx<'_>, raw: Option<&Spanned<String>>) -> Result<Root, ManifestError> {
    // A folder that cannot be resolved holds no context either: those errors say so, on their line.
    let folder = std::fs::canonicalize(&ctx.dir)
        .unwrap_or_else(|_| std::path::absolute(&ctx.dir).unwrap_or_else(|_| ctx.dir.clone()));
    let Some(raw) = raw else {
        let git = folder.ancestors().find(|dir| std::fs::symlink_metadata(dir.join(".git")).is_ok());
        return Ok(match git {
            Some(tree) => Root { path: tree.to_path_buf(), origin: RootOrigin::GitWorkTree, folder },
            None => Root { path: folder.clone(), origin: RootOrigin::ManifestFolder, folder },
        });
    };
    let given = raw.get_ref().clone();
    let fail = |problem| ctx.at(raw.span(), problem);
    if Path::new(&given).is_absolute() {
        return Err(fail(Problem::AbsoluteRoot { given }));
    }
    let joined = ctx.dir.join(&given);
    let looked = std::path::absolute(&joined).unwrap_or_else(|_| joined.clone());
    let path = match std::fs::canonicalize(&joined) {
        Ok(path) if path.is_dir() => path,
        Ok(_) => return Err(fail(Problem::RootNotDir { given, looked })),
        Err(err) => return Err(fail(Problem::RootUnresolvable { given, looked, err })),
    };
    if !folder.starts_with(&path) {
        return Err(fail(Problem::RootNotAbove { given, resolved: path, folder }));
    }
    Ok(Root { path, origin: RootOrigin::Given(given), folder })
}

/// The longest path both `a` and `b` start with (`/` at least, for absolute paths).
fn common_ancestor(a: &Path, b: &Path) -> PathBuf {
    a.components()
        .zip(b.components())
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x)
        .collect::<Vec<Component<'_>>>()
        .iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_ancestor_is_where_two_paths_part() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(common_ancestor(&p("/a/b/c"), &p("/a/b/d/e")), p("/a/b"));
        assert_eq!(common_ancestor(&p("/a/b"), &p("/x")), p("/"));
        assert_eq!(common_ancestor(&p("/a/b"), &p("/a/bc")), p("/a"), "by component, not by byte");
    }
}
