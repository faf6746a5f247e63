//! A converge's event log: every decision becomes an event, persisted in order (so `kiln logs`
//! replays it) and streamed to the client that asked, if it is still listening.
//!
//! Emitting is synchronous and cheap — a queue feeds one writer task — so the engine can report from
//! inside a task's progress callback without reordering anything.

use crate::model::{ConvergeId, ConvergeState, Event, EventKind, Input, Reason};
use crate::state::StateStore;
use kiln_proto::v1 as pb;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tonic::Status;

pub type Live = mpsc::Sender<Result<pb::ConvergeEvent, Status>>;

#[derive(Debug)]
enum Item {
    Event {
        kind: EventKind,
        image: Option<String>,
        message: String,
    },
    Live(pb::ConvergeEvent),
    /// The last event, stored in the write that marks the converge finished.
    Finish {
        state: ConvergeState,
        kind: EventKind,
        message: String,
    },
}

/// The most events persisted in one write.
const BATCH: usize = 256;

/// The engine's side of the log.
#[derive(Debug, Clone)]
pub struct Events {
    id: ConvergeId,
    tx: mpsc::UnboundedSender<Item>,
}

impl Events {
    /// Starts the writer; it ends when every `Events` clone is dropped and the queue is drained.
    pub fn start(store: Arc<dyn StateStore>, id: ConvergeId, live: Live) -> (Events, JoinHandle<()>) {
        Events::writer(Some(store), id, live)
    }

    /// Events kept to be stored later, all at once: neither persisted nor streamed as told. A
    /// settled converge says them before it is stored, so they are stored with it.
    pub fn collecting(id: ConvergeId) -> (Events, Collected) {
        let (tx, rx) = mpsc::unbounded_channel::<Item>();
        (Events { id, tx }, Collected { rx })
    }

    /// Events that are streamed and never persisted: a dry run opens no converge, so it leaves
    /// nothing in the state, its log included.
    pub fn ephemeral(id: ConvergeId, live: Live) -> (Events, JoinHandle<()>) {
        Events::writer(None, id, live)
    }

