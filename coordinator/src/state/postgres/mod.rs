//! [`PostgresStore`]: a farm's state in one PostgreSQL database that several coordinators share
//! (DESIGN.md "High availability"). Built on `tokio-postgres` with a `deadpool-postgres` pool: the
//! driver is async and pipelines, so no blocking pool is needed (SQLite's store needs one), and
//! deadpool keeps each connection's prepared statements, so a call costs its statements' round
//! trips and no re-parsing. (`sqlx` was the other candidate; its compile-time-checked queries need
//! a database at build time or a committed query cache, and its migrator keeps its own table — the
//! SQLite store's migration rules, below, are easier kept by hand.)
//!
//! What the database enforces, whichever coordinator asks:
//! - **Records** are a compare-and-set under the instance's row lock (`instance_generations ...
//!   FOR UPDATE`): two writers from one generation serialize, and the second sees the first's.
//! - **One running converge per instance** is the partial unique index `converges_one_running`;
//!   an open that loses the race is told which converge won.
//! - **Claims** lock their converge's row `FOR SHARE`, so a converge cannot finish between the
//!   check that it runs and the claim's insert, and claims of one converge never interleave with
//!   its finish.
//! - **Fencing**: every write transaction starts by locking the `leader_lease` row `FOR KEY SHARE`
//!   and comparing its token with the one this handle acquired ([`lease::fence`]). A takeover locks
//!   that row `FOR UPDATE`, so it waits for every write in flight under the old token, and every write after it
//!   reads the new token and is refused. Advisory locks were the alternative and fence nothing: one
//!   is held by one session, not by the pool's other connections; it vanishes with its connection
//!   while the process still believes it leads; it carries no number a write can be checked against;
//!   and a partitioned session keeps it for as long as TCP takes to notice, not for a TTL.
//!
//! Time: stamps (`written_at_ms`, `started_ms`, events' `at_ms`) come from the injected [`Clock`],
//! as on SQLite; the lease's expiry is the database's clock (`clock_timestamp()`), the one clock
//! every coordinator reads alike.
//!
//! Contexts' bytes are not rows: only the context index is here, and the archives stay files in a
//! content-addressed directory (`--data-dir`), which a farm puts on storage every coordinator
//! mounts (NFS, a ReadWriteMany volume) so they survive the loss of one coordinator's disk. They
//! are immutable and named by their digest, so coordinators sharing the directory need no locks
//! (a temp file renamed into place; two writers of one digest write the same bytes). In the
//! database they would cost more than they give: `bytea` values are read and written whole
//! (a 500 MB context held in memory twice), large objects stream but live outside the tables'
//! lifecycle (unlinked by hand, vacuumed apart), and either way every uploaded byte would be
//! written again to the WAL and to every replica — uploads are the converge's hot path. A
//! coordinator that lacks a file the index names asks for it again (`Contexts::missing` checks
//! the file too), so an unshared directory costs re-uploads after a takeover, never a wrong build.

mod catalog;
mod claims;
mod converges;
mod lease;
mod migrations;
mod records;
mod trust;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};

use crate::model::{
    AgentRow, AuditRow, Claim, ContextRow, Converge, ConvergeId, ConvergeState, Event, EventKind, Generation,
    Inventory, JoinRow, Owner, Pin, Record, RecordedImage, TokenRow,
};
use crate::state::record_cache::{Lookup, RecordCache};
use crate::state::{Clock, Leadership, StateError, StateStore, SystemClock};

pub use migrations::SCHEMA_VERSION;

