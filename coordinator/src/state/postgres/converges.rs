//! Converges and their event logs. One running converge per instance is the partial unique index
//! `converges_one_running`: an open inserts with `ON CONFLICT … DO NOTHING`, which waits for a
//! concurrent open of the same instance to commit or roll back, so of two coordinators racing, one
//! inserts and the other is told which converge runs. Event seqs come from the converge's
//! `last_seq`, bumped by an `UPDATE` that locks the converge's row: gap-free per converge, however
//! many coordinators' tasks append at once.

use deadpool_postgres::GenericClient;
use tokio_postgres::Row;

use super::{execute, from_json, int, query, query_opt, to_json, uint, Ctx};
use crate::model::{Converge, ConvergeId, ConvergeState, Event, EventKind, Generation};
use crate::state::StateError;

const COLUMNS: &str = "id, instance, state, reason, started_ms, finished_ms, requested_by";

/// A settled converge's open: running (so the one-running index decides), its events' seqs taken.
const OPEN_SETTLED: &str = "INSERT INTO converges (id, instance, state, started_ms, requested_by, last_seq) \
     VALUES ($1, $2, 'running', $3, $4, $5) ON CONFLICT (instance) WHERE state = 'running' DO NOTHING";
const FINISH_SETTLED: &str =
    "UPDATE converges SET state = 'succeeded', finished_ms = $2 WHERE id = $1 AND state = 'running'";
const INSERT_EVENTS: &str = "INSERT INTO events (converge_id, seq, at_ms, image, kind, message) \
     SELECT $1, e.seq, $3, e.image, e.kind::jsonb, e.message \
     FROM UNNEST($2::bigint[], $4::text[], $5::text[], $6::text[]) AS e(seq, image, kind, message)";

/// How often an open retries when the converge it lost to finished before it could be named.
const OPEN_ATTEMPTS: usize = 3;

/// Opens a running converge of `instance`, as `chosen` when the caller named its id (a converge
/// decided before it was stored), else under a new one.
pub(super) async fn open<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    chosen: Option<&ConvergeId>,
    instance: &str,
    requested_by: &str,
    what: &str,
) -> Result<Converge, StateError> {
    for _ in 0..OPEN_ATTEMPTS {
        let converge = Converge {
            id: chosen.cloned().unwrap_or_else(|| ConvergeId::generate(now_ms)),
            instance: instance.to_owned(),
            state: ConvergeState::Running,
            started_ms: now_ms,
            finished_ms: None,
            requested_by: requested_by.to_owned(),
        };
        let inserted = execute(
            tx,
            "INSERT INTO converges (id, instance, state, started_ms, requested_by) VALUES ($1, $2, 'running', $3, $4) \
             ON CONFLICT (instance) WHERE state = 'running' DO NOTHING",
            &[&converge.id.as_str(), &instance, &int(now_ms), &requested_by],
        )
        .await
        .ctx(what)?;
        if inserted == 1 {
            return Ok(converge);
        }
        let running = query_opt(tx, "SELECT id FROM converges WHERE instance = $1 AND state = 'running'", &[&instance])
            .await
            .ctx(what)?;
        if let Some(row) = running {
            return Err(StateError::ConvergeRunning {
                instance: instance.to_owned(),
                running: row.get::<_, String>(0).into(),
            });
        }
        // The converge that blocked this one finished in between: try again.
    }
    Err(StateError::Backend {
        what: what.to_owned(),
        err: format!(
            "other converges of {instance} kept starting and finishing; {OPEN_ATTEMPTS} attempts lost the race"
        )
        .into(),
    })
}

pub(super) async fn append_event<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    id: &ConvergeId,
    kind: EventKind,
    image: Option<&str>,
    message: &str,
    what: &str,
) -> Result<Event, StateError> {
    let seq = next_seq(tx, id, what).await?.ok_or_else(|| StateError::UnknownConverge { id: id.clone() })?;
    insert_event(tx, now_ms, id, seq, kind, image, message, what).await
}

