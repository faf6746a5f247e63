//! The coordinator's state behind one trait: agents, records by generation, converges and their
//! events, claims, pins, the context index and store inventories (DESIGN.md "Where state lives").
//! [`SqliteStore`] is the embedded default; [`PostgresStore`] serves a farm of several coordinators.
//! Both implement the same [`Store`], which speaks only in [`crate::model`] types, and both pass the
//! one test suite (`coordinator/tests/store.rs`).
//!
//! Two promises the converge engine builds on: [`Store::write_record`] is a compare-and-set (a
//! converge records only if the record is still the generation it started from), and at most one
//! converge per instance runs at a time ([`Store::open_converge`]). Both hold across processes
//! sharing one database, not just across tasks of one coordinator. A third holds across a farm's
//! coordinators: once a handle leads ([`Store::try_acquire_leadership`]), its writes are refused
//! as soon as another coordinator takes the lease ([`leadership`]).

mod clock;
mod error;
pub mod leadership;
mod postgres;
mod sqlite;

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;

use crate::model::{
    AgentRow, AuditRow, Claim, ContextRow, Converge, ConvergeId, ConvergeState, Event, EventKind, Generation,
    Inventory, JoinRow, Owner, Pin, Record, RecordedImage, TokenRow,
};

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{BoxError, StoreError};
pub use leadership::Leadership;
pub use postgres::{PostgresStore, SCHEMA_VERSION as POSTGRES_SCHEMA_VERSION};
pub use sqlite::{SqliteStore, SCHEMA_VERSION};

/// Opens the state a coordinator was pointed at: the PostgreSQL database `database` when given
/// (`kiln-coordinator --state postgres://…`), else the SQLite file `kiln.db` in `dir`.
pub async fn open(dir: &Path, database: Option<&str>) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    Ok(match database {
        Some(url) => std::sync::Arc::new(PostgresStore::connect(url).await?),
        None => std::sync::Arc::new(SqliteStore::open(dir.join("kiln.db"))?),
    })
}

