//! The SQLite store against a real database file in a temp dir: migrations, the record
//! compare-and-set, one running converge per instance, claims on a lease, event logs, the context
//! index, and what survives a restart (drop the store, reopen the file).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_coordinator::model::{
    AgentId, AgentRole, AgentRow, ContextRow, ConvergeId, ConvergeState, EventKind, Generation, RecordedImage,
    RecordedKind,
};
use kiln_coordinator::store::{Clock, ManualClock, SqliteStore, Store, StoreError, SCHEMA_VERSION};
use tempfile::TempDir;

const T0: u64 = 1_750_000_000_000;

fn temp_db() -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    // A directory that does not exist yet: open creates it, as it must for a fresh $KILN_HOME.
    let path = dir.path().join("home").join("state.db");
    (dir, path)
}

fn open_at(path: &Path, clock: &Arc<ManualClock>) -> SqliteStore {
    SqliteStore::open_with_clock(path, clock.clone()).unwrap()
}

fn built(name: &str, reference: &str) -> RecordedImage {
    RecordedImage {
        name: name.to_owned(),
        reference: reference.to_owned(),
        kind: RecordedKind::Built,
        target: "registry:127.0.0.1:5000".to_owned(),
        context: Some("4a77b1c2d3e4".repeat(5)),
        user: Some("app".to_owned()),
        inputs: None,
        image_id: None,
    }
}

fn refs(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}

#[tokio::test]
async fn migrations_apply_once_and_reopen_is_a_no_op() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    let all: Vec<u32> = (1..=SCHEMA_VERSION).collect();
    assert_eq!(store.migrations_applied(), all.as_slice());
    drop(store);

    clock.advance(60_000);
    let store = open_at(&path, &clock);
    assert!(store.migrations_applied().is_empty(), "reopen applied {:?}", store.migrations_applied());
    drop(store);

    let raw = rusqlite::Connection::open(&path).unwrap();
    let mut stmt = raw.prepare("SELECT version, applied_at FROM schema_migrations ORDER BY version").unwrap();
    let rows: Vec<(u32, u64)> =
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().collect::<Result<_, _>>().unwrap();
    assert_eq!(rows, all.iter().map(|&v| (v, T0)).collect::<Vec<_>>(), "each version once, stamped at first open");
}

#[tokio::test]
async fn a_newer_schema_is_refused_naming_the_file_and_both_versions() {
    let (_dir, path) = temp_db();
    drop(SqliteStore::open(&path).unwrap());
    let newer = SCHEMA_VERSION + 5;
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?1, 0)", [newer]).unwrap();
    drop(raw);

    let err = SqliteStore::open(&path).unwrap_err();
    match &err {
        StoreError::SchemaTooNew { database, found, known } => {
            assert_eq!(
                (database.as_str(), *found, *known),
                (path.display().to_string().as_str(), newer, SCHEMA_VERSION)
            );
        }
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    let message = err.to_string();
    for needle in [path.display().to_string(), newer.to_string(), SCHEMA_VERSION.to_string(), "upgrade kiln".into()] {
        assert!(message.contains(&needle), "{message:?} lacks {needle:?}");
    }
}

#[tokio::test]
async fn the_first_record_from_none_is_generation_1() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    assert_eq!(store.record("shop").await.unwrap(), None);
    let images = vec![built("api", "shop-api:4a77b1c2d3e4-amd64")];
    let generation = store.write_record("shop", None, images.clone()).await.unwrap();
    assert_eq!(generation, Generation(1));
    let record = store.record("shop").await.unwrap().unwrap();
    assert_eq!((record.instance.as_str(), record.generation, &record.images), ("shop", Generation(1), &images));
    assert_eq!(store.previous_record("shop").await.unwrap(), None);
}

