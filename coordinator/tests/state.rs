//! The state store's one test suite, run against both backends: SQLite in a file in a temp dir, and
//! PostgreSQL in a database of its own in the test binary's throwaway cluster
//! (`kiln_e2e::postgres`). Each test body is written once against a [`Backend`]; `suite!` makes it
//! two tests, `sqlite::<name>` and `postgres::<name>`. Covered: migrations, the record
//! compare-and-set, one running converge per instance (also between two handles racing), claims on
//! a lease, event logs, pins, the context index, agents and inventories, leadership, and what
//! survives a restart (drop the handle, open the same database again).
//!
//! Below the suite: what only PostgreSQL has — fencing between coordinators that share a farm,
//! migration by coordinators starting together, connection errors — and SQLite's trivially held
//! leadership. PostgreSQL missing fails these tests loudly (run `bash scripts/setup`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kiln_coordinator::model::{
    AgentId, AgentRole, AgentRow, ContextRow, ConvergeId, ConvergeState, EventKind, Generation, RecordedImage,
    RecordedKind,
};
use kiln_coordinator::state::{
    Clock, Leadership, ManualClock, PostgresStore, SqliteStore, StateError, StateStore, POSTGRES_SCHEMA_VERSION,
    SCHEMA_VERSION,
};
use kiln_e2e::postgres::{Database, Postgres};
use tempfile::TempDir;

const T0: u64 = 1_750_000_000_000;

/// Where one test's state lives.
enum Backend {
    /// `cached`: the handle keeps the records it read, as the serving coordinator's does.
    Sqlite {
        _dir: TempDir,
        path: PathBuf,
        cached: bool,
    },
    Postgres {
        db: Database,
    },
}

impl Backend {
    fn sqlite() -> Backend {
        let dir = tempfile::tempdir().unwrap();
        // A directory that does not exist yet: open creates it, as it must for a fresh $KILN_HOME.
        let path = dir.path().join("home").join("state.db");
        Backend::Sqlite { _dir: dir, path, cached: false }
    }

    /// SQLite with the record cache on: the suite holds for it unchanged.
    fn sqlite_cached() -> Backend {
        match Backend::sqlite() {
            Backend::Sqlite { _dir, path, .. } => Backend::Sqlite { _dir, path, cached: true },
            other => other,
        }
    }

    async fn postgres() -> Backend {
        Backend::Postgres { db: Postgres::shared().create_database().await }
    }

    /// A new handle on the test's database — a new connection (a new pool on PostgreSQL), as a
    /// restarted coordinator or a second one would have.
    async fn open(&self, clock: &Arc<ManualClock>) -> Arc<dyn StateStore> {
        self.try_open(clock).await.unwrap().0
    }

    /// [`Backend::open`], with the migrations the open applied.
    async fn try_open(&self, clock: &Arc<ManualClock>) -> Result<(Arc<dyn StateStore>, Vec<u32>), StateError> {
        Ok(match self {
            Backend::Sqlite { path, cached, .. } => {
                let store = SqliteStore::open_with_clock(path, clock.clone())?;
                if *cached {
                    store.cache_records();
                }
                let applied = store.migrations_applied().to_vec();
                (Arc::new(store), applied)
            }
            Backend::Postgres { db } => {
                let store = PostgresStore::connect_with_clock(&db.url, clock.clone()).await?;
                let applied = store.migrations_applied().to_vec();
                (Arc::new(store), applied)
            }
        })
    }

    fn schema_version(&self) -> u32 {
        match self {
            Backend::Sqlite { .. } => SCHEMA_VERSION,
            Backend::Postgres { .. } => POSTGRES_SCHEMA_VERSION,
        }
    }

    /// The database as errors name it: the file, or the URL without a password.
    fn name(&self) -> String {
        match self {
            Backend::Sqlite { path, .. } => path.display().to_string(),
            Backend::Postgres { db } => db.url.clone(),
        }
    }

    /// Runs raw SQL (written to mean the same on both) behind the store's back.
    async fn execute(&self, sql: &str) {
        match self {
            Backend::Sqlite { path, .. } => {
                rusqlite::Connection::open(path).unwrap().execute_batch(sql).unwrap();
            }
            Backend::Postgres { db } => raw_postgres(db).await.batch_execute(sql).await.unwrap(),
        }
    }

    /// Every row of a query of two integer columns.
    async fn pairs(&self, sql: &str) -> Vec<(i64, i64)> {
        match self {
            Backend::Sqlite { path, .. } => {
                let raw = rusqlite::Connection::open(path).unwrap();
                let mut stmt = raw.prepare(sql).unwrap();
                stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().collect::<Result<_, _>>().unwrap()
            }
            Backend::Postgres { db } => {
                let rows = raw_postgres(db).await.query(sql, &[]).await.unwrap();
                rows.iter().map(|r| (integer(r, 0), integer(r, 1))).collect()
            }
        }
    }

    /// A query's one integer.
    async fn count(&self, sql: &str) -> i64 {
        match self {
            Backend::Sqlite { path, .. } => {
                rusqlite::Connection::open(path).unwrap().query_row(sql, [], |r| r.get(0)).unwrap()
            }
            Backend::Postgres { db } => integer(&raw_postgres(db).await.query_one(sql, &[]).await.unwrap(), 0),
        }
    }
}

async fn raw_postgres(db: &Database) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// An integer column of PostgreSQL's, whichever width it has.
fn integer(row: &tokio_postgres::Row, i: usize) -> i64 {
    row.try_get::<_, i64>(i).or_else(|_| row.try_get::<_, i32>(i).map(i64::from)).unwrap()
}

/// Each body becomes `sqlite::<name>`, `sqlite_cached::<name>` and `postgres::<name>`.
macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::sqlite()).await
                }
            )*
        }
        mod sqlite_cached {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::sqlite_cached()).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Backend::postgres().await).await
                }
            )*
        }
    };
}

suite!(
    migrations_apply_once_and_reopen_is_a_no_op,
    a_newer_schema_is_refused_naming_the_database_and_both_versions,
    the_first_record_from_none_is_generation_1,
    a_stale_expected_generation_is_refused_and_changes_nothing,
    current_and_previous_follow_writes_and_older_generations_are_pruned,
    delete_removes_the_record_and_generations_never_repeat,
    records_claims_events_and_converges_survive_a_restart,
    a_converge_running_at_restart_is_failed_with_an_event_and_its_claims_wait_for_their_lease,
    a_second_converge_of_a_running_instance_is_refused_naming_the_running_one,
    two_handles_never_both_record_or_both_run,
    claims_expire_by_lease_renew_extends_them_and_release_removes_them,
    only_a_running_converge_may_claim,
    a_converge_finishes_once_and_never_as_running,
    the_last_events_land_with_the_finish_and_a_refused_finish_keeps_them,
    a_converge_opens_with_its_first_event_or_not_at_all,
    a_settled_converge_is_stored_whole_or_not_at_all,
    the_settled_record_follows_this_handle_and_a_stale_one_only_costs_a_fallback,
    settled_converges_after_usual_ones_on_the_same_connections_are_stored,
    events_come_back_in_seq_order_and_after_seq_resumes,
    an_event_kind_written_by_a_newer_kiln_still_replays,
    sixteen_concurrent_appends_get_distinct_gap_free_seqs,
    batched_appends_keep_their_order_and_interleave_gap_free_with_others,
    converges_list_newest_first_per_instance_and_within_limit,
    missing_contexts_returns_exactly_the_unknown_ones,
    contexts_are_listed_and_collected_only_when_unclaimed,
    a_context_entry_list_is_kept_replaced_survives_a_restart_and_goes_with_its_context,
    the_builder_of_a_ref_is_the_converge_that_last_started_building_it,
    agents_and_inventories_are_replaced_by_their_key,
    pins_are_kept_once_survive_a_restart_and_go_only_when_unpinned,
    a_lone_coordinator_leads_writes_renews_and_resigns,
);

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(T0))
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

