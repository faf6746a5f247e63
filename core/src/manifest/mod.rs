//! `kiln.toml`: an instance's images and where they go.
//!
//! [`Manifest::load`] reads `<dir>/kiln.toml` and resolves it into domain types: paths made
//! absolute and checked, refs parsed and normalized, defaults filled in. Every error names the file,
//! the line and the fix ([`ManifestError`]).
//!
//! # Format
//!
//! ```toml
//! team = "payments"                 # optional: the team that owns the instance on a farm
//! instance = "shop"                 # required: lowercase letters, digits and '-', starting with a
//!                                   # letter, ending with a letter or digit, at most 63 characters
//! platforms = ["linux/amd64"]       # optional: os/arch[/variant] or arch[/variant], or "cluster":
//!                                   # the architectures of the target cluster's nodes; default:
//!                                   # "cluster" for a kind or nodes target, else linux on this
//!                                   # host's architecture
//! root = "../.."                    # optional, relative to this file's folder, which it must hold:
//!                                   # every context and Dockerfile must resolve (symlinks followed)
//!                                   # inside it; default: the enclosing git work tree (the nearest
//!                                   # folder upward holding .git), else this file's folder
//!
//! [target]                          # required: where the images go
//! kind = "registry"                 # required: "registry" | "kind" | "nodes" | "local"
//! registry = "127.0.0.1:5000/team"  # registry: required, host[:port][/prefix]; the host must carry
//!                                   # a '.' or a port, or be localhost, or Docker reads it as a Hub user
//! # cluster = "kind"                # kind: the kind cluster's name (default "kind");
//!                                   # nodes: required, the cluster whose node agents receive the images
//! # namespace = "shop"              # optional: Kubernetes namespace of the kiln-images ConfigMap
//! # mirror_registry = "mirror.internal:5000/upstream"  # optional: where pinned images are re-homed
//!
//! [built.api]                       # an image Kiln builds; the name is lowercase letters, digits, '-'
//! context = "services/api"          # required: a directory, relative to this file's folder,
//!                                   # inside the root
//! dockerfile = "services/api/Dockerfile"  # optional, relative to this file's folder;
//!                                   # default <context>/Dockerfile; may lie outside the context,
//!                                   # never outside the root
//! args = { VERSION = "1" }          # optional build args
//! target = "runtime"                # optional build stage
//! shared = false                    # optional: true marks a base many instances use
//!                                   # (kiln.dev/kind=shared, no instance label)
//! repository = "shop-api"           # optional: default "<instance>-<name>"; the target's registry
//!                                   # is prepended
//! stage = { run = ["pnpm", "deploy", "--filter", "api", "{out}"], remove = ["node_modules/.modules.yaml"] }
//!                                   # optional: the context is what this command writes into the
//!                                   # fresh directory {out} (run in `context`), sealed; see `Stage`
//!
//! [brought.db]                      # an image the user owns: never built, labeled or swept
//! ref = "postgres:16"
//!
//! [pinned.envoy]                    # upstream software deployed by digest: never built or swept
//! ref = "envoyproxy/envoy:v1.30.1@sha256:<64 hex>"   # the @sha256 digest is required
//! ```
//!
//! Image names are unique across `built`, `brought` and `pinned`; an instance needs at least one
//! image and a `[target]` (a missing target would otherwise leave built images nowhere the
//! workloads can pull them, which DESIGN.md requires to fail loudly, naming `registry`).
//!
//! # Bases: a built image FROM another
//!
//! A built image's Dockerfile may build `FROM` another built image of the same manifest (a
//! `shared` base, typically) by writing the base's manifest name, its repository, or its repository
//! on the target — never a tag, since the base's tags are content addresses:
//!
//! ```toml
//! [built.base]                      # base/Dockerfile: FROM scratch …
//! context = "base"
//! shared = true
//!
//! [built.api]                       # api/Dockerfile: FROM base   (or FROM shop-base)
//! context = "api"
//! ```
//!
//! The base is built first, and `api`'s Dockerfile is built with `FROM shop-base:<content tag>`,
//! so `api`'s tag changes whenever `base`'s does. A `FROM` naming a stage declared above it, one
//! with a variable (`FROM ${BASE}`), `scratch`, and any image written with a tag or from another
//! registry are left alone. Images that build FROM each other in a cycle, or an image FROM itself,
//! are a manifest error naming the cycle (`a → b → a`). The rules, and why the address stays
//! honest, are in the `from` module (private; see [`BuiltImage::dockerfile_as_built`]).

