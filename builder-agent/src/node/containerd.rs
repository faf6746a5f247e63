//! [`ContainerdStore`]: the node store over containerd's own gRPC API, in one namespace.
//!
//! A listing resolves each ref's target to its image id (the config digest) by reading the manifest
//! and config blobs, because containerd keeps refs, not images: one image typically wears a name,
//! the CRI's `sha256:<id>` ref and, when kind loaded it, an `import-<date>@sha256:<manifest>` ref —
//! three records the sweep must see as one image, or removing the name alone would free nothing.

use super::content::Conn;
use super::import::{self, MANIFEST_LIMIT};
use super::oci::{self, ImageConfig, Index, Manifest};
use super::{ImportBody, ImportSpec, Imported, NodeError, NodeStore, Removal};
use async_trait::async_trait;
use futures_util::{stream, StreamExt, TryStreamExt};
use kiln_core::refs::{ImageRef, Platform};
use kiln_core::sweep::{ListedImage, RemovalMode};
use kiln_proto::containerd::services::containers::v1::containers_client::ContainersClient;
use kiln_proto::containerd::services::containers::v1::ListContainersRequest;
use kiln_proto::containerd::services::images::v1::images_client::ImagesClient;
use kiln_proto::containerd::services::images::v1::{DeleteImageRequest, GetImageRequest, ListImagesRequest};
use kiln_proto::containerd::services::version::v1::version_client::VersionClient;
use kiln_proto::containerd::types::Descriptor;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use tonic::Code;

/// How many targets a listing resolves at once.
const RESOLVE_PARALLELISM: usize = 8;

/// One containerd namespace, reached over containerd's socket.
#[derive(Clone, Debug)]
pub struct ContainerdStore {
    conn: Conn,
}

/// What a ref's target resolves to.
#[derive(Clone, Debug)]
struct Resolved {
    id: String,
    /// The target's digest and, when the target is an index, the manifest picked from it.
    digests: Vec<String>,
    labels: BTreeMap<String, String>,
    bytes: u64,
}

impl ContainerdStore {
    /// Connects to containerd at `socket` and checks it answers; every call is scoped to `namespace`.
    pub async fn connect(socket: impl AsRef<Path>, namespace: &str) -> Result<ContainerdStore, NodeError> {
        let store = ContainerdStore { conn: Conn::connect(socket.as_ref(), namespace).await? };
        store.ping().await?;
        Ok(store)
    }

    pub fn socket(&self) -> &Path {
        &self.conn.socket
    }

    pub fn namespace(&self) -> &str {
        &self.conn.namespace
    }

    async fn delete(&self, name: &str) -> Result<Removal, NodeError> {
        let mut client = ImagesClient::new(self.conn.channel.clone());
        // `sync` waits for the collector, so the content of an image whose last ref this was is gone
        // by the time the call returns and a re-list reports the bytes truly reclaimed.
        let request = self.conn.request(DeleteImageRequest { name: name.to_string(), sync: true }, None);
        match self.conn.call("remove image", name, client.delete(request)).await {
            Ok(_) => Ok(Removal::Removed),
            Err(NodeError::Refused { source, .. }) if source.code() == Code::NotFound => Ok(Removal::Absent),
            Err(err) => Err(err),
        }
    }

    /// The image a target names, or `None` when its blobs are not all there (an interrupted pull):
    /// such a ref has no id to group by, and no labels that could make it a sweep candidate.
    async fn resolve(&self, target: &Descriptor) -> Result<Option<Resolved>, NodeError> {
        let mut digests = vec![target.digest.clone()];
        let mut manifest_digest = target.digest.clone();
        if target.media_type == oci::OCI_INDEX || target.media_type == oci::DOCKER_MANIFEST_LIST {
            let Some(blob) = self.conn.read_blob(&target.digest, "image index", MANIFEST_LIMIT).await? else {
                return Ok(None);
            };
            let index: Index = self.parse(&target.digest, "image index", &blob)?;
            let host = Platform::host();
            let Some(entry) = index.pick(host.os(), host.arch()) else { return Ok(None) };
            manifest_digest = entry.digest.clone();
            digests.push(manifest_digest.clone());
        }
        let Some(blob) = self.conn.read_blob(&manifest_digest, "image manifest", MANIFEST_LIMIT).await? else {
            return Ok(None);
        };
        let manifest: Manifest = self.parse(&manifest_digest, "image manifest", &blob)?;
        let Some(blob) = self.conn.read_blob(&manifest.config.digest, "image config", MANIFEST_LIMIT * 4).await? else {
            return Ok(None);
        };
        let config: ImageConfig = self.parse(&manifest.config.digest, "image config", &blob)?;
        Ok(Some(Resolved {
            id: manifest.config.digest.clone(),
            digests,
            labels: config.labels(),
            bytes: manifest.bytes(),
        }))
    }

