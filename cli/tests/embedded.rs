//! `kiln up` with no `--coordinator`: the embedded default — the real coordinator and a real host
//! agent started in-process against this machine's Docker daemon, state in a temp `KILN_HOME`.

use kiln::{Connect, EventKind, Exit, LogsArgs, Outcome, OutputMode, UpArgs};
use std::path::{Path, PathBuf};

/// examples/hello under a unique instance name, so its tags are this test's alone.
fn hello(into: &Path) -> (PathBuf, String) {
    let dir = into.join("hello");
    kiln_e2e::fixture::copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/hello"), &dir);
    let instance = format!("cli{:08x}", fastrand::u32(..));
    let manifest = dir.join("kiln.toml");
    let text = std::fs::read_to_string(&manifest)
        .unwrap()
        .replace("instance = \"hello\"", &format!("instance = \"{instance}\""));
    std::fs::write(&manifest, text).unwrap();
    (dir, instance)
}

fn args(dir: &Path, home: &Path) -> UpArgs {
    UpArgs {
        dir: dir.to_path_buf(),
        force: false,
        dry_run: false,
        connect: Connect::embedded_in(home),
        output: OutputMode::Quiet,
    }
}

/// The images with an event of `kind`, sorted: the embedded agent builds as many at once as the
/// machine has cores, so they finish in any order.
fn images(events: &[kiln::Event], kind: EventKind) -> Vec<String> {
    let mut images: Vec<String> = events.iter().filter(|e| e.kind == kind).map(|e| e.image.clone()).collect();
    images.sort();
    images
}

fn remove_tags(events: &[kiln::Event]) {
    for e in events.iter().filter(|e| e.kind == EventKind::Building) {
        let _ = std::process::Command::new("docker").args(["rmi", "--force", "--no-prune", &e.reference]).output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_up_builds_then_records_and_logs_replay_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = hello(tmp.path());
    let home = tmp.path().join("kiln-home");

    let first = kiln::up(args(&dir, &home)).await.unwrap();
    assert_eq!(first.outcome, Outcome::Succeeded, "{:#?}", first.events);
    assert_eq!(first.exit(), Exit::Converged);
    assert_eq!(images(&first.events, EventKind::Built), vec!["web", "worker"]);
    assert!(home.join("state/kiln.db").is_file(), "state lives in KILN_HOME, not in the instance folder");
    assert!(!dir.join("state").exists());
    let caches = std::fs::read_dir(home.join("stat")).map(|d| d.count()).unwrap_or(0);
    assert!(caches >= 1, "the contexts' stat caches live in KILN_HOME/stat too");

    let second = kiln::up(args(&dir, &home)).await.unwrap();
    assert_eq!(images(&second.events, EventKind::Recorded), vec!["web", "worker"], "{:#?}", second.events);
    assert!(images(&second.events, EventKind::Built).is_empty());

    let replay = kiln::logs(LogsArgs {
        converge_id: first.converge_id.clone(),
        follow: false,
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    })
    .await
    .unwrap();
    let kinds = |events: &[kiln::Event]| {
        events
            .iter()
            .filter(|e| e.kind != EventKind::NeedContexts && e.kind != EventKind::Progress)
            .map(|e| e.kind)
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(&replay), kinds(&first.events), "logs replays the converge's events");
    remove_tags(&first.events);
}

/// The CLI's own path (`plan_up`) end to end: the child comes first in the file, and the CLI lists
/// its base before it, so even a coordinator that builds in request order builds the base first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_up_builds_a_base_then_the_image_built_from_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shop");
    let manifest = format!(
        "instance = \"cli{:08x}\"\n[target]\nkind = \"local\"\n\
         [built.app]\ncontext = \"app\"\n[built.base]\ncontext = \"base\"\nshared = true\n",
        fastrand::u32(..)
    );
    for (path, contents) in [
        ("kiln.toml", manifest.as_str()),
        ("app/Dockerfile", "FROM base\nCOPY app.txt /app.txt\n"),
        ("app/app.txt", "app\n"),
        ("base/Dockerfile", "FROM scratch\nCOPY base.txt /base.txt\n"),
        ("base/base.txt", "base\n"),
    ] {
        std::fs::create_dir_all(dir.join(path).parent().unwrap()).unwrap();
        std::fs::write(dir.join(path), contents).unwrap();
    }
    let home = tmp.path().join("kiln-home");
    let up = kiln::up(args(&dir, &home)).await.unwrap();
    assert_eq!(up.outcome, Outcome::Succeeded, "{:#?}", up.events);
    // In build order: the base first.
    let built: Vec<&str> = up.events.iter().filter(|e| e.kind == EventKind::Built).map(|e| e.image.as_str()).collect();
    assert_eq!(built, vec!["base", "app"]);
    let reference = |name: &str| {
        up.events.iter().find(|e| e.kind == EventKind::Building && e.image == name).unwrap().reference.clone()
    };
    // Built on the base's content tag: the base's layer (FROM scratch, one COPY) under its own.
    let layers = std::process::Command::new("docker")
        .args(["image", "inspect", "--format", "{{len .RootFS.Layers}}", &reference("app")])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&layers.stdout).trim(), "2", "the base's layer and the child's");
    remove_tags(&up.events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_build_exits_1_naming_the_image() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = hello(tmp.path());
    std::fs::write(dir.join("web/Dockerfile"), "FROM scratch\nCOPY nowhere.txt /\n").unwrap();
    let outcome = kiln::up(args(&dir, &tmp.path().join("kiln-home"))).await.unwrap();
    assert_eq!(outcome.exit(), Exit::Failed);
    let failure = outcome.failure.expect("a failure is reported");
    assert_eq!(failure.image, "web");
    assert!(failure.message.contains("nowhere.txt"), "{}", failure.message);
    remove_tags(&outcome.events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_kiln_on_the_same_home_waits_instead_of_failing_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("kiln-home");
    let (a, _) = hello(&tmp.path().join("a"));
    // A slow build, so the second kiln starts while the first converge is running.
    let base = kiln_e2e::docker::busybox_base();
    std::fs::write(a.join("web/Dockerfile"), format!("FROM {base}\nRUN sleep 3\nCOPY index.html /srv/\n")).unwrap();
    let (b, _) = hello(&tmp.path().join("b"));
    let (first, second) = tokio::join!(kiln::up(args(&a, &home)), async {
        tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        kiln::up(args(&b, &home)).await
    });
    let (first, second) = (first.unwrap(), second.unwrap());
    assert_eq!(first.outcome, Outcome::Succeeded, "{:#?}", first.events);
    assert_eq!(second.outcome, Outcome::Succeeded, "{:#?}", second.events);
    // The second coordinator's start did not mark the first's running converge failed.
    let status = kiln::status(kiln::StatusArgs {
        instance: None,
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    })
    .await
    .unwrap();
    assert_eq!(status.converges.len(), 2);
    assert!(status.converges.iter().all(|c| c.outcome == Outcome::Succeeded), "{:#?}", status.converges);
    remove_tags(&first.events);
    remove_tags(&second.events);
}

/// A second `kiln status` while another `kiln` holds `$KILN_HOME` (a long embedded `kiln up`)
/// reads beside it instead of waiting for it to finish.
#[test]
fn status_reads_while_another_kiln_holds_the_home() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("kiln-home");
    std::fs::create_dir_all(&home).unwrap();
    let lock =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(home.join("embedded.lock")).unwrap();
    lock.lock().unwrap();

    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["status"])
        .env("KILN_HOME", &home)
        .env_remove("KILN_COORDINATOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Not a speed check: a status that waits for the lock would wait until it is released, which
    // this test never does before the deadline.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("kiln status waited for the lock another kiln holds");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(!stderr.contains("waiting for it to finish"), "stderr: {stderr}");
    drop(lock);
}

