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

#[cfg(test)]
mod tests {
    use super::*;

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