/// Appends `events` in order in one round of statements: the seqs are taken in one bump of
/// `last_seq` and the rows go in one `INSERT`, so a burst costs what one event costs.
pub(super) async fn append_events<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    id: &ConvergeId,
    events: Vec<(EventKind, Option<String>, String)>,
    what: &str,
) -> Result<Vec<Event>, StateError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let count = events.len() as u64;
    let row = query_opt(
        tx,
        "UPDATE converges SET last_seq = last_seq + $2 WHERE id = $1 RETURNING last_seq",
        &[&id.as_str(), &int(count)],
    )
    .await
    .ctx(what)?;
    let last = row.map(|row| uint(row.get(0))).ok_or_else(|| StateError::UnknownConverge { id: id.clone() })?;
    insert_events(tx, now_ms, id, last + 1 - count, events, what).await
}

/// The statements of a settled converge (`id`, opened and finished at once with `events`), sent
/// together so the transaction costs one round trip before its commit rather than five: under a
/// farm's load each round trip waits for both processes to be scheduled, and the connection is
/// held the while. They run in the order written: the open first (so no other converge of the
/// instance records from then on), then the record's generation, then the events and the finish.
/// Returns whether the open inserted (no other converge of the instance runs), the record's
/// generation, and the stored events; when the open did not insert, the statements after it
/// fail or change nothing, and the caller rolls back.
pub(super) async fn settle<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    id: &ConvergeId,
    instance: &str,
    requested_by: &str,
    events: Vec<(EventKind, Option<String>, String)>,
    what: &str,
) -> (Result<bool, StateError>, Result<Option<Generation>, StateError>, Result<Vec<Event>, StateError>) {
    let count = int(events.len() as u64);
    let open = async {
        let inserted = execute(tx, OPEN_SETTLED, &[&id.as_str(), &instance, &int(now_ms), &requested_by, &count]).await;
        Ok(inserted.ctx(what)? == 1)
    };
    let finish = async {
        let finished = execute(tx, FINISH_SETTLED, &[&id.as_str(), &int(now_ms)]).await;
        match finished.ctx(what)? {
            1 => Ok(()),
            _ => Err(StateError::UnknownConverge { id: id.clone() }),
        }
    };
    // Each statement goes out on its first poll, which `join!` makes in the order written — once
    // all four are prepared: on a connection that had prepared only some, the ones it had would
    // run ahead of the others (the events before the converge they belong to).
    let prepared = futures_util::future::try_join_all(
        [OPEN_SETTLED, super::records::CURRENT, INSERT_EVENTS, FINISH_SETTLED].map(|sql| tx.prepare_cached(sql)),
    );
    if let Err(err) = prepared.await.ctx(what) {
        let failed = || StateError::Backend { what: what.to_owned(), err: "an earlier statement failed".into() };
        return (Err(err), Err(failed()), Err(failed()));
    }
    let (opened, generation, stored, finished) = futures_util::join!(
        open,
        super::records::current(tx, instance, what),
        insert_events(tx, now_ms, id, 1, events, what),
        finish
    );
    (opened, generation, stored.and_then(|stored| finished.map(|()| stored)))
}

/// Inserts `events` as the seqs from `first` on, in one statement.
async fn insert_events<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    id: &ConvergeId,
    first: u64,
    events: Vec<(EventKind, Option<String>, String)>,
    what: &str,
) -> Result<Vec<Event>, StateError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let last = first + events.len() as u64 - 1;
    let seqs: Vec<i64> = (first..=last).map(int).collect();
    let kinds = events.iter().map(|(kind, _, _)| to_json(kind, what)).collect::<Result<Vec<String>, _>>()?;
    let images: Vec<Option<&str>> = events.iter().map(|(_, image, _)| image.as_deref()).collect();
    let messages: Vec<&str> = events.iter().map(|(_, _, message)| message.as_str()).collect();
    execute(tx, INSERT_EVENTS, &[&id.as_str(), &seqs, &int(now_ms), &images, &kinds, &messages]).await.ctx(what)?;
    Ok(events
        .into_iter()
        .zip(first..)
        .map(|((kind, image, message), seq)| Event { seq, at_ms: now_ms, image, kind, message })
        .collect())
}

