//! One pinned image copied registry to registry through `oci-client` (the OCI distribution
//! protocol): the manifest list or index at the pinned digest, every manifest it names, and every
//! blob — streamed from one registry into the other, never landing on disk; a blob the mirror's
//! repository holds is skipped, and one on the same registry is mounted instead of copied.
//!
//! Every manifest is moved as the exact bytes pulled, and those bytes are hashed here: a manifest
//! whose sha256 is not the digest that names it is refused before anything of it is pushed, and
//! after the push the mirror must answer the pinned digest (`Docker-Content-Digest`) for the
//! mirrored ref. So the mirrored ref always names the bytes the pin names, or the copy fails.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest, Sha256};

/// Blobs copied at once: enough to keep two loopback registries busy, few enough for a farm's link.
const PARALLEL_BLOBS: usize = 4;

/// Every manifest type a registry may hold a pinned image as.
const MANIFEST_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// Why a pinned image could not be copied; each names the ref and, when known, the fix.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The bytes that came back are not the ones the pin names: refused, never recorded.
    #[error(
        "{at} serves other bytes than {digest} names (their sha256 is {got}) — the copy is refused; check the \
         pin, and that registry's storage"
    )]
    DigestDiffers { at: String, digest: String, got: String },
    #[error("{what} {reference}")]
    Registry {
        what: &'static str,
        reference: String,
        #[source]
        err: OciDistributionError,
    },
    #[error("manifest {reference} is not JSON the OCI image spec describes: {why}")]
    Unreadable { reference: String, why: String },
}

/// What a copy moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copied {
    pub blobs: u64,
    pub bytes: u64,
    /// Blobs the mirror already held or mounted from the upstream's repository.
    pub reused: u64,
}

/// A parsed `repo@digest` on one registry: what `oci-client` addresses.
#[derive(Clone, Debug)]
pub struct Place {
    pub registry: String,
    pub repository: String,
}

impl Place {
    /// The registry and repository of a ref Kiln already parsed and normalized.
    pub fn of(reference: &kiln_core::refs::ImageRef) -> Place {
        Place { registry: reference.domain().to_string(), repository: reference.path().to_string() }
    }

    /// `registry/repository`, as an error names it.
    fn name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    pub(super) fn at(&self, digest: &str) -> Reference {
        Reference::with_digest(self.registry.clone(), self.repository.clone(), digest.to_string())
    }

    pub(super) fn tagged(&self, tag: &str) -> Reference {
        Reference::with_tag(self.registry.clone(), self.repository.clone(), tag.to_string())
    }
}

/// The client for one copy. Plain HTTP for loopback registries, as Docker allows them insecure by
/// default (and the agent's registry probe does the same); HTTPS with the system's roots otherwise.
pub fn client(registries: &[&str]) -> Client {
    // reqwest is built without a crypto provider of its own (the workspace builds ring, not
    // aws-lc-rs); a process that installed one already keeps it.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let plain: Vec<String> = registries.iter().filter(|r| loopback(r)).map(|r| r.to_string()).collect();
    let config = ClientConfig {
        protocol: ClientProtocol::HttpsExcept(plain),
        // One PUT per blob, with its length: a stream that cannot be replayed needs no chunking.
        use_monolithic_push: true,
        ..ClientConfig::default()
    };
    Client::new(config)
}

fn loopback(registry: &str) -> bool {
    let host = registry.rsplit_once(':').map_or(registry, |(host, _)| host).trim_matches(['[', ']']);
    host == "localhost" || host.starts_with("127.") || host == "::1"
}

/// Whether `mirror` holds a manifest at `digest`: one HEAD. A mirror that answers another digest
/// for it is an error, never "present".
pub async fn present(client: &Client, mirror: &Place, digest: &str) -> Result<bool, CopyError> {
    let reference = mirror.at(digest);
    match client.fetch_manifest_digest(&reference, &RegistryAuth::Anonymous).await {
        Ok(got) if got == digest => Ok(true),
        Ok(got) => Err(CopyError::DigestDiffers { at: mirror.name(), digest: digest.to_string(), got }),
        Err(err) if not_found(&err) => Ok(false),
        Err(OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
            actual, ..
        })) => Err(CopyError::DigestDiffers { at: mirror.name(), digest: digest.to_string(), got: actual }),
        Err(err) => Err(CopyError::Registry { what: "HEAD", reference: reference.whole(), err }),
    }
}

