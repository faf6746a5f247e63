//! Importing a `docker save` archive into containerd over its gRPC API.
//!
//! containerd has no import RPC (`ctr import` does this work client-side), so the importer does what
//! `ctr` does: every layer goes into the Content service as it streams in, then the config, then a
//! Docker schema 2 manifest built for them, and last the Images service points the name at that
//! manifest. Everything is written under one lease, so containerd's collector cannot take a layer
//! between its write and the manifest that will keep it; when the import fails, ending the lease
//! leaves the partial content to the collector.
//!
//! The name is created the way a CRI pull creates it: beside it goes the `sha256:<id>` ref the CRI
//! keys images by, and both carry the CRI's `managed` label. Left to itself the CRI plugin adds
//! both a moment later, racing the sweep (it re-creates a ref removed in that window).
//!
//! Verification is by digest: the config must hash to the image id asked for, and each layer to
//! the config's `rootfs.diff_ids` entry in its place. The id thus pins every byte, and a name is
//! only ever pointed at content that was checked.

use super::archive::{self, Failure, Piece, SMALL_LIMIT};
use super::content::{BlobWriter, Committed, Conn};
use super::oci::{self, Descriptor, ImageConfig, Manifest, SavedImage};
use super::{ImportBody, ImportSpec, Imported, NodeError};
use kiln_core::refs::ImageRef;
use kiln_proto::containerd::services::content::v1::content_client::ContentClient;
use kiln_proto::containerd::services::content::v1::{Info, UpdateRequest};
use kiln_proto::containerd::services::images::v1::images_client::ImagesClient;
use kiln_proto::containerd::services::images::v1::{CreateImageRequest, GetImageRequest, Image, UpdateImageRequest};
use kiln_proto::containerd::types::Descriptor as TargetDescriptor;
use std::collections::HashMap;
use tonic::Code;

/// The largest manifest blob a listing reads; real ones are a few kilobytes.
pub(super) const MANIFEST_LIMIT: u64 = 4 << 20;

pub(super) async fn import(conn: &Conn, archive: ImportBody, spec: &ImportSpec) -> Result<Imported, NodeError> {
    let name = ImageRef::parse(&spec.reference)
        .map_err(|source| NodeError::BadReference { reference: spec.reference.clone(), source })?
        .normalized();
    let lease = conn.lease().await?;
    let imported = import_leased(conn, &lease, archive, spec, &name).await;
    conn.end_lease(&lease).await;
    let imported = imported?;
    tracing::info!(socket = %conn.socket.display(), reference = %imported.reference, id = %imported.id, bytes = imported.bytes, "imported");
    Ok(imported)
}

/// What the archive's stream left in the content store and in memory, by archive path.
#[derive(Default)]
struct Received {
    blobs: HashMap<String, (String, u64)>,
    links: HashMap<String, String>,
    small: HashMap<String, Vec<u8>>,
}

impl Received {
    /// The blob at `path`, following `docker save`'s symlinks for repeated layers.
    fn blob(&self, path: &str) -> Option<&(String, u64)> {
        let mut path = path;
        // A link chain longer than the archive has links is a loop.
        for _ in 0..=self.links.len() {
            if let Some(blob) = self.blobs.get(path) {
                return Some(blob);
            }
            path = self.links.get(path)?;
        }
        None
    }
}

