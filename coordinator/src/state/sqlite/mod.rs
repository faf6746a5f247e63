//! [`SqliteStore`]: the embedded default backend, one SQLite file in `$KILN_HOME` shared by every
//! instance the user converges there — and possibly by several `kiln` processes at once. So the file
//! runs in WAL mode (readers never block the writer), waits on a busy lock instead of failing at once,
//! and every read-modify-write is an `IMMEDIATE` transaction: it takes the write lock before reading,
//! so two processes cannot both read generation 3 and both write generation 4.
//!
//! rusqlite is blocking, so one thread owns the writing connection and runs the writes, committing
//! those that queue up together in one transaction (`writer`: group commit — one fsync for many
//! writes). Reads run beside it on connections of their own (`readers`), never waiting for a commit.
//!
//! Leadership is trivially held: one embedded coordinator serves the file (the CLI's home lock sees
//! to that), so every acquisition succeeds with token 1 and nothing is ever fenced. The lease lives
//! in memory only, for [`StateStore::current_leader`] to answer.

mod cached;
mod catalog;
mod claims;
mod converges;
mod migrations;
mod pins;
mod readers;
mod records;
mod trust;
mod writer;

use cached::{Cached, STATEMENT_CACHE};

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{Connection, ErrorCode};

use crate::model::{
    AgentRow, AuditRow, Claim, ContextRow, Converge, ConvergeId, ConvergeState, Event, EventKind, Generation,
    Inventory, JoinRow, Owner, Pin, Record, RecordedImage, TokenRow,
};
use crate::state::{Clock, Leadership, StateError, StateStore, SystemClock};

pub use migrations::SCHEMA_VERSION;

/// How long a call waits for another process's write lock before failing with [`StateError::Busy`].
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The coordinator's state in one SQLite file.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

struct Inner {
    writer: writer::Writer,
    readers: readers::Readers,
    clock: Arc<dyn Clock>,
    path: PathBuf,
    applied: Vec<u32>,
    leader: Mutex<Option<Leadership>>,
    /// False only for `kiln-bench state-writes`' baseline: reads sent through the writer, as before.
    reads_beside: bool,
    /// Current records, once read, when this process is the file's one writer.
    records: super::record_cache::RecordCache,
}

impl SqliteStore {
    /// Opens (creating it and its directory if needed) the database at `path` and migrates it to
    /// [`SCHEMA_VERSION`], stamping with the system clock.
    pub fn open(path: impl AsRef<Path>) -> Result<SqliteStore, StateError> {
        SqliteStore::open_with_clock(path, Arc::new(SystemClock))
    }

    /// [`SqliteStore::open`] with the clock that stamps records, converges and events.
    ///
    /// A second process opening the file while another migrates it (`kiln-coordinator token
    /// create` beside a starting coordinator) can be told "database is locked" without SQLite's
    /// busy handler being asked (switching to WAL, upgrading a read to a write): that is asked
    /// again for as long as the busy timeout, like every other lock wait.
    pub fn open_with_clock(path: impl AsRef<Path>, clock: Arc<dyn Clock>) -> Result<SqliteStore, StateError> {
        SqliteStore::open_grouped(path, clock, writer::GROUP)
    }

    /// A store whose transactions take at most `group` calls — 1 is a transaction per call, the
    /// baseline `kiln-bench state-writes` measures group commit against. Not for production use.
    #[doc(hidden)]
    pub fn open_grouped(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
        group: usize,
    ) -> Result<SqliteStore, StateError> {
        let path = path.as_ref();
        let deadline = std::time::Instant::now() + BUSY_TIMEOUT;
        loop {
            match SqliteStore::open_once(path, clock.clone(), group) {
                Err(err) if std::time::Instant::now() < deadline && is_locked(&err) => {
                    std::thread::sleep(std::time::Duration::from_millis(25));
                }
                opened => return opened,
            }
        }
    }

