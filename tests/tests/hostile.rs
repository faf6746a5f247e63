//! Requests the CLI never sends, from a client that means harm: a built image's ref that is not
//! its address, another instance's content tag forced over with other bytes, a ref outside the
//! target's registry. Each is refused before anything is claimed, built, labeled, pushed or
//! recorded — the daemon and the coordinator's `Status` read the same after as before.

use kiln_e2e::fixture::{reference, remove_built, unique, write};
use kiln_e2e::wire::{self, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::path::{Path, PathBuf};

/// A small instance folder: one built image `web`, target `local`, its context holding `content`.
fn instance(into: &Path, instance: &str, content: &str) -> PathBuf {
    let dir = into.join(instance);
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.web]\ncontext = \"web\"\n"),
    );
    write(&dir, "web/Dockerfile", "FROM scratch\nCOPY content.txt /content.txt\n");
    write(&dir, "web/content.txt", content);
    dir
}

async fn status(url: &str, instance: &str) -> pb::StatusReply {
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(url));
    client.status(pb::StatusRequest { instance: instance.to_string() }).await.unwrap().into_inner()
}

/// Sends `Up` for `dir` with `edit` made to the request, expecting the coordinator to refuse it.
async fn refused_up(url: &str, dir: &Path, edit: impl FnOnce(&mut pb::UpRequest)) -> tonic::Status {
    let (mut req, _) = wire::up_request(dir, false);
    edit(&mut req);
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(url));
    match client.up(req).await {
        Ok(stream) => panic!("the coordinator accepted the request: {:?}", stream.into_inner().message().await),
        Err(status) => status,
    }
}

fn assert_names(status: &tonic::Status, parts: &[&str]) {
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    for part in parts {
        assert!(status.message().contains(part), "{part:?} missing from: {}", status.message());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_ref_that_is_not_its_address_is_refused_and_nothing_is_built_labeled_or_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("lie");
    let dir = instance(tmp.path(), &name, "lying\n");
    let honest = reference(&dir, "web");
    let repo = format!("{name}-web");
    let lie = format!("{repo}:000000000000-amd64");
    // An image Kiln never built, which a lying ref once re-tagged and a `down` then removed.
    let victim = format!("{}:latest", unique("victim"));
    let victim_id = docker::plant_unlabeled(&victim);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let before = (docker::images_named(&repo), status(&farm.url, &name).await);

    let refused = refused_up(&farm.url, &dir, |req| req.images[0].reference = lie.clone()).await;
    assert_names(&refused, &["image \"web\": reference", &format!("sent {lie:?}"), &format!("address {honest:?}")]);
    let refused =
        refused_up(&farm.url, &dir, |req| (req.images[0].reference, req.force) = (victim.clone(), true)).await;
    // Named in its own repository: a repository is the client's to choose, a tag never is.
    let tag = honest.rsplit_once(':').unwrap().1;
    let victim_address = format!("{}:{tag}", victim.rsplit_once(':').unwrap().0);
    assert_names(&refused, &[&format!("sent {victim:?}"), &format!("address {victim_address:?}")]);

    assert_eq!(farm.builds(), 0, "nothing was built");
    assert_eq!((docker::images_named(&repo), status(&farm.url, &name).await), before, "nor tagged or recorded");
    assert_eq!(docker::image_id(&victim).as_deref(), Some(victim_id.as_str()), "the victim's tag is untouched");
    assert_eq!(docker::label(&victim, "kiln.dev/kind"), None, "and carries no Kiln label");

    // A `down` of the instance has nothing of the victim's to take.
    assert!(wire::succeeded(&wire::down(&farm.url, &name).await));
    assert_eq!(docker::image_id(&victim).as_deref(), Some(victim_id.as_str()));

    // The honest request for the same folder still converges.
    assert!(wire::succeeded(&up(&farm.url, &dir, false).await));
    assert_eq!(docker::label(&honest, "kiln.dev/instance").as_deref(), Some(name.as_str()));
    farm.stop().await;
    remove_built(&dir);
    docker::remove(&victim);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_cannot_rebuild_another_instances_tag_from_other_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let (owner_name, thief_name) = (unique("owner"), unique("thief"));
    let owner = instance(tmp.path(), &owner_name, "the owner's bytes\n");
    let thief = instance(tmp.path(), &thief_name, "other bytes\n");
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(wire::succeeded(&up(&farm.url, &owner, false).await));
    let theirs = reference(&owner, "web");
    let their_id = docker::image_id(&theirs).unwrap();
    let ours = reference(&thief, "web");
    let before = (docker::images_named(&format!("{owner_name}-web")), status(&farm.url, &thief_name).await);

    // The thief's own context, forced under the owner's content tag.
    let refused =
        refused_up(&farm.url, &thief, |req| (req.images[0].reference, req.force) = (theirs.clone(), true)).await;
    assert_names(
        &refused,
        &[&format!("sent {theirs:?}"), &format!("address {:?}", ours.replace(&thief_name, &owner_name))],
    );

    assert_eq!(farm.builds(), 1, "only the owner's build ran");
    assert_eq!(docker::image_id(&theirs), Some(their_id), "the owner's tag still names the owner's image");
    assert_eq!((docker::images_named(&format!("{owner_name}-web")), status(&farm.url, &thief_name).await), before);
    let events = up(&farm.url, &owner, false).await;
    assert_eq!(wire::images_with(&events, Kind::Recorded), ["web"], "and is truly current: {events:#?}");

    // A force of the owner's own address rebuilds the same bytes under it, as it always did.
    let events = up(&farm.url, &owner, true).await;
    assert!(wire::succeeded(&events), "{events:#?}");
    assert_eq!(docker::label(&theirs, "kiln.dev/instance").as_deref(), Some(owner_name.as_str()));
    farm.stop().await;
    remove_built(&owner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ref_outside_the_targets_registry_is_refused_and_nothing_is_pushed() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("reg");
    // Nothing listens on the target's registry: the request is judged before any push is tried.
    let dir = kiln_e2e::fixture::example("registry", tmp.path(), "reg", &name, Some("127.0.0.1:9"));
    let honest = reference(&dir, "web");
    let tag = honest.rsplit_once(':').unwrap().1.to_string();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let before = status(&farm.url, &name).await;

    for elsewhere in [format!("evil.example:5000/{name}-web:{tag}"), format!("{name}-web:{tag}")] {
        let refused = refused_up(&farm.url, &dir, |req| req.images[0].reference = elsewhere.clone()).await;
        assert_names(&refused, &[&format!("sent {elsewhere:?}"), "outside the target's registry 127.0.0.1:9"]);
    }
    // Its right address in another registry is still not where this target pushes.
    let refused = refused_up(&farm.url, &dir, |req| {
        req.target.as_mut().unwrap().registry = "127.0.0.1:9/team".into();
    })
    .await;
    assert_names(&refused, &[&format!("sent {honest:?}"), "outside the target's registry 127.0.0.1:9/team"]);

    assert_eq!((farm.builds(), farm.pushes()), (0, 0));
    assert_eq!(status(&farm.url, &name).await, before);
    assert!(docker::images_named(&format!("evil.example:5000/{name}-web")).is_empty());
    farm.stop().await;
}
