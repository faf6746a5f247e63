//! Whether a Dockerfile's `COPY`/`ADD` from the build context could pick up a given top-level
//! name: the question that decides if BuildKit may build a context it would see with extra files
//! (see `BuildBody::buildkit_sees_the_same`).
//!
//! The answer errs on "could": anything this reader does not fully understand — a parser
//! directive, a heredoc, a variable in a source, a glob or the context root as a source, a `RUN`
//! mount of the context — counts as reaching every name, and the build then goes to the classic
//! builder, which is always correct and only slower.

/// True only when no instruction can read any of `names` (top-level entries of the context) from
/// the build context.
pub(super) fn never_copies(dockerfile: &str, names: &[&str]) -> bool {
    if names.is_empty() {
        return true;
    }
    let Some(lines) = logical_lines(dockerfile) else {
        return false;
    };
    lines.iter().all(|line| line_is_safe(line, names))
}

/// The Dockerfile's instructions, one per entry, continuation lines joined; `None` when it uses a
/// parser directive (which can change the escape character) or a heredoc.
fn logical_lines(dockerfile: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut current = String::new();
    for raw in dockerfile.lines() {
        let trimmed = raw.trim();
        if current.is_empty() && trimmed.starts_with('#') {
            // A directive (`# escape=`, `# syntax=`) or a comment; directives could change parsing.
            let body = trimmed.trim_start_matches('#').trim().to_lowercase();
            if body.starts_with("escape") || body.starts_with("syntax") {
                return None;
            }
            continue;
        }
        if raw.contains("<<") {
            return None;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                if !current.trim().is_empty() {
                    out.push(std::mem::take(&mut current));
                }
                current.clear();
            }
        }
    }
    if !current.trim().is_empty() {
        out.push(current);
    }
    Some(out)
}

fn line_is_safe(line: &str, names: &[&str]) -> bool {
    let mut words = line.split_whitespace();
    let Some(instruction) = words.next().map(str::to_uppercase) else {
        return true;
    };
    match instruction.as_str() {
        // A bind or cache mount can expose the context to a command.
        "RUN" => !line.contains("--mount"),
        "COPY" | "ADD" => copy_is_safe(line.split_once(char::is_whitespace).map_or("", |(_, rest)| rest), names),
        // Runs in a later build from this image, against that build's context.
        "ONBUILD" => true,
        _ => true,
    }
}

fn copy_is_safe(args: &str, names: &[&str]) -> bool {
    let mut rest = args.trim();
    while let Some(flag_end) = rest.starts_with("--").then(|| rest.find(char::is_whitespace)).flatten() {
        // A copy from another stage or image does not read the context at all.
        if rest[..flag_end].starts_with("--from") {
            return true;
        }
        rest = rest[flag_end..].trim_start();
    }
    let sources: Vec<String> = if rest.starts_with('[') {
        match serde_json::from_str::<Vec<String>>(rest) {
            Ok(mut all) if all.len() >= 2 => {
                all.pop();
                all
            }
            _ => return false,
        }
    } else {
        let mut all: Vec<String> = rest.split_whitespace().map(str::to_string).collect();
        if all.len() < 2 {
            return false;
        }
        all.pop();
        all
    };
    sources.iter().all(|source| source_is_safe(source, names))
}

fn source_is_safe(source: &str, names: &[&str]) -> bool {
    if source.contains("://") {
        // A remote `ADD`: not the context.
        return true;
    }
    if source.contains('$') {
        return false;
    }
    let mut path = source;
    loop {
        let before = path;
        path = path.trim_start_matches('/');
        path = path.strip_prefix("./").unwrap_or(path);
        if path == before {
            break;
        }
    }
    let first = path.split('/').next().unwrap_or("");
    if first.is_empty() || first == "." || first == ".." || first.contains(['*', '?', '[', '\\']) {
        return false;
    }
    !names.contains(&first)
}

#[cfg(test)]
mod tests {
    use super::never_copies;

    const EXTRAS: &[&str] = &[".kiln-dockerfile", ".dockerignore"];

    #[test]
    fn named_sources_below_the_root_or_beside_the_extras_are_safe() {
        for dockerfile in [
            "FROM scratch\nCOPY a.txt /srv/\n",
            "FROM base\nCOPY --chown=1:1 src/ lib/*.py /app/\nRUN make\n",
            "FROM base AS b\nRUN x\nFROM scratch\nCOPY --from=b / /\n",
            "FROM scratch\nCOPY [\"a b.txt\", \"c\", \"/dst/\"]\n",
            "FROM scratch\nADD https://example.com/x.tgz /x\n",
            "# a comment\nFROM scratch\nCOPY app \\\n  /app\n",
        ] {
            assert!(never_copies(dockerfile, EXTRAS), "{dockerfile:?}");
        }
    }

    #[test]
    fn the_root_globs_variables_mounts_directives_and_heredocs_could_reach_them() {
        for dockerfile in [
            "FROM scratch\nCOPY . /ctx/\n",
            "FROM scratch\nCOPY ./ /ctx/\n",
            "FROM scratch\ncopy * /ctx/\n",
            "FROM scratch\nCOPY .d* /ctx/\n",
            "FROM scratch\nCOPY .dockerignore /x\n",
            "FROM scratch\nADD ./.kiln-dockerfile /x\n",
            "FROM scratch\nCOPY $SRC /x\n",
            "FROM base\nRUN --mount=type=bind,target=/c ls /c\n",
            "# escape=`\nFROM scratch\nCOPY a /b\n",
            "FROM scratch\nCOPY <<EOF /x\nhi\nEOF\n",
            "FROM scratch\nCOPY lonely\n",
            "FROM scratch\nCOPY [\"broken\n",
        ] {
            assert!(!never_copies(dockerfile, EXTRAS), "{dockerfile:?}");
        }
    }

    #[test]
    fn with_nothing_extra_any_dockerfile_is_safe() {
        assert!(never_copies("FROM scratch\nCOPY . /\n", &[]));
    }
}
