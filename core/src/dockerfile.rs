//! A Dockerfile's `FROM` images, read the way Docker's parser reads them, and the rewrite that puts
//! another image in a `FROM`'s place.
//!
//! This is how a built image that builds `FROM` another built image of its manifest gets that
//! base's content ref (`manifest::BuiltImage::dockerfile_as_built`): the manifest reads which
//! images each Dockerfile names, and the CLI replaces a base's name with the base's content ref in
//! the bytes it sends, so the child's address covers the base's.
//!
//! Docker's rules kept here (BuildKit's `frontend/dockerfile/parser`), because reading a line
//! differently from Docker would make Kiln wait for an image the build does not use, or rewrite
//! text the build does not read as a `FROM`:
//! - parser directives at the very top (`# escape=``, `# syntax=…`, `# check=…`); the escape
//!   character is `\` unless `escape` says `` ` ``;
//! - a line whose first non-blank character is `#` is a comment, also inside a continued
//!   instruction, where blank lines are dropped too;
//! - a line ending in the escape character (blanks after it allowed) continues on the next, joined
//!   without a space;
//! - the bodies of heredocs (`RUN <<EOF` … `EOF`) of `RUN`, `COPY` and `ADD` are not instructions;
//! - keywords and `AS` are case-insensitive; `FROM [--flag=…]… <image> [AS <stage>]`;
//! - a `FROM` naming a stage declared above it (case-insensitive) builds on that stage, not on an
//!   image.
//!
//! Left alone, never reported: an image with a variable (`FROM ${BASE}`, `FROM $BASE`), whose value
//! only the build knows; one holding the escape character; and `scratch`, which names no image.

use std::ops::Range;

/// A `FROM` that names an image: not a stage, not a variable, not `scratch`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FromImage {
    /// 1-based line of the `FROM` keyword.
    pub line: usize,
    /// The image as written (`base`, `shop-base`, `busybox:1.36`).
    pub image: String,
    /// Where `image` lies in the Dockerfile's text, in bytes: what [`rewrite`] replaces. A name
    /// split by a line continuation spans the continuation too.
    pub span: Range<usize>,
}

/// Every `FROM` of `text` that names an image, in order.
pub fn from_images(text: &str) -> Vec<FromImage> {
    let lines = physical_lines(text);
    let (escape, mut i) = directives(&lines);
    let mut stages: Vec<String> = Vec::new();
    let mut found = Vec::new();
    while i < lines.len() {
        if is_blank_or_comment(lines[i].1) {
            i += 1;
            continue;
        }
        let line = i + 1;
        let logical = Logical::gather(&lines, &mut i, escape);
        let words = logical.words();
        let Some(keyword) = words.first().map(|w| &logical.text[w.clone()]) else { continue };
        if keyword.eq_ignore_ascii_case("from") {
            let mut rest = words[1..].iter().skip_while(|w| logical.text[(*w).clone()].starts_with("--"));
            let Some(image_word) = rest.next() else { continue };
            let image = &logical.text[image_word.clone()];
            let stage = match (rest.next(), rest.next()) {
                (Some(as_word), Some(name)) if logical.text[as_word.clone()].eq_ignore_ascii_case("as") => {
                    Some(logical.text[name.clone()].to_ascii_lowercase())
                }
                _ => None,
            };
            let names_stage = stages.iter().any(|s| s.eq_ignore_ascii_case(image));
            let variable = image.contains('$') || image.contains(escape);
            if !names_stage && !variable && !image.eq_ignore_ascii_case("scratch") {
                found.push(FromImage { line, image: image.to_string(), span: logical.span(image_word) });
            }
            // Declared after its own FROM is read: `FROM base AS base` names the image `base`.
            stages.extend(stage);
        } else if ["run", "copy", "add"].iter().any(|k| keyword.eq_ignore_ascii_case(k)) {
            skip_heredocs(&lines, &mut i, &logical.text, &words[1..]);
        }
    }
    found
}

