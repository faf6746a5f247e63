//! Delivery to cluster nodes (DESIGN.md "The converge", step 6), for the `nodes` and `kind`
//! targets.
//!
//! `nodes`: every node agent announcing the target's cluster is asked first whether it already
//! holds the image id under the ref; only if some node lacks it does the host agent export the
//! image — once — to the coordinator's relay, from which the lacking nodes import it in parallel.
//! Agents only dial out, so the coordinator is the one place both can reach. The spool is deleted
//! when the delivery ends, whatever its outcome. A node that cannot take the image fails the
//! converge, named.
//!
//! `kind`: the host agent does it all (the node containers live on its Docker daemon): it finds
//! them by kind's labels and streams one `docker save` into each node's `ctr import`. One platform
//! of a multi-platform image is saved under its platform ref and named on the nodes by the
//! content ref, as a node agent names it.

use crate::events::Events;
use crate::hub::{AgentConn, Hub};
use crate::model::{AgentRole, EventKind};
use crate::relay::Relay;
use crate::task::{FailureKind, Task, TaskFailure, TaskOutcome};
use std::sync::Arc;
use tokio::task::JoinSet;
use tracing::Instrument;

/// Why a delivery did not happen.
#[derive(Debug)]
pub(crate) enum DeliverError {
    /// The ref left the host before it could be exported: the converge rebuilds it.
    Gone(String),
    /// Anything else, as a sentence naming the node, cluster or agent.
    Failed(String),
}

impl From<TaskFailure> for DeliverError {
    fn from(err: TaskFailure) -> DeliverError {
        match err {
            TaskFailure::Failed { kind: FailureKind::ImageGone, message, .. } => DeliverError::Gone(message),
            other => DeliverError::Failed(other.to_string()),
        }
    }
}

/// The node agents of `cluster`, in id order.
pub(crate) fn cluster_nodes(hub: &Hub, cluster: &str) -> Vec<Arc<AgentConn>> {
    hub.connected().into_iter().filter(|a| a.role == AgentRole::Node && a.cluster == cluster).collect()
}

/// What one image's delivery to a `nodes` cluster did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct NodesDelivered {
    /// Nodes that imported it.
    pub imported: Vec<String>,
    /// Nodes that already held the id under the ref.
    pub skipped: Vec<String>,
    /// The bytes the host exported for the nodes that lacked it (once, however many imported).
    pub bytes: u64,
}

/// Delivers `reference` from `host` to every node agent of `cluster`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn to_nodes(
    hub: &Hub,
    relay: &Relay,
    host: &AgentConn,
    converge: &str,
    cluster: &str,
    reference: &str,
    name: &str,
    narrate: bool,
    events: &Events,
) -> Result<NodesDelivered, DeliverError> {
    let nodes = cluster_nodes(hub, cluster);
    if nodes.is_empty() {
        return Err(no_nodes(cluster));
    }
    let to = Nodes { nodes: &nodes, cluster, source: reference, reference };
    deliver_to(relay, host, converge, to, name, narrate, events).await
}

pub(crate) fn no_nodes(cluster: &str) -> DeliverError {
    DeliverError::Failed(format!(
        "no node agent of cluster `{cluster}` is connected — run `kiln-agent --role node --cluster {cluster}` on each of its nodes"
    ))
}

/// Where a delivery to node agents goes: `nodes` of `cluster` get the host's image `source` under
/// `reference` — the same ref, or for one platform of a multi-platform image its platform ref on
/// the host and the content ref on the nodes.
pub(crate) struct Nodes<'a> {
    pub nodes: &'a [Arc<AgentConn>],
    pub cluster: &'a str,
    pub source: &'a str,
    pub reference: &'a str,
}

