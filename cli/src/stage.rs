//! Staged contexts (DESIGN.md "Seal", ADR-0069): a built image whose manifest says
//! `stage = { run = [… "{out}" …] }` builds the tree that command writes, not its context folder.
//!
//! Each command runs in its image's context folder, with `{out}` a fresh empty directory, stdin
//! closed and its output captured (shown when it fails). The tree it wrote is then sealed in place
//! (`kiln_core::seal`: the declared where-and-when files deleted, the staging path rewritten to the
//! declared in-image path, a symlink naming the staging path or a non-UTF-8 file holding it
//! refused) and becomes the context that is hashed, uploaded and built. So one input staged into
//! two directories is one digest, and `kiln up` and `kiln refs` agree, because both stage here.
//!
//! Staging runs on the CLI, never on the coordinator or an agent: the command is the user's
//! toolchain (pnpm and its store), and only the sealed tree leaves this machine.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::manifest::{BuiltImage, Manifest, Stage};
use kiln_core::seal::{seal, SealError, SealReport};
use tempfile::TempDir;

use crate::error::Exit;

/// A sealed staged tree. The directory is removed when the last holder drops it: the plan, and
/// each upload of it.
#[derive(Clone, Debug)]
pub struct Staged {
    pub dir: Arc<TempDir>,
    /// The command as the manifest writes it.
    pub command: String,
    pub report: SealReport,
    pub took: Duration,
}

impl Staged {
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// One line for the converge's output: what ran and what the seal changed.
    pub fn words(&self) -> String {
        let list = |paths: &[String]| paths.join(", ");
        let sealed = match (self.report.deleted.is_empty(), self.report.rewritten.is_empty()) {
            (true, true) => "nothing to delete or rewrite".to_string(),
            (false, true) => format!("deleted {}", list(&self.report.deleted)),
            (true, false) => format!("rewrote {}", list(&self.report.rewritten)),
            (false, false) => {
                format!("deleted {}; rewrote {}", list(&self.report.deleted), list(&self.report.rewritten))
            }
        };
        format!("staged by `{}` in {:.1} s; sealed: {sealed}", self.command, self.took.as_secs_f64())
    }
}

/// Why an image's context could not be staged.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("built image {image:?}: cannot make a directory to stage its context into")]
    Scratch {
        image: String,
        #[source]
        err: std::io::Error,
    },
    #[error("built image {image:?}: cannot run its stage command `{command}` in {} — is {program:?} installed and on PATH (or a path from the context folder)?", dir.display())]
    Spawn {
        image: String,
        command: String,
        program: String,
        dir: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("built image {image:?}: its stage command `{command}` failed ({status}) in {}{}", dir.display(), tail_words(output))]
    Failed { image: String, command: String, dir: PathBuf, status: ExitStatus, output: String },
    #[error("built image {image:?}: the tree `{command}` staged cannot be sealed (it is kept where it was staged, to look at)")]
    Seal {
        image: String,
        command: String,
        /// Boxed: the seal's errors name a tree and a path, and this `Result` is returned often.
        #[source]
        err: Box<SealError>,
    },
}

impl StageError {
    /// A command that failed may succeed when run again (a registry it fetched from was down): 1.
    /// One that cannot start, or a tree the seal refuses, fails the same way every time until the
    /// manifest or the command changes: 2, as a manifest error is.
    pub fn exit(&self) -> Exit {
        match self {
            StageError::Scratch { .. } | StageError::Failed { .. } => Exit::Failed,
            StageError::Spawn { .. } | StageError::Seal { .. } => Exit::Usage,
        }
    }
}

/// Stages every staged built image of `manifest`, one after another (their output would
/// interleave, and a package manager runs its own parallelism), by image name.
pub fn stage_all(manifest: &Manifest) -> Result<BTreeMap<String, Staged>, StageError> {
    let mut staged = BTreeMap::new();
    for (name, image) in manifest.built() {
        if let Some(stage) = &image.stage {
            staged.insert(name.to_string(), stage_one(name, image, stage)?);
        }
    }
    Ok(staged)
}

