//! Which coordinator of a farm is active (DESIGN.md "High availability"). Several coordinators
//! share one PostgreSQL database; exactly one holds its lease row, with a **fencing token** that
//! grows by one with every acquisition. A store handle that acquired the lease carries the token
//! into every write it makes, and the database refuses a write whose token is not the current
//! one — so a coordinator paused past its lease (SIGSTOP, a long GC, a partition) and woken after
//! another took over can never write again, however sure it still is that it leads.
//!
//! The lease's expiry is read on the database's clock, never a coordinator's: the coordinators'
//! clocks need not agree, and the database is the one party every candidate asks. On SQLite (one
//! embedded process) leadership is trivially always held.
//!
//! [`lead`] is what a coordinator runs at start: stand by until the lease is free, take it, and
//! renew it in the background; [`Held::lost`] resolves when it is gone. While it stands by it
//! serves anyway, answering every call with where the active coordinator is ([`Activity`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::state::{StateError, StateStore};

/// A lease on a farm's leadership, as the store granted or last renewed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leadership {
    /// Who holds it: unique per coordinator process (`host/pid/nonce`).
    pub holder: String,
    /// Where the holder serves, so standbys and errors can name the active coordinator.
    pub addr: String,
    /// The fencing token: one more than the previous holder's, never reused.
    pub token: u64,
    /// When the lease lapses unless renewed: milliseconds since the epoch on the database's clock.
    pub expires_ms: u64,
}

/// How long a lease lives and how often it is renewed and asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeasePolicy {
    /// How long a lease lives without renewal: how long a dead coordinator keeps the farm waiting.
    pub ttl: Duration,
    /// How often the holder renews: a third of the TTL survives two missed renewals.
    pub renew_every: Duration,
    /// How often a standby asks for the lease.
    pub poll_every: Duration,
}

impl Default for LeasePolicy {
    /// A standby takes over within `ttl + poll_every` ≈ 6.6 s of the active coordinator's death
    /// (the goal: a median under 8 s to the first successful converge); the holder
    /// renews every 2 s, so a database that stalls for up to 4 s costs no failover.
    fn default() -> LeasePolicy {
        LeasePolicy {
            ttl: Duration::from_secs(6),
            renew_every: Duration::from_secs(2),
            poll_every: Duration::from_millis(600),
        }
    }
}

/// Why a held lease ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lost {
    /// Another coordinator took the lease: this one's writes are refused from now on.
    Superseded { current: u64, active: Option<String> },
    /// Renewals failed until the lease's TTL ran out here: another coordinator may lead by now.
    Unrenewed { error: String },
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lost::Superseded { current, active: Some(addr) } => {
                write!(f, "superseded by the coordinator at {addr} (token {current})")
            }
            Lost::Superseded { current, active: None } => write!(f, "superseded (token {current})"),
            Lost::Unrenewed { error } => write!(f, "not renewed before its TTL ran out: {error}"),
        }
    }
}

/// The lease this coordinator holds, renewed in the background until it is lost or resigned.
pub struct Held {
    leadership: Leadership,
    lost: watch::Receiver<Option<Lost>>,
    renewer: JoinHandle<()>,
    store: Arc<dyn StateStore>,
}

impl Held {
    /// The lease as first acquired (its token is this coordinator's for as long as it leads).
    pub fn leadership(&self) -> &Leadership {
        &self.leadership
    }

    /// Resolves once the lease is lost; never while it is held.
    pub async fn lost(&self) -> Lost {
        self.lost_signal().await
    }

    /// [`Held::lost`], owning what it waits on, so the lease itself can be kept elsewhere.
    pub fn lost_signal(&self) -> impl std::future::Future<Output = Lost> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            let reason = lost.wait_for(Option::is_some).await.ok().and_then(|reason| reason.clone());
            reason.unwrap_or(Lost::Unrenewed { error: "the renewal task stopped".into() })
        }
    }

    /// Stops renewing and frees the lease, so a standby takes over at once instead of after the TTL.
    pub async fn resign(self) -> Result<(), StateError> {
        self.renewer.abort();
        self.store.resign_leadership(&self.leadership).await
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held").field("leadership", &self.leadership).finish_non_exhaustive()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.renewer.abort();
    }
}

