//! The plain keyed tables: agents as last seen, the context index and store inventories. Each write
//! replaces the row it names; none needs more than one statement.

use rusqlite::{Connection, OptionalExtension};

use super::{from_json, to_json, Cached, Ctx};
use crate::model::{AgentId, AgentRole, AgentRow, ContextRow, Inventory};
use crate::state::StateError;

pub(super) fn upsert_agent(conn: &mut Connection, agent: &AgentRow) -> Result<(), StateError> {
    let what = || format!("saving agent {}", agent.id);
    let stores = to_json(&agent.stores, what)?;
    let platforms = to_json(&agent.platforms, what)?;
    conn.exec(
        "INSERT INTO agents (id, role, stores, platforms, version, last_seen_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT (id) DO UPDATE SET role = excluded.role, stores = excluded.stores, \
         platforms = excluded.platforms, version = excluded.version, last_seen_ms = excluded.last_seen_ms",
        (&agent.id.0, agent.role.name(), &stores, &platforms, &agent.version, agent.last_seen_ms),
    )
    .ctx(what)?;
    Ok(())
}

pub(super) fn agents(conn: &mut Connection) -> Result<Vec<AgentRow>, StateError> {
    let what = || "listing agents".to_owned();
    let mut stmt = conn
        .prepare_cached("SELECT id, role, stores, platforms, version, last_seen_ms FROM agents ORDER BY id")
        .ctx(what)?;
    let rows = stmt
        .query_map([], |row| {
            Ok((
                row.get::<_, String>(0)?,
                row.get::<_, String>(1)?,
                row.get::<_, String>(2)?,
                row.get::<_, String>(3)?,
                row.get::<_, String>(4)?,
                row.get::<_, u64>(5)?,
            ))
        })
        .ctx(what)?
        .collect::<Result<Vec<_>, _>>()
        .ctx(what)?;
    rows.into_iter()
        .map(|(id, role, stores, platforms, version, last_seen_ms)| {
            let row_name = || format!("agent {id}");
            let role = AgentRole::from_name(&role).ok_or_else(|| StateError::Corrupt {
                what: row_name(),
                err: format!("role {role:?} is not host, node or both").into(),
            })?;
            let stores = from_json(&stores, row_name)?;
            let platforms = from_json(&platforms, row_name)?;
            Ok(AgentRow { id: AgentId(id), role, stores, platforms, version, last_seen_ms })
        })
        .collect()
}

pub(super) fn missing_contexts(conn: &mut Connection, digests: &[String]) -> Result<Vec<String>, StateError> {
    let what = || "looking up contexts".to_owned();
    let mut stmt = conn.prepare_cached("SELECT 1 FROM contexts WHERE digest = ?1").ctx(what)?;
    let mut missing: Vec<String> = Vec::new();
    for digest in digests {
        if missing.contains(digest) {
            continue;
        }
        if !stmt.exists([digest]).ctx(what)? {
            missing.push(digest.clone());
        }
    }
    Ok(missing)
}

pub(super) fn put_context(conn: &mut Connection, context: &ContextRow) -> Result<(), StateError> {
    let what = || format!("indexing context {}", context.digest);
    conn.exec(
        "INSERT INTO contexts (digest, bytes, stored_at_ms) VALUES (?1, ?2, ?3) \
         ON CONFLICT (digest) DO UPDATE SET bytes = excluded.bytes, stored_at_ms = excluded.stored_at_ms",
        (&context.digest, context.bytes, context.stored_at_ms),
    )
    .ctx(what)?;
    Ok(())
}

pub(super) fn context(conn: &mut Connection, digest: &str) -> Result<Option<ContextRow>, StateError> {
    let what = || format!("looking up context {digest}");
    conn.one_row("SELECT digest, bytes, stored_at_ms FROM contexts WHERE digest = ?1", [digest], |row| {
        Ok(ContextRow { digest: row.get(0)?, bytes: row.get(1)?, stored_at_ms: row.get(2)? })
    })
    .optional()
    .ctx(what)
}

pub(super) fn contexts(conn: &mut Connection) -> Result<Vec<ContextRow>, StateError> {
    let what = || "listing contexts".to_owned();
    let mut stmt = conn.prepare_cached("SELECT digest, bytes, stored_at_ms FROM contexts ORDER BY digest").ctx(what)?;
    let rows = stmt
        .query_map([], |row| Ok(ContextRow { digest: row.get(0)?, bytes: row.get(1)?, stored_at_ms: row.get(2)? }))
        .ctx(what)?
        .collect::<Result<Vec<_>, _>>()
        .ctx(what)?;
    Ok(rows)
}

/// Deletes the context's row unless a live claim names it, in one transaction that takes the write
/// lock first: a converge claims a context before it looks the context up, so either its claim is
/// seen here, or the row is already gone when it looks and it asks for an upload.
pub(super) fn delete_context_unless_claimed(
    conn: &mut Connection,
    digest: &str,
    claim: &str,
    now_ms: u64,
) -> Result<bool, StateError> {
    let what = || format!("collecting context {digest}");
    let tx = conn.nested().ctx(what)?;
    let claimed: bool = tx
        .one_row(
            "SELECT EXISTS (SELECT 1 FROM claims WHERE reference = ?1 AND expires_ms > ?2)",
            (claim, now_ms),
            |r| r.get(0),
        )
        .ctx(what)?;
    if claimed {
        return Ok(false);
    }
    let deleted = tx.exec("DELETE FROM contexts WHERE digest = ?1", [digest]).ctx(what)?;
    tx.exec("DELETE FROM context_entries WHERE digest = ?1", [digest]).ctx(what)?;
    tx.commit().ctx(what)?;
    Ok(deleted > 0)
}

pub(super) fn put_context_entries(conn: &mut Connection, digest: &str, stream: &[u8]) -> Result<(), StateError> {
    let what = || format!("keeping the entry list of context {digest}");
    conn.exec(
        "INSERT INTO context_entries (digest, stream) VALUES (?1, ?2) \
         ON CONFLICT (digest) DO UPDATE SET stream = excluded.stream",
        (digest, stream),
    )
    .ctx(what)?;
    Ok(())
}

pub(super) fn context_entries(conn: &mut Connection, digest: &str) -> Result<Option<Vec<u8>>, StateError> {
    let what = || format!("reading the entry list of context {digest}");
    conn.one_row("SELECT stream FROM context_entries WHERE digest = ?1", [digest], |row| row.get(0))
        .optional()
        .ctx(what)
}

pub(super) fn put_inventory(
    conn: &mut Connection,
    store: &str,
    listing: &str,
    listed_ms: u64,
) -> Result<(), StateError> {
    let what = || format!("saving the inventory of store {store}");
    conn.exec(
        "INSERT INTO inventories (store, listing, listed_ms) VALUES (?1, ?2, ?3) \
         ON CONFLICT (store) DO UPDATE SET listing = excluded.listing, listed_ms = excluded.listed_ms",
        (store, listing, listed_ms),
    )
    .ctx(what)?;
    Ok(())
}

pub(super) fn inventory(conn: &mut Connection, store: &str) -> Result<Option<Inventory>, StateError> {
    let what = || format!("reading the inventory of store {store}");
    conn.one_row("SELECT store, listing, listed_ms FROM inventories WHERE store = ?1", [store], |row| {
        Ok(Inventory { store: row.get(0)?, listing_json: row.get(1)?, listed_at_ms: row.get(2)? })
    })
    .optional()
    .ctx(what)
}
