//! Showing a converge's events: one renderer per output mode, fed the same events by `up` as they
//! stream and by `logs` as they replay, so a replay reads exactly like the live run.
//!
//! - [`plain`]: one line per event (`web      built in 3.2 s`, `web | <log line>`), for pipes and CI.
//! - [`json`]: one JSON object per event on stdout, for scripts.
//! - [`tty`]: a live line per image (hashing, uploading, building with its last log line,
//!   pushing with bytes), for a terminal.
//!
//! The words are decided once, in [`status_text`], so the plain and terminal views never disagree.

pub mod json;
pub mod plain;
pub mod tty;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, IsTerminal};

use crate::event::{Event, EventKind, Outcome};
use crate::request::UpPlan;

/// How a command shows what it does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputMode {
    /// Live progress on a terminal, plain lines otherwise.
    #[default]
    Auto,
    Plain,
    /// One JSON object per event (or one document for `status`, `images`, `agents`).
    Json,
    /// Nothing on stdout: for callers (tests) that read the returned values instead.
    Quiet,
}

/// Something that shows a converge as it goes.
pub trait Render: Send {
    /// Before the walk: these built images are being hashed.
    fn addressing(&mut self, _images: &[String]) {}
    /// After the walk: the refs and the context of each image are known.
    fn addressed(&mut self, _plan: &UpPlan) {}
    fn event(&mut self, event: &Event) -> io::Result<()>;
    /// `sent` bytes of the context with tree `digest` are on their way.
    fn upload_progress(&mut self, _digest: &str, _sent: u64) {}
    fn finish(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The renderer for `mode` on this process's stdout.
pub fn renderer(mode: OutputMode) -> Box<dyn Render> {
    match mode {
        OutputMode::Auto if io::stdout().is_terminal() => Box::new(tty::Tty::new()),
        OutputMode::Auto | OutputMode::Plain => Box::new(plain::Plain::new(io::stdout())),
        OutputMode::Json => Box::new(json::Json::new(io::stdout())),
        OutputMode::Quiet => Box::new(Quiet),
    }
}

/// Shows nothing.
#[derive(Debug)]
pub struct Quiet;

impl Render for Quiet {
    fn event(&mut self, _event: &Event) -> io::Result<()> {
        Ok(())
    }
}

/// Which images each context digest belongs to, so "uploading" can name images, not hashes. A
/// replay (`kiln logs`) has no manifest and falls back to the digests' first 12 characters.
pub type ContextNames = BTreeMap<String, Vec<String>>;

pub fn context_names(plan: &UpPlan) -> ContextNames {
    plan.contexts.iter().map(|(digest, source)| (digest.clone(), source.images.clone())).collect()
}

/// What an event says, without its image column; `None` for events a line-per-event view skips
/// (byte progress, which would flood a log).
pub fn status_text(event: &Event, names: &ContextNames) -> Option<String> {
    let paren = |word: &str| match event.message.is_empty() {
        true => word.to_string(),
        false => format!("{word} ({})", event.message),
    };
    let text = match event.kind {
        EventKind::Started => match event.message.is_empty() {
            true => format!("converge {} started", event.converge_id),
            false => format!("converge {} started: {}", event.converge_id, event.message),
        },
        EventKind::NeedContexts => {
            let listed: Vec<String> = event
                .contexts
                .iter()
                .map(|digest| match names.get(digest) {
                    Some(images) => images.join("+"),
                    None => digest.chars().take(12).collect(),
                })
                .collect();
            format!("uploading {} context(s): {}", listed.len(), listed.join(", "))
        }
        EventKind::Uploaded => match event.bytes {
            0 => paren("uploaded context"),
            bytes => paren(&format!("uploaded context, {}", human_bytes(bytes))),
        },
        EventKind::Recorded => paren("recorded"),
        // With a reason, the coordinator's message is the whole line: `held (built by converge …)`,
        // `gone from registry … — pushing again`, `building web:… on h1: context changed (…)`.
        EventKind::Held | EventKind::Building | EventKind::Would if event.reason.is_some() => event.message.clone(),
        EventKind::Held => paren("held"),
        EventKind::Building => paren("building"),
        EventKind::Would => event.message.clone(),
        EventKind::ContextsCollected => {
            format!("{} ({})", event.message, human_bytes(event.bytes))
        }
        EventKind::BuildLog => format!("| {}", event.message),
        EventKind::Built => paren(&format!("built in {}", seconds(event.millis))),
        EventKind::Pushing => paren("pushing"),
        EventKind::Progress => return None,
        EventKind::Pushed => {
            let mut word = format!("pushed {}", human_bytes(event.bytes));
            if event.millis > 0 {
                word = format!("{word} in {}", seconds(event.millis));
            }
            paren(&word)
        }
        EventKind::Delivered => paren("delivered"),
        EventKind::Note | EventKind::Queued | EventKind::Requeued => event.message.clone(),
        EventKind::InMirror | EventKind::WouldMirror => event.message.clone(),
        EventKind::Mirrored => match event.millis {
            0 => format!("mirrored {} ({})", human_bytes(event.bytes), event.message),
            ms => format!("mirrored {} in {} ({})", human_bytes(event.bytes), seconds(ms), event.message),
        },
        EventKind::Failed => format!("failed: {}", event.message),
        EventKind::Finished => match (event.outcome, event.millis) {
            (Outcome::Succeeded, 0) => "converged".to_string(),
            (Outcome::Succeeded, ms) => format!("converged in {}", seconds(ms)),
            // The reason was the `failed` line just before; said once is enough.
            (Outcome::Failed, _) => format!("converge failed — `kiln logs {}` replays it", event.converge_id),
            (other, _) => paren(&format!("converge finished {}", other.word())),
        },
        EventKind::Planned => {
            let frees = match event.bytes {
                0 => "untag only".to_string(),
                bytes => human_bytes(bytes),
            };
            format!("would remove {} from {} ({}, {frees})", event.reference, event.store, event.instance)
        }
        EventKind::Removed => match event.bytes {
            0 => format!("removed {} from {}", event.reference, event.store),
            bytes => format!("removed {} from {} ({})", event.reference, event.store, human_bytes(bytes)),
        },
        EventKind::NotRemoved => format!("kept {} on {}: {}", event.reference, event.store, event.message),
        EventKind::Swept => format!("swept {} image(s) ({})", event.count, human_bytes(event.bytes)),
        EventKind::RecordDeleted => format!("deleted the record of {}", event.instance),
        EventKind::Unknown(n) => match event.message.is_empty() {
            true => format!("(event of kind {n})"),
            false => event.message.clone(),
        },
    };
    Some(text)
}

/// How a job that is not an up (`gc`, `down <instance>`, named by its `Started` message) ended;
/// an up's `Finished` says "converged", which would be the wrong word for them.
pub fn job_finished_text(event: &Event, job: &str) -> String {
    match (event.outcome, event.message.is_empty()) {
        (Outcome::Succeeded, true) => format!("{job}: done"),
        (Outcome::Succeeded, false) => format!("{job}: done ({})", event.message),
        // The reason was the `failed` line just before.
        _ => format!("{job} failed"),
    }
}

/// The line for `event`, given the job its converge's `Started` named (`None` for an up).
pub fn line_text(event: &Event, names: &ContextNames, job: Option<&str>) -> Option<String> {
    match (event.kind, job) {
        (EventKind::Finished, Some(job)) => Some(job_finished_text(event, job)),
        _ => status_text(event, names),
    }
}

/// The job a `Started` event names, if it is not an up.
pub fn job_of(event: &Event) -> Option<String> {
    (event.kind == EventKind::Started && !event.message.is_empty()).then(|| event.message.clone())
}

/// `web      <text>`: the image column padded to 8 so a converge's lines align; converge-wide
/// events carry no column. Log lines are `web | <line>`, unpadded, like `docker compose`.
pub fn with_image(image: &str, text: &str) -> String {
    if image.is_empty() {
        text.to_string()
    } else if let Some(line) = text.strip_prefix("| ") {
        format!("{image} | {line}")
    } else {
        format!("{image:<8} {text}")
    }
}

/// Bytes in decimal units with one decimal, as `docker images` shows them: `2.1 GB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 999.95 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Milliseconds as seconds with one decimal: `3.2 s`.
pub fn seconds(millis: u64) -> String {
    format!("{:.1} s", millis as f64 / 1000.0)
}

/// How many of a failing image's last log lines are shown again when it fails.
pub const TAIL_LINES: usize = 20;

/// The last [`TAIL_LINES`] build log lines of each image, kept so a failure can show what led to it.
#[derive(Debug, Default)]
pub struct Tails {
    lines: HashMap<String, VecDeque<String>>,
}

impl Tails {
    pub fn push(&mut self, image: &str, line: &str) {
        let tail = self.lines.entry(image.to_string()).or_default();
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line.to_string());
    }

    /// The heading and lines to print when `image` fails; empty when it logged nothing.
    pub fn report(&self, image: &str) -> Vec<String> {
        let Some(tail) = self.lines.get(image).filter(|t| !t.is_empty()) else { return Vec::new() };
        let mut out = vec![format!("── last {} log line(s) of {image} ──", tail.len())];
        out.extend(tail.iter().map(|line| format!("{image} | {line}")));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_seconds_read_like_docker() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(1_000), "1.0 kB");
        assert_eq!(human_bytes(2_100_000_000), "2.1 GB");
        assert_eq!(human_bytes(999_999), "1.0 MB", "rounding up never prints 1000.0 kB");
        assert_eq!(seconds(3_210), "3.2 s");
        assert_eq!(seconds(40), "0.0 s");
    }

    #[test]
    fn a_tail_keeps_the_last_twenty_lines() {
        let mut tails = Tails::default();
        for i in 0..25 {
            tails.push("web", &format!("step {i}"));
        }
        let report = tails.report("web");
        assert_eq!(report.len(), 21);
        assert_eq!(report[0], "── last 20 log line(s) of web ──");
        assert_eq!(report[1], "web | step 5");
        assert_eq!(report[20], "web | step 24");
        assert!(tails.report("worker").is_empty());
    }
}
