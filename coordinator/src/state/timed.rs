//! [`Timed`]: a [`StateStore`] that times every call of the one it wraps, by method name, into
//! `kiln_state_call_duration_seconds`. `serve` wraps the store it opened, so every part of the
//! coordinator — engine, hub, sweep, trust, leadership — is measured without knowing it.
//!
//! Every method forwards, the batched ones included (`append_events`): a default method left to
//! the trait would silently turn one write into many.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{Leadership, StateError, StateStore};
use crate::metrics::names::Method;
use crate::metrics::Histograms;
use crate::model::{
    AgentRow, AuditRow, Claim, ContextRow, Converge, ConvergeId, ConvergeState, Event, EventKind, Generation,
    Inventory, JoinRow, Owner, Pin, Record, RecordedImage, TokenRow,
};

pub(crate) struct Timed {
    inner: Arc<dyn StateStore>,
    seconds: Histograms<Method>,
}

impl Timed {
    pub(crate) fn wrap(inner: Arc<dyn StateStore>, seconds: Histograms<Method>) -> Arc<dyn StateStore> {
        Arc::new(Timed { inner, seconds })
    }

    fn observe(&self, method: &'static str, started: Instant) {
        self.seconds.get_or_create(&Method { method }).observe(started.elapsed().as_secs_f64());
    }
}

/// The trait's methods, each timed and forwarded as is. A method added to [`StateStore`] must be
/// added here too — the compiler says so.
macro_rules! timed {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        #[async_trait]
        impl StateStore for Timed {
            $(
                async fn $name(&self, $($arg: $ty),*) -> Result<$ret, StateError> {
                    let started = Instant::now();
                    let result = self.inner.$name($($arg),*).await;
                    self.observe(stringify!($name), started);
                    result
                }
            )*
        }
    };
}

timed! {
    upsert_agent(agent: AgentRow) -> ();
    agents() -> Vec<AgentRow>;
    record(instance: &str) -> Option<Record>;
    settled_record(instance: &str) -> Option<Record>;
    previous_record(instance: &str) -> Option<Record>;
    records() -> Vec<(Record, Option<Record>)>;
    write_record(instance: &str, expected: Option<Generation>, images: Vec<RecordedImage>) -> Generation;
    delete_record(instance: &str) -> bool;
    open_converge(instance: &str, requested_by: &str) -> Converge;
    open_converge_with(instance: &str, requested_by: &str, first: (EventKind, Option<String>, String)) -> (Converge, Event);
    append_event(converge: &ConvergeId, kind: EventKind, image: Option<&str>, message: &str) -> Event;
    append_events(converge: &ConvergeId, events: Vec<(EventKind, Option<String>, String)>) -> Vec<Event>;
    events(converge: &ConvergeId, after_seq: Option<u64>) -> Vec<Event>;
    finish_converge(converge: &ConvergeId, state: ConvergeState) -> ();
    finish_with_events(
        converge: &ConvergeId,
        state: ConvergeState,
        events: Vec<(EventKind, Option<String>, String)>
    ) -> (Vec<Event>, Option<StateError>);
    settle_converge(
        id: &ConvergeId,
        instance: &str,
        requested_by: &str,
        generation: Generation,
        events: Vec<(EventKind, Option<String>, String)>
    ) -> Option<(Converge, Vec<Event>)>;
    converge(converge: &ConvergeId) -> Option<Converge>;
    converges(instance: Option<&str>, limit: usize) -> Vec<Converge>;
    builder_of(reference: &str) -> Option<ConvergeId>;
    fail_in_flight(reason: &str) -> Vec<ConvergeId>;
    claim(converge: &ConvergeId, refs: &[String], expires_ms: u64) -> ();
    renew_claims(converge: &ConvergeId, expires_ms: u64) -> usize;
    release_claims(converge: &ConvergeId) -> ();
    live_claims(now_ms: u64) -> Vec<Claim>;
    pin(reference: &str, pinned_by: &str) -> bool;
    unpin(reference: &str) -> bool;
    pins() -> Vec<Pin>;
    missing_contexts(digests: &[String]) -> Vec<String>;
    put_context(context: ContextRow) -> ();
    context(digest: &str) -> Option<ContextRow>;
    contexts() -> Vec<ContextRow>;
    delete_context_unless_claimed(digest: &str, claim: &str, now_ms: u64) -> bool;
    put_context_entries(digest: &str, stream: Vec<u8>) -> ();
    context_entries(digest: &str) -> Option<Vec<u8>>;
    put_token(token: TokenRow) -> ();
    token(id: &str) -> Option<TokenRow>;
    tokens() -> Vec<TokenRow>;
    revoke_token(id: &str, now_ms: u64) -> bool;
    put_join(join: JoinRow) -> ();
    use_join(id: &str, now_ms: u64) -> Option<JoinRow>;
    revoke_agent(id: &str, now_ms: u64) -> bool;
    revoked_agents() -> Vec<(String, u64)>;
    own(instance: &str, claim: Owner) -> Owner;
    owner(instance: &str) -> Option<Owner>;
    append_audit(entry: AuditRow) -> ();
    audit(since_ms: u64, actor: Option<&str>) -> Vec<AuditRow>;
    put_inventory(store: &str, listing_json: String, listed_ms: u64) -> ();
    inventory(store: &str) -> Option<Inventory>;
    try_acquire_leadership(holder: &str, addr: &str, ttl: Duration) -> Option<Leadership>;
    renew_leadership(leadership: &Leadership, ttl: Duration) -> Leadership;
    resign_leadership(leadership: &Leadership) -> ();
    current_leader() -> Option<Leadership>;
}
