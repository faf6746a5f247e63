//! The tasks a node agent executes for the coordinator: list its store, remove refs from it. Like
//! the host's tasks, each answers exactly once, and a failure is an answer naming what failed.
//!
//! A removal batch is confirmed by listing the store again before answering: a ref containerd
//! accepted the removal of can be back a moment later (the CRI plugin re-creates a ref it was
//! labeling), and a CRI removal can leave the image behind. The coordinator is told what the
//! store now holds, not what the calls returned.

use super::{NodeStore, Removal, RemovalMode};
use crate::tasks::{answer, listing, TaskResult};
use kiln_core::error_chain as chain;
use kiln_proto::v1 as pb;
use pb::task_error::Kind as ErrorKind;
use pb::task_result::Outcome;
use std::collections::HashSet;
use std::sync::Arc;
use tokio::sync::mpsc;

pub(crate) async fn execute(store: Arc<dyn NodeStore>, out: mpsc::Sender<pb::AgentMessage>, task: pb::Task) {
    let result = match task.kind {
        Some(pb::task::Kind::List(_)) => list(&*store).await,
        Some(pb::task::Kind::Remove(r)) => remove(&*store, r).await,
        Some(_) => Err((
            ErrorKind::Unsupported,
            format!(
                "node agent on {} only lists and removes — send builds, pushes and inspections to a host agent",
                store.describe()
            ),
        )),
        None => Err((ErrorKind::Unsupported, "this agent does not know that kind of task — upgrade it".to_string())),
    };
    answer(&out, task.task_id, result).await;
}

async fn list(store: &dyn NodeStore) -> TaskResult {
    let images = store.list().await.map_err(|e| (ErrorKind::Failed, chain(&e)))?;
    Ok(listing(images))
}

async fn remove(store: &dyn NodeStore, r: pb::RemoveTask) -> TaskResult {
    let mut out = pb::Removed::default();
    // Every removal is tried: one failure is reported, never allowed to abandon the rest.
    for reference in r.references {
        match store.remove_ref(&reference).await {
            Ok(Removal::Removed) => out.removed.push(reference),
            Ok(Removal::Absent) => out.absent.push(reference),
            Err(err) => out.failed.push(format!("{reference}: {}", chain(&err))),
        }
    }
    confirm(store, &mut out).await;
    Ok(Outcome::Removed(out))
}

/// Moves every ref reported removed that the store still lists to `failed`.
async fn confirm(store: &dyn NodeStore, out: &mut pb::Removed) {
    if out.removed.is_empty() {
        return;
    }
    let images = match store.list().await {
        Ok(images) => images,
        // The coordinator re-lists after a sweep anyway; an unconfirmed answer is still an answer.
        Err(err) => {
            tracing::warn!(store = %store.describe(), error = %err, "could not re-list to confirm removals");
            return;
        }
    };
    // Removing by id (CRI) is confirmed by the id; by ref, by the ref alone — containerd's
    // `sha256:<id>` ref can be gone while the image stays under its other refs.
    let by_id = store.removal_mode() == RemovalMode::PerId;
    let still: HashSet<&str> = images
        .iter()
        .flat_map(|image| image.refs.iter().map(String::as_str).chain(by_id.then_some(image.id.as_str())))
        .collect();
    let (gone, back): (Vec<String>, Vec<String>) =
        std::mem::take(&mut out.removed).into_iter().partition(|reference| !still.contains(reference.as_str()));
    out.removed = gone;
    for reference in back {
        tracing::warn!(store = %store.describe(), %reference, "removed, yet listed again");
        out.failed.push(format!("{reference}: still listed after its removal — the next sweep retries it"));
    }
}
