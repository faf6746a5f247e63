//! Finding kind's node containers on this daemon and reaching the containerd inside each one.
//!
//! A node container's containerd listens on `/run/containerd/containerd.sock` inside the container.
//! An agent running as root on the daemon's own machine reaches that socket through the kernel's
//! view of the container's root, `/proc/<pid>/root/…` — no `docker exec`, no socat, no port. Over
//! it the agent speaks containerd's gRPC API exactly as a node agent does ([`ContainerdStore`]),
//! so a kind node is listed, swept and asked "do you hold this image?" in a millisecond or two,
//! where each `docker exec` costs a hundred.
//!
//! Where the path cannot be reached (the daemon is remote, or the agent is not root, or runs in its
//! own PID namespace), the node is still reported, with the reason, so a sweep can say why it
//! skipped it and a load can fall back to `docker exec ctr`.

use crate::host::{DockerStore, HostError, KIND_CLUSTER_LABEL};
use crate::node::{ContainerdStore, NodeStore, K8S_NAMESPACE};
use bollard::query_parameters::ListContainersOptionsBuilder;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Where a kind node's containerd listens, inside its container.
const NODE_SOCKET: &str = "run/containerd/containerd.sock";

/// One kind node container on this daemon.
#[derive(Clone)]
pub struct KindNode {
    /// The container's name (`dev-control-plane`), which kind makes unique per daemon.
    pub name: String,
    /// The kind cluster it belongs to, from its `io.x-k8s.kind.cluster` label.
    pub cluster: String,
    /// Its containerd in namespace `k8s.io`, or why this agent cannot reach it.
    pub store: Result<Arc<dyn NodeStore>, String>,
}

impl std::fmt::Debug for KindNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let store = self.store.as_ref().map(|s| s.describe());
        f.debug_struct("KindNode")
            .field("name", &self.name)
            .field("cluster", &self.cluster)
            .field("store", &store)
            .finish()
    }
}

/// Connections to node containerds, by container id, with the pid they were made through: a
/// restarted container has a new pid (and a new containerd), so its old connection is dropped.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reach {
    conns: Arc<Mutex<HashMap<String, (i64, ContainerdStore)>>>,
}

impl DockerStore {
    /// Every running kind node container on this daemon (of cluster `only`, when given), sorted by
    /// name, each with its containerd reached through `/proc`.
    pub async fn kind_nodes_of(&self, only: Option<&str>) -> Result<Vec<KindNode>, HostError> {
        let label = match only {
            Some(cluster) => format!("{KIND_CLUSTER_LABEL}={cluster}"),
            None => KIND_CLUSTER_LABEL.to_string(),
        };
        let filters = HashMap::from([("label".to_string(), vec![label])]);
        let options = ListContainersOptionsBuilder::default().filters(&filters).build();
        let containers = self
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|err| self.daemon_error("list containers", only.unwrap_or("of kind clusters"), err))?;
        let found: Vec<(String, String, String)> = containers
            .into_iter()
            .filter_map(|c| {
                let name = c.names?.into_iter().next()?.trim_start_matches('/').to_string();
                let cluster = c.labels.and_then(|mut l| l.remove(KIND_CLUSTER_LABEL)).unwrap_or_default();
                Some((c.id?, name, cluster))
            })
            .collect();
        if only.is_none() {
            // Every node was listed: connections to containers that are gone can go too.
            self.kind_reach.conns.lock().unwrap().retain(|id, _| found.iter().any(|(known, ..)| known == id));
        }
        let mut nodes = futures_util::future::join_all(found.into_iter().map(|(id, name, cluster)| async move {
            let store = self.reach(&id, &name).await;
            KindNode { name, cluster, store }
        }))
        .await;
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(nodes)
    }

    /// The containerd of node container `id`, connected once per container start.
    async fn reach(&self, id: &str, name: &str) -> Result<Arc<dyn NodeStore>, String> {
        let inspected = self
            .docker
            .inspect_container(id, None)
            .await
            .map_err(|err| kiln_core::error_chain(&self.daemon_error("inspect container", name, err)))?;
        let pid = inspected.state.and_then(|s| s.pid).filter(|pid| *pid > 0);
        let Some(pid) = pid else {
            return Err(format!("kind node {name} is not running"));
        };
        if let Some((known, store)) = self.kind_reach.conns.lock().unwrap().get(id) {
            if *known == pid {
                return Ok(Arc::new(store.clone()));
            }
        }
        // A pid the daemon reports is only this machine's pid when the daemon runs here and the agent
        // shares its PID namespace; otherwise `/proc/<pid>` is some other process, and its socket
        // some other containerd. So: a local daemon only, and the root must be the node's own.
        if !self.host().starts_with("unix://") {
            return Err(format!(
                "the Docker daemon at {} is not on this machine, so kind node {name}'s containerd is out of the                  agent's reach — run a host agent on that machine",
                self.host()
            ));
        }
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let hostname = inspected.config.and_then(|c| c.hostname).unwrap_or_default();
        let seen = std::fs::read_to_string(root.join("etc/hostname")).unwrap_or_default();
        if hostname.is_empty() || seen.trim() != hostname {
            return Err(format!(
                "kind node {name} runs as pid {pid} by the daemon's count, but /proc/{pid} here is not that                  container (its hostname reads {:?}, not {hostname:?}) — the agent must share the daemon's PID                  namespace, as root on the daemon's machine",
                seen.trim()
            ));
        }
        let socket = root.join(NODE_SOCKET);
        let store = ContainerdStore::connect(&socket, K8S_NAMESPACE).await.map_err(|err| {
            format!(
                "cannot reach the containerd of kind node {name} at {}: {} — the agent reaches it only as root on \
                 the Docker daemon's own machine",
                socket.display(),
                kiln_core::error_chain(&err)
            )
        })?;
        self.kind_reach.conns.lock().unwrap().insert(id.to_string(), (pid, store.clone()));
        Ok(Arc::new(store))
    }
}