async fn migrations_apply_once_and_reopen_is_a_no_op(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let (store, applied) = backend.try_open(&clock).await.unwrap();
    let all: Vec<u32> = (1..=backend.schema_version()).collect();
    assert_eq!(applied, all);
    drop(store);

    clock.advance(60_000);
    let (store, applied) = backend.try_open(&clock).await.unwrap();
    assert!(applied.is_empty(), "reopen applied {applied:?}");
    drop(store);

    let rows = backend.pairs("SELECT version, applied_at FROM schema_migrations ORDER BY version").await;
    let expected: Vec<(i64, i64)> = all.iter().map(|&v| (i64::from(v), T0 as i64)).collect();
    assert_eq!(rows, expected, "each version once, stamped at first open");
}

async fn a_newer_schema_is_refused_naming_the_database_and_both_versions(backend: Backend) {
    drop(backend.open(&clock()).await);
    let (known, newer) = (backend.schema_version(), backend.schema_version() + 5);
    backend.execute(&format!("INSERT INTO schema_migrations (version, applied_at) VALUES ({newer}, 0)")).await;

    let err = backend.try_open(&clock()).await.map(|_| ()).unwrap_err();
    match &err {
        StateError::SchemaTooNew { database, found, known: k } => {
            assert_eq!((database.as_str(), *found, *k), (backend.name().as_str(), newer, known));
        }
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    let message = err.to_string();
    for needle in [backend.name(), newer.to_string(), known.to_string(), "upgrade kiln".into()] {
        assert!(message.contains(&needle), "{message:?} lacks {needle:?}");
    }
}

async fn the_first_record_from_none_is_generation_1(backend: Backend) {
    let store = backend.open(&clock()).await;
    assert_eq!(store.record("shop").await.unwrap(), None);
    let images = vec![built("api", "shop-api:4a77b1c2d3e4-amd64")];
    let generation = store.write_record("shop", None, images.clone()).await.unwrap();
    assert_eq!(generation, Generation(1));
    let record = store.record("shop").await.unwrap().unwrap();
    assert_eq!((record.instance.as_str(), record.generation, &record.images), ("shop", Generation(1), &images));
    assert_eq!(store.previous_record("shop").await.unwrap(), None);
}

async fn a_stale_expected_generation_is_refused_and_changes_nothing(backend: Backend) {
    let store = backend.open(&clock()).await;
    let first = vec![built("api", "shop-api:111111111111-amd64")];
    let second = vec![built("api", "shop-api:222222222222-amd64")];
    store.write_record("shop", None, first.clone()).await.unwrap();
    store.write_record("shop", Some(Generation(1)), second.clone()).await.unwrap();

    let stale = store.write_record("shop", Some(Generation(1)), vec![built("api", "shop-api:333333333333-amd64")]);
    match stale.await.unwrap_err() {
        StateError::RecordMoved { instance, expected, actual } => {
            assert_eq!((instance.as_str(), expected, actual), ("shop", Some(Generation(1)), Some(Generation(2))));
        }
        other => panic!("expected RecordMoved, got {other:?}"),
    }
    // A converge that saw no record must not overwrite one written meanwhile either.
    let from_none = store.write_record("shop", None, vec![]).await.unwrap_err();
    assert!(matches!(from_none, StateError::RecordMoved { expected: None, actual: Some(Generation(2)), .. }));
    assert!(from_none.to_string().contains("instance shop"), "{from_none}");

    let current = store.record("shop").await.unwrap().unwrap();
    assert_eq!((current.generation, current.images), (Generation(2), second));
    let previous = store.previous_record("shop").await.unwrap().unwrap();
    assert_eq!((previous.generation, previous.images), (Generation(1), first));
}

async fn current_and_previous_follow_writes_and_older_generations_are_pruned(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
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

    let kept = backend.count("SELECT COUNT(*) FROM records WHERE instance = 'shop'").await;
    assert_eq!(kept, 2, "generation 1 should have been pruned");
}

async fn delete_removes_the_record_and_generations_never_repeat(backend: Backend) {
    let store = backend.open(&clock()).await;
    store.write_record("shop", None, vec![built("api", "shop-api:111111111111-amd64")]).await.unwrap();
    store.write_record("shop", Some(Generation(1)), vec![built("api", "shop-api:222222222222-amd64")]).await.unwrap();

    assert!(store.delete_record("shop").await.unwrap());
    assert_eq!(store.record("shop").await.unwrap(), None);
    assert_eq!(store.previous_record("shop").await.unwrap(), None);
    assert!(store.records().await.unwrap().is_empty());
    assert!(!store.delete_record("shop").await.unwrap(), "nothing left to delete");

    // A converge that started from generation 2 before `kiln down` must not record over the deletion.
    let stale = store.write_record("shop", Some(Generation(2)), vec![]).await.unwrap_err();
    assert!(matches!(stale, StateError::RecordMoved { actual: None, .. }), "{stale:?}");
    assert_eq!(store.write_record("shop", None, vec![]).await.unwrap(), Generation(3));
}

async fn records_claims_events_and_converges_survive_a_restart(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
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

    let store = backend.open(&clock).await;
    assert_eq!(store.record("shop").await.unwrap().unwrap().images, images);
    assert_eq!(store.converge(&converge.id).await.unwrap(), Some(converge.clone()));
    assert_eq!(store.events(&converge.id, None).await.unwrap(), before);
    let claims = store.live_claims(T0).await.unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!((&claims[0].converge, claims[0].reference.as_str()), (&converge.id, "shop-api:4a77b1c2d3e4-amd64"));
    assert!(store.missing_contexts(&["ab".repeat(32)]).await.unwrap().is_empty());
}

async fn a_converge_running_at_restart_is_failed_with_an_event_and_its_claims_wait_for_their_lease(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
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
    let store = backend.open(&clock).await;
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

async fn a_second_converge_of_a_running_instance_is_refused_naming_the_running_one(backend: Backend) {
    let store = backend.open(&clock()).await;
    let first = store.open_converge("shop", "ana").await.unwrap();
    assert_eq!(first.state, ConvergeState::Running);

    let err = store.open_converge("shop", "bo").await.unwrap_err();
    match &err {
        StateError::ConvergeRunning { instance, running } => {
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

async fn two_handles_never_both_record_or_both_run(backend: Backend) {
    // Two opens are two connections (two pools on PostgreSQL), as two `kiln` processes sharing
    // $KILN_HOME, or two coordinators sharing a farm's database, would have.
    let a: Arc<dyn StateStore> = backend.open(&clock()).await;
    let b: Arc<dyn StateStore> = backend.open(&clock()).await;
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
            Err(StateError::RecordMoved { actual: Some(Generation(2)), .. }) => {}
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(won, 1);

    // Each round races one open per handle on its own thread: exactly one converge runs.
    for round in 0..10 {
        let instance = format!("shop-{round}");
        let (x, y) = {
            let (a, b, ia, ib) = (a.clone(), b.clone(), instance.clone(), instance.clone());
            let x = tokio::spawn(async move { a.open_converge(&ia, "ana").await });
            let y = tokio::spawn(async move { b.open_converge(&ib, "bo").await });
            (x.await.unwrap(), y.await.unwrap())
        };
        let (winner, loser) = match (x, y) {
            (Ok(winner), Err(loser)) | (Err(loser), Ok(winner)) => (winner, loser),
            (x, y) => panic!("exactly one converge of {instance} should open: {x:?} / {y:?}"),
        };
        assert!(matches!(loser, StateError::ConvergeRunning { ref running, .. } if *running == winner.id), "{loser:?}");
        assert_eq!(a.converges(Some(&instance), 10).await.unwrap().len(), 1, "the loser left no converge behind");
    }
}

async fn claims_expire_by_lease_renew_extends_them_and_release_removes_them(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
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

async fn only_a_running_converge_may_claim(backend: Backend) {
    let store = backend.open(&clock()).await;
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();

    let late = store.claim(&converge.id, &refs(&["shop-api:1-amd64"]), u64::MAX >> 2).await.unwrap_err();
    assert!(
        matches!(late, StateError::ConvergeFinished { ref id, state: ConvergeState::Succeeded } if *id == converge.id)
    );
    let unknown = ConvergeId::from("nosuchconverge0");
    let err = store.claim(&unknown, &refs(&["x:1"]), 1).await.unwrap_err();
    assert!(matches!(err, StateError::UnknownConverge { ref id } if *id == unknown), "{err:?}");
    assert!(store.live_claims(0).await.unwrap().is_empty());
}

async fn a_converge_finishes_once_and_never_as_running(backend: Backend) {
    let store = backend.open(&clock()).await;
    let converge = store.open_converge("shop", "ana").await.unwrap();
    let err = store.finish_converge(&converge.id, ConvergeState::Running).await.unwrap_err();
    assert!(matches!(err, StateError::FinishAsRunning { .. }), "{err:?}");
    store.finish_converge(&converge.id, ConvergeState::Failed { reason: "push refused".into() }).await.unwrap();
    let again = store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap_err();
    assert!(matches!(again, StateError::ConvergeFinished { state: ConvergeState::Failed { .. }, .. }), "{again:?}");
    let state = store.converge(&converge.id).await.unwrap().unwrap().state;
    assert_eq!(state, ConvergeState::Failed { reason: "push refused".into() });
}

async fn a_converge_opens_with_its_first_event_or_not_at_all(backend: Backend) {
    let store = backend.open(&clock()).await;
    let started = (EventKind::Started, None, "gc --dry-run".to_owned());
    let (converge, first) = store.open_converge_with("shop", "ana", started.clone()).await.unwrap();
    assert_eq!((converge.state.clone(), converge.requested_by.as_str()), (ConvergeState::Running, "ana"));
    assert_eq!((first.seq, first.kind.clone(), first.message.as_str()), (1, EventKind::Started, "gc --dry-run"));
    assert_eq!(store.events(&converge.id, None).await.unwrap(), vec![first]);
    store.append_event(&converge.id, EventKind::Note, None, "next").await.unwrap();
    assert_eq!(store.events(&converge.id, Some(1)).await.unwrap()[0].seq, 2);

    // Refused while the instance runs one: no converge opened, no event written anywhere.
    let err = store.open_converge_with("shop", "ben", started).await.unwrap_err();
    assert!(matches!(err, StateError::ConvergeRunning { ref running, .. } if *running == converge.id), "{err:?}");
    let converges = store.converges(Some("shop"), 10).await.unwrap();
    assert_eq!(converges.iter().map(|c| c.id.clone()).collect::<Vec<_>>(), vec![converge.id.clone()]);
    assert_eq!(store.events(&converge.id, None).await.unwrap().len(), 2);
}

async fn the_last_events_land_with_the_finish_and_a_refused_finish_keeps_them(backend: Backend) {
    let store = backend.open(&clock()).await;
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.append_event(&converge.id, EventKind::Started, None, "").await.unwrap();
    let last = vec![
        (EventKind::Failed, Some("api".to_owned()), "build failed at step 3".to_owned()),
        (EventKind::Finished { succeeded: false, generation: 0 }, None, "build failed at step 3".to_owned()),
    ];
    let failed = ConvergeState::Failed { reason: "build failed at step 3".into() };
    let (appended, not_marked) = store.finish_with_events(&converge.id, failed.clone(), last).await.unwrap();
    assert!(not_marked.is_none(), "{not_marked:?}");
    assert_eq!(appended.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3]);
    assert_eq!(store.converge(&converge.id).await.unwrap().unwrap().state, failed);
    let kinds: Vec<EventKind> = store.events(&converge.id, None).await.unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds[0], EventKind::Started);
    assert!(matches!(kinds[2], EventKind::Finished { succeeded: false, .. }), "{kinds:?}");

    // Finished already (as a takeover fails a converge): the state stands, the events still land.
    let late = vec![(EventKind::Note, None, "late".to_owned())];
    let (appended, not_marked) =
        store.finish_with_events(&converge.id, ConvergeState::Succeeded, late.clone()).await.unwrap();
    assert!(matches!(not_marked, Some(StateError::ConvergeFinished { .. })), "{not_marked:?}");
    assert_eq!(appended.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![4]);
    assert_eq!(store.converge(&converge.id).await.unwrap().unwrap().state, failed);
    let (_, as_running) = store.finish_with_events(&converge.id, ConvergeState::Running, vec![]).await.unwrap();
    assert!(matches!(as_running, Some(StateError::FinishAsRunning { .. })), "{as_running:?}");

    let unknown = ConvergeId::from("nosuchconverge0");
    let err = store.finish_with_events(&unknown, ConvergeState::Succeeded, late).await.unwrap_err();
    assert!(matches!(err, StateError::UnknownConverge { .. }), "{err:?}");
}

/// `settle_converge`: the no-op converge opened, logged and finished in one write, only while its
/// instance runs nothing and its record stands where the converge decided it.
async fn a_settled_converge_is_stored_whole_or_not_at_all(backend: Backend) {
    let store = backend.open(&clock()).await;
    let first = store.write_record("shop", None, vec![built("api", "shop-api:1")]).await.unwrap();
    let said = |generation: Generation| {
        vec![
            (EventKind::Started, None, String::new()),
            (
                EventKind::Recorded { reference: "shop-api:1".into(), reason: None },
                Some("api".to_owned()),
                "shop-api:1".to_owned(),
            ),
            (EventKind::Finished { succeeded: true, generation: generation.0 }, None, "unchanged".to_owned()),
        ]
    };
    let id = ConvergeId::generate(T0);
    let (converge, events) = store.settle_converge(&id, "shop", "ana", first, said(first)).await.unwrap().unwrap();
    assert_eq!((converge.id.clone(), converge.state.clone()), (id.clone(), ConvergeState::Succeeded));
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
    let stored = store.converge(&id).await.unwrap().unwrap();
    assert_eq!((stored.state, stored.requested_by.as_str()), (ConvergeState::Succeeded, "ana"));
    assert!(stored.finished_ms.is_some());
    let kinds: Vec<EventKind> = store.events(&id, None).await.unwrap().into_iter().map(|e| e.kind).collect();
    assert_eq!(kinds, said(first).into_iter().map(|e| e.0).collect::<Vec<_>>());
    // It left nothing running: the next converge of the instance opens.
    let next = store.open_converge("shop", "ben").await.unwrap();

    // While that one runs, a settled converge is refused, naming it, and writes nothing.
    let refused = ConvergeId::generate(T0 + 1);
    let err = store.settle_converge(&refused, "shop", "ana", first, said(first)).await.unwrap_err();
    assert!(matches!(err, StateError::ConvergeRunning { ref running, .. } if *running == next.id), "{err:?}");
    assert!(store.converge(&refused).await.unwrap().is_none());
    let unknown = store.events(&refused, None).await.unwrap_err();
    assert!(matches!(unknown, StateError::UnknownConverge { .. }), "{unknown:?}");

    // The record moved after the converge decided: nothing is written, and it may go the long way.
    let second = store.write_record("shop", Some(first), vec![built("api", "shop-api:2")]).await.unwrap();
    store.finish_converge(&next.id, ConvergeState::Succeeded).await.unwrap();
    let late = ConvergeId::generate(T0 + 2);
    assert!(store.settle_converge(&late, "shop", "ana", first, said(first)).await.unwrap().is_none());
    assert!(store.converge(&late).await.unwrap().is_none());
    assert!(store.events(&late, None).await.is_err());
    assert_eq!(store.converges(Some("shop"), 10).await.unwrap().len(), 2);
    // Nor is one stored for a record taken down.
    store.delete_record("shop").await.unwrap();
    assert!(store.settle_converge(&late, "shop", "ana", second, said(second)).await.unwrap().is_none());
    assert!(store.converge(&late).await.unwrap().is_none());
}

/// `settled_record` may answer from what the handle kept (PostgreSQL always keeps it for this
/// read), so it must follow the handle's own writes, and one from behind another handle's write
/// — a coordinator that took over — may only make the settled converge fall back, and heal.
async fn the_settled_record_follows_this_handle_and_a_stale_one_only_costs_a_fallback(backend: Backend) {
    let clock = clock();
    let store = backend.open(&clock).await;
    let generation = |r: Option<kiln_coordinator::model::Record>| r.map(|r| r.generation);
    assert_eq!(generation(store.settled_record("shop").await.unwrap()), None);
    let first = store.write_record("shop", None, vec![built("api", "shop-api:1")]).await.unwrap();
    assert_eq!(generation(store.settled_record("shop").await.unwrap()), Some(first));
    let second = store.write_record("shop", Some(first), vec![built("api", "shop-api:2")]).await.unwrap();
    let kept = store.settled_record("shop").await.unwrap().unwrap();
    assert_eq!((kept.generation, kept.images), (second, vec![built("api", "shop-api:2")]));
    assert!(store.delete_record("shop").await.unwrap());
    assert_eq!(generation(store.settled_record("shop").await.unwrap()), None);
    let third = store.write_record("shop", None, vec![built("api", "shop-api:3")]).await.unwrap();
    assert_eq!(generation(store.settled_record("shop").await.unwrap()), Some(third));

    // Another handle writes: this one's answer may be one write behind.
    let other = backend.open(&clock).await;
    let fourth = other.write_record("shop", Some(third), vec![built("api", "shop-api:4")]).await.unwrap();
    let seen = store.settled_record("shop").await.unwrap().unwrap().generation;
    assert!(seen == third || seen == fourth, "{seen:?}");
    let said = vec![(EventKind::Started, None, String::new())];
    let id = ConvergeId::generate(T0);
    let settled = store.settle_converge(&id, "shop", "ana", seen, said.clone()).await.unwrap();
    assert_eq!(settled.is_some(), seen == fourth, "a settle is stored exactly when its record is current");
    // Refused or not, the next answer is the current record.
    assert_eq!(generation(store.settled_record("shop").await.unwrap()), Some(fourth));
    let again = ConvergeId::generate(T0 + 1);
    assert!(store.settle_converge(&again, "shop", "ana", fourth, said).await.unwrap().is_some());
}

/// The farm's mix, one call after another: usual converges (whose statements each connection has
/// prepared) and settled ones. On PostgreSQL the settled converge's statements go out together; a
/// connection that had prepared some of them and not the others once ran the events ahead of the
/// converge they belong to, and the call failed ("current transaction is aborted").
async fn settled_converges_after_usual_ones_on_the_same_connections_are_stored(backend: Backend) {
    let store = backend.open(&clock()).await;
    for round in 0..24u64 {
        let instance = format!("shop{}", round % 3);
        let converge = store.open_converge(&instance, "ana").await.unwrap();
        store.append_events(&converge.id, vec![(EventKind::Started, None, String::new())]).await.unwrap();
        let current = store.record(&instance).await.unwrap().map(|r| r.generation);
        let generation = store.write_record(&instance, current, vec![built("api", "shop-api:1")]).await.unwrap();
        store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();
        let said = vec![(EventKind::Started, None, String::new()), (EventKind::Note, None, format!("round {round}"))];
        let id = ConvergeId::generate(T0 + round);
        let settled = store.settle_converge(&id, &instance, "ana", generation, said).await;
        let (converge, events) =
            settled.unwrap_or_else(|err| panic!("round {round}: {err}")).expect("the record stands");
        assert_eq!((converge.state, events.len()), (ConvergeState::Succeeded, 2), "round {round}");
        assert_eq!(store.events(&id, None).await.unwrap().len(), 2, "round {round}");
    }
}

async fn events_come_back_in_seq_order_and_after_seq_resumes(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
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
    assert!(matches!(store.events(&unknown, None).await, Err(StateError::UnknownConverge { .. })));
    let err = store.append_event(&unknown, EventKind::Note, None, "x").await.unwrap_err();
    assert!(matches!(err, StateError::UnknownConverge { .. }), "{err:?}");
}

async fn an_event_kind_written_by_a_newer_kiln_still_replays(backend: Backend) {
    let store = backend.open(&clock()).await;
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.append_event(&converge.id, EventKind::Started, None, "start").await.unwrap();
    backend
        .execute(&format!(
            r#"INSERT INTO events (converge_id, seq, at_ms, image, kind, message)
               VALUES ('{}', 2, 0, NULL, '{{"kind":"teleported","meters":3}}', 'beamed')"#,
            converge.id
        ))
        .await;
    let events = store.events(&converge.id, None).await.unwrap();
    assert_eq!((events[1].kind.clone(), events[1].message.as_str()), (EventKind::Unknown, "beamed"));
}

async fn sixteen_concurrent_appends_get_distinct_gap_free_seqs(backend: Backend) {
    let store: Arc<dyn StateStore> = backend.open(&clock()).await;
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

/// The events writer's path: a burst in one call. Every backend must implement it (a default that
/// appends one by one made each event a transaction of its own on PostgreSQL).
async fn batched_appends_keep_their_order_and_interleave_gap_free_with_others(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store: Arc<dyn StateStore> = backend.open(&clock).await;
    let converge = store.open_converge("shop", "ana").await.unwrap();
    store.append_event(&converge.id, EventKind::Started, None, "start").await.unwrap();
    clock.advance(7);
    let burst = vec![
        (EventKind::Uploaded { bytes: 3 }, Some("api".to_owned()), "up".to_owned()),
        (EventKind::BuildLog, None, "no image".to_owned()),
        (EventKind::Built { secs: 1.5 }, Some("web".to_owned()), "built".to_owned()),
    ];
    let appended = store.append_events(&converge.id, burst.clone()).await.unwrap();
    assert_eq!(appended.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3, 4]);
    assert!(store.append_events(&converge.id, Vec::new()).await.unwrap().is_empty());

    // Eight writers, each a burst of five, with single appends among them: every seq once.
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (store, id) = (store.clone(), converge.id.clone());
            tokio::spawn(async move {
                let lines = (0..5).map(|j| (EventKind::BuildLog, Some(format!("w{i}")), format!("{i}.{j}"))).collect();
                let mut seqs: Vec<u64> = store.append_events(&id, lines).await.unwrap().iter().map(|e| e.seq).collect();
                seqs.push(store.append_event(&id, EventKind::Note, None, &format!("{i}")).await.unwrap().seq);
                seqs
            })
        })
        .collect();
    let mut seqs = Vec::new();
    for task in tasks {
        let burst = task.await.unwrap();
        assert!(burst[..5].windows(2).all(|w| w[1] == w[0] + 1), "one burst's seqs are consecutive: {burst:?}");
        seqs.extend(burst);
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (5..=52).collect::<Vec<u64>>());

    let stored = store.events(&converge.id, None).await.unwrap();
    assert_eq!(stored.iter().map(|e| e.seq).collect::<Vec<_>>(), (1..=52).collect::<Vec<u64>>());
    let first_burst: Vec<_> =
        stored[1..4].iter().map(|e| (e.kind.clone(), e.image.clone(), e.message.clone())).collect();
    assert_eq!(first_burst, burst);
    assert!(stored[1..4].iter().all(|e| e.at_ms == T0 + 7), "a burst is stamped when written");
    let unknown = ConvergeId::from("nosuchconverge0");
    let err = store.append_events(&unknown, burst).await.unwrap_err();
    assert!(matches!(err, StateError::UnknownConverge { .. }), "{err:?}");
    assert_eq!(store.events(&converge.id, None).await.unwrap().len(), 52, "nothing written by the refused burst");
}

async fn converges_list_newest_first_per_instance_and_within_limit(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
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

async fn missing_contexts_returns_exactly_the_unknown_ones(backend: Backend) {
    let store = backend.open(&clock()).await;
    let [a, b, c, d] = ["a", "b", "c", "d"].map(|x| x.repeat(64));
    for digest in [&a, &c] {
        store.put_context(ContextRow { digest: digest.clone(), bytes: 10, stored_at_ms: T0 }).await.unwrap();
    }
    let asked = [a.clone(), b.clone(), c.clone(), d.clone(), b.clone()];
    assert_eq!(store.missing_contexts(&asked).await.unwrap(), vec![b.clone(), d]);
    assert_eq!(store.context(&c).await.unwrap(), Some(ContextRow { digest: c, bytes: 10, stored_at_ms: T0 }));
    assert_eq!(store.context(&b).await.unwrap(), None);
}

async fn contexts_are_listed_and_collected_only_when_unclaimed(backend: Backend) {
    let store = backend.open(&clock()).await;
    let [a, b] = ["a", "b"].map(|x| x.repeat(64));
    for digest in [&b, &a] {
        store.put_context(ContextRow { digest: digest.clone(), bytes: 10, stored_at_ms: T0 }).await.unwrap();
    }
    let listed: Vec<String> = store.contexts().await.unwrap().into_iter().map(|c| c.digest).collect();
    assert_eq!(listed, vec![a.clone(), b.clone()], "by digest");

    let converge = store.open_converge("shop", "ana").await.unwrap();
    let claim_a = format!("context:{a}");
    store.claim(&converge.id, std::slice::from_ref(&claim_a), T0 + 30_000).await.unwrap();
    assert!(!store.delete_context_unless_claimed(&a, &claim_a, T0).await.unwrap(), "a live claim keeps it");
    assert!(store.context(&a).await.unwrap().is_some());
    assert!(store.delete_context_unless_claimed(&a, &claim_a, T0 + 30_000).await.unwrap(), "an expired one does not");
    assert!(store.delete_context_unless_claimed(&b, &format!("context:{b}"), T0).await.unwrap());
    assert!(!store.delete_context_unless_claimed(&b, &format!("context:{b}"), T0).await.unwrap(), "already gone");
    assert!(store.contexts().await.unwrap().is_empty());
}

async fn a_context_entry_list_is_kept_replaced_survives_a_restart_and_goes_with_its_context(backend: Backend) {
    let store = backend.open(&clock()).await;
    let [a, b] = ["a", "b"].map(|x| x.repeat(64));
    assert_eq!(store.context_entries(&a).await.unwrap(), None);
    for digest in [&a, &b] {
        store.put_context(ContextRow { digest: digest.clone(), bytes: 10, stored_at_ms: T0 }).await.unwrap();
    }
    // Raw bytes, every value a byte can take: names need not be UTF-8.
    let stream: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
    store.put_context_entries(&a, vec![1, 2, 3]).await.unwrap();
    store.put_context_entries(&a, stream.clone()).await.unwrap();
    store.put_context_entries(&b, vec![0]).await.unwrap();
    drop(store);
    let store = backend.open(&clock()).await;
    assert_eq!(store.context_entries(&a).await.unwrap(), Some(stream), "replaced, then read back after a restart");
    assert!(store.delete_context_unless_claimed(&a, &format!("context:{a}"), T0).await.unwrap());
    assert_eq!(store.context_entries(&a).await.unwrap(), None, "collected with its context");
    assert_eq!(store.context_entries(&b).await.unwrap(), Some(vec![0]), "another context's list stays");
}

async fn the_builder_of_a_ref_is_the_converge_that_last_started_building_it(backend: Backend) {
    let clock = clock();
    let store = backend.open(&clock).await;
    let building = |reference: &str| EventKind::Building { reference: reference.to_owned(), reason: None };
    let mut converges = Vec::new();
    for reference in ["shop-api:1-amd64", "shop-api:1-amd64", "shop_api:1-amd64"] {
        clock.advance(1000);
        let converge = store.open_converge("shop", "ana").await.unwrap();
        store.append_event(&converge.id, EventKind::Started, None, "start").await.unwrap();
        store.append_event(&converge.id, building(reference), Some("api"), "building").await.unwrap();
        store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();
        converges.push(converge.id);
    }
    assert_eq!(store.builder_of("shop-api:1-amd64").await.unwrap().as_ref(), Some(&converges[1]), "the latest");
    assert_eq!(store.builder_of("shop_api:1-amd64").await.unwrap().as_ref(), Some(&converges[2]));
    // `_` and `%` are plain characters in a ref, never wildcards.
    assert_eq!(store.builder_of("shop%api:1-amd64").await.unwrap(), None);
    assert_eq!(store.builder_of("blog-web:2-amd64").await.unwrap(), None);
}

async fn agents_and_inventories_are_replaced_by_their_key(backend: Backend) {
    let store = backend.open(&clock()).await;
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

async fn pins_are_kept_once_survive_a_restart_and_go_only_when_unpinned(backend: Backend) {
    let clock = Arc::new(ManualClock::new(T0));
    let store = backend.open(&clock).await;
    assert!(store.pin("tool:1", "ana@box").await.unwrap(), "a new pin is a change");
    clock.advance(5);
    assert!(!store.pin("tool:1", "bo@box").await.unwrap(), "pinning twice is pinning once");
    assert!(store.pin("base:2", "bo@box").await.unwrap());
    // `kiln down` of any instance leaves pins alone: they belong to no instance.
    store.delete_record("shop").await.unwrap();
    drop(store);

    let store = backend.open(&clock).await;
    let pins = store.pins().await.unwrap();
    let listed: Vec<(&str, u64, &str)> =
        pins.iter().map(|p| (p.reference.as_str(), p.pinned_at_ms, p.pinned_by.as_str())).collect();
    assert_eq!(listed, vec![("base:2", T0 + 5, "bo@box"), ("tool:1", T0, "ana@box")], "the first pin's author stays");
    assert!(store.unpin("tool:1").await.unwrap());
    assert!(!store.unpin("tool:1").await.unwrap(), "unpinning what is not pinned changes nothing");
    assert_eq!(store.pins().await.unwrap().len(), 1);
}

async fn a_lone_coordinator_leads_writes_renews_and_resigns(backend: Backend) {
    let store = backend.open(&clock()).await;
    assert_eq!(store.current_leader().await.unwrap(), None, "nobody leads a fresh database");
    let ttl = Duration::from_secs(60);
    let led =
        store.try_acquire_leadership("coord-a", "10.0.0.1:7070", ttl).await.unwrap().expect("a lone coordinator leads");
    assert!(led.token >= 1, "{led:?}");
    assert_eq!((led.holder.as_str(), led.addr.as_str()), ("coord-a", "10.0.0.1:7070"));
    assert_eq!(store.current_leader().await.unwrap().as_ref(), Some(&led));
    store.write_record("shop", None, vec![]).await.expect("the leader writes");
    let renewed = store.renew_leadership(&led, ttl).await.unwrap();
    assert_eq!((renewed.token, renewed.holder.as_str()), (led.token, "coord-a"), "a renewal keeps the lease");
    store.resign_leadership(&renewed).await.unwrap();
    assert_eq!(store.current_leader().await.unwrap(), None, "a resigned lease is free");
}

/// A write whose caller went away mid-transaction (here: a timeout while it waits on a row lock)
/// must never land, and the connection it held, still in that transaction, must not serve the
/// next call — whose `COMMIT` would otherwise commit the abandoned write with its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_write_abandoned_mid_transaction_never_lands_and_its_connection_is_not_reused() {
    let backend = Backend::postgres().await;
    let Backend::Postgres { db } = &backend else { unreachable!() };
    let store = backend.open(&clock()).await;
    let first = store.write_record("shop", None, vec![built("api", "reg/api:1")]).await.unwrap();
    let second = store.write_record("shop", Some(first), vec![built("api", "reg/api:2")]).await.unwrap();

    // Another session holds generation 1's row, which the next write prunes last: that write
    // waits inside its transaction having already inserted generation 3.
    let holder = raw_postgres(db).await;
    holder
        .batch_execute("BEGIN; SELECT * FROM records WHERE instance = 'shop' AND generation = 1 FOR UPDATE")
        .await
        .unwrap();
    let abandoned = store.write_record("shop", Some(second), vec![built("api", "reg/api:3")]);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), abandoned).await.is_err(),
        "the write waits on the held row"
    );
    holder.batch_execute("COMMIT").await.unwrap();

    // Later writes, one at a time, take whatever connection the pool has.
    let converge = store.open_converge("other", "ana").await.unwrap();
    for i in 0..8 {
        store.append_event(&converge.id, EventKind::Note, None, &format!("after {i}")).await.unwrap();
    }
    store.finish_converge(&converge.id, ConvergeState::Succeeded).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let record = store.record("shop").await.unwrap().expect("the second record stands");
    assert_eq!(record.generation, second, "the abandoned write never landed");
    assert_eq!(record.images, vec![built("api", "reg/api:2")]);
    assert_eq!(
        // This test's database only: the cluster is shared with the suite's other tests, whose
        // own transactions may be open at this instant (CI saw one).
        backend
            .count(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE state LIKE 'idle in transaction%' AND datname = current_database()"
            )
            .await,
        0,
        "no connection is left in a transaction"
    );
    assert_eq!(store.events(&converge.id, None).await.unwrap().len(), 8);
}