async fn import_leased(
    conn: &Conn,
    lease: &str,
    archive: ImportBody,
    spec: &ImportSpec,
    name: &str,
) -> Result<Imported, NodeError> {
    let not_an_image = |problem: String| NodeError::NotAnImageArchive { reference: name.to_string(), problem };
    let received = receive(conn, lease, archive, name).await?;

    let listing = received.small.get("manifest.json").ok_or_else(|| not_an_image("it has no manifest.json".into()))?;
    let saved: Vec<SavedImage> =
        serde_json::from_slice(listing).map_err(|_| not_an_image("its manifest.json does not parse".into()))?;
    // The config a `docker save` of several images holds for the wanted one is the one hashing to its id.
    let mut candidates = Vec::new();
    for image in &saved {
        let bytes = config_bytes(conn, &received, &image.config)
            .await?
            .ok_or_else(|| not_an_image(format!("its manifest.json names {}, which it does not hold", image.config)))?;
        candidates.push((image, bytes));
    }
    let wanted = match candidates.len() {
        0 => return Err(not_an_image("its manifest.json lists no image".into())),
        1 => 0,
        _ => candidates.iter().position(|(_, bytes)| oci::sha256(bytes) == spec.id).unwrap_or(0),
    };
    let (image, config) = &candidates[wanted];
    let config_digest = oci::sha256(config);
    if config_digest != spec.id {
        return Err(NodeError::DigestMismatch {
            reference: name.to_string(),
            what: "the image config".to_string(),
            expected: spec.id.clone(),
            actual: config_digest,
        });
    }
    let parsed: ImageConfig = serde_json::from_slice(config)
        .map_err(|_| not_an_image(format!("its config {} does not parse", image.config)))?;
    if parsed.diff_ids().len() != image.layers.len() {
        return Err(not_an_image(format!(
            "the config lists {} layers and manifest.json {}",
            parsed.diff_ids().len(),
            image.layers.len()
        )));
    }
    let mut layers = Vec::with_capacity(image.layers.len());
    for (i, (path, diff_id)) in image.layers.iter().zip(parsed.diff_ids()).enumerate() {
        let (digest, size) = received
            .blob(path)
            .ok_or_else(|| not_an_image(format!("manifest.json names {path}, which it does not hold")))?;
        if digest != diff_id {
            return Err(NodeError::DigestMismatch {
                reference: name.to_string(),
                what: format!("layer {i} ({path})"),
                expected: diff_id.clone(),
                actual: digest.clone(),
            });
        }
        layers.push(Descriptor { media_type: oci::DOCKER_LAYER.to_string(), digest: digest.clone(), size: *size });
    }

    if received.blob(&image.config).is_none() {
        write_whole(conn, lease, config.clone(), &config_digest, HashMap::new(), format!("config of {name}")).await?;
    }
    let config = Descriptor {
        media_type: oci::DOCKER_CONFIG.to_string(),
        digest: config_digest.clone(),
        size: config.len() as u64,
    };
    let manifest = Manifest { schema_version: 2, media_type: oci::DOCKER_MANIFEST.to_string(), config, layers };
    let manifest_bytes = Manifest::docker(manifest.config.clone(), manifest.layers.clone());
    let manifest_digest = oci::sha256(&manifest_bytes);
    let manifest_size = manifest_bytes.len() as i64;
    let labels = manifest.gc_labels();
    let written =
        write_whole(conn, lease, manifest_bytes, &manifest_digest, labels.clone(), format!("manifest of {name}"))
            .await?;
    if written == Committed::AlreadyPresent {
        // A manifest already there may lack the labels that keep its layers; they are set again.
        label_blob(conn, lease, &manifest_digest, labels).await?;
    }
    let target = TargetDescriptor {
        media_type: oci::DOCKER_MANIFEST.to_string(),
        digest: manifest_digest.clone(),
        size: manifest_size,
        annotations: HashMap::new(),
    };
    // The `sha256:<id>` ref is the one the CRI pins an image's identity to; created here, as a CRI
    // pull does, so the plugin has nothing left to add behind the import's back.
    point(conn, lease, &config_digest, &target, Existing::Keep).await?;
    point(conn, lease, name, &target, Existing::Repoint).await?;
    Ok(Imported { id: config_digest, manifest: manifest_digest, reference: name.to_string(), bytes: manifest.bytes() })
}

/// Streams every layer of the archive into the content store and keeps the small files.
async fn receive(conn: &Conn, lease: &str, archive: ImportBody, name: &str) -> Result<Received, NodeError> {
    let mut pieces = archive::read(archive);
    let mut received = Received::default();
    let mut current: Option<(String, u64, BlobWriter)> = None;
    while let Some(piece) = pieces.recv().await {
        let piece = match piece {
            Ok(piece) => piece,
            Err(failure) => {
                if let Some((_, _, writer)) = current.take() {
                    writer.abort().await;
                }
                return Err(match failure {
                    Failure::Read(source) => NodeError::ArchiveRead { reference: name.to_string(), source },
                    Failure::Malformed(problem) => {
                        NodeError::NotAnImageArchive { reference: name.to_string(), problem }
                    }
                });
            }
        };
        match piece {
            Piece::Start { path, size } => {
                let writer = BlobWriter::open(conn, lease, format!("{path} of {name}"));
                current = Some((path, size, writer));
            }
            Piece::Data(data) => {
                if let Some((_, _, writer)) = current.as_mut() {
                    writer.write(data).await?;
                }
            }
            Piece::End { digest } => {
                if let Some((path, size, writer)) = current.take() {
                    writer.commit(&digest, size, HashMap::new()).await?;
                    received.blobs.insert(path, (digest, size));
                }
            }
            Piece::Small { path, bytes } => {
                received.small.insert(path, bytes);
            }
            Piece::Link { path, target } => {
                received.links.insert(path, target);
            }
        }
    }
    if let Some((path, _, writer)) = current.take() {
        writer.abort().await;
        return Err(NodeError::NotAnImageArchive {
            reference: name.to_string(),
            problem: format!("reading stopped inside {path}"),
        });
    }
    Ok(received)
}

