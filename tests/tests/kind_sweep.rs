//! The sweep on kind nodes: the host agent reaches the containerd of every kind node container on
//! its daemon and serves it as a node store, so images delivered with the `kind` target are swept
//! like any node's — one generation of grace, workloads kept, nothing unlabeled or another farm's
//! touched. Against the real Docker daemon and fake kind nodes (`kiln_e2e::kind`) running the
//! Debian package's containerd.

use kiln_core::sweep::{LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
use kiln_e2e::fixture::{reference, unique, write};
use kiln_e2e::kind::{instance, KindNode};
use kiln_e2e::wire::{channel, gc, succeeded, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1 as pb;
use std::path::Path;

fn qualified(reference: &str) -> String {
    format!("docker.io/library/{reference}")
}

/// Edits the instance's one file and converges, asserting success.
async fn next_generation(farm: &Farm, dir: &Path, step: &str) -> String {
    write(dir, "web/index.html", &format!("<p>{}</p>\n", unique(step)));
    let events = up(&farm.url, dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    reference(dir, "web")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_kind_node_the_replaced_image_survives_one_generation_then_goes_with_its_import_refs_and_content() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = unique("ks");
    let node = KindNode::start(&cluster, &format!("{cluster}-control-plane"));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let dir = instance(tmp.path(), &unique("kgrace"), &cluster);
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let first = reference(&dir, "web");
    let first_id = docker::image_id(&first).unwrap();
    // The node was empty: every ref on it now is the first image's (its name and kind's import ref).
    let first_refs = node.refs();
    assert!(first_refs.contains(&qualified(&first)), "{first_refs:?}");
    assert!(first_refs.iter().any(|r| r.starts_with("import-")), "{first_refs:?}");
    assert!(node.content().contains(&first_id));

    // `kiln images` shows the node's containerd as one of the host agent's stores.
    let store = kiln_agent::stores::kind_store_id("e2e-agent", &node.name);
    let mut client = pb::kiln_client::KilnClient::new(channel(&farm.url));
    let stores = client.images(pb::ImagesRequest::default()).await.unwrap().into_inner().stores;
    let listed = stores.iter().find(|s| s.store == store).unwrap_or_else(|| panic!("no {store} in {stores:#?}"));
    assert!(listed.error.is_empty(), "{listed:#?}");
    assert!(listed.images.iter().any(|i| i.id == first_id), "{listed:#?}");

    let second = next_generation(&farm, &dir, "second").await;
    let refs = node.refs();
    for r in &first_refs {
        assert!(refs.contains(r), "the generation just replaced keeps every ref on the node: {r} of {refs:?}");
    }
    assert!(docker::image_id(&first).is_none(), "the build host's old tag goes at once");

    let third = next_generation(&farm, &dir, "third").await;
    let refs = node.refs();
    for r in &first_refs {
        assert!(!refs.contains(r), "two generations back, {r} goes from the kind node: {refs:?}");
    }
    assert!(refs.contains(&qualified(&second)), "the generation just replaced stays: {refs:?}");
    assert!(refs.contains(&qualified(&third)), "{refs:?}");
    assert!(!node.content().contains(&first_id), "its content is reclaimed, not just its names");
    farm.stop().await;
    for r in [&second, &third] {
        docker::remove(r);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_on_a_kind_node_keeps_what_its_containers_use_unlabeled_images_and_other_farms() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = unique("kg");
    let node = KindNode::start(&cluster, &format!("{cluster}-worker"));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let dir = instance(tmp.path(), &unique("kinuse"), &cluster);
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let used = reference(&dir, "web");
    // A container on the node (created, as the kubelet would, in namespace k8s.io) uses it.
    node.ctr(&["containers", "create", &qualified(&used), &unique("workload")]);

    let unlabeled = format!("{}:1", unique("kunlabeled"));
    let other_farm = format!("{}:1", unique("kotherfarm"));
    let garbage = format!("{}:1", unique("kgarbage"));
    let unlabeled_id = docker::plant_unlabeled(&unlabeled);
    let other_farm_id = docker::plant_other_farm(&other_farm, "some-other-farm");
    let labels = [(LABEL_KIND, "image"), (LABEL_INSTANCE, "kinuse"), (LABEL_FARM, farm.farm_id.as_str())];
    docker::plant_labeled(&[&garbage], &labels, &unique("garbage"));
    for planted in [&unlabeled, &other_farm, &garbage] {
        node.load(planted);
        docker::remove(planted);
    }

    let second = next_generation(&farm, &dir, "second").await;
    let third = next_generation(&farm, &dir, "third").await;
    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    let refs = node.refs();
    assert!(refs.contains(&qualified(&used)), "a container on the kind node uses it: a root — {refs:?}");
    assert!(refs.contains(&qualified(&unlabeled)), "never Kiln's to take: {refs:?}");
    assert!(refs.contains(&qualified(&other_farm)), "another farm's: {refs:?}");
    assert!(!refs.contains(&qualified(&garbage)), "this farm's garbage goes, so the node really was swept: {refs:?}");

    // `kiln images --all-farms` shows what Kiln labeled on the node, whatever the farm, and
    // nothing else; without it, this farm's alone.
    let store = kiln_agent::stores::kind_store_id("e2e-agent", &node.name);
    let client = pb::kiln_client::KilnClient::new(channel(&farm.url));
    let ids_listed = |all_farms| {
        let mut client = client.clone();
        let store = store.clone();
        async move {
            let stores = client.images(pb::ImagesRequest { all_farms }).await.unwrap().into_inner().stores;
            let listed =
                stores.iter().find(|s| s.store == store).unwrap_or_else(|| panic!("no {store} in {stores:#?}"));
            listed.images.iter().map(|i| i.id.clone()).collect::<Vec<String>>()
        }
    };
    let ids = ids_listed(true).await;
    assert!(ids.contains(&other_farm_id), "{ids:?}");
    assert!(!ids.contains(&unlabeled_id), "{ids:?}");
    let ours = ids_listed(false).await;
    assert!(!ours.contains(&other_farm_id), "another farm's image is listed only with --all-farms: {ours:?}");
    farm.stop().await;
    for r in [&second, &third] {
        docker::remove(r);
    }
}
