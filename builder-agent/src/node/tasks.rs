//! The tasks a node agent executes for the coordinator: list its store (with the images its
//! containers use), import an image relayed from a host agent, remove refs (or, CRI-only, whole
//! ids) from it. Like the host's tasks, each answers exactly once, and a failure is an answer
//! naming what failed.
//!
//! A removal batch is confirmed by listing the store again before answering: a ref containerd
//! accepted the removal of can be back a moment later (the CRI plugin re-creates a ref it was
//! labeling), and a CRI removal can leave the image behind. The coordinator is told what the
//! store now holds, not what the calls returned.

use super::{ImportSpec, NodeStore, Removal, RemovalMode};
use crate::tasks::{answer, listing, refuse, TaskResult};
use kiln_core::error_chain as chain;
use kiln_proto::v1 as pb;
use pb::task_error::Kind as ErrorKind;
use pb::task_result::Outcome;
use std::collections::HashSet;
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tracing::Instrument;

/// What a node agent's tasks share: the store, and the coordinator's relay imports come from.
pub(crate) struct NodeContext {
    pub store: Arc<dyn NodeStore>,
    /// The id the store is announced by (`containerd@AGENT`, `cri@AGENT`), for its metrics.
    pub store_id: String,
    pub relay: pb::image_relay_client::ImageRelayClient<Channel>,
    pub out: mpsc::Sender<pb::AgentMessage>,
    pub metrics: Arc<crate::metrics::AgentMetrics>,
}

pub(crate) async fn execute(ctx: Arc<NodeContext>, task: pb::Task) {
    let span = crate::tasks::span(&task);
    run(ctx, task).instrument(span).await
}

async fn run(ctx: Arc<NodeContext>, task: pb::Task) {
    let store = &*ctx.store;
    let result = match task.kind {
        Some(pb::task::Kind::List(l)) => list(store, l).await,
        Some(pb::task::Kind::Remove(r)) => remove(store, r).await,
        Some(pb::task::Kind::Import(i)) => import(&ctx, i).await,
        Some(_) => refuse((
            ErrorKind::Unsupported,
            format!(
                "node agent on {} only lists, imports and removes — send builds, pushes, exports and inspections to a host agent",
                store.describe()
            ),
        )),
        None => refuse((ErrorKind::Unsupported, "this agent does not know that kind of task — upgrade it".to_string())),
    };
    if let Ok(outcome) = &result {
        ctx.metrics.answered(&ctx.store_id, outcome);
    }
    answer(&ctx.out, task.task_id, result).await;
}

pub(crate) async fn list(store: &dyn NodeStore, l: pb::ListTask) -> TaskResult {
    // Containers first: an image a container starts using between the two reads is then listed
    // and kept, rather than seen unused.
    let in_use = match l.workloads {
        true => store.workload_images().await.map_err(|e| (ErrorKind::Failed, chain(&e)))?,
        false => Vec::new(),
    };
    let images = store.list().await.map_err(|e| (ErrorKind::Failed, chain(&e)))?;
    let Outcome::Listing(mut out) = listing(images) else { unreachable!("listing() builds a listing") };
    out.in_use = in_use;
    out.workloads_listed = l.workloads;
    out.removes_whole_ids = store.removal_mode() == RemovalMode::PerId;
    Ok(Outcome::Listing(out))
}

/// Points the ref at the image, pulling the archive from the relay unless the node already holds
/// the id under that ref; an import without a relay key only answers whether it does.
async fn import(ctx: &NodeContext, i: pb::ImportTask) -> TaskResult {
    use futures_util::StreamExt;
    let store = &*ctx.store;
    let held = store.holds(&i.reference, &i.image_id).await.map_err(|e| (ErrorKind::Failed, chain(&e)))?;
    if held || i.relay_key.is_empty() {
        return Ok(Outcome::Imported(pb::Imported { skipped: held, bytes: 0 }));
    }
    let request = pb::RelayGetRequest { key: i.relay_key.clone() };
    let chunks = ctx.relay.clone().get(crate::tasks::traced(request)).await.map_err(|s| {
        (ErrorKind::Failed, format!("the coordinator's relay has no archive for {}: {}", i.reference, s.message()))
    })?;
    let body = chunks
        .into_inner()
        .map(|chunk| chunk.map(|c| c.data).map_err(|s| std::io::Error::other(s.message().to_string())))
        .boxed();
    let spec = ImportSpec { reference: i.reference.clone(), id: i.image_id.clone() };
    let imported = store.import(body, &spec).await.map_err(|e| (ErrorKind::Failed, chain(&e)))?;
    Ok(Outcome::Imported(pb::Imported { skipped: false, bytes: imported.bytes }))
}

pub(crate) async fn remove(store: &dyn NodeStore, r: pb::RemoveTask) -> TaskResult {
    let mut out = pb::Removed::default();
    // Every removal is tried: one failure is reported, never allowed to abandon the rest.
    for reference in r.references {
        match store.remove_ref(&reference).await {
            Ok(Removal::Removed) => out.removed.push(reference),
            Ok(Removal::Absent) => out.absent.push(reference),
            Err(err) => failure(&mut out, reference, chain(&err)),
        }
    }
    // Whole ids: a nameless image, or on a CRI-only node an image every name of which is garbage
    // (the CRI removes an image by id with all its names).
    for id in r.image_ids {
        match store.remove_ref(&id).await {
            Ok(Removal::Removed) => out.removed.push(id),
            Ok(Removal::Absent) => out.absent.push(id),
            Err(err) => failure(&mut out, id, chain(&err)),
        }
    }
    confirm(store, &mut out).await;
    Ok(Outcome::Removed(out))
}

fn failure(out: &mut pb::Removed, reference: String, reason: String) {
    out.failed.push(format!("{reference}: {reason}"));
    out.failures.push(pb::RemovalFailure { reference, reason });
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
        failure(out, reference, "still listed after its removal — the next sweep retries it".to_string());
    }
}