    /// [`SqliteStore::open_grouped`] with every read sent through the writer, as before reads had
    /// connections of their own: the baseline `kiln-bench state-writes` measures reads against.
    /// Not for production use.
    #[doc(hidden)]
    pub fn open_reading_through_writer(
        path: impl AsRef<Path>,
        clock: Arc<dyn Clock>,
    ) -> Result<SqliteStore, StateError> {
        let mut store = SqliteStore::open_grouped(path, clock, writer::GROUP)?;
        Arc::get_mut(&mut store.inner).expect("a store just opened has one handle").reads_beside = false;
        Ok(store)
    }

    fn open_once(path: &Path, clock: Arc<dyn Clock>, group: usize) -> Result<SqliteStore, StateError> {
        let path = path.to_owned();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|err| StateError::CreateDir { dir: dir.to_owned(), err })?;
        }
        let open_err = |err: rusqlite::Error| StateError::Open { path: path.clone(), err: Box::new(err) };
        let mut conn = Connection::open(&path).map_err(open_err)?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(open_err)?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        // Off by default in SQLite; without it a claim or event could name a converge that is not there.
        conn.pragma_update(None, "foreign_keys", true).map_err(open_err)?;
        let mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "wal", |row| row.get(0)).map_err(open_err)?;
        if !mode.eq_ignore_ascii_case("wal") {
            let err = format!("the file system refused WAL mode (journal mode stays {mode})");
            return Err(StateError::Open { path, err: err.into() });
        }
        let applied = migrations::migrate(&mut conn, &path, clock.now_ms())?;
        let leader = Mutex::new(None);
        let writer = writer::Writer::start(conn, clock.clone(), path.clone(), group)
            .map_err(|err| StateError::Open { path: path.clone(), err: Box::new(err) })?;
        let readers = readers::Readers::new(path.clone(), BUSY_TIMEOUT);
        let records = super::record_cache::RecordCache::default();
        let inner = Inner { writer, readers, clock, path, applied, leader, reads_beside: true, records };
        Ok(SqliteStore { inner: Arc::new(inner) })
    }

    /// Keeps each instance's current record in memory once read (`record_cache`). Only for the
    /// process that is the file's one writer — the serving coordinator — since another process's
    /// write would not be seen.
    pub fn cache_records(&self) {
        self.inner.records.enable();
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// The schema versions this open applied; empty when the database was already current.
    pub fn migrations_applied(&self) -> &[u32] {
        &self.inner.applied
    }

    /// Runs `f` on the writer's thread with the connection and the clock's now, in the next group's
    /// transaction. `what` names the call in errors ("writing the record of instance shop").
    async fn run<T, F>(&self, what: String, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, u64) -> Result<T, StateError> + Send + 'static,
    {
        self.inner.writer.run(what, f).await.map_err(|err| self.name_busy(err))
    }

    /// Runs the read `f` on a reader connection, beside the writer (`readers`): it sees every
    /// write answered before it was asked, and waits for none of the writer's commits.
    async fn read<T, F>(&self, what: String, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StateError> + Send + 'static,
    {
        let read = match self.inner.reads_beside {
            true => self.inner.readers.read(what, f).await,
            false => self.inner.writer.run(what, move |c, _| f(c)).await,
        };
        read.map_err(|err| self.name_busy(err))
    }

    /// Runs the write `f` of `instance`'s record, then forgets the cached record — in a task of
    /// its own, so a caller that stops waiting (a cancelled converge) cannot leave the cache
    /// answering with what the write replaced.
    async fn writing_record<T, F>(&self, instance: &str, what: String, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, u64) -> Result<T, StateError> + Send + 'static,
    {
        // Nothing to forget without the cache: no task for it either.
        if !self.inner.records.enabled() {
            return self.run(what, f).await;
        }
        let (store, instance) = (self.clone(), instance.to_owned());
        let stopped = StateError::Writer { what: format!("{what} (the write's task stopped)") };
        let writing = tokio::spawn(async move {
            let result = store.run(what, f).await;
            store.inner.records.forget(&instance);
            result
        });
        writing.await.unwrap_or(Err(stopped))
    }

    /// A lock held by another process past the busy timeout is the one backend failure a user can
    /// act on, so it is told apart from the rest.
    fn name_busy(&self, err: StateError) -> StateError {
        match err {
            StateError::Backend { what, err } => {
                let busy = matches!(
                    err.downcast_ref::<rusqlite::Error>().and_then(rusqlite::Error::sqlite_error_code),
                    Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
                );
                if busy {
                    StateError::Busy { path: self.inner.path.clone(), what, err }
                } else {
                    StateError::Backend { what, err }
                }
            }
            other => other,
        }
    }
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore").field("path", &self.inner.path).finish_non_exhaustive()
    }
}

