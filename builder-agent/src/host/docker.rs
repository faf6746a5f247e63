//! [`DockerStore`]: the host store over a real Docker daemon, through bollard.
//!
//! Builds go to the daemon's BuildKit (`buildkit.rs`): it stamps Kiln's labels into the image
//! config without a step per label. A daemon that turns BuildKit away gets the classic builder
//! (`POST /build` through bollard, version 1) from then on; both take the context as one tar stream,
//! which is exactly what a verified canonical archive is.

use super::body::BuildBody;
use super::buildlog::BuildLog;
use super::push::{self, Endpoint, PushFailure};
use super::{BuildSpec, Built, HostError, HostStore, ImageInfo, PushProgress, Pushed, Removal};
use async_trait::async_trait;
use bollard::errors::Error as DockerError;
use bollard::query_parameters::{
    BuildImageOptionsBuilder, BuilderVersion, ListContainersOptionsBuilder, ListImagesOptionsBuilder,
    RemoveImageOptionsBuilder,
};
use bollard::Docker;
use futures_util::StreamExt;
use kiln_core::refs::ImageRef;
use kiln_core::sweep::{ListedImage, LABEL_KIND};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc::Sender;

/// Where the daemon is when `DOCKER_HOST` does not say.
pub const DEFAULT_DOCKER_HOST: &str = "unix:///var/run/docker.sock";

/// How long any call may wait for the daemon's first answer (not for a build or push to finish).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// A build's first answer comes only after the daemon has received and unpacked the whole context,
/// which for a multi-gigabyte context takes longer than any quick call should be allowed.
const BUILD_ANSWER_TIMEOUT: Duration = Duration::from_secs(60 * 60);

/// One Docker daemon, reached over its socket.
#[derive(Clone, Debug)]
pub struct DockerStore {
    host: String,
    pub(super) docker: Docker,
    pub(super) builder: Docker,
    pub(super) endpoint: Endpoint,
    /// Connections to the containerd of kind node containers on this daemon.
    pub(super) kind_reach: super::kind::Reach,
    /// Set once the daemon turned a BuildKit build away: every later build is classic.
    classic_only: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Layers read per image id (images never change).
    layers: std::sync::Arc<super::layers::LayerCache>,
}

impl DockerStore {
    /// Connects to the daemon `DOCKER_HOST` names, or to [`DEFAULT_DOCKER_HOST`].
    pub async fn connect_local() -> Result<DockerStore, HostError> {
        let host = std::env::var("DOCKER_HOST").ok().filter(|h| !h.is_empty());
        DockerStore::connect(host.as_deref().unwrap_or(DEFAULT_DOCKER_HOST)).await
    }

    /// Connects to the daemon at `host` (`unix:///path` or `tcp://addr:port`) and agrees an API
    /// version with it; fails naming the address when nothing answers there.
    pub async fn connect(host: &str) -> Result<DockerStore, HostError> {
        let endpoint =
            Endpoint::from_host(host).ok_or_else(|| HostError::UnsupportedHost { host: host.to_string() })?;
        let unreachable =
            |source: DockerError| HostError::Unreachable { host: host.to_string(), source: source.into() };
        let docker = Docker::connect_with_host(host).map_err(unreachable)?.with_timeout(ANSWER_TIMEOUT);
        let docker = docker.negotiate_version().await.map_err(unreachable)?;
        let builder = docker.clone().with_timeout(BUILD_ANSWER_TIMEOUT);
        Ok(DockerStore {
            host: host.to_string(),
            docker,
            builder,
            endpoint,
            kind_reach: Default::default(),
            classic_only: Default::default(),
            layers: Default::default(),
        })
    }

    /// The address this store talks to, as given.
    pub fn host(&self) -> &str {
        &self.host
    }