#[tokio::test]
async fn a_stale_expected_generation_is_refused_and_changes_nothing() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let first = vec![built("api", "shop-api:111111111111-amd64")];
    let second = vec![built("api", "shop-api:222222222222-amd64")];
    store.write_record("shop", None, first.clone()).await.unwrap();
    store.write_record("shop", Some(Generation(1)), second.clone()).await.unwrap();

    let stale = store.write_record("shop", Some(Generation(1)), vec![built("api", "shop-api:333333333333-amd64")]);
    match stale.await.unwrap_err() {
        StoreError::RecordMoved { instance, expected, actual } => {
            assert_eq!((instance.as_str(), expected, actual), ("shop", Some(Generation(1)), Some(Generation(2))));
        }
        other => panic!("expected RecordMoved, got {other:?}"),
    }
    // A converge that saw no record must not overwrite one written meanwhile either.
    let from_none = store.write_record("shop", None, vec![]).await.unwrap_err();
    assert!(matches!(from_none, StoreError::RecordMoved { expected: None, actual: Some(Generation(2)), .. }));
    assert!(from_none.to_string().contains("instance shop"), "{from_none}");

    let current = store.record("shop").await.unwrap().unwrap();
    assert_eq!((current.generation, current.images), (Generation(2), second));
    let previous = store.previous_record("shop").await.unwrap().unwrap();
    assert_eq!((previous.generation, previous.images), (Generation(1), first));
}

#[tokio::test]
async fn current_and_previous_follow_writes_and_older_generations_are_pruned() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    for (n, expected) in [(1u64, None), (2, Some(Generation(1))), (3, Some(Generation(2)))] {
        clock.advance(1000);
        let reference = format!("shop-api:{n:012}-amd64");
        assert_eq!(store.write_record("shop", expected, vec![built("api", &reference)]).await.unwrap(), Generation(n));
    }
    store.write_record("blog", None, vec![built("web", "blog-web:aaaaaaaaaaaa-amd64")]).await.unwrap();

    let current = store.record("shop").await.unwrap().unwrap();
    let previous = store.previous_record("shop").await.unwrap().unwrap();
    assert_eq!((current.generation, current.written_at_ms), (Generation(3), T0 + 3000));
    assert_eq!((previous.generation, previous.written_at_ms), (Generation(2), T0 + 2000));
    assert_eq!(previous.images[0].reference, "shop-api:000000000002-amd64");

    let all = store.records().await.unwrap();
    let summary: Vec<(String, u64, Option<u64>)> =
        all.iter().map(|(c, p)| (c.instance.clone(), c.generation.0, p.as_ref().map(|p| p.generation.0))).collect();
    assert_eq!(summary, vec![("blog".to_owned(), 1, None), ("shop".to_owned(), 3, Some(2))]);

    let raw = rusqlite::Connection::open(&path).unwrap();
    let kept: u32 = raw.query_row("SELECT COUNT(*) FROM records WHERE instance = 'shop'", [], |r| r.get(0)).unwrap();
    assert_eq!(kept, 2, "generation 1 should have been pruned");
}

#[tokio::test]
async fn delete_removes_the_record_and_generations_never_repeat() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    store.write_record("shop", None, vec![built("api", "shop-api:111111111111-amd64")]).await.unwrap();
    store.write_record("shop", Some(Generation(1)), vec![built("api", "shop-api:222222222222-amd64")]).await.unwrap();

    assert!(store.delete_record("shop").await.unwrap());
    assert_eq!(store.record("shop").await.unwrap(), None);
    assert_eq!(store.previous_record("shop").await.unwrap(), None);
    assert!(store.records().await.unwrap().is_empty());
    assert!(!store.delete_record("shop").await.unwrap(), "nothing left to delete");

    // A converge that started from generation 2 before `kiln down` must not record over the deletion.
    let stale = store.write_record("shop", Some(Generation(2)), vec![]).await.unwrap_err();
    assert!(matches!(stale, StoreError::RecordMoved { actual: None, .. }), "{stale:?}");
    assert_eq!(store.write_record("shop", None, vec![]).await.unwrap(), Generation(3));
}