/// Names a rusqlite failure by what the call was doing.
trait Ctx<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, StateError>;
}

impl<T> Ctx<T> for rusqlite::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T, StateError> {
        self.map_err(|err| StateError::Backend { what: what(), err: Box::new(err) })
    }
}

/// Decodes a JSON column, naming the row when it does not parse.
fn from_json<T: serde::de::DeserializeOwned>(json: &str, row: impl FnOnce() -> String) -> Result<T, StateError> {
    serde_json::from_str(json).map_err(|err| StateError::Corrupt { what: row(), err: Box::new(err) })
}

fn to_json<T: serde::Serialize>(value: &T, what: impl FnOnce() -> String) -> Result<String, StateError> {
    serde_json::to_string(value).map_err(|err| StateError::Backend { what: what(), err: Box::new(err) })
}

#[async_trait]
impl StateStore for SqliteStore {
    async fn upsert_agent(&self, agent: AgentRow) -> Result<(), StateError> {
        self.run(format!("saving agent {}", agent.id), move |c, _| catalog::upsert_agent(c, &agent)).await
    }

    async fn agents(&self) -> Result<Vec<AgentRow>, StateError> {
        self.read("listing agents".into(), catalog::agents).await
    }

    async fn record(&self, instance: &str) -> Result<Option<Record>, StateError> {
        let version = match self.inner.records.lookup(instance) {
            super::record_cache::Lookup::Hit(record) => return Ok(record),
            super::record_cache::Lookup::Miss(version) => version,
        };
        let owned = instance.to_owned();
        let what = format!("reading the record of instance {instance}");
        let record = self.read(what, move |c| records::nth(c, &owned, 0)).await?;
        self.inner.records.fill(instance, version, &record);
        Ok(record)
    }

    async fn settled_record(&self, instance: &str) -> Result<Option<Record>, StateError> {
        // The serving coordinator's reads are answered from its cache already, which is exact.
        self.record(instance).await
    }

    async fn previous_record(&self, instance: &str) -> Result<Option<Record>, StateError> {
        let instance = instance.to_owned();
        self.read(format!("reading the previous record of instance {instance}"), move |c| records::nth(c, &instance, 1))
            .await
    }

    async fn records(&self) -> Result<Vec<(Record, Option<Record>)>, StateError> {
        self.read("listing records".into(), records::all).await
    }

    async fn write_record(
        &self,
        instance: &str,
        expected: Option<Generation>,
        images: Vec<RecordedImage>,
    ) -> Result<Generation, StateError> {
        let what = format!("writing the record of instance {instance}");
        let owned = instance.to_owned();
        self.writing_record(instance, what, move |c, now| records::write(c, now, &owned, expected, &images)).await
    }

    async fn delete_record(&self, instance: &str) -> Result<bool, StateError> {
        let what = format!("deleting the record of instance {instance}");
        let owned = instance.to_owned();
        self.writing_record(instance, what, move |c, _| records::delete(c, &owned)).await
    }

    async fn open_converge(&self, instance: &str, requested_by: &str) -> Result<Converge, StateError> {
        let (instance, requested_by) = (instance.to_owned(), requested_by.to_owned());
        self.run(format!("opening a converge of instance {instance}"), move |c, now| {
            converges::open(c, now, &instance, &requested_by)
        })
        .await
    }

    async fn open_converge_with(
        &self,
        instance: &str,
        requested_by: &str,
        first: (EventKind, Option<String>, String),
    ) -> Result<(Converge, Event), StateError> {
        let (instance, requested_by) = (instance.to_owned(), requested_by.to_owned());
        self.run(format!("opening a converge of instance {instance}"), move |c, now| {
            let converge = converges::open(c, now, &instance, &requested_by)?;
            let mut events = converges::append_events(c, now, &converge.id, vec![first])?;
            Ok((converge, events.remove(0)))
        })
        .await
    }

