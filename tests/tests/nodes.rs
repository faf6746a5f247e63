//! Delivery to a `nodes` cluster and the sweep on its nodes, against the real Docker daemon and one
//! real containerd per simulated node, each served by a real node agent (`run_node_with`).
//!
//! The image travels the production path: the host agent's `docker save` goes to the coordinator's
//! relay, and each node agent imports it from there through containerd's API.

use async_trait::async_trait;
use kiln_agent::node::{ContainerdStore, ImportBody, ImportSpec, Imported, NodeError, NodeStore, Removal, RemovalMode};
use kiln_core::sweep::{LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
use kiln_e2e::containerd::Containerd;
use kiln_e2e::fixture::{reference, unique, write};
use kiln_e2e::wire::{gc, succeeded, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An instance of one image built `FROM scratch`, delivered to the nodes of `cluster`.
fn instance(into: &Path, name: &str, cluster: &str) -> PathBuf {
    let dir = into.join(name);
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{name}\"\n\n[target]\nkind = \"nodes\"\ncluster = \"{cluster}\"\n\n[built.web]\ncontext = \"web\"\n"),
    );
    write(&dir, "web/Dockerfile", "FROM scratch\nCOPY index.html /srv/index.html\n");
    write(&dir, "web/index.html", &format!("<p>{}</p>\n", unique("first")));
    dir
}

/// A farm with node agents `n1`, `n2` of a fresh cluster, each on its own containerd.
async fn farm_with_nodes(home: &Path, count: usize) -> (Farm, String, Vec<Containerd>) {
    let mut farm = Farm::start(home).await;
    let cluster = unique("c");
    let mut nodes = Vec::new();
    for i in 1..=count {
        let node = Containerd::start().await;
        farm.start_node(&cluster, &format!("{cluster}-n{i}"), Arc::new(node.store().await)).await;
        nodes.push(node);
    }
    (farm, cluster, nodes)
}

async fn holds(node: &Containerd, reference: &str, id: &str) -> bool {
    node.store().await.holds(reference, id).await.unwrap()
}

fn failure(events: &[pb::ConvergeEvent]) -> String {
    events.iter().filter(|e| e.kind() == Kind::Failed).map(|e| e.message.clone()).collect::<Vec<_>>().join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_reaches_every_node_once_and_a_node_holding_it_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut farm, _cluster, nodes) = farm_with_nodes(&tmp.path().join("home"), 2).await;
    let dir = instance(tmp.path(), &unique("deliv"), &_cluster);

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let web = reference(&dir, "web");
    let id = docker::image_id(&web).expect("the host holds what it built");
    for node in &nodes {
        assert!(holds(node, &web, &id).await, "every node of the cluster holds the ref on the image id");
    }
    assert_eq!(farm.exports(), 1, "the host exports the image once, whatever the number of nodes");

    // Forced: rebuilt (from cache, the same id) and delivered again — to nodes that hold it.
    let events = up(&farm.url, &dir, true).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.exports(), 1, "nodes holding the id under the ref take nothing: no export at all");
    assert!(events.iter().any(|e| e.kind() == Kind::Delivered && e.message.contains("already holds")), "{events:#?}");
    farm.stop().await;
    docker::remove(&web);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_node_agent_of_the_cluster_the_converge_fails_naming_the_cluster() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut farm, _cluster, _nodes) = farm_with_nodes(&tmp.path().join("home"), 1).await;
    let dir = instance(tmp.path(), &unique("nonode"), "nowhere");
    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events));
    let why = failure(&events);
    assert!(why.contains("cluster `nowhere`") && why.contains("--cluster nowhere"), "{why}");
    farm.stop().await;
    docker::remove(&reference(&dir, "web"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_nodes_the_replaced_ref_survives_one_generation_while_the_host_tag_goes_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut farm, cluster, nodes) = farm_with_nodes(&tmp.path().join("home"), 2).await;
    let dir = instance(tmp.path(), &unique("grace"), &cluster);
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let first = reference(&dir, "web");
    let first_id = docker::image_id(&first).unwrap();

    write(&dir, "web/index.html", &format!("<p>{}</p>\n", unique("second")));
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let second = reference(&dir, "web");
    let second_id = docker::image_id(&second).unwrap();
    assert!(docker::image_id(&first).is_none(), "nothing runs on the build host: its old tag goes at once");
    for node in &nodes {
        assert!(holds(node, &first, &first_id).await, "a node keeps the generation just replaced");
        assert!(holds(node, &second, &second_id).await);
    }

    write(&dir, "web/index.html", &format!("<p>{}</p>\n", unique("third")));
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    for node in &nodes {
        assert!(!holds(node, &first, &first_id).await, "two generations back, it goes from every node");
        assert!(holds(node, &second, &second_id).await, "the generation just replaced is kept again");
    }
    farm.stop().await;
    for r in [&second, &reference(&dir, "web")] {
        docker::remove(r);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_a_node_container_uses_survives_gc() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut farm, cluster, nodes) = farm_with_nodes(&tmp.path().join("home"), 1).await;
    let dir = instance(tmp.path(), &unique("inuse"), &cluster);
    assert!(succeeded(&up(&farm.url, &dir, false).await));
    let first = reference(&dir, "web");
    let first_id = docker::image_id(&first).unwrap();
    let node = &nodes[0];
    let qualified = node.store().await.list().await.unwrap();
    let named = qualified.iter().find(|i| i.id == first_id).unwrap().refs[0].clone();
    node.create_container(&unique("ctr"), &named).await;

    for step in ["second", "third"] {
        write(&dir, "web/index.html", &format!("<p>{}</p>\n", unique(step)));
        assert!(succeeded(&up(&farm.url, &dir, false).await));
    }
    // Garbage beside it shows the node store really was swept, not skipped.
    let (garbage, archive) = saved_garbage(&farm, "gone");
    node.ctr_import(&archive).await;
    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    assert!(holds(node, &first, &first_id).await, "a container on the node still uses it: a root");
    let left = node.store().await.list().await.unwrap();
    assert!(!left.iter().any(|i| i.refs.iter().any(|r| r.contains(&garbage))), "the garbage went: {left:#?}");
    farm.stop().await;
    docker::remove(&reference(&dir, "web"));
}

