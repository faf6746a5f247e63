//! Multi-platform images (issue 11) against the real Docker daemon, a real registry and one real
//! containerd per simulated node: one task per platform, the index under the content tag, each
//! node its own platform, and the emulation preflight.
//!
//! This machine is amd64 with no binfmt_misc handlers: an arm64 image builds here only because its
//! Dockerfile runs nothing (`FROM scratch` + `COPY`), which BuildKit builds for any platform.

use kiln_agent::node::NodeStore;
use kiln_e2e::containerd::Containerd;
use kiln_e2e::fixture::{reference, unique, write};
use kiln_e2e::wire::{images_with, succeeded, up};
use kiln_e2e::{docker, Farm, Registry};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const ACCEPT_ANY: &str = "application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.oci.image.manifest.v1+json";

/// An instance of one image `app` for `platforms`, delivered to `target` (a `[target]` body).
fn instance(into: &Path, name: &str, platforms: &[&str], target: &str, dockerfile: &str) -> PathBuf {
    let dir = into.join(name);
    let list = platforms.iter().map(|p| format!("\"{p}\"")).collect::<Vec<_>>().join(", ");
    write(
        &dir,
        "kiln.toml",
        &format!(
            "instance = \"{name}\"\nplatforms = [{list}]\n\n[target]\n{target}\n\n[built.app]\ncontext = \"app\"\n"
        ),
    );
    write(&dir, "app/Dockerfile", dockerfile);
    write(&dir, "app/hello.txt", &format!("{}\n", unique("hello")));
    dir
}

const COPY_ONLY: &str = "FROM scratch\nCOPY hello.txt /hello.txt\n";

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn failure(events: &[pb::ConvergeEvent]) -> String {
    events.iter().filter(|e| e.kind() == Kind::Failed).map(|e| e.message.clone()).collect::<Vec<_>>().join("\n")
}

/// `(repository, tag)` of a ref on `registry`.
fn repo_and_tag<'a>(reference: &'a str, registry: &str) -> (&'a str, &'a str) {
    reference.trim_start_matches(&format!("{registry}/")).rsplit_once(':').unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_platforms_become_one_index_in_the_registry_and_a_second_converge_moves_nothing() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let target = format!("kind = \"registry\"\nregistry = \"{}\"", registry.addr);
    let dir = instance(tmp.path(), &unique("multi"), &["linux/amd64", "linux/arm64"], &target, COPY_ONLY);
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.builds(), 2, "one build per platform");
    assert_eq!(farm.pushes(), 2, "one push per platform's image");

    let app = reference(&dir, "app");
    assert!(app.ends_with("-amd64.arm64"), "{app}");
    let (repo, tag) = repo_and_tag(&app, &registry.addr);
    let (status, body) = registry.get_with(&format!("/v2/{repo}/manifests/{tag}"), &[("Accept", ACCEPT_ANY)]).unwrap();
    assert_eq!(status, 200, "{body}");
    let index = json(&body);
    assert_eq!(index["mediaType"], LIST, "{body}");
    let manifests = index["manifests"].as_array().unwrap();
    let archs: Vec<&str> = manifests.iter().map(|m| m["platform"]["architecture"].as_str().unwrap()).collect();
    assert_eq!(archs, vec!["amd64", "arm64"]);
    for m in manifests {
        let digest = m["digest"].as_str().unwrap();
        let (status, body) =
            registry.get_with(&format!("/v2/{repo}/manifests/{digest}"), &[("Accept", ACCEPT_ANY)]).unwrap();
        assert_eq!(status, 200, "{body}");
        let config = json(&body)["config"]["digest"].as_str().unwrap().to_string();
        let (status, body) = registry.get(&format!("/v2/{repo}/blobs/{config}")).unwrap();
        assert_eq!(status, 200);
        let config = json(&body);
        assert_eq!(config["architecture"], m["platform"]["architecture"], "each manifest's config says its platform");
        assert_eq!(config["os"], "linux");
        assert_eq!(config["config"]["Labels"]["kiln.dev/farm"], farm.farm_id.as_str(), "every platform is labeled");
    }

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["app"], "{events:#?}");
    assert_eq!(farm.builds(), 2, "a second converge builds nothing");
    assert_eq!(farm.pushes(), 2, "a second converge pushes nothing");
    farm.stop().await;
    for token in ["amd64", "arm64"] {
        docker::remove(&format!("{app}-{token}"));
    }
}

