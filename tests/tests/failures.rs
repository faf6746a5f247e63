//! Converges that must fail, and what they must leave behind: a record untouched, nothing built
//! from bytes that do not match their digest, a converge cut short by a crash reported failed.

use kiln_coordinator::state::{SqliteStore, StateStore};
use kiln_e2e::fixture::{reference, remove_built, unique, write};
use kiln_e2e::wire::{self, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1 as pb;
use kiln_proto::v1::converge_event::Kind;
use std::path::Path;

fn slow_instance(dir: &Path, instance: &str, seconds: u32) {
    write(
        dir,
        "kiln.toml",
        &format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.slow]\ncontext = \"slow\"\n"),
    );
    write(dir, "slow/Dockerfile", &format!("FROM {}\nRUN sleep {seconds}\n", docker::busybox_base()));
}

async fn status(url: &str, instance: &str) -> pb::StatusReply {
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(url));
    client.status(pb::StatusRequest { instance: instance.to_string() }).await.unwrap().into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_build_leaves_the_record_and_shows_the_failing_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("inst");
    let instance = unique("fail");
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.app]\ncontext = \"app\"\n"),
    );
    write(&dir, "app/Dockerfile", "FROM scratch\nCOPY a.txt /a.txt\n");
    write(&dir, "app/a.txt", "a\n");
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(up(&farm.url, &dir, false).await.last().unwrap().outcome() == pb::Outcome::Succeeded);
    let good = reference(&dir, "app");

    write(&dir, "app/Dockerfile", "FROM scratch\nCOPY a.txt /a.txt\nCOPY missing.txt /missing.txt\n");
    let events = up(&farm.url, &dir, false).await;
    let failed: Vec<_> = events.iter().filter(|e| e.kind() == Kind::Failed).collect();
    assert_eq!(failed.len(), 1, "{events:#?}");
    assert_eq!(failed[0].image, "app");
    assert!(failed[0].message.contains("COPY missing.txt"), "the error shows the failing step: {}", failed[0].message);
    // The agent typed the step's number (TaskError.step) and the coordinator says it: 2 as
    // BuildKit counts (no step for `FROM scratch`), 3 as the classic builder does.
    let message = &failed[0].message;
    assert!(message.contains("failed at build step 2:") || message.contains("failed at build step 3:"), "{message}");
    assert!(events.last().unwrap().outcome() == pb::Outcome::Failed);

    let st = status(&farm.url, &instance).await;
    assert_eq!(st.instances[0].generation, 1, "the record is untouched");
    assert_eq!(st.instances[0].images[0].reference, good);
    farm.stop().await;
    docker::remove(&good);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_that_does_not_match_its_digest_is_refused_and_nothing_is_built() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = kiln_e2e::fixture::example("hello", tmp.path(), "hello", &unique("lie"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (req, contexts) = wire::up_request(&dir, false);
    let web = req.images.iter().find(|i| i.name == "web").unwrap();
    let worker = req.images.iter().find(|i| i.name == "worker").unwrap();
    // Claim web's digest for worker's bytes.
    let (worker_dir, opts) = &contexts[&worker.context_digest];
    let mut bytes = Vec::new();
    kiln_core::archive::pack(&kiln_core::digest::walk_tree(worker_dir, opts).unwrap(), &mut bytes).unwrap();
    let err = wire::upload(&farm.url, &web.context_digest, bytes).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("refused") && err.message().contains(&web.context_digest), "{}", err.message());

    let mut client = pb::content_store_client::ContentStoreClient::new(wire::channel(&farm.url));
    let missing =
        client.find_missing(pb::FindMissingRequest { digests: vec![web.context_digest.clone()] }).await.unwrap();
    assert_eq!(missing.into_inner().missing, vec![web.context_digest.clone()], "the refused bytes were not stored");
    assert_eq!(farm.builds(), 0);
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_with_no_target_fails_naming_registry_and_builds_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = kiln_e2e::fixture::example("hello", tmp.path(), "hello", &unique("notarget"), None);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let (mut req, _) = wire::up_request(&dir, false);
    req.target = None;
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(&farm.url));
    let err = client.up(req).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("registry"), "{}", err.message());
    assert_eq!(farm.builds(), 0);

    // The manifest itself refuses first, naming `registry`, before any client could send it.
    let text = std::fs::read_to_string(dir.join("kiln.toml")).unwrap().replace("[target]\nkind = \"local\"\n", "");
    std::fs::write(dir.join("kiln.toml"), text).unwrap();
    let err = kiln_core::manifest::Manifest::load(&dir).unwrap_err();
    assert!(err.to_string().contains("registry"), "{err}");
    farm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_converge_of_a_running_instance_is_refused_naming_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("inst");
    let instance = unique("busy");
    slow_instance(&dir, &instance, 3);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    let url = farm.url.clone();
    let first_dir = dir.clone();
    let first = tokio::spawn(async move { up(&url, &first_dir, false).await });
    // Wait until the first converge is building.
    let mut running = None;
    for _ in 0..100 {
        let st = status(&farm.url, &instance).await;
        if let Some(c) = st.converges.iter().find(|c| c.outcome() == pb::Outcome::Running) {
            running = Some(c.id.clone());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let running = running.expect("the first converge started");
    let (req, _) = wire::up_request(&dir, false);
    let mut client = pb::kiln_client::KilnClient::new(wire::channel(&farm.url));
    let err = client.up(req).await.unwrap_err();
    assert!(err.message().contains(&running), "names the running converge: {}", err.message());
    let events = first.await.unwrap();
    assert!(events.last().unwrap().outcome() == pb::Outcome::Succeeded, "{events:#?}");
    farm.stop().await;
    remove_built(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_killed_mid_converge_keeps_its_records_and_reports_the_converge_failed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("inst");
    let instance = unique("crash");
    slow_instance(&dir, &instance, 1);
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    assert!(up(&farm.url, &dir, false).await.last().unwrap().outcome() == pb::Outcome::Succeeded);
    let recorded = reference(&dir, "slow");

    // A new generation whose build takes a while; kill the coordinator while it builds.
    slow_instance(&dir, &instance, 5);
    let building = reference(&dir, "slow");
    let url = farm.url.clone();
    let second_dir = dir.clone();
    let client = tokio::spawn(async move {
        let (req, contexts) = wire::up_request(&second_dir, false);
        let mut client = pb::kiln_client::KilnClient::new(wire::channel(&url));
        let mut stream = client.up(req).await.unwrap().into_inner();
        let mut seen = Vec::new();
        while let Ok(Some(event)) = stream.message().await {
            if event.kind() == Kind::NeedContexts {
                for digest in &event.contexts {
                    let (d, o) = &contexts[digest];
                    let mut bytes = Vec::new();
                    kiln_core::archive::pack(&kiln_core::digest::walk_tree(d, o).unwrap(), &mut bytes).unwrap();
                    wire::upload(&url, digest, bytes).await.unwrap();
                }
            }
            seen.push(event.kind());
            if event.kind() == Kind::Building {
                // The stream goes back with the id: dropping it here would be a client going
                // away, and the coordinator would cancel (and release the claims) before the crash.
                return (stream, event.converge_id);
            }
        }
        panic!("the converge never started building: {seen:?}");
    });
    let (stream, converge_id) = client.await.unwrap();
    farm.crash_coordinator();
    drop(stream);
    farm.restart_coordinator().await;

    let st = status(&farm.url, &instance).await;
    assert_eq!(st.instances[0].generation, 1, "the record survived the crash untouched");
    assert_eq!(st.instances[0].images[0].reference, recorded);
    let crashed = st.converges.iter().find(|c| c.id == converge_id).expect("the converge is listed");
    assert_eq!(crashed.outcome(), pb::Outcome::Failed);
    assert!(crashed.reason.contains("restarted"), "{}", crashed.reason);

    // Its claims live on until their lease runs out: a sweep may not take what it was building.
    let store = SqliteStore::open(farm.home.join("state/kiln.db")).unwrap();
    let now = kiln_e2e::now_ms();
    let live = store.live_claims(now).await.unwrap();
    assert!(live.iter().any(|c| c.reference == building && c.converge.as_str() == converge_id), "{live:?}");
    let lease = farm.claim_lease.as_millis() as u64;
    assert!(store.live_claims(now + lease + 1_000).await.unwrap().is_empty(), "and expire with it");
    farm.stop().await;
    // The build the crash orphaned still finishes on the daemon; wait for its tag to clean it up.
    for _ in 0..200 {
        if docker::image_id(&building).is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    docker::remove(&building);
    docker::remove(&recorded);
}
