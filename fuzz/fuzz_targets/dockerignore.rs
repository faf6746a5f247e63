//! Arbitrary `.dockerignore` files and paths, differentially: Kiln's matcher (patterns compiled to
//! Rust regexes, with Docker's exact/prefix/suffix shortcuts) against a slow reference written
//! here from Docker's own code (moby's `ignorefile.ReadAll` and `patternmatcher`), which walks the
//! pattern character by character with backtracking and never builds a regex.
//!
//! Input: the file's bytes, then paths, each after a NUL (a path may hold a newline, which Go's `.`
//! does not match). Paths are made canonical
//! (`/`-separated, relative, no empty, `.` or `..` components), as the walk hands them over.
//!
//! The reference decides every pattern made of literals, `\`-escaped non-word ASCII, `*`, `?`, `**`
//! and `[…]` classes of plain characters and ranges. It declines patterns whose Go-regex meaning
//! is the regex engine's rather than the glob's (an escaped letter such as `\d`, a `*`, `?` or `[`
//! inside a class, a POSIX class): for those only "no panic" is checked.
#![no_main]

use kiln_core::ignore::{DockerIgnore, IgnoreError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut parts = data.split(|&b| b == 0);
    let text = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let paths: Vec<String> = parts.filter_map(|raw| canonical_path(&String::from_utf8_lossy(raw))).collect();
    let reference = reference::read(&text);
    let kiln = match DockerIgnore::parse(&text) {
        Ok(kiln) => kiln,
        Err(IgnoreError::BadPattern { why, pattern, line }) => {
            // Go's regex engine compiles every pattern the reference can decide; Kiln must too.
            if why == "Docker's matcher cannot compile it" {
                if let Some(patterns) = &reference {
                    let on_line = patterns.iter().find(|p| p.line == line);
                    assert!(
                        on_line.is_none_or(|p| p.tokens.is_none()),
                        "line {line}: {pattern:?} is a pattern Docker compiles, refused by Kiln"
                    );
                }
            }
            return;
        }
        Err(IgnoreError::EmptyException { line, pattern }) => {
            assert!(reference.is_none(), "line {line}: {pattern:?} refused as a bare `!`, which Docker accepts");
            return;
        }
    };
    assert!(reference.is_some(), "Kiln accepts a bare `!` Docker refuses: {text:?}");
    let Some(patterns) = reference else {
        return;
    };
    for path in &paths {
        let excluded = kiln.is_excluded(path);
        if let Some(expected) = reference::is_excluded(&patterns, path) {
            assert_eq!(excluded, expected, "{path:?} against {:?}", text);
        }
    }
});

/// The path as the walk would name it, or `None` when nothing canonical is left of it.
fn canonical_path(raw: &str) -> Option<String> {
    let parts: Vec<&str> = raw.split('/').filter(|part| !matches!(*part, "" | "." | "..")).collect();
    (!parts.is_empty()).then(|| parts.join("/"))
}

mod reference {
    /// One pattern as Docker keeps it: `None` tokens when the reference declines to decide it.
    pub struct Pattern {
        pub line: usize,
        exception: bool,
        shortcut: Shortcut,
        pub tokens: Option<Vec<Token>>,
    }

    enum Shortcut {
        Exact(String),
        Prefix(String),
        Suffix(String),
        Regex,
    }

    #[derive(Debug, Clone)]
    pub enum Token {
        Literal(char),
        /// `*`: any run of characters but `/`.
        Star,
        /// `?`: one character but `/`.
        One,
        /// `**` followed by more pattern: nothing, or anything ending in `/` (Docker's `(.*/)?`).
        DirStar,
        /// `**` at the end: anything (Docker's `.*`; `.` does not match a newline in Go).
        Tail,
        Class {
            negated: bool,
            items: Vec<(char, char)>,
        },
    }

