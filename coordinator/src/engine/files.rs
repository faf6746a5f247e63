//! "context changed" names its files: the recorded tree's entry list diffed against the new one.
//!
//! Where the lists come from (issue 14): the coordinator keeps each uploaded context's entry list
//! in the state store, derived while the upload is verified (`Contexts::entries`). Not the CLI's
//! stat cache: in a served farm the recorded generation may be another developer's converge, whose
//! tree this CLI never walked. Not beside the archive: a farm's coordinators share the database,
//! not their disks. A list lives as long as its context's row, which the content store's
//! collection keeps while any record's current or previous generation names it — exactly the
//! generations a converge or `kiln why` can compare against.
//!
//! The diff is made here, after the uploads, rather than by the CLI: the new context's list is
//! then stored too, and the reason — files included — is what the events persist, so `kiln logs`
//! replays the same words later. When either list is missing (a context uploaded before lists
//! were kept, held but never uploaded to this farm, or too long to keep), the reason keeps its
//! tree digests, as before.

use kiln_core::digest::TreeDigest;

use super::decide::Decision;
use super::Engine;
use crate::contexts::Contexts;
use crate::model::{FilesMoved, Input, Reason};

impl Engine {
    /// Adds the files that moved to every "context changed" among `decisions`.
    pub(super) async fn name_files(&self, decisions: &mut [Decision<'_>]) {
        for d in decisions.iter_mut() {
            let Reason::Changed { changes } = &mut d.reason else { continue };
            for change in changes.iter_mut().filter(|c| c.input == Input::Context && c.files.is_none()) {
                change.files = files_moved(&self.contexts, &change.before, &change.after).await;
            }
        }
    }
}

/// The files that moved from tree `before` to tree `after` (hex digests), if both lists are kept.
async fn files_moved(contexts: &Contexts, before: &str, after: &str) -> Option<FilesMoved> {
    let (before, after): (TreeDigest, TreeDigest) = (before.parse().ok()?, after.parse().ok()?);
    let old = lookup(contexts, &before).await?;
    let new = lookup(contexts, &after).await?;
    // A long list's diff is a few milliseconds of CPU: off the runtime's threads.
    let moved = tokio::task::spawn_blocking(move || kiln_core::digest::diff::diff(&old, &new)).await.ok()?;
    Some(FilesMoved::of(&moved))
}

async fn lookup(contexts: &Contexts, digest: &TreeDigest) -> Option<Vec<kiln_core::digest::Entry>> {
    match contexts.entries(digest).await {
        Ok(entries) => entries,
        Err(err) => {
            // The reason is still true without the names; the converge goes on.
            tracing::warn!(%digest, error = %kiln_core::error_chain(&err), "reading a context's entry list failed");
            None
        }
    }
}
