//! Staged contexts end to end (DESIGN.md "Seal", ADR-0069): `kiln up` with the embedded
//! coordinator and the real Docker daemon builds the sealed tree a staging command wrote, and one
//! input staged into two fresh directories is one ref.

use std::path::Path;
use std::process::Command;

use kiln::{Connect, EventKind, Exit, Outcome, OutputMode, UpArgs};
use kiln_e2e::fixture::{unique, write};

/// What a package manager's deploy does: copies the sources into the output directory and leaves
/// records of where (a config naming the output path, which the seal rewrites to the in-image
/// path) and when (a state file with the path, the time and the process id, declared in
/// `remove`) it ran.
const STAGE_SH: &str = r#"set -e
out="$1"
cp -R src/. "$out/"
printf 'virtualStoreDir: %s/node_modules/.pnpm\nprunedAt: %s %s\n' "$out" "$(date +%s%N)" "$$" > "$out/.modules.yaml"
printf '{"root": "%s/lib"}\n' "$out" > "$out/config.json"
"#;

/// An instance whose built image `api` is staged by `stage.sh` in its context folder.
fn staged_instance(into: &Path) -> std::path::PathBuf {
    let dir = into.join("shop");
    let manifest = format!(
        "instance = \"{}\"\n[target]\nkind = \"local\"\n\n[built.api]\ncontext = \"api\"\n\
         stage = {{ run = [\"sh\", \"stage.sh\", \"{{out}}\"], remove = [\".modules.yaml\"], image_path = \"/app\" }}\n",
        unique("stage")
    );
    write(&dir, "kiln.toml", &manifest);
    write(&dir, "api/Dockerfile", "FROM scratch\nCOPY . /app/\n");
    write(&dir, "api/stage.sh", STAGE_SH);
    write(&dir, "api/src/index.js", "console.log('api')\n");
    write(&dir, "api/src/lib/util.js", "module.exports = 1\n");
    dir
}

fn args(dir: &Path, home: &Path) -> UpArgs {
    UpArgs { connect: Connect::embedded_in(home), output: OutputMode::Quiet, ..UpArgs::new(dir) }
}

/// What `kiln refs` prints for image `name`'s ref (the binary, as a user runs it).
fn refs_line(dir: &Path, name: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln")).arg("refs").arg(dir).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "kiln refs: {}", String::from_utf8_lossy(&out.stderr));
    stdout.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("no {name} in {stdout}")).to_string()
}

/// A file of the image `reference` (FROM scratch, so nothing can run in it): `docker create`,
/// then `docker cp` out of the container. `None` when the image has no such file.
fn file_in_image(reference: &str, path: &str) -> Option<String> {
    let container = kiln_e2e::docker::create_container(reference);
    let out = tempfile::tempdir().unwrap();
    let copied = Command::new("docker")
        .arg("cp")
        .arg(format!("{container}:{path}"))
        .arg(out.path().join("file"))
        .output()
        .unwrap();
    kiln_e2e::docker::remove_container(&container);
    copied.status.success().then(|| std::fs::read_to_string(out.path().join("file")).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_context_builds_its_sealed_tree_and_staged_again_is_the_same_ref() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = staged_instance(tmp.path());
    let home = tmp.path().join("kiln-home");

    let first = kiln::up(args(&dir, &home)).await.unwrap();
    assert_eq!(first.outcome, Outcome::Succeeded, "{:#?}", first.events);
    let built = first.events.iter().find(|e| e.kind == EventKind::Building && e.image == "api").expect("api is built");
    let reference = built.reference.clone();
    assert!(first.events.iter().any(|e| e.kind == EventKind::Built && e.image == "api"), "{:#?}", first.events);

    // Staged again into another fresh directory (the state file's time and pid differ too): the
    // same tree digest, so the same ref, and nothing to build.
    let second = kiln::up(args(&dir, &home)).await.unwrap();
    assert_eq!(second.outcome, Outcome::Succeeded, "{:#?}", second.events);
    let recorded = second.events.iter().find(|e| e.kind == EventKind::Recorded && e.image == "api");
    assert_eq!(recorded.map(|e| e.reference.as_str()), Some(reference.as_str()), "{:#?}", second.events);
    assert!(second.events.iter().all(|e| e.kind != EventKind::Building), "{:#?}", second.events);

    // `kiln refs` stages too, into its own directory, and agrees.
    let line = refs_line(&dir, "api");
    assert!(line.contains(&reference) && line.ends_with("entries, staged)"), "{line}");

    // What was built is the sealed tree: the sources the command copied, the config rewritten to
    // the in-image path, the state file gone — and not the context folder (no stage.sh).
    assert_eq!(file_in_image(&reference, "/app/index.js").as_deref(), Some("console.log('api')\n"));
    assert_eq!(file_in_image(&reference, "/app/config.json").as_deref(), Some("{\"root\": \"/app/lib\"}\n"));
    assert_eq!(file_in_image(&reference, "/app/.modules.yaml"), None);
    assert_eq!(file_in_image(&reference, "/app/stage.sh"), None);
    kiln_e2e::docker::remove(&reference);
}

#[test]
fn a_failing_stage_command_fails_kiln_up_naming_the_image_the_command_and_its_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = staged_instance(tmp.path());
    write(&dir, "api/stage.sh", "echo 'resolving 12 packages'\necho 'ERR_PNPM_OUTDATED_LOCKFILE' >&2\nexit 7\n");
    let home = tmp.path().join("kiln-home");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("up")
        .arg(&dir)
        .env("KILN_HOME", &home)
        .env_remove("KILN_COORDINATOR")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(Exit::Failed.code().into()), "stderr: {stderr}");
    let want = format!(
        "kiln: built image \"api\": its stage command `sh stage.sh {{out}}` failed (exit status: 7) in {}; its \
         output:\n  | resolving 12 packages\n  | ERR_PNPM_OUTDATED_LOCKFILE\n",
        dir.join("api").canonicalize().unwrap().display()
    );
    assert_eq!(stderr, want);
    assert!(!home.join("state").exists(), "nothing was asked of a coordinator");

    // `kiln refs` stages the same way, and fails the same way.
    let refs = Command::new(env!("CARGO_BIN_EXE_kiln")).arg("refs").arg(&dir).output().unwrap();
    let stderr = String::from_utf8_lossy(&refs.stderr);
    assert_eq!(refs.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains("built image \"api\": its stage command `sh stage.sh {out}` failed"), "{stderr}");
}
