//! The coordinator's state behind one trait: agents, records by generation, converges and their
//! events, claims, pins, the context index and store inventories (DESIGN.md "Where state lives").
//! [`SqliteStore`] is the embedded default; [`PostgresStore`] serves a farm of several coordinators.
//! Both implement the same [`StateStore`], which speaks only in [`crate::model`] types, and both pass the
//! one test suite (`coordinator/tests/state.rs`).
//!
//! Two promises the converge engine builds on: [`StateStore::write_record`] is a compare-and-set (a
//! converge records only if the record is still the generation it started from), and at most one
//! converge per instance runs at a time ([`StateStore::open_converge`]). Both hold across processes
//! sharing one database, not just across tasks of one coordinator. A third holds across a farm's
//! coordinators: once a handle leads ([`StateStore::try_acquire_leadership`]), its writes are refused
//! as soon as another coordinator takes the lease ([`leadership`]).

mod clock;
mod error;
pub mod leadership;
mod postgres;
mod record_cache;
mod sqlite;
mod timed;

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;

use crate::model::{
    AgentRow, AuditRow, Claim, ContextRow, Converge, ConvergeId, ConvergeState, Event, EventKind, Generation,
    Inventory, JoinRow, Owner, Pin, Record, RecordedImage, TokenRow,
};

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{BoxError, StateError};
pub use leadership::Leadership;
pub use postgres::{PostgresStore, SCHEMA_VERSION as POSTGRES_SCHEMA_VERSION};
pub use sqlite::{SqliteStore, SCHEMA_VERSION};
pub(crate) use timed::Timed;

/// Opens the state a coordinator was pointed at: the PostgreSQL database `database` when given
/// (`kiln-coordinator --state postgres://…`), else the SQLite file `kiln.db` in `dir`. `writer`:
/// this process is the SQLite file's one writer (a serving coordinator, not a read-only one beside
/// another), so it may keep the records it read ([`SqliteStore::cache_records`]). PostgreSQL keeps
/// nothing in memory: several coordinators share it, and one that lost the lease while paused
/// must not answer from what it read before.
pub async fn open(
    dir: &Path,
    database: Option<&str>,
    writer: bool,
) -> Result<std::sync::Arc<dyn StateStore>, StateError> {
    Ok(match database {
        Some(url) => std::sync::Arc::new(PostgresStore::connect(url).await?),
        None => {
            let store = SqliteStore::open(dir.join("kiln.db"))?;
            if writer {
                store.cache_records();
            }
            std::sync::Arc::new(store)
        }
    })
}

