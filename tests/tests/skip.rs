//! Skipping exactly what has not changed, against the real Docker daemon: by record, by a labeled
//! image of this farm, never by a look-alike; and rebuilding exactly what did change.
//!
//! These tests drive the coordinator through a raw gRPC client (`kiln_e2e::wire`), which uploads
//! contexts when asked just as the CLI does; the host store is the real daemon, counted.

use kiln_e2e::fixture::{example, reference, remove_built, unique, write};
use kiln_e2e::wire::{images_with, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1::converge_event::Kind;

fn succeeded(events: &[kiln_proto::v1::ConvergeEvent]) -> bool {
    events.last().is_some_and(|e| e.kind() == Kind::Finished && e.outcome() == kiln_proto::v1::Outcome::Succeeded)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_up_builds_and_a_second_records_without_docker() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("skip"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web", "worker"]);
    assert_eq!(farm.builds(), 2);
    assert_eq!(docker::label(&reference(&dir, "web"), "kiln.dev/farm").as_deref(), Some(farm.farm_id.as_str()));

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!(farm.builds(), 2, "a no-op converge sends no build to Docker");
    assert_eq!(farm.pushes(), 0);
    assert!(images_with(&events, Kind::NeedContexts).is_empty(), "a no-op converge uploads nothing");
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_state_wiped_this_farms_images_are_held_and_another_farms_is_used_never_retagged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("wipe"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    assert_eq!(farm.builds(), 2);

    // Another farm's image now wears web's exact tag: equivalent by address, so it is used as it
    // is — moving the tag would leave that farm's record naming an image it no longer owns.
    let web = reference(&dir, "web");
    docker::remove(&web);
    let other = docker::plant_other_farm(&web, "home-0123456789ab");

    farm.wipe_state_and_restart().await;
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Held), vec!["web", "worker"], "{events:#?}");
    let reason = |name: &str| {
        events.iter().find(|e| e.kind() == Kind::Held && e.image == name).and_then(|e| e.reason.clone()).unwrap()
    };
    assert_eq!(reason("worker").kind(), kiln_proto::v1::reason::Kind::Held);
    assert_eq!(reason("web").kind(), kiln_proto::v1::reason::Kind::HeldByFarm);
    assert_eq!(reason("web").farm, "home-0123456789ab");
    assert_eq!(images_with(&events, Kind::Delivered), vec!["web", "worker"], "held images are still delivered");
    assert_eq!(farm.builds(), 2, "nothing is built: the tag is never moved off another farm's image");
    assert_eq!(docker::image_id(&web), Some(other.clone()));
    assert_eq!(docker::label(&web, "kiln.dev/farm").as_deref(), Some("home-0123456789ab"));
    // This farm's reliance is on the daemon itself, so the owner's sweep leaves the tag.
    let hold = kiln_core::sweep::hold_ref(&farm.farm_id, &web).unwrap();
    assert_eq!(docker::image_id(&hold), Some(other));
    farm.stop().await;
    docker::remove(&hold);
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlabeled_image_wearing_the_exact_tag_is_not_held() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("plant"), None);
    let web = reference(&dir, "web");
    let planted = docker::plant_unlabeled(&web);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(images_with(&events, Kind::Held).is_empty(), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web", "worker"]);
    assert_ne!(docker::image_id(&web), Some(planted), "the tag now names Kiln's build");
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_what_changed_is_rebuilt() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("edit"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let old_refs = [reference(&dir, "web"), reference(&dir, "worker")];

    // Only mtimes move: nothing is rebuilt.
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
    for rel in ["web/index.html", "web/Dockerfile", "worker.Dockerfile"] {
        std::fs::File::options().write(true).open(dir.join(rel)).unwrap().set_modified(later).unwrap();
    }
    let events = up(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");

    // A `.dockerignore`d file changes: nothing is rebuilt.
    write(&dir, "web/notes.log", "edited notes, ignored by web/.dockerignore\n");
    let events = up(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!(farm.builds(), 2);

    // One file of web changes: web alone is rebuilt, under a new tag.
    write(&dir, "web/index.html", "<p>edited</p>\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web"], "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["worker"]);
    assert_ne!(reference(&dir, "web"), old_refs[0]);

    // A build arg changes: worker alone is rebuilt.
    let manifest = dir.join("kiln.toml");
    let text = std::fs::read_to_string(&manifest).unwrap().replace("hello from kiln", "hello again");
    std::fs::write(&manifest, text).unwrap();
    let events = up(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Built), vec!["worker"], "{events:#?}");
    assert_eq!(farm.builds(), 4);
    farm.stop().await;
    old_refs.iter().for_each(|r| docker::remove(r));
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_rebuilds_and_redelivers_everything() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("force"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let events = up(&farm.url, &dir, true).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web", "worker"]);
    assert_eq!(images_with(&events, Kind::Delivered), vec!["web", "worker"]);
    assert!(images_with(&events, Kind::Recorded).is_empty());
    assert_eq!(farm.builds(), 4);
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_client_elsewhere_with_the_same_sources_uploads_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let first = example("hello", tmp.path(), "alice", &unique("ctxa"), None);
    let second = example("hello", tmp.path(), "bob", &unique("ctxb"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let events = up(&farm.url, &first, false).await;
    assert!(succeeded(&events));
    assert_eq!(events.iter().filter(|e| e.kind() == Kind::NeedContexts).count(), 1);

    let events = up(&farm.url, &second, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web", "worker"], "another instance builds its own tags");
    assert!(events.iter().all(|e| e.kind() != Kind::NeedContexts), "but uploads nothing: {events:#?}");
    farm.stop().await;
    remove_built(&first);
    remove_built(&second);
}