pub(super) async fn events<C: GenericClient>(
    c: &C,
    id: &ConvergeId,
    after_seq: Option<u64>,
    what: &str,
) -> Result<Vec<Event>, StateError> {
    if query_opt(c, "SELECT 1 FROM converges WHERE id = $1", &[&id.as_str()]).await.ctx(what)?.is_none() {
        return Err(StateError::UnknownConverge { id: id.clone() });
    }
    let rows = query(
        c,
        "SELECT seq, at_ms, image, kind::text, message FROM events WHERE converge_id = $1 AND seq > $2 ORDER BY seq",
        &[&id.as_str(), &int(after_seq.unwrap_or(0))],
    )
    .await
    .ctx(what)?;
    rows.iter()
        .map(|row| {
            let seq = uint(row.get(0));
            let kind = from_json(row.get(3), || format!("event {seq} of converge {id}"))?;
            Ok(Event { seq, at_ms: uint(row.get(1)), image: row.get(2), kind, message: row.get(4) })
        })
        .collect()
}

/// The converge that most recently started building `reference`, from its `building` event.
pub(super) async fn builder_of<C: GenericClient>(
    c: &C,
    reference: &str,
    what: &str,
) -> Result<Option<ConvergeId>, StateError> {
    // Matches the partial index `events_building`.
    let row = query_opt(
        c,
        "SELECT converge_id FROM events WHERE kind->>'kind' = 'building' AND kind->>'reference' = $1 \
         ORDER BY at_ms DESC, converge_id COLLATE \"C\" DESC, seq DESC LIMIT 1",
        &[&reference],
    )
    .await
    .ctx(what)?;
    Ok(row.map(|row| ConvergeId::from(row.get::<_, String>(0))))
}

pub(super) async fn finish<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    id: &ConvergeId,
    state: &ConvergeState,
    what: &str,
) -> Result<(), StateError> {
    let reason = match state {
        ConvergeState::Running => return Err(StateError::FinishAsRunning { id: id.clone() }),
        ConvergeState::Succeeded => None,
        ConvergeState::Failed { reason } => Some(reason.as_str()),
    };
    match state_of(tx, id, "FOR UPDATE", what).await? {
        None => return Err(StateError::UnknownConverge { id: id.clone() }),
        Some(ConvergeState::Running) => {}
        Some(finished) => return Err(StateError::ConvergeFinished { id: id.clone(), state: finished }),
    }
    execute(
        tx,
        "UPDATE converges SET state = $2, reason = $3, finished_ms = $4 WHERE id = $1",
        &[&id.as_str(), &state.name(), &reason, &int(now_ms)],
    )
    .await
    .ctx(what)?;
    Ok(())
}

pub(super) async fn get<C: GenericClient>(c: &C, id: &ConvergeId, what: &str) -> Result<Option<Converge>, StateError> {
    let sql = format!("SELECT {COLUMNS} FROM converges WHERE id = $1");
    query_opt(c, &sql, &[&id.as_str()]).await.ctx(what)?.as_ref().map(decode).transpose()
}

pub(super) async fn list<C: GenericClient>(
    c: &C,
    instance: Option<&str>,
    limit: usize,
    what: &str,
) -> Result<Vec<Converge>, StateError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let sql = format!(
        "SELECT {COLUMNS} FROM converges WHERE $1::text IS NULL OR instance = $1 \
         ORDER BY started_ms DESC, id COLLATE \"C\" DESC LIMIT $2"
    );
    query(c, &sql, &[&instance, &limit]).await.ctx(what)?.iter().map(decode).collect()
}