/// Each platform of the child `app` carries that platform's base layer under its own, and no
/// other; each node holds the child's image of its platform under the content ref.
async fn child_on_its_base(base: &str, app: &str, amd: &Containerd, arm: &Containerd) {
    for (token, other, node) in [("amd64", "arm64", amd), ("arm64", "amd64", arm)] {
        let platform_app = format!("{app}-{token}");
        let (base_layers, app_layers) = (docker::layers(&format!("{base}-{token}")), docker::layers(&platform_app));
        assert_eq!(docker::platform(&platform_app), Some(format!("linux/{token}")));
        assert_eq!(app_layers.len(), base_layers.len() + 1, "{token}: {app_layers:?}");
        assert!(app_layers.starts_with(&base_layers), "{token}: {base_layers:?} under {app_layers:?}");
        let other_base = docker::layers(&format!("{base}-{other}"));
        assert_ne!(base_layers, other_base, "the platforms' bases differ");
        assert!(!app_layers.starts_with(&other_base), "{token}: built on the {other} base");
        assert!(holds(node, app, &docker::image_id(&platform_app).unwrap()).await, "the {token} node");
    }
}

/// A `nodes` target, so the content ref names no image anywhere a build could read it (in a
/// registry it would name the index, which a build pulls its platform from): each platform of the
/// child must build on the base's image of that platform, on the host holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_platform_child_builds_each_platform_on_its_shared_bases_image_of_that_platform() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (cluster, amd, arm) = amd_and_arm_nodes(&mut farm, "mpb").await;
    let dir = tmp.path().join(unique("mpbase"));
    let manifest = format!(
        "instance = \"{}\"\nplatforms = [\"linux/amd64\", \"linux/arm64\"]\n\n\
         [target]\nkind = \"nodes\"\ncluster = \"{cluster}\"\n\n\
         [built.base]\ncontext = \"base\"\nshared = true\n\n[built.app]\ncontext = \"app\"\n",
        unique("mpbase"),
    );
    write(&dir, "kiln.toml", &manifest);
    // The base differs by platform without running anything: BuildKit names the platform it
    // builds for in TARGETARCH, so each platform's base copies its own file.
    write(&dir, "base/Dockerfile", "FROM scratch\nARG TARGETARCH\nCOPY ${TARGETARCH}.txt /arch.txt\n");
    write(&dir, "base/amd64.txt", "the amd64 base\n");
    write(&dir, "base/arm64.txt", "the arm64 base\n");
    write(&dir, "app/Dockerfile", "FROM base\nCOPY app.txt /app.txt\n");
    write(&dir, "app/app.txt", "the app, first\n");

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(farm.builds(), 4, "one build per platform per image");
    let (base, app) = (reference(&dir, "base"), reference(&dir, "app"));
    assert!(base.ends_with("-amd64.arm64") && app.ends_with("-amd64.arm64"), "{base} {app}");
    child_on_its_base(&base, &app, &amd, &arm).await;

    // Only the child moves: the base is recorded as it was, and each platform of the child is
    // built again on the base's image of that platform, found in the hosts' inventories.
    write(&dir, "app/app.txt", "the app, second\n");
    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["base"], "{events:#?}");
    assert_eq!(farm.builds(), 6, "the child's two platforms only");
    let moved = reference(&dir, "app");
    assert_ne!(moved, app);
    child_on_its_base(&base, &moved, &amd, &arm).await;
    farm.stop().await;
    for reference in [&base, &app, &moved] {
        for token in ["amd64", "arm64"] {
            docker::remove(&format!("{reference}-{token}"));
        }
    }
}

