//! A converge and a sweep at once: the race ADR-0039 left open and DESIGN.md closes with a claim.
//! A converge claims every ref before it builds, and a claim is a root, so a sweep that runs
//! between a build and its record must keep the built ref.
//!
//! The window is held open on purpose rather than hoped for: the harness's host store pauses each
//! build once Docker has the tag (`BuildPause`), the test runs `gc` in that pause — the ref built
//! but named by no record, exactly what a sweep without claims would take — then lets the converge
//! finish. Each round also plants garbage, so every gc is shown to be sweeping while it keeps the
//! claimed ref.

use kiln_core::sweep::{LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
use kiln_e2e::fixture::{reference, unique, write};
use kiln_e2e::wire::{gc, succeeded, swept_refs, up};
use kiln_e2e::{docker, Farm};
use kiln_proto::v1::converge_event::Kind;
use std::sync::atomic::Ordering;
use std::time::Duration;

const ROUNDS: usize = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_during_a_converge_keeps_every_ref_the_converge_claimed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("inst");
    let instance = unique("swrace");
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.app]\ncontext = \"app\"\n"),
    );
    write(&dir, "app/Dockerfile", "FROM scratch\nCOPY round /round\n");
    let mut farm = Farm::start(&tmp.path().join("home")).await;
    farm.store.pause.armed.store(true, Ordering::SeqCst);
    let labels = [(LABEL_KIND, "image"), (LABEL_INSTANCE, instance.as_str()), (LABEL_FARM, farm.farm_id.as_str())];
    let mut built = Vec::new();

    for round in 0..ROUNDS {
        write(&dir, "app/round", &format!("round {round}\n"));
        let in_flight = reference(&dir, "app");
        let garbage = format!("{instance}-garbage:{round}");
        docker::plant_labeled(&[&garbage], &labels, &format!("garbage {round}"));

        let gate = farm.store.pause.gate.lock().await;
        let (url, converge_dir) = (farm.url.clone(), dir.clone());
        let converge = tokio::spawn(async move { up(&url, &converge_dir, false).await });
        tokio::time::timeout(Duration::from_secs(60), farm.store.pause.built.notified())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the build never finished"));
        assert!(docker::image_id(&in_flight).is_some(), "round {round}: built, not yet recorded");

        let events = gc(&farm.url, false, None).await;
        assert!(succeeded(&events), "round {round}: {events:#?}");
        assert_eq!(swept_refs(&events, Kind::Removed), vec![garbage.clone()], "round {round}: {events:#?}");
        assert!(docker::image_id(&in_flight).is_some(), "round {round}: the claim kept {in_flight}");

        drop(gate);
        let events = converge.await.unwrap();
        assert!(succeeded(&events), "round {round}: {events:#?}");
        assert!(docker::image_id(&in_flight).is_some(), "round {round}: delivered and recorded");
        built.push(in_flight);
    }
    farm.stop().await;
    built.iter().for_each(|r| docker::remove(r));
}
