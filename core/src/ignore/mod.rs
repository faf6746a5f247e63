//! `.dockerignore` with Docker's own rules (moby's `ignorefile` reader and `patternmatcher`), so the
//! entries Kiln hashes and ships are exactly the ones `docker build` would send: a pattern that Kiln
//! read even slightly differently would address one tree and build another.
//!
//! Reading: a UTF-8 BOM is dropped from the first line; a line starting with `#` (column 0, before
//! trimming) is a comment; lines are trimmed, empty ones skipped; a leading `!` marks an exception;
//! each pattern is cleaned like Go's `filepath.Clean` and loses one leading `/`. Matching: patterns
//! apply in order, the last one that matches wins, and a pattern matches a path when it matches the
//! path or any of its parent directories. Each pattern becomes an anchored regex (`**` crosses
//! directories, `*` and `?` do not), with Docker's exact/prefix/suffix shortcuts kept because they
//! are part of its observable behaviour: `**foo` is a plain suffix test, so it matches `barfoo`.

mod pattern;

pub(crate) use pattern::go_clean;
use pattern::{check_glob_syntax, compile, Matcher};

/// Why a `.dockerignore` was refused. Docker refuses the same lines, so a context that Kiln accepts
/// is one Docker accepts too.
#[derive(Debug, thiserror::Error)]
pub enum IgnoreError {
    #[error(
        ".dockerignore line {line}: `{pattern}` is an exception with no pattern — write `!path` or remove the line"
    )]
    EmptyException { line: usize, pattern: String },
    #[error(".dockerignore line {line}: `{pattern}` is not a valid pattern ({why}) — fix or escape it with `\\`")]
    BadPattern { line: usize, pattern: String, why: &'static str },
}

/// A parsed `.dockerignore`: its patterns in file order.
#[derive(Debug, Clone, Default)]
pub struct DockerIgnore {
    patterns: Vec<Pattern>,
}

#[derive(Debug, Clone)]
struct Pattern {
    /// The cleaned pattern without its `!`: Docker's directory skipping compares this text.
    text: String,
    exception: bool,
    matcher: Matcher,
}

impl DockerIgnore {
    /// A `.dockerignore` that excludes nothing (the context has none).
    pub fn empty() -> DockerIgnore {
        DockerIgnore::default()
    }

