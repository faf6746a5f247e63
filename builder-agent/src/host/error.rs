//! Why a host store call failed. Each variant names the daemon, image, tag or file involved and,
//! where one is known, the fix; the underlying error is the `#[source]`, never repeated.

use kiln_core::archive::ArchiveError;
use kiln_core::refs::RefError;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("DOCKER_HOST={host} is not a unix:// or tcp:// address — the agent reaches Docker only through those")]
    UnsupportedHost { host: String },
    #[error("cannot reach the Docker daemon at {host} — is it running?")]
    Unreachable {
        host: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "lost the connection to the Docker daemon at {host} during `{op} {object}` — check the daemon is still running"
    )]
    Lost {
        host: String,
        op: &'static str,
        object: String,
        #[source]
        source: io::Error,
    },
    #[error("the Docker daemon at {host} did not answer `{op} {object}` in time — is it overloaded or stuck?")]
    TimedOut { host: String, op: &'static str, object: String },
    #[error("the Docker daemon at {host} refused `{op} {object}`")]
    Refused {
        host: String,
        op: &'static str,
        object: String,
        #[source]
        source: bollard::errors::Error,
    },
    /// `step` carries the failing step (`Step 2/3 : COPY missing /`) and the daemon's message.
    #[error("no node container of kind cluster {cluster} runs on this Docker daemon (none labeled io.x-k8s.kind.cluster={cluster}) — create it (`kind create cluster --name {cluster}`) or start its nodes")]
    NoKindNodes { cluster: String },
    /// `why` is what `ctr` said on the node (its stderr), not a Rust error.
    #[error("loading {reference} into kind node {node} failed: {why}")]
    KindImport { node: String, reference: String, why: String },
    #[error("build of {tag} failed at {step}")]
    BuildFailed { tag: String, step: String },
    #[error("push of {reference} failed: {why}")]
    PushFailed { reference: String, why: String },
    /// The daemon could not connect to the registry at all: nothing of the push was delivered, so
    /// it may be sent again.
    #[error("push of {reference} failed: the registry refused the connection: {why}")]
    RegistryRefused { reference: String, why: String },
    #[error("{reference} does not name exactly one tag — pushes and untags take `repo:tag`, with no digest")]
    NotPushable {
        reference: String,
        #[source]
        source: Option<RefError>,
    },
    #[error("{id} is not a full image id — whole-image removals take `sha256:` and 64 hex digits")]
    NotAnImageId { id: String },
    #[error("cannot read the context archive {archive}")]
    ContextUnreadable {
        archive: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("context archive {archive} was refused; nothing was built from it")]
    ContextRefused {
        archive: PathBuf,
        #[source]
        source: ArchiveError,
    },
    #[error("context archive {archive} holds {name}, the name Kiln reserves for a Dockerfile kept outside the context — rename that file in the context")]
    ReservedName { archive: PathBuf, name: &'static str },
    #[error("context archive {archive}: its .dockerignore is not a regular file, so a Dockerfile kept outside the context cannot be hidden from the build — make .dockerignore a file")]
    IgnoreNotAFile { archive: PathBuf },
    #[error("cannot make a scratch directory under {scratch} — create it, or point the agent at a writable directory")]
    Scratch {
        scratch: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the worker thread that {what} stopped before finishing")]
    Worker {
        what: String,
        #[source]
        source: tokio::task::JoinError,
    },
}