fn not_found(err: &OciDistributionError) -> bool {
    match err {
        OciDistributionError::RegistryError { envelope, .. } => {
            envelope.errors.iter().any(|e| matches!(e.code, OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown))
        }
        OciDistributionError::ServerError { code, .. } => *code == 404,
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        _ => false,
    }
}

/// One manifest as pulled: its exact bytes, its media type and what it names.
struct Pulled {
    digest: String,
    bytes: bytes::Bytes,
    media_type: String,
    /// An index's platform manifests.
    children: Vec<String>,
    /// A manifest's config and layers.
    blobs: Vec<OciDescriptor>,
}

/// Pulls the manifest at `digest` and refuses it unless its bytes hash to `digest`.
async fn pull(client: &Client, upstream: &Place, digest: &str) -> Result<Pulled, CopyError> {
    let reference = upstream.at(digest);
    let (bytes, _) = match client.pull_manifest_raw(&reference, &RegistryAuth::Anonymous, MANIFEST_TYPES).await {
        Ok(pulled) => pulled,
        Err(OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
            actual, ..
        })) => return Err(CopyError::DigestDiffers { at: upstream.name(), digest: digest.to_string(), got: actual }),
        Err(err) => return Err(CopyError::Registry { what: "pull manifest", reference: reference.whole(), err }),
    };
    // Checked here whatever the client checked: the pin is only as good as this comparison.
    let got = sha256(&bytes);
    if got != digest {
        return Err(CopyError::DigestDiffers { at: upstream.name(), digest: digest.to_string(), got });
    }
    let unreadable = |why: String| CopyError::Unreadable { reference: reference.whole(), why };
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))?;
    let descriptors = |key: &str| -> Result<Vec<OciDescriptor>, CopyError> {
        match json.get(key) {
            None => Ok(Vec::new()),
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| unreadable(format!("{key}: {e}"))),
        }
    };
    let children: Vec<String> = descriptors("manifests")?.into_iter().map(|d| d.digest).collect();
    let mut blobs = descriptors("layers")?;
    if let Some(config) = json.get("config") {
        blobs.insert(0, serde_json::from_value(config.clone()).map_err(|e| unreadable(format!("config: {e}")))?);
    }
    // The media type a registry stores it under; an OCI manifest may leave it out, and then its
    // shape says which it is.
    let media_type = match json.get("mediaType").and_then(|m| m.as_str()) {
        Some(m) => m.to_string(),
        None if json.get("manifests").is_some() => MANIFEST_TYPES[0].to_string(),
        None => MANIFEST_TYPES[2].to_string(),
    };
    Ok(Pulled { digest: digest.to_string(), bytes, media_type, children, blobs })
}

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Every manifest under `root` (the pinned digest), children first, and the distinct blobs they
/// name: what a copy must move. Pulling them costs a few small GETs and is what a dry run skips.
async fn walk(client: &Client, upstream: &Place, root: &str) -> Result<(Vec<Pulled>, Vec<OciDescriptor>), CopyError> {
    let mut manifests = Vec::new();
    let mut queue = vec![root.to_string()];
    let mut seen = BTreeSet::new();
    while let Some(digest) = queue.pop() {
        if !seen.insert(digest.clone()) {
            continue;
        }
        let pulled = pull(client, upstream, &digest).await?;
        queue.extend(pulled.children.iter().cloned());
        manifests.push(pulled);
    }
    let mut names = BTreeSet::new();
    let blobs = manifests.iter().flat_map(|m| m.blobs.iter()).filter(|b| names.insert(b.digest.clone())).cloned();
    let blobs = blobs.collect();
    // A parent is pushed after what it names, so the mirror never holds a dangling index.
    manifests.reverse();
    Ok((manifests, blobs))
}