mod address;
mod built;
mod error;
mod from;
mod raw;
mod resolve;
mod root;
mod stage;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

pub use address::{Addressed, ImageAddressError};
pub use error::{Escape, ManifestError, Problem};
pub use from::{Base, BuiltDockerfile};
pub use root::RootOrigin;
pub use stage::{Stage, OUT as STAGE_OUT};

use crate::digest::{digest_dir, DigestError, Tree, TreeDigest, WalkOptions};
use crate::refs::{AddressInputs, ContentTagError, ImageRef, PlatformSet};

/// Where a manifest's platform set comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlatformSource {
    /// `platforms = [...]`.
    Listed,
    /// No `platforms`, and a target without a cluster: this machine's platform.
    Host,
    /// The union of the target cluster's node architectures, as the coordinator sees them:
    /// `platforms = "cluster"` (`named`), or no `platforms` with a kind or nodes target. A named
    /// source with no node known fails; an unnamed one keeps this machine's platform.
    Cluster { named: bool },
}

/// The manifest's file name inside an instance folder.
pub const FILE_NAME: &str = "kiln.toml";

/// A resolved `kiln.toml`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// The file it was read from, as given.
    pub path: PathBuf,
    pub instance: String,
    /// The team that owns the instance on a farm (`team = "payments"`); without one, the user who
    /// first converges it does.
    pub team: Option<String>,
    /// The folder every context and Dockerfile must resolve inside (absolute, symlinks resolved):
    /// `root = "…"`, else the enclosing git work tree, else the manifest's folder.
    pub root: PathBuf,
    /// The platform set every built image's content tag names. With a cluster source, this
    /// machine's platform until the cluster's set is known ([`Manifest::with_cluster_platforms`]).
    pub platforms: PlatformSet,
    pub platform_source: PlatformSource,
    pub target: Target,
    /// The Kubernetes namespace of the `kiln-images` ConfigMap, when set.
    pub namespace: Option<String>,
    /// Where pinned images are re-homed, when set.
    pub mirror_registry: Option<RegistryPath>,
    /// In the order they appear in the file.
    pub images: Vec<Image>,
}

impl Manifest {
    /// The manifest with the platform set its cluster reported: every built image is addressed
    /// with it from then on.
    pub fn with_cluster_platforms(mut self, platforms: PlatformSet) -> Manifest {
        self.platforms = platforms;
        self
    }

    /// Reads and resolves `<dir>/kiln.toml`.
    pub fn load(dir: &Path) -> Result<Manifest, ManifestError> {
        let path = dir.join(FILE_NAME);
        let text = std::fs::read_to_string(&path).map_err(|err| {
            let problem = match err.kind() {
                std::io::ErrorKind::NotFound => Problem::NotFound,
                _ => Problem::Unreadable { err },
            };
            ManifestError { path: path.clone(), line: None, problem: Box::new(problem) }
        })?;
        Manifest::parse(&text, &path)
    }

    /// Resolves `text` as if read from `manifest_path`; relative paths in it are taken from that
    /// file's folder, which must exist (contexts are checked on disk).
    pub fn parse(text: &str, manifest_path: &Path) -> Result<Manifest, ManifestError> {
        resolve::resolve(text, manifest_path)
    }

    /// The image named `name`.
    pub fn image(&self, name: &str) -> Option<&Image> {
        self.images.iter().find(|image| image.name == name)
    }

    /// The built images with their names, in file order.
    pub fn built(&self) -> impl Iterator<Item = (&str, &BuiltImage)> {
        self.images.iter().filter_map(|image| match &image.spec {
            ImageSpec::Built(built) => Some((image.name.as_str(), built)),
            _ => None,
        })
    }
}