    /// moby's `ignorefile.ReadAll`, then `patternmatcher.New`: `None` when Docker refuses the file
    /// for a reason the reference reproduces (a bare `!`).
    pub fn read(text: &str) -> Option<Vec<Pattern>> {
        let mut patterns = Vec::new();
        for (index, raw) in text.split('\n').enumerate() {
            // bufio.ScanLines drops one trailing '\r'.
            let mut line = raw.strip_suffix('\r').unwrap_or(raw);
            if index == 0 {
                line = line.strip_prefix('\u{feff}').unwrap_or(line);
            }
            if line.starts_with('#') {
                continue;
            }
            let mut pattern = line.trim().to_string();
            if pattern.is_empty() {
                continue;
            }
            let invert = pattern.starts_with('!');
            if invert {
                pattern = pattern[1..].trim().to_string();
            }
            if !pattern.is_empty() {
                pattern = clean(&pattern);
                if pattern.len() > 1 && pattern.starts_with('/') {
                    pattern.remove(0);
                }
            }
            if invert {
                pattern.insert(0, '!');
            }
            // patternmatcher.New: trimmed and cleaned once more, then the `!` taken off.
            let mut p = pattern.trim().to_string();
            if p.is_empty() {
                continue;
            }
            p = clean(&p);
            let exception = p.starts_with('!');
            if exception {
                if p.len() == 1 {
                    return None;
                }
                p.remove(0);
            }
            // text/scanner skips a BOM before the first character, so Docker's regex and its
            // shortcut's byte offsets no longer agree: the reference declines such a pattern.
            let (shortcut, tokens) = match p.starts_with('\u{feff}') {
                true => (Shortcut::Regex, None),
                false => (shortcut(&p), tokens(&p)),
            };
            patterns.push(Pattern { line: index + 1, exception, shortcut, tokens });
        }
        Some(patterns)
    }

    /// Docker's matcher: the last pattern matching the path or one of its parent directories wins.
    pub fn is_excluded(patterns: &[Pattern], path: &str) -> Option<bool> {
        let mut candidates: Vec<&str> = path.match_indices('/').map(|(i, _)| &path[..i]).collect();
        candidates.push(path);
        let mut excluded = false;
        for pattern in patterns {
            let mut hit = false;
            for candidate in &candidates {
                hit |= matches(pattern, candidate)?;
            }
            if hit {
                excluded = !pattern.exception;
            }
        }
        Some(excluded)
    }

    fn matches(pattern: &Pattern, path: &str) -> Option<bool> {
        match &pattern.shortcut {
            Shortcut::Exact(text) => Some(path == text),
            Shortcut::Prefix(prefix) => Some(path.starts_with(prefix.as_str())),
            Shortcut::Suffix(suffix) => {
                Some(path.ends_with(suffix.as_str()) || (suffix.starts_with('/') && path == &suffix[1..]))
            }
            Shortcut::Regex => {
                let tokens = pattern.tokens.as_ref()?;
                let path: Vec<char> = path.chars().collect();
                Some(match_tokens(tokens, &path))
            }
        }
    }

    /// Plain backtracking over the tokens: slow, and obviously what the glob says.
    fn match_tokens(tokens: &[Token], path: &[char]) -> bool {
        let Some((first, rest)) = tokens.split_first() else {
            return path.is_empty();
        };
        match first {
            Token::Literal(c) => path.first() == Some(c) && match_tokens(rest, &path[1..]),
            Token::One => path.first().is_some_and(|&c| c != '/') && match_tokens(rest, &path[1..]),
            Token::Class { negated, items } => {
                path.first().is_some_and(|&c| {
                    let member = items.iter().any(|&(lo, hi)| lo <= c && c <= hi);
                    member != *negated
                }) && match_tokens(rest, &path[1..])
            }
            Token::Star => {
                (0..=path.len()).take_while(|&n| n == 0 || path[n - 1] != '/').any(|n| match_tokens(rest, &path[n..]))
            }
            // `(.*/)?`: Go's `.` stops at a newline.
            Token::DirStar => {
                match_tokens(rest, path)
                    || (1..=path.len())
                        .take_while(|&n| !path[..n - 1].contains(&'\n'))
                        .any(|n| path[n - 1] == '/' && match_tokens(rest, &path[n..]))
            }
            Token::Tail => {
                (0..=path.len()).take_while(|&n| n == 0 || path[n - 1] != '\n').any(|n| match_tokens(rest, &path[n..]))
            }
        }
    }

