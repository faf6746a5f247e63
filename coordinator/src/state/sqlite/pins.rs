//! Pins: refs a user asked every sweep to keep (`kiln pin`). A pin is a root like a record, but
//! it belongs to no instance, so `kiln down` never drops it; only `kiln unpin` does.

use rusqlite::Connection;

use super::{Cached, Ctx};
use crate::model::Pin;
use crate::state::StateError;

/// Inserts the pin; false when the ref was already pinned (the first pin's time and author stay).
pub(super) fn pin(conn: &mut Connection, now_ms: u64, reference: &str, by: &str) -> Result<bool, StateError> {
    let what = || format!("pinning {reference}");
    let inserted = conn
        .exec(
            "INSERT INTO pins (reference, pinned_at_ms, pinned_by) VALUES (?1, ?2, ?3) ON CONFLICT (reference) DO NOTHING",
            (reference, now_ms, by),
        )
        .ctx(what)?;
    Ok(inserted == 1)
}

/// Deletes the pin; false when there was none.
pub(super) fn unpin(conn: &mut Connection, reference: &str) -> Result<bool, StateError> {
    let what = || format!("unpinning {reference}");
    let deleted = conn.exec("DELETE FROM pins WHERE reference = ?1", [reference]).ctx(what)?;
    Ok(deleted == 1)
}

pub(super) fn all(conn: &mut Connection) -> Result<Vec<Pin>, StateError> {
    let what = || "listing pins".to_owned();
    let mut stmt =
        conn.prepare_cached("SELECT reference, pinned_at_ms, pinned_by FROM pins ORDER BY reference").ctx(what)?;
    let rows = stmt
        .query_map([], |row| Ok(Pin { reference: row.get(0)?, pinned_at_ms: row.get(1)?, pinned_by: row.get(2)? }))
        .ctx(what)?;
    rows.collect::<Result<Vec<_>, _>>().ctx(what)
}