    /// Parses the text of a `.dockerignore`. Line numbers in errors count from 1.
    pub fn parse(text: &str) -> Result<DockerIgnore, IgnoreError> {
        let mut patterns = Vec::new();
        for (i, raw) in text.split('\n').enumerate() {
            let line = i + 1;
            let mut raw = raw.strip_suffix('\r').unwrap_or(raw);
            if i == 0 {
                raw = raw.strip_prefix('\u{feff}').unwrap_or(raw);
            }
            if raw.starts_with('#') {
                continue;
            }
            let trimmed = raw.trim();
            if trimmed.is_empty() {
                continue;
            }
            // moby's ignorefile reader: `!` off, trimmed again, cleaned, one leading `/` off.
            let (invert, body) = match trimmed.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, trimmed),
            };
            let mut read = if body.is_empty() { String::new() } else { go_clean(body) };
            if read.len() > 1 && read.starts_with('/') {
                read.remove(0);
            }
            if invert {
                read.insert(0, '!');
            }
            // Then patternmatcher.New trims and cleans the line once more and only then takes the
            // `!` off: `/ a` means `a`, `/!a` is an exception, and `!/` is a bare `!`.
            let again = read.trim();
            if again.is_empty() {
                continue;
            }
            let again = go_clean(again);
            let (exception, cleaned) = match again.strip_prefix('!') {
                Some(rest) => (true, rest.to_string()),
                None => (false, again),
            };
            if exception && cleaned.is_empty() {
                return Err(IgnoreError::EmptyException { line, pattern: trimmed.to_string() });
            }
            let bad = |why| IgnoreError::BadPattern { line, pattern: trimmed.to_string(), why };
            check_glob_syntax(&cleaned).map_err(bad)?;
            let matcher = compile(&cleaned).map_err(bad)?;
            patterns.push(Pattern { text: cleaned, exception, matcher });
        }
        Ok(DockerIgnore { patterns })
    }

    /// Appends an exception for exactly `rel_path`, the way the Docker CLI appends `!Dockerfile`
    /// and `!.dockerignore` so the builder always receives them. The path is taken literally, not
    /// as a pattern, so a Dockerfile whose name holds `*` or `[` is still kept.
    pub fn keep_always(&mut self, rel_path: &str) {
        self.patterns.push(Pattern {
            text: rel_path.to_string(),
            exception: true,
            matcher: Matcher::Exact(rel_path.to_string()),
        });
    }

    /// True when `rel_path` (`/`-separated, relative, no leading `./`) is left out of the context:
    /// the last pattern that matches it or one of its parent directories is not an exception.
    pub fn is_excluded(&self, rel_path: &str) -> bool {
        let mut excluded = false;
        for p in &self.patterns {
            // An exception can only re-include, and a plain pattern only exclude: skipping the
            // others is Docker's rule, and it decides which of two overlapping patterns wins.
            if p.exception != excluded {
                continue;
            }
            let hit = p.matcher.matches(rel_path)
                || rel_path.match_indices('/').any(|(i, _)| p.matcher.matches(&rel_path[..i]));
            if hit {
                excluded = !p.exception;
            }
        }
        excluded
    }

    /// Whether an excluded directory must still be walked because an exception pattern's text
    /// starts with `dir/` (or is `dir`). Docker decides this on the pattern text, not by matching,
    /// so `!*/keep` does not rescue anything under an excluded `docs`.
    pub fn may_hold_exceptions_under(&self, dir: &str) -> bool {
        self.patterns.iter().filter(|p| p.exception).any(|p| {
            p.text.len() >= dir.len()
                && p.text.starts_with(dir)
                && (p.text.len() == dir.len() || p.text.as_bytes()[dir.len()] == b'/')
        })
    }

    /// True when no pattern can exclude anything (none, or only exceptions): the walk then skips
    /// matching altogether, which on a 20,000-file context is a good part of its CPU time.
    pub fn excludes_nothing(&self) -> bool {
        self.patterns.iter().all(|p| p.exception)
    }

    /// Whether any pattern is an exception (`!…`).
    pub fn has_exceptions(&self) -> bool {
        self.patterns.iter().any(|p| p.exception)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_plain_pattern_can_exclude() {
        assert!(DockerIgnore::empty().excludes_nothing());
        let mut kept = DockerIgnore::parse("!a\n# comment\n").unwrap();
        kept.keep_always("Dockerfile");
        assert!(kept.excludes_nothing());
        assert!(!DockerIgnore::parse("!a\nb\n").unwrap().excludes_nothing());
    }

    fn ignore(text: &str) -> DockerIgnore {
        DockerIgnore::parse(text).unwrap()
    }

    #[test]
    fn star_stays_in_one_directory() {
        let di = ignore("*.md");
        assert!(di.is_excluded("README.md"));
        assert!(!di.is_excluded("docs/a.md"));
    }

    #[test]
    fn double_star_crosses_directories() {
        let di = ignore("**/*.md");
        assert!(di.is_excluded("README.md"));
        assert!(di.is_excluded("docs/a.md"));
        assert!(di.is_excluded("docs/deep/er/a.md"));
        assert!(!di.is_excluded("docs/a.mdx"));
    }

    #[test]
    fn a_directory_pattern_excludes_everything_below() {
        let di = ignore("docs");
        assert!(di.is_excluded("docs"));
        assert!(di.is_excluded("docs/a/b"));
        assert!(!di.is_excluded("docsx"));
        assert!(!di.is_excluded("x/docs"));
    }

    #[test]
    fn trailing_double_star_excludes_contents_but_not_the_dir() {
        let di = ignore("docs/**");
        assert!(di.is_excluded("docs/a"));
        assert!(di.is_excluded("docs/a/b"));
        assert!(!di.is_excluded("docs"));
    }

    #[test]
    fn exception_re_includes_and_keeps_the_dir_walkable() {
        let di = ignore("docs\n!docs/keep.md\n");
        assert!(di.is_excluded("docs"));
        assert!(di.is_excluded("docs/other.md"));
        assert!(!di.is_excluded("docs/keep.md"));
        assert!(di.may_hold_exceptions_under("docs"));
        assert!(!di.may_hold_exceptions_under("doc"));
        assert!(!di.may_hold_exceptions_under("src"));
        assert!(di.has_exceptions());
        assert!(!ignore("docs").has_exceptions());
    }

    #[test]
    fn later_patterns_override_earlier_ones() {
        let di = ignore("*.log\n!keep.log\nkeep.log\n");
        assert!(di.is_excluded("keep.log"));
        let di = ignore("*.log\n!keep.log\n");
        assert!(!di.is_excluded("keep.log"));
        assert!(di.is_excluded("other.log"));
    }

    #[test]
    fn exception_directory_skipping_reads_pattern_text_not_matches() {
        // Docker only descends into an excluded dir when an exception's text starts with it.
        let di = ignore("docs\n!*/keep\n");
        assert!(!di.may_hold_exceptions_under("docs"));
        assert!(!di.is_excluded("docs/keep"));
    }

    #[test]
    fn leading_slash_and_dot_segments_are_cleaned_away() {
        let di = ignore("/foo\n");
        assert!(di.is_excluded("foo"));
        let di = ignore("./foo/../bar\n");
        assert!(di.is_excluded("bar"));
        assert!(!di.is_excluded("foo"));
        let di = ignore("a//b/./c/\n");
        assert!(di.is_excluded("a/b/c"));
    }

    #[test]
    fn a_line_is_trimmed_and_cleaned_again_after_its_leading_slash_goes_as_docker_does() {
        // Found by the `dockerignore` fuzz target (differential against Docker's reader).
        let di = ignore("/ a\n");
        assert!(di.is_excluded("a"));
        assert!(!di.is_excluded(" a"));
        let di = ignore("*\n/!keep\n");
        assert!(!di.is_excluded("keep"), "`/!keep` is an exception once its slash is gone");
        assert!(di.is_excluded("other"));
        let di = ignore("/\t/a/..\n");
        assert!(!di.is_excluded("\t"), "a line that trims to nothing is no pattern");
        assert!(matches!(DockerIgnore::parse("!/\n"), Err(IgnoreError::EmptyException { line: 1, .. })));
    }

    #[test]
    fn only_column_zero_hash_is_a_comment() {
        let di = ignore("#x\n");
        assert!(!di.is_excluded("#x"));
        let di = ignore(" #x\n");
        assert!(di.is_excluded("#x"));
    }

    #[test]
    fn bom_blank_lines_and_whitespace_are_dropped() {
        let di = ignore("\u{feff}a.txt\r\n\n   \n  b.txt  \n!  b.txt\n");
        assert!(di.is_excluded("a.txt"));
        assert!(!di.is_excluded("b.txt"));
        // The BOM only counts on the first line.
        let di = ignore("x\n\u{feff}a.txt\n");
        assert!(!di.is_excluded("a.txt"));
    }

    #[test]
    fn character_classes() {
        let di = ignore("[a-c].txt\n");
        assert!(di.is_excluded("a.txt"));
        assert!(di.is_excluded("c.txt"));
        assert!(!di.is_excluded("d.txt"));
        let di = ignore("[^a-c].txt\n");
        assert!(!di.is_excluded("a.txt"));
        assert!(di.is_excluded("d.txt"));
        // Go's regex reads `[` inside a class literally; Rust's would read a nested class.
        let di = ignore("x[[]\n");
        assert!(di.is_excluded("x["));
    }

    #[test]
    fn escapes_make_meta_characters_literal() {
        let di = ignore("\\*.txt\n");
        assert!(di.is_excluded("*.txt"));
        assert!(!di.is_excluded("a.txt"));
        let di = ignore("a\\?\n");
        assert!(di.is_excluded("a?"));
        assert!(!di.is_excluded("ab"));
    }

    #[test]
    fn regex_meta_characters_are_literal() {
        let di = ignore("a.b+(c)|{d}$\n");
        assert!(di.is_excluded("a.b+(c)|{d}$"));
        assert!(!di.is_excluded("axb+(c)|{d}$"));
        let di = ignore("a.*\n");
        assert!(di.is_excluded("a.txt"));
        assert!(!di.is_excluded("ab"));
    }

    #[test]
    fn question_mark_is_one_non_slash_character() {
        let di = ignore("a?c\n");
        assert!(di.is_excluded("abc"));
        assert!(!di.is_excluded("a/c"));
        assert!(!di.is_excluded("ac"));
    }

    #[test]
    fn double_star_in_the_middle_matches_zero_or_more_directories() {
        let di = ignore("a/**/b\n");
        assert!(di.is_excluded("a/b"));
        assert!(di.is_excluded("a/x/b"));
        assert!(di.is_excluded("a/x/y/b"));
        assert!(!di.is_excluded("a/xb"));
    }

    #[test]
    fn leading_double_star_is_dockers_suffix_test() {
        let di = ignore("**/foo\n");
        assert!(di.is_excluded("foo"));
        assert!(di.is_excluded("a/b/foo"));
        assert!(!di.is_excluded("barfoo"));
        // Without the slash Docker tests a plain suffix, which is wider than its own regex.
        let di = ignore("**foo\n");
        assert!(di.is_excluded("barfoo"));
        assert!(di.is_excluded("a/barfoo"));
        let di = ignore("**\n");
        assert!(di.is_excluded("anything/at/all"));
    }

    #[test]
    fn errors_name_line_and_pattern() {
        match DockerIgnore::parse("a\n\n!\n") {
            Err(IgnoreError::EmptyException { line: 3, pattern }) => assert_eq!(pattern, "!"),
            other => panic!("expected EmptyException on line 3, got {other:?}"),
        }
        match DockerIgnore::parse("ok\n[a-\n") {
            Err(IgnoreError::BadPattern { line: 2, pattern, .. }) => assert_eq!(pattern, "[a-"),
            other => panic!("expected BadPattern on line 2, got {other:?}"),
        }
        let msg = DockerIgnore::parse("x\n  ! \n").unwrap_err().to_string();
        assert!(msg.contains("line 2"), "{msg}");
    }

    #[test]
    fn keep_always_overrides_everything_before_it() {
        let mut di = ignore("*\n");
        di.keep_always("sub/Dockerfile");
        assert!(!di.is_excluded("sub/Dockerfile"));
        assert!(di.is_excluded("sub/other"));
        assert!(di.may_hold_exceptions_under("sub"));
    }

    #[test]
    fn empty_excludes_nothing() {
        let di = DockerIgnore::empty();
        assert!(!di.is_excluded("a/b"));
        assert!(!di.has_exceptions());
        assert!(!di.may_hold_exceptions_under("a"));
    }
}
