//! Converges and their event logs. One running converge per instance is checked inside the write
//! transaction and backed by a partial unique index, so two `kiln up` of one instance — from two
//! terminals, or two processes sharing the database — cannot both build and race to record.
//! Event seqs are assigned inside the same kind of transaction, so they are gap-free per converge and
//! `kiln logs --follow` can resume from the last seq it printed.

use rusqlite::{Connection, OptionalExtension, Row};

use super::{from_json, to_json, Cached, Ctx};
use crate::model::{Converge, ConvergeId, ConvergeState, Event, EventKind};
use crate::state::StateError;

const COLUMNS: &str = "id, instance, state, reason, started_ms, finished_ms, requested_by";

pub(super) fn open(
    conn: &mut Connection,
    now_ms: u64,
    instance: &str,
    requested_by: &str,
) -> Result<Converge, StateError> {
    open_as(conn, now_ms, ConvergeId::generate(now_ms), instance, requested_by)
}

/// [`open`], under an id the caller chose (a converge decided before it was stored).
pub(super) fn open_as(
    conn: &mut Connection,
    now_ms: u64,
    id: ConvergeId,
    instance: &str,
    requested_by: &str,
) -> Result<Converge, StateError> {
    let what = || format!("opening a converge of instance {instance}");
    let tx = conn.nested().ctx(what)?;
    let running: Option<String> = tx
        .one_row("SELECT id FROM converges WHERE instance = ?1 AND state = 'running'", [instance], |row| row.get(0))
        .optional()
        .ctx(what)?;
    if let Some(running) = running {
        return Err(StateError::ConvergeRunning { instance: instance.to_owned(), running: running.into() });
    }
    let converge = Converge {
        id,
        instance: instance.to_owned(),
        state: ConvergeState::Running,
        started_ms: now_ms,
        finished_ms: None,
        requested_by: requested_by.to_owned(),
    };
    tx.exec(
        "INSERT INTO converges (id, instance, state, started_ms, requested_by) VALUES (?1, ?2, 'running', ?3, ?4)",
        (converge.id.as_str(), instance, now_ms, requested_by),
    )
    .ctx(what)?;
    tx.commit().ctx(what)?;
    Ok(converge)
}

pub(super) fn append_event(
    conn: &mut Connection,
    now_ms: u64,
    id: &ConvergeId,
    kind: EventKind,
    image: Option<String>,
    message: String,
) -> Result<Event, StateError> {
    let what = || format!("appending an event to converge {id}");
    let tx = conn.nested().ctx(what)?;
    if state_of(&tx, id)?.is_none() {
        return Err(StateError::UnknownConverge { id: id.clone() });
    }
    let event = insert_event(&tx, now_ms, id, kind, image, message)?;
    tx.commit().ctx(what)?;
    Ok(event)
}

/// [`append_event`] for several, in one transaction.
pub(super) fn append_events(
    conn: &mut Connection,
    now_ms: u64,
    id: &ConvergeId,
    events: Vec<(EventKind, Option<String>, String)>,
) -> Result<Vec<Event>, StateError> {
    let what = || format!("appending events to converge {id}");
    let tx = conn.nested().ctx(what)?;
    if state_of(&tx, id)?.is_none() {
        return Err(StateError::UnknownConverge { id: id.clone() });
    }
    let mut appended = Vec::with_capacity(events.len());
    for (kind, image, message) in events {
        appended.push(insert_event(&tx, now_ms, id, kind, image, message)?);
    }
    tx.commit().ctx(what)?;
    Ok(appended)
}

pub(super) fn events(conn: &mut Connection, id: &ConvergeId, after_seq: Option<u64>) -> Result<Vec<Event>, StateError> {
    let what = || format!("reading the events of converge {id}");
    if state_of(conn, id)?.is_none() {
        return Err(StateError::UnknownConverge { id: id.clone() });
    }
    let mut stmt = conn
        .prepare_cached(
            "SELECT seq, at_ms, image, kind, message FROM events WHERE converge_id = ?1 AND seq > ?2 ORDER BY seq",
        )
        .ctx(what)?;
    let rows = stmt
        .query_map((id.as_str(), after_seq.unwrap_or(0)), |row| {
            Ok((row.get::<_, u64>(0)?, row.get(1)?, row.get(2)?, row.get::<_, String>(3)?, row.get(4)?))
        })
        .ctx(what)?
        .collect::<Result<Vec<_>, _>>()
        .ctx(what)?;
    rows.into_iter()
        .map(|(seq, at_ms, image, kind, message)| {
            let kind = from_json(&kind, || format!("event {seq} of converge {id}"))?;
            Ok(Event { seq, at_ms, image, kind, message })
        })
        .collect()
}

/// The converge that most recently started building `reference`, from the events it logged.
pub(super) fn builder_of(conn: &mut Connection, reference: &str) -> Result<Option<ConvergeId>, StateError> {
    let what = || format!("looking up the converge that built {reference}");
    // The reference is JSON-escaped as the event stored it; LIKE's wildcards in it are escaped too.
    let quoted = serde_json::to_string(reference).unwrap_or_default();
    let escaped: String =
        quoted.chars().flat_map(|c| if matches!(c, '%' | '_' | '\\') { vec!['\\', c] } else { vec![c] }).collect();
    let pattern = format!("%\"reference\":{escaped}%");
    conn.one_row(
        "SELECT converge_id FROM events WHERE kind LIKE '{\"kind\":\"building\"%' AND kind LIKE ?1 ESCAPE '\\' \
         ORDER BY at_ms DESC LIMIT 1",
        [pattern],
        |row| row.get::<_, String>(0),
    )
    .optional()
    .ctx(what)
    .map(|id| id.map(ConvergeId::from))
}

