//! The `kind` target of a multi-platform image (issue 11): kind's node containers run on a host
//! agent's Docker daemon, so they run that daemon's platform — the agent's own. That platform is
//! built on that host and loaded into the nodes under the content ref; the set's other platforms
//! are built for the address and go nowhere. Which host runs a cluster's nodes comes from the
//! stores host agents announce (`kind:<node>@<agent>`, with the node's cluster).

use std::sync::Arc;

use super::decide::Decision;
use super::{Engine, Failure};
use crate::deliver::{self, DeliverError};
use crate::events::Events;
use crate::hub::AgentConn;
use crate::model::{ConvergeId, EventKind};
use crate::plan::UpPlan;

impl Engine {
    /// `kind`: each node container runs its host agent's platform; one outside the set fails the
    /// converge naming it, and so does a cluster no connected host agent reports.
    pub(super) fn check_kind_nodes(&self, plan: &UpPlan, cluster: &str) -> Result<(), Failure> {
        let carriers = kind_carriers(&self.hub.connected(), cluster);
        if carriers.is_empty() {
            return Err(Failure::whole(format!(
                "kind cluster {cluster}: no connected host agent reports a node container of it (label \
                 {KIND_LABEL}={cluster}) — create it on a host agent's Docker daemon (`kind create cluster --name \
                 {cluster}`), or wait for that agent to see it (it looks every 10 s)"
            )));
        }
        for (host, nodes) in carriers {
            if host.platforms.iter().any(|p| plan.platforms.contains(p)) {
                continue;
            }
            let runs = match host.platforms.is_empty() {
                true => "a platform its host agent did not announce".to_string(),
                false => host.platforms.join(", "),
            };
            return Err(Failure::whole(format!(
                "kind node {} of cluster {cluster} (on host agent {}) runs {runs}, which the platforms {} do not \
                 include — add it to `platforms` in kiln.toml",
                nodes.join(", "),
                host.id,
                plan.platforms.join(", ")
            )));
        }
        Ok(())
    }

    /// `kind`, one platform of a multi-platform image: when `host`'s daemon runs the cluster's
    /// node containers and they run `d.platform`, they load its platform image under the content
    /// ref; a platform no node runs goes nowhere.
    pub(super) async fn platform_to_kind(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        cluster: &str,
        d: &Decision<'_>,
        narrate: bool,
        events: &Events,
    ) -> Result<Vec<String>, DeliverError> {
        let content = d.index.unwrap_or(&d.image.reference);
        let (name, source) = (d.image.name.as_str(), d.image.reference.as_str());
        match kind_host(&self.hub.connected(), cluster, &d.platform) {
            Some(k) if k.id == host.id => {
                deliver::to_kind(host, id.as_str(), cluster, (source, content), name, narrate, events).await
            }
            // Built elsewhere (the build was required on the kind host, so only an agent that
            // reconnected under another id gets here): that daemon cannot reach the nodes.
            Some(k) => Err(DeliverError::Failed(format!(
                "{source} was built on host agent {}, but the node containers of kind cluster {cluster} run on host \
                 agent {}'s daemon — run `kiln up` again",
                host.id, k.id
            ))),
            None => {
                if narrate {
                    let words = format!("no kind node of {cluster} runs {}: {source} goes nowhere", d.platform);
                    events.emit(EventKind::Note, Some(name), words);
                }
                Ok(Vec::new())
            }
        }
    }
}

/// The label kind puts on every node container, named in a failure.
const KIND_LABEL: &str = "io.x-k8s.kind.cluster";

/// The connected host agents whose daemon runs node containers of kind cluster `cluster`, each
/// with those containers' names, as the agents last announced their stores.
fn kind_carriers(hosts: &[Arc<AgentConn>], cluster: &str) -> Vec<(Arc<AgentConn>, Vec<String>)> {
    let mut carriers = Vec::new();
    for host in hosts.iter().filter(|a| a.is_host()) {
        let suffix = format!("@{}", host.id);
        let nodes: Vec<String> = host
            .stores()
            .iter()
            .filter(|s| s.kind == kiln_proto::v1::store_info::Kind::Node as i32 && s.cluster == cluster)
            .map(|s| {
                let id = s.id.as_str();
                id.strip_prefix("kind:").and_then(|n| n.strip_suffix(&suffix)).unwrap_or(id).to_string()
            })
            .collect();
        if !nodes.is_empty() {
            carriers.push((host.clone(), nodes));
        }
    }
    carriers
}

/// The host agent whose daemon runs node containers of kind cluster `cluster` of platform
/// `platform` (its own native platform), if any.
pub(super) fn kind_host(hosts: &[Arc<AgentConn>], cluster: &str, platform: &str) -> Option<Arc<AgentConn>> {
    kind_carriers(hosts, cluster).into_iter().map(|(h, _)| h).find(|h| h.platforms.iter().any(|p| p == platform))
}
