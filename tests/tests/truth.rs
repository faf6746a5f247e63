//! Recorded means present (issue 13), against the real Docker daemon and a real registry: what a
//! record names is confirmed on its target every converge, and what vanished outside Kiln is
//! rebuilt or delivered again, saying so; every image says why, in words and as a typed reason; a
//! dry run changes nothing anywhere; two farms sharing one daemon never lose each other's images.

use kiln_e2e::fixture::{example, reference, remove_built, unique, write};
use kiln_e2e::wire::{down, images_with, succeeded, up, up_dry};
use kiln_e2e::{docker, Farm, Registry};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use kiln_proto::v1::reason::Kind as Why;

/// The reason an image's first event of `kind` carries.
fn reason(events: &[pb::ConvergeEvent], kind: Kind, image: &str) -> pb::Reason {
    events
        .iter()
        .find(|e| e.kind() == kind && e.image == image)
        .and_then(|e| e.reason.clone())
        .unwrap_or_else(|| panic!("no {kind:?} event with a reason for {image}: {events:#?}"))
}

fn message(events: &[pb::ConvergeEvent], kind: Kind, image: &str) -> String {
    events.iter().find(|e| e.kind() == kind && e.image == image).map(|e| e.message.clone()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_removed_outside_kiln_is_rebuilt_and_the_converge_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("gone"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let web = reference(&dir, "web");

    docker::remove(&web);
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let why = reason(&events, Kind::Building, "web");
    assert_eq!(why.kind(), Why::Gone);
    assert_eq!((why.store.as_str(), why.generation), ("docker@e2e-agent", 1));
    assert_eq!(
        message(&events, Kind::Building, "web"),
        "gone from docker@e2e-agent since generation 1 (removed outside Kiln) — rebuilding"
    );
    assert_eq!(images_with(&events, Kind::Recorded), vec!["worker"]);
    assert_eq!(farm.builds(), 3, "web alone is rebuilt");
    assert!(docker::image_id(&web).is_some(), "recorded means present again");
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_deleted_from_the_registry_is_pushed_again_without_a_build() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("registry", tmp.path(), "reg", &unique("regone"), Some(&registry.addr));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    assert_eq!(farm.pushes(), 2);

    // A no-op converge asks the registry (one HEAD per image) and pushes nothing.
    let events = up(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!(farm.pushes(), 2);

    let web = reference(&dir, "web");
    let (repo, tag) = web.trim_start_matches(&format!("{}/", registry.addr)).rsplit_once(':').unwrap();
    registry.delete_tag(repo, tag);
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let why = reason(&events, Kind::Held, "web");
    assert_eq!(why.kind(), Why::Gone);
    assert_eq!(why.store, format!("registry {}", registry.addr));
    assert!(message(&events, Kind::Held, "web").ends_with("(removed outside Kiln) — pushing again"), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Pushed), vec!["web"]);
    assert_eq!(images_with(&events, Kind::Recorded), vec!["worker"]);
    assert_eq!(farm.builds(), 2, "the host still held it: nothing was built");
    let (status, _) = registry
        .get_with(
            &format!("/v2/{repo}/manifests/{tag}"),
            &[("Accept", "application/vnd.docker.distribution.manifest.v2+json")],
        )
        .unwrap();
    assert_eq!(status, 200, "the tag is back in the registry");
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reason_is_typed_and_said_in_words() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("why"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert_eq!(reason(&events, Kind::Building, "web").kind(), Why::FirstBuild);
    assert!(message(&events, Kind::Building, "web").ends_with(": first build"), "{events:#?}");

    let events = up(&farm.url, &dir, false).await;
    assert_eq!(reason(&events, Kind::Recorded, "web").kind(), Why::Recorded);

    let events = up(&farm.url, &dir, true).await;
    assert_eq!(reason(&events, Kind::Building, "web").kind(), Why::Forced);
    assert!(message(&events, Kind::Building, "web").ends_with(": --force"));

    // A context file: the tree moved, from one digest to the other, and the file is named (both
    // trees' entry lists were kept from their uploads).
    let before = up_dry(&farm.url, &dir, false).await;
    assert_eq!(reason(&before, Kind::Would, "web").kind(), Why::Recorded);
    write(&dir, "web/index.html", "<p>why</p>\n");
    let events = up(&farm.url, &dir, false).await;
    let why = reason(&events, Kind::Building, "web");
    assert_eq!(why.kind(), Why::Changed);
    let change = &why.changes[0];
    assert_eq!(change.input(), pb::input_change::Input::Context);
    assert_ne!(change.before, change.after);
    assert_eq!(change.files.as_ref().and_then(|f| f.changed.clone()).map(|c| c.paths), Some(vec!["index.html".into()]));
    let said = message(&events, Kind::Building, "web");
    assert!(said.ends_with(": context changed: 1 file (~ index.html)"), "{said}");

    // The Dockerfile (inside the context): said apart from the rest of the tree.
    write(
        &dir,
        "web/Dockerfile",
        &format!("{}\n# edited\n", std::fs::read_to_string(dir.join("web/Dockerfile")).unwrap()),
    );
    let events = up(&farm.url, &dir, false).await;
    let inputs: Vec<_> = reason(&events, Kind::Building, "web").changes.iter().map(|c| c.input()).collect();
    assert_eq!(inputs, vec![pb::input_change::Input::Dockerfile, pb::input_change::Input::Context]);
    assert!(message(&events, Kind::Building, "web").contains("Dockerfile changed"));

    // A build arg.
    let manifest = dir.join("kiln.toml");
    let text = std::fs::read_to_string(&manifest).unwrap().replace("hello from kiln", "hello again");
    std::fs::write(&manifest, text).unwrap();
    let events = up(&farm.url, &dir, false).await;
    let why = reason(&events, Kind::Building, "worker");
    assert_eq!(why.changes[0].input(), pb::input_change::Input::BuildArg);
    assert!(
        message(&events, Kind::Building, "worker").ends_with("build arg GREETING: hello from kiln → hello again"),
        "{events:#?}"
    );

    // Held: built by a converge that never recorded it (the record is deleted, the image stays).
    let record_refs = [reference(&dir, "web"), reference(&dir, "worker")];
    let store = kiln_coordinator::state::SqliteStore::open(farm.home.join("state/kiln.db")).unwrap();
    use kiln_coordinator::state::StateStore;
    let instance = std::fs::read_to_string(&manifest)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("instance = \""))
        .unwrap()
        .trim_end_matches('"')
        .to_string();
    store.delete_record(&instance).await.unwrap();
    let events = up(&farm.url, &dir, false).await;
    let why = reason(&events, Kind::Held, "web");
    assert_eq!(why.kind(), Why::Held);
    assert_eq!(why.converge.len(), 16, "the converge that built it: {why:?}");
    assert!(message(&events, Kind::Held, "web")
        .starts_with(&format!("held (built by converge {}, not in the record)", why.converge)));
    farm.stop().await;
    record_refs.iter().for_each(|r| docker::remove(r));
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_changes_nothing_anywhere() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("dry"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    write(&dir, "web/index.html", "<p>dry</p>\n");
    docker::remove(&reference(&dir, "worker"));

    let state = || {
        let contexts: Vec<String> = std::fs::read_dir(farm.home.join("state/contexts"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        (contexts, std::fs::read(farm.home.join("state/kiln.db")).unwrap().len())
    };
    let images = || docker::images_named(reference(&dir, "web").split(':').next().unwrap());
    let (before_state, before_images) = (state(), images());
    let store = kiln_coordinator::state::SqliteStore::open(farm.home.join("state/kiln.db")).unwrap();
    use kiln_coordinator::state::StateStore;
    let before_converges = store.converges(None, 100).await.unwrap().len();
    let before_record = store.records().await.unwrap();

    let events = up_dry(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(reason(&events, Kind::Would, "web").kind(), Why::Changed);
    assert_eq!(message(&events, Kind::Would, "web").split(':').next(), Some("would build"));
    assert_eq!(reason(&events, Kind::Would, "worker").kind(), Why::Gone);
    assert!(images_with(&events, Kind::Building).is_empty());

    assert_eq!(farm.builds(), 2, "no build");
    assert_eq!(images(), before_images, "the daemon is as it was");
    assert_eq!(state().0, before_state.0, "no context uploaded");
    assert_eq!(store.converges(None, 100).await.unwrap().len(), before_converges, "no converge opened");
    assert_eq!(store.records().await.unwrap(), before_record, "the record is untouched");
    assert!(store.live_claims(kiln_e2e::now_ms()).await.unwrap().is_empty(), "nothing claimed");
    farm.stop().await;
    remove_built(&dir);
}

/// Two developers' embedded Kiln on one build host: two farms, one daemon, one instance folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_farms_on_one_daemon_never_lose_each_others_recorded_images() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("twofarms"), None);
    let instance = std::fs::read_to_string(dir.join("kiln.toml"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("instance = \"").map(|r| r.trim_end_matches('"').to_string()))
        .unwrap();
    let refs = [reference(&dir, "web"), reference(&dir, "worker")];
    let mut a = Farm::start(&tmp.path().join("home-a")).await;
    let mut b = Farm::start(&tmp.path().join("home-b")).await;

    // up A, up B: B builds nothing and holds A's images.
    assert!(succeeded(&up(&a.url, &dir, false).await));
    let events = up(&b.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(reason(&events, Kind::Held, "web").kind(), Why::HeldByFarm);
    assert_eq!(b.builds(), 0, "the address is the same: farm B uses farm A's images");
    for r in &refs {
        assert_eq!(docker::label(r, "kiln.dev/farm").as_deref(), Some(a.farm_id.as_str()), "the tag never moved");
    }
    // down B: B's sweep drops its holds, and A's tags stay.
    assert!(succeeded(&down(&b.url, &instance).await));
    let events = up(&a.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!(a.builds(), 2, "nothing rebuilt");
    for r in &refs {
        assert_eq!(docker::label(r, "kiln.dev/farm").as_deref(), Some(a.farm_id.as_str()));
        assert!(docker::image_id(&kiln_core::sweep::hold_ref(&b.farm_id, r).unwrap()).is_none(), "B's hold is gone");
    }

    // The mirror case: B holds again, then A goes down first. B's hold keeps the tags A built.
    assert!(succeeded(&up(&b.url, &dir, false).await));
    assert!(succeeded(&down(&a.url, &instance).await));
    for r in &refs {
        assert!(docker::image_id(r).is_some(), "{r} survived A's down: B still holds it");
    }
    let events = up(&b.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!((a.builds(), b.builds()), (2, 0), "nothing rebuilt by either farm");
    a.stop().await;
    b.stop().await;
    for r in &refs {
        docker::remove(&kiln_core::sweep::hold_ref(&b.farm_id, r).unwrap());
    }
    remove_built(&dir);
}
