//! The trust tables: user tokens and join tokens (hashes only), revoked agents, instance owners,
//! and the audit log.

use rusqlite::{Connection, OptionalExtension};

use super::{Cached, Ctx};
use crate::model::{AgentRole, AuditRow, JoinRow, Owner, TokenRow};
use crate::state::StateError;
use crate::trust::Role;

pub(super) fn put_token(conn: &mut Connection, t: &TokenRow) -> Result<(), StateError> {
    let what = || format!("saving token {}", t.id);
    conn.exec(
        "INSERT INTO tokens (id, hash, user_name, role, team, created_ms, expires_ms, revoked_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        (&t.id, &t.hash, &t.user, t.role.name(), &t.team, t.created_ms, t.expires_ms, t.revoked_ms),
    )
    .ctx(what)?;
    Ok(())
}

fn token_row(row: &rusqlite::Row<'_>) -> rusqlite::Result<TokenRow> {
    let role: String = row.get(3)?;
    Ok(TokenRow {
        id: row.get(0)?,
        hash: row.get(1)?,
        user: row.get(2)?,
        role: Role::parse(&role).unwrap_or(Role::Viewer),
        team: row.get(4)?,
        created_ms: row.get(5)?,
        expires_ms: row.get(6)?,
        revoked_ms: row.get(7)?,
    })
}

const TOKEN_COLUMNS: &str = "id, hash, user_name, role, team, created_ms, expires_ms, revoked_ms";

pub(super) fn token(conn: &mut Connection, id: &str) -> Result<Option<TokenRow>, StateError> {
    let what = || format!("reading token {id}");
    conn.one_row(&format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE id = ?1"), [id], token_row).optional().ctx(what)
}

pub(super) fn tokens(conn: &mut Connection) -> Result<Vec<TokenRow>, StateError> {
    let what = || "listing tokens".to_owned();
    let mut stmt =
        conn.prepare_cached(&format!("SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_ms, id")).ctx(what)?;
    let rows = stmt.query_map([], token_row).ctx(what)?;
    rows.collect::<Result<Vec<_>, _>>().ctx(what)
}

pub(super) fn revoke_token(conn: &mut Connection, id: &str, now_ms: u64) -> Result<bool, StateError> {
    let what = || format!("revoking token {id}");
    let n =
        conn.exec("UPDATE tokens SET revoked_ms = ?2 WHERE id = ?1 AND revoked_ms IS NULL", (id, now_ms)).ctx(what)?;
    Ok(n == 1)
}

pub(super) fn put_join(conn: &mut Connection, j: &JoinRow) -> Result<(), StateError> {
    let what = || format!("saving join token {}", j.id);
    conn.exec(
        "INSERT INTO join_tokens (id, hash, role, cluster, created_ms, expires_ms, used_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        (&j.id, &j.hash, j.role.name(), &j.cluster, j.created_ms, j.expires_ms, j.used_ms),
    )
    .ctx(what)?;
    Ok(())
}

/// Marks join token `id` used, once: in one write transaction, so two agents presenting the same
/// token at once cannot both enroll. Returns the row as it was when this call used it.
pub(super) fn use_join(conn: &mut Connection, id: &str, now_ms: u64) -> Result<Option<JoinRow>, StateError> {
    let what = || format!("using join token {id}");
    let tx = conn.nested().ctx(what)?;
    let row = tx
        .one_row(
            "SELECT id, hash, role, cluster, created_ms, expires_ms, used_ms FROM join_tokens WHERE id = ?1",
            [id],
            |row| {
                let role: String = row.get(2)?;
                Ok(JoinRow {
                    id: row.get(0)?,
                    hash: row.get(1)?,
                    role: AgentRole::from_name(&role).unwrap_or(AgentRole::Host),
                    cluster: row.get(3)?,
                    created_ms: row.get(4)?,
                    expires_ms: row.get(5)?,
                    used_ms: row.get(6)?,
                })
            },
        )
        .optional()
        .ctx(what)?;
    let Some(row) = row else { return Ok(None) };
    if row.used_ms.is_none() {
        tx.exec("UPDATE join_tokens SET used_ms = ?2 WHERE id = ?1", (id, now_ms)).ctx(what)?;
        tx.commit().ctx(what)?;
    }
    Ok(Some(row))
}

/// Revokes up to `now_ms`; a later revocation of the same id moves the line forward.
pub(super) fn revoke_agent(conn: &mut Connection, id: &str, now_ms: u64) -> Result<bool, StateError> {
    let what = || format!("revoking agent {id}");
    let n = conn
        .exec(
            "INSERT INTO revoked_agents (id, revoked_ms) VALUES (?1, ?2) \
             ON CONFLICT (id) DO UPDATE SET revoked_ms = excluded.revoked_ms WHERE revoked_ms < excluded.revoked_ms",
            (id, now_ms),
        )
        .ctx(what)?;
    Ok(n == 1)
}

pub(super) fn revoked_agents(conn: &mut Connection) -> Result<Vec<(String, u64)>, StateError> {
    let what = || "listing revoked agents".to_owned();
    let mut stmt = conn.prepare_cached("SELECT id, revoked_ms FROM revoked_agents ORDER BY id").ctx(what)?;
    let rows = stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?))).ctx(what)?;
    rows.collect::<Result<Vec<_>, _>>().ctx(what)
}