/// The config at `path`: kept in memory (legacy layout) or already streamed into the content
/// store as a blob (OCI layout), whence it is read back.
async fn config_bytes(conn: &Conn, received: &Received, path: &str) -> Result<Option<Vec<u8>>, NodeError> {
    if let Some(bytes) = received.small.get(path) {
        return Ok(Some(bytes.clone()));
    }
    match received.blob(path) {
        Some((digest, _)) => conn.read_blob(digest, "image config", SMALL_LIMIT).await,
        None => Ok(None),
    }
}

async fn write_whole(
    conn: &Conn,
    lease: &str,
    bytes: Vec<u8>,
    digest: &str,
    labels: HashMap<String, String>,
    object: String,
) -> Result<Committed, NodeError> {
    let size = bytes.len() as u64;
    let mut writer = BlobWriter::open(conn, lease, object);
    writer.write(bytes).await?;
    writer.commit(digest, size, labels).await
}

async fn label_blob(conn: &Conn, lease: &str, digest: &str, labels: HashMap<String, String>) -> Result<(), NodeError> {
    let paths = labels.keys().map(|key| format!("labels.{key}")).collect();
    let mut request = UpdateRequest {
        info: Some(Info { digest: digest.to_string(), labels }),
        update_mask: Some(Default::default()),
    };
    if let Some(mask) = request.update_mask.as_mut() {
        mask.paths = paths;
    }
    let mut client = ContentClient::new(conn.channel.clone());
    conn.call("label blob", digest, client.update(conn.request(request, Some(lease)))).await?;
    Ok(())
}

/// The label the CRI plugin puts on the refs it manages. A ref created without it gets it from the
/// plugin's event handler a moment later, by a create-then-update that re-creates the ref if it was
/// removed in between (containerd 1.6); a ref born with it is left alone.
const CRI_MANAGED: (&str, &str) = ("io.cri-containerd.image", "managed");

/// How a ref is to be written when it already exists.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Existing {
    Repoint,
    Keep,
}

/// Creates `name` at `target`, CRI-managed; an existing `name` is re-pointed or kept as `existing` says.
async fn point(
    conn: &Conn,
    lease: &str,
    name: &str,
    target: &TargetDescriptor,
    existing: Existing,
) -> Result<(), NodeError> {
    let mut client = ImagesClient::new(conn.channel.clone());
    let labels = HashMap::from([(CRI_MANAGED.0.to_string(), CRI_MANAGED.1.to_string())]);
    let image = Image { name: name.to_string(), target: Some(target.clone()), labels };
    let create = CreateImageRequest { image: Some(image.clone()) };
    match client.create(conn.request(create, Some(lease))).await {
        Ok(_) => return Ok(()),
        Err(status) if status.code() == Code::AlreadyExists && existing == Existing::Keep => return Ok(()),
        Err(status) if status.code() == Code::AlreadyExists => {}
        Err(status) => return Err(conn.refused("create image", name, status)),
    }
    let get = GetImageRequest { name: name.to_string() };
    let current = conn.call("get image", name, client.get(conn.request(get, None))).await?.into_inner().image;
    let current = current.unwrap_or_default();
    if current.target.is_some_and(|t| t.digest == target.digest)
        && current.labels.get(CRI_MANAGED.0).map(String::as_str) == Some(CRI_MANAGED.1)
    {
        return Ok(());
    }
    let mut update = UpdateImageRequest { image: Some(image), update_mask: Some(Default::default()) };
    if let Some(mask) = update.update_mask.as_mut() {
        mask.paths = vec!["target".to_string(), format!("labels.{}", CRI_MANAGED.0)];
    }
    conn.call("re-point image", name, client.update(conn.request(update, Some(lease)))).await?;
    Ok(())
}