    fn writer(store: Option<Arc<dyn StateStore>>, id: ConvergeId, live: Live) -> (Events, JoinHandle<()>) {
        let (tx, mut rx) = mpsc::unbounded_channel::<Item>();
        let writer_id = id.clone();
        let writer = tokio::spawn(async move {
            let mut seq = 0;
            // Events queued while the last write ran go to the store in one write, in order; a
            // live-only item ends the batch, so the client sees everything in the order emitted.
            let mut next: Option<Item> = None;
            loop {
                let first = match next.take() {
                    Some(item) => item,
                    None => match rx.recv().await {
                        Some(item) => item,
                        None => break,
                    },
                };
                let mut batch: Vec<(EventKind, Option<String>, String)> = Vec::new();
                let mut live_item = None;
                let mut finish = None;
                match first {
                    Item::Event { kind, image, message } => batch.push((kind, image, message)),
                    Item::Live(event) => live_item = Some(event),
                    Item::Finish { state, kind, message } => {
                        batch.push((kind, None, message));
                        finish = Some(state);
                    }
                }
                while live_item.is_none() && finish.is_none() && batch.len() < BATCH {
                    match rx.try_recv() {
                        Ok(Item::Event { kind, image, message }) => batch.push((kind, image, message)),
                        Ok(Item::Finish { state, kind, message }) => {
                            batch.push((kind, None, message));
                            finish = Some(state);
                        }
                        Ok(live) => {
                            next = Some(live);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                let events: Vec<pb::ConvergeEvent> = match (&store, batch.is_empty()) {
                    (_, true) => Vec::new(),
                    (Some(store), false) => match persist(store.as_ref(), &writer_id, batch, finish).await {
                        Ok(events) => events.iter().map(|e| to_pb(&writer_id, e)).collect(),
                        Err(err) => {
                            tracing::warn!(converge = %writer_id, error = %err, "events not persisted");
                            Vec::new()
                        }
                    },
                    (None, false) => batch
                        .into_iter()
                        .map(|(kind, image, message)| {
                            seq += 1;
                            let at_ms = crate::engine::now_ms();
                            to_pb(&writer_id, &Event { seq, at_ms, image, kind, message })
                        })
                        .collect(),
                };
                // A client that went away does not stop the writer: the log is still persisted.
                for event in events.into_iter().chain(live_item) {
                    let _ = live.send(Ok(event)).await;
                }
            }
        });
        (Events { id, tx }, writer)
    }

    /// The converge's last event (`Finished`), persisted in the write that marks it `state`:
    /// both are stored before it is sent, so a client that saw it may start the instance's next
    /// converge at once and is never told one still runs.
    pub fn finish(&self, state: ConvergeState, kind: EventKind, message: impl Into<String>) {
        let _ = self.tx.send(Item::Finish { state, kind, message: message.into() });
    }

    pub fn emit(&self, kind: EventKind, image: Option<&str>, message: impl Into<String>) {
        let _ = self.tx.send(Item::Event { kind, image: image.map(str::to_string), message: message.into() });
    }

    /// Asks the client for contexts; not persisted: a replay has nothing to upload.
    pub fn need_contexts(&self, digests: &[String]) {
        let event = pb::ConvergeEvent {
            converge_id: self.id.to_string(),
            kind: pb::converge_event::Kind::NeedContexts as i32,
            message: format!("upload {} context(s)", digests.len()),
            contexts: digests.to_vec(),
            at_ms: crate::engine::now_ms(),
            ..Default::default()
        };
        let _ = self.tx.send(Item::Live(event));
    }

    /// Bytes moved so far by a push or upload; live only.
    pub fn progress(&self, image: &str, current: u64, total: u64) {
        self.progress_saying(image, "", current, total)
    }

    /// Bytes moved so far, with the word the client shows before them (`copying`); live only.
    pub fn progress_saying(&self, image: &str, words: &str, current: u64, total: u64) {
        let event = pb::ConvergeEvent {
            message: words.to_string(),
            converge_id: self.id.to_string(),
            kind: pb::converge_event::Kind::Progress as i32,
            image: image.to_string(),
            bytes: current,
            millis: total,
            at_ms: crate::engine::now_ms(),
            ..Default::default()
        };
        let _ = self.tx.send(Item::Live(event));
    }
}

/// The events told to an [`Events::collecting`].
#[derive(Debug)]
pub struct Collected {
    rx: mpsc::UnboundedReceiver<Item>,
}

impl Collected {
    /// The events told through `events`, the last handle on them, in order. What is live only
    /// (progress, asks for contexts) is not kept: a settled converge moves nothing and uploads
    /// nothing.
    pub fn take(mut self, events: Events) -> Vec<(EventKind, Option<String>, String)> {
        drop(events);
        let mut events = Vec::new();
        while let Ok(item) = self.rx.try_recv() {
            match item {
                Item::Event { kind, image, message } => events.push((kind, image, message)),
                Item::Finish { kind, message, .. } => events.push((kind, None, message)),
                Item::Live(_) => {}
            }
        }
        events
    }
}

/// Stores a batch of events; the last batch also marks the converge finished, in the same write.
async fn persist(
    store: &dyn StateStore,
    id: &ConvergeId,
    batch: Vec<(EventKind, Option<String>, String)>,
    finish: Option<ConvergeState>,
) -> Result<Vec<Event>, crate::state::StateError> {
    let Some(state) = finish else {
        return store.append_events(id, batch).await;
    };
    let (events, not_marked) = match store.finish_with_events(id, state.clone(), batch).await {
        Ok(done) => done,
        Err(err) => {
            // Never left running because its last events could not be stored: a running converge
            // holds its instance until a restart fails it.
            if let Err(marked) = store.finish_converge(id, state).await {
                tracing::warn!(converge = %id, error = %marked, "converge not marked finished");
            }
            return Err(err);
        }
    };
    if let Some(err) = not_marked {
        tracing::warn!(converge = %id, error = %err, "converge not marked finished");
    }
    Ok(events)
}

/// A persisted event as the wire carries it.
pub fn to_pb(id: &ConvergeId, event: &Event) -> pb::ConvergeEvent {
    use pb::converge_event::Kind;
    let mut wire = pb::ConvergeEvent {
        converge_id: id.to_string(),
        seq: event.seq,
        at_ms: event.at_ms,
        image: event.image.clone().unwrap_or_default(),
        message: event.message.clone(),
        outcome: outcome(event) as i32,
        ..Default::default()
    };
    let kind = match &event.kind {
        EventKind::Started => Kind::Started,
        EventKind::Recorded { reference, reason } => {
            (wire.reference, wire.reason) = (reference.clone(), reason.as_ref().map(reason_to_pb));
            Kind::Recorded
        }
        EventKind::Held { reference, reason } => {
            (wire.reference, wire.reason) = (reference.clone(), reason.as_ref().map(reason_to_pb));
            Kind::Held
        }
        EventKind::Building { reference, reason } => {
            (wire.reference, wire.reason) = (reference.clone(), reason.as_ref().map(reason_to_pb));
            Kind::Building
        }
        EventKind::Would { reference, reason, .. } => {
            (wire.reference, wire.reason) = (reference.clone(), Some(reason_to_pb(reason)));
            Kind::Would
        }
        EventKind::ContextsCollected { count, bytes } => {
            (wire.count, wire.bytes) = (*count, *bytes);
            Kind::ContextsCollected
        }
        EventKind::Uploaded { bytes } => {
            wire.bytes = *bytes;
            Kind::Uploaded
        }
        EventKind::BuildLog => Kind::BuildLog,
        EventKind::Built { secs } => {
            wire.millis = (secs * 1000.0) as u64;
            Kind::Built
        }
        EventKind::Pushing => Kind::Pushing,
        EventKind::Pushed { bytes } => {
            wire.bytes = *bytes;
            Kind::Pushed
        }
        EventKind::Delivered => Kind::Delivered,
        EventKind::Failed => Kind::Failed,
        EventKind::Finished { generation, .. } => {
            wire.generation = *generation;
            Kind::Finished
        }
        EventKind::Planned { store, instance, reference, bytes }
        | EventKind::Removed { store, instance, reference, bytes } => {
            (wire.store, wire.instance, wire.reference, wire.bytes) =
                (store.clone(), instance.clone(), reference.clone(), *bytes);
            if matches!(event.kind, EventKind::Planned { .. }) {
                Kind::Planned
            } else {
                Kind::Removed
            }
        }
        EventKind::NotRemoved { store, reference } => {
            (wire.store, wire.reference) = (store.clone(), reference.clone());
            Kind::NotRemoved
        }
        EventKind::Swept { images, bytes } => {
            (wire.count, wire.bytes) = (*images, *bytes);
            Kind::Swept
        }
        EventKind::RecordDeleted { instance } => {
            wire.instance = instance.clone();
            Kind::RecordDeleted
        }
        EventKind::Queued { position, wait_ms } => {
            (wire.count, wire.millis) = (u64::from(*position), *wait_ms);
            Kind::Queued
        }
        EventKind::Requeued { agent } => {
            wire.store = agent.clone();
            Kind::Requeued
        }
        EventKind::Mirrored { reference, bytes, blobs, millis } => {
            (wire.reference, wire.bytes, wire.count, wire.millis) = (reference.clone(), *bytes, *blobs, *millis);
            Kind::Mirrored
        }
        EventKind::InMirror { reference } => {
            wire.reference = reference.clone();
            Kind::InMirror
        }
        EventKind::WouldMirror { reference, .. } => {
            wire.reference = reference.clone();
            Kind::WouldMirror
        }
        EventKind::Note | EventKind::Unknown => Kind::Note,
    };
    wire.kind = kind as i32;
    wire
}

/// A reason as the wire carries it.
pub fn reason_to_pb(reason: &Reason) -> pb::Reason {
    use pb::reason::Kind;
    let mut wire = pb::Reason::default();
    let kind = match reason {
        Reason::Recorded => Kind::Recorded,
        Reason::Held { converge } => {
            wire.converge = converge.clone();
            Kind::Held
        }
        Reason::FirstBuild => Kind::FirstBuild,
        Reason::Forced => Kind::Forced,
        Reason::Changed { changes } => {
            wire.changes = changes
                .iter()
                .map(|c| pb::InputChange {
                    input: match c.input {
                        Input::Context => pb::input_change::Input::Context,
                        Input::Dockerfile => pb::input_change::Input::Dockerfile,
                        Input::BuildArg => pb::input_change::Input::BuildArg,
                        Input::Target => pb::input_change::Input::Target,
                        Input::Platforms => pb::input_change::Input::Platforms,
                        Input::Delivery => pb::input_change::Input::Delivery,
                    } as i32,
                    name: c.name.clone(),
                    before: c.before.clone(),
                    after: c.after.clone(),
                    files: c.files.as_ref().map(files_to_pb),
                })
                .collect();
            Kind::Changed
        }
        Reason::Gone { store, generation } => {
            (wire.store, wire.generation) = (store.clone(), *generation);
            Kind::Gone
        }
        Reason::HeldByFarm { farm } => {
            wire.farm = farm.clone();
            Kind::HeldByFarm
        }
    };
    wire.kind = kind as i32;
    wire
}

fn files_to_pb(files: &crate::model::FilesMoved) -> pb::FilesMoved {
    let paths = |m: &crate::model::MovedPaths| Some(pb::MovedPaths { count: m.count, paths: m.paths.clone() });
    pb::FilesMoved { added: paths(&files.added), removed: paths(&files.removed), changed: paths(&files.changed) }
}

fn outcome(event: &Event) -> pb::Outcome {
    match event.kind {
        EventKind::Finished { succeeded: true, .. } => pb::Outcome::Succeeded,
        EventKind::Finished { succeeded: false, .. } => pb::Outcome::Failed,
        _ => pb::Outcome::Unspecified,
    }
}