    pub(super) fn daemon_error(&self, op: &'static str, object: &str, err: DockerError) -> HostError {
        let host = self.host.clone();
        let object = object.to_string();
        match err {
            DockerError::RequestTimeoutError => HostError::TimedOut { host, op, object },
            DockerError::HyperLegacyError { .. }
            | DockerError::IOError { .. }
            | DockerError::SocketNotFoundError(_) => HostError::Unreachable { host, source: err.into() },
            other => HostError::Refused { host, op, object, source: other },
        }
    }
}

/// The request body for a build of `spec` from `context_archive` (read on a blocking thread).
async fn prepare_body(context_archive: &Path, spec: &BuildSpec) -> Result<BuildBody, HostError> {
    let archive = context_archive.to_path_buf();
    let (dockerfile, outside) = (spec.dockerfile.clone(), spec.dockerfile_outside.clone());
    tokio::task::spawn_blocking(move || BuildBody::prepare(&archive, &dockerfile, outside.as_deref())).await.map_err(
        |source| HostError::Worker { what: format!("read context archive {}", context_archive.display()), source },
    )?
}

fn is_not_found(err: &DockerError) -> bool {
    matches!(err, DockerError::DockerResponseServerError { status_code: 404, .. })
}

#[async_trait]
impl HostStore for DockerStore {
    async fn kind_load(
        &self,
        cluster: &str,
        reference: &str,
        id: &str,
        name: &str,
    ) -> Result<super::KindLoad, HostError> {
        self.load_into_kind(cluster, reference, id, name).await
    }

    async fn kind_nodes(&self) -> Result<Vec<super::KindNode>, HostError> {
        self.kind_nodes_of(None).await
    }