/// Connections per coordinator: a converge holds one only for a statement or a short transaction.
const POOL_SIZE: usize = 16;
/// Connections for the lease alone: a standby's poll and an active one's renewal.
const LEASE_POOL_SIZE: usize = 2;
/// Connections for the settled converge alone (`settle_converge`).
const SETTLE_POOL_SIZE: usize = 2;
/// How long a call waits for a connection (to be made, or freed by another call).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The coordinator's state in a PostgreSQL database.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    /// The lease's own connections: a renewal never queues behind a busy farm's converges for a
    /// connection of `pool` — under load that wait outlasted the lease and stopped the coordinator.
    lease_pool: Pool,
    /// The settled converge's own connections: a developer's no-op `kiln up` waits on its one
    /// write, and under a farm's load a connection of `pool` is free only after a queue of
    /// builds' writes (which a client does not wait on the same way) has had its turn.
    settle_pool: Pool,
    clock: Arc<dyn Clock>,
    /// The URL without its password, for errors.
    database: String,
    applied: Vec<u32>,
    /// The lease this handle acquired: its token goes into every write.
    leadership: Mutex<Option<Leadership>>,
    /// What [`StateStore::settled_record`] answers from: each record as this handle last read or
    /// wrote it. Nothing else reads it — a coordinator paused past its lease must not answer a
    /// client from what it read before — and the settled converge's write compares the generation
    /// it was decided on, in its fenced transaction, so a stale entry costs a fallback, never a
    /// wrong answer (and the mismatch forgets the entry).
    records: RecordCache,
}

/// A fenced write: runs the future `$op` (its statements on the connection `$c`) in a transaction
/// that commits only if this handle's lease token is still the farm's current one (or the farm has
/// never had a leader and this handle claims none).
///
/// `BEGIN`, the lease check and the op's first statement are sent to the database together, so a
/// write of one statement costs two round trips (that, and `COMMIT`) where it cost four. Under a
/// farm's load each round trip waits for a busy coordinator to be scheduled again; the pool's
/// connections were held mostly idle in transaction, waiting on this side. The order the three
/// run in is safe whatever it is: the check holds the lease row `FOR KEY SHARE` until the commit,
/// and a takeover waits for that lock, so a write that saw the current token commits before any
/// takeover, and one that saw an old token rolls back whatever it had done.
macro_rules! fenced {
    // On a connection of the settled converge's own pool.
    (settled: $store:expr, $what:expr, |$c:ident| $op:expr) => {
        fenced!(@from settle_client, $store, $what, |$c| $op)
    };
    // The transaction, on a connection `$store.$get` gives.
    (@from $get:ident, $store:expr, $what:expr, |$c:ident| $op:expr) => {{
        let what: &str = $what;
        let held = $store.held();
        let open = Open::new($store.$get(what).await?);
        let $c = open.client();
        // `futures_util::join!` polls in the order written: `BEGIN` goes out first.
        let (begun, fence, value) =
            futures_util::join!($c.batch_execute("BEGIN"), lease::fence($c, held.as_ref(), what), $op);
        open.finish(what, begun.ctx(what).and(fence).and(value)).await
    }};
    ($store:expr, $what:expr, |$c:ident| $op:expr) => {
        fenced!(@from client, $store, $what, |$c| $op)
    };
}

/// A connection in a transaction begun by hand. Dropped before it ended (a caller gone mid-write),
/// the connection leaves the pool rather than hand an open transaction to the next caller.
struct Open {
    client: Option<Object>,
}

impl Open {
    fn new(client: Object) -> Open {
        Open { client: Some(client) }
    }

    fn client(&self) -> &Object {
        self.client.as_ref().expect("an open transaction has its connection until it ends")
    }

