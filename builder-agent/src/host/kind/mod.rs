//! Loading an image into a kind cluster without the `kind` binary: what `kind load docker-image`
//! does, done through the Docker Engine API.
//!
//! kind's nodes are containers on this host's daemon, labeled `io.x-k8s.kind.cluster=<name>`, each
//! running its own containerd. One `docker save` stream is read once and fanned out, chunk by
//! chunk, into a `ctr --namespace=k8s.io images import … -` exec in every node that lacks the
//! image — so memory holds a few chunks whatever the image's size, and the slowest node paces
//! the rest. A node that already names the image id under the ref is skipped (kind re-imports
//! every time, kind#2413); asking goes straight to the node's containerd ([`nodes`]) and costs a
//! millisecond, or, where that cannot be reached, two small `docker exec`s ([`exec`]).

mod exec;
mod nodes;

pub use nodes::KindNode;
pub(crate) use nodes::Reach;

use super::{DockerStore, HostError};

/// The label kind puts on every node container of a cluster.
pub const KIND_CLUSTER_LABEL: &str = "io.x-k8s.kind.cluster";

/// What a load did, by node container name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KindLoad {
    pub loaded: Vec<String>,
    pub skipped: Vec<String>,
}

impl DockerStore {
    /// Loads `reference` (image `id`) into every node of kind cluster `cluster` that lacks it
    /// under `name`: `reference` itself, or for one platform of a multi-platform image the content
    /// ref, which the nodes must hold in place of the platform ref `docker save` writes.
    pub(super) async fn load_into_kind(
        &self,
        cluster: &str,
        reference: &str,
        id: &str,
        name: &str,
    ) -> Result<KindLoad, HostError> {
        let nodes = self.kind_nodes_of(Some(cluster)).await?;
        if nodes.is_empty() {
            return Err(HostError::NoKindNodes { cluster: cluster.to_string() });
        }
        let normalize =
            |r: &str| kiln_core::refs::ImageRef::parse(r).map(|r| r.normalized()).unwrap_or_else(|_| r.to_string());
        let (saved, qualified) = (normalize(reference), normalize(name));
        let checks = futures_util::future::join_all(nodes.iter().map(|n| self.holds(n, &qualified, id))).await;
        let mut load = KindLoad::default();
        let mut lacking = Vec::new();
        for (node, held) in nodes.into_iter().zip(checks) {
            if held? {
                load.skipped.push(node.name);
            } else {
                lacking.push(node);
            }
        }
        if lacking.is_empty() {
            return Ok(load);
        }
        let names: Vec<String> = lacking.iter().map(|n| n.name.clone()).collect();
        self.stream_into(&names, reference).await?;
        if saved != qualified {
            // The archive names the image by the ref it was saved under; the nodes keep it under
            // `name` only, so no platform ref is left on a node for a sweep to wonder about.
            let renames = names.iter().map(|node| self.rename(node, &saved, &qualified));
            for renamed in futures_util::future::join_all(renames).await {
                renamed?;
            }
        }
        for node in &lacking {
            if !self.holds(node, &qualified, id).await? {
                return Err(HostError::KindImport {
                    node: node.name.clone(),
                    reference: name.to_string(),
                    why: format!("the import finished, yet the node does not name {id} under {qualified}"),
                });
            }
        }
        load.loaded = names;
        Ok(load)
    }

    /// Whether kind node `node` names image `id` under `qualified`: asked of its containerd when
    /// this agent reaches it, else through `docker exec ctr`.
    async fn holds(&self, node: &KindNode, qualified: &str, id: &str) -> Result<bool, HostError> {
        match &node.store {
            Ok(store) => store
                .holds(qualified, id)
                .await
                .map_err(|err| kind_error(&node.name, qualified, kiln_core::error_chain(&err))),
            Err(_) => self.exec_holds(&node.name, qualified, id).await,
        }
    }
}

fn kind_error(node: &str, reference: &str, why: String) -> HostError {
    HostError::KindImport { node: node.to_string(), reference: reference.to_string(), why }
}
