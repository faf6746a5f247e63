//! A multi-platform image's index, assembled in its registry from the per-platform images the
//! agents pushed (each under its platform ref, `kiln_core::refs::platform_ref`) and put under the
//! content tag — so `docker pull` and containerd on each architecture get their own image.
//!
//! Here, in the coordinator, for the reason the mirror runs here: the coordinator is the one place
//! that sees every platform's result, and the index is a few hundred bytes of JSON naming
//! manifests the registry already holds; no image byte moves through it. Each platform's manifest
//! is pulled and hashed, and its config read back: an image whose config names another
//! architecture than its platform is refused before the index names it.
//!
//! The index's bytes are a function of the platform manifests alone (entries in the content tag's
//! platform order, keys in a fixed order), so rebuilding the same images assembles the same index
//! at the same digest.

use oci_client::secrets::RegistryAuth;
use oci_client::Client;

use super::copy::{sha256, CopyError, Place};

/// The index type when every platform's manifest is Docker's schema 2 (what a daemon's push
/// makes); an OCI index otherwise.
const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// One platform's image, pushed under `reference`.
#[derive(Clone, Debug)]
pub struct Part {
    pub platform: kiln_core::refs::Platform,
    pub reference: kiln_core::refs::ImageRef,
}

/// The index put under the content tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assembled {
    pub digest: String,
    /// Each platform's manifest digest, in the parts' order.
    pub manifests: Vec<String>,
}

/// Why the index could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error(transparent)]
    Registry(#[from] CopyError),
    #[error(
        "{reference} is a {found} image, not {platform} — the agent that built it ignored the platform; \
         nothing was put under the content tag"
    )]
    WrongPlatform { reference: String, platform: String, found: String },
}

/// Puts the index of `parts` under `content` (a ref with a tag), after checking each part.
pub async fn assemble(
    client: &Client,
    content: &kiln_core::refs::ImageRef,
    parts: &[Part],
) -> Result<Assembled, IndexError> {
    let place = Place::of(content);
    let mut entries = Vec::new();
    let mut manifests = Vec::new();
    let mut all_docker = true;
    for part in parts {
        let tag = part.reference.tag().unwrap_or("latest");
        let (bytes, media_type, config) = pull_manifest(client, &Place::of(&part.reference), tag).await?;
        let found = config_platform(client, &place, &part.reference, &config).await?;
        let wanted = (part.platform.os().to_string(), part.platform.arch().to_string());
        if found != wanted {
            return Err(IndexError::WrongPlatform {
                reference: part.reference.to_string(),
                platform: part.platform.oci(),
                found: format!("{}/{}", found.0, found.1),
            });
        }
        all_docker &= media_type == DOCKER_MANIFEST;
        let digest = sha256(&bytes);
        let mut platform = serde_json::json!({ "architecture": part.platform.arch(), "os": part.platform.os() });
        if let Some(variant) = part.platform.variant() {
            platform["variant"] = variant.into();
        }
        entries.push(serde_json::json!({
            "mediaType": media_type,
            "digest": digest,
            "size": bytes.len(),
            "platform": platform,
        }));
        manifests.push(digest);
    }
    let media_type = if all_docker { DOCKER_LIST } else { OCI_INDEX };
    let index = serde_json::json!({ "schemaVersion": 2, "mediaType": media_type, "manifests": entries });
    let bytes = serde_json::to_vec(&index).expect("JSON values serialize");
    let digest = sha256(&bytes);
    let target = place.tagged(content.tag().unwrap_or("latest"));
    let content_type = media_type.parse().expect("a media type is a header value");
    client.push_manifest_raw(&target, bytes, content_type).await.map_err(|err| CopyError::Registry {
        what: "push index",
        reference: target.whole(),
        err,
    })?;
    // The registry must now answer the index's digest for the content tag.
    let got = client
        .fetch_manifest_digest(&target, &RegistryAuth::Anonymous)
        .await
        .map_err(|err| CopyError::Registry { what: "HEAD index", reference: target.whole(), err })?;
    if got != digest {
        return Err(CopyError::DigestDiffers { at: target.whole(), digest, got }.into());
    }
    Ok(Assembled { digest, manifests })
}

/// A platform's manifest as the registry holds it under `tag`: exact bytes, media type, config
/// digest.
async fn pull_manifest(client: &Client, place: &Place, tag: &str) -> Result<(bytes::Bytes, String, String), CopyError> {
    let reference = place.tagged(tag);
    let accept = [DOCKER_MANIFEST, OCI_MANIFEST];
    let (bytes, _) = client
        .pull_manifest_raw(&reference, &RegistryAuth::Anonymous, &accept)
        .await
        .map_err(|err| CopyError::Registry { what: "pull manifest", reference: reference.whole(), err })?;
    let unreadable = |why: String| CopyError::Unreadable { reference: reference.whole(), why };
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))?;
    if json.get("manifests").is_some() {
        return Err(unreadable("it is an index already, not one platform's image".to_string()));
    }
    let media_type = json.get("mediaType").and_then(|m| m.as_str()).unwrap_or(OCI_MANIFEST).to_string();
    let config = json["config"]["digest"].as_str().ok_or_else(|| unreadable("no config digest".to_string()))?;
    Ok((bytes, media_type, config.to_string()))
}

/// The `(os, architecture)` an image config names.
async fn config_platform(
    client: &Client,
    place: &Place,
    reference: &kiln_core::refs::ImageRef,
    config: &str,
) -> Result<(String, String), CopyError> {
    let at = place.at(config);
    let mut bytes = Vec::new();
    client.pull_blob(&at, config, &mut bytes).await.map_err(|err| CopyError::Registry {
        what: "pull config",
        reference: at.whole(),
        err,
    })?;
    let unreadable = |why: String| CopyError::Unreadable { reference: reference.to_string(), why };
    let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| unreadable(format!("config: {e}")))?;
    let field = |key: &str| json.get(key).and_then(|v| v.as_str()).unwrap_or_default().to_string();
    Ok((field("os"), field("architecture")))
}