/// Runs `stage`'s command for `image` into a fresh directory and seals what it wrote.
pub fn stage_one(name: &str, image: &BuiltImage, stage: &Stage) -> Result<Staged, StageError> {
    let started = Instant::now();
    let command = stage.command_line();
    let dir = tempfile::Builder::new()
        .prefix(&format!("kiln-stage-{name}-"))
        .tempdir()
        .map_err(|err| StageError::Scratch { image: name.to_string(), err })?;
    let mut argv = stage.argv(dir.path()).into_iter();
    let program = argv.next().expect("a loaded stage has a program");
    // A relative path names a file of the context folder, where the command runs; std leaves
    // which folder it is resolved from unspecified, so it is made absolute here.
    let program = match Path::new(&program) {
        path if path.is_relative() && path.components().count() > 1 => image.context.join(path).into_os_string(),
        _ => program,
    };
    let spawn_failed = |err| StageError::Spawn {
        image: name.to_string(),
        command: command.clone(),
        program: program.to_string_lossy().into_owned(),
        dir: image.context.clone(),
        err,
    };
    // One pipe for both streams, so the output reads in the order it was written.
    let (mut reader, writer) = std::io::pipe().map_err(spawn_failed)?;
    let mut child = Command::new(&program)
        .args(argv)
        .current_dir(&image.context)
        .stdin(Stdio::null())
        .stdout(writer.try_clone().map_err(spawn_failed)?)
        .stderr(writer)
        .spawn()
        .map_err(spawn_failed)?;
    let output = read_tail(&mut reader);
    let status = child.wait().map_err(spawn_failed)?;
    if !status.success() {
        let dir = image.context.clone();
        return Err(StageError::Failed { image: name.to_string(), command, dir, status, output });
    }
    match seal(dir.path(), &stage.seal_spec(dir.path())) {
        Ok(report) => Ok(Staged { dir: Arc::new(dir), command, report, took: started.elapsed() }),
        Err(err) => {
            // The refused tree is the evidence: keep it; the seal's message names where it is.
            let _ = dir.keep();
            Err(StageError::Seal { image: name.to_string(), command, err: Box::new(err) })
        }
    }
}

/// How much of a command's output is kept for its error: the end is where it says why.
const TAIL_BYTES: usize = 16 * 1024;
const TAIL_LINES: usize = 30;

/// Reads `reader` to its end (every writer closed), keeping only the last [`TAIL_BYTES`].
fn read_tail(reader: &mut impl Read) -> String {
    let mut kept: Vec<u8> = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                kept.extend_from_slice(&buf[..n]);
                if kept.len() > 2 * TAIL_BYTES {
                    kept.drain(..kept.len() - TAIL_BYTES);
                }
            }
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let start = kept.len().saturating_sub(TAIL_BYTES);
    String::from_utf8_lossy(&kept[start..]).into_owned()
}