    fn parse<T: serde::de::DeserializeOwned>(
        &self,
        digest: &str,
        what: &'static str,
        blob: &[u8],
    ) -> Result<T, NodeError> {
        serde_json::from_slice(blob).map_err(|source| NodeError::BadBlob {
            socket: self.conn.socket.clone(),
            digest: digest.to_string(),
            what,
            source,
        })
    }
}

#[async_trait]
impl NodeStore for ContainerdStore {
    fn removal_mode(&self) -> RemovalMode {
        RemovalMode::PerRef
    }

    fn describe(&self) -> String {
        format!("containerd {} namespace {}", self.conn.socket.display(), self.conn.namespace)
    }

    async fn list(&self) -> Result<Vec<ListedImage>, NodeError> {
        let mut client = ImagesClient::new(self.conn.channel.clone());
        let request = self.conn.request(ListImagesRequest {}, None);
        let images =
            self.conn.call("list images", &self.conn.namespace, client.list(request)).await?.into_inner().images;

        let mut targets: BTreeMap<String, Descriptor> = BTreeMap::new();
        for image in &images {
            if let Some(target) = &image.target {
                targets.entry(target.digest.clone()).or_insert_with(|| target.clone());
            }
        }
        let resolved: BTreeMap<String, Option<Resolved>> = stream::iter(targets.into_values())
            .map(|target| async move { Ok::<_, NodeError>((target.digest.clone(), self.resolve(&target).await?)) })
            .buffer_unordered(RESOLVE_PARALLELISM)
            .try_collect()
            .await?;

        let mut by_id: BTreeMap<String, ListedImage> = BTreeMap::new();
        for image in images {
            let Some(target) = image.target else { continue };
            let Some(Some(found)) = resolved.get(&target.digest) else {
                tracing::warn!(socket = %self.conn.socket.display(), reference = %image.name, target = %target.digest, "ref's content is incomplete; left out of the listing");
                continue;
            };
            let listed = by_id.entry(found.id.clone()).or_insert_with(|| ListedImage {
                id: found.id.clone(),
                refs: Vec::new(),
                digests: Vec::new(),
                labels: found.labels.clone(),
                bytes: found.bytes,
                layers: Vec::new(),
            });
            listed.refs.push(image.name);
            listed.digests.extend(found.digests.iter().cloned());
        }
        Ok(by_id
            .into_values()
            .map(|mut image| {
                image.refs.sort();
                image.digests.sort();
                image.digests.dedup();
                image
            })
            .collect())
    }

    async fn import(&self, archive: ImportBody, spec: &ImportSpec) -> Result<Imported, NodeError> {
        import::import(&self.conn, archive, spec).await
    }

    async fn remove_ref(&self, reference: &str) -> Result<Removal, NodeError> {
        if self.delete(reference).await? == Removal::Removed {
            return Ok(Removal::Removed);
        }
        // A root or a record may spell a name the short way; containerd holds the long one.
        match ImageRef::parse(reference).map(|r| r.normalized()) {
            Ok(normalized) if normalized != reference && !reference.starts_with("sha256:") => {
                self.delete(&normalized).await
            }
            _ => Ok(Removal::Absent),
        }
    }

    async fn workload_images(&self) -> Result<Vec<String>, NodeError> {
        let mut client = ContainersClient::new(self.conn.channel.clone());
        let request = self.conn.request(ListContainersRequest {}, None);
        let containers = self
            .conn
            .call("list containers", &self.conn.namespace, client.list(request))
            .await?
            .into_inner()
            .containers;
        let images: BTreeSet<String> =
            containers.into_iter().map(|c| c.image).filter(|image| !image.is_empty()).collect();
        Ok(images.into_iter().collect())
    }

    async fn holds(&self, reference: &str, id: &str) -> Result<bool, NodeError> {
        let name = ImageRef::parse(reference)
            .map_err(|source| NodeError::BadReference { reference: reference.to_string(), source })?
            .normalized();
        let mut client = ImagesClient::new(self.conn.channel.clone());
        let request = self.conn.request(GetImageRequest { name: name.clone() }, None);
        let image = match self.conn.call("get image", &name, client.get(request)).await {
            Ok(answer) => answer.into_inner().image,
            Err(NodeError::Refused { source, .. }) if source.code() == Code::NotFound => None,
            Err(err) => return Err(err),
        };
        let Some(target) = image.and_then(|image| image.target) else { return Ok(false) };
        Ok(self.resolve(&target).await?.is_some_and(|found| found.id == id))
    }

    async fn ping(&self) -> Result<(), NodeError> {
        let mut client = VersionClient::new(self.conn.channel.clone());
        let request = self.conn.request((), None);
        self.conn.call("version", "", client.version(request)).await.map(|_| ())
    }
}