    async fn append_event(
        &self,
        converge: &ConvergeId,
        kind: EventKind,
        image: Option<&str>,
        message: &str,
    ) -> Result<Event, StateError> {
        let (id, image, message) = (converge.clone(), image.map(str::to_owned), message.to_owned());
        self.run(format!("appending an event to converge {id}"), move |c, now| {
            converges::append_event(c, now, &id, kind, image, message)
        })
        .await
    }

    async fn append_events(
        &self,
        converge: &ConvergeId,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Vec<Event>, StateError> {
        let id = converge.clone();
        self.run(format!("appending {} events to converge {id}", events.len()), move |c, now| {
            converges::append_events(c, now, &id, events)
        })
        .await
    }

    async fn events(&self, converge: &ConvergeId, after_seq: Option<u64>) -> Result<Vec<Event>, StateError> {
        let id = converge.clone();
        self.read(format!("reading the events of converge {id}"), move |c| converges::events(c, &id, after_seq)).await
    }

    async fn finish_converge(&self, converge: &ConvergeId, state: ConvergeState) -> Result<(), StateError> {
        let id = converge.clone();
        self.run(format!("finishing converge {id}"), move |c, now| converges::finish(c, now, &id, state)).await
    }

    async fn finish_with_events(
        &self,
        converge: &ConvergeId,
        state: ConvergeState,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<(Vec<Event>, Option<StateError>), StateError> {
        let id = converge.clone();
        let what = format!("finishing converge {id} with {} events", events.len());
        self.run(what, move |c, now| {
            // `finish` is a savepoint of its own: a refusal to mark undoes nothing of the events.
            let finished = converges::finish(c, now, &id, state).err();
            Ok((converges::append_events(c, now, &id, events)?, finished))
        })
        .await
    }

    async fn settle_converge(
        &self,
        id: &ConvergeId,
        instance: &str,
        requested_by: &str,
        generation: Generation,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Option<(Converge, Vec<Event>)>, StateError> {
        let (id, instance, requested_by) = (id.clone(), instance.to_owned(), requested_by.to_owned());
        let what = format!("storing the settled converge {id} of instance {instance}");
        let settled = self.run(what.clone(), move |c, now| {
            // Opened first, then the record compared, as on PostgreSQL: once this converge runs,
            // no other of the instance can write the record under it. A moved record rolls the
            // whole call back.
            let converge = converges::open_as(c, now, id, &instance, &requested_by)?;
            let actual = records::current(c, &instance).ctx(|| what)?;
            if actual != Some(generation) {
                return Err(StateError::RecordMoved { instance, expected: Some(generation), actual });
            }
            let events = converges::append_events(c, now, &converge.id, events)?;
            converges::finish(c, now, &converge.id, ConvergeState::Succeeded)?;
            Ok((Converge { state: ConvergeState::Succeeded, finished_ms: Some(now), ..converge }, events))
        });
        match settled.await {
            Ok(settled) => Ok(Some(settled)),
            Err(StateError::RecordMoved { instance, .. }) => {
                // Decided on a record the file no longer has: if this handle kept it, it is
                // stale (a second writer on the file), and the next read goes to the file.
                self.inner.records.forget(&instance);
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }

    async fn converge(&self, converge: &ConvergeId) -> Result<Option<Converge>, StateError> {
        let id = converge.clone();
        self.read(format!("reading converge {id}"), move |c| converges::get(c, &id)).await
    }

    async fn converges(&self, instance: Option<&str>, limit: usize) -> Result<Vec<Converge>, StateError> {
        let instance = instance.map(str::to_owned);
        let what = match &instance {
            Some(instance) => format!("listing the converges of instance {instance}"),
            None => "listing converges".to_owned(),
        };
        self.read(what, move |c| converges::list(c, instance.as_deref(), limit)).await
    }

    async fn fail_in_flight(&self, reason: &str) -> Result<Vec<ConvergeId>, StateError> {
        let reason = reason.to_owned();
        self.run("failing converges left running".into(), move |c, now| converges::fail_in_flight(c, now, &reason))
            .await
    }

    async fn claim(&self, converge: &ConvergeId, refs: &[String], expires_ms: u64) -> Result<(), StateError> {
        let (id, refs) = (converge.clone(), refs.to_vec());
        self.run(format!("claiming refs for converge {id}"), move |c, _| claims::claim(c, &id, &refs, expires_ms)).await
    }

    async fn renew_claims(&self, converge: &ConvergeId, expires_ms: u64) -> Result<usize, StateError> {
        let id = converge.clone();
        self.run(format!("renewing the claims of converge {id}"), move |c, _| claims::renew(c, &id, expires_ms)).await
    }

    async fn release_claims(&self, converge: &ConvergeId) -> Result<(), StateError> {
        let id = converge.clone();
        self.run(format!("releasing the claims of converge {id}"), move |c, _| claims::release(c, &id)).await
    }

    async fn live_claims(&self, now_ms: u64) -> Result<Vec<Claim>, StateError> {
        self.run("listing live claims".into(), move |c, _| claims::live(c, now_ms)).await
    }

    async fn pin(&self, reference: &str, pinned_by: &str) -> Result<bool, StateError> {
        let (reference, by) = (reference.to_owned(), pinned_by.to_owned());
        self.run(format!("pinning {reference}"), move |c, now| pins::pin(c, now, &reference, &by)).await
    }

    async fn unpin(&self, reference: &str) -> Result<bool, StateError> {
        let reference = reference.to_owned();
        self.run(format!("unpinning {reference}"), move |c, _| pins::unpin(c, &reference)).await
    }

    async fn pins(&self) -> Result<Vec<Pin>, StateError> {
        self.read("listing pins".into(), pins::all).await
    }

    async fn missing_contexts(&self, digests: &[String]) -> Result<Vec<String>, StateError> {
        let digests = digests.to_vec();
        self.read("looking up contexts".into(), move |c| catalog::missing_contexts(c, &digests)).await
    }

    async fn put_context(&self, context: ContextRow) -> Result<(), StateError> {
        self.run(format!("indexing context {}", context.digest), move |c, _| catalog::put_context(c, &context)).await
    }

    async fn context(&self, digest: &str) -> Result<Option<ContextRow>, StateError> {
        let digest = digest.to_owned();
        self.read(format!("looking up context {digest}"), move |c| catalog::context(c, &digest)).await
    }

    async fn builder_of(&self, reference: &str) -> Result<Option<ConvergeId>, StateError> {
        let reference = reference.to_owned();
        self.read(format!("looking up the converge that built {reference}"), move |c| {
            converges::builder_of(c, &reference)
        })
        .await
    }

    async fn contexts(&self) -> Result<Vec<ContextRow>, StateError> {
        self.read("listing contexts".into(), catalog::contexts).await
    }

    async fn delete_context_unless_claimed(&self, digest: &str, claim: &str, now_ms: u64) -> Result<bool, StateError> {
        let (digest, claim) = (digest.to_owned(), claim.to_owned());
        self.run(format!("collecting context {digest}"), move |c, _| {
            catalog::delete_context_unless_claimed(c, &digest, &claim, now_ms)
        })
        .await
    }

    async fn put_context_entries(&self, digest: &str, stream: Vec<u8>) -> Result<(), StateError> {
        let digest = digest.to_owned();
        self.run(format!("keeping the entry list of context {digest}"), move |c, _| {
            catalog::put_context_entries(c, &digest, &stream)
        })
        .await
    }

    async fn context_entries(&self, digest: &str) -> Result<Option<Vec<u8>>, StateError> {
        let digest = digest.to_owned();
        self.read(format!("reading the entry list of context {digest}"), move |c| catalog::context_entries(c, &digest))
            .await
    }

    async fn put_token(&self, token: TokenRow) -> Result<(), StateError> {
        self.run(format!("saving token {}", token.id), move |c, _| trust::put_token(c, &token)).await
    }

    async fn token(&self, id: &str) -> Result<Option<TokenRow>, StateError> {
        let id = id.to_owned();
        self.read(format!("reading token {id}"), move |c| trust::token(c, &id)).await
    }

    async fn tokens(&self) -> Result<Vec<TokenRow>, StateError> {
        self.read("listing tokens".into(), trust::tokens).await
    }

    async fn revoke_token(&self, id: &str, now_ms: u64) -> Result<bool, StateError> {
        let id = id.to_owned();
        self.run(format!("revoking token {id}"), move |c, _| trust::revoke_token(c, &id, now_ms)).await
    }

    async fn put_join(&self, join: JoinRow) -> Result<(), StateError> {
        self.run(format!("saving join token {}", join.id), move |c, _| trust::put_join(c, &join)).await
    }

    async fn use_join(&self, id: &str, now_ms: u64) -> Result<Option<JoinRow>, StateError> {
        let id = id.to_owned();
        self.run(format!("using join token {id}"), move |c, _| trust::use_join(c, &id, now_ms)).await
    }

    async fn revoke_agent(&self, id: &str, now_ms: u64) -> Result<bool, StateError> {
        let id = id.to_owned();
        self.run(format!("revoking agent {id}"), move |c, _| trust::revoke_agent(c, &id, now_ms)).await
    }

    async fn revoked_agents(&self) -> Result<Vec<(String, u64)>, StateError> {
        self.read("listing revoked agents".into(), trust::revoked_agents).await
    }

    async fn own(&self, instance: &str, claim: Owner) -> Result<Owner, StateError> {
        let instance = instance.to_owned();
        self.run(format!("reading the owner of instance {instance}"), move |c, _| trust::own(c, &instance, &claim))
            .await
    }

    async fn owner(&self, instance: &str) -> Result<Option<Owner>, StateError> {
        let instance = instance.to_owned();
        self.read(format!("reading the owner of instance {instance}"), move |c| trust::owner(c, &instance)).await
    }

    async fn append_audit(&self, entry: AuditRow) -> Result<(), StateError> {
        self.run("writing the audit log".into(), move |c, _| trust::append_audit(c, &entry)).await
    }

    async fn audit(&self, since_ms: u64, actor: Option<&str>) -> Result<Vec<AuditRow>, StateError> {
        let actor = actor.map(str::to_owned);
        self.read("reading the audit log".into(), move |c| trust::audit(c, since_ms, actor.as_deref())).await
    }

    async fn put_inventory(&self, store: &str, listing_json: String, listed_ms: u64) -> Result<(), StateError> {
        let store = store.to_owned();
        self.run(format!("saving the inventory of store {store}"), move |c, _| {
            catalog::put_inventory(c, &store, &listing_json, listed_ms)
        })
        .await
    }

    async fn inventory(&self, store: &str) -> Result<Option<Inventory>, StateError> {
        let store = store.to_owned();
        self.read(format!("reading the inventory of store {store}"), move |c| catalog::inventory(c, &store)).await
    }

    async fn try_acquire_leadership(
        &self,
        holder: &str,
        addr: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, StateError> {
        let expires_ms = self.inner.clock.now_ms().saturating_add(ttl.as_millis() as u64);
        let leadership = Leadership { holder: holder.to_owned(), addr: addr.to_owned(), token: 1, expires_ms };
        *self.leader() = Some(leadership.clone());
        Ok(Some(leadership))
    }

    async fn renew_leadership(&self, leadership: &Leadership, ttl: Duration) -> Result<Leadership, StateError> {
        let expires_ms = self.inner.clock.now_ms().saturating_add(ttl.as_millis() as u64);
        let renewed = Leadership { expires_ms, ..leadership.clone() };
        *self.leader() = Some(renewed.clone());
        Ok(renewed)
    }

    async fn resign_leadership(&self, _leadership: &Leadership) -> Result<(), StateError> {
        *self.leader() = None;
        Ok(())
    }

    async fn current_leader(&self) -> Result<Option<Leadership>, StateError> {
        Ok(self.leader().clone())
    }
}

impl SqliteStore {
    fn leader(&self) -> std::sync::MutexGuard<'_, Option<Leadership>> {
        self.inner.leader.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether opening failed only because another connection held the file's lock.
fn is_locked(err: &StateError) -> bool {
    let chain = kiln_core::error_chain(err);
    chain.contains("database is locked") || chain.contains("database table is locked")
}