/// Whether any instruction of `text` is a `RUN`: a build that runs a command runs the image's own
/// binaries, so a platform the build host does not run needs emulation; one that only copies
/// (`FROM scratch` + `COPY`) builds for any platform. Every stage counts, the target's or not:
/// which stages BuildKit skips is the build's business, and guessing "none" would start a build
/// that fails on an `exec format error` halfway.
pub fn runs_commands(text: &str) -> bool {
    let lines = physical_lines(text);
    let (escape, mut i) = directives(&lines);
    while i < lines.len() {
        if is_blank_or_comment(lines[i].1) {
            i += 1;
            continue;
        }
        let logical = Logical::gather(&lines, &mut i, escape);
        let words = logical.words();
        let Some(keyword) = words.first().map(|w| &logical.text[w.clone()]) else { continue };
        if keyword.eq_ignore_ascii_case("run") {
            return true;
        }
        if ["copy", "add"].iter().any(|k| keyword.eq_ignore_ascii_case(k)) {
            skip_heredocs(&lines, &mut i, &logical.text, &words[1..]);
        }
    }
    false
}

/// `text` with each span replaced by its text. Spans must not overlap; their order does not matter.
pub fn rewrite(text: &str, replacements: &[(Range<usize>, String)]) -> String {
    let mut sorted: Vec<&(Range<usize>, String)> = replacements.iter().collect();
    sorted.sort_by_key(|(span, _)| span.start);
    let mut out = String::with_capacity(text.len() + 64 * sorted.len());
    let mut at = 0;
    for (span, with) in sorted {
        out.push_str(&text[at..span.start]);
        out.push_str(with);
        at = span.end;
    }
    out.push_str(&text[at..]);
    out
}

/// Each line's start offset and its text without the line ending (`\n` or `\r\n`).
fn physical_lines(text: &str) -> Vec<(usize, &str)> {
    let mut start = 0;
    text.split_inclusive('\n')
        .map(|raw| {
            let at = start;
            start += raw.len();
            let line = raw.strip_suffix('\n').unwrap_or(raw);
            (at, line.strip_suffix('\r').unwrap_or(line))
        })
        .collect()
}

/// The escape character the parser directives at the top set, and the index of the first line
/// after them. A directive is `# key=value` with a key BuildKit knows; anything else ends them.
fn directives(lines: &[(usize, &str)]) -> (char, usize) {
    let mut escape = '\\';
    let mut i = 0;
    while let Some(&(_, line)) = lines.get(i) {
        let Some(body) = line.trim_start().strip_prefix('#') else { break };
        let Some((key, value)) = body.split_once('=') else { break };
        let key = key.trim().to_ascii_lowercase();
        match key.as_str() {
            "escape" => match value.trim() {
                "`" => escape = '`',
                "\\" => escape = '\\',
                // Docker refuses the file; nothing it would build can be misread.
                _ => break,
            },
            "syntax" | "check" => {}
            _ => break,
        }
        i += 1;
    }
    (escape, i)
}

fn is_blank_or_comment(line: &str) -> bool {
    let trimmed = line.trim_start();
    trimmed.is_empty() || trimmed.starts_with('#')
}

/// One instruction with its continuation lines joined, each byte remembering where it came from.
struct Logical {
    text: String,
    /// `origin[k]` is the offset in the Dockerfile of `text`'s byte `k`.
    origin: Vec<usize>,
}

impl Logical {
    /// Joins the instruction starting at line `*i`, leaving `*i` on the line after it.
    fn gather(lines: &[(usize, &str)], i: &mut usize, escape: char) -> Logical {
        let mut logical = Logical { text: String::new(), origin: Vec::new() };
        loop {
            let (start, line) = lines[*i];
            *i += 1;
            let (body, continues) = match strip_continuation(line, escape) {
                Some(head) => (head, true),
                None => (line, false),
            };
            logical.text.push_str(body);
            logical.origin.extend(start..start + body.len());
            if !continues {
                break;
            }
            // Comment and blank lines inside a continued instruction are dropped, as Docker does.
            while *i < lines.len() && is_blank_or_comment(lines[*i].1) {
                *i += 1;
            }
            if *i == lines.len() {
                break;
            }
        }
        logical
    }