    async fn export(&self, reference: &str) -> Result<super::ExportStream, HostError> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        // A long save must not be cut at the short answer timeout: the build client waits longer.
        let (docker, store, reference) = (self.builder.clone(), self.clone(), reference.to_string());
        // bollard's stream borrows its client; a task owning a clone feeds a small channel, so
        // the archive is never buffered beyond a few chunks.
        tokio::spawn(async move {
            let mut chunks = docker.export_image(&reference);
            while let Some(chunk) = chunks.next().await {
                let chunk = chunk.map_err(|err| store.daemon_error("save", &reference, err));
                let stop = chunk.is_err();
                if tx.send(chunk).await.is_err() || stop {
                    break;
                }
            }
        });
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx).boxed())
    }

    async fn build(&self, context_archive: &Path, spec: &BuildSpec, log: Sender<String>) -> Result<Built, HostError> {
        let mut body = prepare_body(context_archive, spec).await?;
        if body.buildkit_sees_the_same && !self.classic_only.load(std::sync::atomic::Ordering::Relaxed) {
            match self.build_with_buildkit(body, spec, &log).await? {
                super::buildkit::Outcome::Built => {
                    return match self.inspect(&spec.tag).await? {
                        Some(info) => Ok(Built { id: info.id }),
                        None => Err(HostError::BuildFailed {
                            tag: spec.tag.clone(),
                            step: "its end — the daemon reported success, but no image wears the tag".to_string(),
                        }),
                    };
                }
                super::buildkit::Outcome::Unsupported(why) => {
                    tracing::warn!(host = %self.host, %why, "the daemon has no BuildKit; building with the classic builder");
                    self.classic_only.store(true, std::sync::atomic::Ordering::Relaxed);
                    // The refused attempt took the body; the classic build needs its own.
                    body = prepare_body(context_archive, spec).await?;
                }
            }
        }
        // The classic builder, for what BuildKit would see differently or cannot build.
        let args: HashMap<&str, &str> = spec.args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let labels: HashMap<&str, &str> = spec.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut options = BuildImageOptionsBuilder::default()
            .dockerfile(&body.dockerfile)
            .t(&spec.tag)
            .nocache(spec.no_cache)
            .rm(true)
            .forcerm(true)
            .buildargs(&args)
            .labels(&labels)
            .version(BuilderVersion::BuilderV1);
        if let Some(target) = &spec.target {
            options = options.target(target);
        }
        if let Some(platform) = &spec.platform {
            options = options.platform(platform);
        }
        let request = bollard::body_try_stream(body.into_stream());
        let mut output = self.builder.build_image(options.build(), None, Some(request));

        let mut lines = BuildLog::default();
        let failed = |lines: &BuildLog, message: &str| HostError::BuildFailed {
            tag: spec.tag.clone(),
            step: lines.failed_at(message),
        };
        while let Some(item) = output.next().await {
            match item {
                Ok(info) => {
                    for line in lines.push(info.stream.as_deref().unwrap_or_default()) {
                        // A listener that went away must not stop the build it was watching.
                        let _ = log.send(line).await;
                    }
                }
                Err(DockerError::DockerStreamError { error }) => return Err(failed(&lines, &error)),
                // Refused before any output: a Dockerfile that does not parse or is not there.
                Err(DockerError::DockerResponseServerError { message, .. }) => return Err(failed(&lines, &message)),
                Err(err) => return Err(self.daemon_error("build", &spec.tag, err)),
            }
        }
        if let Some(line) = lines.finish() {
            let _ = log.send(line).await;
        }
        // The tag, not the build's own report, is what a later converge will find; read it back.
        match self.inspect(&spec.tag).await? {
            Some(info) => Ok(Built { id: info.id }),
            None => Err(failed(&lines, "the daemon reported success, but no image wears the tag")),
        }
    }

    async fn list_labeled(&self) -> Result<Vec<ListedImage>, HostError> {
        let filters = HashMap::from([("label", vec![LABEL_KIND])]);
        let options = ListImagesOptionsBuilder::default().filters(&filters).build();
        let images = self
            .docker
            .list_images(Some(options))
            .await
            .map_err(|err| self.daemon_error("list images labeled", LABEL_KIND, err))?;
        Ok(images
            .into_iter()
            .map(|image| ListedImage {
                id: image.id,
                refs: real_names(image.repo_tags),
                digests: bare_digests(real_names(image.repo_digests)),
                labels: image.labels.into_iter().collect(),
                bytes: u64::try_from(image.size).unwrap_or(0),
                layers: Vec::new(),
            })
            .collect())
    }

    async fn list_with_layers(&self) -> Result<Vec<ListedImage>, HostError> {
        let every = self
            .docker
            .list_images(Some(ListImagesOptionsBuilder::default().build()))
            .await
            .map_err(|err| self.daemon_error("list images", "all", err))?;
        let mut out = Vec::with_capacity(every.len());
        for image in every {
            // Gone since the listing, or unreadable: counted whole if it is Kiln's.
            let layers = self.layers_of(&image.id).await.unwrap_or_default();
            let labeled = image.labels.contains_key(LABEL_KIND);
            out.push(ListedImage {
                id: image.id,
                // An image Kiln did not label is listed for its layers alone.
                refs: if labeled { real_names(image.repo_tags) } else { Vec::new() },
                digests: if labeled { bare_digests(real_names(image.repo_digests)) } else { Vec::new() },
                labels: if labeled { image.labels.into_iter().collect() } else { BTreeMap::new() },
                bytes: if labeled { u64::try_from(image.size).unwrap_or(0) } else { 0 },
                layers,
            });
        }
        Ok(out)
    }

    async fn tag(&self, id: &str, reference: &str) -> Result<(), HostError> {
        let (name, tag) = split_tagged(reference)?;
        let options = bollard::query_parameters::TagImageOptionsBuilder::default().repo(&name).tag(&tag).build();
        self.docker.tag_image(id, Some(options)).await.map_err(|err| self.daemon_error("tag", reference, err))
    }

    async fn inspect(&self, reference: &str) -> Result<Option<ImageInfo>, HostError> {
        let image = match self.docker.inspect_image(reference).await {
            Ok(image) => image,
            Err(err) if is_not_found(&err) => return Ok(None),
            Err(err) => return Err(self.daemon_error("inspect image", reference, err)),
        };
        let config = image.config.unwrap_or_default();
        Ok(Some(ImageInfo {
            id: image.id.unwrap_or_default(),
            bytes: image.size.and_then(|size| u64::try_from(size).ok()).unwrap_or(0),
            labels: config.labels.unwrap_or_default().into_iter().collect::<BTreeMap<_, _>>(),
            user: config.user.filter(|user| !user.is_empty()),
            repo_tags: image.repo_tags.unwrap_or_default(),
            repo_digests: image.repo_digests.unwrap_or_default(),
        }))
    }

    async fn push(&self, reference: &str, progress: Sender<PushProgress>) -> Result<Pushed, HostError> {
        let (name, tag) = split_tagged(reference)?;
        let api_version = self.docker.client_version().to_string();
        push::push(&self.endpoint, &api_version, &name, &tag, &progress).await.map_err(|failure| match failure {
            PushFailure::Connect(source) => HostError::Unreachable { host: self.host.clone(), source: source.into() },
            PushFailure::Lost(source) => {
                HostError::Lost { host: self.host.clone(), op: "push", object: reference.to_string(), source }
            }
            // Docker reports a registry it could not dial only in words (`dial tcp …: connect:
            // connection refused`); this is the one place they are read, and they become a type.
            PushFailure::Daemon(why) if never_connected(&why) => {
                HostError::RegistryRefused { reference: reference.to_string(), why }
            }
            PushFailure::Daemon(why) => HostError::PushFailed { reference: reference.to_string(), why },
        })
    }

    async fn remove_tag(&self, reference: &str) -> Result<Removal, HostError> {
        // A name without a tag would make Docker fall back to an image-id-prefix match and could
        // delete an image by id; removal here only ever takes one tag off.
        split_tagged(reference)?;
        let options = RemoveImageOptionsBuilder::default().force(false).noprune(false).build();
        match self.docker.remove_image(reference, Some(options), None).await {
            Ok(_) => Ok(Removal::Removed),
            Err(err) if is_not_found(&err) => Ok(Removal::Absent),
            Err(err) => Err(self.daemon_error("untag", reference, err)),
        }
    }

    async fn remove_image(&self, id: &str) -> Result<Removal, HostError> {
        // Only a full id: a short prefix or a name could match some other image.
        if !is_image_id(id) {
            return Err(HostError::NotAnImageId { id: id.to_string() });
        }
        let options = RemoveImageOptionsBuilder::default().force(false).noprune(false).build();
        match self.docker.remove_image(id, Some(options), None).await {
            Ok(_) => Ok(Removal::Removed),
            Err(err) if is_not_found(&err) => Ok(Removal::Absent),
            Err(err) => Err(self.daemon_error("remove image", id, err)),
        }
    }

    async fn images_in_use(&self) -> Result<Vec<String>, HostError> {
        let options = ListContainersOptionsBuilder::default().all(true).build();
        let containers = self
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|err| self.daemon_error("list containers", "all", err))?;
        let mut used: Vec<String> =
            containers.into_iter().flat_map(|c| [c.image, c.image_id]).flatten().filter(|s| !s.is_empty()).collect();
        used.sort();
        used.dedup();
        Ok(used)
    }

    async fn ping(&self) -> Result<(), HostError> {
        self.docker.ping().await.map(|_| ()).map_err(|err| self.daemon_error("ping", "/_ping", err))
    }
}

