//! The node store against real containerd, one per simulated node (`kiln_e2e::containerd`), with test images
//! built `FROM scratch` on the machine's real Docker daemon and exported by `docker save`. Each test
//! starts its own containerd, so tests run in parallel without meeting.
//!
//! What containerd really does is asserted as found on containerd 1.6 here: the CRI plugin adds a
//! `sha256:<id>` ref of its own shortly after any image appears in `k8s.io`, and `ctr images
//! import` (what `kind load` runs) adds an `import-<date>@sha256:<manifest>` ref.

use kiln_agent::node::{ContainerdStore, ImportSpec, NodeError, NodeStore, Removal};
use kiln_core::sweep::{
    plan, ListedImage, Policy, RemovalMode, RemovalTarget, Roots, StoreId, StoreKind, StoreListing,
};
use kiln_e2e::containerd::{body, synthetic_archive, Containerd, SavedImage, Synthetic};
use std::collections::BTreeSet;
use std::time::Duration;

const FARM: &str = "node-tests";

fn spec(image: &SavedImage) -> ImportSpec {
    ImportSpec { reference: image.tag.clone(), id: image.id.clone() }
}

/// Lists until `ready` holds: the CRI plugin's own refs and cache follow containerd's events a
/// moment after each change. Panics with the last listing if it never does.
async fn list_until(store: &dyn NodeStore, ready: impl Fn(&[ListedImage]) -> bool) -> Vec<ListedImage> {
    let mut listing = Vec::new();
    for _ in 0..250 {
        listing = store.list().await.unwrap();
        if ready(&listing) {
            return listing;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{} never reached the expected state; last listing: {listing:#?}", store.describe());
}

fn find<'a>(listing: &'a [ListedImage], id: &str) -> Option<&'a ListedImage> {
    listing.iter().find(|image| image.id == id)
}

fn node_listing(store: &dyn NodeStore, images: Vec<ListedImage>) -> StoreListing {
    StoreListing {
        store: StoreId(store.describe()),
        kind: StoreKind::Node,
        removal: store.removal_mode(),
        runs_workloads: false,
        images,
    }
}

/// Plans a sweep of `store` with `roots`, executes every removal in plan order, and returns the
/// plan's targets with their outcomes.
async fn sweep(store: &dyn NodeStore, roots: &Roots) -> Vec<(RemovalTarget, Removal)> {
    let listing = node_listing(store, store.list().await.unwrap());
    let planned = plan(&[listing], roots, &Policy { farm: FARM.to_string() });
    let mut done = Vec::new();
    for removal in &planned.stores[0].removals {
        let reference = match &removal.target {
            RemovalTarget::Ref(reference) | RemovalTarget::Id(reference) => reference,
        };
        done.push((removal.target.clone(), store.remove_ref(reference).await.unwrap()));
    }
    done
}

#[tokio::test]
async fn an_import_lists_under_its_id_with_its_bytes_and_labels() {
    let (node, image) = (Containerd::start().await, SavedImage::build(3 << 20));
    let store = node.store().await;
    assert!(!store.holds(&image.tag, &image.id).await.unwrap(), "nothing is held before the import");
    let imported = store.import(image.body(), &spec(&image)).await.unwrap();

    assert_eq!(imported.id, image.id);
    assert_eq!(imported.reference, image.qualified);
    // Delivery skips a node where the name already names the id, in any spelling.
    assert!(store.holds(&image.tag, &image.id).await.unwrap());
    assert!(store.holds(&image.qualified, &image.id).await.unwrap());
    assert!(!store.holds(&format!("{}-other", image.tag), &image.id).await.unwrap());
    assert!(!store.holds(&image.tag, &format!("sha256:{}", "0".repeat(64))).await.unwrap());
    assert_eq!(imported.bytes, image.bytes());
    let listing = store.list().await.unwrap();
    let listed = find(&listing, &image.id).expect("the imported image is listed");
    // The import writes the CRI's `sha256:<id>` ref itself, as a CRI pull does, so the CRI plugin
    // has no ref of its own to add behind it.
    assert_eq!(listed.refs, vec![image.qualified.clone(), image.id.clone()]);
    assert_eq!(listed.bytes, image.bytes());
    assert!(listed.digests.contains(&imported.manifest), "{listed:#?}");
    for (key, value) in &image.labels {
        assert_eq!(listed.labels.get(key), Some(value), "label {key}");
    }
    let content = node.content().await;
    for blob in image.layer_digests().iter().chain([&image.id, &imported.manifest]) {
        assert!(content.contains(blob), "{blob} is in the content store");
    }

    // The CRI sees the image too: the kubelet would find it and not pull.
    let cri = node.cri().await;
    let seen = list_until(&cri, |l| find(l, &image.id).is_some()).await;
    assert!(cri.holds(&image.tag, &image.id).await.unwrap());
    assert_eq!(find(&seen, &image.id).unwrap().refs, vec![image.qualified.clone()]);
    assert_eq!(find(&seen, &image.id).unwrap().labels, listed.labels);
}

#[tokio::test]
async fn an_import_writes_the_same_manifest_as_kinds_loader() {
    let (ours, kinds, image) = (Containerd::start().await, Containerd::start().await, SavedImage::build(1 << 20));
    let imported = ours.store().await.import(image.body(), &spec(&image)).await.unwrap();
    kinds.ctr_import(&image.archive).await;
    let listing = kinds.store().await.list().await.unwrap();
    let theirs = find(&listing, &image.id).expect("ctr import created the image");
    assert_eq!(theirs.digests, vec![imported.manifest.clone()]);
    assert!(theirs.refs.contains(&format!("import-{}@{}", today(&theirs.refs), imported.manifest)), "{theirs:#?}");
}

/// The date part of the `import-<date>@…` ref among `refs`.
fn today(refs: &[String]) -> String {
    refs.iter()
        .find_map(|r| r.strip_prefix("import-").and_then(|r| r.split_once('@')).map(|(date, _)| date.to_string()))
        .expect("an import-* ref")
}

#[tokio::test]
async fn importing_twice_is_a_no_op_and_a_new_image_repoints_the_name() {
    let node = Containerd::start().await;
    let (first, second) = (SavedImage::build(64 << 10), SavedImage::build(64 << 10));
    let store = node.store().await;
    let name = first.qualified.clone();
    let again = store.import(first.body(), &spec(&first)).await.unwrap();
    assert_eq!(store.import(first.body(), &spec(&first)).await.unwrap(), again);

    store.import(second.body(), &ImportSpec { reference: first.tag.clone(), id: second.id.clone() }).await.unwrap();
    let listing = store.list().await.unwrap();
    assert!(find(&listing, &second.id).unwrap().refs.contains(&name), "{listing:#?}");
    assert!(find(&listing, &first.id).is_none_or(|old| !old.refs.contains(&name)), "{listing:#?}");
}

#[tokio::test]
async fn a_second_tag_survives_removal_of_the_first() {
    let (node, image) = (Containerd::start().await, SavedImage::build(64 << 10));
    let store = node.store().await;
    store.import(image.body(), &spec(&image)).await.unwrap();
    let second = format!("{}-second", image.qualified);
    node.create_ref(&second, node.target(&image.qualified).await).await;
    let before = node.content().await;

    assert_eq!(store.remove_ref(&image.qualified).await.unwrap(), Removal::Removed);
    let listing = store.list().await.unwrap();
    let left = find(&listing, &image.id).expect("the second tag keeps the image");
    assert!(left.refs.contains(&second) && !left.refs.contains(&image.qualified), "{left:#?}");
    assert_eq!(node.content().await, before, "untagging frees nothing while a tag remains");
}

#[tokio::test]
async fn every_alias_lists_under_one_id_and_removing_them_all_reclaims_the_content() {
    let (node, image) = (Containerd::start().await, SavedImage::build(1 << 20));
    let store = node.store().await;
    let imported = store.import(image.body(), &spec(&image)).await.unwrap();
    let import_ref = format!("import-2026-11-29@{}", imported.manifest);
    node.create_ref(&import_ref, node.target(&image.qualified).await).await;

    // The CRI plugin adds the `sha256:<id>` ref itself.
    let listing = list_until(&store, |l| find(l, &image.id).is_some_and(|i| i.refs.len() == 3)).await;
    assert_eq!(listing.len(), 1, "three refs, one image: {listing:#?}");
    assert_eq!(listing[0].refs, vec![image.qualified.clone(), import_ref.clone(), image.id.clone()]);
    let before = node.content().await;

    // Nothing roots it: the planner takes every ref, names before aliases.
    let done = sweep(&store, &Roots::default()).await;
    assert_eq!(done.len(), 3, "{done:?}");
    assert!(done.iter().all(|(_, outcome)| *outcome == Removal::Removed), "{done:?}");
    assert!(store.list().await.unwrap().is_empty());
    let after = node.content().await;
    for blob in image.layer_digests().iter().chain([&image.id, &imported.manifest]) {
        assert!(before.contains(blob) && !after.contains(blob), "{blob} was reclaimed");
    }
}

#[tokio::test]
async fn kinds_import_refs_go_with_the_named_ref_and_the_content_is_reclaimed() {
    let (node, image) = (Containerd::start().await, SavedImage::build(1 << 20));
    node.ctr_import(&image.archive).await;
    let store = node.store().await;
    let listing = list_until(&store, |l| find(l, &image.id).is_some_and(|i| i.refs.len() == 3)).await;
    let refs = &find(&listing, &image.id).unwrap().refs;
    assert!(refs[1].starts_with("import-") && refs[2] == image.id, "{refs:?}");
    let before = node.content().await;

    let done = sweep(&store, &Roots::default()).await;
    assert_eq!(done.len(), 3, "{done:?}");
    assert!(store.list().await.unwrap().is_empty());
    let after = node.content().await;
    assert!(image.layer_digests().iter().all(|blob| before.contains(blob) && !after.contains(blob)));
    assert!(!after.contains(&image.id));
}

#[tokio::test]
async fn a_root_keeps_its_name_while_the_garbage_tag_goes() {
    let (node, image) = (Containerd::start().await, SavedImage::build(64 << 10));
    let store = node.store().await;
    store.import(image.body(), &spec(&image)).await.unwrap();
    let garbage = format!("{}-old", image.qualified);
    node.create_ref(&garbage, node.target(&image.qualified).await).await;
    list_until(&store, |l| find(l, &image.id).is_some_and(|i| i.refs.len() == 3)).await;

    // The root spells the name the short way, as a record would.
    let roots = Roots { claims: vec![image.tag.clone()], ..Roots::default() };
    let done = sweep(&store, &roots).await;
    assert_eq!(done, vec![(RemovalTarget::Ref(garbage), Removal::Removed)]);
    let listing = store.list().await.unwrap();
    assert_eq!(find(&listing, &image.id).unwrap().refs, vec![image.qualified.clone(), image.id.clone()]);
}

#[tokio::test]
async fn removing_what_is_not_there_is_absent() {
    let (node, image) = (Containerd::start().await, SavedImage::build(64 << 10));
    let store = node.store().await;
    assert_eq!(store.remove_ref("docker.io/kiln-test/never:1").await.unwrap(), Removal::Absent);
    assert_eq!(store.remove_ref(&format!("sha256:{}", "0".repeat(64))).await.unwrap(), Removal::Absent);

    // A short spelling removes the qualified name containerd holds; then it is absent.
    store.import(image.body(), &spec(&image)).await.unwrap();
    assert_eq!(store.remove_ref(&image.tag).await.unwrap(), Removal::Removed);
    assert_eq!(store.remove_ref(&image.tag).await.unwrap(), Removal::Absent);
    assert_eq!(store.remove_ref(&image.qualified).await.unwrap(), Removal::Absent);

    let cri = node.cri().await;
    assert_eq!(cri.remove_ref(&format!("sha256:{}", "0".repeat(64))).await.unwrap(), Removal::Absent);
}

#[tokio::test]
async fn cri_remove_takes_the_names_and_id_ref_but_not_kinds_import_ref() {
    let (node, image) = (Containerd::start().await, SavedImage::build(1 << 20));
    node.ctr_import(&image.archive).await;
    let (store, cri) = (node.store().await, node.cri().await);
    list_until(&store, |l| find(l, &image.id).is_some_and(|i| i.refs.len() == 3)).await;
    let seen = cri.list().await.unwrap();
    let import_ref = find(&seen, &image.id).unwrap().refs.iter().find(|r| r.contains("/import-")).cloned();
    let import_ref = import_ref.expect("the CRI shows kind's ref among the image's repo digests");
    assert!(import_ref.starts_with("docker.io/library/import-"), "{import_ref}");

    // A name would take every tag of its image through the CRI: refused.
    assert!(matches!(cri.remove_ref(&image.qualified).await, Err(NodeError::NotAnImageId { .. })));

    let err = cri.remove_ref(&image.id).await.unwrap_err();
    assert!(matches!(err, NodeError::HeldByHiddenRefs { .. }), "{err}");
    assert!(err.to_string().contains(&import_ref), "{err}");
    // containerd decides: the names and the id ref went, the import ref and the content stayed.
    let listing = store.list().await.unwrap();
    let left = find(&listing, &image.id).expect("the import ref keeps the image");
    assert_eq!(left.refs.len(), 1);
    assert!(left.refs[0].starts_with("import-"), "{left:#?}");
    assert!(image.layer_digests().is_subset(&node.content().await));
    // And the CRI's listing says what holds it.
    assert_eq!(find(&cri.list().await.unwrap(), &image.id).unwrap().refs, vec![import_ref]);

    // Through containerd the leftover goes, and with it the content.
    let done = sweep(&store, &Roots::default()).await;
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(image.layer_digests().is_disjoint(&node.content().await));
    assert!(store.list().await.unwrap().is_empty());
    // The CRI's cache missed that removal (it looks the ref up under the name it misspelled), so
    // its list outlives containerd's refs: only containerd's own listing confirms a removal.
    assert!(find(&cri.list().await.unwrap(), &image.id).is_some());
    assert!(matches!(cri.remove_ref(&image.id).await, Err(NodeError::HeldByHiddenRefs { .. })));
}

#[tokio::test]
async fn cri_removes_a_whole_id_and_keeps_a_mixed_one_whole() {
    let node = Containerd::start().await;
    let (garbage, mixed) = (SavedImage::build(64 << 10), SavedImage::build(64 << 10));
    let store = node.store().await;
    store.import(garbage.body(), &spec(&garbage)).await.unwrap();
    store.import(mixed.body(), &spec(&mixed)).await.unwrap();
    let old = format!("{}-old", mixed.qualified);
    node.create_ref(&old, node.target(&mixed.qualified).await).await;
    let cri = node.cri().await;
    let seen =
        list_until(&cri, |l| find(l, &garbage.id).is_some() && find(l, &mixed.id).is_some_and(|i| i.refs.len() == 2))
            .await;
    assert_eq!(cri.removal_mode(), RemovalMode::PerId);

    // A root names one tag of `mixed`: the CRI cannot untag the other, so the id stays whole.
    let roots = Roots { claims: vec![mixed.qualified.clone()], ..Roots::default() };
    let planned = plan(&[node_listing(&cri, seen)], &roots, &Policy { farm: FARM.to_string() });
    let store_plan = &planned.stores[0];
    assert_eq!(store_plan.kept_whole.len(), 1);
    assert_eq!(
        (store_plan.kept_whole[0].id.as_str(), &store_plan.kept_whole[0].garbage_refs),
        (mixed.id.as_str(), &vec![old.clone()])
    );
    assert_eq!(store_plan.removals.len(), 1);
    assert_eq!(store_plan.removals[0].target, RemovalTarget::Id(garbage.id.clone()));

    assert_eq!(cri.remove_ref(&garbage.id).await.unwrap(), Removal::Removed);
    let listing = store.list().await.unwrap();
    assert!(find(&listing, &garbage.id).is_none(), "every ref of the id went: {listing:#?}");
    assert!(garbage.layer_digests().is_disjoint(&node.content().await));
    let kept = find(&listing, &mixed.id).unwrap();
    assert!(kept.refs.contains(&mixed.qualified) && kept.refs.contains(&old), "{kept:#?}");
}

#[tokio::test]
async fn workload_images_are_what_containers_use() {
    let (node, image) = (Containerd::start().await, SavedImage::build(64 << 10));
    let store = node.store().await;
    assert!(store.workload_images().await.unwrap().is_empty());
    store.import(image.body(), &spec(&image)).await.unwrap();
    node.create_container("web-1", &image.qualified).await;
    node.create_container("web-2", &image.qualified).await;
    node.create_container("db-1", "docker.io/library/postgres:16").await;
    assert_eq!(
        store.workload_images().await.unwrap(),
        vec![image.qualified.clone(), "docker.io/library/postgres:16".to_string()]
    );

    // As a root, the workload keeps the image it names.
    let used = store.workload_images().await.unwrap();
    let mut roots = Roots::default();
    roots.workloads.insert(StoreId(store.describe()), used);
    list_until(&store, |l| find(l, &image.id).is_some_and(|i| i.refs.len() == 2)).await;
    assert!(sweep(&store, &roots).await.is_empty());
}

#[tokio::test]
async fn a_tampered_or_mismatched_archive_is_refused_and_names_nothing() {
    let (node, image) = (Containerd::start().await, SavedImage::build(2 << 20));
    let store = node.store().await;

    let wrong_id = ImportSpec { reference: image.tag.clone(), id: format!("sha256:{}", "1".repeat(64)) };
    let err = store.import(image.body(), &wrong_id).await.unwrap_err();
    assert!(matches!(&err, NodeError::DigestMismatch { what, .. } if what == "the image config"), "{err}");

    let err = store.import(body(image.tampered_layer()), &spec(&image)).await.unwrap_err();
    assert!(matches!(&err, NodeError::DigestMismatch { what, .. } if what.starts_with("layer ")), "{err}");

    let mut cut = image.archive.clone();
    cut.truncate(cut.len() / 2);
    let err = store.import(body(cut), &spec(&image)).await.unwrap_err();
    assert!(matches!(err, NodeError::ArchiveRead { .. } | NodeError::NotAnImageArchive { .. }), "{err}");

    let failing: kiln_agent::node::ImportBody = Box::pin(futures_util::stream::iter(vec![
        Ok(bytes::Bytes::copy_from_slice(&image.archive[..4096])),
        Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "host agent went away")),
    ]));
    let err = store.import(failing, &spec(&image)).await.unwrap_err();
    assert!(matches!(err, NodeError::ArchiveRead { .. }), "{err}");

    assert!(store.list().await.unwrap().is_empty(), "no failed import named anything");
}

