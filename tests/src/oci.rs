//! A two-platform image pushed straight into a registry through `oci-client`, with no Docker and
//! no network: per platform a `FROM scratch`-like image (one uncompressed layer tar holding one
//! file, and its config), and an OCI image index naming both. It plays the upstream software a
//! manifest pins (`[pinned.envoy] ref = "…:v1@sha256:<index>"`).

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::{Client, Reference};
use serde_json::json;
use sha2::{Digest, Sha256};

/// What was pushed.
#[derive(Clone, Debug)]
pub struct Pushed {
    /// `<registry>/<repository>:<tag>@<index digest>`: what a manifest pins.
    pub pinned: String,
    /// The index's digest (`sha256:<hex>`).
    pub index: String,
    /// Each platform's manifest digest, amd64 then arm64.
    pub manifests: Vec<String>,
    /// Each platform's layer digest, amd64 then arm64.
    pub layers: Vec<String>,
}

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A client for a plain-HTTP loopback registry.
pub fn client(registry: &str) -> Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(vec![registry.to_string()]),
        use_monolithic_push: true,
        ..ClientConfig::default()
    })
}

/// One tar holding `/payload` with `content`: a layer as a `COPY` of one file makes it.
fn layer(content: &[u8]) -> Vec<u8> {
    let mut tar = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_ustar();
    header.set_size(content.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(&mut header, "payload", content).unwrap();
    tar.into_inner().unwrap()
}

/// Pushes `repository:tag` into `registry` (`127.0.0.1:PORT`): an index of linux/amd64 and
/// linux/arm64, each with a layer of `payload` random bytes. The index carries the annotation
/// `kiln.test=genuine`, which a test may rewrite in the registry's storage (same length) to make
/// it serve bytes the pinned digest does not name.
pub async fn push_two_platform(registry: &str, repository: &str, tag: &str, payload: usize) -> Pushed {
    let client = client(registry);
    let at = |digest: &str| Reference::with_digest(registry.to_string(), repository.to_string(), digest.to_string());
    let mut entries = Vec::new();
    let (mut manifests, mut layers) = (Vec::new(), Vec::new());
    for arch in ["amd64", "arm64"] {
        let mut content = vec![0u8; payload];
        fastrand::fill(&mut content);
        let tar = layer(&content);
        let layer_digest = sha256(&tar);
        let config = serde_json::to_vec(&json!({
            "architecture": arch,
            "os": "linux",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }))
        .unwrap();
        let config_digest = sha256(&config);
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": tar.len()}],
        }))
        .unwrap();
        let manifest_digest = sha256(&manifest);
        client.push_blob(&at(&layer_digest), tar, &layer_digest).await.unwrap();
        client.push_blob(&at(&config_digest), config, &config_digest).await.unwrap();
        let oci_manifest = "application/vnd.oci.image.manifest.v1+json".parse().unwrap();
        client.push_manifest_raw(&at(&manifest_digest), manifest.clone(), oci_manifest).await.unwrap();
        entries.push(json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest,
            "size": manifest.len(),
            "platform": {"architecture": arch, "os": "linux"},
        }));
        manifests.push(manifest_digest);
        layers.push(layer_digest);
    }
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": entries,
        "annotations": {"kiln.test": "genuine"},
    }))
    .unwrap();
    let index_digest = sha256(&index);
    let tagged = Reference::with_tag(registry.to_string(), repository.to_string(), tag.to_string());
    let oci_index = "application/vnd.oci.image.index.v1+json".parse().unwrap();
    client.push_manifest_raw(&tagged, index, oci_index).await.unwrap();
    Pushed { pinned: format!("{registry}/{repository}:{tag}@{index_digest}"), index: index_digest, manifests, layers }
}

/// The digest `registry` answers (`Docker-Content-Digest`) for `repository@<digest>` or, for
/// anything else, `repository:<tag>`; `None` when it holds no such manifest.
pub async fn manifest_digest(registry: &str, repository: &str, digest_or_tag: &str) -> Option<String> {
    let client = client(registry);
    let (registry, repository, wanted) = (registry.to_string(), repository.to_string(), digest_or_tag.to_string());
    let reference = match digest_or_tag.starts_with("sha256:") {
        true => Reference::with_digest(registry, repository, wanted),
        false => Reference::with_tag(registry, repository, wanted),
    };
    client.fetch_manifest_digest(&reference, &oci_client::secrets::RegistryAuth::Anonymous).await.ok()
}
