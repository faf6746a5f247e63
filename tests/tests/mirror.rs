//! `mirror_registry` against two real registries: one plays the upstream holding a two-platform
//! pinned image (pushed with no Docker, `kiln_e2e::oci`), the other the mirror. A converge copies
//! the whole index into the mirror at the same digest and records the mirrored ref; a second one
//! makes one HEAD and copies nothing; an upstream serving bytes the pin does not name is refused
//! and nothing is recorded; `kiln mirror --dry-run` and `kiln up --dry-run` list the copy they would
//! make and make none.

use kiln::render::plain::Plain;
use kiln_e2e::fixture::unique;
use kiln_e2e::oci::{manifest_digest, push_two_platform};
use kiln_e2e::wire::{channel, images_with, succeeded, up, up_dry};
use kiln_e2e::{Farm, Registry};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::path::{Path, PathBuf};

/// An instance whose only image is `pinned`, re-homed into `mirror`.
fn instance(root: &Path, name: &str, mirror: &str, pinned: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let toml = format!(
        "instance = \"{name}\"\n\n[target]\nkind = \"local\"\nmirror_registry = \"{mirror}\"\n\n\
         [pinned.envoy]\nref = \"{pinned}\"\n"
    );
    std::fs::write(dir.join("kiln.toml"), toml).unwrap();
    dir
}

async fn recorded(url: &str, instance: &str) -> Option<pb::InstanceStatus> {
    let mut client = pb::kiln_client::KilnClient::new(channel(url));
    let reply = client.status(pb::StatusRequest { instance: instance.to_string() }).await.unwrap().into_inner();
    reply.instances.into_iter().find(|i| i.instance == instance)
}

/// `kiln mirror [--dry-run] DIR` as a user runs it, against `connect`: its plain output.
async fn kiln_mirror(connect: kiln::Connect, dir: &Path, dry_run: bool) -> (kiln::UpOutcome, String) {
    let args = kiln::MirrorArgs { dir: dir.to_path_buf(), dry_run, connect, output: kiln::OutputMode::Plain };
    let mut out = Plain::new(Vec::new());
    let outcome = kiln::mirror_with(&args, &mut out).await.unwrap();
    (outcome, String::from_utf8(out.into_inner()).unwrap())
}

fn blob_held(registry: &Registry, repository: &str, digest: &str) -> bool {
    let (status, _, _) = registry.request("HEAD", &format!("/v2/{repository}/blobs/{digest}"), &[]).unwrap();
    status == 200
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_image_is_copied_whole_at_its_digest_and_only_once() {
    let (upstream, mirror) = (Registry::start(), Registry::start());
    let pushed = push_two_platform(&upstream.addr, "upstream/envoy", "v1", 64 * 1024).await;
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("mirror");
    let dir = instance(tmp.path(), &name, &format!("{}/mirror", mirror.addr), &pushed.pinned);
    let mirrored = format!("{}/mirror/envoy:v1@{}", mirror.addr, pushed.index);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    // The dry run names the copy, and makes none.
    let (outcome, text) = kiln_mirror(kiln::Connect::remote(&farm.url), &dir, true).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert!(text.contains(&format!("envoy    would copy {} → {mirrored}", pushed.pinned)), "{text}");
    assert_eq!(manifest_digest(&mirror.addr, "mirror/envoy", &pushed.index).await, None, "a dry run copies nothing");
    let events = up_dry(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::WouldMirror), ["envoy"], "{events:#?}");
    assert!(recorded(&farm.url, &name).await.is_none_or(|r| r.generation == 0), "a dry run records nothing");

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Mirrored), ["envoy"]);
    let copied = events.iter().find(|e| e.kind() == Kind::Mirrored).unwrap();
    assert_eq!((copied.reference.as_str(), copied.count), (mirrored.as_str(), 4), "2 layers, 2 configs");

    // The same digest, for the index and for every platform's manifest, and every layer there.
    let answered = manifest_digest(&mirror.addr, "mirror/envoy", &pushed.index).await;
    assert_eq!(answered.as_deref(), Some(pushed.index.as_str()));
    for manifest in &pushed.manifests {
        assert_eq!(manifest_digest(&mirror.addr, "mirror/envoy", manifest).await.as_deref(), Some(manifest.as_str()));
    }
    assert!(pushed.layers.iter().all(|layer| blob_held(&mirror, "mirror/envoy", layer)));
    let tagged = manifest_digest(&mirror.addr, "mirror/envoy", "v1").await;
    assert_eq!(tagged.as_deref(), Some(pushed.index.as_str()), "the tag names the pinned digest");

    let record = recorded(&farm.url, &name).await.expect("the converge recorded the instance");
    let envoy = record.images.iter().find(|i| i.name == "envoy").unwrap();
    assert_eq!(envoy.reference, mirrored, "the record names the mirrored ref");

    // A second converge asks the mirror one HEAD and the upstream nothing.
    let (upstream_before, mirror_before) = (upstream.requests().len(), mirror.requests().len());
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::InMirror), ["envoy"]);
    assert!(images_with(&events, Kind::Mirrored).is_empty(), "{events:#?}");
    // oci-client checks the API version (`GET /v2/`) before each request to a registry that asks
    // no auth, as this one does; that ping is not counted.
    let asked: Vec<String> =
        mirror.requests().split_off(mirror_before).into_iter().filter(|r| r != "GET /v2/").collect();
    assert_eq!(asked, [format!("HEAD /v2/mirror/envoy/manifests/{}", pushed.index)]);
    assert_eq!(upstream.requests().len(), upstream_before, "the upstream is not asked again");

    let (outcome, text) = kiln_mirror(kiln::Connect::remote(&farm.url), &dir, false).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert!(text.contains(&format!("envoy    in mirror: {mirrored}")), "{text}");
    farm.stop().await;

    // The embedded default starts no host agent for it: a copy needs no Docker daemon.
    let (outcome, text) = kiln_mirror(kiln::Connect::embedded_in(tmp.path().join("laptop")), &dir, false).await;
    assert_eq!(outcome.exit(), kiln::Exit::Converged, "{text}");
    assert!(text.contains(&format!("envoy    in mirror: {mirrored}")), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_serving_other_bytes_than_the_pin_is_refused_and_nothing_recorded() {
    let (upstream, mirror) = (Registry::start(), Registry::start());
    let pushed = push_two_platform(&upstream.addr, "upstream/envoy", "v1", 1024).await;
    // The registry's stored index, rewritten in place: it now serves other bytes under the digest
    // the manifest pins, as a tampered or corrupted upstream would.
    let file = upstream.blob_file(&pushed.index);
    let genuine = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, genuine.replace("genuine", "forgery")).unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let name = unique("tamper");
    let dir = instance(tmp.path(), &name, &format!("{}/mirror", mirror.addr), &pushed.pinned);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events), "{events:#?}");
    let failed = events.iter().find(|e| e.kind() == Kind::Failed).unwrap();
    assert_eq!(failed.image, "envoy", "{failed:#?}");
    assert!(failed.message.contains("refused") && failed.message.contains(&pushed.index), "{}", failed.message);
    assert!(recorded(&farm.url, &name).await.is_none_or(|r| r.generation == 0), "nothing is recorded");
    assert_eq!(manifest_digest(&mirror.addr, "mirror/envoy", &pushed.index).await, None);
    assert!(!blob_held(&mirror, "mirror/envoy", &pushed.layers[0]), "nothing was copied before the refusal");
    farm.stop().await;
}