#[tokio::test]
async fn repeated_layers_and_the_oci_archive_layout_import() {
    let node = Containerd::start().await;
    let store = node.store().await;
    for layout in [Synthetic::LegacyWithLink, Synthetic::Oci] {
        let archive = synthetic_archive(layout);
        let spec =
            ImportSpec { reference: format!("kiln-test/synthetic:{layout:?}").to_lowercase(), id: archive.id.clone() };
        let imported = store.import(body(archive.bytes.clone()), &spec).await.unwrap();
        assert_eq!(imported.id, archive.id, "{layout:?}");
        assert_eq!(imported.bytes, archive.image_bytes, "{layout:?}");
        let listing = store.list().await.unwrap();
        let listed = find(&listing, &archive.id).unwrap();
        assert_eq!(listed.labels.get("kiln.dev/kind").map(String::as_str), Some("image"));
        let content = node.content().await;
        assert!(archive.layer_digests.iter().all(|d| content.contains(d)), "{layout:?}");
    }
}

#[tokio::test]
async fn an_unreachable_socket_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nothing.sock");
    let err = ContainerdStore::connect(&socket, "k8s.io").await.unwrap_err();
    assert!(matches!(err, NodeError::Unreachable { .. }));
    assert!(err.to_string().contains(&socket.display().to_string()), "{err}");
}