    /// Its whitespace-separated words, as byte ranges of `text`.
    fn words(&self) -> Vec<Range<usize>> {
        let mut words = Vec::new();
        let mut start = None;
        for (k, c) in self.text.char_indices() {
            match (c.is_whitespace(), start) {
                (true, Some(s)) => {
                    words.push(s..k);
                    start = None;
                }
                (false, None) => start = Some(k),
                _ => {}
            }
        }
        if let Some(s) = start {
            words.push(s..self.text.len());
        }
        words
    }

    /// Where a word of `text` lies in the Dockerfile.
    fn span(&self, word: &Range<usize>) -> Range<usize> {
        self.origin[word.start]..self.origin[word.end - 1] + 1
    }
}

/// `line` without its continuation (the escape character last, blanks after it allowed), or
/// `None` when the instruction ends on it.
fn strip_continuation(line: &str, escape: char) -> Option<&str> {
    line.trim_end_matches([' ', '\t']).strip_suffix(escape)
}

/// Moves `*i` past the bodies of the heredocs an instruction opens (`<<EOF`, `<<-EOF`, `<<"EOF"`,
/// `3<<EOF`), each ending at a line that is its word (after leading tabs, for `<<-`).
fn skip_heredocs(lines: &[(usize, &str)], i: &mut usize, text: &str, words: &[Range<usize>]) {
    for word in words {
        let Some((name, strip_tabs)) = heredoc(&text[word.clone()]) else { continue };
        while let Some(&(_, line)) = lines.get(*i) {
            *i += 1;
            let line = if strip_tabs { line.trim_start_matches('\t') } else { line };
            if line == name {
                break;
            }
        }
    }
}