    /// Commits when `outcome` is a success, rolls back otherwise; the connection goes back to the
    /// pool either way once the transaction has ended.
    async fn finish<T>(mut self, what: &str, outcome: Result<T, StateError>) -> Result<T, StateError> {
        let client = self.client();
        let ended = match &outcome {
            Ok(_) => client.batch_execute("COMMIT").await.ctx(what),
            Err(_) => client.batch_execute("ROLLBACK").await.ctx(what),
        };
        if ended.is_ok() {
            // Ended: the connection is clean and goes back to the pool.
            drop(self.client.take());
        }
        ended?;
        outcome
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // Still in a transaction: closed, never reused.
            drop(Object::take(client));
        }
    }
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/database`, or
    /// libpq's `key=value` form) and migrates it to [`SCHEMA_VERSION`], stamping with the system
    /// clock.
    pub async fn connect(url: &str) -> Result<PostgresStore, StateError> {
        PostgresStore::connect_with_clock(url, Arc::new(SystemClock)).await
    }

    /// [`PostgresStore::connect`] with the clock that stamps records, converges and events.
    pub async fn connect_with_clock(url: &str, clock: Arc<dyn Clock>) -> Result<PostgresStore, StateError> {
        let mut config: tokio_postgres::Config =
            url.parse().map_err(|err| StateError::DatabaseUrl { err: Box::new(err) })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("kiln-coordinator");
        }
        let database = describe(&config);
        let pool = pool_of(&config, POOL_SIZE, &database)?;
        let lease_pool = pool_of(&config, LEASE_POOL_SIZE, &database)?;
        let settle_pool = pool_of(&config, SETTLE_POOL_SIZE, &database)?;
        let mut client = get(&pool, &database, "opening the store").await?;
        let applied = migrations::migrate(&mut client, &database, clock.now_ms()).await?;
        drop(client);
        let leadership = Mutex::new(None);
        let records = RecordCache::default();
        records.enable();
        Ok(PostgresStore {
            inner: Arc::new(Inner { pool, lease_pool, settle_pool, clock, database, applied, leadership, records }),
        })
    }

    /// The database, as its URL without the password.
    pub fn database(&self) -> &str {
        &self.inner.database
    }

    /// The schema versions this connect applied; empty when the database was already current.
    pub fn migrations_applied(&self) -> &[u32] {
        &self.inner.applied
    }

    fn now_ms(&self) -> u64 {
        self.inner.clock.now_ms()
    }

    async fn client(&self, what: &str) -> Result<Object, StateError> {
        get(&self.inner.pool, &self.inner.database, what).await
    }

    async fn settle_client(&self, what: &str) -> Result<Object, StateError> {
        get(&self.inner.settle_pool, &self.inner.database, what).await
    }

    async fn lease_client(&self, what: &str) -> Result<Object, StateError> {
        get(&self.inner.lease_pool, &self.inner.database, what).await
    }

    /// The settled converge's transaction with its statements one after another: for when another
    /// converge of the instance ran as the pipelined one tried to open.
    async fn settle_in_turn(
        &self,
        id: &ConvergeId,
        instance: &str,
        requested_by: &str,
        generation: Generation,
        events: Vec<(EventKind, Option<String>, String)>,
        what: &str,
    ) -> Result<Option<(Converge, Vec<Event>)>, StateError> {
        let now = self.now_ms();
        let settled = fenced!(settled: self, what, |tx| async {
            let converge = converges::open(tx, now, Some(id), instance, requested_by, what).await?;
            let actual = records::current(tx, instance, what).await?;
            if actual != Some(generation) {
                return Err(StateError::RecordMoved {
                    instance: instance.to_owned(),
                    expected: Some(generation),
                    actual,
                });
            }
            let events = converges::append_events(tx, now, &converge.id, events, what).await?;
            converges::finish(tx, now, &converge.id, &ConvergeState::Succeeded, what).await?;
            Ok((Converge { state: ConvergeState::Succeeded, finished_ms: Some(now), ..converge }, events))
        });
        match settled {
            Ok(settled) => Ok(Some(settled)),
            Err(StateError::RecordMoved { .. }) => {
                self.inner.records.forget(instance);
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }

    fn held(&self) -> Option<Leadership> {
        self.inner.leadership.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn set_held(&self, leadership: Option<Leadership>) {
        *self.inner.leadership.lock().unwrap_or_else(PoisonError::into_inner) = leadership;
    }
}

/// A pool of at most `size` connections to the database `config` names.
fn pool_of(config: &tokio_postgres::Config, size: usize, database: &str) -> Result<Pool, StateError> {
    // `Fast` recycling trusts a connection the driver has not seen close: a dead one fails its
    // next statement, which the caller sees as a backend error, instead of every call paying a
    // round trip to check.
    let manager =
        Manager::from_config(config.clone(), NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(CONNECT_TIMEOUT))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .build()
        .map_err(|err| StateError::Unreachable {
            database: database.to_owned(),
            what: "opening the store".into(),
            err: Box::new(err),
        })
}

async fn get(pool: &Pool, database: &str, what: &str) -> Result<Object, StateError> {
    pool.get().await.map_err(|err| StateError::Unreachable {
        database: database.to_owned(),
        what: what.to_owned(),
        err: Box::new(err),
    })
}

/// `postgres://user@host:port/database`: the URL without its password.
fn describe(config: &tokio_postgres::Config) -> String {
    let user = config.get_user().unwrap_or("");
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                tokio_postgres::config::Host::Unix(dir) => format!("{}:{port}", dir.display()),
            }
        })
        .collect();
    let dbname = config.get_dbname().unwrap_or(user);
    format!("postgres://{user}@{}/{dbname}", hosts.join(","))
}

