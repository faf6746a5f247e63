//! The classic builder's output, cut into lines and remembered well enough to say where a failed
//! build stopped.
//!
//! Docker sends build output as `stream` fragments that need not end at line boundaries (a step's
//! output can arrive in pieces, and one fragment can hold several lines), so lines are reassembled
//! before they reach the converge's event log. The last `Step N/M : …` line is kept because the
//! daemon's error message alone rarely says which instruction failed.

/// Reassembles build output into lines and tracks the step being run.
#[derive(Debug, Default)]
pub(super) struct BuildLog {
    partial: String,
    step: Option<String>,
}

impl BuildLog {
    /// Adds one `stream` fragment; returns the lines it completed.
    pub(super) fn push(&mut self, fragment: &str) -> Vec<String> {
        self.partial.push_str(fragment);
        let mut lines = Vec::new();
        while let Some(end) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=end).collect();
            lines.push(self.note(line.trim_end_matches(['\n', '\r']).to_string()));
        }
        lines
    }

    /// The unterminated last line, if the output ended without a newline.
    pub(super) fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.partial);
        (!rest.is_empty()).then(|| self.note(rest))
    }

    /// Where the build stopped and why, for `HostError::BuildFailed::step`.
    pub(super) fn failed_at(&self, message: &str) -> String {
        let message = message.trim();
        match &self.step {
            Some(step) => format!("{step} — {message}"),
            None => format!("its start (before any step ran) — {message}"),
        }
    }

    fn note(&mut self, line: String) -> String {
        if line.starts_with("Step ") {
            self.step = Some(line.clone());
        }
        line
    }
}

/// The 1-based number of the step a failed build's `step` text names: `Step 2/3 : COPY …` (the
/// classic builder), `[2/3] RUN …` or `[stage-1 2/3] RUN …` (BuildKit). `None` for a failure
/// before any step ran, or a BuildKit vertex of its own (`[internal] load …`).
pub fn step_number(step: &str) -> Option<u32> {
    // The text after ` — ` is the daemon's message, which may hold fractions of its own.
    let named = step.split(" — ").next().unwrap_or(step);
    let first = named.split_whitespace().take(3).find_map(|word| {
        let (n, of) = word.trim_matches(|c| c == '[' || c == ']' || c == ':').split_once('/')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        (digits(n) && digits(of)).then(|| n.parse::<u32>().ok()).flatten()
    })?;
    (first > 0).then_some(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_step_s_number_is_read_from_either_builder_s_spelling() {
        assert_eq!(step_number("Step 2/3 : COPY missing.txt / — COPY failed: no source files"), Some(2));
        assert_eq!(
            step_number("[2/2] RUN false — process \"/bin/sh -c false\" did not complete: exit code 1/2"),
            Some(2)
        );
        assert_eq!(step_number("[stage-1 3/4] RUN make — exit code 2"), Some(3));
        assert_eq!(step_number("its start (before any step ran) — dockerfile parse error on line 1/2"), None);
        assert_eq!(step_number("[internal] load build definition from Dockerfile — 1/1 failed"), None);
        assert_eq!(step_number("its end — the daemon reported success, but no image wears the tag"), None);
    }

    #[test]
    fn fragments_are_reassembled_into_lines() {
        let mut log = BuildLog::default();
        assert_eq!(log.push("Step 1/2 : FROM scr"), Vec::<String>::new());
        assert_eq!(
            log.push("atch\n ---> \nStep 2/2 : COPY a /\r\n"),
            ["Step 1/2 : FROM scratch", " ---> ", "Step 2/2 : COPY a /"]
        );
        assert_eq!(log.push("tail"), Vec::<String>::new());
        assert_eq!(log.finish().as_deref(), Some("tail"));
        assert_eq!(log.finish(), None);
    }

    #[test]
    fn a_failure_names_the_last_step_started() {
        let mut log = BuildLog::default();
        assert_eq!(log.failed_at("no Dockerfile\n"), "its start (before any step ran) — no Dockerfile");
        log.push("Step 1/2 : FROM scratch\nStep 2/2 : COPY missing /\n");
        assert_eq!(log.failed_at("COPY failed"), "Step 2/2 : COPY missing / — COPY failed");
    }
}