pub(super) fn finish(
    conn: &mut Connection,
    now_ms: u64,
    id: &ConvergeId,
    state: ConvergeState,
) -> Result<(), StateError> {
    let what = || format!("finishing converge {id}");
    let reason = match &state {
        ConvergeState::Running => return Err(StateError::FinishAsRunning { id: id.clone() }),
        ConvergeState::Succeeded => None,
        ConvergeState::Failed { reason } => Some(reason.as_str()),
    };
    let tx = conn.nested().ctx(what)?;
    match state_of(&tx, id)? {
        None => return Err(StateError::UnknownConverge { id: id.clone() }),
        Some(ConvergeState::Running) => {}
        Some(finished) => return Err(StateError::ConvergeFinished { id: id.clone(), state: finished }),
    }
    tx.exec(
        "UPDATE converges SET state = ?2, reason = ?3, finished_ms = ?4 WHERE id = ?1",
        (id.as_str(), state.name(), reason, now_ms),
    )
    .ctx(what)?;
    tx.commit().ctx(what)
}

pub(super) fn get(conn: &mut Connection, id: &ConvergeId) -> Result<Option<Converge>, StateError> {
    let what = || format!("reading converge {id}");
    let sql = format!("SELECT {COLUMNS} FROM converges WHERE id = ?1");
    let raw = conn.one_row(&sql, [id.as_str()], raw_row).optional().ctx(what)?;
    raw.map(decode).transpose()
}

pub(super) fn list(conn: &mut Connection, instance: Option<&str>, limit: usize) -> Result<Vec<Converge>, StateError> {
    let what = || "listing converges".to_owned();
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let sql = format!(
        "SELECT {COLUMNS} FROM converges WHERE ?1 IS NULL OR instance = ?1 ORDER BY started_ms DESC, id DESC LIMIT ?2"
    );
    let mut stmt = conn.prepare_cached(&sql).ctx(what)?;
    let raws = stmt.query_map((instance, limit), raw_row).ctx(what)?.collect::<Result<Vec<_>, _>>().ctx(what)?;
    raws.into_iter().map(decode).collect()
}

pub(super) fn fail_in_flight(conn: &mut Connection, now_ms: u64, reason: &str) -> Result<Vec<ConvergeId>, StateError> {
    let what = || "failing converges left running".to_owned();
    let tx = conn.nested().ctx(what)?;
    let ids: Vec<ConvergeId> = {
        let mut stmt = tx.prepare_cached("SELECT id FROM converges WHERE state = 'running' ORDER BY id").ctx(what)?;
        let ids = stmt.query_map([], |row| row.get::<_, String>(0)).ctx(what)?;
        ids.map(|id| id.map(ConvergeId::from)).collect::<Result<_, _>>().ctx(what)?
    };
    for id in &ids {
        tx.exec(
            "UPDATE converges SET state = 'failed', reason = ?2, finished_ms = ?3 WHERE id = ?1",
            (id.as_str(), reason, now_ms),
        )
        .ctx(what)?;
        insert_event(&tx, now_ms, id, EventKind::Failed, None, reason.to_owned())?;
    }
    tx.commit().ctx(what)?;
    Ok(ids)
}

/// The converge's state, `None` if there is no such converge.
pub(super) fn state_of(conn: &Connection, id: &ConvergeId) -> Result<Option<ConvergeState>, StateError> {
    let what = || format!("reading the state of converge {id}");
    let raw: Option<(String, Option<String>)> = conn
        .one_row("SELECT state, reason FROM converges WHERE id = ?1", [id.as_str()], |row| {
            Ok((row.get(0)?, row.get(1)?))
        })
        .optional()
        .ctx(what)?;
    raw.map(|(state, reason)| decode_state(id, &state, reason)).transpose()
}

/// Inserts an event with the next seq; the caller holds the write transaction that makes it gap-free.
fn insert_event(
    conn: &Connection,
    now_ms: u64,
    id: &ConvergeId,
    kind: EventKind,
    image: Option<String>,
    message: String,
) -> Result<Event, StateError> {
    let what = || format!("appending an event to converge {id}");
    let seq: u64 = conn
        .one_row("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE converge_id = ?1", [id.as_str()], |row| row.get(0))
        .ctx(what)?;
    let kind_json = to_json(&kind, what)?;
    conn.exec(
        "INSERT INTO events (converge_id, seq, at_ms, image, kind, message) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        (id.as_str(), seq, now_ms, image.as_deref(), &kind_json, &message),
    )
    .ctx(what)?;
    Ok(Event { seq, at_ms: now_ms, image, kind, message })
}

struct RawConverge {
    id: String,
    instance: String,
    state: String,
    reason: Option<String>,
    started_ms: u64,
    finished_ms: Option<u64>,
    requested_by: String,
}

fn raw_row(row: &Row<'_>) -> rusqlite::Result<RawConverge> {
    Ok(RawConverge {
        id: row.get(0)?,
        instance: row.get(1)?,
        state: row.get(2)?,
        reason: row.get(3)?,
        started_ms: row.get(4)?,
        finished_ms: row.get(5)?,
        requested_by: row.get(6)?,
    })
}

fn decode(raw: RawConverge) -> Result<Converge, StateError> {
    let id = ConvergeId::from(raw.id);
    let state = decode_state(&id, &raw.state, raw.reason)?;
    Ok(Converge {
        id,
        instance: raw.instance,
        state,
        started_ms: raw.started_ms,
        finished_ms: raw.finished_ms,
        requested_by: raw.requested_by,
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