/// SQLite serves one embedded coordinator: whoever asks leads, and nothing is fenced.
#[tokio::test]
async fn leadership_is_always_held_on_sqlite() {
    let backend = Backend::sqlite();
    let (a, b) = (backend.open(&clock()).await, backend.open(&clock()).await);
    let ttl = Duration::from_secs(10);
    let la = a.try_acquire_leadership("a", "127.0.0.1:1", ttl).await.unwrap().expect("a leads");
    let lb = b.try_acquire_leadership("b", "127.0.0.1:2", ttl).await.unwrap().expect("b leads too");
    assert_eq!((la.token, lb.token), (1, 1));
    a.write_record("shop", None, vec![]).await.unwrap();
    b.write_record("shop", Some(Generation(1)), vec![]).await.unwrap();
    assert_eq!(a.renew_leadership(&la, ttl).await.unwrap().expires_ms, T0 + 10_000, "expiry on the store's clock");
}

/// The serving coordinator's handle keeps the records it read (`SqliteStore::cache_records`):
/// a change made behind its back is not seen — which is why only the file's one writer keeps
/// them — while every write through it, a refused or deleted one too, is seen by the next read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_cached_records_follow_every_write_through_the_handle() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kiln.db");
    let store = SqliteStore::open(&path).unwrap();
    store.cache_records();
    let generation = |r: Option<kiln_coordinator::model::Record>| r.map(|r| r.generation.0);
    assert_eq!(generation(store.record("shop").await.unwrap()), None);
    store.write_record("shop", None, vec![built("web", "shop-web:aaa")]).await.unwrap();
    assert_eq!(generation(store.record("shop").await.unwrap()), Some(1), "an absent record was kept past a write");

    // Behind the handle's back: answered from memory.
    let images = |r: Option<kiln_coordinator::model::Record>| r.map_or(0, |r| r.images.len());
    rusqlite::Connection::open(&path).unwrap().execute_batch("UPDATE records SET images = '[]'").unwrap();
    assert_eq!(images(store.record("shop").await.unwrap()), 1, "the read did not come from memory");

    // A refused compare-and-set still makes the next read go to the file.
    let refused = store.write_record("shop", Some(Generation(5)), vec![]).await;
    assert!(matches!(refused, Err(StateError::RecordMoved { .. })), "{refused:?}");
    assert_eq!(images(store.record("shop").await.unwrap()), 0);
    store.write_record("shop", Some(Generation(1)), vec![built("web", "shop-web:bbb")]).await.unwrap();
    let current = store.record("shop").await.unwrap().unwrap();
    assert_eq!((current.generation.0, current.images[0].reference.as_str()), (2, "shop-web:bbb"));
    assert!(store.delete_record("shop").await.unwrap());
    assert_eq!(generation(store.record("shop").await.unwrap()), None);
}

