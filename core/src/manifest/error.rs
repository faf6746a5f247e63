//! Manifest errors: every one names the file, the line when there is one, and the fix.

use std::fmt;
use std::path::PathBuf;

use super::root::RootOrigin;
use crate::refs::{PlatformError, RefError};

/// A manifest that cannot be used. Displays as `<file>:<line>: <problem>` (or `<file>: <problem>`
/// when the problem is the file as a whole); the underlying error, if any, is the `source`.
#[derive(Debug)]
pub struct ManifestError {
    pub path: PathBuf,
    /// 1-based line of the offending key or table, when the problem sits on one.
    pub line: Option<usize>,
    /// Boxed: the error travels up every `?` of the resolver and should stay small.
    pub problem: Box<Problem>,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{line}: {}", self.path.display(), self.problem),
            None => write!(f, "{}: {}", self.path.display(), self.problem),
        }
    }
}

impl std::error::Error for ManifestError {
    // The problem's text is already in this error's message; only its cause is a source.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.problem)
    }
}

/// What is wrong, and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error(
        "not found — create it (examples/hello/kiln.toml shows the format) or run kiln in the folder that holds it"
    )]
    NotFound,
    #[error("cannot be read")]
    Unreadable {
        #[source]
        err: std::io::Error,
    },
    /// TOML syntax or a value of the wrong type; `detail` is the TOML parser's own description.
    #[error("{detail}")]
    Toml { detail: String },
    #[error("unknown key {key:?} {section} — expected one of {}", expected.join(", "))]
    UnknownKey { key: String, section: String, expected: &'static [&'static str] },
    #[error("no instance — add instance = \"<name>\" at the top (lowercase letters, digits and '-')")]
    MissingInstance,
    #[error(
        "instance {name:?} is invalid: use lowercase letters, digits and '-', start with a letter, end with a \
         letter or digit, at most 63 characters"
    )]
    BadInstance { name: String },
    #[error("no [target] — add one, e.g. [target] kind = \"registry\" with registry = \"host:port\"")]
    NoTarget,
    #[error("[target] has no kind — add kind = \"registry\" (or \"kind\", \"nodes\", \"local\")")]
    MissingTargetKind,
    #[error("unknown target kind {kind:?} — expected one of registry, kind, nodes, local")]
    UnknownTargetKind { kind: String },
    #[error("target kind \"registry\" needs registry = \"host:port[/prefix]\", e.g. registry = \"127.0.0.1:5000\"")]
    MissingRegistry,
    #[error("target kind \"nodes\" needs cluster = \"<cluster name>\"")]
    MissingCluster,
    #[error("key {key:?} does not apply to target kind {kind:?} — remove it")]
    KeyNotForKind { key: &'static str, kind: &'static str },
    #[error("{key} {value:?} is invalid: {why}")]
    BadRegistry { key: &'static str, value: String, why: String },
    #[error("{what} {value:?} is invalid: {why}")]
    BadName { what: &'static str, value: String, why: &'static str },
    #[error(
        "platforms is empty — list at least one, e.g. platforms = [\"linux/amd64\"], or remove the key to build \
         for this host"
    )]
    EmptyPlatforms,
    #[error(
        "platforms = {name:?}: a name says where the set comes from, and only \"cluster\" is known — list the \
         platforms (platforms = [\"linux/amd64\", \"linux/arm64\"]), or say platforms = \"cluster\""
    )]
    PlatformsNamed { name: String },
    #[error(
        "platforms = \"cluster\" takes the set from the target's cluster, and a {target} target has none — list \
         the platforms (platforms = [\"linux/amd64\"]), or deliver to a kind or nodes target"
    )]
    ClusterWithoutCluster { target: &'static str },
    #[error("platforms has an invalid entry")]
    BadPlatform {
        #[source]
        err: PlatformError,
    },
    #[error("no images — add a [built.<name>], [brought.<name>] or [pinned.<name>] table")]
    NoImages,
    #[error(
        "image name {name:?} in {section} is invalid: use lowercase letters, digits and '-', starting and ending \
         with a letter or digit, at most 63 characters"
    )]
    BadImageName { name: String, section: String },
    #[error("two images are named {name:?} ({first} and {second}) — rename one")]
    DuplicateName { name: String, first: String, second: String },
    #[error("{kind} image {image:?} needs {key} = {example}")]
    MissingKey { kind: &'static str, image: String, key: &'static str, example: &'static str },
    #[error("built image {image:?}: {key} {value:?} must be relative to the manifest's folder")]
    AbsolutePath { image: String, key: &'static str, value: String },
    #[error("built image {image:?}: context {given:?} does not exist (looked in {})", looked.display())]
    ContextMissing { image: String, given: String, looked: PathBuf },
    #[error("built image {image:?}: context {given:?} is not a directory ({})", looked.display())]
    ContextNotDir { image: String, given: String, looked: PathBuf },
    #[error("built image {image:?}: dockerfile {given:?} does not exist (looked in {})", looked.display())]
    DockerfileMissing { image: String, given: String, looked: PathBuf },
    #[error(
        "built image {image:?}: no Dockerfile in context {context:?} (looked for {}) — add one or set dockerfile = \"<path>\"",
        looked.display()
    )]
    DefaultDockerfileMissing { image: String, context: String, looked: PathBuf },
    #[error("built image {image:?}: dockerfile {given:?} is not a file ({})", looked.display())]
    DockerfileNotFile { image: String, given: String, looked: PathBuf },
    #[error("built image {image:?}: cannot resolve {key} {given:?} ({})", looked.display())]
    Unresolvable {
        image: String,
        key: &'static str,
        given: String,
        looked: PathBuf,
        #[source]
        err: std::io::Error,
    },
    /// A context or Dockerfile resolving outside the instance's root. Boxed: it is the largest problem.
    #[error("{0}")]
    OutsideRoot(Box<Escape>),
    #[error("root {given:?} must be relative to the manifest's folder, e.g. root = \"../..\"")]
    AbsoluteRoot { given: String },
    #[error("root {given:?} is not a directory ({})", looked.display())]
    RootNotDir { given: String, looked: PathBuf },
    #[error("cannot resolve root {given:?} ({})", looked.display())]
    RootUnresolvable {
        given: String,
        looked: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error(
        "root {given:?} resolves to {}, which does not hold the manifest's folder {} — name a folder the manifest \
         lies in, e.g. root = \"..\"",
        resolved.display(),
        folder.display()
    )]
    RootNotAbove { given: String, resolved: PathBuf, folder: PathBuf },
    #[error("built image {image:?}: build arg {key:?} is invalid — a name must be non-empty, without '=' or spaces")]
    BadArg { image: String, key: String },
    #[error(
        "built image {image:?}: target stage {stage:?} is invalid — name a stage of the Dockerfile (FROM … AS <stage>)"
    )]
    BadStage { image: String, stage: String },
    #[error("built image {image:?}: repository {repository:?} is invalid")]
    BadRepository {
        image: String,
        repository: String,
        #[source]
        err: RefError,
    },
    #[error(
        "built image {image:?}: repository {repository:?} must be a repository path without registry, tag or \
         digest — the target's registry is prepended"
    )]
    RepositoryNotPlain { image: String, repository: String },
    #[error("{kind} image {image:?}: ref is not a valid image reference")]
    BadRef {
        kind: &'static str,
        image: String,
        #[source]
        err: RefError,
    },
    #[error("pinned image {image:?} needs a digest: write ref = \"{given}@sha256:…\"")]
    PinnedWithoutDigest { image: String, given: String },
    #[error("built image {image:?}: cannot read its Dockerfile {} to find the images it builds FROM", path.display())]
    DockerfileUnreadable {
        image: String,
        path: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error(
        "built image {image:?}: stage must be a table, e.g. stage = {{ run = [\"pnpm\", \"deploy\", \"--filter\", \
         \"api\", \"{{out}}\"], remove = [\"node_modules/.modules.yaml\"] }}"
    )]
    StageNotTable { image: String },
    #[error("built image {image:?}: stage.{key} must be {want}")]
    StageType { image: String, key: &'static str, want: &'static str },
    #[error(
        "built image {image:?}: stage needs a command: run = [\"<program>\", \"<arg>\", …, \"{{out}}\"], which writes \
         the staged context into the fresh directory {{out}}"
    )]
    StageNoRun { image: String },
    #[error(
        "built image {image:?}: stage.run never names {{out}} — pass the command the fresh directory it must write \
         the staged context to, e.g. [\"pnpm\", \"deploy\", \"--filter\", \"api\", \"{{out}}\"]"
    )]
    StageNoOut { image: String },
    #[error("built image {image:?}: stage.remove pattern {pattern:?} cannot be used: {why}")]
    StagePattern { image: String, pattern: String, why: String },
    #[error(
        "built image {image:?}: stage.image_path {given:?} must be an absolute path without empty, . or .. parts, \
         e.g. image_path = \"/app\" (where the Dockerfile copies the staged tree)"
    )]
    StageImagePath { image: String, given: String },
    /// Built images whose Dockerfiles build FROM each other in a loop: `cycle` is `a, b, a` (an
    /// image FROM itself is `a, a`), `steps` says where each Dockerfile names the next.
    #[error("{}", from_cycle(cycle, steps))]
    FromCycle { cycle: Vec<String>, steps: Vec<String> },
}

