//! Loading an image into a kind cluster without the `kind` binary: what `kind load docker-image`
//! does, done through the Docker Engine API.
//!
//! kind's nodes are containers on this host's daemon, labeled `io.x-k8s.kind.cluster=<name>`, each
//! running its own containerd. One `docker save` stream is read once and fanned out, chunk by
//! chunk, into a `ctr --namespace=k8s.io images import … -` exec in every node that lacks the
//! image — so memory holds a few chunks whatever the image's size, and the slowest node paces
//! the rest. A node that already names the image id under the ref is skipped: asking costs two
//! tiny execs, where kind re-imports every time (kind#2413).

use super::{DockerStore, HostError};
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::query_parameters::ListContainersOptionsBuilder;
use bytes::Bytes;
use futures_util::StreamExt;
use std::collections::HashMap;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// The label kind puts on every node container of a cluster.
pub const KIND_CLUSTER_LABEL: &str = "io.x-k8s.kind.cluster";

/// The import kind itself runs on a node (so the same refs appear: the named one and
/// `import-<date>@sha256:…`).
const IMPORT: [&str; 8] =
    ["ctr", "--namespace=k8s.io", "images", "import", "--all-platforms", "--digests", "--snapshotter=overlayfs", "-"];

/// What a load did, by node container name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KindLoad {
    pub loaded: Vec<String>,
    pub skipped: Vec<String>,
}

