//! The host store: one Docker daemon an agent builds on, lists, pushes from and untags in.
//!
//! The agent's tasks see Docker only through [`HostStore`], a narrow trait in Kiln's own terms (a
//! build spec, a labeled listing, a push with progress, a delete-if-present untag), so the converge
//! logic never depends on bollard's types and a simulated agent can stand in for a real one.
//! [`DockerStore`] is the real adapter. [`verify_context`] is the check every build runs first:
//! the context archive must unpack safely to exactly the tree digest the tag addresses.
//!
//! Whether an image answers for a tag is decided here once ([`HostStore::held`]): only an image
//! that wears exactly that tag *and* carries `kiln.dev/kind` with this farm's `kiln.dev/farm`
//! counts. An image someone built by hand under a Kiln-like name never makes Kiln skip a build
//! (ADR-0041), and another farm's image never makes this farm skip one.

mod body;
mod buildkit;
mod buildlog;
mod copies;
mod docker;
mod error;
mod kind;
mod layers;
mod push;
mod verify;

pub(crate) use buildlog::step_number;
pub use docker::DockerStore;
pub use error::HostError;
pub use kind::{KindLoad, KindNode, KIND_CLUSTER_LABEL};
pub use verify::verify_context;

/// The name under which a Dockerfile that lives outside the context travels in the archive sent to
/// Docker. It is not part of the verified tree; a context that already holds this name is refused.
pub use body::OUTSIDE_DOCKERFILE;

/// The BuildKit answer decoder, for the `buildkit_status` fuzz target (`fuzz/`): not an API.
#[doc(hidden)]
pub use buildkit::decode_answer as buildkit_answer;

use async_trait::async_trait;
use kiln_core::refs::ImageRef;
use kiln_core::sweep::{ListedImage, LABEL_FARM, LABEL_KIND};
use std::collections::BTreeMap;
use std::path::Path;
use tokio::sync::mpsc::Sender;

/// A `docker save` archive in chunks, read once front to back.
pub type ExportStream = futures_util::stream::BoxStream<'static, Result<bytes::Bytes, HostError>>;

/// Everything a build needs besides the context archive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BuildSpec {
    /// The full content ref the image is built straight to (`hello-web:17eb17246f39-amd64`,
    /// `127.0.0.1:5000/x:…`).
    pub tag: String,
    /// The Dockerfile's path inside the context (`Dockerfile`, `docker/api.Dockerfile`). Ignored
    /// when `dockerfile_outside` is set.
    pub dockerfile: String,
    /// The contents of a Dockerfile that lives outside the context. It travels beside the context
    /// under [`OUTSIDE_DOCKERFILE`] and is hidden from the build's `COPY` by `.dockerignore`.
    pub dockerfile_outside: Option<Vec<u8>>,
    pub args: BTreeMap<String, String>,
    /// The stage to stop at (`--target`).
    pub target: Option<String>,
    /// An OCI platform, `linux/amd64`.
    pub platform: Option<String>,
    /// Stamped through the build API's labels parameter, never written into the Dockerfile.
    pub labels: BTreeMap<String, String>,
    pub no_cache: bool,
}

/// A finished build: the id of the image now wearing the spec's tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Built {
    /// `sha256:<config digest>`.
    pub id: String,
}

/// One image as `inspect` reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    /// `sha256:<config digest>`.
    pub id: String,
    pub bytes: u64,
    pub labels: BTreeMap<String, String>,
    /// The image config's declared `USER`; `None` when it declares none (it then runs as root).
    pub user: Option<String>,
    /// Every tag the image wears, as Docker spells it (`x:t`, `127.0.0.1:5000/x:t`).
    pub repo_tags: Vec<String>,
    /// `repo@sha256:…` for each registry the image was pushed to or pulled from.
    pub repo_digests: Vec<String>,
}

/// Progress of one layer of a push, from Docker's `progressDetail`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushProgress {
    /// The layer's short id as Docker reports it.
    pub layer: String,
    pub current: u64,
    pub total: u64,
}

/// A finished push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pushed {
    /// The manifest digest the registry now serves the tag as (`sha256:…`), when Docker reported it.
    pub digest: Option<String>,
    /// Layer bytes this push sent; layers the registry already held count nothing.
    pub bytes: u64,
}

/// What a delete-if-present untag found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    Removed,
    /// The tag was not there: someone else removed it first, which is the same outcome.
    Absent,
}

/// One Docker daemon, in Kiln's terms. Object-safe, so tasks hold an `Arc<dyn HostStore>`.
#[async_trait]
pub trait HostStore: Send + Sync {
    /// Builds `context_archive` (a canonical archive already checked by [`verify_context`])
    /// straight to `spec.tag`, sending each build log line to `log` as it arrives. A closed `log`
    /// does not stop the build.
    async fn build(&self, context_archive: &Path, spec: &BuildSpec, log: Sender<String>) -> Result<Built, HostError>;

    /// Every image carrying `kiln.dev/kind`, whatever its farm: the sweep planner decides what is
    /// this farm's.
    async fn list_labeled(&self) -> Result<Vec<ListedImage>, HostError>;

    /// [`HostStore::list_labeled`] with each image's layers, plus every other image on the store
    /// listed by its layers alone (no refs, no labels), so a sweep counts as freed only the layers
    /// no remaining image uses. A store that cannot tell layers lists the labeled images without.
    async fn list_with_layers(&self) -> Result<Vec<ListedImage>, HostError> {
        self.list_labeled().await
    }

