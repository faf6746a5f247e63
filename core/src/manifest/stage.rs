//! A built image's `stage`: a command that writes its context (a package manager's deploy), and
//! what the seal removes from what it wrote (DESIGN.md "Seal", ADR-0069).
//!
//! ```toml
//! [built.api]
//! context = "services/api"          # where the command runs; the Dockerfile is read from here
//! stage = { run = ["pnpm", "deploy", "--filter", "api", "{out}"], remove = ["node_modules/.modules.yaml"] }
//! ```
//!
//! The command is run by the CLI (`kiln up`, `kiln refs`), never by `core`; this module only reads
//! and checks the key. It is checked here, at load, because staging is the first thing a converge
//! does: a command that cannot be told where to write, or a pattern Docker's rules refuse, should
//! fail on its line, not after a minute of `pnpm deploy`.

use std::ffi::OsString;
use std::ops::Range;
use std::path::Path;

use toml::de::DeValue;
use toml::Spanned;

use super::error::{ManifestError, Problem};
use super::raw::{section, RawStage, STAGE_KEYS};
use super::resolve::Ctx;
use crate::ignore::DockerIgnore;
use crate::seal::SealSpec;

/// The word in `run` that stands for the fresh, empty directory the command writes to.
pub const OUT: &str = "{out}";

/// How a built image's context is staged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// The program and its arguments, run without a shell in the image's `context`; every
    /// [`OUT`] in them is the staging directory.
    pub run: Vec<String>,
    /// Where-and-when files the seal deletes: `.dockerignore` patterns relative to the staged
    /// tree (`node_modules/.modules.yaml`, `**/.bin`).
    pub remove: Vec<String>,
    /// The absolute path the staged tree has inside the image (`/app`): a text file naming the
    /// staging directory gets this path instead. `None`: such a file is refused, naming it.
    pub image_path: Option<String>,
}

impl Stage {
    /// The command's argv with [`OUT`] replaced by `out`.
    pub fn argv(&self, out: &Path) -> Vec<OsString> {
        self.run
            .iter()
            .map(|arg| {
                let mut parts = arg.split(OUT);
                let mut joined = OsString::from(parts.next().unwrap_or_default());
                for part in parts {
                    joined.push(out.as_os_str());
                    joined.push(part);
                }
                joined
            })
            .collect()
    }

    /// The command as the manifest writes it, for messages (`pnpm deploy --filter api {out}`).
    pub fn command_line(&self) -> String {
        self.run.join(" ")
    }

    /// What [`crate::seal::seal`] is told about a tree this command staged into `out`.
    pub fn seal_spec(&self, out: &Path) -> SealSpec {
        SealSpec {
            staging_path: out.to_path_buf(),
            delete: self.remove.clone(),
            in_image_path: self.image_path.clone(),
        }
    }
}

const RUN_SHAPE: &str = "an array of strings: the program and its arguments, run without a shell, e.g. run = \
                         [\"pnpm\", \"deploy\", \"--filter\", \"api\", \"{out}\"]";
const REMOVE_SHAPE: &str = "an array of .dockerignore patterns relative to the staged tree, e.g. remove = \
                            [\"node_modules/.modules.yaml\"]";
const IMAGE_PATH_SHAPE: &str = "a string: the absolute path the staged tree has inside the image, e.g. image_path = \
                                \"/app\"";

/// Checks the shape of `stage` in `[built.<image>]` before serde reads it, so a wrong type is
/// reported with the key's meaning and an example instead of serde's `expected a sequence`.
pub(super) fn check_shape(image: &str, value: &Spanned<DeValue<'_>>, problems: &mut Vec<(Range<usize>, Problem)>) {
    let Some(table) = value.get_ref().as_table() else {
        problems.push((value.span(), Problem::StageNotTable { image: image.to_string() }));
        return;
    };
    for (key, item) in table.iter() {
        let wrong = |want| (item.span(), Problem::StageType { image: image.to_string(), key: key_name(key), want });
        let strings = |v: &DeValue<'_>| v.as_array().is_some_and(|a| a.iter().all(|s| s.get_ref().is_str()));
        match key.get_ref().as_ref() {
            "run" if !strings(item.get_ref()) => problems.push(wrong(RUN_SHAPE)),
            "remove" if !strings(item.get_ref()) => problems.push(wrong(REMOVE_SHAPE)),
            "image_path" if !item.get_ref().is_str() => problems.push(wrong(IMAGE_PATH_SHAPE)),
            "run" | "remove" | "image_path" => {}
            other => problems.push((
                key.span(),
                Problem::UnknownKey {
                    key: other.to_string(),
                    section: format!("in stage of {}", section("built", image)),
                    expected: STAGE_KEYS,
                },
            )),
        }
    }
}