#[tokio::test]
async fn records_claims_events_and_converges_survive_a_restart() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    let images = vec![built("api", "shop-api:4a77b1c2d3e4-amd64")];
    store.write_record("shop", None, images.clone()).await.unwrap();
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.claim(&converge.id, &refs(&["shop-api:4a77b1c2d3e4-amd64"]), T0 + 30_000).await.unwrap();
    store.append_event(&converge.id, EventKind::Started, None, "converging shop").await.unwrap();
    store.append_event(&converge.id, EventKind::Uploaded { bytes: 2048 }, Some("api"), "uploaded").await.unwrap();
    store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();
    store.put_context(ContextRow { digest: "ab".repeat(32), bytes: 2048, stored_at_ms: T0 }).await.unwrap();
    let before = store.events(&converge.id, None).await.unwrap();
    let converge = store.converge(&converge.id).await.unwrap().unwrap();
    drop(store);

    let store = open_at(&path, &clock);
    assert_eq!(store.record("shop").await.unwrap().unwrap().images, images);
    assert_eq!(store.converge(&converge.id).await.unwrap(), Some(converge.clone()));
    assert_eq!(store.events(&converge.id, None).await.unwrap(), before);
    let claims = store.live_claims(T0).await.unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!((&claims[0].converge, claims[0].reference.as_str()), (&converge.id, "shop-api:4a77b1c2d3e4-amd64"));
    assert!(store.missing_contexts(&["ab".repeat(32)]).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_converge_running_at_restart_is_failed_with_an_event_and_its_claims_wait_for_their_lease() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    let running = store.open_converge("shop", "ana").await.unwrap();
    store
        .append_event(
            &running.id,
            EventKind::Building { reference: String::new(), reason: None },
            Some("api"),
            "building api",
        )
        .await
        .unwrap();
    store.claim(&running.id, &refs(&["shop-api:4a77b1c2d3e4-amd64"]), T0 + 30_000).await.unwrap();
    let done = store.open_converge("blog", "bo").await.unwrap();
    store.finish_converge(&done.id, ConvergeState::Succeeded).await.unwrap();
    drop(store);

    clock.advance(5_000);
    let store = open_at(&path, &clock);
    let reason = "coordinator restarted while it ran";
    assert_eq!(store.fail_in_flight(reason).await.unwrap(), vec![running.id.clone()]);

    let failed = store.converge(&running.id).await.unwrap().unwrap();
    assert_eq!(failed.state, ConvergeState::Failed { reason: reason.to_owned() });
    assert_eq!(failed.finished_ms, Some(T0 + 5_000));
    let events = store.events(&running.id, None).await.unwrap();
    let last = events.last().unwrap();
    assert_eq!((last.seq, &last.kind, last.message.as_str()), (2, &EventKind::Failed, reason));
    assert_eq!(store.converge(&done.id).await.unwrap().unwrap().state, ConvergeState::Succeeded);
    assert_eq!(store.live_claims(T0 + 5_000).await.unwrap().len(), 1, "the claim expires on its lease, not at restart");

    assert!(store.fail_in_flight(reason).await.unwrap().is_empty(), "nothing is left running");
    store.open_converge("shop", "ana").await.expect("the instance can converge again");
}

