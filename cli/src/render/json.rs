//! `--json`: one object per event, one per line, for scripts (`kiln up --json | jq …`).
//!
//! Every line carries `"schema": 2` — version 2 added `reference` on an image's events, `reason`,
//! and `generation` on an up's `finished`; fields are only ever added within a version.
//!
//! The fields are the event's own (converge_id, seq, at_ms, kind as a lowercase word, image,
//! message, bytes, millis); `contexts` appears only when it lists something, `outcome` only on
//! `finished`, the sweep's `store`, `instance` and `reference` only when set and `count` only on
//! `swept`, so a consumer can test for presence instead of for empty values.

use std::io::{self, Write};

use serde::Serialize;

use super::Render;
use crate::event::{Event, EventKind, Outcome};

#[derive(Debug)]
pub struct Json<W> {
    out: W,
}

impl<W: Write + Send> Json<W> {
    pub fn new(out: W) -> Json<W> {
        Json { out }
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

/// The version of the `--json` event schema.
pub const SCHEMA: u32 = 2;

#[derive(Serialize)]
struct Line<'a> {
    schema: u32,
    converge_id: &'a str,
    seq: u64,
    at_ms: u64,
    kind: &'a str,
    image: &'a str,
    message: &'a str,
    bytes: u64,
    millis: u64,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    contexts: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    outcome: Option<Outcome>,
    #[serde(skip_serializing_if = "str::is_empty")]
    store: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    instance: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    reference: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    generation: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a crate::event::Reason>,
}

/// The JSON line for `event`, without its newline.
pub fn line(event: &Event) -> String {
    let line = Line {
        schema: SCHEMA,
        converge_id: &event.converge_id,
        seq: event.seq,
        at_ms: event.at_ms,
        kind: event.kind.word(),
        image: &event.image,
        message: &event.message,
        bytes: event.bytes,
        millis: event.millis,
        contexts: &event.contexts,
        outcome: (event.kind == EventKind::Finished).then_some(event.outcome),
        store: &event.store,
        instance: &event.instance,
        reference: &event.reference,
        count: matches!(
            event.kind,
            EventKind::Swept | EventKind::ContextsCollected | EventKind::Queued | EventKind::Mirrored
        )
        .then_some(event.count),
        generation: (event.kind == EventKind::Finished && event.generation > 0).then_some(event.generation),
        reason: event.reason.as_ref(),
    };
    // Serializing plain strings and numbers cannot fail.
    serde_json::to_string(&line).unwrap_or_default()
}

impl<W: Write + Send> Render for Json<W> {
    fn event(&mut self, event: &Event) -> io::Result<()> {
        writeln!(self.out, "{}", line(event))?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::plain::tests::hello_converge;

    #[test]
    fn each_event_is_one_json_object_per_line() {
        let mut json = Json::new(Vec::new());
        for event in hello_converge() {
            json.event(&event).unwrap();
        }
        let out = String::from_utf8(json.into_inner()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), hello_converge().len());
        assert_eq!(
            lines[0],
            r#"{"schema":2,"converge_id":"c-17","seq":1,"at_ms":1700000000000,"kind":"started","image":"","message":"","bytes":0,"millis":0}"#
        );
        assert_eq!(
            lines[1],
            format!(
                r#"{{"schema":2,"converge_id":"c-17","seq":2,"at_ms":1700000000100,"kind":"need_contexts","image":"","message":"","bytes":0,"millis":0,"contexts":["{}","{}"]}}"#,
                "a".repeat(64),
                "b".repeat(64)
            )
        );
        assert_eq!(
            lines[5],
            r##"{"schema":2,"converge_id":"c-17","seq":6,"at_ms":1700000000500,"kind":"build_log","image":"web","message":"#1 [internal] load build definition","bytes":0,"millis":0}"##
        );
        assert_eq!(
            lines[7],
            r#"{"schema":2,"converge_id":"c-17","seq":8,"at_ms":1700000000700,"kind":"built","image":"web","message":"","bytes":0,"millis":3210}"#
        );
        assert_eq!(
            lines[12],
            r#"{"schema":2,"converge_id":"c-17","seq":13,"at_ms":1700000001200,"kind":"finished","image":"","message":"","bytes":0,"millis":5000,"outcome":"succeeded"}"#
        );
    }

    #[test]
    fn sweep_events_carry_their_store_owner_ref_and_count() {
        let removed = Event {
            store: "docker@h".into(),
            instance: "shop".into(),
            reference: "shop-api:old".into(),
            bytes: 7,
            ..Event::new(EventKind::Removed, "", "")
        };
        assert_eq!(
            line(&removed),
            r#"{"schema":2,"converge_id":"","seq":0,"at_ms":0,"kind":"removed","image":"","message":"","bytes":7,"millis":0,"store":"docker@h","instance":"shop","reference":"shop-api:old"}"#
        );
        let swept = Event { bytes: 7, ..Event::new(EventKind::Swept, "", "") };
        assert_eq!(
            line(&swept),
            r#"{"schema":2,"converge_id":"","seq":0,"at_ms":0,"kind":"swept","image":"","message":"","bytes":7,"millis":0,"count":0}"#
        );
    }

    #[test]
    fn messages_are_escaped_not_broken_across_lines() {
        let event = Event::new(EventKind::BuildLog, "web", "say \"hi\"\n\tthen go");
        assert_eq!(
            line(&event),
            r#"{"schema":2,"converge_id":"","seq":0,"at_ms":0,"kind":"build_log","image":"web","message":"say \"hi\"\n\tthen go","bytes":0,"millis":0}"#
        );
    }
}
