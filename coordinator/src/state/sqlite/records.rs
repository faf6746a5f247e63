//! Records by generation. The compare-and-set and the write happen in one `IMMEDIATE` transaction,
//! so a converge that started from generation 3 records only if 3 is still current when it writes:
//! two converges racing on one instance can never both record, and the loser's images are not
//! silently replaced by the winner's (or the other way round).

use rusqlite::{Connection, OptionalExtension, Row};

use super::{from_json, to_json, Cached, Ctx};
use crate::model::{Generation, Record, RecordedImage};
use crate::state::StateError;

const COLUMNS: &str = "instance, generation, images, written_at_ms";

/// The number of the instance's current generation, if it has a record.
pub(super) fn current(conn: &Connection, instance: &str) -> rusqlite::Result<Option<Generation>> {
    let actual: Option<u64> =
        conn.one_row("SELECT MAX(generation) FROM records WHERE instance = ?1", [instance], |row| row.get(0))?;
    Ok(actual.map(Generation))
}

/// The instance's `n`th newest generation: 0 = current, 1 = previous.
pub(super) fn nth(conn: &mut Connection, instance: &str, n: u32) -> Result<Option<Record>, StateError> {
    let what = || format!("reading the record of instance {instance}");
    let sql = format!("SELECT {COLUMNS} FROM records WHERE instance = ?1 ORDER BY generation DESC LIMIT 1 OFFSET ?2");
    let raw = conn.one_row(&sql, (instance, n), raw_row).optional().ctx(what)?;
    raw.map(decode).transpose()
}

pub(super) fn all(conn: &mut Connection) -> Result<Vec<(Record, Option<Record>)>, StateError> {
    let what = || "listing records".to_owned();
    let sql = format!("SELECT {COLUMNS} FROM records ORDER BY instance, generation DESC");
    let mut stmt = conn.prepare_cached(&sql).ctx(what)?;
    let raws = stmt.query_map([], raw_row).ctx(what)?.collect::<Result<Vec<_>, _>>().ctx(what)?;
    let mut out: Vec<(Record, Option<Record>)> = Vec::new();
    for raw in raws {
        let record = decode(raw)?;
        match out.last_mut() {
            Some((current, previous)) if current.instance == record.instance => {
                // Rows come newest first, so the first after the current one is the previous.
                if previous.is_none() {
                    *previous = Some(record);
                }
            }
            _ => out.push((record, None)),
        }
    }
    Ok(out)
}

pub(super) fn write(
    conn: &mut Connection,
    now_ms: u64,
    instance: &str,
    expected: Option<Generation>,
    images: &[RecordedImage],
) -> Result<Generation, StateError> {
    let what = || format!("writing the record of instance {instance}");
    let images = to_json(&images, what)?;
    let tx = conn.nested().ctx(what)?;
    let actual = current(&tx, instance).ctx(what)?;
    if actual != expected {
        return Err(StateError::RecordMoved { instance: instance.to_owned(), expected, actual });
    }
    let last: Option<u64> = tx
        .one_row("SELECT last_generation FROM instance_generations WHERE instance = ?1", [instance], |row| row.get(0))
        .optional()
        .ctx(what)?;
    let generation = last.unwrap_or(0) + 1;
    tx.exec(
        "INSERT INTO instance_generations (instance, last_generation) VALUES (?1, ?2) \
         ON CONFLICT (instance) DO UPDATE SET last_generation = excluded.last_generation",
        (instance, generation),
    )
    .ctx(what)?;
    tx.exec(
        "INSERT INTO records (instance, generation, images, written_at_ms) VALUES (?1, ?2, ?3, ?4)",
        (instance, generation, &images, now_ms),
    )
    .ctx(what)?;
    // Keep the generation just replaced: node stores sweep with it as their grace.
    if let Some(Generation(replaced)) = actual {
        tx.exec("DELETE FROM records WHERE instance = ?1 AND generation < ?2", (instance, replaced)).ctx(what)?;
    }
    tx.commit().ctx(what)?;
    Ok(Generation(generation))
}

pub(super) fn delete(conn: &mut Connection, instance: &str) -> Result<bool, StateError> {
    let what = || format!("deleting the record of instance {instance}");
    let deleted = conn.exec("DELETE FROM records WHERE instance = ?1", [instance]).ctx(what)?;
    Ok(deleted > 0)
}

struct RawRecord {
    instance: String,
    generation: u64,
    images: String,
    written_at_ms: u64,
}

fn raw_row(row: &Row<'_>) -> rusqlite::Result<RawRecord> {
    Ok(RawRecord { instance: row.get(0)?, generation: row.get(1)?, images: row.get(2)?, written_at_ms: row.get(3)? })
}

fn decode(raw: RawRecord) -> Result<Record, StateError> {
    let images = from_json(&raw.images, || format!("record {} generation {}", raw.instance, raw.generation))?;
    Ok(Record {
        instance: raw.instance,
        generation: Generation(raw.generation),
        images,
        written_at_ms: raw.written_at_ms,
    })
}