/// A caller that stops waiting for a record's write (a cancelled converge) cannot leave the
/// cache answering with the record the write replaced: the write still lands, and then the next
/// read sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_record_write_abandoned_by_its_caller_is_still_seen_by_the_next_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kiln.db");
    let store = SqliteStore::open(&path).unwrap();
    store.cache_records();
    store.write_record("shop", None, vec![built("web", "shop-web:aaa")]).await.unwrap();
    assert_eq!(store.record("shop").await.unwrap().unwrap().generation, Generation(1));

    // Another connection holds the write lock, so the write cannot land during its first poll:
    // polled once, then dropped, it has been handed to the writer and waits there for the lock.
    let raw = rusqlite::Connection::open(&path).unwrap();
    raw.execute_batch("BEGIN IMMEDIATE").unwrap();
    let abandoned = tokio::time::timeout(
        Duration::ZERO,
        store.write_record("shop", Some(Generation(1)), vec![built("web", "shop-web:bbb")]),
    )
    .await;
    assert!(abandoned.is_err(), "the write answered while another connection held the lock");
    raw.execute_batch("COMMIT").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let landed: i64 = raw.query_row("SELECT MAX(generation) FROM records", [], |r| r.get(0)).unwrap();
        let seen = store.record("shop").await.unwrap().unwrap().generation;
        if landed == 2 && seen == Generation(2) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the file holds generation {landed}, the handle says {seen:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads do not queue behind the writer: with the file's write lock held elsewhere (another
/// process's transaction), a write waits for it, and reads made meanwhile are answered — with
/// what had committed — before the write lands. Once it lands, the next read sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reads_are_answered_while_a_write_waits_for_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kiln.db");
    let store = Arc::new(SqliteStore::open(&path).unwrap());
    store.pin("kiln-before:1", "alice").await.unwrap();
    store.write_record("shop", None, vec![built("web", "shop-web:aaa")]).await.unwrap();

    let other = rusqlite::Connection::open(&path).unwrap();
    other.execute_batch("BEGIN IMMEDIATE").unwrap();
    let writing = {
        let store = store.clone();
        tokio::spawn(async move { store.pin("kiln-during:1", "bob").await })
    };
    for _ in 0..3 {
        let pins = store.pins().await.unwrap();
        assert_eq!(pins.iter().map(|p| p.reference.as_str()).collect::<Vec<_>>(), ["kiln-before:1"]);
        let record = store.record("shop").await.unwrap().expect("the record committed before");
        assert_eq!(record.generation, Generation(1));
        assert!(store.converges(None, 10).await.unwrap().is_empty());
    }
    assert!(!writing.is_finished(), "the write waits for the lock the other connection holds");

    other.execute_batch("ROLLBACK").unwrap();
    assert!(writing.await.unwrap().unwrap(), "the write lands once the lock is free");
    let pins = store.pins().await.unwrap();
    assert_eq!(pins.len(), 2, "a read after the write was answered sees it: {pins:?}");
}