impl DockerStore {
    /// The running node containers of kind cluster `cluster`, by name, sorted.
    pub async fn kind_nodes(&self, cluster: &str) -> Result<Vec<String>, HostError> {
        let filters = HashMap::from([("label".to_string(), vec![format!("{KIND_CLUSTER_LABEL}={cluster}")])]);
        let options = ListContainersOptionsBuilder::default().filters(&filters).build();
        let containers = self
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|err| self.daemon_error("list containers", cluster, err))?;
        let mut names: Vec<String> = containers
            .into_iter()
            .filter_map(|c| c.names.and_then(|n| n.into_iter().next()))
            .map(|n| n.trim_start_matches('/').to_string())
            .collect();
        names.sort();
        Ok(names)
    }

    /// Loads `reference` (image `id`) into every node of kind cluster `cluster` that lacks it.
    pub(super) async fn load_into_kind(&self, cluster: &str, reference: &str, id: &str) -> Result<KindLoad, HostError> {
        let nodes = self.kind_nodes(cluster).await?;
        if nodes.is_empty() {
            return Err(HostError::NoKindNodes { cluster: cluster.to_string() });
        }
        let qualified = kiln_core::refs::ImageRef::parse(reference)
            .map(|r| r.normalized())
            .unwrap_or_else(|_| reference.to_string());
        let checks = futures_util::future::join_all(nodes.iter().map(|n| self.node_holds(n, &qualified, id))).await;
        let mut load = KindLoad::default();
        let mut lacking = Vec::new();
        for (node, held) in nodes.into_iter().zip(checks) {
            if held? {
                load.skipped.push(node);
            } else {
                lacking.push(node);
            }
        }
        if lacking.is_empty() {
            return Ok(load);
        }
        self.stream_into(&lacking, reference).await?;
        for node in &lacking {
            if !self.node_holds(node, &qualified, id).await? {
                return Err(HostError::KindImport {
                    node: node.clone(),
                    reference: reference.to_string(),
                    why: format!("the import finished, yet the node does not name {id} under {qualified}"),
                });
            }
        }
        load.loaded = lacking;
        Ok(load)
    }

    /// Whether kind node `node` names image `id` under `qualified`: the ref's manifest's config.
    async fn node_holds(&self, node: &str, qualified: &str, id: &str) -> Result<bool, HostError> {
        let filter = format!("name=={qualified}");
        let (code, out, err) = self.exec(node, &["ctr", "--namespace=k8s.io", "images", "ls", &filter], None).await?;
        if code != 0 {
            return Err(kind_error(node, qualified, format!("`ctr images ls` exited {code}: {err}")));
        }
        // REF TYPE DIGEST SIZE PLATFORMS LABELS; no row when the ref is absent.
        let Some(digest) = out.lines().skip(1).find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.first() == Some(&qualified)).then(|| cols.get(2).map(|d| d.to_string())).flatten()
        }) else {
            return Ok(false);
        };
        let (code, out, err) = self.exec(node, &["ctr", "--namespace=k8s.io", "content", "get", &digest], None).await?;
        if code != 0 {
            return Err(kind_error(node, qualified, format!("`ctr content get {digest}` exited {code}: {err}")));
        }
        let manifest: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
        let config = manifest.pointer("/config/digest").and_then(|d| d.as_str());
        // An index (multi-platform import) is not what Kiln delivers: it does not count as held.
        Ok(config == Some(id))
    }

    /// One `docker save` of `reference`, fanned out into an import exec per node, in parallel.
    async fn stream_into(&self, nodes: &[String], reference: &str) -> Result<(), HostError> {
        let mut senders = Vec::new();
        let mut imports = Vec::new();
        for node in nodes {
            let (tx, rx) = mpsc::channel::<Bytes>(4);
            senders.push(tx);
            imports.push(self.exec(node, &IMPORT, Some(rx)));
        }
        let pump = async {
            let mut archive = super::HostStore::export(self, reference).await?;
            while let Some(chunk) = archive.next().await {
                let chunk = chunk?;
                // A node whose import died stops taking chunks; the others go on, and its exit code
                // names the failure below.
                for tx in &senders {
                    let _ = tx.send(chunk.clone()).await;
                }
            }
            drop(senders);
            Ok::<(), HostError>(())
        };
        let (pumped, results) = tokio::join!(pump, futures_util::future::join_all(imports));
        pumped?;
        for (node, result) in nodes.iter().zip(results) {
            let (code, _, err) = result?;
            if code != 0 {
                return Err(kind_error(node, reference, format!("`ctr images import` exited {code}: {err}")));
            }
        }
        Ok(())
    }

    /// Runs `cmd` in container `node`, feeding `stdin` when given; its exit code, stdout, stderr.
    async fn exec(
        &self,
        node: &str,
        cmd: &[&str],
        stdin: Option<mpsc::Receiver<Bytes>>,
    ) -> Result<(i64, String, String), HostError> {
        let what = cmd.join(" ");
        let options = CreateExecOptions {
            cmd: Some(cmd.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
            attach_stdin: Some(stdin.is_some()),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            ..Default::default()
        };
        let created =
            self.builder.create_exec(node, options).await.map_err(|err| self.daemon_error("exec", node, err))?;
        let started = self
            .builder
            .start_exec(&created.id, Some(StartExecOptions { detach: false, ..Default::default() }))
            .await
            .map_err(|err| self.daemon_error("exec", node, err))?;
        let StartExecResults::Attached { mut output, mut input } = started else {
            return Err(kind_error(node, &what, "the daemon started the exec detached".to_string()));
        };
        let feed = async move {
            if let Some(mut rx) = stdin {
                while let Some(chunk) = rx.recv().await {
                    if input.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
                // Closing stdin is the end of the archive for `ctr import -`.
                let _ = input.shutdown().await;
            }
        };
        let read = async {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            while let Some(item) = output.next().await {
                match item {
                    Ok(bollard::container::LogOutput::StdOut { message }) => out.extend_from_slice(&message),
                    Ok(bollard::container::LogOutput::StdErr { message }) => err.extend_from_slice(&message),
                    Ok(_) => {}
                    Err(e) => return Err(self.daemon_error("exec", node, e)),
                }
            }
            Ok((out, err))
        };
        let ((), read) = tokio::join!(feed, read);
        let (out, err) = read?;
        let inspected =
            self.builder.inspect_exec(&created.id).await.map_err(|err| self.daemon_error("exec", node, err))?;
        let code = inspected.exit_code.unwrap_or(-1);
        Ok((code, String::from_utf8_lossy(&out).into_owned(), String::from_utf8_lossy(&err).trim().to_string()))
    }
}

fn kind_error(node: &str, reference: &str, why: String) -> HostError {
    HostError::KindImport { node: node.to_string(), reference: reference.to_string(), why }
}
