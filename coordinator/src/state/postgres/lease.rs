//! The farm's lease: one row, `leader_lease`, created by the first migration with token 0 (never
//! led). Acquiring bumps the token under the row's lock, and only when the lease has lapsed on the
//! database's clock; every write transaction locks the row `FOR KEY SHARE` first and compares
//! tokens.
//!
//! Why the token alone fences, and expiry does not: the token changes only by a takeover, and a
//! takeover first locks the row `FOR UPDATE`, which waits for every write holding it
//! `FOR KEY SHARE`, while every write that starts after it reads the new token.
//!
//! Why `KEY SHARE` and not `SHARE`: a renewal updates only `expires_at`, a non-key column, which
//! takes `FOR NO KEY UPDATE` — compatible with `KEY SHARE`, in conflict with `SHARE`. With `SHARE`
//! a busy farm's stream of fenced writes kept the renewal waiting on the row until the lease ran
//! out (the farm benchmark on PostgreSQL: 1,000 agents, 200 converges), and the coordinator that
//! was working hardest stepped down. A takeover still waits for them all, through its explicit
//! `FOR UPDATE`. So a leader whose lease lapsed but that nobody replaced
//! may still write (nothing else leads), and renews; one that was replaced never writes again.

use std::time::Duration;

use deadpool_postgres::{GenericClient, Transaction};
use tokio_postgres::Row;

use super::{int, query_one, query_opt, uint, Ctx};
use crate::state::{Leadership, StateError};

/// The lease's columns as a [`Leadership`]: expiry in ms on the database's clock.
const LEASE: &str = "holder, addr, token, floor(extract(epoch FROM expires_at) * 1000)::bigint";

/// Fails unless `held` (this handle's lease) is the farm's current one. A handle that never led
/// may write only to a database no coordinator ever led (token 0): a lone coordinator, a test.
pub(super) async fn fence<C: GenericClient>(tx: &C, held: Option<&Leadership>, what: &str) -> Result<(), StateError> {
    let row = query_one(
        tx,
        "SELECT token, CASE WHEN expires_at > clock_timestamp() THEN addr END FROM leader_lease FOR KEY SHARE",
        &[],
    )
    .await
    .ctx(what)?;
    let current = uint(row.get(0));
    let active: Option<String> = row.get(1);
    match held {
        None if current == 0 => Ok(()),
        None => Err(StateError::NotLeader { active }),
        Some(held) if held.token == current => Ok(()),
        Some(held) => Err(StateError::Fenced { holder: held.holder.clone(), token: held.token, current, active }),
    }
}

/// Takes the lease if it lapsed, in `tx`: the caller commits.
pub(super) async fn acquire(
    tx: &Transaction<'_>,
    holder: &str,
    addr: &str,
    ttl: Duration,
    what: &str,
) -> Result<Option<Leadership>, StateError> {
    // `FOR UPDATE` waits for every fenced write in flight (`FOR KEY SHARE`): a token bump that
    // did not would let a write checked against the old token commit after the new one.
    tx.execute("SELECT 1 FROM leader_lease FOR UPDATE", &[]).await.ctx(what)?;
    let c = tx;
    // Two standbys asking at once both wait on the row lock; the second re-reads the row the first
    // wrote, finds its lease live, and updates nothing.
    let sql = format!(
        "UPDATE leader_lease SET token = token + 1, holder = $1, addr = $2, acquired_at = clock_timestamp(), \
         expires_at = clock_timestamp() + $3::bigint * interval '1 millisecond' \
         WHERE expires_at <= clock_timestamp() RETURNING {LEASE}"
    );
    let row = query_opt(c, &sql, &[&holder, &addr, &int(ttl.as_millis() as u64)]).await.ctx(what)?;
    Ok(row.as_ref().map(leadership))
}

pub(super) async fn renew<C: GenericClient>(
    c: &C,
    held: &Leadership,
    ttl: Duration,
    what: &str,
) -> Result<Leadership, StateError> {
    let sql = format!(
        "UPDATE leader_lease SET expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond' \
         WHERE token = $1 RETURNING {LEASE}"
    );
    match query_opt(c, &sql, &[&int(held.token), &int(ttl.as_millis() as u64)]).await.ctx(what)? {
        Some(row) => Ok(leadership(&row)),
        None => Err(superseded(c, held, what).await?),
    }
}

pub(super) async fn resign<C: GenericClient>(c: &C, held: &Leadership, what: &str) -> Result<(), StateError> {
    let sql =
        "UPDATE leader_lease SET expires_at = clock_timestamp() WHERE token = $1 AND expires_at > clock_timestamp()";
    super::execute(c, sql, &[&int(held.token)]).await.ctx(what)?;
    Ok(())
}

pub(super) async fn current<C: GenericClient>(c: &C, what: &str) -> Result<Option<Leadership>, StateError> {
    let sql = format!("SELECT {LEASE} FROM leader_lease WHERE token > 0 AND expires_at > clock_timestamp()");
    Ok(query_opt(c, &sql, &[]).await.ctx(what)?.as_ref().map(leadership))
}

/// The error for a lease whose token is no longer current, naming who leads now.
async fn superseded<C: GenericClient>(c: &C, held: &Leadership, what: &str) -> Result<StateError, StateError> {
    let row =
        query_one(c, "SELECT token, CASE WHEN expires_at > clock_timestamp() THEN addr END FROM leader_lease", &[])
            .await
            .ctx(what)?;
    Ok(StateError::Fenced {
        holder: held.holder.clone(),
        token: held.token,
        current: uint(row.get(0)),
        active: row.get(1),
    })
}

fn leadership(row: &Row) -> Leadership {
    Leadership { holder: row.get(0), addr: row.get(1), token: uint(row.get(2)), expires_ms: uint(row.get(3)) }
}