/// A cluster of two simulated node agents, each on a real containerd: one announcing amd64, one
/// arm64. Returns the cluster's name and the two stores.
async fn amd_and_arm_nodes(farm: &mut Farm, prefix: &str) -> (String, Containerd, Containerd) {
    let cluster = unique(prefix);
    let (amd, arm) = (Containerd::start().await, Containerd::start().await);
    farm.start_node_on(&cluster, &format!("{cluster}-amd"), Arc::new(amd.store().await), &["linux/amd64"]).await;
    farm.start_node_on(&cluster, &format!("{cluster}-arm"), Arc::new(arm.store().await), &["linux/arm64"]).await;
    (cluster, amd, arm)
}

async fn holds(node: &Containerd, reference: &str, id: &str) -> bool {
    node.store().await.holds(reference, id).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_node_imports_its_own_platform_under_the_multi_platform_ref() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (cluster, amd, arm) = amd_and_arm_nodes(&mut farm, "mp").await;
    let target = format!("kind = \"nodes\"\ncluster = \"{cluster}\"");
    let dir = instance(tmp.path(), &unique("mpnodes"), &["linux/amd64", "linux/arm64"], &target, COPY_ONLY);

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    let app = reference(&dir, "app");
    let (amd_ref, arm_ref) = (format!("{app}-amd64"), format!("{app}-arm64"));
    assert_eq!(docker::platform(&amd_ref).as_deref(), Some("linux/amd64"));
    assert_eq!(docker::platform(&arm_ref).as_deref(), Some("linux/arm64"));
    // An image id is the digest of its config, which names its platform: a node holding the
    // arm64 config's id under the content ref holds the arm64 image.
    let (amd_id, arm_id) = (docker::image_id(&amd_ref).unwrap(), docker::image_id(&arm_ref).unwrap());
    assert_ne!(amd_id, arm_id);
    assert!(holds(&amd, &app, &amd_id).await, "the amd64 node holds the amd64 image under {app}");
    assert!(holds(&arm, &app, &arm_id).await, "the arm64 node holds the arm64 image under {app}");
    assert!(!holds(&amd, &app, &arm_id).await && !holds(&arm, &app, &amd_id).await);
    assert_eq!(farm.exports(), 2, "one export per platform");

    let events = up(&farm.url, &dir, false).await;
    assert!(succeeded(&events), "{events:#?}");
    assert_eq!(images_with(&events, Kind::Recorded), vec!["app"], "one record, said once: {events:#?}");
    assert_eq!(farm.builds(), 2, "a second converge builds nothing");
    assert_eq!(farm.exports(), 2, "nodes holding their platform's image take nothing");
    farm.stop().await;
    docker::remove(&amd_ref);
    docker::remove(&arm_ref);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_of_a_platform_outside_the_set_fails_the_converge_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let cluster = unique("rv");
    let (amd, riscv) = (Containerd::start().await, Containerd::start().await);
    farm.start_node_on(&cluster, &format!("{cluster}-amd"), Arc::new(amd.store().await), &["linux/amd64"]).await;
    let odd = format!("{cluster}-riscv");
    farm.start_node_on(&cluster, &odd, Arc::new(riscv.store().await), &["linux/riscv64"]).await;
    let target = format!("kind = \"nodes\"\ncluster = \"{cluster}\"");
    let dir = instance(tmp.path(), &unique("rvnodes"), &["linux/amd64", "linux/arm64"], &target, COPY_ONLY);

    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events), "{events:#?}");
    let why = failure(&events);
    assert!(why.contains(&format!("node {odd}")) && why.contains("linux/riscv64"), "{why}");
    assert_eq!(farm.builds(), 0, "refused before anything was built");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_step_for_a_platform_nobody_runs_fails_before_any_build_naming_the_fix() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let target = format!("kind = \"registry\"\nregistry = \"{}\"", registry.addr);
    let runs = "FROM scratch\nCOPY hello.txt /hello.txt\nRUN [\"/hello.txt\"]\n";
    let dir = instance(tmp.path(), &unique("emu"), &["linux/amd64", "linux/arm64"], &target, runs);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    // A handler for another architecture only: arm64 stays unrunnable here.
    std::fs::create_dir_all(farm.binfmt_root()).unwrap();
    std::fs::write(farm.binfmt_root().join("status"), "enabled\n").unwrap();
    std::fs::write(farm.binfmt_root().join("qemu-riscv64"), "enabled\ninterpreter /usr/bin/qemu-riscv64-static\n")
        .unwrap();

    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events), "{events:#?}");
    let why = failure(&events);
    assert!(why.contains("platform linux/arm64"), "{why}");
    assert!(why.contains("install qemu-user-static and register binfmt handlers, or add an arm64 build host"), "{why}");
    assert_eq!(farm.builds(), 0, "nothing was built");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_announcing_an_emulator_takes_the_run_step_past_the_preflight() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let target = format!("kind = \"registry\"\nregistry = \"{}\"", registry.addr);
    // The RUN fails on any platform (the file is no program): what matters is that a build ran.
    let runs = "FROM scratch\nCOPY hello.txt /hello.txt\nRUN [\"/hello.txt\"]\n";
    let dir = instance(tmp.path(), &unique("emuok"), &["linux/amd64", "linux/arm64"], &target, runs);
    let home = tmp.path().join("home");
    // The handler is in place before the agent says hello: it announces linux/arm64 as emulated.
    std::fs::create_dir_all(home.join("binfmt_misc")).unwrap();
    std::fs::write(home.join("binfmt_misc/status"), "enabled\n").unwrap();
    std::fs::write(home.join("binfmt_misc/qemu-aarch64"), "enabled\ninterpreter /usr/bin/qemu-aarch64-static\n")
        .unwrap();
    let mut farm = Farm::start(&home).await;
    assert_eq!(farm.binfmt_root(), home.join("binfmt_misc"));
    // `kiln agents` says so: the host agent builds amd64 and emulates arm64.
    let mut client = pb::kiln_client::KilnClient::new(kiln_e2e::wire::channel(&farm.url));
    let agents = client.agents(pb::AgentsRequest {}).await.unwrap().into_inner().agents;
    let emulating: Vec<_> = agents.iter().filter(|a| a.connected && !a.emulates.is_empty()).collect();
    assert_eq!(emulating.len(), 1, "{agents:#?}");
    assert_eq!(emulating[0].emulates, vec!["linux/arm64".to_string()]);

    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events), "{events:#?}");
    let why = failure(&events);
    assert!(!why.contains("install qemu-user-static"), "the preflight let it through: {why}");
    assert!(why.contains("build of"), "{why}");
    assert!(farm.builds() >= 1, "a build ran");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_target_refuses_several_platforms_before_anything_is_built() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = instance(tmp.path(), &unique("mplocal"), &["linux/amd64", "linux/arm64"], "kind = \"local\"", COPY_ONLY);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let events = up(&farm.url, &dir, false).await;
    assert!(!succeeded(&events), "{events:#?}");
    let why = failure(&events);
    assert!(why.contains("target local") && why.contains("a Docker daemon runs one platform"), "{why}");
    assert_eq!(farm.builds(), 0);
    farm.stop().await;
}

