//! Claims: an in-flight converge's hold on the refs it is about to build or deliver, each a sweep
//! root until its lease runs out. Only a running converge may claim or renew: claims taken for a
//! converge that already finished would hold images nobody is going to use.

use rusqlite::Connection;

use super::converges::state_of;
use super::{Cached, Ctx};
use crate::model::{Claim, ConvergeId, ConvergeState};
use crate::state::StateError;

pub(super) fn claim(
    conn: &mut Connection,
    id: &ConvergeId,
    refs: &[String],
    expires_ms: u64,
) -> Result<(), StateError> {
    let what = || format!("claiming refs for converge {id}");
    let tx = conn.nested().ctx(what)?;
    require_running(&tx, id)?;
    {
        let mut stmt = tx
            .prepare_cached(
                "INSERT INTO claims (converge_id, reference, expires_ms) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (converge_id, reference) DO UPDATE SET expires_ms = excluded.expires_ms",
            )
            .ctx(what)?;
        for reference in refs {
            stmt.execute((id.as_str(), reference, expires_ms)).ctx(what)?;
        }
    }
    tx.commit().ctx(what)
}

pub(super) fn renew(conn: &mut Connection, id: &ConvergeId, expires_ms: u64) -> Result<usize, StateError> {
    let what = || format!("renewing the claims of converge {id}");
    let tx = conn.nested().ctx(what)?;
    require_running(&tx, id)?;
    let renewed =
        tx.exec("UPDATE claims SET expires_ms = ?2 WHERE converge_id = ?1", (id.as_str(), expires_ms)).ctx(what)?;
    tx.commit().ctx(what)?;
    Ok(renewed)
}

pub(super) fn release(conn: &mut Connection, id: &ConvergeId) -> Result<(), StateError> {
    let what = || format!("releasing the claims of converge {id}");
    conn.exec("DELETE FROM claims WHERE converge_id = ?1", [id.as_str()]).ctx(what)?;
    Ok(())
}

pub(super) fn live(conn: &mut Connection, now_ms: u64) -> Result<Vec<Claim>, StateError> {
    let what = || "listing live claims".to_owned();
    let tx = conn.nested().ctx(what)?;
    tx.exec("DELETE FROM claims WHERE expires_ms <= ?1", [now_ms]).ctx(what)?;
    let claims = all(&tx)?;
    tx.commit().ctx(what)?;
    Ok(claims)
}

fn all(conn: &Connection) -> Result<Vec<Claim>, StateError> {
    let what = || "listing live claims".to_owned();
    let mut stmt = conn
        .prepare_cached("SELECT converge_id, reference, expires_ms FROM claims ORDER BY reference, converge_id")
        .ctx(what)?;
    let rows = stmt
        .query_map([], |row| {
            Ok(Claim {
                converge: ConvergeId::from(row.get::<_, String>(0)?),
                reference: row.get(1)?,
                expires_ms: row.get(2)?,
            })
        })
        .ctx(what)?;
    rows.collect::<Result<Vec<_>, _>>().ctx(what)
}

fn require_running(conn: &Connection, id: &ConvergeId) -> Result<(), StateError> {
    match state_of(conn, id)? {
        None => Err(StateError::UnknownConverge { id: id.clone() }),
        Some(ConvergeState::Running) => Ok(()),
        Some(state) => Err(StateError::ConvergeFinished { id: id.clone(), state }),
    }
}