impl DockerStore {
    /// The image's layers with their sizes (see `layers.rs`), read once per id.
    async fn layers_of(&self, id: &str) -> Result<Vec<kiln_core::sweep::Layer>, HostError> {
        if let Some(known) = self.layers.get(id) {
            return Ok(known);
        }
        let image = self.docker.inspect_image(id).await.map_err(|err| self.daemon_error("inspect image", id, err))?;
        let diffs = image.root_fs.and_then(|r| r.layers).unwrap_or_default();
        let history = self.docker.image_history(id).await.map_err(|err| self.daemon_error("image history", id, err))?;
        // The API lists history newest first.
        let sizes: Vec<u64> = history.iter().rev().map(|h| u64::try_from(h.size).unwrap_or(0)).collect();
        let layers = super::layers::layers(&diffs, &sizes);
        self.layers.put(id, layers.clone());
        Ok(layers)
    }
}

/// Docker's API (before 1.43) names an untagged image `<none>:<none>` and an undigested one
/// `<none>@<none>`; those are placeholders, not refs anyone could remove or keep.
fn real_names(names: Vec<String>) -> Vec<String> {
    names.into_iter().filter(|name| !name.starts_with("<none>")).collect()
}

/// `repo@sha256:…` → `sha256:…`, deduplicated: the planner matches a root's digest against the
/// digest alone (`ListedImage::digests`), whichever repository the image was pushed to.
fn bare_digests(repo_digests: Vec<String>) -> Vec<String> {
    let mut digests: Vec<String> = repo_digests
        .into_iter()
        .map(|d| d.rsplit_once('@').map_or(d.clone(), |(_, digest)| digest.to_string()))
        .collect();
    digests.sort();
    digests.dedup();
    digests
}

