//! A converge's events as the CLI sees them: the wire's `ConvergeEvent` converted once at the edge,
//! so the renderers and the callers of [`crate::up`] never touch prost types.
//!
//! A kind this CLI does not know (a newer coordinator added one) is kept as [`EventKind::Unknown`]
//! and rendered as a note rather than dropped or treated as an error: within kiln.v1 kinds are only
//! ever added, and an older CLI must still show a newer coordinator's converge.

use kiln_proto::v1::{converge_event, ConvergeEvent};
use serde::Serialize;

/// What an event says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventKind {
    Started,
    NeedContexts,
    Uploaded,
    Recorded,
    Held,
    Building,
    BuildLog,
    Built,
    Pushing,
    Pushed,
    Delivered,
    Note,
    Failed,
    Finished,
    Progress,
    /// A removal a dry-run sweep would make.
    Planned,
    /// A removal the store's re-listing confirmed.
    Removed,
    /// A planned removal that did not happen; the message says why.
    NotRemoved,
    /// A sweep's total: `count` images, `bytes` freed.
    Swept,
    /// `kiln down` deleted the instance's record.
    RecordDeleted,
    /// A dry run's decision for an image: what would happen, and why.
    Would,
    /// The sweep collected uploaded contexts: `count` and `bytes`.
    ContextsCollected,
    /// A build task waits for a slot: `count` is its place in the queue, `millis` the wait told.
    Queued,
    /// A build task lost on its agent (`store`) and queued again.
    Requeued,
    /// A pinned image copied into the mirror: `reference` the mirrored ref, `bytes` and `count`
    /// (blobs) copied, in `millis`.
    Mirrored,
    /// A pinned image the mirror already holds at its digest: nothing copied.
    InMirror,
    /// A dry run's copy into the mirror.
    WouldMirror,
    /// A kind from a newer coordinator, with its wire number.
    Unknown(i32),
}

impl EventKind {
    /// The lowercase word `--json` prints for this kind.
    pub fn word(self) -> &'static str {
        match self {
            EventKind::Started => "started",
            EventKind::NeedContexts => "need_contexts",
            EventKind::Uploaded => "uploaded",
            EventKind::Recorded => "recorded",
            EventKind::Held => "held",
            EventKind::Building => "building",
            EventKind::BuildLog => "build_log",
            EventKind::Built => "built",
            EventKind::Pushing => "pushing",
            EventKind::Pushed => "pushed",
            EventKind::Delivered => "delivered",
            EventKind::Note => "note",
            EventKind::Failed => "failed",
            EventKind::Finished => "finished",
            EventKind::Progress => "progress",
            EventKind::Planned => "planned",
            EventKind::Removed => "removed",
            EventKind::NotRemoved => "not_removed",
            EventKind::Swept => "swept",
            EventKind::RecordDeleted => "record_deleted",
            EventKind::Would => "would",
            EventKind::ContextsCollected => "contexts_collected",
            EventKind::Queued => "queued",
            EventKind::Requeued => "requeued",
            EventKind::Mirrored => "mirrored",
            EventKind::InMirror => "in_mirror",
            EventKind::WouldMirror => "would_mirror",
            EventKind::Unknown(_) => "unknown",
        }
    }

    fn from_wire(kind: i32) -> EventKind {
        use converge_event::Kind as K;
        match K::try_from(kind) {
            Ok(K::Started) => EventKind::Started,
            Ok(K::NeedContexts) => EventKind::NeedContexts,
            Ok(K::Uploaded) => EventKind::Uploaded,
            Ok(K::Recorded) => EventKind::Recorded,
            Ok(K::Held) => EventKind::Held,
            Ok(K::Building) => EventKind::Building,
            Ok(K::BuildLog) => EventKind::BuildLog,
            Ok(K::Built) => EventKind::Built,
            Ok(K::Pushing) => EventKind::Pushing,
            Ok(K::Pushed) => EventKind::Pushed,
            Ok(K::Delivered) => EventKind::Delivered,
            Ok(K::Note) => EventKind::Note,
            Ok(K::Failed) => EventKind::Failed,
            Ok(K::Finished) => EventKind::Finished,
            Ok(K::Progress) => EventKind::Progress,
            Ok(K::Planned) => EventKind::Planned,
            Ok(K::Removed) => EventKind::Removed,
            Ok(K::NotRemoved) => EventKind::NotRemoved,
            Ok(K::Swept) => EventKind::Swept,
            Ok(K::RecordDeleted) => EventKind::RecordDeleted,
            Ok(K::Would) => EventKind::Would,
            Ok(K::ContextsCollected) => EventKind::ContextsCollected,
            Ok(K::Queued) => EventKind::Queued,
            Ok(K::Requeued) => EventKind::Requeued,
            Ok(K::Mirrored) => EventKind::Mirrored,
            Ok(K::InMirror) => EventKind::InMirror,
            Ok(K::WouldMirror) => EventKind::WouldMirror,
            Ok(K::Unspecified) | Err(_) => EventKind::Unknown(kind),
        }
    }

    fn to_wire(self) -> i32 {
        use converge_event::Kind as K;
        let kind = match self {
            EventKind::Started => K::Started,
            EventKind::NeedContexts => K::NeedContexts,
            EventKind::Uploaded => K::Uploaded,
            EventKind::Recorded => K::Recorded,
            EventKind::Held => K::Held,
            EventKind::Building => K::Building,
            EventKind::BuildLog => K::BuildLog,
            EventKind::Built => K::Built,
            EventKind::Pushing => K::Pushing,
            EventKind::Pushed => K::Pushed,
            EventKind::Delivered => K::Delivered,
            EventKind::Note => K::Note,
            EventKind::Failed => K::Failed,
            EventKind::Finished => K::Finished,
            EventKind::Progress => K::Progress,
            EventKind::Planned => K::Planned,
            EventKind::Removed => K::Removed,
            EventKind::NotRemoved => K::NotRemoved,
            EventKind::Swept => K::Swept,
            EventKind::RecordDeleted => K::RecordDeleted,
            EventKind::Would => K::Would,
            EventKind::ContextsCollected => K::ContextsCollected,
            EventKind::Queued => K::Queued,
            EventKind::Requeued => K::Requeued,
            EventKind::Mirrored => K::Mirrored,
            EventKind::InMirror => K::InMirror,
            EventKind::WouldMirror => K::WouldMirror,
            EventKind::Unknown(n) => return n,
        };
        kind as i32
    }
}