/// Where an instance's images go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Push to a registry the workloads pull from.
    Registry(RegistryPath),
    /// Load into every node of the named kind cluster.
    Kind { cluster: String },
    /// Stream to every node agent of the named cluster.
    Nodes { cluster: String },
    /// The build host is where the images run.
    Local,
}

impl Target {
    /// The `kind` key's value for this target.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Target::Registry(_) => "registry",
            Target::Kind { .. } => "kind",
            Target::Nodes { .. } => "nodes",
            Target::Local => "local",
        }
    }

    /// The repository name a built image gets on this target: behind the registry and its prefix
    /// for `registry`, unchanged elsewhere.
    pub fn qualify(&self, repository: &str) -> String {
        match self {
            Target::Registry(registry) => registry.qualify(repository),
            _ => repository.to_string(),
        }
    }
}

/// `host[:port][/prefix]`, as the `registry` and `mirror_registry` keys give it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RegistryPath {
    /// `host[:port]`, recognized by Docker as a registry domain.
    pub host: String,
    /// Path components every repository is placed under (`team`, `org/sub`).
    pub prefix: Option<String>,
}

impl RegistryPath {
    /// `host[/prefix]/repository`.
    pub fn qualify(&self, repository: &str) -> String {
        format!("{self}/{repository}")
    }
}

impl fmt::Display for RegistryPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.prefix {
            Some(prefix) => write!(f, "{}/{prefix}", self.host),
            None => f.write_str(&self.host),
        }
    }
}

/// One named image of the instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    pub name: String,
    pub spec: ImageSpec,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageSpec {
    Built(BuiltImage),
    /// A ref the user owns: never built, labeled, swept or inspected.
    Brought(ImageRef),
    /// An upstream `tag@sha256:…`: deployed, never built or swept. Always has a digest.
    Pinned(ImageRef),
}

/// An image Kiln builds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuiltImage {
    /// Absolute, symlinks resolved; an existing directory when the manifest was loaded.
    pub context: PathBuf,
    pub dockerfile: DockerfileLoc,
    pub args: BTreeMap<String, String>,
    pub target: Option<String>,
    /// Marks a base many instances use: `kiln.dev/kind=shared`, no instance label.
    pub shared: bool,
    /// The repository name before the target qualifies it (`shop-api`).
    pub repository: String,
    /// The built images of this manifest its Dockerfile builds `FROM`, as it names them (module
    /// docs, "Bases"); empty for most images.
    pub from: Vec<Base>,
    /// A staged context: the tree this command writes, sealed, is what is hashed and built in
    /// place of `context`, which is only where the command runs and the Dockerfile's default
    /// folder.
    pub stage: Option<Stage>,
}