/// The coordinator's state. Held as `Arc<dyn Store>`; every method is one atomic step.
///
/// Time: timestamps the store writes (`written_at_ms`, `started_ms`, `finished_ms`, an event's
/// `at_ms`) come from the [`Clock`] given at open; lease times (`expires_ms`, `now_ms`) are passed by
/// the caller, who owns the lease policy.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    // --- agents
    /// Inserts the agent or replaces what was known of it.
    async fn upsert_agent(&self, agent: AgentRow) -> Result<(), StoreError>;
    /// Every agent ever seen, by id.
    async fn agents(&self) -> Result<Vec<AgentRow>, StoreError>;

    // --- records
    /// The instance's current record.
    async fn record(&self, instance: &str) -> Result<Option<Record>, StoreError>;
    /// The generation the current record replaced (a node store's grace), if kept.
    async fn previous_record(&self, instance: &str) -> Result<Option<Record>, StoreError>;
    /// Every instance's current record with its previous one, by instance name.
    async fn records(&self) -> Result<Vec<(Record, Option<Record>)>, StoreError>;
    /// Writes a new generation if the current one is still `expected` (the generation this converge
    /// started from; `None` = there was none); otherwise fails with [`StoreError::RecordMoved`] and
    /// writes nothing. Generations older than the previous one are pruned.
    async fn write_record(
        &self,
        instance: &str,
        expected: Option<Generation>,
        images: Vec<RecordedImage>,
    ) -> Result<Generation, StoreError>;
    /// Deletes every generation of the instance's record (`kiln down`). Returns whether one existed.
    /// The generation counter is kept, so a later record never reuses a number.
    async fn delete_record(&self, instance: &str) -> Result<bool, StoreError>;

    // --- converges and their events
    /// Opens a running converge, or fails with [`StoreError::ConvergeRunning`] if the instance has one.
    async fn open_converge(&self, instance: &str, requested_by: &str) -> Result<Converge, StoreError>;
    /// Appends an event with the next seq of this converge (gap-free from 1).
    async fn append_event(
        &self,
        converge: &ConvergeId,
        kind: EventKind,
        image: Option<&str>,
        message: &str,
    ) -> Result<Event, StoreError>;
    /// Appends several events in order, at once: one write for a burst (a converge of many images
    /// emits dozens of events within milliseconds). The default appends them one by one.
    async fn append_events(
        &self,
        converge: &ConvergeId,
        events: Vec<(EventKind, Option<String>, String)>,
    ) -> Result<Vec<Event>, StoreError> {
        let mut appended = Vec::with_capacity(events.len());
        for (kind, image, message) in events {
            appended.push(self.append_event(converge, kind, image.as_deref(), &message).await?);
        }
        Ok(appended)
    }
    /// The converge's events in seq order, only those after `after_seq` when given.
    async fn events(&self, converge: &ConvergeId, after_seq: Option<u64>) -> Result<Vec<Event>, StoreError>;
    /// Marks a running converge succeeded or failed. Claims are left alone: release them explicitly,
    /// or let them expire.
    async fn finish_converge(&self, converge: &ConvergeId, state: ConvergeState) -> Result<(), StoreError>;
    async fn converge(&self, converge: &ConvergeId) -> Result<Option<Converge>, StoreError>;
    /// Newest first, at most `limit`, of one instance or of all.
    async fn converges(&self, instance: Option<&str>, limit: usize) -> Result<Vec<Converge>, StoreError>;
    /// The converge that most recently started building `reference` (its `building` event), if
    /// its log is still kept: what "held (built by converge X)" names.
    async fn builder_of(&self, reference: &str) -> Result<Option<ConvergeId>, StoreError>;
    /// At coordinator start: every converge still running is marked failed with `reason`, and a
    /// `Failed` event saying so is appended. Its claims are left to expire on their lease.
    async fn fail_in_flight(&self, reason: &str) -> Result<Vec<ConvergeId>, StoreError>;

    // --- claims
    /// Claims `refs` for a running converge until `expires_ms` (a ref claimed again gets the new expiry).
    async fn claim(&self, converge: &ConvergeId, refs: &[String], expires_ms: u64) -> Result<(), StoreError>;
    /// Moves every claim of the converge to `expires_ms`; returns how many it holds.
    async fn renew_claims(&self, converge: &ConvergeId, expires_ms: u64) -> Result<usize, StoreError>;
    async fn release_claims(&self, converge: &ConvergeId) -> Result<(), StoreError>;
    /// Claims with `expires_ms > now_ms`; expired ones are dropped on the way.
    async fn live_claims(&self, now_ms: u64) -> Result<Vec<Claim>, StoreError>;

    // --- pins
    /// Pins `reference` (already in its one stored spelling); false when it was pinned before.
    async fn pin(&self, reference: &str, pinned_by: &str) -> Result<bool, StoreError>;
    /// Drops the pin; false when `reference` was not pinned.
    async fn unpin(&self, reference: &str) -> Result<bool, StoreError>;
    /// Every pin, by reference.
    async fn pins(&self) -> Result<Vec<Pin>, StoreError>;

    // --- the context index
    /// The digests of `digests` not in the index, in the order given, each once.
    async fn missing_contexts(&self, digests: &[String]) -> Result<Vec<String>, StoreError>;
    async fn put_context(&self, context: ContextRow) -> Result<(), StoreError>;
    async fn context(&self, digest: &str) -> Result<Option<ContextRow>, StoreError>;
    /// Every indexed context, by digest.
    async fn contexts(&self) -> Result<Vec<ContextRow>, StoreError>;
    /// Drops the context's row unless a claim named `claim` lives past `now_ms`; true when a row
    /// went. Atomic against `claim`, so a converge that claimed the context first keeps it.
    async fn delete_context_unless_claimed(&self, digest: &str, claim: &str, now_ms: u64) -> Result<bool, StoreError>;

    // --- trust (DESIGN.md "Trust")
    async fn put_token(&self, token: TokenRow) -> Result<(), StoreError>;
    async fn token(&self, id: &str) -> Result<Option<TokenRow>, StoreError>;
    /// Every token ever made, revoked ones included, oldest first.
    async fn tokens(&self) -> Result<Vec<TokenRow>, StoreError>;
    /// Revokes the token; false when there is none (or it was revoked before).
    async fn revoke_token(&self, id: &str, now_ms: u64) -> Result<bool, StoreError>;
    async fn put_join(&self, join: JoinRow) -> Result<(), StoreError>;
    /// Uses join token `id` once, atomically: the row as it was (`used_ms` none when this call was
    /// the first use), or `None` when there is no such token.
    async fn use_join(&self, id: &str, now_ms: u64) -> Result<Option<JoinRow>, StoreError>;
    /// Revokes every certificate of agent `id` issued up to `now_ms`; false when it already was.
    async fn revoke_agent(&self, id: &str, now_ms: u64) -> Result<bool, StoreError>;
    /// `(agent id, revoked at)`: a certificate of that id issued before then is refused; one
    /// issued after (the machine enrolled again, by an admin's new join token) is not.
    async fn revoked_agents(&self) -> Result<Vec<(String, u64)>, StoreError>;
    /// The instance's owner, made `claim` when it has none yet — atomically, so two first
    /// converges cannot both own it.
    async fn own(&self, instance: &str, claim: Owner) -> Result<Owner, StoreError>;
    async fn owner(&self, instance: &str) -> Result<Option<Owner>, StoreError>;
    async fn append_audit(&self, entry: AuditRow) -> Result<(), StoreError>;
    /// Audit entries at or after `since_ms`, oldest first; only `actor`'s when given.
    async fn audit(&self, since_ms: u64, actor: Option<&str>) -> Result<Vec<AuditRow>, StoreError>;

    // --- store inventories
    /// Replaces the store's last listing.
    async fn put_inventory(&self, store: &str, listing_json: String, listed_ms: u64) -> Result<(), StoreError>;
    async fn inventory(&self, store: &str) -> Result<Option<Inventory>, StoreError>;

    // --- leadership (see [`leadership`]): trivially held on SQLite
    /// Takes the farm's lease for `ttl` if no coordinator holds a live one, with a fencing token one
    /// above the last; `None` while another's lease lives. From then on this handle's writes carry
    /// the token, and are refused with [`StoreError::Fenced`] once another coordinator takes over.
    async fn try_acquire_leadership(
        &self,
        holder: &str,
        addr: &str,
        ttl: Duration,
    ) -> Result<Option<Leadership>, StoreError>;
    /// Extends the lease to `ttl` from now if its token is still current — even past its expiry,
    /// as long as nobody took it meanwhile; else [`StoreError::Fenced`] naming who leads.
    async fn renew_leadership(&self, leadership: &Leadership, ttl: Duration) -> Result<Leadership, StoreError>;
    /// Ends the lease now (if its token is still current), so a standby need not wait out the TTL.
    async fn resign_leadership(&self, leadership: &Leadership) -> Result<(), StoreError>;
    /// The live lease, if a coordinator holds one.
    async fn current_leader(&self) -> Result<Option<Leadership>, StoreError>;
}