/// How a converge ended (or that it has not yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Unspecified,
    Running,
    Succeeded,
    Failed,
}

impl Outcome {
    pub fn word(self) -> &'static str {
        match self {
            Outcome::Unspecified => "unspecified",
            Outcome::Running => "running",
            Outcome::Succeeded => "succeeded",
            Outcome::Failed => "failed",
        }
    }

    pub(crate) fn from_wire(outcome: i32) -> Outcome {
        use kiln_proto::v1::Outcome as O;
        match O::try_from(outcome) {
            Ok(O::Running) => Outcome::Running,
            Ok(O::Succeeded) => Outcome::Succeeded,
            Ok(O::Failed) => Outcome::Failed,
            Ok(O::Unspecified) | Err(_) => Outcome::Unspecified,
        }
    }

    fn to_wire(self) -> i32 {
        use kiln_proto::v1::Outcome as O;
        match self {
            Outcome::Unspecified => O::Unspecified as i32,
            Outcome::Running => O::Running as i32,
            Outcome::Succeeded => O::Succeeded as i32,
            Outcome::Failed => O::Failed as i32,
        }
    }
}

/// One event of a converge, in the order the coordinator numbered it (`seq`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub converge_id: String,
    pub seq: u64,
    /// Milliseconds since the Unix epoch, on the coordinator's clock.
    pub at_ms: u64,
    pub kind: EventKind,
    /// The manifest name of the image the event is about; empty for the converge as a whole.
    pub image: String,
    pub message: String,
    pub bytes: u64,
    pub millis: u64,
    /// `NeedContexts`: the tree digests (64 hex) the coordinator lacks.
    pub contexts: Vec<String>,
    /// `Finished`: how the converge ended.
    pub outcome: Outcome,
    /// Sweep events: the store a removal is about.
    pub store: String,
    /// Sweep events: the image's owner (an instance, `shared`, `unowned`); `RecordDeleted`: the
    /// instance.
    pub instance: String,
    /// Sweep events: the ref (or image id) removed, planned or kept.
    pub reference: String,
    /// `Swept`: how many images went.
    pub count: u64,
    /// `Finished` of an up: the generation now current.
    pub generation: u64,
    /// Why an image was skipped, delivered or built (`Recorded`, `Held`, `Building`, `Would`).
    pub reason: Option<Reason>,
}

/// Why an image was skipped, delivered or built, as `--json` carries it: `kind` is one of
/// `recorded`, `held`, `first_build`, `forced`, `changed`, `gone`, `held_by_farm` (or `unknown`
/// from a newer coordinator); the other fields appear when they say something.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reason {
    pub kind: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub converge: String,
    /// `changed`: each input that moved; a context's names the files that moved when it can.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<Change>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub store: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub farm: String,
}

/// One input of an image's address that moved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Change {
    /// `context`, `dockerfile`, `build_arg`, `target`, `platforms`, `delivery`.
    pub input: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub before: String,
    pub after: String,
    /// `context`: the files that moved, when the coordinator kept both trees' entry lists.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<FilesMoved>,
}

/// The paths that moved between two trees of a context: how many each way, and the first of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct FilesMoved {
    pub added: MovedPaths,
    pub removed: MovedPaths,
    /// Moved in place: contents, executable bit, type or symlink target (`kiln why` tells which).
    pub changed: MovedPaths,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Default)]
pub struct MovedPaths {
    pub count: u64,
    /// The first of them in path order (the coordinator keeps at most 20).
    pub paths: Vec<String>,
}