pub(super) async fn fail_in_flight<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    reason: &str,
    what: &str,
) -> Result<Vec<ConvergeId>, StateError> {
    let rows = query(
        tx,
        "UPDATE converges SET state = 'failed', reason = $1, finished_ms = $2, last_seq = last_seq + 1 \
         WHERE state = 'running' RETURNING id, last_seq",
        &[&reason, &int(now_ms)],
    )
    .await
    .ctx(what)?;
    let mut failed: Vec<(ConvergeId, u64)> =
        rows.iter().map(|row| (ConvergeId::from(row.get::<_, String>(0)), uint(row.get(1)))).collect();
    failed.sort();
    for (id, seq) in &failed {
        insert_event(tx, now_ms, id, *seq, EventKind::Failed, None, reason, what).await?;
    }
    Ok(failed.into_iter().map(|(id, _)| id).collect())
}

/// The converge's state, `None` if there is no such converge; `lock` is `FOR UPDATE` or `FOR SHARE`.
pub(super) async fn state_of<C: GenericClient>(
    tx: &C,
    id: &ConvergeId,
    lock: &str,
    what: &str,
) -> Result<Option<ConvergeState>, StateError> {
    let sql = format!("SELECT state, reason FROM converges WHERE id = $1 {lock}");
    let row = query_opt(tx, &sql, &[&id.as_str()]).await.ctx(what)?;
    row.map(|row| decode_state(id, row.get(0), row.get(1))).transpose()
}

/// Takes the converge's next event seq, locking its row until the transaction ends.
async fn next_seq<C: GenericClient>(tx: &C, id: &ConvergeId, what: &str) -> Result<Option<u64>, StateError> {
    let row =
        query_opt(tx, "UPDATE converges SET last_seq = last_seq + 1 WHERE id = $1 RETURNING last_seq", &[&id.as_str()])
            .await
            .ctx(what)?;
    Ok(row.map(|row| uint(row.get(0))))
}

#[allow(clippy::too_many_arguments)] // one event's columns, and where and why it is written
async fn insert_event<C: GenericClient>(
    tx: &C,
    now_ms: u64,
    id: &ConvergeId,
    seq: u64,
    kind: EventKind,
    image: Option<&str>,
    message: &str,
    what: &str,
) -> Result<Event, StateError> {
    let kind_json = to_json(&kind, what)?;
    execute(
        tx,
        "INSERT INTO events (converge_id, seq, at_ms, image, kind, message) VALUES ($1, $2, $3, $4, $5::text::jsonb, $6)",
        &[&id.as_str(), &int(seq), &int(now_ms), &image, &kind_json, &message],
    )
    .await
    .ctx(what)?;
    Ok(Event { seq, at_ms: now_ms, image: image.map(str::to_owned), kind, message: message.to_owned() })
}

fn decode(row: &Row) -> Result<Converge, StateError> {
    let id = ConvergeId::from(row.get::<_, String>(0));
    let state = decode_state(&id, row.get(2), row.get(3))?;
    Ok(Converge {
        id,
        instance: row.get(1),
        state,
        started_ms: uint(row.get(4)),
        finished_ms: row.get::<_, Option<i64>>(5).map(uint),
        requested_by: row.get(6),
    })
}

fn decode_state(id: &ConvergeId, state: &str, reason: Option<String>) -> Result<ConvergeState, StateError> {
    match state {
        "running" => Ok(ConvergeState::Running),
        "succeeded" => Ok(ConvergeState::Succeeded),
        // A failure always carries its reason; an empty one still reads as failed.
        "failed" => Ok(ConvergeState::Failed { reason: reason.unwrap_or_default() }),
        other => Err(StateError::Corrupt {
            what: format!("converge {id}"),
            err: format!("state {other:?} is not running, succeeded or failed").into(),
        }),
    }
}