/// `kiln logs … | head`: a reader that stops early is not a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_into_a_pipe_closed_early_ends_quietly() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = hello(tmp.path());
    let home = tmp.path().join("kiln-home");
    let first = kiln::up(args(&dir, &home)).await.unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["logs", &first.converge_id])
        .env("KILN_HOME", &home)
        .env_remove("KILN_COORDINATOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first_bytes = [0u8; 8];
    std::io::Read::read_exact(&mut stdout, &mut first_bytes).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.to_lowercase().contains("broken pipe"), "stderr: {stderr}");
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    remove_tags(&first.events);
}

/// A coordinator that dies mid-converge is said as such, with exit 3 — not as a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_gone_mid_converge_is_said_and_exits_3() {
    use std::sync::atomic::Ordering;
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _) = hello(tmp.path());
    let mut farm = kiln_e2e::Farm::start(&tmp.path().join("farm")).await;
    farm.store.pause.armed.store(true, Ordering::SeqCst);
    let store = farm.store.clone();
    let gate = store.pause.gate.lock().await;
    let args = UpArgs { connect: Connect::remote(farm.url.clone()), ..args(&dir, &home_unused(&tmp)) };
    let up = tokio::spawn(async move { kiln::up(args).await });
    tokio::time::timeout(std::time::Duration::from_secs(60), farm.store.pause.built.notified())
        .await
        .expect("a build ran");
    farm.crash_coordinator();
    let err = up.await.unwrap().expect_err("the converge's stream broke");
    drop(gate);
    assert_eq!(err.exit(), Exit::Unreachable, "{err}");
    let text = kiln::error::report(&err);
    assert!(text.starts_with(&format!("the coordinator at {} went away during the converge (", farm.url)), "{text}");
    assert!(!text.contains("h2 protocol error"), "{text}");
    farm.stop().await;
    kiln_e2e::fixture::remove_built(&dir);
}

fn home_unused(tmp: &tempfile::TempDir) -> PathBuf {
    tmp.path().join("unused-home")
}