impl BuiltImage {
    /// The address inputs of this image, given its context's tree digest and its Dockerfile as
    /// built ([`BuiltImage::dockerfile_as_built`]), whose sent bytes — an outside Dockerfile's, or
    /// one rewritten to name its bases by content ref — are an input; a Dockerfile inside the
    /// context built as it is is already covered by the tree digest.
    pub fn address_inputs<'a>(
        &'a self,
        tree: TreeDigest,
        platforms: &'a PlatformSet,
        dockerfile: &'a BuiltDockerfile,
    ) -> AddressInputs<'a> {
        AddressInputs {
            tree,
            dockerfile_outside: dockerfile.sent.as_deref(),
            dockerfile_path: self.dockerfile.rel(),
            build_args: &self.args,
            target: self.target.as_deref(),
            platforms,
        }
    }

    /// The walk options of this image's context: a Dockerfile inside it is always part of it. A
    /// staged tree holds no Dockerfile of the manifest's: its Dockerfile travels beside it.
    pub fn walk_options(&self) -> WalkOptions {
        match &self.dockerfile {
            DockerfileLoc::Inside { rel } if self.stage.is_none() => WalkOptions { dockerfile: Some(rel.clone()) },
            _ => WalkOptions { dockerfile: None },
        }
    }

    /// Walks the context: its entries and tree digest, the first input of the address.
    pub fn walk(&self) -> Result<(Tree, TreeDigest), AddressError> {
        self.walk_with(None)
    }

    /// [`BuiltImage::walk`], taking unchanged files' hashes from the stat cache kept under
    /// `stat_cache` (a directory; one file per context) when given. A staged image is refused:
    /// its context folder is not what it builds (see [`BuiltImage::walk_staged`]).
    pub fn walk_with(&self, stat_cache: Option<&Path>) -> Result<(Tree, TreeDigest), AddressError> {
        if let Some(stage) = &self.stage {
            return Err(AddressError::NotStaged { command: stage.command_line() });
        }
        match stat_cache {
            Some(dir) => {
                let file = crate::digest::cache_file_for(dir, &self.context);
                let (tree, hashed, _) = crate::digest::digest_dir_cached(&self.context, &self.walk_options(), &file)?;
                Ok((tree, hashed.digest))
            }
            None => Ok(digest_dir(&self.context, &self.walk_options())?),
        }
    }

    /// [`BuiltImage::walk_with`] with the stat cache under `stat_cache` and `tag`, what the file
    /// watcher answered for this context just now: a result recorded under the same tag is taken
    /// without walking, and the tree is then `None` ([`crate::digest::digest_dir_vouched`]).
    pub fn walk_vouched(
        &self,
        stat_cache: &Path,
        tag: Option<&[u8]>,
    ) -> Result<(Option<Tree>, crate::digest::Summary), AddressError> {
        if let Some(stage) = &self.stage {
            return Err(AddressError::NotStaged { command: stage.command_line() });
        }
        let file = crate::digest::cache_file_for(stat_cache, &self.context);
        Ok(crate::digest::digest_dir_vouched(&self.context, &self.walk_options(), &file, tag)?)
    }

    /// Walks `staged`, the sealed tree this image's staging command wrote, in place of its
    /// context. No stat cache: every staging writes a fresh directory, so a cache could never hit
    /// and one would be left behind per run.
    pub fn walk_staged(&self, staged: &Path) -> Result<(Tree, TreeDigest), AddressError> {
        Ok(digest_dir(staged, &self.walk_options())?)
    }
}

/// Why a built image could not be addressed.
#[derive(Debug, thiserror::Error)]
pub enum AddressError {
    #[error(transparent)]
    Context(#[from] DigestError),
    #[error("cannot read Dockerfile {path}")]
    Dockerfile {
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("Dockerfile {path} changed while it was read (a FROM naming a built image came or went) — re-run once it is quiet")]
    DockerfileChanged { path: PathBuf },
    #[error("it builds FROM built image {base:?}, which is not addressed yet — address the manifest's images in build order")]
    BaseUnaddressed { base: String },
    #[error("its context was not walked")]
    NotWalked,
    #[error("its context is staged by `{command}`, which must run first — kiln up and kiln refs run it")]
    NotStaged { command: String },
    #[error(transparent)]
    ContentTag(#[from] ContentTagError),
}

/// Where a built image's Dockerfile lies relative to its context. Symlinks are resolved first, so
/// a link inside the context pointing out of it is `Outside`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DockerfileLoc {
    /// Inside the context: the walk always includes it, so the tree digest covers its contents.
    /// `rel` is `/`-separated, relative to the context (`Dockerfile`, `docker/api.Dockerfile`).
    Inside { rel: String },
    /// Outside the context: its contents must go into the image address. `path` is absolute;
    /// `rel` is the path from the context to it (`../worker.Dockerfile`), the same on every
    /// checkout of the tree.
    Outside { path: PathBuf, rel: String },
}

impl DockerfileLoc {
    /// The path relative to the context, for the address and for `docker build -f`.
    pub fn rel(&self) -> &str {
        match self {
            DockerfileLoc::Inside { rel } | DockerfileLoc::Outside { rel, .. } => rel,
        }
    }
}