fn from_cycle(cycle: &[String], steps: &[String]) -> String {
    let (path, at) = (cycle.join(" → "), steps.join("; "));
    match cycle {
        [only, _] => format!(
            "built image {only:?} builds FROM itself: {path} ({at}) — a FROM naming a built image of this manifest, by \
             name or repository, builds on that image; to build on an image from elsewhere, write it with a tag or \
             registry (FROM docker.io/library/{only}:latest)"
        ),
        _ => format!(
            "built images build FROM each other in a cycle: {path} ({at}) — a base is built before the images built \
             FROM it, so one of them must build FROM something else"
        ),
    }
}

/// A path of the manifest that resolves outside the instance's root, and the `root` that would hold it.
#[derive(Debug)]
pub struct Escape {
    /// `context` or `dockerfile`.
    pub key: &'static str,
    /// `[built.<name>]`.
    pub section: String,
    /// The path as the manifest gives it.
    pub given: String,
    /// Where it resolves, symlinks followed.
    pub resolved: PathBuf,
    pub root: PathBuf,
    pub origin: RootOrigin,
    /// The `root` value, relative to the manifest's folder, that would hold both.
    pub widen: String,
}

impl fmt::Display for Escape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {:?} of {} resolves to {}, outside the instance's root {} ({}) — move it inside, or widen the root \
             with root = {:?}",
            self.key,
            self.given,
            self.section,
            self.resolved.display(),
            self.root.display(),
            self.origin,
            self.widen
        )
    }
}
