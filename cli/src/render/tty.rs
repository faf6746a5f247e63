//! The terminal view: one live line per image, showing where it is — hashing, uploading (bytes),
//! building (with its last build log line), pushing (bytes) — and converge-wide events printed
//! above them as they come.
//!
//! What each line says is decided by [`bar_text`], a pure function tested on its own; this module
//! only moves indicatif's bars.

use std::collections::HashMap;
use std::io;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::{context_names, human_bytes, job_of, line_text, status_text, ContextNames, Render, Tails};
use crate::event::{Event, EventKind};
use crate::request::UpPlan;

/// What an image's line shows after `event`; `None` when the event is not about one image's state.
pub fn bar_text(event: &Event, names: &ContextNames) -> Option<String> {
    if event.image.is_empty() {
        return None;
    }
    match event.kind {
        EventKind::BuildLog => Some(format!("building: {}", event.message)),
        EventKind::Progress if event.message.is_empty() => Some(format!("pushing {}", human_bytes(event.bytes))),
        // A copy into the mirror tells its total (in `millis`): a bar, with bytes and percent.
        EventKind::Progress if event.millis > 0 => Some(format!(
            "{} {} {} / {} ({}%)",
            event.message,
            progress_bar(event.bytes, event.millis),
            human_bytes(event.bytes),
            human_bytes(event.millis),
            event.bytes.saturating_mul(100) / event.millis
        )),
        EventKind::Progress => Some(format!("{} {}", event.message, human_bytes(event.bytes))),
        _ => status_text(event, names),
    }
}

/// `[#####-----]`: `done` of `total` in 20 cells.
fn progress_bar(done: u64, total: u64) -> String {
    let cells = (done.min(total).saturating_mul(20) / total.max(1)) as usize;
    format!("[{}{}]", "#".repeat(cells), "-".repeat(20 - cells))
}

pub struct Tty {
    multi: MultiProgress,
    bars: HashMap<String, ProgressBar>,
    names: ContextNames,
    /// Per context digest: its archive's expected size, and when its upload started.
    uploads: HashMap<String, (u64, Option<std::time::Instant>)>,
    tails: Tails,
    /// The job (`gc`, `down x`) the converge's `Started` named; `None` for an up.
    job: Option<String>,
    running: ProgressStyle,
    done: ProgressStyle,
}

impl std::fmt::Debug for Tty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tty").field("images", &self.bars.len()).finish_non_exhaustive()
    }
}

impl Default for Tty {
    fn default() -> Self {
        Tty::new()
    }
}

impl Tty {
    pub fn new() -> Tty {
        let running = ProgressStyle::with_template("{spinner:.cyan} {prefix:<8.bold} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        let done = ProgressStyle::with_template("  {prefix:<8.bold} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner());
        Tty {
            multi: MultiProgress::with_draw_target(ProgressDrawTarget::stdout()),
            bars: HashMap::new(),
            names: ContextNames::new(),
            uploads: HashMap::new(),
            tails: Tails::default(),
            job: None,
            running,
            done,
        }
    }

    fn bar(&mut self, image: &str) -> &ProgressBar {
        if !self.bars.contains_key(image) {
            let bar = self.multi.add(ProgressBar::new_spinner().with_style(self.running.clone()));
            bar.set_prefix(image.to_string());
            bar.enable_steady_tick(Duration::from_millis(120));
            self.bars.insert(image.to_string(), bar);
        }
        &self.bars[image]
    }

    fn settle(&mut self, image: &str, text: String) {
        let style = self.done.clone();
        let bar = self.bar(image);
        bar.set_style(style);
        bar.finish_with_message(text);
    }
}

impl Render for Tty {
    fn addressing(&mut self, images: &[String]) {
        for image in images {
            self.bar(image).set_message("hashing");
        }
    }

    fn addressed(&mut self, plan: &UpPlan) {
        self.names = context_names(plan);
        self.uploads = plan.contexts.iter().map(|(d, c)| (d.clone(), (c.archive_bytes, None))).collect();
        for image in &plan.request.images {
            if self.bars.contains_key(&image.name) {
                self.bar(&image.name).set_message(format!("addressed {}", image.reference));
            }
        }
    }

