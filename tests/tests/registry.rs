//! The `registry` target against a real registry: pushed tags carry Kiln's labels in their image
//! config, a no-op converge pushes nothing, and a ref swept from the host before its push is rebuilt
//! and pushed again.

use kiln_e2e::fixture::{example, reference, remove_built, unique};
use kiln_e2e::wire::{images_with, up};
use kiln_e2e::{Farm, Registry};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::sync::atomic::Ordering;

const MANIFEST_V2: &str = "application/vnd.docker.distribution.manifest.v2+json";

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_tags_are_listed_and_carry_the_labels() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let instance = unique("reg");
    let dir = example("registry", tmp.path(), "reg", &instance, Some(&registry.addr));
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = up(&farm.url, &dir, false).await;
    assert!(events.last().unwrap().outcome() == pb::Outcome::Succeeded, "{events:#?}");
    assert_eq!(images_with(&events, Kind::Pushed), vec!["web", "worker"]);
    assert_eq!(farm.pushes(), 2);

    let web = reference(&dir, "web");
    let (repo_and_tag, _) = (web.trim_start_matches(&format!("{}/", registry.addr)), ());
    let (repo, tag) = repo_and_tag.rsplit_once(':').unwrap();
    let (status, body) = registry.get(&format!("/v2/{repo}/tags/list")).unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["tags"], serde_json::json!([tag]));

    let (status, body) = registry.get_with(&format!("/v2/{repo}/manifests/{tag}"), &[("Accept", MANIFEST_V2)]).unwrap();
    assert_eq!(status, 200, "{body}");
    let config = json(&body)["config"]["digest"].as_str().unwrap().to_string();
    let (status, body) = registry.get(&format!("/v2/{repo}/blobs/{config}")).unwrap();
    assert_eq!(status, 200);
    let labels = &json(&body)["config"]["Labels"];
    assert_eq!(labels["kiln.dev/kind"], "image");
    assert_eq!(labels["kiln.dev/instance"], instance.as_str());
    assert_eq!(labels["kiln.dev/farm"], farm.farm_id.as_str());
    assert_eq!(labels["kiln.dev/context"].as_str().unwrap().len(), 64);

    let events = up(&farm.url, &dir, false).await;
    assert_eq!(images_with(&events, Kind::Recorded), vec!["web", "worker"]);
    assert_eq!(farm.pushes(), 2, "a no-op converge pushes nothing");
    assert_eq!(farm.builds(), 2);
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ref_swept_before_its_push_is_rebuilt_and_pushed() {
    let registry = Registry::start();
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("registry", tmp.path(), "reg", &unique("gone"), Some(&registry.addr));
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    farm.store.sweep_before_push.store(1, Ordering::SeqCst);

    let events = up(&farm.url, &dir, false).await;
    assert!(events.last().unwrap().outcome() == pb::Outcome::Succeeded, "{events:#?}");
    assert_eq!(images_with(&events, Kind::Built), vec!["web", "web", "worker"], "web is rebuilt once: {events:#?}");
    assert_eq!(images_with(&events, Kind::Pushed), vec!["web", "worker"]);
    assert!(events.iter().any(|e| e.kind() == Kind::Note && e.message.contains("rebuilding")), "{events:#?}");
    farm.stop().await;
    remove_built(&dir);
}