/// The last lines of a command's output, indented under the message; nothing when it was silent.
fn tail_words(output: &str) -> String {
    let lines: Vec<&str> = output.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return " — it printed nothing".to_string();
    }
    let skipped = lines.len().saturating_sub(TAIL_LINES);
    let mut words = String::from(if skipped > 0 { "; the end of its output:" } else { "; its output:" });
    for line in &lines[skipped..] {
        words.push_str("\n  | ");
        words.push_str(line);
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest whose image `api` is staged by `script` (a shell script written into the
    /// context as `stage.sh`, given `{out}` as `$1`).
    fn staged_manifest(script: &str, stage_extra: &str) -> (TempDir, Manifest) {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("api")).unwrap();
        std::fs::write(tmp.path().join("api/Dockerfile"), "FROM scratch\nCOPY . /app/\n").unwrap();
        std::fs::write(tmp.path().join("api/stage.sh"), script).unwrap();
        let text = format!(
            "instance = \"shop\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n\
             stage = {{ run = [\"sh\", \"stage.sh\", \"{{out}}\"]{stage_extra} }}\n"
        );
        std::fs::write(tmp.path().join("kiln.toml"), text).unwrap();
        let manifest = Manifest::load(tmp.path()).unwrap();
        (tmp, manifest)
    }

    #[test]
    fn a_staged_tree_is_sealed_and_kept_while_held() {
        let script = "echo hi > \"$1/a.txt\"\nprintf 'root: %s\\n' \"$1\" > \"$1/.modules.yaml\"\n";
        let (_tmp, manifest) = staged_manifest(script, ", remove = [\".modules.yaml\"]");
        let staged = stage_all(&manifest).unwrap();
        let api = &staged["api"];
        assert_eq!(std::fs::read_to_string(api.path().join("a.txt")).unwrap(), "hi\n");
        assert!(!api.path().join(".modules.yaml").exists(), "the declared where-and-when file is gone");
        assert_eq!(api.report.deleted, [".modules.yaml"]);
        assert!(api.words().contains("staged by `sh stage.sh {out}`"), "{}", api.words());
        let path = api.path().to_path_buf();
        drop(staged);
        assert!(!path.exists(), "the staging directory goes with the last holder");
    }

    #[test]
    fn a_failing_command_names_the_image_the_command_and_its_output() {
        let (_tmp, manifest) =
            staged_manifest("echo resolving packages\necho 'ERR_PNPM_NO_LOCKFILE' >&2\nexit 3\n", "");
        let err = stage_all(&manifest).unwrap_err();
        assert_eq!(err.exit(), Exit::Failed);
        let text = err.to_string();
        assert!(
            text.starts_with("built image \"api\": its stage command `sh stage.sh {out}` failed (exit status: 3) in "),
            "{text}"
        );
        assert!(text.ends_with("; its output:\n  | resolving packages\n  | ERR_PNPM_NO_LOCKFILE"), "{text}");
    }

    #[test]
    fn a_command_that_cannot_start_says_which_program() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("api")).unwrap();
        std::fs::write(tmp.path().join("api/Dockerfile"), "FROM scratch\n").unwrap();
        let text = "instance = \"shop\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n\
                    stage = { run = [\"kiln-no-such-tool\", \"{out}\"] }\n";
        std::fs::write(tmp.path().join("kiln.toml"), text).unwrap();
        let err = stage_all(&Manifest::load(tmp.path()).unwrap()).unwrap_err();
        assert_eq!(err.exit(), Exit::Usage);
        assert!(err.to_string().contains("is \"kiln-no-such-tool\" installed and on PATH"), "{err}");
    }

    #[test]
    fn a_relative_program_is_found_from_the_context_folder() {
        let (tmp, manifest) = staged_manifest("", "");
        let script = tmp.path().join("api/stage.sh");
        std::fs::write(&script, "#!/bin/sh\necho from-context > \"$1/where\"\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let mut manifest = manifest;
        let kiln_core::manifest::ImageSpec::Built(api) = &mut manifest.images[0].spec else { panic!() };
        api.stage.as_mut().unwrap().run = vec!["./stage.sh".into(), "{out}".into()];
        let staged = stage_all(&manifest).unwrap();
        assert_eq!(std::fs::read_to_string(staged["api"].path().join("where")).unwrap(), "from-context\n");
    }

    #[test]
    fn a_symlink_naming_the_staging_path_is_refused_and_the_tree_kept() {
        let (_tmp, manifest) = staged_manifest("echo x > \"$1/a\"\nln -s \"$1/a\" \"$1/link\"\n", "");
        let err = stage_all(&manifest).unwrap_err();
        assert_eq!(err.exit(), Exit::Usage);
        let StageError::Seal { err: sealed, .. } = &err else { panic!("{err}") };
        let SealError::SymlinkNamesStaging { root, path, .. } = &**sealed else { panic!("{err}") };
        assert_eq!(path, "link");
        assert!(root.join("a").exists(), "the refused tree is kept to look at");
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_text_file_naming_the_staging_path_is_rewritten_to_the_image_path_or_refused_without_one() {
        let script = "printf '{\"root\": \"%s/lib\"}' \"$1\" > \"$1/config.json\"\n";
        let (_tmp, manifest) = staged_manifest(script, ", image_path = \"/app\"");
        let staged = stage_all(&manifest).unwrap();
        let config = std::fs::read_to_string(staged["api"].path().join("config.json")).unwrap();
        assert_eq!(config, "{\"root\": \"/app/lib\"}");

        let (_tmp, manifest) = staged_manifest(script, "");
        let err = stage_all(&manifest).unwrap_err();
        let StageError::Seal { err: sealed, .. } = &err else { panic!("{err}") };
        let SealError::HoldsStaging { root, path, .. } = &**sealed else { panic!("{err}") };
        assert_eq!(path, "config.json");
        std::fs::remove_dir_all(root).unwrap();
    }
}
