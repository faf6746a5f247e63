//! Why a node store call failed. Each variant names the socket, ref, blob or archive involved and,
//! where one is known, the fix; the underlying error is the `#[source]`, never repeated.

use kiln_core::refs::RefError;
use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot reach containerd at {socket} — is it running, and is this the socket its [grpc] address names?")]
    Unreachable {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("containerd at {socket} refused `{op} {object}`")]
    Refused {
        socket: PathBuf,
        op: &'static str,
        object: String,
        #[source]
        source: tonic::Status,
    },
    #[error("containerd at {socket} did not answer `{op} {object}` in time — is it overloaded or stuck?")]
    TimedOut { socket: PathBuf, op: &'static str, object: String },
    #[error("containerd at {socket}: blob {digest} is not a valid {what}")]
    BadBlob {
        socket: PathBuf,
        digest: String,
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("containerd at {socket}: blob {digest} is larger than the {limit} bytes a {what} may be")]
    BlobTooLarge { socket: PathBuf, digest: String, what: &'static str, limit: u64 },
    #[error("{reference} is not an image reference containerd can hold")]
    BadReference {
        reference: String,
        #[source]
        source: RefError,
    },
    #[error("import of {reference}: reading the image archive failed; nothing was tagged")]
    ArchiveRead {
        reference: String,
        #[source]
        source: io::Error,
    },
    /// `problem` says what the archive lacks or holds that a `docker save` archive would not.
    #[error("import of {reference}: the archive is not a `docker save` archive of one image ({problem}); nothing was tagged")]
    NotAnImageArchive { reference: String, problem: String },
    #[error("import of {reference}: {what} hashes to {actual}, not {expected} — the archive was corrupted or is not the image asked for; nothing was tagged")]
    DigestMismatch { reference: String, what: String, expected: String, actual: String },
    #[error("CRI at {socket} cannot remove {reference}: the CRI removes whole images only, so name the image id (sha256:…) — a named ref would take every tag of its image")]
    NotAnImageId { socket: PathBuf, reference: String },
    /// `refs` are the refs the CRI still shows, as it spells them.
    #[error("CRI at {socket} removed every name of {id}, but still lists it under {refs}, which the CRI cannot remove (kind's `import-*` ref, or its stale memory of one) — remove that ref with containerd's API (`ctr -n k8s.io images rm`), or restart containerd if it no longer holds it; better, give the agent containerd's socket")]
    HeldByHiddenRefs { socket: PathBuf, id: String, refs: String },
    #[error("CRI at {socket} cannot {what} — give the agent containerd's own socket for that")]
    CriOnly { socket: PathBuf, what: &'static str },
    #[error("the worker thread that {what} stopped before finishing")]
    Worker {
        what: String,
        #[source]
        source: tokio::task::JoinError,
    },
}