/// Plants, through `ctr import` as `kind load` does, an image of `farm`'s `instance` that nothing
/// names: garbage on the node, under a named ref, an `import-*` ref and the CRI's `sha256:` ref.
fn saved_garbage(farm: &Farm, instance: &str) -> (String, Vec<u8>) {
    let (tag, _, archive) = saved_garbage_with_id(farm, instance);
    (tag, archive)
}

/// [`saved_garbage`], with the image id.
fn saved_garbage_with_id(farm: &Farm, instance: &str) -> (String, String, Vec<u8>) {
    let tag = format!("kiln-test/{}:1", unique("garbage"));
    let labels = [(LABEL_KIND, "image"), (LABEL_INSTANCE, instance), (LABEL_FARM, farm.farm_id.as_str())];
    docker::plant_labeled(&[&tag], &labels, &unique("garbage"));
    let id = docker::image_id(&tag).unwrap();
    let saved = std::process::Command::new("docker").args(["save", &tag]).output().unwrap();
    assert!(saved.status.success());
    docker::remove(&tag);
    (tag, id, saved.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kind_style_import_refs_and_cri_id_refs_go_with_their_named_ref_and_content_is_reclaimed() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut farm, _cluster, nodes) = farm_with_nodes(&tmp.path().join("home"), 1).await;
    let node = &nodes[0];
    let before = node.content().await;
    let (tag, archive) = saved_garbage(&farm, "gone");
    node.ctr_import(&archive).await;
    let listed = node.store().await.list().await.unwrap();
    let refs: Vec<String> = listed.iter().flat_map(|i| i.refs.clone()).collect();
    assert!(refs.iter().any(|r| r.contains("import-")), "kind's import ref is there: {refs:?}");
    assert!(refs.iter().any(|r| r.starts_with("sha256:")), "the CRI's id ref is there: {refs:?}");
    assert!(node.content().await.len() > before.len());

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    let left = node.store().await.list().await.unwrap();
    assert!(left.is_empty(), "every ref of the garbage went, {tag} among them: {left:#?}");
    assert_eq!(node.content().await, before, "its content was reclaimed");
    farm.stop().await;
}

/// A node store that refuses to remove one ref, as a containerd refusing one removal would.
struct Refusing {
    inner: ContainerdStore,
    refuse: std::sync::Mutex<Option<String>>,
}

