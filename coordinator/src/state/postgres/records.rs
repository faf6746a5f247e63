//! Records by generation. The compare-and-set runs under the instance's `instance_generations` row
//! lock: two coordinators recording one instance from generation 3 serialize there, and the second
//! reads the first's generation 4 (each statement sees what committed before it) and records
//! nothing. `kiln down` takes the same lock, so a record cannot land on top of a deletion it did
//! not see.

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;

use super::{execute, from_json, int, query, query_one, query_opt, uint, Ctx};
use crate::model::{Generation, Record};
use crate::state::StateError;

const COLUMNS: &str = "instance, generation, images::text, written_at_ms";

pub(super) const CURRENT: &str = "SELECT MAX(generation) FROM records WHERE instance = $1";

/// The number of the instance's current generation, if it has a record.
pub(super) async fn current<C: GenericClient>(
    c: &C,
    instance: &str,
    what: &str,
) -> Result<Option<Generation>, StateError> {
    let actual: Option<i64> = query_one(c, CURRENT, &[&instance]).await.ctx(what)?.get(0);
    Ok(actual.map(|g| Generation(uint(g))))
}

/// The instance's `n`th newest generation: 0 = current, 1 = previous.
pub(super) async fn nth<C: GenericClient>(
    c: &C,
    instance: &str,
    n: i64,
    what: &str,
) -> Result<Option<Record>, StateError> {
    let sql = format!("SELECT {COLUMNS} FROM records WHERE instance = $1 ORDER BY generation DESC LIMIT 1 OFFSET $2");
    query_opt(c, &sql, &[&instance, &n]).await.ctx(what)?.as_ref().map(decode).transpose()
}

pub(super) async fn all<C: GenericClient>(c: &C, what: &str) -> Result<Vec<(Record, Option<Record>)>, StateError> {
    let sql = format!("SELECT {COLUMNS} FROM records ORDER BY instance COLLATE \"C\", generation DESC");
    let mut out: Vec<(Record, Option<Record>)> = Vec::new();
    for row in query(c, &sql, &[]).await.ctx(what)? {
        let record = decode(&row)?;
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

pub(super) async fn write<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    instance: &str,
    expected: Option<Generation>,
    images_json: &str,
    what: &str,
) -> Result<Generation, StateError> {
    // Creates the instance's row if it is new and locks it either way (a conflicting `DO UPDATE`
    // locks the row it would have updated).
    let last: i64 = query_one(
        tx,
        "INSERT INTO instance_generations (instance, last_generation) VALUES ($1, 0) \
         ON CONFLICT (instance) DO UPDATE SET last_generation = instance_generations.last_generation \
         RETURNING last_generation",
        &[&instance],
    )
    .await
    .ctx(what)?
    .get(0);
    let actual = current(tx, instance, what).await?;
    if actual != expected {
        return Err(StateError::RecordMoved { instance: instance.to_owned(), expected, actual });
    }
    let generation = last + 1;
    execute(tx, "UPDATE instance_generations SET last_generation = $2 WHERE instance = $1", &[&instance, &generation])
        .await
        .ctx(what)?;
    execute(
        tx,
        "INSERT INTO records (instance, generation, images, written_at_ms) VALUES ($1, $2, $3::text::jsonb, $4)",
        &[&instance, &generation, &images_json, &int(now_ms)],
    )
    .await
    .ctx(what)?;
    // Keep the generation just replaced: node stores sweep with it as their grace.
    if let Some(Generation(replaced)) = actual {
        execute(tx, "DELETE FROM records WHERE instance = $1 AND generation < $2", &[&instance, &int(replaced)])
            .await
            .ctx(what)?;
    }
    Ok(Generation(uint(generation)))
}

pub(super) async fn delete<C: GenericClient>(tx: &C, instance: &str, what: &str) -> Result<bool, StateError> {
    execute(tx, "SELECT 1 FROM instance_generations WHERE instance = $1 FOR UPDATE", &[&instance]).await.ctx(what)?;
    let deleted = execute(tx, "DELETE FROM records WHERE instance = $1", &[&instance]).await.ctx(what)?;
    Ok(deleted > 0)
}

fn decode(row: &Row) -> Result<Record, StateError> {
    let (instance, generation): (String, i64) = (row.get(0), row.get(1));
    let images = from_json(row.get(2), || format!("record {instance} generation {generation}"))?;
    Ok(Record { instance, generation: Generation(uint(generation)), images, written_at_ms: uint(row.get(3)) })
}