/// Fencing, leases and connections: what only a farm's PostgreSQL store has.
mod postgres_only {
    use super::*;
    use kiln_coordinator::state::leadership::{lead, Activity, LeasePolicy, Lost};
    use tokio::sync::watch;
    use tokio::time::Instant;

    const A: &str = "10.0.0.1:7070";
    const B: &str = "10.0.0.2:7070";
    const LONG: Duration = Duration::from_secs(60);
    /// How long a test waits for what must happen (a lease lapsing, a standby taking over)
    /// before failing; never asserted as a speed.
    const PATIENCE: Duration = Duration::from_secs(60);

    /// Asks for the lease until the database grants it.
    async fn acquire_once_lapsed(store: &dyn StateStore, holder: &str, addr: &str) -> Leadership {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(leadership) = store.try_acquire_leadership(holder, addr, LONG).await.unwrap() {
                return leadership;
            }
            assert!(Instant::now() < deadline, "the lease of {holder} never became free");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_coordinator_whose_lease_was_taken_over_is_fenced_and_writes_nothing() {
        let backend = Backend::postgres().await;
        // Two handles, two pools: two coordinators of one farm.
        let (a, b) = (backend.open(&clock()).await, backend.open(&clock()).await);

        let la = a.try_acquire_leadership("coord-a", A, LONG).await.unwrap().expect("A leads a fresh farm");
        assert_eq!(b.try_acquire_leadership("coord-b", B, LONG).await.unwrap(), None, "B cannot while A's lease lives");
        assert_eq!(b.current_leader().await.unwrap().map(|l| l.addr), Some(A.to_owned()));
        let shop = a.open_converge("shop", "ana").await.unwrap();
        a.claim(&shop.id, &refs(&["shop-api:1-amd64"]), T0 + 30_000).await.unwrap();
        a.write_record("shop", None, vec![built("api", "shop-api:1-amd64")]).await.unwrap();
        let standby = b.write_record("shop", Some(Generation(1)), vec![]).await.unwrap_err();
        assert!(matches!(standby, StateError::NotLeader { active: Some(ref active) } if active == A), "{standby:?}");
        assert!(standby.to_string().contains(A), "{standby}");

        // A's last renewal is short; then A renews no more (paused, partitioned), and B takes over.
        a.renew_leadership(&la, Duration::from_millis(100)).await.unwrap();
        let lb = acquire_once_lapsed(&*b, "coord-b", B).await;
        assert!(lb.token > la.token, "B's token {} should be above A's {}", lb.token, la.token);

        let fenced =
            a.write_record("shop", Some(Generation(1)), vec![built("api", "shop-api:2-amd64")]).await.unwrap_err();
        match &fenced {
            StateError::Fenced { holder, token, current, active } => {
                assert_eq!(
                    (holder.as_str(), *token, *current, active.as_deref()),
                    ("coord-a", la.token, lb.token, Some(B))
                );
            }
            other => panic!("expected Fenced, got {other:?}"),
        }
        assert!(fenced.to_string().contains(B), "{fenced}");
        let context = ContextRow { digest: "ab".repeat(32), bytes: 1, stored_at_ms: T0 };
        let agent = AgentRow {
            id: AgentId("build-1".into()),
            role: AgentRole::Host,
            stores: vec![],
            platforms: vec![],
            version: "0.1.0".into(),
            last_seen_ms: T0,
        };
        let refused = [
            a.open_converge("blog", "ana").await.map(drop),
            a.open_converge_with("blog", "ana", (EventKind::Started, None, String::new())).await.map(drop),
            a.append_event(&shop.id, EventKind::Note, None, "late").await.map(drop),
            a.claim(&shop.id, &refs(&["shop-api:2-amd64"]), T0 + 60_000).await,
            a.renew_claims(&shop.id, T0 + 60_000).await.map(drop),
            a.release_claims(&shop.id).await,
            a.finish_converge(&shop.id, ConvergeState::Succeeded).await,
            a.finish_with_events(&shop.id, ConvergeState::Succeeded, vec![(EventKind::Note, None, "late".into())])
                .await
                .map(drop),
            a.fail_in_flight("restarted").await.map(drop),
            a.delete_record("shop").await.map(drop),
            a.pin("tool:1", "ana").await.map(drop),
            a.put_context(context).await,
            a.upsert_agent(agent).await,
            a.put_inventory("docker:build-1", "[]".into(), T0).await,
            a.renew_leadership(&la, LONG).await.map(drop),
        ];
        for (i, result) in refused.iter().enumerate() {
            assert!(matches!(result, Err(StateError::Fenced { .. })), "write {i}: {result:?}");
        }

        // Nothing A tried landed: B finds the state as A left it when it lost the lease.
        let record = b.record("shop").await.unwrap().unwrap();
        assert_eq!((record.generation, record.images[0].reference.as_str()), (Generation(1), "shop-api:1-amd64"));
        assert_eq!(b.converges(None, 10).await.unwrap().len(), 1);
        assert!(b.events(&shop.id, None).await.unwrap().is_empty());
        assert!(b.pins().await.unwrap().is_empty() && b.agents().await.unwrap().is_empty());
        assert_eq!(b.live_claims(T0).await.unwrap().len(), 1, "A's claim stands until its own lease");
        assert_eq!(b.fail_in_flight("its coordinator lost the lease").await.unwrap(), vec![shop.id.clone()]);
        assert_eq!(b.write_record("shop", Some(Generation(1)), vec![]).await.unwrap(), Generation(2));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lapsed_lease_nobody_took_still_renews_with_its_token() {
        let backend = Backend::postgres().await;
        let (a, b) = (backend.open(&clock()).await, backend.open(&clock()).await);
        let la = a.try_acquire_leadership("coord-a", A, Duration::from_millis(50)).await.unwrap().unwrap();
        let deadline = Instant::now() + PATIENCE;
        while b.current_leader().await.unwrap().is_some() {
            assert!(Instant::now() < deadline, "the lease never lapsed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Nobody else leads, so nothing can conflict with A's writes: the token alone fences.
        a.write_record("shop", None, vec![]).await.expect("a lapsed leader nobody replaced still writes");
        let renewed = a.renew_leadership(&la, LONG).await.unwrap();
        assert_eq!(renewed.token, la.token);
        assert_eq!(b.try_acquire_leadership("coord-b", B, LONG).await.unwrap(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resigned_lease_passes_at_once_and_the_old_handle_writes_no_more() {
        let backend = Backend::postgres().await;
        let (a, b) = (backend.open(&clock()).await, backend.open(&clock()).await);
        let la = a.try_acquire_leadership("coord-a", A, LONG).await.unwrap().unwrap();
        a.resign_leadership(&la).await.unwrap();
        let lb = b.try_acquire_leadership("coord-b", B, LONG).await.unwrap().expect("no TTL to wait out");
        assert_eq!(lb.token, la.token + 1);
        let err = a.open_converge("shop", "ana").await.unwrap_err();
        assert!(matches!(err, StateError::NotLeader { active: Some(ref active) } if active == B), "{err:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn standbys_racing_for_a_free_lease_exactly_one_wins() {
        let backend = Backend::postgres().await;
        let mut asks = Vec::new();
        for i in 0..4 {
            let store = backend.open(&clock()).await;
            asks.push(tokio::spawn(async move {
                store.try_acquire_leadership(&format!("coord-{i}"), &format!("10.0.0.{i}:7070"), LONG).await.unwrap()
            }));
        }
        let mut granted = Vec::new();
        for ask in asks {
            granted.extend(ask.await.unwrap());
        }
        assert_eq!(granted.len(), 1, "{granted:?}");
        assert_eq!(granted[0].token, 1);
    }

    /// A write in flight holds the lease row as every fenced write does. The leader's renewal must
    /// pass it (a busy farm always has one: with `FOR SHARE` the renewal waited until the lease
    /// ran out), while a takeover must wait for it (or the write would land after the takeover).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_in_flight_never_holds_up_the_renewal_and_always_holds_up_a_takeover() {
        let backend = Backend::postgres().await;
        let Backend::Postgres { db } = &backend else { unreachable!() };
        let (a, b) = (backend.open(&clock()).await, backend.open(&clock()).await);
        let held = a.try_acquire_leadership("coord-a", A, Duration::from_secs(2)).await.unwrap().expect("A leads");
        let mut writer = raw_postgres(db).await;
        let in_flight = writer.transaction().await.unwrap();
        in_flight.batch_execute("SELECT token FROM leader_lease FOR KEY SHARE").await.unwrap();

        let renewed = tokio::time::timeout(PATIENCE, a.renew_leadership(&held, Duration::from_secs(2))).await;
        assert!(renewed.expect("the renewal waited on the write in flight").is_ok());

        // Once A's lease lapses, B's takeover waits until the write in flight ends.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let takeover = tokio::spawn(async move { b.try_acquire_leadership("coord-b", B, LONG).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!takeover.is_finished(), "the takeover went ahead of a write in flight under the old token");
        in_flight.commit().await.unwrap();
        let taken = tokio::time::timeout(PATIENCE, takeover).await.expect("the takeover ended").unwrap();
        assert_eq!(taken.map(|l| l.token), Some(held.token + 1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_standby_takes_over_a_resigned_lease_and_a_leader_learns_it_was_superseded() {
        let backend = Backend::postgres().await;
        let (a, b) = (backend.open(&clock()).await, backend.open(&clock()).await);
        let policy =
            LeasePolicy { ttl: LONG, renew_every: Duration::from_millis(20), poll_every: Duration::from_millis(20) };
        let (a_says, _) = watch::channel(Activity::Standby { active: None });
        let held_a = lead(a, "coord-a", A, policy, &a_says).await.unwrap();
        let (b_says, mut b_heard) = watch::channel(Activity::Standby { active: None });
        let standby = tokio::spawn(async move { lead(b, "coord-b", B, policy, &b_says).await.unwrap() });
        // While it waits, B names where the leader serves, so callers reaching B are sent to A.
        let named = tokio::time::timeout(PATIENCE, b_heard.wait_for(|a| *a != Activity::Standby { active: None }))
            .await
            .expect("B named the leader")
            .unwrap()
            .clone();
        assert_eq!(named, Activity::Standby { active: Some(A.to_string()) });
        let token_a = held_a.leadership().token;
        held_a.resign().await.unwrap();
        let held_b = tokio::time::timeout(PATIENCE, standby).await.expect("B took over").unwrap();
        assert_eq!(held_b.leadership().token, token_a + 1);

        // A third coordinator takes the lease from under B (as if B's renewals had stalled past it).
        backend
            .execute(
                "UPDATE leader_lease SET token = token + 1, holder = 'coord-c', addr = '10.0.0.3:7070', \
                 expires_at = clock_timestamp() + interval '1 minute'",
            )
            .await;
        let lost = tokio::time::timeout(PATIENCE, held_b.lost()).await.expect("B noticed");
        assert_eq!(lost, Lost::Superseded { current: token_a + 2, active: Some("10.0.0.3:7070".into()) });
    }

    /// `serve` on a farm's database (`kiln-coordinator --state postgres://…`): the second
    /// coordinator stands by while the first serves, and leads once the first stops cleanly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_served_coordinator_stands_by_until_the_first_stops() {
        let backend = Backend::postgres().await;
        let Backend::Postgres { db } = &backend else { unreachable!() };
        let observer = backend.open(&clock()).await;
        let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let start = |dir: &TempDir| {
            let mut config = kiln_coordinator::Config::new(dir.path(), "farm-pg");
            config.database = Some(db.url.clone());
            config.lease = LeasePolicy {
                ttl: LONG,
                renew_every: Duration::from_millis(50),
                poll_every: Duration::from_millis(20),
            };
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            // What the lease names is the URL clients reach it by (no --advertise: scheme and address).
            let addr = format!("http://{}", listener.local_addr().unwrap());
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let served = tokio::spawn(kiln_coordinator::serve(listener, config, async move {
                let _ = stopped.await;
            }));
            (addr, stop, served)
        };
        let leader_is = async |addr: &str| {
            let deadline = Instant::now() + PATIENCE;
            while observer.current_leader().await.unwrap().map(|l| l.addr).as_deref() != Some(addr) {
                assert!(Instant::now() < deadline, "{addr} never led");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };

        let (addr_a, stop_a, served_a) = start(&dirs.0);
        leader_is(&addr_a).await;
        let (addr_b, stop_b, served_b) = start(&dirs.1);
        assert!(!served_b.is_finished(), "B stands by rather than failing");
        stop_a.send(()).unwrap();
        served_a.await.unwrap().expect("A stops cleanly, resigning its lease");
        leader_is(&addr_b).await;
        stop_b.send(()).unwrap();
        served_b.await.unwrap().expect("B stops cleanly");
        assert_eq!(observer.current_leader().await.unwrap(), None, "B resigned too");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn coordinators_starting_together_on_a_fresh_database_migrate_it_once() {
        let backend = Backend::postgres().await;
        let Backend::Postgres { db } = &backend else { unreachable!() };
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let url = db.url.clone();
                tokio::spawn(async move { PostgresStore::connect(&url).await.unwrap().migrations_applied().to_vec() })
            })
            .collect();
        let mut applied = Vec::new();
        for open in opens {
            applied.extend(open.await.unwrap());
        }
        applied.sort_unstable();
        assert_eq!(applied, (1..=POSTGRES_SCHEMA_VERSION).collect::<Vec<_>>(), "each migration applied once");
    }

    #[tokio::test]
    async fn an_unreachable_database_is_named_without_its_password() {
        // Port 1 on loopback: nothing listens there.
        let err = PostgresStore::connect("postgres://kiln:s3cret@127.0.0.1:1/farm").await.unwrap_err();
        assert!(matches!(err, StateError::Unreachable { .. }), "{err:?}");
        let chain = kiln_core::error_chain(&err);
        assert!(chain.contains("postgres://kiln@127.0.0.1:1/farm") && !chain.contains("s3cret"), "{chain}");
    }

    #[tokio::test]
    async fn a_malformed_url_is_refused_without_echoing_it() {
        let err = PostgresStore::connect("postgres://kiln:s3cret@127.0.0.1:notaport/farm").await.unwrap_err();
        assert!(matches!(err, StateError::DatabaseUrl { .. }), "{err:?}");
        let chain = kiln_core::error_chain(&err);
        assert!(!chain.contains("s3cret") && chain.contains("--state"), "{chain}");
    }

    /// The settled converge (a developer's no-op `kiln up`) has connections of its own: with every
    /// connection of the store's pool held by a write waiting on a lock, it is still stored, where
    /// it would otherwise wait for one until the pool's timeout and fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_settled_converge_is_stored_while_every_other_connection_waits() {
        let backend = Backend::postgres().await;
        let Backend::Postgres { db } = &backend else { unreachable!() };
        let store = backend.open(&clock()).await;
        let first = store.write_record("shop", None, vec![built("api", "shop-api:1")]).await.unwrap();
        let holder = raw_postgres(db).await;
        holder.batch_execute("BEGIN; LOCK TABLE pins IN ACCESS EXCLUSIVE MODE").await.unwrap();
        let pins: Vec<_> = (0..24)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move { store.pin(&format!("reg/held:{i}"), "ana").await })
            })
            .collect();
        // The pool's sixteen connections each wait on the lock, in their transactions.
        let waiting = "SELECT count(*) FROM pg_stat_activity \
                       WHERE wait_event_type = 'Lock' AND datname = current_database()";
        let deadline = Instant::now() + PATIENCE;
        while backend.count(waiting).await < 16 {
            assert!(Instant::now() < deadline, "the pins never all waited on the lock");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(backend.count(waiting).await, 16, "the pool has sixteen connections");

        let id = ConvergeId::generate(T0);
        let said = vec![
            (EventKind::Started, None, String::new()),
            (EventKind::Finished { succeeded: true, generation: first.0 }, None, "unchanged".to_owned()),
        ];
        let settled = store.settle_converge(&id, "shop", "ana", first, said).await;
        let (converge, events) = settled.expect("stored while the pool waits").expect("the record did not move");
        assert_eq!((converge.state, events.len()), (ConvergeState::Succeeded, 2));

        holder.batch_execute("COMMIT").await.unwrap();
        for pin in pins {
            assert!(pin.await.unwrap().unwrap(), "each pin lands once the lock is gone");
        }
        assert_eq!(store.pins().await.unwrap().len(), 24);
        assert_eq!(store.converge(&id).await.unwrap().map(|c| c.state), Some(ConvergeState::Succeeded));
    }
}

/// Per-call latency of the hot store calls on both backends: medians and 90th percentiles over
/// 1,000 calls each, PostgreSQL with its default, durable settings (fsync on) on loopback and again
/// with fsync off, the handle leading (so every write is fenced). A measurement, not a test; run it with
/// `cargo test --release -p kiln-coordinator --test store -- --ignored --nocapture latency`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run it explicitly"]
async fn latency_of_key_calls() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn StateStore> = Arc::new(SqliteStore::open(dir.path().join("kiln.db")).unwrap());
    let cluster = Postgres::start_durable();
    let db = cluster.create_database().await;
    let postgres: Arc<dyn StateStore> = Arc::new(PostgresStore::connect(&db.url).await.unwrap());
    // The same on the test cluster (fsync off): what the round trips and the locks cost alone.
    let db = Postgres::shared().create_database().await;
    let unsynced: Arc<dyn StateStore> = Arc::new(PostgresStore::connect(&db.url).await.unwrap());
    for (name, store) in [("sqlite", sqlite), ("postgres", postgres), ("postgres, fsync off", unsynced)] {
        store.try_acquire_leadership("bench", "127.0.0.1:0", Duration::from_secs(600)).await.unwrap().unwrap();
        const N: usize = 1000;
        let images: Vec<RecordedImage> =
            (0..4).map(|i| built(&format!("img{i}"), &format!("shop-img{i}:4a77b1c2d3e4-amd64"))).collect();
        let mut generation = None;
        let write = time(N, async || {
            generation = Some(store.write_record("shop", generation, images.clone()).await.unwrap());
        })
        .await;
        let read = time(N, async || drop(store.record("shop").await.unwrap())).await;
        let mut i = 0;
        let open = time(N, async || {
            i += 1;
            drop(store.open_converge(&format!("instance-{i}"), "bench").await.unwrap());
        })
        .await;
        let converge = store.open_converge("events", "bench").await.unwrap();
        let append = time(N, async || {
            drop(store.append_event(&converge.id, EventKind::BuildLog, Some("api"), "a line").await.unwrap())
        })
        .await;
        println!("{name:20} record {read}  write_record {write}  open_converge {open}  append_event {append}");
    }
}

/// Runs `call` `n` times and reports "p50 µs / p90 µs".
async fn time(n: usize, mut call: impl AsyncFnMut()) -> String {
    let mut micros = Vec::with_capacity(n);
    for _ in 0..n {
        let start = std::time::Instant::now();
        call().await;
        micros.push(start.elapsed().as_micros() as u64);
    }
    micros.sort_unstable();
    format!("{} / {} µs", micros[n / 2], micros[n * 9 / 10])
}