/// Forgets the instance's kept record when dropped: after a write of it ended, or was abandoned
/// by its caller mid-way (it may have committed).
struct Forget<'a>(&'a PostgresStore, &'a str);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0.inner.records.forget(self.1);
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore").field("database", &self.inner.database).finish_non_exhaustive()
    }
}

/// Names a PostgreSQL failure by what the call was doing.
trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, StateError>;
}

impl<T> Ctx<T> for Result<T, tokio_postgres::Error> {
    fn ctx(self, what: &str) -> Result<T, StateError> {
        self.map_err(|err| StateError::Backend { what: what.to_owned(), err: Box::new(err) })
    }
}

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

// Every statement goes through the connection's statement cache: parsed once per connection.
async fn query<C: GenericClient>(c: &C, sql: &str, params: Params<'_>) -> Result<Vec<Row>, tokio_postgres::Error> {
    let statement = c.prepare_cached(sql).await?;
    c.query(&statement, params).await
}

async fn query_opt<C: GenericClient>(
    c: &C,
    sql: &str,
    params: Params<'_>,
) -> Result<Option<Row>, tokio_postgres::Error> {
    let statement = c.prepare_cached(sql).await?;
    c.query_opt(&statement, params).await
}

async fn query_one<C: GenericClient>(c: &C, sql: &str, params: Params<'_>) -> Result<Row, tokio_postgres::Error> {
    let statement = c.prepare_cached(sql).await?;
    c.query_one(&statement, params).await
}

async fn execute<C: GenericClient>(c: &C, sql: &str, params: Params<'_>) -> Result<u64, tokio_postgres::Error> {
    let statement = c.prepare_cached(sql).await?;
    c.execute(&statement, params).await
}

