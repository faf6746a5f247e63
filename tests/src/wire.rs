//! A raw client of the coordinator's gRPC services, for tests that must say what the `kiln` CLI
//! never would (an upload whose bytes do not match its digest) or that check the protocol itself.

use kiln_core::archive::pack;
use kiln_core::digest::walk_tree;
use kiln_core::manifest::{ImageSpec, Manifest};
use kiln_proto::v1 as pb;
use std::collections::BTreeMap;
use std::path::PathBuf;
use tonic::transport::Channel;

pub fn channel(url: &str) -> Channel {
    tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect_lazy()
}

/// The `UpRequest` for an instance folder, and where each context digest's directory is.
pub fn up_request(dir: &std::path::Path, force: bool) -> (pb::UpRequest, Contexts) {
    let manifest = Manifest::load(dir).unwrap();
    let mut contexts = BTreeMap::new();
    let mut images = Vec::new();
    // As the CLI addresses them: bases before the images built FROM them, whose Dockerfiles then
    // name the bases' content refs (`Manifest::address`).
    let (addressed, _) = manifest.walk_and_address().unwrap();
    let mut addressed = addressed.into_iter();
    for image in &manifest.images {
        let spec = match &image.spec {
            ImageSpec::Built(_) => {
                let done = addressed.next().unwrap();
                let b = done.image;
                contexts.insert(done.tree.to_string(), (b.context.clone(), b.walk_options()));
                let sent = done.dockerfile.sent.unwrap_or_default();
                pb::ImageSpec {
                    name: done.name.to_string(),
                    kind: pb::image_spec::Kind::Built as i32,
                    reference: done.reference.to_string(),
                    context_digest: done.tree.to_string(),
                    dockerfile: if sent.is_empty() { b.dockerfile.rel().to_string() } else { String::new() },
                    dockerfile_outside: sent,
                    args: b.args.clone().into_iter().collect(),
                    target_stage: b.target.clone().unwrap_or_default(),
                    shared: b.shared,
                    // As the CLI sends it: the hash of the Dockerfile as built.
                    dockerfile_digest: done.dockerfile.digest,
                    // As the CLI sends it: what the coordinator recomputes the address from.
                    dockerfile_path: b.dockerfile.rel().to_string(),
                    from: b.base_names().into_iter().map(str::to_string).collect(),
                }
            }
            ImageSpec::Brought(r) | ImageSpec::Pinned(r) => pb::ImageSpec {
                name: image.name.clone(),
                kind: if matches!(image.spec, ImageSpec::Brought(_)) {
                    pb::image_spec::Kind::Brought
                } else {
                    pb::image_spec::Kind::Pinned
                } as i32,
                reference: r.to_string(),
                ..Default::default()
            },
        };
        images.push(spec);
    }
    let target = match &manifest.target {
        kiln_core::manifest::Target::Registry(r) => {
            pb::Target { kind: pb::target::Kind::Registry as i32, registry: r.to_string(), ..Default::default() }
        }
        kiln_core::manifest::Target::Kind { cluster } => {
            pb::Target { kind: pb::target::Kind::Kind as i32, cluster: cluster.clone(), ..Default::default() }
        }
        kiln_core::manifest::Target::Nodes { cluster } => {
            pb::Target { kind: pb::target::Kind::Nodes as i32, cluster: cluster.clone(), ..Default::default() }
        }
        kiln_core::manifest::Target::Local => pb::Target { kind: pb::target::Kind::Local as i32, ..Default::default() },
    };
    let mirror_registry = manifest.mirror_registry.as_ref().map(ToString::to_string).unwrap_or_default();
    let req = pb::UpRequest {
        instance: manifest.instance.clone(),
        target: Some(pb::Target { mirror_registry, ..target }),
        platforms: manifest.platforms.oci().split(',').map(str::to_string).collect(),
        images,
        force,
        requested_by: "e2e".to_string(),
        dry_run: false,
        team: manifest.team.clone().unwrap_or_default(),
        mirror_only: false,
    };
    (req, contexts)
}

/// Uploads `data` claiming `digest`, in 1 MiB chunks.
pub async fn upload(url: &str, digest: &str, data: Vec<u8>) -> Result<pb::UploadReply, tonic::Status> {
    let mut chunks: Vec<pb::UploadChunk> =
        data.chunks(1 << 20).map(|c| pb::UploadChunk { digest: String::new(), data: c.to_vec().into() }).collect();
    if chunks.is_empty() {
        chunks.push(pb::UploadChunk::default());
    }
    chunks[0].digest = digest.to_string();
    let mut client = pb::content_store_client::ContentStoreClient::new(channel(url));
    client.upload(tokio_stream::iter(chunks)).await.map(|r| r.into_inner())
}

