//! The stores a host agent announces and serves: its Docker daemon, and the containerd of every
//! kind node container on that daemon. Kind nodes come and go while the agent stays connected, so
//! the list is taken again every [`REFRESH`] and after every kind load, and a changed list is sent
//! to the coordinator as a `Stores` message — a sweep that starts before a new node is announced
//! merely leaves that node for the next one, which is the safe side.

use crate::host::{HostStore, KindNode};
use crate::node::NodeStore;
use crate::tasks::TaskContext;
use kiln_proto::v1 as pb;
use pb::task_error::Kind as ErrorKind;
use std::sync::Arc;
use std::time::Duration;

/// How often a host agent looks for kind nodes that started or went away.
pub(crate) const REFRESH: Duration = Duration::from_secs(10);

/// The id a host agent's Docker store is announced and addressed by.
pub(crate) fn host_store_id(agent_id: &str) -> String {
    format!("docker@{agent_id}")
}

/// The id of kind node container `node`'s containerd, as the host agent `agent_id` serves it.
pub fn kind_store_id(agent_id: &str, node: &str) -> String {
    format!("kind:{node}@{agent_id}")
}

/// The host store first, then one node store per kind node container, by name. A daemon that
/// cannot list its containers right now yields the host store alone.
pub(crate) async fn host_stores(agent_id: &str, store: &dyn HostStore) -> Vec<pb::StoreInfo> {
    let host =
        pb::StoreInfo { id: host_store_id(agent_id), kind: pb::store_info::Kind::Host as i32, cluster: String::new() };
    let nodes = store.kind_nodes().await.unwrap_or_else(|err| {
        tracing::warn!(agent = %agent_id, error = %kiln_core::error_chain(&err), "cannot list kind nodes");
        Vec::new()
    });
    std::iter::once(host).chain(nodes.iter().map(|n| kind_info(agent_id, n))).collect()
}

fn kind_info(agent_id: &str, node: &KindNode) -> pb::StoreInfo {
    pb::StoreInfo {
        id: kind_store_id(agent_id, &node.name),
        kind: pb::store_info::Kind::Node as i32,
        cluster: node.cluster.clone(),
    }
}

/// Takes the list again and, when it changed, tells the coordinator.
pub(crate) async fn announce(ctx: &TaskContext) {
    let now = host_stores(&ctx.agent_id, &*ctx.store).await;
    {
        let mut announced = ctx.announced.lock().unwrap();
        if *announced == now {
            return;
        }
        *announced = now.clone();
    }
    let body = pb::agent_message::Body::Stores(pb::Stores { stores: now });
    let _ = ctx.out.send(pb::AgentMessage { body: Some(body) }).await;
}

/// The store a task names.
pub(crate) enum Target {
    /// The agent's Docker daemon (also what an empty store names).
    Host,
    /// A kind node container's containerd.
    Kind(Arc<dyn NodeStore>),
}

/// Resolves a task's store. A store this agent does not hold is refused, never run against the
/// Docker daemon: removals meant for a node must not reach the build host.
pub(crate) async fn resolve(ctx: &TaskContext, store: &str) -> Result<Target, (ErrorKind, String)> {
    if store.is_empty() || store == host_store_id(&ctx.agent_id) {
        return Ok(Target::Host);
    }
    let refused = || (ErrorKind::Unsupported, format!("agent {} does not hold store {store}", ctx.agent_id));
    let Some(node) = store.strip_prefix("kind:").and_then(|s| s.strip_suffix(&format!("@{}", ctx.agent_id))) else {
        return Err(refused());
    };
    let nodes = ctx.store.kind_nodes().await.map_err(|e| (ErrorKind::Failed, kiln_core::error_chain(&e)))?;
    match nodes.into_iter().find(|n| n.name == node) {
        Some(KindNode { store: Ok(store), .. }) => Ok(Target::Kind(store)),
        Some(KindNode { store: Err(why), .. }) => Err((ErrorKind::Failed, why)),
        None => Err((ErrorKind::Failed, format!("kind node {node} no longer runs on this Docker daemon"))),
    }
}