    fn event(&mut self, event: &Event) -> io::Result<()> {
        if event.kind == EventKind::BuildLog {
            self.tails.push(&event.image, &event.message);
        }
        if let Some(job) = job_of(event) {
            self.job = Some(job);
        }
        match bar_text(event, &self.names) {
            Some(text) => match event.kind {
                EventKind::Recorded | EventKind::Delivered | EventKind::Mirrored | EventKind::InMirror => {
                    self.settle(&event.image, text)
                }
                EventKind::Failed => {
                    self.settle(&event.image, text);
                    for line in self.tails.report(&event.image) {
                        self.multi.println(line)?;
                    }
                }
                _ => self.bar(&event.image).set_message(text),
            },
            None => {
                if let Some(text) = line_text(event, &self.names, self.job.as_deref()) {
                    self.multi.println(text)?;
                }
                if event.kind == EventKind::NeedContexts {
                    for digest in &event.contexts {
                        for image in self.names.get(digest).cloned().unwrap_or_default() {
                            self.bar(&image).set_message("uploading context");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn upload_progress(&mut self, digest: &str, sent: u64) {
        let (total, started) = self.uploads.entry(digest.to_string()).or_insert((0, None));
        let elapsed = started.get_or_insert_with(std::time::Instant::now).elapsed();
        let text = upload_text(sent, *total, elapsed);
        for image in self.names.get(digest).cloned().unwrap_or_default() {
            self.bar(&image).set_message(text.clone());
        }
    }

    fn finish(&mut self) -> io::Result<()> {
        let images: Vec<String> = self.bars.keys().cloned().collect();
        for image in images {
            let bar = &self.bars[&image];
            if !bar.is_finished() {
                let text = bar.message();
                self.settle(&image, text);
            }
        }
        Ok(())
    }
}

/// `uploading context 12.3 MB of 40.1 MB (31%, 210.0 MB/s)`; without a known total, the bytes and
/// rate alone.
pub fn upload_text(sent: u64, total: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64();
    let rate = (secs > 0.05).then(|| format!("{}/s", human_bytes((sent as f64 / secs) as u64)));
    let mut details = Vec::new();
    let mut text = format!("uploading context {}", human_bytes(sent));
    if total > 0 {
        text.push_str(&format!(" of {}", human_bytes(total)));
        details.push(format!("{}%", (sent.min(total) * 100) / total));
    }
    details.extend(rate);
    if !details.is_empty() {
        text.push_str(&format!(" ({})", details.join(", ")));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upload_line_shows_total_percentage_and_rate() {
        assert_eq!(
            upload_text(12_300_000, 41_000_000, Duration::from_secs(1)),
            "uploading context 12.3 MB of 41.0 MB (30%, 12.3 MB/s)"
        );
        assert_eq!(upload_text(0, 41_000_000, Duration::ZERO), "uploading context 0 B of 41.0 MB (0%)");
        assert_eq!(upload_text(5_000_000, 0, Duration::from_secs(2)), "uploading context 5.0 MB (2.5 MB/s)");
    }

    #[test]
    fn an_images_line_follows_its_state() {
        let names = ContextNames::new();
        let log = Event::new(EventKind::BuildLog, "web", "#4 RUN make");
        assert_eq!(bar_text(&log, &names).as_deref(), Some("building: #4 RUN make"));
        let push = Event { bytes: 12_300_000, ..Event::new(EventKind::Progress, "web", "") };
        assert_eq!(bar_text(&push, &names).as_deref(), Some("pushing 12.3 MB"));
        let built = Event { millis: 3_200, ..Event::new(EventKind::Built, "web", "") };
        assert_eq!(bar_text(&built, &names).as_deref(), Some("built in 3.2 s"));
        let recorded = Event::new(EventKind::Recorded, "web", "hello-web:17eb17246f39-amd64");
        assert_eq!(bar_text(&recorded, &names).as_deref(), Some("recorded (hello-web:17eb17246f39-amd64)"));
        let swept = Event::new(EventKind::Note, "", "swept 4 image(s) (2.1 GB)");
        assert_eq!(bar_text(&swept, &names), None, "converge-wide events print above the lines");
    }

    #[test]
    fn a_copy_into_the_mirror_shows_a_bar_bytes_and_percent_then_what_it_moved() {
        let names = ContextNames::new();
        let copying =
            Event { bytes: 50_000_000, millis: 200_000_000, ..Event::new(EventKind::Progress, "envoy", "copying") };
        assert_eq!(
            bar_text(&copying, &names).as_deref(),
            Some("copying [#####---------------] 50.0 MB / 200.0 MB (25%)")
        );
        let words = "copied 4 blob(s) from up/envoy:v1@sha256:ab → mirror/envoy:v1@sha256:ab";
        let mirrored = Event { bytes: 400_000_000, millis: 2_500, ..Event::new(EventKind::Mirrored, "envoy", words) };
        assert_eq!(bar_text(&mirrored, &names), Some(format!("mirrored 400.0 MB in 2.5 s ({words})")));
    }
}
