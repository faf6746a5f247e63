//! The image formats a node store reads and writes: Docker schema 2 and OCI manifests and indexes,
//! the image config, and the `manifest.json` of a `docker save` archive. Pure: bytes in, values out.
//!
//! The manifest an import writes is byte-for-byte the one `ctr images import` writes for the same
//! archive (same fields, same order, no whitespace), so a node that took an image from kind's loader
//! and from Kiln holds one manifest, not two that differ by formatting.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::collections::{BTreeMap, HashMap};

pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// An uncompressed layer tar: what `docker save` holds, so no recompression is needed.
pub const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// The label on a manifest blob that keeps its config from containerd's garbage collector.
const GC_REF_CONFIG: &str = "containerd.io/gc.ref.content.config";
/// The prefix of the labels that keep its layers (`…l.0`, `…l.1`).
const GC_REF_LAYER: &str = "containerd.io/gc.ref.content.l.";

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
}

/// A single-platform manifest, Docker schema 2 or OCI; field order is the serialized order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

impl Manifest {
    /// The Docker schema 2 manifest for a config and its uncompressed layers, as JSON bytes.
    pub fn docker(config: Descriptor, layers: Vec<Descriptor>) -> Vec<u8> {
        let manifest = Manifest { schema_version: 2, media_type: DOCKER_MANIFEST.to_string(), config, layers };
        serde_json::to_vec(&manifest).expect("a manifest always serializes")
    }

    /// Config and layer bytes: what the image costs the node, as a listing reports it.
    pub fn bytes(&self) -> u64 {
        self.config.size + self.layers.iter().map(|layer| layer.size).sum::<u64>()
    }