    /// Docker's choice among exact, prefix, suffix and regex matching, read off the pattern text
    /// as `Pattern.compile` does.
    fn shortcut(p: &str) -> Shortcut {
        let chars: Vec<char> = p.chars().collect();
        let mut kind = 0; // 0 exact, 1 prefix, 2 suffix, 3 regex
        let mut i = 0;
        while i < chars.len() {
            let at_start = i == 0;
            let c = chars[i];
            i += 1;
            match c {
                '*' if chars.get(i) == Some(&'*') => {
                    i += 1;
                    if chars.get(i) == Some(&'/') {
                        i += 1;
                    }
                    kind = if i == chars.len() && kind == 0 { 1 } else { 3 };
                    if at_start {
                        kind = 2;
                    }
                }
                '*' | '?' | '[' | ']' => kind = 3,
                '\\' => {
                    i += 1;
                    kind = 3;
                }
                _ => {}
            }
        }
        match kind {
            0 => Shortcut::Exact(p.to_string()),
            1 => Shortcut::Prefix(p[..p.len() - 2].to_string()),
            2 => Shortcut::Suffix(p[2..].to_string()),
            _ => Shortcut::Regex,
        }
    }

    /// The pattern as glob tokens, or `None` when its regex meaning is not the glob's.
    fn tokens(p: &str) -> Option<Vec<Token>> {
        let chars: Vec<char> = p.chars().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            i += 1;
            match c {
                '*' if chars.get(i) == Some(&'*') => {
                    i += 1;
                    if chars.get(i) == Some(&'/') {
                        i += 1;
                    }
                    out.push(if i == chars.len() { Token::Tail } else { Token::DirStar });
                }
                '*' => out.push(Token::Star),
                '?' => out.push(Token::One),
                // Docker leaves `^` unescaped: in its regex it is an anchor, not a character.
                '^' => return None,
                '\\' => out.push(Token::Literal(escaped(chars.get(i).copied())?)),
                '[' => {
                    let (token, next) = class(&chars, i)?;
                    out.push(token);
                    i = next;
                }
                c => out.push(Token::Literal(c)),
            }
            if c == '\\' {
                i += 1;
            }
        }
        Some(out)
    }

    /// `\` before an ASCII character that is not a letter or digit is that character in Go's
    /// regex; before anything else it is a class, an assertion or an error there, which the
    /// reference declines.
    fn escaped(c: Option<char>) -> Option<char> {
        c.filter(|c| c.is_ascii() && !c.is_ascii_alphanumeric())
    }

    /// A `[…]` class of plain characters, escaped punctuation and ranges; `None` for anything
    /// Docker's regex would read otherwise.
    fn class(chars: &[char], mut i: usize) -> Option<(Token, usize)> {
        let negated = chars.get(i) == Some(&'^');
        if negated {
            i += 1;
        }
        let mut items = Vec::new();
        let member = |i: &mut usize| -> Option<char> {
            let c = *chars.get(*i)?;
            *i += 1;
            match c {
                '\\' => {
                    let e = escaped(chars.get(*i).copied())?;
                    *i += 1;
                    Some(e)
                }
                '*' | '?' | '[' | ']' | '-' => None,
                c => Some(c),
            }
        };
        loop {
            if chars.get(i) == Some(&']') && !items.is_empty() {
                return Some((Token::Class { negated, items }, i + 1));
            }
            let lo = member(&mut i)?;
            let hi = if chars.get(i) == Some(&'-') && chars.get(i + 1) != Some(&']') {
                i += 1;
                member(&mut i)?
            } else {
                lo
            };
            if hi < lo {
                return None;
            }
            items.push((lo, hi));
        }
    }

    /// Go's `filepath.Clean` on Unix, written out from its definition (rules 1–4 of the doc).
    fn clean(path: &str) -> String {
        let rooted = path.starts_with('/');
        let mut out: Vec<&str> = Vec::new();
        for part in path.split('/') {
            match part {
                "" | "." => {}
                ".." if out.last().is_some_and(|last| *last != "..") => {
                    out.pop();
                }
                ".." if rooted => {}
                part => out.push(part),
            }
        }
        let joined = out.join("/");
        if rooted {
            format!("/{joined}")
        } else if joined.is_empty() {
            ".".to_string()
        } else {
            joined
        }
    }
}