#[tokio::test]
async fn a_second_converge_of_a_running_instance_is_refused_naming_the_running_one() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let first = store.open_converge("shop", "ana").await.unwrap();
    assert_eq!(first.state, ConvergeState::Running);

    let err = store.open_converge("shop", "bo").await.unwrap_err();
    match &err {
        StoreError::ConvergeRunning { instance, running } => {
            assert_eq!((instance.as_str(), running), ("shop", &first.id));
        }
        other => panic!("expected ConvergeRunning, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains(first.id.as_str()) && message.contains("kiln logs"), "{message}");

    let other = store.open_converge("blog", "bo").await.expect("another instance converges concurrently");
    assert_ne!(other.id, first.id);

    store.finish_converge(&first.id, ConvergeState::Failed { reason: "build failed".into() }).await.unwrap();
    store.open_converge("shop", "bo").await.expect("a finished converge no longer blocks its instance");
}

#[tokio::test]
async fn two_handles_on_one_file_never_both_record_or_both_run() {
    let (_dir, path) = temp_db();
    // Two opens are two connections, as two `kiln` processes sharing $KILN_HOME would have.
    let a: Arc<dyn Store> = Arc::new(SqliteStore::open(&path).unwrap());
    let b: Arc<dyn Store> = Arc::new(SqliteStore::open(&path).unwrap());
    a.write_record("shop", None, vec![]).await.unwrap();

    let mut writes = Vec::new();
    for i in 0..8 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        writes.push(tokio::spawn(async move {
            let reference = format!("shop-api:{i:012}-amd64");
            store.write_record("shop", Some(Generation(1)), vec![built("api", &reference)]).await
        }));
    }
    let mut won = 0;
    for write in writes {
        match write.await.unwrap() {
            Ok(generation) => {
                won += 1;
                assert_eq!(generation, Generation(2));
            }
            Err(StoreError::RecordMoved { actual: Some(Generation(2)), .. }) => {}
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(won, 1);

    let (x, y) = tokio::join!(a.open_converge("shop", "ana"), b.open_converge("shop", "bo"));
    let (winner, loser) = match (x, y) {
        (Ok(winner), Err(loser)) | (Err(loser), Ok(winner)) => (winner, loser),
        (x, y) => panic!("exactly one converge should open: {x:?} / {y:?}"),
    };
    assert!(matches!(loser, StoreError::ConvergeRunning { ref running, .. } if *running == winner.id), "{loser:?}");
}

#[tokio::test]
async fn claims_expire_by_lease_renew_extends_them_and_release_removes_them() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    let lease = 30_000;
    let shop = store.open_converge("shop", "ana").await.unwrap();
    let blog = store.open_converge("blog", "bo").await.unwrap();
    store.claim(&shop.id, &refs(&["shop-api:1-amd64", "shop-web:2-amd64"]), clock.now_ms() + lease).await.unwrap();
    store.claim(&blog.id, &refs(&["blog-web:3-amd64"]), clock.now_ms() + lease).await.unwrap();

    clock.advance(lease - 1);
    assert_eq!(store.live_claims(clock.now_ms()).await.unwrap().len(), 3);
    assert_eq!(store.renew_claims(&blog.id, clock.now_ms() + lease).await.unwrap(), 1);

    clock.advance(1);
    let live = store.live_claims(clock.now_ms()).await.unwrap();
    let live: Vec<(&ConvergeId, &str)> = live.iter().map(|c| (&c.converge, c.reference.as_str())).collect();
    assert_eq!(live, vec![(&blog.id, "blog-web:3-amd64")], "shop's claims expired at their lease");
    assert_eq!(store.renew_claims(&shop.id, clock.now_ms() + lease).await.unwrap(), 0, "expired claims are gone");

    store.release_claims(&blog.id).await.unwrap();
    assert!(store.live_claims(clock.now_ms()).await.unwrap().is_empty());
}

#[tokio::test]
async fn only_a_running_converge_may_claim() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();

    let late = store.claim(&converge.id, &refs(&["shop-api:1-amd64"]), u64::MAX >> 2).await.unwrap_err();
    assert!(
        matches!(late, StoreError::ConvergeFinished { ref id, state: ConvergeState::Succeeded } if *id == converge.id)
    );
    let unknown = ConvergeId::from("nosuchconverge0");
    let err = store.claim(&unknown, &refs(&["x:1"]), 1).await.unwrap_err();
    assert!(matches!(err, StoreError::UnknownConverge { ref id } if *id == unknown), "{err:?}");
    assert!(store.live_claims(0).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_converge_finishes_once_and_never_as_running() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let converge = store.open_converge("shop", "ana").await.unwrap();
    let err = store.finish_converge(&converge.id, ConvergeState::Running).await.unwrap_err();
    assert!(matches!(err, StoreError::FinishAsRunning { .. }), "{err:?}");
    store.finish_converge(&converge.id, ConvergeState::Failed { reason: "push refused".into() }).await.unwrap();
    let again = store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap_err();
    assert!(matches!(again, StoreError::ConvergeFinished { state: ConvergeState::Failed { .. }, .. }), "{again:?}");
    let state = store.converge(&converge.id).await.unwrap().unwrap().state;
    assert_eq!(state, ConvergeState::Failed { reason: "push refused".into() });
}

#[tokio::test]
async fn events_come_back_in_seq_order_and_after_seq_resumes() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    let converge = store.open_converge("shop", "ana").await.unwrap();
    let kinds = [
        EventKind::Started,
        EventKind::Uploaded { bytes: 1 << 20 },
        EventKind::Building { reference: String::new(), reason: None },
        EventKind::BuildLog,
        EventKind::Built { secs: 12.345 },
        EventKind::Pushed { bytes: 7_000_000 },
    ];
    for kind in &kinds {
        clock.advance(10);
        store.append_event(&converge.id, kind.clone(), Some("api"), "line").await.unwrap();
    }

    let events = store.events(&converge.id, None).await.unwrap();
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(events.iter().map(|e| e.kind.clone()).collect::<Vec<_>>(), kinds.to_vec());
    assert_eq!(events[4].at_ms, T0 + 50);
    assert_eq!(events[0].image.as_deref(), Some("api"));

    let tail = store.events(&converge.id, Some(4)).await.unwrap();
    assert_eq!(tail.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![5, 6]);
    assert!(store.events(&converge.id, Some(6)).await.unwrap().is_empty());

    let unknown = ConvergeId::from("nosuchconverge0");
    assert!(matches!(store.events(&unknown, None).await, Err(StoreError::UnknownConverge { .. })));
    let err = store.append_event(&unknown, EventKind::Note, None, "x").await.unwrap_err();
    assert!(matches!(err, StoreError::UnknownConverge { .. }), "{err:?}");
}

