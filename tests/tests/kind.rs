//! Delivery to a `kind` cluster without the kind binary, against the real Docker daemon and fake
//! kind nodes (`kiln_e2e::kind`): containers labeled as kind labels its nodes, each running the
//! Debian package's containerd.

use kiln_e2e::fixture::{reference, unique};
use kiln_e2e::kind::{instance, KindNode};
use kiln_e2e::wire::{gc, succeeded, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1::converge_event::Kind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_reaches_the_containerd_of_every_kind_node_and_a_second_delivery_skips_them() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = unique("kc");
    let nodes = [
        KindNode::start(&cluster, &format!("{cluster}-control-plane")),
        KindNode::start(&cluster, &format!("{cluster}-worker")),
    ];
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let dir = instance(tmp.path(), &unique("kinddel"), &cluster);

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let web = reference(&dir, "web");
    let qualified = format!("docker.io/library/{web}");
    for node in &nodes {
        let refs = node.refs();
        assert!(refs.contains(&qualified), "{} lists {qualified}: {refs:?}", node.name);
        assert!(refs.iter().any(|r| r.starts_with("import-")), "the refs kind itself would create: {refs:?}");
    }

    // Forced: rebuilt from cache (the same id) and delivered again, to nodes that hold it.
    let events = up(&farm.url, &dir, true).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(events.iter().any(|e| e.kind() == Kind::Delivered && e.message.contains("already holds")), "{events:#?}");
    farm.stop().await;
    docker::remove(&web);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_cluster_with_no_node_container_fails_the_converge_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let dir = instance(tmp.path(), &unique("kindnone"), "no-such-cluster");
    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events));
    let failed: String = events.iter().filter(|e| e.kind() == Kind::Failed).map(|e| e.message.clone()).collect();
    assert!(failed.contains("kind cluster no-such-cluster"), "{failed}");
    farm.stop().await;
    docker::remove(&reference(&dir, "web"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_node_out_of_direct_reach_is_loaded_through_docker_exec_and_reported_not_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = unique("kh");
    let node = KindNode::start_hidden(&cluster, &format!("{cluster}-control-plane"));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let dir = instance(tmp.path(), &unique("kindhidden"), &cluster);

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let web = reference(&dir, "web");
    assert!(node.refs().contains(&format!("docker.io/library/{web}")), "{:?}", node.refs());
    // The holds check falls back to `docker exec ctr` and still sees the image there.
    let events = up(&farm.url, &dir, true).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(events.iter().any(|e| e.kind() == Kind::Delivered && e.message.contains("already holds")), "{events:#?}");

    let events = gc(&farm.url, false, None).await;
    let store = kiln_agent::stores::kind_store_id("e2e-agent", &node.name);
    let note = events
        .iter()
        .find(|e| e.kind() == Kind::Note && e.message.contains(&store))
        .unwrap_or_else(|| panic!("no note about {store}: {events:#?}"));
    assert!(note.message.contains("not swept") && note.message.contains("cannot reach the containerd"), "{note:#?}");
    farm.stop().await;
    docker::remove(&web);
}