/// The terminator a heredoc word names, and whether its body's lines drop leading tabs.
fn heredoc(word: &str) -> Option<(&str, bool)> {
    let rest = word.trim_start_matches(|c: char| c.is_ascii_digit()).strip_prefix("<<")?;
    let (rest, strip_tabs) = match rest.strip_prefix('-') {
        Some(rest) => (rest, true),
        None => (rest, false),
    };
    let name = ['"', '\''].iter().find_map(|q| rest.strip_prefix(*q).and_then(|r| r.strip_suffix(*q))).unwrap_or(rest);
    (!name.is_empty() && !name.contains('<')).then_some((name, strip_tabs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn images(text: &str) -> Vec<(usize, String)> {
        from_images(text)
            .into_iter()
            .map(|f| {
                assert_eq!(&text[f.span.clone()], f.image, "the span is where the image is written");
                (f.line, f.image)
            })
            .collect()
    }

    fn one(line: usize, image: &str) -> (usize, String) {
        (line, image.to_string())
    }

    #[test]
    fn run_anywhere_needs_the_platform_and_copy_alone_does_not() {
        assert!(!runs_commands("FROM scratch\nCOPY . /\n# RUN nothing\n"));
        assert!(runs_commands("FROM base AS b\nrun echo hi\nFROM scratch\nCOPY --from=b / /\n"));
        // A heredoc's body is not an instruction, even a line reading RUN.
        assert!(!runs_commands("FROM scratch\nCOPY <<EOF /x\nRUN not an instruction\nEOF\n"));
        // A continued instruction whose next line starts with RUN is still the COPY.
        assert!(!runs_commands("FROM scratch\nCOPY a \\\n  RUN /\n"));
    }

    #[test]
    fn a_from_names_its_image_after_flags_and_before_its_stage() {
        let text = "FROM base\nfrom --platform=$BUILDPLATFORM shop-base:1 As Build\nRUN make\n";
        assert_eq!(images(text), [one(1, "base"), one(2, "shop-base:1")]);
        let text = "FROM --platform=linux/amd64 127.0.0.1:5000/team/shop-base\n";
        assert_eq!(images(text), [one(1, "127.0.0.1:5000/team/shop-base")]);
    }

    #[test]
    fn a_stage_declared_above_shadows_an_image_of_its_name_case_insensitively() {
        let text = "FROM busybox AS Base\nFROM base\nFROM BASE AS other\nFROM other\n";
        assert_eq!(images(text), [one(1, "busybox")]);
        // A stage's own FROM, and any FROM above the stage, name the image.
        let text = "FROM base AS base\nFROM tools\nFROM tools AS tools\n";
        assert_eq!(images(text), [one(1, "base"), one(2, "tools"), one(3, "tools")]);
    }

    #[test]
    fn comments_continuations_and_crlf_are_read_as_docker_reads_them() {
        let text = "# FROM commented\n  # FROM indented comment\nFROM \\\n  # a comment inside\n\n  base \\\n  AS b\r\nRUN x\r\n";
        let found = from_images(text);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].line, 3, "the line of the FROM keyword");
        assert_eq!(found[0].image, "base");
        assert_eq!(&text[found[0].span.clone()], "base");
        // Trailing blanks after the escape still continue; a split name is joined without a space.
        let text = "FROM ba\\  \nse\nRUN echo FROM x\n";
        let found = from_images(text);
        assert_eq!(found[0].image, "base");
        assert_eq!(
            rewrite(text, &[(found[0].span.clone(), "shop-base:abc".into())]),
            "FROM shop-base:abc\nRUN echo FROM x\n"
        );
        // A continued RUN whose next line starts with FROM is still the RUN.
        assert!(images("RUN echo \\\nFROM base\n").is_empty());
    }

    #[test]
    fn the_escape_directive_changes_the_continuation_character() {
        let text = "# escape=`\nFROM `\n  base\nRUN dir c:\\\nFROM other\n";
        assert_eq!(images(text), [one(2, "base"), one(5, "other")]);
        // Only at the top: after an instruction it is a comment.
        let text = "FROM a\n# escape=`\nRUN x `\nFROM b\n";
        assert_eq!(images(text), [one(1, "a"), one(4, "b")]);
        // `# syntax=` keeps the directives open.
        assert_eq!(images("# syntax=docker/dockerfile:1\n# escape=`\nRUN a `\nFROM b\nFROM c\n"), [one(5, "c")]);
    }

    #[test]
    fn heredoc_bodies_are_not_instructions() {
        let text = "FROM a\nRUN <<EOF\nFROM inside\nEOF\nCOPY <<-\"END\" /x\n\tFROM tabbed\n\tEND\nFROM b\n";
        assert_eq!(images(text), [one(1, "a"), one(8, "b")]);
        // `$((1<<2))` is shell arithmetic, not a heredoc.
        assert_eq!(images("FROM a\nRUN echo $((1<<2))\nFROM b\n"), [one(1, "a"), one(3, "b")]);
    }

    #[test]
    fn variables_the_escape_character_and_scratch_are_left_alone() {
        let text = "ARG BASE=base\nFROM ${BASE}\nFROM $BASE AS x\nFROM scratch\nFROM SCRATCH\nFROM my\\image\n";
        assert!(images(text).is_empty(), "{:?}", images(text));
        assert!(images("FROM --platform=linux/amd64\n").is_empty(), "a FROM with no image names none");
    }

    #[test]
    fn a_rewrite_replaces_exactly_the_spans_and_keeps_every_other_byte() {
        let text =
            "# base image\nFROM base AS build\nRUN make\nFROM --platform=linux/amd64 tools\nCOPY --from=build /a /a\n";
        let found = from_images(text);
        let replacements: Vec<_> =
            found.iter().rev().map(|f| (f.span.clone(), format!("{}:0123456789ab-amd64", f.image))).collect();
        assert_eq!(
            rewrite(text, &replacements),
            "# base image\nFROM base:0123456789ab-amd64 AS build\nRUN make\n\
             FROM --platform=linux/amd64 tools:0123456789ab-amd64\nCOPY --from=build /a /a\n"
        );
        assert_eq!(rewrite(text, &[]), text);
    }
}