/// Delivers to the nodes `to` names: asks each first, exports once for those that lack it.
pub(crate) async fn deliver_to(
    relay: &Relay,
    host: &AgentConn,
    converge: &str,
    to: Nodes<'_>,
    name: &str,
    narrate: bool,
    events: &Events,
) -> Result<NodesDelivered, DeliverError> {
    let Nodes { nodes, cluster, source, reference } = to;
    let id = host_image_id(host, converge, source).await?;

    // Ask first: a cluster that holds the image already costs one small task per node, no export.
    let answers = on_nodes(nodes, converge, reference, &id, None).await;
    let mut done = NodesDelivered::default();
    let mut lacking = Vec::new();
    let mut failures = Vec::new();
    for (node, answer) in nodes.iter().zip(answers) {
        match answer {
            Ok(true) => done.skipped.push(node.id.clone()),
            Ok(false) => lacking.push(node.clone()),
            Err(why) => failures.push(format!("node {}: {why}", node.id)),
        }
    }
    if !failures.is_empty() {
        return Err(failed_on(reference, cluster, failures));
    }
    if lacking.is_empty() {
        if narrate {
            events.emit(EventKind::Delivered, Some(name), format!("every node of {cluster} already holds {reference}"));
        }
        return Ok(done);
    }

    let key = relay_key(&id, converge);
    relay.expect(&key);
    let result = export_and_import(host, relay, &lacking, converge, (source, reference), &id, &key, events, name).await;
    relay.discard(&key).await;
    let (bytes, answers) = result?;
    done.bytes = bytes;
    for (node, answer) in lacking.iter().zip(answers) {
        match answer {
            Ok(_) => done.imported.push(node.id.clone()),
            Err(why) => failures.push(format!("node {}: {why}", node.id)),
        }
    }
    if !failures.is_empty() {
        return Err(failed_on(reference, cluster, failures));
    }
    let skipped = match done.skipped.len() {
        0 => String::new(),
        n => format!(" ({n} already held it)"),
    };
    events.emit(
        EventKind::Delivered,
        Some(name),
        format!("{reference} to {} node(s) of {cluster}{skipped}", done.imported.len()),
    );
    Ok(done)
}

fn failed_on(reference: &str, cluster: &str, failures: Vec<String>) -> DeliverError {
    DeliverError::Failed(format!("{reference} could not be delivered to cluster {cluster}: {}", failures.join("; ")))
}

/// A spool name per image and converge: two converges delivering the same image never share one.
fn relay_key(id: &str, converge: &str) -> String {
    let clean = |s: &str| s.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').collect::<String>();
    format!("{}-{}", clean(id.trim_start_matches("sha256:")), clean(converge))
}

/// Exports once and imports on every lacking node at the same time: the nodes read the relay's
/// spool while the host still writes it. An export that fails ends the readers with its reason,
/// and is the failure reported, since every import failed only because of it. Returns the bytes
/// exported and each lacking node's answer.
#[allow(clippy::too_many_arguments)]
async fn export_and_import(
    host: &AgentConn,
    relay: &Relay,
    lacking: &[Arc<AgentConn>],
    converge: &str,
    (source, reference): (&str, &str),
    id: &str,
    key: &str,
    events: &Events,
    name: &str,
) -> Result<(u64, Vec<Result<bool, String>>), DeliverError> {
    events.emit(EventKind::Pushing, Some(name), format!("exporting {source} from {}", host.id));
    let export = Task::Export { reference: source.into(), image_id: id.to_string(), relay_key: key.to_string() };
    let exporting = async {
        let exported = host.run(converge, export, |_| {}).await;
        match &exported {
            Ok(TaskOutcome::Exported { .. }) => {}
            Ok(_) => relay.fail(key, "the host answered the export with something else"),
            Err(err) => relay.fail(key, &err.to_string()),
        }
        exported
    };
    let importing = on_nodes(lacking, converge, reference, id, Some(key));
    let (exported, answers) = tokio::join!(exporting, importing);
    let bytes = match exported? {
        TaskOutcome::Exported { bytes } => bytes,
        _ => return Err(DeliverError::Failed(format!("host {} answered the export with something else", host.id))),
    };
    events.emit(EventKind::Pushed { bytes }, Some(name), format!("to {} node(s)", lacking.len()));
    Ok((bytes, answers))
}

