//! A converge's event log as the page shows it: one line of text per event, in the words
//! `kiln logs` uses, served as JSON (`/api/converges/{id}/events?after=N`) for the page to append
//! as the converge runs. The text is plain: the page puts it in the document as text, never as
//! markup, since build output and messages are whatever a Dockerfile printed.

use serde::Serialize;

use crate::model::{Event, EventKind};

/// The most events one answer carries; `more` says the reader should ask again at once.
pub(crate) const PAGE: usize = 1000;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Line {
    pub seq: u64,
    pub at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The event's kind as stored (`building`, `build_log`, `finished`, …).
    pub kind: String,
    pub text: String,
}

/// One answer of the events endpoint.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Log {
    pub converge: String,
    pub instance: String,
    /// `running`, `succeeded` or `failed`: the reader stops asking once it is not running and
    /// nothing more came.
    pub state: &'static str,
    pub events: Vec<Line>,
    pub more: bool,
}

pub(crate) fn line(event: &Event) -> Line {
    let kind = serde_json::to_value(&event.kind)
        .ok()
        .and_then(|v| v.get("kind").and_then(|k| k.as_str()).map(str::to_string))
        .unwrap_or_default();
    Line { seq: event.seq, at_ms: event.at_ms, image: event.image.clone(), kind, text: text(event) }
}

/// What an event says, as `kiln logs` would say it (without the image column).
fn text(event: &Event) -> String {
    let message = event.message.as_str();
    let with = |word: String| if message.is_empty() { word } else { format!("{word} ({message})") };
    let bytes = super::render::bytes;
    match &event.kind {
        EventKind::Started if message.is_empty() => "started".to_string(),
        EventKind::Started => format!("started: {message}"),
        // With a reason, the coordinator's message is the whole line.
        EventKind::Recorded { reference, .. }
        | EventKind::Held { reference, .. }
        | EventKind::Building { reference, .. }
        | EventKind::Would { reference, .. }
            if message.is_empty() =>
        {
            format!("{} {reference}", kind_word(&event.kind))
        }
        EventKind::Recorded { .. } | EventKind::Held { .. } | EventKind::Building { .. } | EventKind::Would { .. } => {
            message.to_string()
        }
        EventKind::Uploaded { bytes: n } => with(format!("uploaded context, {}", bytes(*n))),
        EventKind::BuildLog => format!("| {message}"),
        EventKind::Built { secs } => with(format!("built in {secs:.1} s")),
        EventKind::Pushing => with("pushing".to_string()),
        EventKind::Pushed { bytes: n } => with(format!("pushed {}", bytes(*n))),
        EventKind::Delivered => with("delivered".to_string()),
        EventKind::Failed => format!("failed: {message}"),
        // The message already says the generation (`shop at generation 4`) when there is one.
        EventKind::Finished { succeeded: true, .. } if !message.is_empty() => format!("succeeded: {message}"),
        EventKind::Finished { succeeded: true, generation: 0 } => "succeeded".to_string(),
        EventKind::Finished { succeeded: true, generation } => format!("succeeded: generation {generation}"),
        EventKind::Finished { succeeded: false, .. } => "failed".to_string(),
        EventKind::Note
        | EventKind::Queued { .. }
        | EventKind::Requeued { .. }
        | EventKind::Mirrored { .. }
        | EventKind::InMirror { .. }
        | EventKind::WouldMirror { .. }
        | EventKind::Unknown => message.to_string(),
        EventKind::Planned { store, instance, reference, bytes: n } => {
            let frees = if *n == 0 { "untag only".to_string() } else { bytes(*n) };
            format!("would remove {reference} from {store} ({instance}, {frees})")
        }
        EventKind::Removed { store, reference, bytes: 0, .. } => format!("removed {reference} from {store}"),
        EventKind::Removed { store, reference, bytes: n, .. } => {
            format!("removed {reference} from {store} ({})", bytes(*n))
        }
        EventKind::NotRemoved { store, reference } => format!("kept {reference} on {store}: {message}"),
        EventKind::Swept { images, bytes: n } => format!("swept {images} image(s) ({})", bytes(*n)),
        EventKind::RecordDeleted { instance } => format!("deleted the record of {instance}"),
        EventKind::ContextsCollected { bytes: n, .. } => format!("{message} ({})", bytes(*n)),
    }
}

fn kind_word(kind: &EventKind) -> &'static str {
    match kind {
        EventKind::Recorded { .. } => "recorded",
        EventKind::Held { .. } => "held",
        EventKind::Building { .. } => "building",
        _ => "would converge",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: EventKind, message: &str) -> Event {
        Event { seq: 7, at_ms: 1, image: Some("web".into()), kind, message: message.into() }
    }

    #[test]
    fn events_read_as_kiln_logs_says_them() {
        let built = line(&event(EventKind::Built { secs: 1.25 }, ""));
        assert_eq!((built.kind.as_str(), built.text.as_str()), ("built", "built in 1.2 s"));
        assert_eq!(line(&event(EventKind::BuildLog, "Step 1/2")).text, "| Step 1/2");
        assert_eq!(
            line(&event(EventKind::Finished { succeeded: true, generation: 4 }, "")).text,
            "succeeded: generation 4"
        );
        let removed = EventKind::Removed {
            store: "docker@h".into(),
            instance: "shop".into(),
            reference: "a:1".into(),
            bytes: 2_100_000,
        };
        assert_eq!(line(&event(removed, "")).text, "removed a:1 from docker@h (2.1 MB)");
        assert_eq!(line(&event(EventKind::Unknown, "from a newer kiln")).text, "from a newer kiln");
    }
}
