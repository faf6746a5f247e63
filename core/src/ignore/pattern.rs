//! One `.dockerignore` pattern as Docker reads it: Go's `filepath.Clean`, Go's `filepath.Match`
//! syntax check (Docker refuses the file when it fails), and Docker's conversion of the pattern to
//! a matcher — an exact, prefix or suffix test, or an anchored regex written in Go's syntax and
//! translated where Rust's regex syntax would read it differently.

use regex::Regex;

/// Docker's four ways of testing a pattern. The first three are shortcuts Docker takes before
/// building a regex; they are kept as Docker has them because `Suffix` is not equivalent to the
/// regex it replaces (`**foo` matches `barfoo`), and agreeing with Docker is the point.
#[derive(Debug, Clone)]
pub(super) enum Matcher {
    Exact(String),
    /// The pattern minus its trailing `**`.
    Prefix(String),
    /// The pattern minus its leading `**`.
    Suffix(String),
    Regex(Regex),
}

impl Matcher {
    pub(super) fn matches(&self, path: &str) -> bool {
        match self {
            Matcher::Exact(p) => path == p,
            Matcher::Prefix(p) => path.starts_with(p.as_str()),
            Matcher::Suffix(s) => path.ends_with(s.as_str()) || s.strip_prefix('/') == Some(path),
            Matcher::Regex(re) => re.is_match(path),
        }
    }
}

/// Lexical path cleaning as Go's `filepath.Clean` does it on Unix: the pattern `./a/../b/` must
/// mean `b`, exactly as it does for Docker.
pub(crate) fn go_clean(path: &str) -> String {
    if path.is_empty() {
        return ".".to_string();
    }
    let rooted = path.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => match parts.last() {
                Some(&last) if last != ".." => {
                    parts.pop();
                }
                // `..` above the root of an absolute path is the root itself.
                _ if rooted => {}
                _ => parts.push(".."),
            },
            _ => parts.push(part),
        }
    }
    let joined = parts.join("/");
    match (rooted, joined.is_empty()) {
        (true, _) => format!("/{joined}"),
        (false, true) => ".".to_string(),
        (false, false) => joined,
    }
}

/// Refuses what Go's `filepath.Match` refuses, since Docker rejects the whole file when it does:
/// an unclosed or empty `[` class, a class range missing an end, a trailing `\`.
pub(super) fn check_glob_syntax(pattern: &str) -> Result<(), &'static str> {
    let mut rest = pattern.as_bytes();
    while !rest.is_empty() {
        // Stars separate the chunks Go checks; a `*` inside a `[…]` does not.
        while let [b'*', tail @ ..] = rest {
            rest = tail;
        }
        let mut in_class = false;
        let mut end = 0;
        while end < rest.len() {
            match rest[end] {
                b'\\' if end + 1 < rest.len() => end += 1,
                b'[' => in_class = true,
                b']' => in_class = false,
                b'*' if !in_class => break,
                _ => {}
            }
            end += 1;
        }
        check_chunk(&rest[..end])?;
        rest = &rest[end..];
    }
    Ok(())
}

fn check_chunk(mut chunk: &[u8]) -> Result<(), &'static str> {
    while let Some(&c) = chunk.first() {
        match c {
            b'[' => {
                chunk = &chunk[1..];
                if chunk.first() == Some(&b'^') {
                    chunk = &chunk[1..];
                }
                let mut ranges = 0;
                loop {
                    if chunk.first() == Some(&b']') && ranges > 0 {
                        chunk = &chunk[1..];
                        break;
                    }
                    chunk = class_char(chunk)?;
                    if chunk.first() == Some(&b'-') {
                        chunk = class_char(&chunk[1..])?;
                    }
                    ranges += 1;
                }
            }
            b'\\' => {
                if chunk.len() < 2 {
                    return Err("a trailing `\\` escapes nothing");
                }
                chunk = &chunk[2..];
            }
            _ => chunk = &chunk[1..],
        }
    }
    Ok(())
}

/// One character of a `[…]` class (possibly `\`-escaped); something must follow it, as the class
/// still needs its `]`.
fn class_char(chunk: &[u8]) -> Result<&[u8], &'static str> {
    let chunk = match chunk.first() {
        None => return Err("unclosed `[` class"),
        Some(b'-') | Some(b']') => return Err("a `[` class is empty or has a range with no start"),
        Some(b'\\') => &chunk[1..],
        Some(_) => chunk,
    };
    let width = match chunk.first() {
        None => return Err("unclosed `[` class"),
        Some(&b) if b < 0x80 => 1,
        Some(&b) if b >= 0xF0 => 4,
        Some(&b) if b >= 0xE0 => 3,
        Some(_) => 2,
    };
    match chunk.get(width..) {
        Some(rest) if !rest.is_empty() => Ok(rest),
        _ => Err("unclosed `[` class"),
    }
}