/// The instance's owner, setting `claim` as it when it has none yet (in one transaction).
pub(super) fn own(conn: &mut Connection, instance: &str, claim: &Owner) -> Result<Owner, StateError> {
    let what = || format!("reading the owner of instance {instance}");
    let tx = conn.nested().ctx(what)?;
    tx.exec(
        "INSERT INTO owners (instance, team, user_name) VALUES (?1, ?2, ?3) ON CONFLICT (instance) DO NOTHING",
        (instance, &claim.team, &claim.user),
    )
    .ctx(what)?;
    let owner = tx
        .one_row("SELECT team, user_name FROM owners WHERE instance = ?1", [instance], |row| {
            Ok(Owner { team: row.get(0)?, user: row.get(1)? })
        })
        .ctx(what)?;
    tx.commit().ctx(what)?;
    Ok(owner)
}

pub(super) fn owner(conn: &mut Connection, instance: &str) -> Result<Option<Owner>, StateError> {
    let what = || format!("reading the owner of instance {instance}");
    conn.one_row("SELECT team, user_name FROM owners WHERE instance = ?1", [instance], |row| {
        Ok(Owner { team: row.get(0)?, user: row.get(1)? })
    })
    .optional()
    .ctx(what)
}

pub(super) fn append_audit(conn: &mut Connection, a: &AuditRow) -> Result<(), StateError> {
    let what = || format!("writing the audit log ({} {})", a.action, a.target);
    conn.exec(
        "INSERT INTO audit (at_ms, actor, action, target, address, outcome) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        (a.at_ms, &a.actor, &a.action, &a.target, &a.address, &a.outcome),
    )
    .ctx(what)?;
    Ok(())
}

pub(super) fn audit(conn: &mut Connection, since_ms: u64, actor: Option<&str>) -> Result<Vec<AuditRow>, StateError> {
    let what = || "reading the audit log".to_owned();
    let mut stmt = conn
        .prepare_cached(
            "SELECT at_ms, actor, action, target, address, outcome FROM audit \
             WHERE at_ms >= ?1 AND (?2 IS NULL OR actor = ?2) ORDER BY seq",
        )
        .ctx(what)?;
    let rows = stmt
        .query_map((since_ms, actor), |row| {
            Ok(AuditRow {
                at_ms: row.get(0)?,
                actor: row.get(1)?,
                action: row.get(2)?,
                target: row.get(3)?,
                address: row.get(4)?,
                outcome: row.get(5)?,
            })
        })
        .ctx(what)?;
    rows.collect::<Result<Vec<_>, _>>().ctx(what)
}