/// The coordinator's state. Held as `Arc<dyn StateStore>`; every method is one atomic step.
///
/// Time: timestamps the store writes (`written_at_ms`, `started_ms`, `finished_ms`, an event's
/// `at_ms`) come from the [`Clock`] given at open; lease times (`expires_ms`, `now_ms`) are passed by
/// the caller, who owns the lease policy.
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    // --- agents
    /// Inserts the agent or replaces what was known of it.
    async fn upsert_agent(&self, agent: AgentRow) -> Result<(), StateError>;
    /// Every agent ever seen, by id.
    async fn agents(&self) -> Result<Vec<AgentRow>, StateError>;

    // --- records
    /// The instance's current record.
    async fn record(&self, instance: &str) -> Result<Option<Record>, StateError>;
    /// The instance's current record as far as this coordinator knows, for a converge that then
    /// stores itself only if the record still has that generation
    /// ([`settle_converge`](StateStore::settle_converge)): it may be one write behind.
    async fn settled_record(&self, instance: &str) -> Result<Option<Record>, StateError>;
    /// The generation the current record replaced (a node store's grace), if kept.
    async fn previous_record(&self, instance: &str) -> Result<Option<Record>, StateError>;
    /// Every instance's current record with its previous one, by instance name.
    async fn records(&self) -> Result<Vec<(Record, Option<Record>)>, StateError>;
    /// Writes a new generation if the current one is still `expected` (the generation this converge
    /// started from; `None` = there was none); otherwise fails with [`StateError::RecordMoved`] and
    /// writes nothing. Generations older than the previous one are pruned.
    async fn write_record(
        &self,
        instance: &str,
        expected: Option<Generation>,
        images: Vec<RecordedImage>,
    ) -> Result<Generation, StateError>;
    /// Deletes every generation of the instance's record (`kiln down`). Returns whether one existed.
    /// The generation counter is kept, so a later record never reuses a number.
    async fn delete_record(&self, instance: &str) -> Result<bool, StateError>;

    // --- converges and their events
    /// Opens a running converge, or fails with [`StateError::ConvergeRunning`] if the instance has one.
    async fn open_converge(&self, instance: &str, requested_by: &str) -> Result<Converge, StateError>;
    /// Opens a converge with its first event (`Started`), as one write: its client waits for one
    /// commit, not two, before it hears the converge began. The default makes the two writes.
    async fn open_converge_with(
        &self,
        instance: &str,
        requested_by: &str,
        first: (EventKind, Option<String>, String),
    ) -> Result<(Converge, Event), StateError> {
        let converge = self.open_converge(instance, requested_by).await?;
        let (kind, image, message) = first;
        let event = self.append_event(&converge.id, kind, image.as_deref(), &message).await?;
        Ok((converge, event))
    }
    /// Appends an event with the next seq of this converge (gap-free from 1).
    async fn append_event(
        &self,
        converge: &ConvergeId,
        kind: EventKind,
        image: Option<&str>,
        message: &str,
    ) -> Result<Event, StateError>;
    /// Appends several events in order, at once: one write for a burst (a converge of many images
    /// emits dozens of events within milliseconds). The default appends them one by one.
    async fn append_events(
        &self,
        converge: &ConvergeId,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Vec<Event>, StateError> {
        let mut appended = Vec::with_capacity(events.len());
        for (kind, image, message) in events {
            appended.push(self.append_event(converge, kind, image.as_deref(), &message).await?);
        }
        Ok(appended)
    }
    /// The converge's events in seq order, only those after `after_seq` when given.
    async fn events(&self, converge: &ConvergeId, after_seq: Option<u64>) -> Result<Vec<Event>, StateError>;
    /// Marks a running converge succeeded or failed. Claims are left alone: release them explicitly,
    /// or let them expire.
    async fn finish_converge(&self, converge: &ConvergeId, state: ConvergeState) -> Result<(), StateError>;
    /// Appends a converge's last events and marks it finished, as one write: its client hears
    /// `Finished` only once both are stored, and on a busy farm every write is a commit to wait
    /// for. The events are appended even when the converge cannot be marked (already finished, by
    /// a takeover that failed it): the second value says why it was not. The default makes the two
    /// writes.
    async fn finish_with_events(
        &self,
        converge: &ConvergeId,
        state: ConvergeState,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<(Vec<Event>, Option<StateError>), StateError> {
        let finished = self.finish_converge(converge, state).await.err();
        Ok((self.append_events(converge, events).await?, finished))
    }
    /// Stores a converge that changed nothing, whole, as one write: opened as `id` for
    /// `requested_by`, its events in order (`Started` first, `Finished` last), marked succeeded.
    /// Only if the instance has no converge running ([`StateError::ConvergeRunning`] otherwise) and
    /// its record is still at `generation`; `Ok(None)` when the record moved, with nothing
    /// written, and the caller converges the usual way. Why: the no-op `kiln up` is the call a
    /// developer waits on, and on a busy farm each write is a commit to queue for; it makes one,
    /// not three (open, its events, finish).
    async fn settle_converge(
        &self,
        id: &ConvergeId,
        instance: &str,
        requested_by: &str,
        generation: Generation,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Option<(Converge, Vec<Event>)>, StateError>;
    async fn converge(&self, converge: &ConvergeId) -> Result<Option<Converge>, StateError>;
    /// Newest first, at most `limit`, of one instance or of all.
    async fn converges(&self, instance: Option<&str>, limit: usize) -> Result<Vec<Converge>, StateError>;
    /// The converge that most recently started building `reference` (its `building` event), if
    /// its log is still kept: what "held (built by converge X)" names.
    async fn builder_of(&self, reference: &str) -> Result<Option<ConvergeId>, StateError>;
    /// At coordinator start: every converge still running is marked failed with `reason`, and a
    /// `Failed` event saying so is appended. Its claims are left to expire on their lease.
    async fn fail_in_flight(&self, reason: &str) -> Result<Vec<ConvergeId>, StateError>;

    // --- claims
    /// Claims `refs` for a running converge until `expires_ms` (a ref claimed again gets the new expiry).
    async fn claim(&self, converge: &ConvergeId, refs: &[String], expires_ms: u64) -> Result<(), StateError>;
    /// Moves every claim of the converge to `expires_ms`; returns how many it holds.
    async fn renew_claims(&self, converge: &ConvergeId, expires_ms: u64) -> Result<usize, StateError>;
    async fn release_claims(&self, converge: &ConvergeId) -> Result<(), StateError>;
    /// Claims with `expires_ms > now_ms`; expired ones are dropped on the way.
    async fn live_claims(&self, now_ms: u64) -> Result<Vec<Claim>, StateError>;

    // --- pins
    /// Pins `reference` (already in its one stored spelling); false when it was pinned before.
    async fn pin(&self, reference: &str, pinned_by: &str) -> Result<bool, StateError>;
    /// Drops the pin; false when `reference` was not pinned.
    async fn unpin(&self, reference: &str) -> Result<bool, StateError>;
    /// Every pin, by reference.
    async fn pins(&self) -> Result<Vec<Pin>, StateError>;

    // --- the context index
    /// The digests of `digests` not in the index, in the order given, each once.
    async fn missing_contexts(&self, digests: &[String]) -> Result<Vec<String>, StateError>;
    async fn put_context(&self, context: ContextRow) -> Result<(), StateError>;
    async fn context(&self, digest: &str) -> Result<Option<ContextRow>, StateError>;
    /// Every indexed context, by digest.
    async fn contexts(&self) -> Result<Vec<ContextRow>, StateError>;
    /// Drops the context's row, and its entry list, unless a claim named `claim` lives past
    /// `now_ms`; true when a row went. Atomic against `claim`, so a converge that claimed the
    /// context first keeps it.
    async fn delete_context_unless_claimed(&self, digest: &str, claim: &str, now_ms: u64) -> Result<bool, StateError>;
    /// Keeps the entry list of context `digest` (its canonical stream, `kiln_core::digest::list`),
    /// replacing any kept before. It goes with the context's row when that is collected, which
    /// no record's current or previous generation names — so the list a record names stays as
    /// long as it could be asked for, and in the database, where every coordinator of a farm
    /// reads it (the archive itself may be on another coordinator's disk).
    async fn put_context_entries(&self, digest: &str, stream: Vec<u8>) -> Result<(), StateError>;
    /// The entry list kept for context `digest`, if one is.
    async fn context_entries(&self, digest: &str) -> Result<Option<Vec<u8>>, StateError>;

    // --- trust (DESIGN.md "Trust")
    async fn put_token(&self, token: TokenRow) -> Result<(), StateError>;
    async fn token(&self, id: &str) -> Result<Option<TokenRow>, StateError>;
    /// Every token ever made, revoked ones included, oldest first.
    async fn tokens(&self) -> Result<Vec<TokenRow>, StateError>;
    /// Revokes the token; false when there is none (or it was revoked before).
    async fn revoke_token(&self, id: &str, now_ms: u64) -> Result<bool, StateError>;
    async fn put_join(&self, join: JoinRow) -> Result<(), StateError>;
    /// Uses join token `id` once, atomically: the row as it was (`used_ms` none when this call was
    /// the first use), or `None` when there is no such token.
    async fn use_join(&self, id: &str, now_ms: u64) -> Result<Option<JoinRow>, StateError>;
    /// Revokes every certificate of agent `id` issued up to `now_ms`; false when it already was.
    async fn revoke_agent(&self, id: &str, now_ms: u64) -> Result<bool, StateError>;
    /// `(agent id, revoked at)`: a certificate of that id issued before then is refused; one
    /// issued after (the machine enrolled again, by an admin's new join token) is not.
    async fn revoked_agents(&self) -> Result<Vec<(String, u64)>, StateError>;
    /// The instance's owner, made `claim` when it has none yet — atomically, so two first
    /// converges cannot both own it.
    async fn own(&self, instance: &str, claim: Owner) -> Result<Owner, StateError>;
    async fn owner(&self, instance: &str) -> Result<Option<Owner>, StateError>;
    async fn append_audit(&self, entry: AuditRow) -> Result<(), StateError>;
    /// Audit entries at or after `since_ms`, oldest first; only `actor`'s when given.
    async fn audit(&self, since_ms: u64, actor: Option<&str>) -> Result<Vec<AuditRow>, StateError>;

    // --- store inventories
    /// Replaces the store's last listing.
    async fn put_inventory(&self, store: &str, listing_json: String, listed_ms: u64) -> Result<(), StateError>;
    async fn inventory(&self, store: &str) -> Result<Option<Inventory>, StateError>;

    // --- leadership (see [`leadership`]): trivially held on SQLite
    /// Takes the farm's lease for `ttl` if no coordinator holds a live one, with a fencing token one
    /// above the last; `None` while another's lease lives. From then on this handle's writes carry
    /// the token, and are refused with [`StateError::Fenced`] once another coordinator takes over.
    async fn try_acquire_leadership(
        &self,
        holder: &str,
        addr: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, StateError>;
    /// Extends the lease to `ttl` from now if its token is still current — even past its expiry,
    /// as long as nobody took it meanwhile; else [`StateError::Fenced`] naming who leads.
    async fn renew_leadership(&self, leadership: &Leadership, ttl: Duration) -> Result<Leadership, StateError>;
    /// Ends the lease now (if its token is still current), so a standby need not wait out the TTL.
    async fn resign_leadership(&self, leadership: &Leadership) -> Result<(), StateError>;
    /// The live lease, if a coordinator holds one.
    async fn current_leader(&self) -> Result<Option<Leadership>, StateError>;
}
