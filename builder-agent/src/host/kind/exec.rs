//! The fallback path into a kind node: `docker exec` of the `ctr` every kind node ships. Used to
//! import (the same command kind runs, so the same refs appear) and, where the node's containerd
//! cannot be reached directly (see `nodes`), to ask whether the node already holds an image.

use super::kind_error;
use crate::host::{DockerStore, HostError};
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// The import kind itself runs on a node (so the same refs appear: the named one and
/// `import-<date>@sha256:…`).
const IMPORT: [&str; 8] =
    ["ctr", "--namespace=k8s.io", "images", "import", "--all-platforms", "--digests", "--snapshotter=overlayfs", "-"];

impl DockerStore {
    /// Whether kind node `node` names image `id` under `qualified`: the ref's manifest's config.
    pub(super) async fn exec_holds(&self, node: &str, qualified: &str, id: &str) -> Result<bool, HostError> {
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
    pub(super) async fn stream_into(&self, nodes: &[String], reference: &str) -> Result<(), HostError> {
        let mut senders = Vec::new();
        let mut imports = Vec::new();
        for node in nodes {
            let (tx, rx) = mpsc::channel::<Bytes>(4);
            senders.push(tx);
            imports.push(self.exec(node, &IMPORT, Some(rx)));
        }
        let pump = async {
            let mut archive = crate::host::HostStore::export(self, reference).await?;
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

    /// Names the image node `node` holds under `from` by `to` instead: `ctr images tag --force`,
    /// then the old name removed (the image stays, named by `to`).
    pub(super) async fn rename(&self, node: &str, from: &str, to: &str) -> Result<(), HostError> {
        let tag = ["ctr", "--namespace=k8s.io", "images", "tag", "--force", from, to];
        let remove = ["ctr", "--namespace=k8s.io", "images", "rm", from];
        for cmd in [&tag[..], &remove[..]] {
            let (code, _, err) = self.exec(node, cmd, None).await?;
            if code != 0 {
                return Err(kind_error(node, to, format!("`{}` exited {code}: {err}", cmd.join(" "))));
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