#[async_trait]
impl NodeStore for Refusing {
    fn removal_mode(&self) -> RemovalMode {
        self.inner.removal_mode()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn list(&self) -> Result<Vec<kiln_core::sweep::ListedImage>, NodeError> {
        self.inner.list().await
    }
    async fn import(&self, archive: ImportBody, spec: &ImportSpec) -> Result<Imported, NodeError> {
        self.inner.import(archive, spec).await
    }
    async fn remove_ref(&self, reference: &str) -> Result<Removal, NodeError> {
        let refused = self.refuse.lock().unwrap().as_deref().is_some_and(|r| reference.contains(r));
        if refused {
            return Err(NodeError::Refused {
                socket: PathBuf::from("refusing"),
                op: "images rm",
                object: reference.to_string(),
                source: tonic::Status::failed_precondition("refused by the test"),
            });
        }
        self.inner.remove_ref(reference).await
    }
    async fn workload_images(&self) -> Result<Vec<String>, NodeError> {
        self.inner.workload_images().await
    }
    async fn ping(&self) -> Result<(), NodeError> {
        self.inner.ping().await
    }
    async fn holds(&self, reference: &str, id: &str) -> Result<bool, NodeError> {
        self.inner.holds(reference, id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_failing_on_one_node_is_reported_and_the_other_nodes_proceed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let cluster = unique("c");
    let (bad, good) = (Containerd::start().await, Containerd::start().await);
    let (garbage_tag, archive) = saved_garbage(&farm, "gone");
    let name = garbage_tag.split(':').next().unwrap().to_string();
    let refusing = Refusing { inner: bad.store().await, refuse: std::sync::Mutex::new(Some(name.clone())) };
    farm.start_node(&cluster, &format!("{cluster}-bad"), Arc::new(refusing)).await;
    farm.start_node(&cluster, &format!("{cluster}-good"), Arc::new(good.store().await)).await;
    bad.ctr_import(&archive).await;
    good.ctr_import(&archive).await;

    let events = gc(&farm.url, false, None).await;
    let not_removed: Vec<_> = events.iter().filter(|e| e.kind() == Kind::NotRemoved).collect();
    assert!(not_removed.iter().any(|e| e.reference.contains(&name)), "the refusal is reported: {events:#?}");
    let good_left = good.store().await.list().await.unwrap();
    assert!(good_left.is_empty(), "the other node's garbage went anyway: {good_left:#?}");
    let bad_left = bad.store().await.list().await.unwrap();
    assert!(bad_left.iter().any(|i| i.refs.iter().any(|r| r.contains(&name))), "the refused ref is still there");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cri_only_node_a_mixed_id_is_kept_whole_and_reported_and_a_garbage_id_goes_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let cluster = unique("c");
    let node = Containerd::start().await;
    farm.start_node(&cluster, &format!("{cluster}-cri"), Arc::new(node.cri().await)).await;
    let containerd = node.store().await;
    // Imported through containerd's API (no kind `import-*` ref, which the CRI cannot see to remove).
    let (mixed_tag, mixed_id, mixed) = saved_garbage_with_id(&farm, "gone");
    let (gone_tag, gone_id, gone) = saved_garbage_with_id(&farm, "gone");
    for (tag, id, archive) in [(&mixed_tag, &mixed_id, mixed), (&gone_tag, &gone_id, gone)] {
        let spec = ImportSpec { reference: tag.clone(), id: id.clone() };
        containerd.import(kiln_e2e::containerd::body(archive), &spec).await.unwrap();
    }
    // A second, pinned name on the mixed image: a root the CRI could only keep by keeping it all.
    let pinned = format!("docker.io/kiln-test/{}:1", unique("pinned"));
    let target = node.target(&format!("docker.io/{mixed_tag}")).await;
    node.create_ref(&pinned, target).await;
    kiln_e2e::wire::pin(&farm.url, &pinned, true).await;

    let events = gc(&farm.url, false, None).await;
    assert!(succeeded(&events), "{events:#?}");
    let reported = events
        .iter()
        .any(|e| e.kind() == Kind::Note && e.message.contains("kept whole") && e.message.contains(&mixed_id));
    assert!(reported, "the mixed id is reported: {events:#?}");
    let left = containerd.list().await.unwrap();
    let mixed_left = left.iter().find(|i| i.id == mixed_id).expect("the mixed id is kept");
    assert!(mixed_left.refs.iter().any(|r| r.contains(&mixed_tag)), "its garbage name too: {mixed_left:?}");
    assert!(!left.iter().any(|i| i.id == gone_id), "an id every name of which is garbage goes whole: {left:#?}");
    farm.stop().await;
}
