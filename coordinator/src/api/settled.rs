//! `Up` for a settled converge (`engine::settled`): decided before anything is stored, stored
//! whole in one write, and its events sent from what was stored, so `kiln logs` replays exactly
//! what the client saw.

use super::{audit, counted, store_status, Audited, EventStream};
use crate::engine::{now_ms, Engine};
use crate::events::to_pb;
use crate::model::{ConvergeId, ConvergeState, EventKind};
use crate::plan::UpPlan;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::Instrument;

/// Runs `plan` as a settled converge when it is one; `None` when it must be opened and run the
/// usual way (something to change, or its record moved before it was stored).
pub(super) async fn settled_up(
    engine: &Arc<Engine>,
    plan: &UpPlan,
    audited: &Audited,
) -> Result<Option<EventStream>, Status> {
    let started_at = Instant::now();
    let id = ConvergeId::generate(now_ms());
    let span = tracing::info_span!("converge", otel.name = "converge up", converge = %id, kind = "up", settled = true);
    let Some(settled) = engine.settled(&id, plan).instrument(span.clone()).await else {
        return Ok(None);
    };
    let generation = settled.generation.0;
    let mut events = Vec::with_capacity(settled.events.len() + 2);
    events.push((EventKind::Started, None, String::new()));
    events.extend(settled.events);
    let message = format!("{} unchanged at generation {generation}", plan.instance);
    events.push((EventKind::Finished { succeeded: true, generation }, None, message));
    let storing = engine.store.settle_converge(&id, &plan.instance, &plan.requested_by, settled.generation, events);
    let Some((_, stored)) = storing.instrument(span).await.map_err(store_status)? else {
        return Ok(None);
    };
    counted(&engine.metrics, audited, &ConvergeState::Succeeded, started_at.elapsed());
    let (live, rx) = mpsc::channel(stored.len().max(1));
    for event in &stored {
        let _ = live.try_send(Ok(to_pb(&id, event)));
    }
    // The audit line is written after the answer, as the usual converge's is.
    let (engine, audited) = (engine.clone(), audited.clone());
    tokio::spawn(async move {
        let outcome = format!("ok (converge {id})");
        audit(&engine, audited.actor, audited.action, &audited.target, audited.address, outcome).await;
    });
    Ok(Some(ReceiverStream::new(rx)))
}