/// Whether the daemon's push error says it never reached the registry: Go's dialer wording.
fn never_connected(why: &str) -> bool {
    why.contains("connect: connection refused")
        || why.contains("connect: no route to host")
        || why.contains("connect: network is unreachable")
}

/// `sha256:` and 64 lowercase hex digits.
fn is_image_id(id: &str) -> bool {
    id.strip_prefix("sha256:").is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Splits `repo:tag` into the name Docker's push wants and the tag. Refuses a ref without an
/// explicit tag (a push of a bare name sends *every* tag of the repository) and one with a digest.
fn split_tagged(reference: &str) -> Result<(String, String), HostError> {
    let not_pushable = |source| HostError::NotPushable { reference: reference.to_string(), source };
    let parsed = ImageRef::parse(reference).map_err(|err| not_pushable(Some(err)))?;
    let last = reference.rsplit('/').next().unwrap_or(reference);
    let (Some(tag), None, true) = (parsed.tag(), parsed.digest(), last.contains(':')) else {
        return Err(not_pushable(None));
    };
    let familiar = parsed.familiar();
    let name = familiar.strip_suffix(&format!(":{tag}")).unwrap_or(&familiar).to_string();
    Ok((name, tag.to_string()))
}

#[cfg(test)]
mod tests {

    #[test]
    fn repo_digests_become_bare_digests_the_planner_can_match() {
        let d = format!("sha256:{}", "a".repeat(64));
        let got = super::bare_digests(vec![format!("127.0.0.1:5000/x@{d}"), format!("reg.example/y@{d}")]);
        assert_eq!(got, vec![d]);
    }

    use super::*;

    #[test]
    fn only_explicitly_tagged_refs_are_split() {
        let split = |r: &str| split_tagged(r).ok();
        assert_eq!(split("app:1"), Some(("app".into(), "1".into())));
        assert_eq!(
            split("127.0.0.1:5000/team/app:abc-amd64"),
            Some(("127.0.0.1:5000/team/app".into(), "abc-amd64".into()))
        );
        assert_eq!(split("docker.io/library/app:1"), Some(("app".into(), "1".into())));
        assert_eq!(split("127.0.0.1:5000/app"), None);
        assert_eq!(split("app"), None);
        assert_eq!(split(&format!("app:1@sha256:{}", "a".repeat(64))), None);
        assert_eq!(split("Not A Ref"), None);
    }

    #[test]
    fn placeholders_are_not_names_and_only_full_ids_are_ids() {
        let names = vec!["<none>:<none>".to_string(), "app:1".to_string(), "<none>@<none>".to_string()];
        assert_eq!(real_names(names), vec!["app:1".to_string()]);
        assert!(is_image_id(&format!("sha256:{}", "ab".repeat(32))));
        assert!(!is_image_id("sha256:abab"));
        assert!(!is_image_id("app:1"));
        assert!(!is_image_id(&"ab".repeat(32)));
    }
}
