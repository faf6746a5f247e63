//! The cluster's platform set as Kubernetes states it: every Node object's
//! `status.nodeInfo.operatingSystem`/`architecture` (what the kubelet reports), for a manifest
//! whose platforms come from the cluster (`platforms = "cluster"`).

use ::kube::api::{Api, ListParams};
use ::kube::Client;
use k8s_openapi::api::core::v1::Node;

use super::KubeError;

/// `(node name, platform in OCI form)` for every Node whose kubelet reported its platform.
pub async fn node_platforms(client: &Client) -> Result<Vec<(String, String)>, KubeError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let listed = nodes.list(&ListParams::default()).await.map_err(KubeError::Nodes)?;
    Ok(listed
        .items
        .into_iter()
        .filter_map(|node| {
            let info = node.status?.node_info?;
            let name = node.metadata.name.unwrap_or_default();
            let os = if info.operating_system.is_empty() { "linux".to_string() } else { info.operating_system };
            let platform = kiln_core::refs::Platform::parse(&format!("{os}/{}", info.architecture)).ok()?;
            Some((name, platform.oci()))
        })
        .collect())
}
