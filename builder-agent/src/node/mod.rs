//! The node store: the images of one cluster node, in containerd's `k8s.io` namespace — the only one
//! the kubelet's CRI sees.
//!
//! The agent's tasks see a node only through [`NodeStore`], a narrow trait in Kiln's own terms (a
//! listing grouped by image id, a streamed import verified by digest, a delete-if-present removal per
//! ref, the images the node's containers use), so the sweep and delivery logic never depend on
//! containerd's or the CRI's types. Two adapters sit beside it:
//!
//! - [`ContainerdStore`] talks to containerd's own gRPC API. It sees every ref — named ones, kind's
//!   `import-<date>@sha256:…` and the CRI's `sha256:<id>` — and removes them one by one, so it can
//!   untag ([`RemovalMode::PerRef`]). It imports by writing blobs through the Content service and
//!   naming them through the Images service: containerd has no import RPC.
//! - [`CriNodeStore`] talks only to the CRI image and runtime services, for nodes where containerd's
//!   own API is out of reach. The CRI cannot untag: removing any ref of an image removes all its names,
//!   so it removes whole image ids only ([`RemovalMode::PerId`]), and the sweep planner keeps an id
//!   whole when any of its names is still needed.
//!
//! Either way, a removal's outcome is confirmed by listing again, never assumed from the call.

mod archive;
mod containerd;
mod content;
mod cri;
mod error;
mod import;
mod oci;
pub(crate) mod tasks;

pub use containerd::ContainerdStore;
pub use content::unix_channel;
pub use cri::CriNodeStore;
pub use error::NodeError;

/// A delete-if-present removal's outcome, the same on nodes as on hosts.
pub use crate::host::Removal;
pub use kiln_core::sweep::RemovalMode;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::BoxStream;
use kiln_core::sweep::ListedImage;
use std::path::PathBuf;

/// The containerd namespace the kubelet's CRI uses; images anywhere else never run on the node.
pub const K8S_NAMESPACE: &str = "k8s.io";

/// A `docker save` archive arriving in chunks, e.g. from the host agent over the network. It is read
/// once, front to back, and never held whole.
pub type ImportBody = BoxStream<'static, std::io::Result<Bytes>>;

/// What an import must produce, and what it must verify the archive against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportSpec {
    /// The name to create or re-point, in any spelling Docker accepts (`app:1`,
    /// `docker.io/library/app:1`); containerd gets the fully qualified form, which is how the CRI
    /// looks names up.
    pub reference: String,
    /// The image id the archive must hold: `sha256:<config digest>`. Every layer is checked against
    /// the config's `rootfs.diff_ids`, so this one digest pins every byte imported.
    pub id: String,
}

/// A finished import.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Imported {
    /// `sha256:<config digest>`.
    pub id: String,
    /// The digest of the Docker schema 2 manifest the name now targets.
    pub manifest: String,
    /// The name as containerd now holds it (`docker.io/library/app:1`).
    pub reference: String,
    /// Config and layer bytes, as a listing counts them.
    pub bytes: u64,
}

/// Where and how to reach a node's image store (the `kiln-agent --role node` options).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConfig {
    /// containerd's gRPC socket (`/run/containerd/containerd.sock`); the CRI is served on it too.
    pub socket: PathBuf,
    /// The containerd namespace; [`K8S_NAMESPACE`] unless a test says otherwise. Ignored in CRI-only
    /// mode, where the CRI decides.
    pub namespace: String,
    /// Reach the node through the CRI alone, as where containerd's own API is not exposed.
    pub cri_only: bool,
}

impl NodeConfig {
    /// containerd at `socket`, namespace [`K8S_NAMESPACE`], its own API.
    pub fn containerd(socket: impl Into<PathBuf>) -> NodeConfig {
        NodeConfig { socket: socket.into(), namespace: K8S_NAMESPACE.to_string(), cri_only: false }
    }

    /// Connects the adapter this config names.
    pub async fn connect(&self) -> Result<std::sync::Arc<dyn NodeStore>, NodeError> {
        Ok(if self.cri_only {
            std::sync::Arc::new(CriNodeStore::connect(&self.socket).await?)
        } else {
            std::sync::Arc::new(ContainerdStore::connect(&self.socket, &self.namespace).await?)
        })
    }
}

/// One node's image store, in Kiln's terms. Object-safe, so tasks hold an `Arc<dyn NodeStore>`.
#[async_trait]
pub trait NodeStore: Send + Sync {
    /// Whether this store can untag ([`RemovalMode::PerRef`]) or removes whole ids only.
    fn removal_mode(&self) -> RemovalMode;

    /// A name for logs and the agent's hello: the socket and, for containerd, the namespace.
    fn describe(&self) -> String;

    /// Every image the store holds, grouped by image id, with every ref that names it, its config's
    /// labels and its bytes. Unlike a host listing this is not filtered by label: the planner
    /// decides what is a candidate.
    async fn list(&self) -> Result<Vec<ListedImage>, NodeError>;

    /// Imports the `docker save` archive `archive`, verified against `spec.id`, and points
    /// `spec.reference` at it. Memory stays bounded whatever the image's size.
    async fn import(&self, archive: ImportBody, spec: &ImportSpec) -> Result<Imported, NodeError>;

    /// Removes `reference` exactly as [`NodeStore::list`] spelled it; `Absent` when it is already
    /// gone. The image's content is reclaimed once its last ref goes.
    async fn remove_ref(&self, reference: &str) -> Result<Removal, NodeError>;

    /// The images the node's containers use, as each container names it (a ref or an image id):
    /// roots the sweep must keep on this store.
    async fn workload_images(&self) -> Result<Vec<String>, NodeError>;

    async fn ping(&self) -> Result<(), NodeError>;

    /// Whether `reference` (any spelling) already names image `id` here: a delivery to a node where
    /// it does is skipped. The image under another name does not count — the workload asks for
    /// this name.
    async fn holds(&self, reference: &str, id: &str) -> Result<bool, NodeError>;
}