/// Runs `Up`, uploading the contexts asked for, and returns every event.
pub async fn up(url: &str, dir: &std::path::Path, force: bool) -> Vec<pb::ConvergeEvent> {
    up_as(url, dir, |req| req.force = force).await
}

/// `Up --dry-run`: its events; it must never ask for a context.
pub async fn up_dry(url: &str, dir: &std::path::Path, force: bool) -> Vec<pb::ConvergeEvent> {
    let events = up_as(url, dir, |req| (req.force, req.dry_run) = (force, true)).await;
    assert!(events.iter().all(|e| e.kind() != pb::converge_event::Kind::NeedContexts), "{events:#?}");
    events
}

/// Runs `Up` with the request `edit` made of the instance folder's, uploading what is asked for.
pub async fn up_as(url: &str, dir: &std::path::Path, edit: impl FnOnce(&mut pb::UpRequest)) -> Vec<pb::ConvergeEvent> {
    let (mut req, contexts) = up_request(dir, false);
    edit(&mut req);
    up_prepared(url, req, &contexts).await
}

/// Where each context digest of an `UpRequest` lives, as `up_request` found it.
pub type Contexts = BTreeMap<String, (PathBuf, kiln_core::digest::WalkOptions)>;

/// Runs an `Up` whose request was made beforehand (the walk and hashing are the client's work,
/// which a load generator does before it starts the clock), uploading what is asked for.
pub async fn up_prepared(url: &str, req: pb::UpRequest, contexts: &Contexts) -> Vec<pb::ConvergeEvent> {
    let mut client = pb::kiln_client::KilnClient::new(channel(url));
    let mut stream = client.up(req).await.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        if event.kind() == pb::converge_event::Kind::NeedContexts {
            for digest in &event.contexts {
                let (dir, opts) = &contexts[digest];
                let tree = walk_tree(dir, opts).unwrap();
                let mut bytes = Vec::new();
                pack(&tree, &mut bytes).unwrap();
                upload(url, digest, bytes).await.unwrap();
            }
        }
        events.push(event);
    }
    events
}

/// The events of one kind, by image name.
pub fn images_with(events: &[pb::ConvergeEvent], kind: pb::converge_event::Kind) -> Vec<String> {
    events.iter().filter(|e| e.kind() == kind).map(|e| e.image.clone()).collect()
}

/// Reads a job's events (gc, down) to its end.
async fn collect(
    response: Result<tonic::Response<tonic::Streaming<pb::ConvergeEvent>>, tonic::Status>,
) -> Vec<pb::ConvergeEvent> {
    let mut stream = response.unwrap().into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        events.push(event);
    }
    events
}

/// Runs `Gc` and returns every event.
pub async fn gc(url: &str, dry_run: bool, instance: Option<&str>) -> Vec<pb::ConvergeEvent> {
    let mut client = pb::kiln_client::KilnClient::new(channel(url));
    let request =
        pb::GcRequest { dry_run, instance: instance.unwrap_or_default().to_string(), requested_by: "e2e".to_string() };
    collect(client.gc(request).await).await
}

/// Runs `Down` for `instance` and returns every event.
pub async fn down(url: &str, instance: &str) -> Vec<pb::ConvergeEvent> {
    let mut client = pb::kiln_client::KilnClient::new(channel(url));
    let request = pb::DownRequest { instance: instance.to_string(), requested_by: "e2e".to_string() };
    collect(client.down(request).await).await
}

/// Pins (`pin = true`) or unpins `reference`; the reply lists every pin after the call.
pub async fn pin(url: &str, reference: &str, pin: bool) -> pb::PinsReply {
    let mut client = pb::kiln_client::KilnClient::new(channel(url));
    let request = pb::PinRequest { reference: reference.to_string(), requested_by: "e2e".to_string() };
    let reply = if pin { client.pin(request).await } else { client.unpin(request).await };
    reply.unwrap().into_inner()
}

/// The refs of a sweep's events of one kind (`Planned`, `Removed`, `NotRemoved`), sorted.
pub fn swept_refs(events: &[pb::ConvergeEvent], kind: pb::converge_event::Kind) -> Vec<String> {
    let mut refs: Vec<String> = events.iter().filter(|e| e.kind() == kind).map(|e| e.reference.clone()).collect();
    refs.sort();
    refs
}

/// True when the job's last event is a succeeded `Finished`.
pub fn succeeded(events: &[pb::ConvergeEvent]) -> bool {
    events
        .last()
        .is_some_and(|e| e.kind() == pb::converge_event::Kind::Finished && e.outcome() == pb::Outcome::Succeeded)
}