/// Builds Docker's matcher for a cleaned pattern: the same regex text Docker builds for Go's
/// engine, translated where Rust's regex syntax reads a class differently.
pub(super) fn compile(pattern: &str) -> Result<Matcher, &'static str> {
    #[derive(PartialEq)]
    enum Kind {
        Exact,
        Prefix,
        Suffix,
        Regex,
    }
    let mut kind = Kind::Exact;
    let mut re = String::from("^");
    let chars: Vec<char> = pattern.chars().collect();
    let mut i = 0;
    let mut first = true;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        match c {
            '*' if chars.get(i) == Some(&'*') => {
                i += 1;
                if chars.get(i) == Some(&'/') {
                    i += 1;
                }
                if i == chars.len() {
                    if kind == Kind::Exact {
                        kind = Kind::Prefix;
                    } else {
                        re.push_str(".*");
                        kind = Kind::Regex;
                    }
                } else {
                    re.push_str("(.*/)?");
                    kind = Kind::Regex;
                }
                if first {
                    kind = Kind::Suffix;
                }
            }
            '*' => {
                re.push_str("[^/]*");
                kind = Kind::Regex;
            }
            '?' => {
                re.push_str("[^/]");
                kind = Kind::Regex;
            }
            '.' | '+' | '(' | ')' | '|' | '{' | '}' | '$' => {
                re.push('\\');
                re.push(c);
            }
            '\\' => match chars.get(i) {
                Some(&next) => {
                    i += 1;
                    re.push('\\');
                    re.push(next);
                    kind = Kind::Regex;
                }
                // Unreachable after the syntax check, which refuses a trailing `\`; kept as
                // Docker's regex builder has it (a literal backslash).
                None => re.push_str("\\\\"),
            },
            '[' | ']' => {
                re.push(c);
                kind = Kind::Regex;
            }
            _ => re.push(c),
        }
        first = false;
    }
    Ok(match kind {
        Kind::Exact => Matcher::Exact(pattern.to_string()),
        Kind::Prefix => Matcher::Prefix(pattern[..pattern.len() - 2].to_string()),
        Kind::Suffix => Matcher::Suffix(pattern[2..].to_string()),
        Kind::Regex => {
            re.push('$');
            let re = Regex::new(&go_regex_to_rust(&re)).map_err(|_| "Docker's matcher cannot compile it")?;
            Matcher::Regex(re)
        }
    })
}

/// Go's regex syntax reads `[`, `&&`, `~~` inside a class literally, where Rust's reads nested
/// classes and set operations; escaping them keeps a pattern like `[[]` meaning what it means to
/// Docker. POSIX classes (`[:alpha:]`) mean the same in both and pass through.
fn go_regex_to_rust(go: &str) -> String {
    let chars: Vec<char> = go.chars().collect();
    let mut out = String::with_capacity(go.len() + 8);
    let mut i = 0;
    let mut in_class = false;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' && i + 1 < chars.len() {
            let next = chars[i + 1];
            if next.is_ascii() && !next.is_ascii_alphanumeric() {
                // Go reads `\` before any ASCII non-word character as that character. Rust reads
                // `\<` and `\>` as word boundaries and refuses some other escapes: spell the
                // character Rust's way instead (escaped only where Rust needs it).
                out.push_str(&regex::escape(next.encode_utf8(&mut [0; 4])));
            } else {
                out.push(c);
                out.push(next);
            }
            i += 2;
            continue;
        }
        if !in_class {
            out.push(c);
            i += 1;
            if c == '[' {
                in_class = true;
                // A `]` right after `[` or `[^` is a member in both syntaxes, not the end.
                if chars.get(i) == Some(&'^') {
                    out.push('^');
                    i += 1;
                }
                if chars.get(i) == Some(&']') {
                    out.push(']');
                    i += 1;
                }
            }
            continue;
        }
        match c {
            ']' => {
                in_class = false;
                out.push(c);
            }
            '[' if chars.get(i + 1) == Some(&':') => {
                let close = (i + 2..chars.len().saturating_sub(1)).find(|&j| chars[j] == ':' && chars[j + 1] == ']');
                match close {
                    Some(j) => {
                        out.extend(&chars[i..j + 2]);
                        i = j + 2;
                        continue;
                    }
                    None => out.push_str("\\["),
                }
            }
            '[' | '&' | '~' => {
                out.push('\\');
                out.push(c);
            }
            _ => out.push(c),
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ignore::DockerIgnore;

    #[test]
    fn go_clean_matches_go() {
        for (input, want) in [
            ("", "."),
            (".", "."),
            ("./", "."),
            ("a/..", "."),
            ("/..", "/"),
            ("/../a", "/a"),
            ("../a", "../a"),
            ("a/../../b", "../b"),
            ("//a//b//", "/a/b"),
            ("a/./b/.", "a/b"),
            ("/", "/"),
        ] {
            assert_eq!(go_clean(input), want, "clean({input:?})");
        }
    }

    #[test]
    fn an_escaped_punctuation_character_is_that_character_as_in_go() {
        // Found by the `dockerignore` fuzz target: Rust's regex reads `\>` as a word boundary
        // and refused it inside a class, where Go's reads the character itself.
        let di = DockerIgnore::parse("a\\>b\n[x\\<]y\n\\ c*\n").unwrap();
        assert!(di.is_excluded("a>b"));
        assert!(di.is_excluded("<y"));
        assert!(di.is_excluded("xy"));
        assert!(di.is_excluded(" cat"));
        assert!(!di.is_excluded("ab"));
    }

    #[test]
    fn go_refuses_these_globs_and_so_does_docker() {
        for bad in ["[", "[]", "[a", "a[-z]", "[a-]", "[^]", "x\\", "*[", "!/"] {
            assert!(DockerIgnore::parse(bad).is_err(), "{bad:?} should be refused");
        }
        for good in ["[a]", "[\\]]", "a*[*]", "[a-z]*", "**/x", "\\[", "!a"] {
            assert!(DockerIgnore::parse(good).is_ok(), "{good:?} should parse");
        }
    }
}