impl From<kiln_proto::v1::FilesMoved> for FilesMoved {
    fn from(f: kiln_proto::v1::FilesMoved) -> FilesMoved {
        let paths = |m: Option<kiln_proto::v1::MovedPaths>| {
            m.map(|m| MovedPaths { count: m.count, paths: m.paths }).unwrap_or_default()
        };
        FilesMoved { added: paths(f.added), removed: paths(f.removed), changed: paths(f.changed) }
    }
}

impl From<kiln_proto::v1::Reason> for Reason {
    fn from(r: kiln_proto::v1::Reason) -> Reason {
        use kiln_proto::v1::input_change::Input;
        use kiln_proto::v1::reason::Kind;
        let kind = match Kind::try_from(r.kind) {
            Ok(Kind::Recorded) => "recorded",
            Ok(Kind::Held) => "held",
            Ok(Kind::FirstBuild) => "first_build",
            Ok(Kind::Forced) => "forced",
            Ok(Kind::Changed) => "changed",
            Ok(Kind::Gone) => "gone",
            Ok(Kind::HeldByFarm) => "held_by_farm",
            Ok(Kind::Unspecified) | Err(_) => "unknown",
        };
        let changes = r
            .changes
            .into_iter()
            .map(|c| Change {
                input: match Input::try_from(c.input) {
                    Ok(Input::Context) => "context",
                    Ok(Input::Dockerfile) => "dockerfile",
                    Ok(Input::BuildArg) => "build_arg",
                    Ok(Input::Target) => "target",
                    Ok(Input::Platforms) => "platforms",
                    Ok(Input::Delivery) => "delivery",
                    Ok(Input::Unspecified) | Err(_) => "unknown",
                },
                name: c.name,
                before: c.before,
                after: c.after,
                files: c.files.map(FilesMoved::from),
            })
            .collect();
        let generation = (kind == "gone").then_some(r.generation);
        Reason { kind, converge: r.converge, changes, store: r.store, generation, farm: r.farm }
    }
}

impl Event {
    /// An event with only its kind, image and message set; the rest zero. For tests and for
    /// callers building expected sequences.
    pub fn new(kind: EventKind, image: &str, message: &str) -> Event {
        Event {
            converge_id: String::new(),
            seq: 0,
            at_ms: 0,
            kind,
            image: image.to_string(),
            message: message.to_string(),
            bytes: 0,
            millis: 0,
            contexts: Vec::new(),
            outcome: Outcome::Unspecified,
            store: String::new(),
            instance: String::new(),
            reference: String::new(),
            count: 0,
            generation: 0,
            reason: None,
        }
    }
}

impl From<ConvergeEvent> for Event {
    fn from(e: ConvergeEvent) -> Event {
        Event {
            kind: EventKind::from_wire(e.kind),
            outcome: Outcome::from_wire(e.outcome),
            converge_id: e.converge_id,
            seq: e.seq,
            at_ms: e.at_ms,
            image: e.image,
            message: e.message,
            bytes: e.bytes,
            millis: e.millis,
            contexts: e.contexts,
            store: e.store,
            instance: e.instance,
            reference: e.reference,
            count: e.count,
            generation: e.generation,
            reason: e.reason.map(Reason::from),
        }
    }
}

impl From<&Event> for ConvergeEvent {
    fn from(e: &Event) -> ConvergeEvent {
        ConvergeEvent {
            converge_id: e.converge_id.clone(),
            seq: e.seq,
            at_ms: e.at_ms,
            kind: e.kind.to_wire(),
            image: e.image.clone(),
            message: e.message.clone(),
            bytes: e.bytes,
            millis: e.millis,
            contexts: e.contexts.clone(),
            outcome: e.outcome.to_wire(),
            store: e.store.clone(),
            instance: e.instance.clone(),
            reference: e.reference.clone(),
            count: e.count,
            generation: e.generation,
            // The wire form is only ever read, never rebuilt from a shown event.
            reason: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_kind_survives_the_wire_and_an_unknown_one_is_kept_by_number() {
        for n in 1..=22 {
            let wire = ConvergeEvent { kind: n, ..Default::default() };
            let event = Event::from(wire.clone());
            assert!(!matches!(event.kind, EventKind::Unknown(_)), "kind {n} not known");
            assert_eq!(ConvergeEvent::from(&event), wire);
        }
        let newer = Event::from(ConvergeEvent { kind: 99, ..Default::default() });
        assert_eq!(newer.kind, EventKind::Unknown(99));
        assert_eq!(newer.kind.word(), "unknown");
        assert_eq!(ConvergeEvent::from(&newer).kind, 99);
    }

    #[test]
    fn outcomes_convert_and_an_unknown_one_is_unspecified() {
        let finished = ConvergeEvent { kind: 14, outcome: 3, ..Default::default() };
        assert_eq!(Event::from(finished).outcome, Outcome::Failed);
        assert_eq!(Outcome::from_wire(42), Outcome::Unspecified);
    }
}