    /// The labels that make containerd's collector keep the config and layers while the manifest is
    /// kept. Without them the blobs are collectable the moment the import's lease ends.
    pub fn gc_labels(&self) -> HashMap<String, String> {
        let mut labels = HashMap::from([(GC_REF_CONFIG.to_string(), self.config.digest.clone())]);
        for (i, layer) in self.layers.iter().enumerate() {
            labels.insert(format!("{GC_REF_LAYER}{i}"), layer.digest.clone());
        }
        labels
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct Index {
    #[serde(default)]
    pub manifests: Vec<IndexEntry>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct IndexEntry {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub platform: Option<IndexPlatform>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct IndexPlatform {
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub architecture: String,
}

impl Index {
    /// The manifest for `os/arch`, else the first manifest: a node runs its own platform, and an
    /// index without one still names one image's worth of content.
    pub fn pick(&self, os: &str, arch: &str) -> Option<&IndexEntry> {
        let is_manifest = |e: &&IndexEntry| e.media_type != OCI_INDEX && e.media_type != DOCKER_MANIFEST_LIST;
        self.manifests
            .iter()
            .filter(is_manifest)
            .find(|e| e.platform.as_ref().is_some_and(|p| p.os == os && p.architecture == arch))
            .or_else(|| self.manifests.iter().find(is_manifest))
    }
}

/// The parts of an image config a node store needs.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub config: Option<RunConfig>,
    #[serde(default)]
    pub rootfs: Option<RootFs>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct RunConfig {
    #[serde(rename = "Labels", default)]
    pub labels: Option<BTreeMap<String, String>>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct RootFs {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

impl ImageConfig {
    pub fn labels(&self) -> BTreeMap<String, String> {
        self.config.as_ref().and_then(|c| c.labels.clone()).unwrap_or_default()
    }

    pub fn diff_ids(&self) -> &[String] {
        self.rootfs.as_ref().map(|r| r.diff_ids.as_slice()).unwrap_or_default()
    }
}

/// One image of a `docker save` archive's `manifest.json`: paths inside the archive.
#[derive(Clone, Debug, Deserialize)]
pub struct SavedImage {
    #[serde(rename = "Config")]
    pub config: String,
    #[serde(rename = "Layers", default)]
    pub layers: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(media_type: &str, digest: &str, size: u64) -> Descriptor {
        Descriptor { media_type: media_type.to_string(), digest: digest.to_string(), size }
    }

    #[test]
    fn the_docker_manifest_is_the_one_ctr_import_writes() {
        // Taken from `ctr -n k8s.io images import` of a two-layer `docker save` archive on this
        // machine's containerd 1.6: the same bytes mean the same manifest digest on every node.
        let expected = r#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json","config":{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"sha256:9103416b6f164498e0f651c479fe95b3d9d7de00192ecc02dfda5d0fedb0757b","size":1850},"layers":[{"mediaType":"application/vnd.docker.image.rootfs.diff.tar","digest":"sha256:2d467db3a012927091d28835811c342e601a2d54e3087536fee573d3e33fde04","size":2048},{"mediaType":"application/vnd.docker.image.rootfs.diff.tar","digest":"sha256:cc2a7437bc24e6a8a5ce411030ed562ea4b8162e45813d1e6684df4e0aa8f382","size":2048}]}"#;
        let written = Manifest::docker(
            descriptor(DOCKER_CONFIG, "sha256:9103416b6f164498e0f651c479fe95b3d9d7de00192ecc02dfda5d0fedb0757b", 1850),
            vec![
                descriptor(
                    DOCKER_LAYER,
                    "sha256:2d467db3a012927091d28835811c342e601a2d54e3087536fee573d3e33fde04",
                    2048,
                ),
                descriptor(
                    DOCKER_LAYER,
                    "sha256:cc2a7437bc24e6a8a5ce411030ed562ea4b8162e45813d1e6684df4e0aa8f382",
                    2048,
                ),
            ],
        );
        assert_eq!(String::from_utf8(written).unwrap(), expected);
        assert_eq!(
            sha256(expected.as_bytes()),
            "sha256:4e8acf4c42fe2ce1ac83f4a1a159c827ddf579d17d178d549ced42c8b854e26a"
        );
    }

    #[test]
    fn gc_labels_name_the_config_and_every_layer_by_position() {
        let manifest = Manifest {
            schema_version: 2,
            media_type: DOCKER_MANIFEST.into(),
            config: descriptor(DOCKER_CONFIG, "sha256:c", 10),
            layers: vec![descriptor(DOCKER_LAYER, "sha256:a", 100), descriptor(DOCKER_LAYER, "sha256:a", 100)],
        };
        let labels = manifest.gc_labels();
        assert_eq!(labels.len(), 3);
        assert_eq!(labels["containerd.io/gc.ref.content.config"], "sha256:c");
        assert_eq!(labels["containerd.io/gc.ref.content.l.0"], "sha256:a");
        assert_eq!(labels["containerd.io/gc.ref.content.l.1"], "sha256:a");
        assert_eq!(manifest.bytes(), 210);
    }

    #[test]
    fn an_index_picks_the_nodes_platform_then_the_first_manifest() {
        let index: Index = serde_json::from_str(
            r#"{"manifests":[
                {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:arm","platform":{"os":"linux","architecture":"arm64"}},
                {"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:amd","platform":{"os":"linux","architecture":"amd64"}}
            ]}"#,
        )
        .unwrap();
        assert_eq!(index.pick("linux", "amd64").unwrap().digest, "sha256:amd");
        assert_eq!(index.pick("linux", "s390x").unwrap().digest, "sha256:arm");
        let empty: Index = serde_json::from_str("{}").unwrap();
        assert!(empty.pick("linux", "amd64").is_none());
    }

    #[test]
    fn a_config_without_labels_or_rootfs_reads_as_empty() {
        let config: ImageConfig = serde_json::from_str(r#"{"architecture":"amd64","config":{}}"#).unwrap();
        assert!(config.labels().is_empty());
        assert!(config.diff_ids().is_empty());
        let config: ImageConfig = serde_json::from_str(
            r#"{"config":{"Labels":{"kiln.dev/kind":"image"}},"rootfs":{"type":"layers","diff_ids":["sha256:a"]}}"#,
        )
        .unwrap();
        assert_eq!(config.labels()["kiln.dev/kind"], "image");
        assert_eq!(config.diff_ids(), ["sha256:a".to_string()]);
    }
}
