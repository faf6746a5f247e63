//! Delivery to a `kind` cluster without the kind binary, against the real Docker daemon and fake
//! kind nodes (`kiln_e2e::kind`): containers labeled as kind labels its nodes, each running the
//! Debian package's containerd.

use kiln_e2e::fixture::{reference, unique, write};
use kiln_e2e::kind::{instance, KindNode};
use kiln_e2e::wire::{gc, succeeded, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1::converge_event::Kind;
use std::path::{Path, PathBuf};

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

/// This machine's platform, which its daemon's kind node containers run, and another one.
fn native_and_other() -> (&'static str, &'static str) {
    match std::env::consts::ARCH {
        "x86_64" => ("linux/amd64", "linux/arm64"),
        "aarch64" => ("linux/arm64", "linux/amd64"),
        other => panic!("no kind test platforms for {other}"),
    }
}

/// Instance `name`: one `FROM scratch` image, `web`, for `platforms`, to kind cluster `cluster`.
fn multi_instance(into: &Path, name: &str, cluster: &str, platforms: &[&str]) -> PathBuf {
    let dir = instance(into, name, cluster);
    let list = platforms.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", ");
    write(
        &dir,
        "kiln.toml",
        &format!(
            "instance = \"{name}\"\nplatforms = [{list}]\n\n[target]\nkind = \"kind\"\ncluster = \"{cluster}\"\n\n\
             [built.web]\ncontext = \"web\"\n"
        ),
    );
    dir
}

/// The platform and config digest of the image node `node` names `qualified`: `ctr images ls`
/// reads the platform off the image's config; the config digest is the image id.
fn node_image(node: &KindNode, qualified: &str) -> (String, String) {
    let rows = node.ctr(&["images", "ls", &format!("name=={qualified}")]);
    let row = rows.iter().skip(1).find(|r| r.starts_with(&format!("{qualified} "))).unwrap_or_else(|| {
        panic!("{} does not list {qualified}: {rows:?}", node.name);
    });
    let cols: Vec<&str> = row.split_whitespace().collect();
    let platform = cols.iter().find(|c| c.starts_with("linux/")).unwrap_or_else(|| panic!("{row}")).to_string();
    let manifest: serde_json::Value = serde_json::from_str(&node.ctr(&["content", "get", cols[2]]).join("\n")).unwrap();
    let config = manifest.pointer("/config/digest").and_then(|d| d.as_str()).unwrap_or_else(|| panic!("{manifest}"));
    (platform, config.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_cluster_gets_its_own_platform_of_a_two_platform_image_under_the_content_ref() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = unique("kmp");
    let nodes = [
        KindNode::start(&cluster, &format!("{cluster}-control-plane")),
        KindNode::start(&cluster, &format!("{cluster}-worker")),
    ];
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (native, other) = native_and_other();
    let dir = multi_instance(tmp.path(), &unique("kindmp"), &cluster, &["linux/amd64", "linux/arm64"]);

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let web = reference(&dir, "web");
    assert!(web.ends_with("-amd64.arm64"), "the content ref names both platforms: {web}");
    let token = |p: &str| p.trim_start_matches("linux/").to_string();
    let (native_ref, other_ref) = (format!("{web}-{}", token(native)), format!("{web}-{}", token(other)));
    let (native_id, other_id) = (docker::image_id(&native_ref).unwrap(), docker::image_id(&other_ref).unwrap());
    assert_ne!(native_id, other_id, "two platforms, two images");
    let qualified = format!("docker.io/library/{web}");
    for node in &nodes {
        let (platform, config) = node_image(node, &qualified);
        assert_eq!(platform, native, "{} holds its own platform under {qualified}", node.name);
        assert_eq!(config, native_id, "{} holds the {native} image Kiln built", node.name);
        let refs = node.refs();
        assert!(
            refs.iter().all(|r| !r.ends_with(&native_ref) && !r.ends_with(&other_ref)),
            "no platform ref: {refs:?}"
        );
    }
    assert_eq!(farm.builds(), 2, "one build per platform");

    // A second converge builds nothing and finds every node holding its platform.
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.builds(), 2, "a second converge builds nothing");
    assert!(
        events.iter().all(|e| e.kind() != Kind::Delivered || e.message.contains("already holds")),
        "nothing delivered again: {events:#?}"
    );

    // A node that lost the image gets its platform back from the host, still without a build.
    nodes[1].ctr(&["images", "rm", &qualified]);
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.builds(), 2, "delivered again from the host's platform image, not rebuilt");
    assert_eq!(node_image(&nodes[1], &qualified), (native.to_string(), native_id.clone()));
    farm.stop().await;
    docker::remove(&native_ref);
    docker::remove(&other_ref);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kind_node_of_a_platform_outside_the_set_fails_the_converge_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = unique("krv");
    let node = KindNode::start(&cluster, &format!("{cluster}-control-plane"));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (native, other) = native_and_other();
    let dir = multi_instance(tmp.path(), &unique("kindrv"), &cluster, &[other, "linux/riscv64"]);

    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events), "{events:#?}");
    let failed: String = events.iter().filter(|e| e.kind() == Kind::Failed).map(|e| e.message.clone()).collect();
    assert!(failed.contains(&format!("kind node {}", node.name)) && failed.contains(native), "{failed}");
    assert_eq!(farm.builds(), 0, "refused before anything was built");
    farm.stop().await;
}