fn key_name(key: &Spanned<std::borrow::Cow<'_, str>>) -> &'static str {
    STAGE_KEYS.iter().copied().find(|k| *k == key.get_ref().as_ref()).unwrap_or("stage")
}

/// `stage` as the manifest gives it, checked: a command that names [`OUT`], patterns Docker's
/// rules read, an absolute in-image path.
pub(super) fn resolve_stage(ctx: &Ctx<'_>, image: &str, raw: Spanned<RawStage>) -> Result<Stage, ManifestError> {
    let span = raw.span();
    let raw = raw.into_inner();
    let no_run = || ctx.at(span.clone(), Problem::StageNoRun { image: image.to_string() });
    let run_raw = raw.run.ok_or_else(no_run)?;
    let run: Vec<String> = run_raw.get_ref().iter().map(|arg| arg.get_ref().clone()).collect();
    if run.first().is_none_or(|program| program.is_empty()) {
        return Err(no_run());
    }
    if !run.iter().any(|arg| arg.contains(OUT)) {
        return Err(ctx.at(run_raw.span(), Problem::StageNoOut { image: image.to_string() }));
    }

    let mut remove = Vec::new();
    for pattern in raw.remove.map(Spanned::into_inner).unwrap_or_default() {
        if let Some(why) = pattern_problem(pattern.get_ref()) {
            let problem = Problem::StagePattern { image: image.to_string(), pattern: pattern.get_ref().clone(), why };
            return Err(ctx.at(pattern.span(), problem));
        }
        remove.push(pattern.into_inner());
    }

    let image_path = match raw.image_path {
        Some(path) if !is_image_path(path.get_ref()) => {
            let problem = Problem::StageImagePath { image: image.to_string(), given: path.get_ref().clone() };
            return Err(ctx.at(path.span(), problem));
        }
        other => other.map(Spanned::into_inner),
    };
    Ok(Stage { run, remove, image_path })
}

/// Why one `remove` pattern cannot be used, if it cannot: the seal joins them into one
/// `.dockerignore`, where a newline would split one into two and `#` would make it a comment.
fn pattern_problem(pattern: &str) -> Option<String> {
    if pattern.trim().is_empty() {
        return Some("it is empty".to_string());
    }
    if pattern.contains(['\n', '\r']) {
        return Some("it holds a line break — give each pattern its own string".to_string());
    }
    if pattern.starts_with('#') {
        return Some("a leading # makes it a comment — escape it as \\#".to_string());
    }
    DockerIgnore::parse(pattern).err().map(|err| match err {
        crate::ignore::IgnoreError::EmptyException { .. } => "an exception with no pattern — write !path".to_string(),
        crate::ignore::IgnoreError::BadPattern { why, .. } => why.to_string(),
    })
}

/// An absolute path the seal can write into text files: no NUL, no empty or `.`/`..` parts that
/// would make two spellings of one place.
fn is_image_path(path: &str) -> bool {
    path.starts_with('/')
        && !path.contains('\0')
        && (path == "/" || path[1..].trim_end_matches('/').split('/').all(|p| !p.is_empty() && p != "." && p != ".."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_is_replaced_wherever_it_appears_in_an_argument() {
        let stage = Stage {
            run: vec!["deploy".into(), "--to={out}/app".into(), "{out}".into(), "plain".into()],
            remove: vec![],
            image_path: None,
        };
        let argv = stage.argv(Path::new("/tmp/s1"));
        assert_eq!(argv, ["deploy", "--to=/tmp/s1/app", "/tmp/s1", "plain"].map(OsString::from));
        assert_eq!(stage.command_line(), "deploy --to={out}/app {out} plain");
    }

    #[test]
    fn image_paths_are_absolute_and_plain() {
        for ok in ["/", "/app", "/srv/app/", "/a-b/c_d"] {
            assert!(is_image_path(ok), "{ok}");
        }
        for bad in ["", "app", "./app", "/a/../b", "/a//b", "/a/./b", "/a\0b"] {
            assert!(!is_image_path(bad), "{bad:?}");
        }
    }

    #[test]
    fn patterns_docker_would_misread_are_named() {
        assert_eq!(pattern_problem("node_modules/.modules.yaml"), None);
        assert_eq!(pattern_problem("**/.bin"), None);
        for bad in ["", " ", "a\nb", "#x", "!"] {
            assert!(pattern_problem(bad).is_some(), "{bad:?}");
        }
    }
}