/// The refs `kiln refs` prints and `kiln up` sends for the instance folder `dir`: both ask the
/// coordinator for a cluster's set (`kiln::platforms::from_cluster`), then address alike.
async fn cli_refs(url: &str, dir: &Path) -> Vec<String> {
    let link = kiln::connect::dial(url, std::time::Duration::from_secs(10)).await.unwrap();
    let manifest = kiln_core::manifest::Manifest::load(dir).unwrap();
    let manifest = kiln::platforms::from_cluster(&link, manifest).await.unwrap();
    let plan = kiln::request::plan_up(&manifest, false, "test", None).unwrap();
    plan.request.images.iter().map(|i| i.reference.clone()).collect()
}

async fn cli_up(url: &str, dir: &Path) -> kiln::UpOutcome {
    let args = kiln::UpArgs {
        dir: dir.to_path_buf(),
        force: false,
        dry_run: false,
        connect: kiln::Connect::remote(url),
        output: kiln::OutputMode::Quiet,
    };
    kiln::up_with(&args, &mut kiln::render::Quiet).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platforms_from_the_cluster_follow_its_nodes_and_refs_and_up_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let cluster = unique("cl");
    let (amd, arm) = (Containerd::start().await, Containerd::start().await);
    farm.start_node_on(&cluster, &format!("{cluster}-amd"), Arc::new(amd.store().await), &["linux/amd64"]).await;
    let dir = tmp.path().join("cluster-set");
    let name = unique("clset");
    write(
        &dir,
        "kiln.toml",
        &format!(
            "instance = \"{name}\"\nplatforms = \"cluster\"\n\n[target]\nkind = \"nodes\"\ncluster = \"{cluster}\"\n\n\
             [built.app]\ncontext = \"app\"\n"
        ),
    );
    write(&dir, "app/Dockerfile", COPY_ONLY);
    write(&dir, "app/hello.txt", &format!("{}\n", unique("hello")));

    // One amd64 node: a one-platform tag, converged by the CLI under the ref `kiln refs` names.
    let first = cli_refs(&farm.url, &dir).await;
    assert!(first[0].ends_with("-amd64"), "{first:?}");
    let outcome = cli_up(&farm.url, &dir).await;
    assert_eq!(outcome.outcome, kiln::Outcome::Succeeded, "{:?}", outcome.failure);
    let id = docker::image_id(&first[0]).unwrap();
    assert!(holds(&amd, &first[0], &id).await);

    // An arm64 node joins: the set, and with it the address, moves; the converge says so.
    farm.start_node_on(&cluster, &format!("{cluster}-arm"), Arc::new(arm.store().await), &["linux/arm64"]).await;
    let second = cli_refs(&farm.url, &dir).await;
    assert!(second[0].ends_with("-amd64.arm64"), "{second:?}");
    let outcome = cli_up(&farm.url, &dir).await;
    assert_eq!(outcome.outcome, kiln::Outcome::Succeeded, "{:?}", outcome.failure);
    assert!(outcome.events.iter().any(|e| e.message.contains("platforms changed: +arm64")), "{:#?}", outcome.events);
    let arm_id = docker::image_id(&format!("{}-arm64", second[0])).unwrap();
    assert!(holds(&arm, &second[0], &arm_id).await, "the arm64 node holds its image under the new ref");
    farm.stop().await;
    docker::remove(&first[0]);
    for token in ["amd64", "arm64"] {
        docker::remove(&format!("{}-{token}", second[0]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platforms_named_cluster_with_no_node_known_fails_naming_the_cluster() {
    let tmp = tempfile::tempdir().unwrap();
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let dir = tmp.path().join("empty-cluster");
    write(
        &dir,
        "kiln.toml",
        "instance = \"nowhere\"\nplatforms = \"cluster\"\n\n[target]\nkind = \"nodes\"\ncluster = \"ghost\"\n\n\
         [built.app]\ncontext = \"app\"\n",
    );
    write(&dir, "app/Dockerfile", COPY_ONLY);
    let link = kiln::connect::dial(&farm.url, std::time::Duration::from_secs(10)).await.unwrap();
    let manifest = kiln_core::manifest::Manifest::load(&dir).unwrap();
    let err = kiln::platforms::from_cluster(&link, manifest).await.unwrap_err().to_string();
    assert!(err.contains("nodes cluster ghost") && err.contains("--cluster ghost"), "{err}");
    farm.stop().await;
}
