//! The trust tables on PostgreSQL: user tokens and join tokens (hashes only), revoked agents,
//! instance owners, and the audit log. Writes are fenced like every other write.

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;

use super::{execute, int, query, query_opt, uint, Ctx};
use crate::model::{AgentRole, AuditRow, JoinRow, Owner, TokenRow};
use crate::state::StateError;
use crate::trust::Role;

fn opt_uint(value: Option<i64>) -> Option<u64> {
    value.map(uint)
}

pub(super) async fn put_token<C: GenericClient>(tx: &C, t: &TokenRow, what: &str) -> Result<(), StateError> {
    execute(
        tx,
        "INSERT INTO tokens (id, hash, user_name, role, team, created_ms, expires_ms, revoked_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        &[
            &t.id,
            &t.hash,
            &t.user,
            &t.role.name(),
            &t.team,
            &int(t.created_ms),
            &t.expires_ms.map(int),
            &t.revoked_ms.map(int),
        ],
    )
    .await
    .ctx(what)?;
    Ok(())
}

fn token_row(row: &Row) -> TokenRow {
    let role: &str = row.get(3);
    TokenRow {
        id: row.get(0),
        hash: row.get(1),
        user: row.get(2),
        role: Role::parse(role).unwrap_or(Role::Viewer),
        team: row.get(4),
        created_ms: uint(row.get(5)),
        expires_ms: opt_uint(row.get(6)),
        revoked_ms: opt_uint(row.get(7)),
    }
}

const TOKEN_COLUMNS: &str = "id, hash, user_name, role, team, created_ms, expires_ms, revoked_ms";

pub(super) async fn token<C: GenericClient>(c: &C, id: &str, what: &str) -> Result<Option<TokenRow>, StateError> {
    let row = query_opt(c, &format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE id = $1"), &[&id]).await.ctx(what)?;
    Ok(row.as_ref().map(token_row))
}

pub(super) async fn tokens<C: GenericClient>(c: &C, what: &str) -> Result<Vec<TokenRow>, StateError> {
    let rows = query(c, &format!("SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_ms, id"), &[]).await.ctx(what)?;
    Ok(rows.iter().map(token_row).collect())
}

pub(super) async fn revoke_token<C: GenericClient>(
    tx: &C,
    id: &str,
    now_ms: u64,
    what: &str,
) -> Result<bool, StateError> {
    let n = execute(tx, "UPDATE tokens SET revoked_ms = $2 WHERE id = $1 AND revoked_ms IS NULL", &[&id, &int(now_ms)])
        .await
        .ctx(what)?;
    Ok(n == 1)
}

pub(super) async fn put_join<C: GenericClient>(tx: &C, j: &JoinRow, what: &str) -> Result<(), StateError> {
    execute(
        tx,
        "INSERT INTO join_tokens (id, hash, role, cluster, created_ms, expires_ms, used_ms) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[&j.id, &j.hash, &j.role.name(), &j.cluster, &int(j.created_ms), &int(j.expires_ms), &j.used_ms.map(int)],
    )
    .await
    .ctx(what)?;
    Ok(())
}

/// Uses the join token once: its row is locked, so two agents presenting it at once serialize and
/// the second sees it used.
pub(super) async fn use_join<C: GenericClient>(
    tx: &C,
    id: &str,
    now_ms: u64,
    what: &str,
) -> Result<Option<JoinRow>, StateError> {
    let row = query_opt(
        tx,
        "SELECT id, hash, role, cluster, created_ms, expires_ms, used_ms FROM join_tokens WHERE id = $1 FOR UPDATE",
        &[&id],
    )
    .await
    .ctx(what)?;
    let Some(row) = row else { return Ok(None) };
    let role: &str = row.get(2);
    let join = JoinRow {
        id: row.get(0),
        hash: row.get(1),
        role: AgentRole::from_name(role).unwrap_or(AgentRole::Host),
        cluster: row.get(3),
        created_ms: uint(row.get(4)),
        expires_ms: uint(row.get(5)),
        used_ms: opt_uint(row.get(6)),
    };
    if join.used_ms.is_none() {
        execute(tx, "UPDATE join_tokens SET used_ms = $2 WHERE id = $1", &[&id, &int(now_ms)]).await.ctx(what)?;
    }
    Ok(Some(join))
}

pub(super) async fn revoke_agent<C: GenericClient>(
    tx: &C,
    id: &str,
    now_ms: u64,
    what: &str,
) -> Result<bool, StateError> {
    let n = execute(
        tx,
        "INSERT INTO revoked_agents (id, revoked_ms) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET revoked_ms = excluded.revoked_ms WHERE revoked_agents.revoked_ms < excluded.revoked_ms",
        &[&id, &int(now_ms)],
    )
    .await
    .ctx(what)?;
    Ok(n == 1)
}

pub(super) async fn revoked_agents<C: GenericClient>(c: &C, what: &str) -> Result<Vec<(String, u64)>, StateError> {
    let rows = query(c, "SELECT id, revoked_ms FROM revoked_agents ORDER BY id", &[]).await.ctx(what)?;
    Ok(rows.iter().map(|r| (r.get(0), uint(r.get(1)))).collect())
}

pub(super) async fn own<C: GenericClient>(
    tx: &C,
    instance: &str,
    claim: &Owner,
    what: &str,
) -> Result<Owner, StateError> {
    execute(
        tx,
        "INSERT INTO owners (instance, team, user_name) VALUES ($1, $2, $3) ON CONFLICT (instance) DO NOTHING",
        &[&instance, &claim.team, &claim.user],
    )
    .await
    .ctx(what)?;
    let row = query_opt(tx, "SELECT team, user_name FROM owners WHERE instance = $1", &[&instance]).await.ctx(what)?;
    Ok(row.map_or_else(|| claim.clone(), |r| Owner { team: r.get(0), user: r.get(1) }))
}

pub(super) async fn owner<C: GenericClient>(c: &C, instance: &str, what: &str) -> Result<Option<Owner>, StateError> {
    let row = query_opt(c, "SELECT team, user_name FROM owners WHERE instance = $1", &[&instance]).await.ctx(what)?;
    Ok(row.map(|r| Owner { team: r.get(0), user: r.get(1) }))
}

pub(super) async fn append_audit<C: GenericClient>(tx: &C, a: &AuditRow, what: &str) -> Result<(), StateError> {
    execute(
        tx,
        "INSERT INTO audit (at_ms, actor, action, target, address, outcome) VALUES ($1, $2, $3, $4, $5, $6)",
        &[&int(a.at_ms), &a.actor, &a.action, &a.target, &a.address, &a.outcome],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn audit<C: GenericClient>(
    c: &C,
    since_ms: u64,
    actor: Option<&str>,
    what: &str,
) -> Result<Vec<AuditRow>, StateError> {
    let rows = query(
        c,
        "SELECT at_ms, actor, action, target, address, outcome FROM audit \
         WHERE at_ms >= $1 AND ($2::text IS NULL OR actor = $2) ORDER BY seq",
        &[&int(since_ms), &actor],
    )
    .await
    .ctx(what)?;
    Ok(rows
        .iter()
        .map(|r| AuditRow {
            at_ms: uint(r.get(0)),
            actor: r.get(1),
            action: r.get(2),
            target: r.get(3),
            address: r.get(4),
            outcome: r.get(5),
        })
        .collect())
}
