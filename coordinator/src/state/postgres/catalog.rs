//! The plain keyed tables: agents as last seen, pins, the context index and store inventories.
//! Each write replaces (or, for a pin, keeps) the row it names in one statement.

use deadpool_postgres::GenericClient;

use super::{execute, from_json, int, query, query_one, query_opt, to_json, uint, Ctx};
use crate::model::{AgentId, AgentRole, AgentRow, ContextRow, Inventory, Pin};
use crate::state::StateError;

pub(super) async fn upsert_agent<C: GenericClient>(tx: &C, agent: &AgentRow, what: &str) -> Result<(), StateError> {
    let stores = to_json(&agent.stores, what)?;
    let platforms = to_json(&agent.platforms, what)?;
    execute(
        tx,
        "INSERT INTO agents (id, role, stores, platforms, version, last_seen_ms) \
         VALUES ($1, $2, $3::text::jsonb, $4::text::jsonb, $5, $6) \
         ON CONFLICT (id) DO UPDATE SET role = excluded.role, stores = excluded.stores, \
         platforms = excluded.platforms, version = excluded.version, last_seen_ms = excluded.last_seen_ms",
        &[&agent.id.0, &agent.role.name(), &stores, &platforms, &agent.version, &int(agent.last_seen_ms)],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn agents<C: GenericClient>(c: &C, what: &str) -> Result<Vec<AgentRow>, StateError> {
    let rows = query(
        c,
        "SELECT id, role, stores::text, platforms::text, version, last_seen_ms FROM agents ORDER BY id COLLATE \"C\"",
        &[],
    )
    .await
    .ctx(what)?;
    rows.iter()
        .map(|row| {
            let id: String = row.get(0);
            let row_name = || format!("agent {id}");
            let role: &str = row.get(1);
            let role = AgentRole::from_name(role).ok_or_else(|| StateError::Corrupt {
                what: row_name(),
                err: format!("role {role:?} is not host, node or both").into(),
            })?;
            let stores = from_json(row.get(2), row_name)?;
            let platforms = from_json(row.get(3), row_name)?;
            Ok(AgentRow {
                id: AgentId(id),
                role,
                stores,
                platforms,
                version: row.get(4),
                last_seen_ms: uint(row.get(5)),
            })
        })
        .collect()
}

/// Inserts the pin; false when the ref was already pinned (the first pin's time and author stay).
pub(super) async fn pin<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    reference: &str,
    by: &str,
    what: &str,
) -> Result<bool, StateError> {
    let inserted = execute(
        tx,
        "INSERT INTO pins (reference, pinned_at_ms, pinned_by) VALUES ($1, $2, $3) ON CONFLICT (reference) DO NOTHING",
        &[&reference, &int(now_ms), &by],
    )
    .await
    .ctx(what)?;
    Ok(inserted == 1)
}

/// Deletes the pin; false when there was none.
pub(super) async fn unpin<C: GenericClient>(tx: &C, reference: &str, what: &str) -> Result<bool, StateError> {
    let deleted = execute(tx, "DELETE FROM pins WHERE reference = $1", &[&reference]).await.ctx(what)?;
    Ok(deleted == 1)
}

pub(super) async fn pins<C: GenericClient>(c: &C, what: &str) -> Result<Vec<Pin>, StateError> {
    let rows = query(c, "SELECT reference, pinned_at_ms, pinned_by FROM pins ORDER BY reference COLLATE \"C\"", &[])
        .await
        .ctx(what)?;
    Ok(rows
        .iter()
        .map(|row| Pin { reference: row.get(0), pinned_at_ms: uint(row.get(1)), pinned_by: row.get(2) })
        .collect())
}

pub(super) async fn missing_contexts<C: GenericClient>(
    c: &C,
    digests: &[String],
    what: &str,
) -> Result<Vec<String>, StateError> {
    let rows = query(c, "SELECT digest FROM contexts WHERE digest = ANY($1::text[])", &[&digests]).await.ctx(what)?;
    let known: std::collections::HashSet<String> = rows.iter().map(|row| row.get(0)).collect();
    let mut missing: Vec<String> = Vec::new();
    for digest in digests {
        if !known.contains(digest) && !missing.contains(digest) {
            missing.push(digest.clone());
        }
    }
    Ok(missing)
}

pub(super) async fn put_context<C: GenericClient>(tx: &C, context: &ContextRow, what: &str) -> Result<(), StateError> {
    execute(
        tx,
        "INSERT INTO contexts (digest, bytes, stored_at_ms) VALUES ($1, $2, $3) \
         ON CONFLICT (digest) DO UPDATE SET bytes = excluded.bytes, stored_at_ms = excluded.stored_at_ms",
        &[&context.digest, &int(context.bytes), &int(context.stored_at_ms)],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn context<C: GenericClient>(
    c: &C,
    digest: &str,
    what: &str,
) -> Result<Option<ContextRow>, StateError> {
    let row = query_opt(c, "SELECT digest, bytes, stored_at_ms FROM contexts WHERE digest = $1", &[&digest])
        .await
        .ctx(what)?;
    Ok(row.map(|row| ContextRow { digest: row.get(0), bytes: uint(row.get(1)), stored_at_ms: uint(row.get(2)) }))
}

pub(super) async fn contexts<C: GenericClient>(c: &C, what: &str) -> Result<Vec<ContextRow>, StateError> {
    let rows = query(c, "SELECT digest, bytes, stored_at_ms FROM contexts ORDER BY digest COLLATE \"C\"", &[])
        .await
        .ctx(what)?;
    Ok(rows
        .iter()
        .map(|row| ContextRow { digest: row.get(0), bytes: uint(row.get(1)), stored_at_ms: uint(row.get(2)) })
        .collect())
}

/// Deletes the context's row unless a live claim `claim` names it. The claims table is locked
/// against writers first (`SHARE`: claims in flight commit before, new ones wait until after), as
/// SQLite's write lock does: a converge claims a context before it looks the context up, so either
/// its claim is seen here, or the row is already gone when it looks and it asks for an upload.
pub(super) async fn delete_context_unless_claimed<C: GenericClient>(
    tx: &C,
    digest: &str,
    claim: &str,
    now_ms: u64,
    what: &str,
) -> Result<bool, StateError> {
    tx.batch_execute("LOCK TABLE claims IN SHARE MODE").await.ctx(what)?;
    let claimed: bool = query_one(
        tx,
        "SELECT EXISTS (SELECT 1 FROM claims WHERE reference = $1 AND expires_ms > $2)",
        &[&claim, &int(now_ms)],
    )
    .await
    .ctx(what)?
    .get(0);
    if claimed {
        return Ok(false);
    }
    let deleted = execute(tx, "DELETE FROM contexts WHERE digest = $1", &[&digest]).await.ctx(what)?;
    execute(tx, "DELETE FROM context_entries WHERE digest = $1", &[&digest]).await.ctx(what)?;
    Ok(deleted > 0)
}

pub(super) async fn put_context_entries<C: GenericClient>(
    tx: &C,
    digest: &str,
    stream: &[u8],
    what: &str,
) -> Result<(), StateError> {
    execute(
        tx,
        "INSERT INTO context_entries (digest, stream) VALUES ($1, $2) \
         ON CONFLICT (digest) DO UPDATE SET stream = excluded.stream",
        &[&digest, &stream],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn context_entries<C: GenericClient>(
    c: &C,
    digest: &str,
    what: &str,
) -> Result<Option<Vec<u8>>, StateError> {
    let row = query_opt(c, "SELECT stream FROM context_entries WHERE digest = $1", &[&digest]).await.ctx(what)?;
    Ok(row.map(|row| row.get(0)))
}

pub(super) async fn put_inventory<C: GenericClient>(
    tx: &C,
    store: &str,
    listing: &str,
    listed_ms: u64,
    what: &str,
) -> Result<(), StateError> {
    execute(
        tx,
        "INSERT INTO inventories (store, listing, listed_ms) VALUES ($1, $2::text::json, $3) \
         ON CONFLICT (store) DO UPDATE SET listing = excluded.listing, listed_ms = excluded.listed_ms",
        &[&store, &listing, &int(listed_ms)],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn inventory<C: GenericClient>(
    c: &C,
    store: &str,
    what: &str,
) -> Result<Option<Inventory>, StateError> {
    let row = query_opt(c, "SELECT store, listing::text, listed_ms FROM inventories WHERE store = $1", &[&store])
        .await
        .ctx(what)?;
    Ok(row.map(|row| Inventory { store: row.get(0), listing_json: row.get(1), listed_at_ms: uint(row.get(2)) }))
}