/// Milliseconds and counters are `BIGINT`: a value past `i64::MAX` (a lease "forever") saturates.
fn int(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A `BIGINT` this store wrote from a `u64`, back.
fn uint(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// Decodes a JSON column (read as text), naming the row when it does not parse.
fn from_json<T: serde::de::DeserializeOwned>(json: &str, row: impl FnOnce() -> String) -> Result<T, StateError> {
    serde_json::from_str(json).map_err(|err| StateError::Corrupt { what: row(), err: Box::new(err) })
}

fn to_json<T: serde::Serialize>(value: &T, what: &str) -> Result<String, StateError> {
    serde_json::to_string(value).map_err(|err| StateError::Backend { what: what.to_owned(), err: Box::new(err) })
}

#[async_trait]
impl StateStore for PostgresStore {
    async fn upsert_agent(&self, agent: AgentRow) -> Result<(), StateError> {
        let what = format!("saving agent {}", agent.id);
        fenced!(self, &what, |tx| catalog::upsert_agent(tx, &agent, &what))
    }

    async fn agents(&self) -> Result<Vec<AgentRow>, StateError> {
        let what = "listing agents";
        catalog::agents(&self.client(what).await?, what).await
    }

    async fn record(&self, instance: &str) -> Result<Option<Record>, StateError> {
        let what = format!("reading the record of instance {instance}");
        records::nth(&self.client(&what).await?, instance, 0, &what).await
    }

    async fn settled_record(&self, instance: &str) -> Result<Option<Record>, StateError> {
        let version = match self.inner.records.lookup(instance) {
            Lookup::Hit(record) => return Ok(record),
            Lookup::Miss(version) => version,
        };
        let record = self.record(instance).await?;
        self.inner.records.fill(instance, version, &record);
        Ok(record)
    }

    async fn previous_record(&self, instance: &str) -> Result<Option<Record>, StateError> {
        let what = format!("reading the previous record of instance {instance}");
        records::nth(&self.client(&what).await?, instance, 1, &what).await
    }

    async fn records(&self) -> Result<Vec<(Record, Option<Record>)>, StateError> {
        let what = "listing records";
        records::all(&self.client(what).await?, what).await
    }

    async fn write_record(
        &self,
        instance: &str,
        expected: Option<Generation>,
        images: Vec<RecordedImage>,
    ) -> Result<Generation, StateError> {
        let what = format!("writing the record of instance {instance}");
        let images = to_json(&images, &what)?;
        let _forget = Forget(self, instance);
        fenced!(self, &what, |tx| records::write(tx, self.now_ms(), instance, expected, &images, &what))
    }

    async fn delete_record(&self, instance: &str) -> Result<bool, StateError> {
        let what = format!("deleting the record of instance {instance}");
        let _forget = Forget(self, instance);
        fenced!(self, &what, |tx| records::delete(tx, instance, &what))
    }

    async fn open_converge(&self, instance: &str, requested_by: &str) -> Result<Converge, StateError> {
        let what = format!("opening a converge of instance {instance}");
        fenced!(self, &what, |tx| converges::open(tx, self.now_ms(), None, instance, requested_by, &what))
    }

    async fn open_converge_with(
        &self,
        instance: &str,
        requested_by: &str,
        first: (EventKind, Option<String>, String),
    ) -> Result<(Converge, Event), StateError> {
        let what = format!("opening a converge of instance {instance}");
        let now = self.now_ms();
        fenced!(self, &what, |tx| async {
            let converge = converges::open(tx, now, None, instance, requested_by, &what).await?;
            let mut events = converges::append_events(tx, now, &converge.id, vec![first], &what).await?;
            Ok((converge, events.remove(0)))
        })
    }

    async fn append_event(
        &self,
        converge: &ConvergeId,
        kind: EventKind,
        image: Option<&str>,
        message: &str,
    ) -> Result<Event, StateError> {
        let what = format!("appending an event to converge {converge}");
        fenced!(self, &what, |tx| converges::append_event(tx, self.now_ms(), converge, kind, image, message, &what))
    }

    async fn append_events(
        &self,
        converge: &ConvergeId,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Vec<Event>, StateError> {
        let what = format!("appending events to converge {converge}");
        fenced!(self, &what, |tx| converges::append_events(tx, self.now_ms(), converge, events, &what))
    }

    async fn events(&self, converge: &ConvergeId, after_seq: Option<u64>) -> Result<Vec<Event>, StateError> {
        let what = format!("reading the events of converge {converge}");
        converges::events(&self.client(&what).await?, converge, after_seq, &what).await
    }

    async fn finish_converge(&self, converge: &ConvergeId, state: ConvergeState) -> Result<(), StateError> {
        let what = format!("finishing converge {converge}");
        if state == ConvergeState::Running {
            return Err(StateError::FinishAsRunning { id: converge.clone() });
        }
        fenced!(self, &what, |tx| converges::finish(tx, self.now_ms(), converge, &state, &what))
    }

    async fn finish_with_events(
        &self,
        converge: &ConvergeId,
        state: ConvergeState,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<(Vec<Event>, Option<StateError>), StateError> {
        let what = format!("finishing converge {converge} with {} events", events.len());
        let now = self.now_ms();
        fenced!(self, &what, |tx| async {
            // A refusal to mark is decided before any statement or by a row read, never by a
            // failed statement: the transaction goes on.
            let finished = converges::finish(tx, now, converge, &state, &what).await;
            let finished = match finished {
                Err(
                    err @ (StateError::FinishAsRunning { .. }
                    | StateError::UnknownConverge { .. }
                    | StateError::ConvergeFinished { .. }),
                ) => Some(err),
                Err(err) => return Err(err),
                Ok(()) => None,
            };
            Ok((converges::append_events(tx, now, converge, events, &what).await?, finished))
        })
    }

    async fn settle_converge(
        &self,
        id: &ConvergeId,
        instance: &str,
        requested_by: &str,
        generation: Generation,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Option<(Converge, Vec<Event>)>, StateError> {
        let what = format!("storing the settled converge {id} of instance {instance}");
        let now = self.now_ms();
        // Every statement at once (`converges::settle`). The open goes first: from then on no
        // other converge of the instance can record, and any that recorded before committed
        // ahead of the open, so the generation read after it sees theirs. A moved record fails
        // the transaction, which rolls the open back.
        let contended = AtomicBool::new(false);
        let replay = events.clone();
        let settled = fenced!(settled: self, &what, |tx| async {
            let (opened, actual, events) = converges::settle(tx, now, id, instance, requested_by, events, &what).await;
            if !opened? {
                contended.store(true, Ordering::Relaxed);
                return Err(StateError::ConvergeRunning { instance: instance.to_owned(), running: id.clone() });
            }
            let actual = actual?;
            if actual != Some(generation) {
                return Err(StateError::RecordMoved {
                    instance: instance.to_owned(),
                    expected: Some(generation),
                    actual,
                });
            }
            let started = Converge {
                id: id.clone(),
                instance: instance.to_owned(),
                state: ConvergeState::Succeeded,
                started_ms: now,
                finished_ms: Some(now),
                requested_by: requested_by.to_owned(),
            };
            Ok((started, events?))
        });
        match settled {
            Ok(settled) => Ok(Some(settled)),
            Err(StateError::RecordMoved { .. }) => {
                self.inner.records.forget(instance);
                Ok(None)
            }
            // Another converge of the instance ran when the open was tried: once more with the
            // statements one after another, where the open names the converge that runs (or
            // retries if it has just finished).
            Err(StateError::ConvergeRunning { .. }) if contended.load(Ordering::Relaxed) => {
                self.settle_in_turn(id, instance, requested_by, generation, replay, &what).await
            }
            Err(err) => Err(err),
        }
    }

    async fn converge(&self, converge: &ConvergeId) -> Result<Option<Converge>, StateError> {
        let what = format!("reading converge {converge}");
        converges::get(&self.client(&what).await?, converge, &what).await
    }

    async fn converges(&self, instance: Option<&str>, limit: usize) -> Result<Vec<Converge>, StateError> {
        let what = match instance {
            Some(instance) => format!("listing the converges of instance {instance}"),
            None => "listing converges".to_owned(),
        };
        converges::list(&self.client(&what).await?, instance, limit, &what).await
    }

    async fn builder_of(&self, reference: &str) -> Result<Option<ConvergeId>, StateError> {
        let what = format!("looking up the converge that built {reference}");
        converges::builder_of(&self.client(&what).await?, reference, &what).await
    }

    async fn fail_in_flight(&self, reason: &str) -> Result<Vec<ConvergeId>, StateError> {
        let what = "failing converges left running";
        fenced!(self, what, |tx| converges::fail_in_flight(tx, self.now_ms(), reason, what))
    }

    async fn claim(&self, converge: &ConvergeId, refs: &[String], expires_ms: u64) -> Result<(), StateError> {
        let what = format!("claiming refs for converge {converge}");
        fenced!(self, &what, |tx| claims::claim(tx, converge, refs, expires_ms, &what))
    }

    async fn renew_claims(&self, converge: &ConvergeId, expires_ms: u64) -> Result<usize, StateError> {
        let what = format!("renewing the claims of converge {converge}");
        fenced!(self, &what, |tx| claims::renew(tx, converge, expires_ms, &what))
    }

    async fn release_claims(&self, converge: &ConvergeId) -> Result<(), StateError> {
        let what = format!("releasing the claims of converge {converge}");
        fenced!(self, &what, |tx| claims::release(tx, converge, &what))
    }

    async fn live_claims(&self, now_ms: u64) -> Result<Vec<Claim>, StateError> {
        let what = "listing live claims";
        fenced!(self, what, |tx| claims::live(tx, now_ms, what))
    }

    async fn pin(&self, reference: &str, pinned_by: &str) -> Result<bool, StateError> {
        let what = format!("pinning {reference}");
        fenced!(self, &what, |tx| catalog::pin(tx, self.now_ms(), reference, pinned_by, &what))
    }

    async fn unpin(&self, reference: &str) -> Result<bool, StateError> {
        let what = format!("unpinning {reference}");
        fenced!(self, &what, |tx| catalog::unpin(tx, reference, &what))
    }

    async fn put_token(&self, token: TokenRow) -> Result<(), StateError> {
        let what = format!("saving token {}", token.id);
        fenced!(self, &what, |tx| trust::put_token(tx, &token, &what))
    }

    async fn token(&self, id: &str) -> Result<Option<TokenRow>, StateError> {
        let what = format!("reading token {id}");
        trust::token(&self.client(&what).await?, id, &what).await
    }

    async fn tokens(&self) -> Result<Vec<TokenRow>, StateError> {
        let what = "listing tokens";
        trust::tokens(&self.client(what).await?, what).await
    }

    async fn revoke_token(&self, id: &str, now_ms: u64) -> Result<bool, StateError> {
        let what = format!("revoking token {id}");
        fenced!(self, &what, |tx| trust::revoke_token(tx, id, now_ms, &what))
    }

    async fn put_join(&self, join: JoinRow) -> Result<(), StateError> {
        let what = format!("saving join token {}", join.id);
        fenced!(self, &what, |tx| trust::put_join(tx, &join, &what))
    }

    async fn use_join(&self, id: &str, now_ms: u64) -> Result<Option<JoinRow>, StateError> {
        let what = format!("using join token {id}");
        fenced!(self, &what, |tx| trust::use_join(tx, id, now_ms, &what))
    }

    async fn revoke_agent(&self, id: &str, now_ms: u64) -> Result<bool, StateError> {
        let what = format!("revoking agent {id}");
        fenced!(self, &what, |tx| trust::revoke_agent(tx, id, now_ms, &what))
    }

    async fn revoked_agents(&self) -> Result<Vec<(String, u64)>, StateError> {
        let what = "listing revoked agents";
        trust::revoked_agents(&self.client(what).await?, what).await
    }

    async fn own(&self, instance: &str, claim: Owner) -> Result<Owner, StateError> {
        let what = format!("reading the owner of instance {instance}");
        fenced!(self, &what, |tx| trust::own(tx, instance, &claim, &what))
    }

    async fn owner(&self, instance: &str) -> Result<Option<Owner>, StateError> {
        let what = format!("reading the owner of instance {instance}");
        trust::owner(&self.client(&what).await?, instance, &what).await
    }

    async fn append_audit(&self, entry: AuditRow) -> Result<(), StateError> {
        let what = "writing the audit log";
        fenced!(self, what, |tx| trust::append_audit(tx, &entry, what))
    }

    async fn audit(&self, since_ms: u64, actor: Option<&str>) -> Result<Vec<AuditRow>, StateError> {
        let what = "reading the audit log";
        trust::audit(&self.client(what).await?, since_ms, actor, what).await
    }

    async fn pins(&self) -> Result<Vec<Pin>, StateError> {
        let what = "listing pins";
        catalog::pins(&self.client(what).await?, what).await
    }

    async fn missing_contexts(&self, digests: &[String]) -> Result<Vec<String>, StateError> {
        let what = "looking up contexts";
        catalog::missing_contexts(&self.client(what).await?, digests, what).await
    }

    async fn put_context(&self, context: ContextRow) -> Result<(), StateError> {
        let what = format!("indexing context {}", context.digest);
        fenced!(self, &what, |tx| catalog::put_context(tx, &context, &what))
    }

    async fn context(&self, digest: &str) -> Result<Option<ContextRow>, StateError> {
        let what = format!("looking up context {digest}");
        catalog::context(&self.client(&what).await?, digest, &what).await
    }

    async fn contexts(&self) -> Result<Vec<ContextRow>, StateError> {
        let what = "listing contexts";
        catalog::contexts(&self.client(what).await?, what).await
    }

    async fn delete_context_unless_claimed(&self, digest: &str, claim: &str, now_ms: u64) -> Result<bool, StateError> {
        let what = format!("collecting context {digest}");
        fenced!(self, &what, |tx| catalog::delete_context_unless_claimed(tx, digest, claim, now_ms, &what))
    }

    async fn put_context_entries(&self, digest: &str, stream: Vec<u8>) -> Result<(), StateError> {
        let what = format!("keeping the entry list of context {digest}");
        fenced!(self, &what, |tx| catalog::put_context_entries(tx, digest, &stream, &what))
    }

    async fn context_entries(&self, digest: &str) -> Result<Option<Vec<u8>>, StateError> {
        let what = format!("reading the entry list of context {digest}");
        catalog::context_entries(&self.client(&what).await?, digest, &what).await
    }

    async fn put_inventory(&self, store: &str, listing_json: String, listed_ms: u64) -> Result<(), StateError> {
        let what = format!("saving the inventory of store {store}");
        fenced!(self, &what, |tx| catalog::put_inventory(tx, store, &listing_json, listed_ms, &what))
    }

    async fn inventory(&self, store: &str) -> Result<Option<Inventory>, StateError> {
        let what = format!("reading the inventory of store {store}");
        catalog::inventory(&self.client(&what).await?, store, &what).await
    }

    async fn try_acquire_leadership(
        &self,
        holder: &str,
        addr: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, StateError> {
        let what = format!("taking the farm's lease for {holder}");
        let mut client = self.lease_client(&what).await?;
        let tx = client.transaction().await.ctx(&what)?;
        let acquired = lease::acquire(&tx, holder, addr, ttl, &what).await?;
        tx.commit().await.ctx(&what)?;
        if acquired.is_some() {
            self.set_held(acquired.clone());
        }
        Ok(acquired)
    }

    async fn renew_leadership(&self, leadership: &Leadership, ttl: Duration) -> Result<Leadership, StateError> {
        let what = format!("renewing the farm's lease of {}", leadership.holder);
        lease::renew(&self.lease_client(&what).await?, leadership, ttl, &what).await
    }

    async fn resign_leadership(&self, leadership: &Leadership) -> Result<(), StateError> {
        let what = format!("resigning the farm's lease of {}", leadership.holder);
        lease::resign(&self.lease_client(&what).await?, leadership, &what).await?;
        if self.held().is_some_and(|held| held.token == leadership.token) {
            self.set_held(None);
        }
        Ok(())
    }

    async fn current_leader(&self) -> Result<Option<Leadership>, StateError> {
        let what = "reading the farm's lease";
        lease::current(&self.lease_client(what).await?, what).await
    }
}