    /// Tags the image `id` (`sha256:…`) as `reference` as well: a farm's hold on an image another
    /// farm built. The image's other tags stay.
    async fn tag(&self, id: &str, reference: &str) -> Result<(), HostError>;

    /// The image `reference` names, or `None` when the daemon has no such image.
    async fn inspect(&self, reference: &str) -> Result<Option<ImageInfo>, HostError>;

    /// Pushes `reference` (which must carry a tag) to the registry it names.
    async fn push(&self, reference: &str, progress: Sender<PushProgress>) -> Result<Pushed, HostError>;

    /// Untags `reference` without force; the image itself goes only when this was its last tag.
    async fn remove_tag(&self, reference: &str) -> Result<Removal, HostError>;

    /// Removes the image `id` (`sha256:…`) if present, without force, so an image a container
    /// uses is refused rather than taken from under it. For images that wear no tag at all.
    async fn remove_image(&self, id: &str) -> Result<Removal, HostError>;

    /// The images the daemon's containers use, running or stopped: for each container, its image
    /// as the container names it (a ref, or an id once the tag moved on) and its image id. A sweep
    /// keeps every one of them (DESIGN.md "Reachability", root 3).
    async fn images_in_use(&self) -> Result<Vec<String>, HostError>;

    async fn ping(&self) -> Result<(), HostError>;

    /// `docker save` of `reference`, streamed as the daemon writes it: the archive a node store
    /// imports. Never held whole; a failure mid-way ends the stream with an error.
    async fn export(&self, reference: &str) -> Result<ExportStream, HostError>;

    /// What `kind load docker-image` does: streams one `docker save` of `reference` into the
    /// containerd of every node container of kind cluster `cluster` on this daemon that does not
    /// already name image `id` under `name`, in parallel; the nodes hold it under `name` (the
    /// content ref of a multi-platform image whose platform ref is `reference`), else `reference`.
    async fn kind_load(&self, cluster: &str, reference: &str, id: &str, name: &str) -> Result<KindLoad, HostError>;

    /// Every kind node container on this daemon, each with its containerd as a node store the
    /// sweep lists and removes from like a node agent's. None by default: a daemon without kind
    /// clusters, or a simulated store.
    async fn kind_nodes(&self) -> Result<Vec<KindNode>, HostError> {
        Ok(Vec::new())
    }

    /// The image wearing exactly `tag`, if it was built by `farm` (DESIGN.md "The converge", step
    /// 3). A failed inspect reads as "holds nothing": the converge then builds, which is always
    /// safe, where trusting a half-answer could skip a build that was needed.
    async fn held(&self, farm: &str, tag: &str) -> Option<ImageInfo> {
        match self.inspect(tag).await {
            Ok(Some(info)) if held_by(&info, farm, tag) => Some(info),
            Ok(_) => None,
            Err(err) => {
                tracing::warn!(%tag, error = %err, "host listing failed; treating the tag as not held");
                None
            }
        }
    }
}

/// Whether `info` answers for `tag` on behalf of `farm`: labeled by Kiln, by this farm, and
/// wearing the tag itself. The tag check matters because Docker resolves a name that is not a tag
/// as an image id prefix, and an image found that way does not wear the tag.
pub fn held_by(info: &ImageInfo, farm: &str, tag: &str) -> bool {
    if !info.labels.contains_key(LABEL_KIND) || info.labels.get(LABEL_FARM).map(String::as_str) != Some(farm) {
        return false;
    }
    let Ok(wanted) = ImageRef::parse(tag) else {
        return false;
    };
    if wanted.digest().is_some() {
        return false;
    }
    info.repo_tags.iter().any(|worn| ImageRef::parse(worn).is_ok_and(|worn| worn == wanted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(labels: &[(&str, &str)], tags: &[&str]) -> ImageInfo {
        ImageInfo {
            id: "sha256:00".into(),
            bytes: 1,
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            user: None,
            repo_tags: tags.iter().map(|t| t.to_string()).collect(),
            repo_digests: vec![],
        }
    }

    #[test]
    fn held_needs_kind_farm_and_the_exact_tag() {
        let ours = [(LABEL_KIND, "image"), (LABEL_FARM, "f1")];
        assert!(held_by(&info(&ours, &["app:abc-amd64"]), "f1", "app:abc-amd64"));
        // Docker's spelling and Kiln's may differ only by normalization.
        assert!(held_by(&info(&ours, &["app:abc-amd64"]), "f1", "docker.io/library/app:abc-amd64"));
        assert!(!held_by(&info(&ours, &["app:abc-amd64"]), "f2", "app:abc-amd64"));
        assert!(!held_by(&info(&ours, &["app:other"]), "f1", "app:abc-amd64"));
        assert!(!held_by(&info(&[(LABEL_FARM, "f1")], &["app:abc-amd64"]), "f1", "app:abc-amd64"));
        assert!(!held_by(&info(&[(LABEL_KIND, "image")], &["app:abc-amd64"]), "f1", "app:abc-amd64"));
        assert!(!held_by(&info(&[], &["app:abc-amd64"]), "f1", "app:abc-amd64"));
    }
}