/// Copies the image at `digest` from `upstream` into `mirror`, tagging it `tag` there when given;
/// `moved` counts blob bytes as they stream, for progress. `total` is told the bytes to copy
/// once they are known.
pub async fn copy(
    client: &Client,
    upstream: &Place,
    mirror: &Place,
    digest: &str,
    tag: Option<&str>,
    moved: Arc<AtomicU64>,
    total: Arc<AtomicU64>,
) -> Result<Copied, CopyError> {
    let (manifests, blobs) = walk(client, upstream, digest).await?;
    let same_registry = upstream.registry == mirror.registry;
    let mut missing = Vec::new();
    let mut copied = Copied::default();
    for blob in blobs {
        let reference = mirror.at(&blob.digest);
        let held = client.blob_exists(&reference, &blob.digest).await;
        match held.map_err(|err| CopyError::Registry { what: "HEAD blob", reference: reference.whole(), err })? {
            true => copied.reused += 1,
            false if same_registry => {
                let mounting = client.mount_blob(&reference, &upstream.at(&blob.digest), &blob.digest).await;
                match mounting {
                    Ok(()) => copied.reused += 1,
                    // A registry may decline a mount (another repository's access): copy it then.
                    Err(_) => missing.push(blob),
                }
            }
            false => missing.push(blob),
        }
    }
    total.store(missing.iter().map(|b| b.size.max(0) as u64).sum(), Ordering::Relaxed);
    let streams = futures_util::stream::iter(missing.into_iter().map(|blob| {
        let moved = moved.clone();
        async move { copy_blob(client, upstream, mirror, &blob, moved).await.map(|()| blob.size.max(0) as u64) }
    }));
    let sizes: Vec<u64> = streams.buffer_unordered(PARALLEL_BLOBS).try_collect().await?;
    copied.blobs = sizes.len() as u64;
    copied.bytes = sizes.iter().sum();

    for manifest in &manifests {
        let is_root = manifest.digest == digest;
        let reference = match (is_root, tag) {
            (true, Some(tag)) => mirror.tagged(tag),
            _ => mirror.at(&manifest.digest),
        };
        let content_type = manifest.media_type.parse().map_err(|_| CopyError::Unreadable {
            reference: reference.whole(),
            why: format!("media type {:?} is no header value", manifest.media_type),
        })?;
        client
            .push_manifest_raw(&reference, manifest.bytes.clone(), content_type)
            .await
            .map_err(|err| CopyError::Registry { what: "push manifest", reference: reference.whole(), err })?;
    }
    // The mirror must now answer the pinned digest for the mirrored ref: what it stored is what
    // was pulled, or the copy is refused before anything records it.
    if !present(client, mirror, digest).await? {
        return Err(CopyError::DigestDiffers {
            at: mirror.name(),
            digest: digest.to_string(),
            got: "nothing (the manifest pushed is not there)".to_string(),
        });
    }
    Ok(copied)
}

async fn copy_blob(
    client: &Client,
    upstream: &Place,
    mirror: &Place,
    blob: &OciDescriptor,
    moved: Arc<AtomicU64>,
) -> Result<(), CopyError> {
    let from = upstream.at(&blob.digest);
    // oci-client hashes the stream as it passes and fails it at the end on a mismatch; the mirror
    // checks the digest again when the upload is committed.
    let stream = client.pull_blob_stream(&from, blob).await.map_err(|err| CopyError::Registry {
        what: "pull blob",
        reference: from.whole(),
        err,
    })?;
    let counted = stream.stream.map(move |chunk| {
        let chunk = chunk.map_err(OciDistributionError::from)?;
        moved.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        Ok(chunk)
    });
    let to = mirror.at(&blob.digest);
    client
        .push_blob_stream(&to, counted, &blob.digest, Some(blob.size.max(0) as u64))
        .await
        .map_err(|err| CopyError::Registry { what: "push blob", reference: to.whole(), err })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_registries_are_plain_http_and_others_are_not() {
        assert!(loopback("127.0.0.1:5000"));
        assert!(loopback("localhost:5000"));
        assert!(loopback("[::1]:5000"));
        assert!(!loopback("registry.farm.internal:5000"));
        assert!(!loopback("docker.io"));
    }

    #[test]
    fn the_digest_is_sha256_over_the_exact_bytes() {
        assert_eq!(sha256(b""), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    }
}