/// Imports run side by side on one node, each to its own name.
#[tokio::test]
async fn parallel_imports_of_shared_layers_all_land() {
    let (node, image) = (Containerd::start().await, SavedImage::build(1 << 20));
    let store = node.store().await;
    let names: Vec<String> = (0..4).map(|i| format!("{}-{i}", image.tag)).collect();
    let imports = names.iter().map(|name| {
        let store = &store;
        let spec = ImportSpec { reference: name.clone(), id: image.id.clone() };
        let archive = image.body();
        async move { store.import(archive, &spec).await }
    });
    for imported in futures_util::future::join_all(imports).await {
        assert_eq!(imported.unwrap().id, image.id);
    }
    let listing = store.list().await.unwrap();
    let refs: BTreeSet<&String> = find(&listing, &image.id).unwrap().refs.iter().collect();
    assert!(names.iter().all(|name| refs.contains(&format!("docker.io/{name}"))), "{refs:?}");
}

#[tokio::test]
async fn a_node_agent_says_hello_as_a_node_and_lists_and_removes_for_the_coordinator() {
    use kiln_proto::v1 as pb;
    let (node, image) = (Containerd::start().await, SavedImage::build(64 << 10));
    let store = node.store().await;
    store.import(image.body(), &spec(&image)).await.unwrap();
    let mut hub = kiln_e2e::containerd::hub::StandIn::start().await;
    let scratch = tempfile::tempdir().unwrap();
    let config = kiln_agent::AgentConfig {
        cluster: "c1".to_string(),
        ..kiln_agent::AgentConfig::new(hub.url.clone(), "node-1", scratch.path().to_path_buf())
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(kiln_agent::run_node_with(config, std::sync::Arc::new(store), async {
        let _ = stopped.await;
    }));

    let hello = hub.hello().await;
    assert_eq!(hello.role(), pb::Role::Node);
    assert_eq!(hello.stores.len(), 1);
    assert_eq!(hello.stores[0].kind(), pb::store_info::Kind::Node);
    assert_eq!(hello.stores[0].id, "containerd@node-1");

    let pb::task_result::Outcome::Listing(listing) = hub.run(pb::task::Kind::List(pb::ListTask::default())).await
    else {
        panic!("a listing answers a list task");
    };
    let listed = listing.images.iter().find(|i| i.id == image.id).expect("the image is listed");
    assert_eq!(listed.refs, vec![image.qualified.clone(), image.id.clone()]);
    assert_eq!(listed.labels.get("kiln.dev/kind").map(String::as_str), Some("image"));

    let missing = "docker.io/kiln-test/never:1".to_string();
    let remove = pb::RemoveTask { references: vec![image.qualified.clone(), missing.clone()], ..Default::default() };
    let pb::task_result::Outcome::Removed(removed) = hub.run(pb::task::Kind::Remove(remove)).await else {
        panic!("a removal answers a remove task");
    };
    assert_eq!(
        (removed.removed, removed.absent, removed.failed),
        (vec![image.qualified.clone()], vec![missing], vec![])
    );

    let build = pb::BuildTask { tag: "x:1".into(), ..Default::default() };
    let pb::task_result::Outcome::Error(refused) = hub.run(pb::task::Kind::Build(build)).await else {
        panic!("a node agent refuses to build");
    };
    assert_eq!(refused.kind(), pb::task_error::Kind::Unsupported);

    stop.send(()).unwrap();
    agent.await.unwrap().unwrap();
}
