//! A cluster's platform set (`platforms = "cluster"`, or no `platforms` with a kind or nodes
//! target): the union of its nodes' platforms, as the coordinator sees them now — each node
//! agent's hello for `nodes`, the host agents whose daemon runs the kind cluster's node containers
//! for `kind` (a node container runs its daemon's platform), and, when the coordinator runs with
//! `--kubernetes`, the Node objects' reported architecture. The CLI asks before it addresses, so
//! `kiln refs` and `kiln up` name the same set; when the set moves, the content tag moves with it
//! and the converge says "platforms changed".

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kiln_proto::v1 as pb;

use crate::engine::Engine;
use crate::model::AgentRole;

/// How long an ask about a kind cluster waits for a first agent when none is connected (an
/// embedded coordinator whose agent is still saying hello).
const FIRST_AGENT_WAIT: Duration = Duration::from_secs(5);

/// Why the set could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("target kind {kind:?} has no cluster — ask for a kind or nodes target's cluster")]
    NoCluster { kind: String },
    #[error(transparent)]
    Kube(#[from] crate::kube::KubeError),
}

impl From<ClusterError> for tonic::Status {
    fn from(err: ClusterError) -> tonic::Status {
        match err {
            ClusterError::NoCluster { .. } => tonic::Status::invalid_argument(err.to_string()),
            ClusterError::Kube(_) => tonic::Status::unavailable(kiln_core::error_chain(&err)),
        }
    }
}

/// The platforms of `cluster` (a `kind` or `nodes` target), sorted, and where each came from.
pub async fn platforms(engine: &Engine, kind: &str, cluster: &str) -> Result<pb::ClusterPlatformsReply, ClusterError> {
    if kind != "nodes" && kind != "kind" {
        return Err(ClusterError::NoCluster { kind: kind.to_string() });
    }
    // Only a kind cluster's set is read off a host agent, which an embedded `kiln` starts beside
    // its coordinator; node agents are elsewhere, and waiting for them would only delay.
    let deadline = Instant::now() + FIRST_AGENT_WAIT;
    while kind == "kind" && engine.hub.connected().is_empty() && Instant::now() < deadline {
        engine.hub.changed(deadline - Instant::now()).await;
    }
    let mut found: BTreeSet<(String, String)> = BTreeSet::new();
    for agent in engine.hub.connected() {
        let runs_it = match kind {
            "nodes" => agent.role == AgentRole::Node && agent.cluster == cluster,
            _ => {
                agent.is_host()
                    && agent
                        .stores()
                        .iter()
                        .any(|s| s.kind == pb::store_info::Kind::Node as i32 && s.cluster == cluster)
            }
        };
        if runs_it {
            let what = if kind == "nodes" { "node agent" } else { "kind node containers on host agent" };
            for platform in &agent.platforms {
                found.insert((platform.clone(), format!("{what} {}: {platform}", agent.id)));
            }
        }
    }
    if let Some(kube) = &engine.config.kubernetes {
        for (node, platform) in crate::kube::node_platforms(&kube.client).await? {
            found.insert((platform.clone(), format!("Kubernetes node {node}: {platform}")));
        }
    }
    let platforms: BTreeSet<String> = found.iter().map(|(p, _)| p.clone()).collect();
    Ok(pb::ClusterPlatformsReply {
        platforms: platforms.into_iter().collect(),
        sources: found.into_iter().map(|(_, source)| source).collect(),
    })
}
