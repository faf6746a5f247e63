//! The sweep against the real Docker daemon: what a converge sweeps after it succeeds (at once on a
//! build host, a generation later where images run), what `down` leaves for other instances, and
//! what `gc` must never take — images containers use, pinned refs, unlabeled images, other farms'.
//!
//! Garbage is planted with `docker build` and this farm's labels, so each test knows exactly which
//! images are unreachable; every name is unique, so tests sharing the daemon never share images.

use kiln_core::sweep::{LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
use kiln_e2e::fixture::{example, reference, remove_built, unique, write};
use kiln_e2e::wire::{self, down, gc, pin, succeeded, swept_refs, up};
use kiln_e2e::{docker, Farm, Registry};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::path::Path;

fn present(reference: &str) -> bool {
    docker::image_id(reference).is_some()
}

/// Plants an image of `farm` owned by `instance`, with nothing naming it: garbage for that farm.
fn plant_garbage(farm: &Farm, instance: &str, references: &[&str]) -> String {
    let labels = [(LABEL_KIND, "image"), (LABEL_INSTANCE, instance), (LABEL_FARM, farm.farm_id.as_str())];
    docker::plant_labeled(references, &labels, &format!("garbage {}", references.join(" ")))
}

fn swept(events: &[pb::ConvergeEvent]) -> Option<&pb::ConvergeEvent> {
    events.iter().find(|e| e.kind() == Kind::Swept)
}

fn cleanup(references: &[&str]) {
    references.iter().for_each(|r| docker::remove(r));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_registry_target_the_replaced_host_tag_is_swept_by_the_next_converge() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("registry", tmp.path(), "reg", &unique("swreg"), Some(&registry.addr));
    // Content no other test's image shares: a sweep counts only the layers no remaining image
    // uses, and other tests on this daemon build the example's own files too.
    write(&dir, "web/index.html", &format!("<p>{}</p>\n", unique("own")));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let (old_web, worker) = (reference(&dir, "web"), reference(&dir, "worker"));

    write(&dir, "web/index.html", "<p>edited</p>\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let new_web = reference(&dir, "web");
    assert!(!present(&old_web), "nothing runs on a build host: the replaced tag goes at once");
    assert!(present(&new_web) && present(&worker), "what the record names stays");
    let total = swept(&events).expect("the converge narrates its sweep");
    assert_eq!(total.count, 1, "{events:#?}");
    assert!(total.bytes > 0, "the replaced image's own layer came back: {total:?}");
    farm.stop().await;
    cleanup(&[&old_web]);
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_local_target_the_replaced_tag_survives_one_more_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("swloc"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let first = reference(&dir, "web");

    write(&dir, "web/index.html", "<p>second</p>\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let second = reference(&dir, "web");
    assert!(present(&first), "where images run, the generation just replaced is kept (the grace)");
    assert!(swept(&events).is_none(), "nothing was swept, so nothing is narrated: {events:#?}");

    write(&dir, "web/index.html", "<p>third</p>\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(!present(&first), "two generations back, it goes");
    assert!(present(&second), "the generation just replaced is kept again");
    assert!(present(&reference(&dir, "web")) && present(&reference(&dir, "worker")));
    assert_eq!(swept(&events).map(|e| e.count), Some(1), "{events:#?}");
    farm.stop().await;
    cleanup(&[&first, &second]);
    remove_built(&dir);
}

/// An instance with its own image and a shared base whose repository is named explicitly, so two
/// instances with the same base sources converge to the same base ref.
fn with_shared_base(dir: &Path, instance: &str, base_repository: &str) {
    write(
        dir,
        "kiln.toml",
        &format!(
            "instance = \"{instance}\"\n[target]\nkind = \"local\"\n\
             [built.own]\ncontext = \"own\"\n\
             [built.base]\ncontext = \"base\"\nrepository = \"{base_repository}\"\nshared = true\n"
        ),
    );
    write(dir, "own/Dockerfile", "FROM scratch\nCOPY f /f\n");
    write(dir, "own/f", &format!("owned by {instance}\n"));
    write(dir, "base/Dockerfile", "FROM scratch\nCOPY f /f\n");
    write(dir, "base/f", "the base both instances share\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_takes_only_what_no_other_instance_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, base) = (unique("swdowna"), unique("swdownb"), unique("swbase"));
    let (dir_a, dir_b) = (tmp.path().join("a"), tmp.path().join("b"));
    with_shared_base(&dir_a, &a, &base);
    with_shared_base(&dir_b, &b, &base);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir_a, false).await));
    let events = up(&farm.url, &dir_b, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let shared = reference(&dir_a, "base");
    assert_eq!(shared, reference(&dir_b, "base"), "byte-identical inputs address one ref");
    let (own_a, own_b) = (reference(&dir_a, "own"), reference(&dir_b, "own"));

    let events = down(&farm.url, &a).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(events.iter().any(|e| e.kind() == Kind::RecordDeleted && e.instance == a), "{events:#?}");
    assert_eq!(swept_refs(&events, Kind::Removed), vec![own_a.clone()]);
    assert!(!present(&own_a));
    assert!(present(&shared), "b's record still names the shared base");
    assert!(present(&own_b), "b's own image is b's");

    let events = down(&farm.url, &b).await;
    assert!(succeeded(&events), "{events:#?}");
    let mut gone = vec![own_b.clone(), shared.clone()];
    gone.sort();
    assert_eq!(swept_refs(&events, Kind::Removed), gone, "with no root left, the shared base goes too");
    assert!(!present(&own_b) && !present(&shared));
    assert_eq!(swept(&events).map(|e| e.count), Some(2));
    farm.stop().await;
    cleanup(&[&own_a, &own_b, &shared]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_a_container_uses_is_never_planned_away() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let name = unique("swctr");
    let (used, idle) = (format!("{name}-used:1"), format!("{name}-idle:1"));
    plant_garbage(&farm, &name, &[&used]);
    plant_garbage(&farm, &name, &[&idle]);
    let container = docker::create_container(&used);

    let plan = gc(&farm.url, true, None).await;
    assert_eq!(swept_refs(&plan, Kind::Planned), vec![idle.clone()], "{plan:#?}");
    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(swept_refs(&events, Kind::Removed), vec![idle.clone()]);
    assert!(swept_refs(&events, Kind::NotRemoved).is_empty(), "the used image was never tried: {events:#?}");
    assert!(present(&used), "a stopped container's image is a root of its store");

    docker::remove_container(&container);
    let events = gc(&farm.url, false, None).await;
    assert_eq!(swept_refs(&events, Kind::Removed), vec![used.clone()], "without its container it is garbage");
    farm.stop().await;
    cleanup(&[&used, &idle]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_never_touches_unlabeled_images_or_another_farms() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let name = unique("swforeign");
    // A hand-built look-alike wearing a Kiln-shaped content tag, and a brought-style ref: no labels.
    let look_alike = format!("{name}-web:4a77b1c2d3e4-amd64");
    let brought = format!("{name}/brought:1.36");
    docker::plant_unlabeled(&look_alike);
    docker::plant_unlabeled(&brought);
    // Kiln's labels, another farm's id.
    let elsewhere = format!("{name}-elsewhere:1");
    docker::plant_other_farm(&elsewhere, "home-0123456789ab");
    // Derived from a Kiln image but with the kind cleared: no longer Kiln's.
    let derived = format!("{name}-derived:1");
    let cleared = [(LABEL_KIND, ""), (LABEL_INSTANCE, name.as_str()), (LABEL_FARM, farm.farm_id.as_str())];
    docker::plant_labeled(&[&derived], &cleared, "derived");
    let garbage = format!("{name}-garbage:1");
    plant_garbage(&farm, &name, &[&garbage]);

    // A second farm on the same daemon (another KILN_HOME) with a converged instance.
    let mut other = Farm::start(&tmp.path().join("other-home")).await;
    let other_dir = example("hello", tmp.path(), "other", &unique("swother"), None);
    assert!(succeeded(&up(&other.url, &other_dir, false).await));
    let other_web = reference(&other_dir, "web");
    // And that farm's garbage, which is still not this farm's to take.
    let other_garbage = format!("{name}-othergarbage:1");
    plant_garbage(&other, &name, &[&other_garbage]);

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(swept_refs(&events, Kind::Removed), vec![garbage.clone()], "{events:#?}");
    for kept in [&look_alike, &brought, &elsewhere, &derived, &other_web, &other_garbage] {
        assert!(present(kept), "{kept} is not this farm's to sweep");
    }
    farm.stop().await;
    other.stop().await;
    cleanup(&[&look_alike, &brought, &elsewhere, &derived, &garbage, &other_garbage]);
    remove_built(&other_dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_removes_nothing_and_plans_exactly_what_gc_then_removes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("swdry"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let name = unique("swdry");
    let (one, two) = (format!("{name}-one:1"), format!("{name}-two:1"));
    let (twin_a, twin_b) = (format!("{name}-twin:a"), format!("{name}-twin:b"));
    plant_garbage(&farm, "alpha", &[&one]);
    plant_garbage(&farm, "beta", &[&two]);
    plant_garbage(&farm, "alpha", &[&twin_a, &twin_b]);
    let garbage = [one.as_str(), two.as_str(), twin_a.as_str(), twin_b.as_str()];

    let plan = gc(&farm.url, true, None).await;
    assert!(succeeded(&plan), "{plan:#?}");
    let planned = swept_refs(&plan, Kind::Planned);
    let mut expected: Vec<String> = garbage.iter().map(|r| r.to_string()).collect();
    expected.sort();
    assert_eq!(planned, expected, "exactly the planted garbage; the record keeps the instance's images");
    assert!(garbage.iter().all(|r| present(r)), "a dry run removes nothing");
    let owners: Vec<(String, String)> =
        plan.iter().filter(|e| e.kind() == Kind::Planned).map(|e| (e.reference.clone(), e.instance.clone())).collect();
    assert!(owners.contains(&(two.clone(), "beta".to_string())), "{owners:?}");
    let planned_bytes: u64 = plan.iter().filter(|e| e.kind() == Kind::Planned).map(|e| e.bytes).sum();
    assert_eq!(plan.iter().filter(|e| e.kind() == Kind::Planned && e.bytes > 0).count(), 3, "one frees per image");

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(swept_refs(&events, Kind::Removed), planned, "gc removes what the dry run planned");
    assert!(garbage.iter().all(|r| !present(r)));
    let total = swept(&events).unwrap();
    assert_eq!((total.count, total.bytes), (3, planned_bytes), "confirmed as planned");
    assert!(present(&reference(&dir, "web")) && present(&reference(&dir, "worker")));
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untagged_image_of_this_farm_is_swept_by_its_id() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let tag = format!("{}-moved:1", unique("swid"));
    let labels = [(LABEL_KIND, "image"), (LABEL_INSTANCE, "moved"), (LABEL_FARM, farm.farm_id.as_str())];
    let orphan = docker::plant_labeled(&[&tag], &labels, "first");
    // The tag moves to another image; the first keeps its labels and no name at all.
    let current = docker::plant_labeled(&[&tag], &labels, "second");
    assert_ne!(orphan, current);

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    let mut expected = vec![orphan.clone(), tag.clone()];
    expected.sort();
    assert_eq!(swept_refs(&events, Kind::Removed), expected, "the tag, and the nameless image by id");
    assert_eq!(swept(&events).map(|e| e.count), Some(2));
    assert!(!present(&orphan) && !present(&tag));
    farm.stop().await;
    cleanup(&[&tag, &orphan]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_for_one_instance_takes_only_that_instances_images() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let name = unique("swone");
    let (mine, theirs) = (format!("{name}-mine:1"), format!("{name}-theirs:1"));
    plant_garbage(&farm, "mine", &[&mine]);
    plant_garbage(&farm, "theirs", &[&theirs]);

    let events = gc(&farm.url, false, Some("mine")).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(swept_refs(&events, Kind::Removed), vec![mine.clone()]);
    assert!(present(&theirs));
    let events = gc(&farm.url, false, None).await;
    assert_eq!(swept_refs(&events, Kind::Removed), vec![theirs.clone()]);
    farm.stop().await;
    cleanup(&[&mine, &theirs]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_that_fails_is_reported_and_the_rest_proceed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let name = unique("swfail");
    let refs: Vec<String> = ["a", "b", "c"].iter().map(|x| format!("{name}-{x}:1")).collect();
    for r in &refs {
        plant_garbage(&farm, &name, &[r]);
    }
    farm.store.refuse_removal_of.lock().unwrap().insert(refs[1].clone());

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "a failed removal does not fail the sweep: {events:#?}");
    assert_eq!(swept_refs(&events, Kind::Removed), vec![refs[0].clone(), refs[2].clone()]);
    let failed: Vec<&pb::ConvergeEvent> = events.iter().filter(|e| e.kind() == Kind::NotRemoved).collect();
    assert_eq!(failed.len(), 1, "{events:#?}");
    assert_eq!(failed[0].reference, refs[1]);
    assert!(failed[0].message.contains("refuses to untag"), "the agent's reason is reported: {}", failed[0].message);
    let finished = events.last().unwrap();
    assert!(finished.message.contains("1 removal(s) failed"), "{finished:?}");
    assert_eq!(swept(&events).map(|e| e.count), Some(2), "only confirmed removals count");
    assert!(!present(&refs[0]) && present(&refs[1]) && !present(&refs[2]));

    farm.store.refuse_removal_of.lock().unwrap().clear();
    let events = gc(&farm.url, false, None).await;
    assert_eq!(swept_refs(&events, Kind::Removed), vec![refs[1].clone()], "the next sweep takes it");
    farm.stop().await;
    refs.iter().for_each(|r| docker::remove(r));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_keeps_an_unreachable_image_until_it_is_unpinned() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let name = unique("swpin");
    let pinned = format!("{name}-tool:1");
    plant_garbage(&farm, &name, &[&pinned]);

    // Pinned under Docker Hub's long spelling; kept under the short one the daemon lists.
    let reply = pin(&farm.url, &format!("docker.io/library/{pinned}"), true).await;
    assert!(reply.changed);
    assert_eq!(reply.pins.iter().map(|p| p.reference.as_str()).collect::<Vec<_>>(), vec![pinned.as_str()]);
    assert!(!pin(&farm.url, &pinned, true).await.changed, "pinning twice is pinning once");
    let events = gc(&farm.url, false, None).await;
    assert!(swept_refs(&events, Kind::Removed).is_empty(), "{events:#?}");
    assert!(present(&pinned), "a pin is a root");

    let reply = pin(&farm.url, &pinned, false).await;
    assert!(reply.changed && reply.pins.is_empty());
    let events = gc(&farm.url, false, None).await;
    assert_eq!(swept_refs(&events, Kind::Removed), vec![pinned.clone()], "unpinned, it goes");
    farm.stop().await;
    docker::remove(&pinned);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_ref_swept_right_after_its_build_is_rebuilt_and_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path(), "hello", &unique("swgone"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    farm.store.sweep_after_build.store(1, std::sync::atomic::Ordering::SeqCst);
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let notes: Vec<&str> = events.iter().filter(|e| e.kind() == Kind::Note).map(|e| e.message.as_str()).collect();
    assert!(notes.iter().any(|n| n.contains("right after its delivery") && n.contains("rebuilding")), "{notes:?}");
    assert_eq!(farm.builds(), 3, "the swept image alone was built again");
    assert!(present(&reference(&dir, "web")) && present(&reference(&dir, "worker")));
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pin_that_names_no_ref_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(&farm.url));
    let request = pb::PinRequest { reference: "Not A Ref".into(), requested_by: "e2e".into() };
    let err = client.pin(request).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("Not A Ref"), "{}", err.message());
    farm.stop().await;
}
