//! Claims: an in-flight converge's hold on the refs it is about to build or deliver, each a sweep
//! root until its lease runs out. Only a running converge may claim or renew; the check locks the
//! converge's row `FOR SHARE` until the claims are in, so a finish from another coordinator waits
//! for them rather than slipping between the check and the insert.

use deadpool_postgres::GenericClient;

use super::converges::state_of;
use super::{execute, int, query, uint, Ctx};
use crate::model::{Claim, ConvergeId, ConvergeState};
use crate::state::StateError;

pub(super) async fn claim<C: GenericClient>(
    tx: &C,
    id: &ConvergeId,
    refs: &[String],
    expires_ms: u64,
    what: &str,
) -> Result<(), StateError> {
    require_running(tx, id, what).await?;
    // One statement for every ref; `DISTINCT`, because `ON CONFLICT DO UPDATE` refuses to touch a
    // row twice in one statement.
    execute(
        tx,
        "INSERT INTO claims (converge_id, reference, expires_ms) \
         SELECT DISTINCT $1, reference, $3::bigint FROM unnest($2::text[]) AS reference \
         ON CONFLICT (converge_id, reference) DO UPDATE SET expires_ms = excluded.expires_ms",
        &[&id.as_str(), &refs, &int(expires_ms)],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn renew<C: GenericClient>(
    tx: &C,
    id: &ConvergeId,
    expires_ms: u64,
    what: &str,
) -> Result<usize, StateError> {
    require_running(tx, id, what).await?;
    let renewed =
        execute(tx, "UPDATE claims SET expires_ms = $2 WHERE converge_id = $1", &[&id.as_str(), &int(expires_ms)])
            .await
            .ctx(what)?;
    Ok(renewed as usize)
}

pub(super) async fn release<C: GenericClient>(tx: &C, id: &ConvergeId, what: &str) -> Result<(), StateError> {
    execute(tx, "DELETE FROM claims WHERE converge_id = $1", &[&id.as_str()]).await.ctx(what)?;
    Ok(())
}

pub(super) async fn live<C: GenericClient>(tx: &C, now_ms: u64, what: &str) -> Result<Vec<Claim>, StateError> {
    execute(tx, "DELETE FROM claims WHERE expires_ms <= $1", &[&int(now_ms)]).await.ctx(what)?;
    let rows = query(
        tx,
        "SELECT converge_id, reference, expires_ms FROM claims ORDER BY reference COLLATE \"C\", converge_id COLLATE \"C\"",
        &[],
    )
    .await
    .ctx(what)?;
    Ok(rows
        .iter()
        .map(|row| Claim {
            converge: ConvergeId::from(row.get::<_, String>(0)),
            reference: row.get(1),
            expires_ms: uint(row.get(2)),
        })
        .collect())
}

async fn require_running<C: GenericClient>(tx: &C, id: &ConvergeId, what: &str) -> Result<(), StateError> {
    match state_of(tx, id, "FOR SHARE", what).await? {
        None => Err(StateError::UnknownConverge { id: id.clone() }),
        Some(ConvergeState::Running) => Ok(()),
        Some(state) => Err(StateError::ConvergeFinished { id: id.clone(), state }),
    }
}