/// This process's name as a lease holder: `<hostname>/<pid>`, so an operator reading the lease
/// row knows which process to look at.
pub fn holder_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "coordinator".to_owned());
    format!("{host}/{}", std::process::id())
}

/// What a coordinator is to its farm right now: what its gate answers callers and its health
/// service answers probes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Activity {
    /// Standing by. `active` is where the coordinator holding the lease serves, when one does, so
    /// a caller that reached this one is sent there.
    Standby { active: Option<String> },
    /// Holding the lease (or the embedded, always-held SQLite one): serving every call.
    Active,
}

/// One attempt at the farm's lease: `Some` when this coordinator now holds it (always on SQLite).
pub async fn try_lead(
    store: Arc<dyn StateStore>,
    holder: &str,
    addr: &str,
    policy: LeasePolicy,
) -> Result<Option<Held>, StateError> {
    // The local deadline starts before the request: the database's expiry was set after it.
    let asked = Instant::now();
    let Some(leadership) = store.try_acquire_leadership(holder, addr, policy.ttl).await? else { return Ok(None) };
    Ok(Some(hold(store, leadership, asked + policy.ttl, policy)))
}

/// Stands by until this coordinator holds the farm's lease, then renews it in the background.
/// Returns at once on SQLite, where leadership is always held. While it waits, `standby` says
/// which coordinator leads, so callers reaching this one can be sent there.
pub async fn lead(
    store: Arc<dyn StateStore>,
    holder: &str,
    addr: &str,
    policy: LeasePolicy,
    standby: &watch::Sender<Activity>,
) -> Result<Held, StateError> {
    loop {
        if let Some(held) = try_lead(store.clone(), holder, addr, policy).await? {
            return Ok(held);
        }
        let active = store.current_leader().await?.map(|l| l.addr);
        let now = Activity::Standby { active: active.clone() };
        if *standby.borrow() != now {
            tracing::info!(active = active.as_deref().unwrap_or("none"), "standing by: another coordinator leads");
            standby.send_replace(now);
        }
        tokio::time::sleep(policy.poll_every).await;
    }
}

/// Starts renewing a lease just acquired.
fn hold(store: Arc<dyn StateStore>, leadership: Leadership, deadline: Instant, policy: LeasePolicy) -> Held {
    tracing::info!(token = leadership.token, holder = %leadership.holder, "leading the farm");
    let (tx, lost) = watch::channel(None);
    let renewer = tokio::spawn(renew(store.clone(), leadership.clone(), deadline, policy, tx));
    Held { leadership, lost, renewer, store }
}

/// Renews until the lease is superseded, or cannot be renewed before it would lapse.
async fn renew(
    store: Arc<dyn StateStore>,
    mut leadership: Leadership,
    mut deadline: Instant,
    policy: LeasePolicy,
    lost: watch::Sender<Option<Lost>>,
) {
    loop {
        tokio::time::sleep(policy.renew_every).await;
        let asked = Instant::now();
        // A renewal that hangs past the deadline counts as failed: the lease may be another's by then.
        let renewed = tokio::time::timeout_at(deadline, store.renew_leadership(&leadership, policy.ttl)).await;
        let reason = match renewed {
            Ok(Ok(next)) => {
                leadership = next;
                deadline = asked + policy.ttl;
                continue;
            }
            Ok(Err(StateError::Fenced { current, active, .. })) => Lost::Superseded { current, active },
            Ok(Err(err)) if Instant::now() < deadline => {
                tracing::warn!(error = %kiln_core::error_chain(&err), "renewing the farm's lease failed; retrying");
                continue;
            }
            Ok(Err(err)) => Lost::Unrenewed { error: kiln_core::error_chain(&err) },
            Err(_) => Lost::Unrenewed { error: "the renewal did not answer in time".into() },
        };
        tracing::error!(%reason, token = leadership.token, "lost the farm's leadership");
        let _ = lost.send(Some(reason));
        return;
    }
}