#[tokio::test]
async fn an_event_kind_written_by_a_newer_kiln_still_replays() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.append_event(&converge.id, EventKind::Started, None, "start").await.unwrap();
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.execute(
        "INSERT INTO events (converge_id, seq, at_ms, image, kind, message) VALUES (?1, 2, 0, NULL, ?2, 'beamed')",
        (converge.id.as_str(), r#"{"kind":"teleported","meters":3}"#),
    )
    .unwrap();
    let events = store.events(&converge.id, None).await.unwrap();
    assert_eq!((events[1].kind.clone(), events[1].message.as_str()), (EventKind::Unknown, "beamed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_appends_get_distinct_gap_free_seqs() {
    let (_dir, path) = temp_db();
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&path).unwrap());
    let converge = store.open_converge("shop", "ana").await.unwrap();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let (store, id) = (store.clone(), converge.id.clone());
            tokio::spawn(async move {
                store.append_event(&id, EventKind::BuildLog, Some("api"), &format!("line {i}")).await.unwrap().seq
            })
        })
        .collect();
    let mut seqs = Vec::new();
    for task in tasks {
        seqs.push(task.await.unwrap());
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=16).collect::<Vec<u64>>());
    let stored: Vec<u64> = store.events(&converge.id, None).await.unwrap().iter().map(|e| e.seq).collect();
    assert_eq!(stored, (1..=16).collect::<Vec<u64>>());
}

#[tokio::test]
async fn converges_list_newest_first_per_instance_and_within_limit() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    let mut opened = Vec::new();
    for instance in ["shop", "blog", "shop"] {
        clock.advance(1000);
        let converge = store.open_converge(instance, "ana").await.unwrap();
        store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();
        opened.push(converge.id);
    }
    let ids = |list: Vec<kiln_coordinator::model::Converge>| list.into_iter().map(|c| c.id).collect::<Vec<_>>();
    assert_eq!(
        ids(store.converges(None, 10).await.unwrap()),
        vec![opened[2].clone(), opened[1].clone(), opened[0].clone()]
    );
    assert_eq!(ids(store.converges(None, 2).await.unwrap()), vec![opened[2].clone(), opened[1].clone()]);
    assert_eq!(ids(store.converges(Some("shop"), 10).await.unwrap()), vec![opened[2].clone(), opened[0].clone()]);
    let first = store.converge(&opened[0]).await.unwrap().unwrap();
    assert_eq!((first.started_ms, first.finished_ms, first.requested_by.as_str()), (T0 + 1000, Some(T0 + 1000), "ana"));
}

