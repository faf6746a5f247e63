//! [`CriNodeStore`]: the node store through the CRI alone (`runtime.v1` ImageService and
//! RuntimeService), for nodes whose containerd API is not reachable but whose CRI socket is.
//!
//! The CRI cannot untag: `RemoveImage` of any name removes every name of that image and its id.
//! So this adapter removes only image ids, and refuses a named ref outright — removing `app:old`
//! through the CRI would also take `app:new` on the same image. Which ids may go is the sweep
//! planner's decision ([`RemovalMode::PerId`]): an id with any kept name is kept whole and reported.
//!
//! What the CRI cannot name, it cannot remove: kind's `import-<date>@sha256:…` ref shows only as a
//! repo digest misspelled under `docker.io/library/`, so it outlives `RemoveImage` (and keeps the
//! content) until someone with containerd's own API removes it. The CRI's list is a cache fed by
//! containerd's events, and it misses that removal too (measured on containerd 1.6): it can go on
//! listing an image containerd no longer holds. So this adapter lists such a ref as the image's
//! alias, and reports an id that a `RemoveImage` left listed as a failure, never as removed.

use super::content::Conn;
use super::oci::ImageConfig;
use super::{ImportBody, ImportSpec, Imported, NodeError, NodeStore, Removal};
use async_trait::async_trait;
use kiln_core::refs::ImageRef;
use kiln_core::sweep::{ListedImage, RemovalMode};
use kiln_proto::cri::v1::image_service_client::ImageServiceClient;
use kiln_proto::cri::v1::runtime_service_client::RuntimeServiceClient;
use kiln_proto::cri::v1::{
    Image, ImageSpec, ImageStatusRequest, ListContainersRequest, ListImagesRequest, RemoveImageRequest, VersionRequest,
};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::Path;

/// The CRI as containerd serves it on its socket.
#[derive(Clone, Debug)]
pub struct CriNodeStore {
    conn: Conn,
}

/// The part of a verbose `ImageStatus` answer's `info` that carries the image config.
#[derive(Deserialize)]
struct VerboseInfo {
    #[serde(rename = "imageSpec", default)]
    image_spec: ImageConfig,
}

impl CriNodeStore {
    /// Connects to the CRI at `socket` and checks it answers.
    pub async fn connect(socket: impl AsRef<Path>) -> Result<CriNodeStore, NodeError> {
        let store = CriNodeStore { conn: Conn::connect(socket.as_ref(), "").await? };
        store.ping().await?;
        Ok(store)
    }

    pub fn socket(&self) -> &Path {
        &self.conn.socket
    }

    fn images(&self) -> ImageServiceClient<tonic::transport::Channel> {
        ImageServiceClient::new(self.conn.channel.clone())
    }

    /// The CRI's status of `image` (a name or id), verbose so that it carries the config.
    async fn status(&self, image: &str) -> Result<Option<(Image, ImageConfig)>, NodeError> {
        let request = ImageStatusRequest { image: Some(spec(image)), verbose: true };
        let answer = self
            .conn
            .call("CRI image status", image, self.images().image_status(self.conn.request(request, None)))
            .await?;
        let answer = answer.into_inner();
        let Some(found) = answer.image else { return Ok(None) };
        // A CRI that does not say leaves the labels empty: the planner then never takes the image.
        let config = answer
            .info
            .get("info")
            .and_then(|info| serde_json::from_str::<VerboseInfo>(info).ok())
            .map(|info| info.image_spec)
            .unwrap_or_default();
        Ok(Some((found, config)))
    }
}

fn spec(image: &str) -> ImageSpec {
    ImageSpec { image: image.to_string() }
}