/// Imports image `id` as `reference` on every node in parallel, from the relay's `key` (`None`:
/// only asks whether each holds it); per node: whether it skipped (already held), or why it
/// failed. Answers come back in `nodes`' order.
async fn on_nodes(
    nodes: &[Arc<AgentConn>],
    converge: &str,
    reference: &str,
    id: &str,
    key: Option<&str>,
) -> Vec<Result<bool, String>> {
    let mut set = JoinSet::new();
    for (i, node) in nodes.iter().enumerate() {
        let task =
            Task::Import { reference: reference.into(), image_id: id.into(), relay_key: key.map(str::to_string) };
        let (node, converge) = (node.clone(), converge.to_string());
        // In the delivery's span: a spawned task starts outside it.
        let importing = async move {
            let answer = match node.run(&converge, task, |_| {}).await {
                Ok(TaskOutcome::Imported { skipped, .. }) => Ok(skipped),
                Ok(_) => Err("answered the import with something else (an older agent?)".to_string()),
                Err(TaskFailure::Failed { message, .. }) => Err(message),
                Err(err) => Err(err.to_string()),
            };
            (i, answer)
        };
        set.spawn(importing.in_current_span());
    }
    let mut out: Vec<Result<bool, String>> = vec![Err("never answered".to_string()); nodes.len()];
    while let Some(joined) = set.join_next().await {
        if let Ok((i, answer)) = joined {
            out[i] = answer;
        }
    }
    out
}

/// Delivers `reference` from `host` into the node containers of kind cluster `cluster`, which run
/// on that host's daemon; the nodes hold it under `import_as` — the content ref of a
/// multi-platform image whose platform ref on the host is `reference` — or `reference` itself.
pub(crate) async fn to_kind(
    host: &AgentConn,
    converge: &str,
    cluster: &str,
    (reference, import_as): (&str, &str),
    name: &str,
    narrate: bool,
    events: &Events,
) -> Result<Vec<String>, DeliverError> {
    let id = host_image_id(host, converge, reference).await?;
    let task = Task::KindLoad {
        reference: reference.into(),
        image_id: id,
        cluster: cluster.into(),
        import_as: if import_as == reference { String::new() } else { import_as.into() },
    };
    let (loaded, skipped) = match host.run(converge, task, |_| {}).await? {
        TaskOutcome::KindLoaded { loaded, skipped } => (loaded, skipped),
        _ => return Err(DeliverError::Failed(format!("host {} answered the kind load with something else", host.id))),
    };
    let message = match (loaded.len(), skipped.len()) {
        (0, _) => format!("every node of kind cluster {cluster} already holds {import_as}"),
        (n, 0) => format!("{import_as} to {n} node(s) of kind cluster {cluster}"),
        (n, s) => format!("{import_as} to {n} node(s) of kind cluster {cluster} ({s} already held it)"),
    };
    if narrate || !loaded.is_empty() {
        events.emit(EventKind::Delivered, Some(name), message);
    }
    Ok(loaded)
}

/// The id of the image `reference` names on `host`; gone is a reason to rebuild.
async fn host_image_id(host: &AgentConn, converge: &str, reference: &str) -> Result<String, DeliverError> {
    let inspect = Task::Inspect { reference: reference.into() };
    match host.run(converge, inspect, |_| {}).await? {
        TaskOutcome::Inspected(Some(image)) => Ok(image.id),
        TaskOutcome::Inspected(None) => {
            Err(DeliverError::Gone(format!("{reference} left host {} before its delivery", host.id)))
        }
        _ => Err(DeliverError::Failed(format!("host {} answered the inspect with something else", host.id))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_keys_differ_per_converge_and_fit_the_relay_alphabet() {
        let id = "sha256:0123abcd";
        let (a, b) = (relay_key(id, "c-1"), relay_key(id, "c-2"));
        assert_ne!(a, b, "two converges delivering one image never share a spool file");
        assert_eq!(a, "0123abcd-c-1");
        assert!(relay_key(id, "../evil/").chars().all(|c| c.is_ascii_alphanumeric() || c == '-'));
    }
}
