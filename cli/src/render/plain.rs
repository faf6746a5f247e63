//! Plain lines, one per event: what a pipe, a CI log or `kiln logs > file` gets.

use std::io::{self, Write};

use super::{context_names, job_of, line_text, with_image, ContextNames, Render, Tails};
use crate::event::{Event, EventKind};
use crate::request::UpPlan;

/// Writes one line per event to `out`, flushing after each so a slow converge shows as it goes.
#[derive(Debug)]
pub struct Plain<W> {
    out: W,
    names: ContextNames,
    tails: Tails,
    /// The job (`gc`, `down x`) the converge's `Started` named; `None` for an up.
    job: Option<String>,
}

impl<W: Write + Send> Plain<W> {
    pub fn new(out: W) -> Plain<W> {
        Plain { out, names: ContextNames::new(), tails: Tails::default(), job: None }
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

impl<W: Write + Send> Render for Plain<W> {
    fn addressed(&mut self, plan: &UpPlan) {
        self.names = context_names(plan);
    }

    fn event(&mut self, event: &Event) -> io::Result<()> {
        if event.kind == EventKind::BuildLog {
            self.tails.push(&event.image, &event.message);
        }
        if let Some(job) = job_of(event) {
            self.job = Some(job);
        }
        if let Some(text) = line_text(event, &self.names, self.job.as_deref()) {
            writeln!(self.out, "{}", with_image(&event.image, &text))?;
        }
        // The log lines already went by, but interleaved with every other image's; the failing
        // image's own tail, next to its failure, is what the reader needs.
        if event.kind == EventKind::Failed {
            for line in self.tails.report(&event.image) {
                writeln!(self.out, "{line}")?;
            }
        }
        self.out.flush()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::event::Outcome;

    fn ev(kind: EventKind, image: &str, message: &str) -> Event {
        Event { converge_id: "c-17".into(), ..Event::new(kind, image, message) }
    }

    /// A converge of examples/hello, as a coordinator would narrate it.
    pub(crate) fn hello_converge() -> Vec<Event> {
        let web = "a".repeat(64);
        let worker = "b".repeat(64);
        let mut seq = vec![
            ev(EventKind::Started, "", ""),
            Event { contexts: vec![web.clone(), worker.clone()], ..ev(EventKind::NeedContexts, "", "") },
            Event { bytes: 2_048, ..ev(EventKind::Uploaded, "web", "") },
            ev(EventKind::Held, "worker", "hello-worker:50930772e841-amd64"),
            ev(EventKind::Building, "web", ""),
            ev(EventKind::BuildLog, "web", "#1 [internal] load build definition"),
            ev(EventKind::BuildLog, "web", "#2 COPY . /usr/share/www"),
            Event { millis: 3_210, ..ev(EventKind::Built, "web", "") },
            Event { bytes: 1_500_000, ..ev(EventKind::Progress, "web", "") },
            ev(EventKind::Delivered, "web", ""),
            ev(EventKind::Recorded, "shell", "busybox:1.36"),
            ev(EventKind::Note, "", "swept 4 image(s) (2.1 GB)"),
            Event { outcome: Outcome::Succeeded, millis: 5_000, ..ev(EventKind::Finished, "", "") },
        ];
        for (i, event) in seq.iter_mut().enumerate() {
            event.seq = i as u64 + 1;
            event.at_ms = 1_700_000_000_000 + i as u64 * 100;
        }
        seq
    }

    fn render(events: &[Event], names: ContextNames) -> String {
        let mut plain = Plain::new(Vec::new());
        plain.names = names;
        for event in events {
            plain.event(event).unwrap();
        }
        String::from_utf8(plain.into_inner()).unwrap()
    }

    #[test]
    fn a_converge_reads_one_line_per_event() {
        let names = ContextNames::from([("a".repeat(64), vec!["web".into()]), ("b".repeat(64), vec!["worker".into()])]);
        let golden = "\
converge c-17 started
uploading 2 context(s): web, worker
web      uploaded context, 2.0 kB
worker   held (hello-worker:50930772e841-amd64)
web      building
web | #1 [internal] load build definition
web | #2 COPY . /usr/share/www
web      built in 3.2 s
web      delivered
shell    recorded (busybox:1.36)
swept 4 image(s) (2.1 GB)
converged in 5.0 s
";
        assert_eq!(render(&hello_converge(), names), golden);
    }

    #[test]
    fn a_gc_reads_as_removals_a_total_and_done() {
        let removed = |reference: &str, bytes| Event {
            store: "docker@h".into(),
            instance: "shop".into(),
            reference: reference.into(),
            bytes,
            ..ev(EventKind::Removed, "", "")
        };
        let events = vec![
            ev(EventKind::Started, "", "gc"),
            removed("shop-api:old1", 1_200_000),
            removed("shop-api:alias", 0),
            Event {
                store: "docker@h".into(),
                reference: "shop-web:old".into(),
                ..ev(EventKind::NotRemoved, "", "conflict: in use")
            },
            Event { count: 1, bytes: 1_200_000, ..ev(EventKind::Swept, "", "") },
            Event { outcome: Outcome::Succeeded, ..ev(EventKind::Finished, "", "1 removal(s) failed") },
        ];
        let golden = "\
converge c-17 started: gc
removed shop-api:old1 from docker@h (1.2 MB)
removed shop-api:alias from docker@h
kept shop-web:old on docker@h: conflict: in use
swept 1 image(s) (1.2 MB)
gc: done (1 removal(s) failed)
";
        assert_eq!(render(&events, ContextNames::new()), golden);
    }

    #[test]
    fn a_dry_run_names_each_removal_with_its_owner_and_bytes() {
        let planned = Event {
            store: "docker@h".into(),
            instance: "shared".into(),
            reference: "base:abc".into(),
            bytes: 2_100_000_000,
            ..ev(EventKind::Planned, "", "")
        };
        let untag = Event { bytes: 0, reference: "base:alias".into(), ..planned.clone() };
        let out = render(&[planned, untag], ContextNames::new());
        assert_eq!(
            out,
            "would remove base:abc from docker@h (shared, 2.1 GB)\nwould remove base:alias from docker@h (shared, untag only)\n"
        );
    }

    #[test]
    fn a_replay_without_the_manifest_names_contexts_by_digest() {
        let out = render(&hello_converge()[1..2], ContextNames::new());
        assert_eq!(out, "uploading 2 context(s): aaaaaaaaaaaa, bbbbbbbbbbbb\n");
    }

    #[test]
    fn a_failure_shows_the_failing_images_last_log_lines() {
        let mut events = vec![ev(EventKind::Building, "worker", "")];
        for i in 1..=22 {
            events.push(ev(EventKind::BuildLog, "worker", &format!("#{i} RUN step")));
            events.push(ev(EventKind::BuildLog, "web", "interleaved"));
        }
        events.push(ev(EventKind::Failed, "worker", "build failed: RUN step exited 1"));
        events.push(Event {
            outcome: Outcome::Failed,
            ..ev(EventKind::Finished, "", "worker: build failed: RUN step exited 1")
        });
        let out = render(&events, ContextNames::new());
        let tail: Vec<&str> = out.lines().skip(1 + 44).collect();
        assert_eq!(tail[0], "worker   failed: build failed: RUN step exited 1");
        assert_eq!(tail[1], "── last 20 log line(s) of worker ──");
        assert_eq!(tail[2], "worker | #3 RUN step");
        assert_eq!(tail[21], "worker | #22 RUN step");
        // The reason was said once, on the failed image's line; the end only says where to look.
        assert_eq!(tail[22], "converge failed — `kiln logs c-17` replays it");
        assert_eq!(out.matches("RUN step exited 1").count(), 1, "{out}");
        assert_eq!(tail.len(), 23);
    }
}