#[tokio::test]
async fn missing_contexts_returns_exactly_the_unknown_ones() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let [a, b, c, d] = ["a", "b", "c", "d"].map(|x| x.repeat(64));
    for digest in [&a, &c] {
        store.put_context(ContextRow { digest: digest.clone(), bytes: 10, stored_at_ms: T0 }).await.unwrap();
    }
    let asked = [a.clone(), b.clone(), c.clone(), d.clone(), b.clone()];
    assert_eq!(store.missing_contexts(&asked).await.unwrap(), vec![b.clone(), d]);
    assert_eq!(store.context(&c).await.unwrap(), Some(ContextRow { digest: c, bytes: 10, stored_at_ms: T0 }));
    assert_eq!(store.context(&b).await.unwrap(), None);
}

#[tokio::test]
async fn agents_and_inventories_are_replaced_by_their_key() {
    let (_dir, path) = temp_db();
    let store = SqliteStore::open(&path).unwrap();
    let mut agent = AgentRow {
        id: AgentId("build-1".into()),
        role: AgentRole::Host,
        stores: vec!["docker:build-1".into()],
        platforms: vec!["linux/amd64".into()],
        version: "0.1.0".into(),
        last_seen_ms: T0,
    };
    store.upsert_agent(agent.clone()).await.unwrap();
    agent.role = AgentRole::Both;
    agent.last_seen_ms = T0 + 5;
    store.upsert_agent(agent.clone()).await.unwrap();
    assert_eq!(store.agents().await.unwrap(), vec![agent]);

    assert_eq!(store.inventory("docker:build-1").await.unwrap(), None);
    store.put_inventory("docker:build-1", "[]".into(), T0).await.unwrap();
    store.put_inventory("docker:build-1", r#"[{"ref":"x:1"}]"#.into(), T0 + 9).await.unwrap();
    let inventory = store.inventory("docker:build-1").await.unwrap().unwrap();
    assert_eq!((inventory.listing_json.as_str(), inventory.listed_at_ms), (r#"[{"ref":"x:1"}]"#, T0 + 9));
}

#[tokio::test]
async fn pins_are_kept_once_survive_a_restart_and_go_only_when_unpinned() {
    let (_dir, path) = temp_db();
    let clock = Arc::new(ManualClock::new(T0));
    let store = open_at(&path, &clock);
    assert!(store.pin("tool:1", "ana@box").await.unwrap(), "a new pin is a change");
    clock.advance(5);
    assert!(!store.pin("tool:1", "bo@box").await.unwrap(), "pinning twice is pinning once");
    assert!(store.pin("base:2", "bo@box").await.unwrap());
    // `kiln down` of any instance leaves pins alone: they belong to no instance.
    store.delete_record("shop").await.unwrap();
    drop(store);

    let store = open_at(&path, &clock);
    let pins = store.pins().await.unwrap();
    let listed: Vec<(&str, u64, &str)> =
        pins.iter().map(|p| (p.reference.as_str(), p.pinned_at_ms, p.pinned_by.as_str())).collect();
    assert_eq!(listed, vec![("base:2", T0 + 5, "bo@box"), ("tool:1", T0, "ana@box")], "the first pin's author stays");
    assert!(store.unpin("tool:1").await.unwrap());
    assert!(!store.unpin("tool:1").await.unwrap(), "unpinning what is not pinned changes nothing");
    assert_eq!(store.pins().await.unwrap().len(), 1);
}