/// `sha256:` and 64 lowercase hex digits: an image id, the only thing this adapter removes.
fn is_image_id(reference: &str) -> bool {
    reference
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// A repo digest that is really kind's `import-<date>@sha256:…` ref, as the CRI spells it
/// (`docker.io/library/import-2026-11-29@sha256:…`).
fn is_import_ref(repo_digest: &str) -> bool {
    ImageRef::parse(repo_digest).is_ok_and(|r| {
        r.domain() == "docker.io"
            && r.tag().is_none()
            && r.path().strip_prefix("library/").is_some_and(|p| p.starts_with("import-"))
    })
}

#[async_trait]
impl NodeStore for CriNodeStore {
    fn removal_mode(&self) -> RemovalMode {
        RemovalMode::PerId
    }

    fn describe(&self) -> String {
        format!("CRI {}", self.conn.socket.display())
    }

    async fn list(&self) -> Result<Vec<ListedImage>, NodeError> {
        let request = self.conn.request(ListImagesRequest {}, None);
        let images =
            self.conn.call("CRI list images", "", self.images().list_images(request)).await?.into_inner().images;
        let mut listed = Vec::with_capacity(images.len());
        for image in images {
            // The list answer carries no labels; the verbose status of each image does.
            let labels = match self.status(&image.id).await? {
                Some((_, config)) => config.labels(),
                // Removed between the two calls: it is no longer there to list.
                None => continue,
            };
            let mut digests: Vec<String> = image
                .repo_digests
                .iter()
                .filter_map(|d| d.rsplit_once('@').map(|(_, digest)| digest.to_string()))
                .collect();
            digests.sort();
            digests.dedup();
            // kind's `import-*` ref shows up among the repo digests, misspelled under
            // `docker.io/library/`; it is listed as a ref because it holds the image, and stays
            // after `RemoveImage` took every name.
            let mut refs = image.repo_tags;
            refs.extend(image.repo_digests.into_iter().filter(|d| is_import_ref(d)));
            refs.sort();
            listed.push(ListedImage { id: image.id, refs, digests, labels, bytes: image.size, layers: Vec::new() });
        }
        listed.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(listed)
    }

    async fn import(&self, _archive: ImportBody, _spec: &ImportSpec) -> Result<Imported, NodeError> {
        Err(NodeError::CriOnly {
            socket: self.conn.socket.clone(),
            what: "import an image (the CRI has no import call)",
        })
    }

    async fn remove_ref(&self, reference: &str) -> Result<Removal, NodeError> {
        if !is_image_id(reference) {
            return Err(NodeError::NotAnImageId { socket: self.conn.socket.clone(), reference: reference.to_string() });
        }
        // `RemoveImage` succeeds for an image that is not there, so presence is asked first.
        if self.status(reference).await?.is_none() {
            return Ok(Removal::Absent);
        }
        let request = self.conn.request(RemoveImageRequest { image: Some(spec(reference)) }, None);
        self.conn.call("CRI remove image", reference, self.images().remove_image(request)).await?;
        // `RemoveImage` answers success even when a ref it cannot see (kind's `import-*`) keeps the
        // image; only asking again tells a removal from a no-op.
        match self.status(reference).await? {
            None => Ok(Removal::Removed),
            Some((left, _)) => Err(NodeError::HeldByHiddenRefs {
                socket: self.conn.socket.clone(),
                id: reference.to_string(),
                refs: if left.repo_digests.is_empty() {
                    "refs it does not list".to_string()
                } else {
                    left.repo_digests.join(", ")
                },
            }),
        }
    }

    async fn workload_images(&self) -> Result<Vec<String>, NodeError> {
        let mut client = RuntimeServiceClient::new(self.conn.channel.clone());
        let request = self.conn.request(ListContainersRequest {}, None);
        let containers = self.conn.call("CRI list containers", "", client.list_containers(request)).await?.into_inner();
        // Both the name the container was created with and the id it resolved to: either keeps it.
        let mut images = BTreeSet::new();
        for container in containers.containers {
            images.extend(container.image.map(|spec| spec.image).filter(|image| !image.is_empty()));
            if !container.image_ref.is_empty() {
                images.insert(container.image_ref);
            }
        }
        Ok(images.into_iter().collect())
    }

    async fn holds(&self, reference: &str, id: &str) -> Result<bool, NodeError> {
        Ok(self.status(reference).await?.is_some_and(|(image, _)| image.id == id))
    }

    async fn ping(&self) -> Result<(), NodeError> {
        let mut client = RuntimeServiceClient::new(self.conn.channel.clone());
        let request = self.conn.request(VersionRequest { version: "v1".to_string() }, None);
        self.conn.call("CRI version", "", client.version(request)).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_full_image_ids_are_removable_through_the_cri() {
        let id = format!("sha256:{}", "ab".repeat(32));
        assert!(is_image_id(&id));
        assert!(!is_image_id("docker.io/library/app:1"));
        assert!(!is_image_id(&format!("import-2026-11-29@{id}")));
        assert!(!is_image_id("sha256:abc"));
        assert!(!is_image_id(&format!("sha256:{}", "AB".repeat(32))));
    }

    #[test]
    fn kinds_import_ref_is_told_from_a_repo_digest() {
        let digest = format!("sha256:{}", "cd".repeat(32));
        assert!(is_import_ref(&format!("docker.io/library/import-2026-11-29@{digest}")));
        assert!(!is_import_ref(&format!("docker.io/library/app@{digest}")));
        assert!(!is_import_ref(&format!("docker.io/team/import-2026-11-29@{digest}")));
        assert!(!is_import_ref("docker.io/library/import-2026-11-29:1"));
    }
}
