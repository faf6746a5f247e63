//! The binary's exit codes and messages, run as a user runs it (`CARGO_BIN_EXE_kiln`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        // Neither may leak in from the environment running the tests.
        .env_remove("KILN_COORDINATOR")
        .env_remove("KILN_CONNECT_TIMEOUT")
        .output()
        .expect("the kiln binary runs")
}

fn hello() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/hello")
}

fn closed_port_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

#[test]
fn up_against_a_closed_port_exits_3_naming_the_address_and_the_os_error() {
    let url = closed_port_url();
    let hello = hello();
    let out = kiln(&["up", hello.to_str().unwrap(), "--coordinator", &url, "--retry-window", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("kiln: cannot reach the coordinator at {url}: connection refused")),
        "stderr: {stderr}"
    );
    assert!(!stderr.contains("transport error"), "stderr: {stderr}");
}

#[test]
fn the_coordinator_can_come_from_the_environment() {
    let url = closed_port_url();
    let hello = hello();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["up", hello.to_str().unwrap()])
        .env("KILN_COORDINATOR", &url)
        .env("KILN_CONNECT_TIMEOUT", "0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(stderr.contains(&url), "stderr: {stderr}");
}

#[test]
fn a_broken_manifest_exits_2_with_its_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("kiln.toml"), "instance = \"x\"\n[target]\nkind = \"moon\"\n").unwrap();
    let out = kiln(&["up", tmp.path().to_str().unwrap(), "--coordinator", &closed_port_url()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    let located = format!("{}:3: unknown target kind \"moon\"", tmp.path().join("kiln.toml").display());
    assert!(stderr.contains(&located), "stderr: {stderr}");
}

#[test]
fn a_malformed_coordinator_url_exits_2() {
    let hello = hello();
    let out = kiln(&["up", hello.to_str().unwrap(), "--coordinator", "127.0.0.1:7070"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("write it as https://host:port"), "stderr: {stderr}");
}

#[test]
fn help_documents_the_exit_codes() {
    let out = kiln(&["--help"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    for line in
        ["0  converged", "1  the converge failed", "2  usage or manifest error", "3  the coordinator cannot be reached"]
    {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
}

#[test]
fn global_flags_may_come_before_the_subcommand() {
    let url = closed_port_url();
    let out = kiln(&["--coordinator", &url, "--connect-timeout", "1", "status"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(stderr.contains(&format!("cannot reach the coordinator at {url}: connection refused")), "stderr: {stderr}");
}

#[test]
fn an_unreachable_coordinator_is_said_to_be_retried_as_it_happens() {
    let url = closed_port_url();
    let started = std::time::Instant::now();
    let out = kiln(&["status", "--coordinator", &url, "--connect-timeout", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "stderr: {stderr}");
    assert!(
        stderr.contains(&format!("kiln: cannot reach {url} yet — retrying (attempt 2, connection refused;")),
        "stderr: {stderr}"
    );
    // The window given is honoured: far from the default 90 s.
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "took {:?}", started.elapsed());
}

#[test]
fn refs_exits_2_on_a_manifest_error_as_up_does() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("kiln.toml"), "instance = \"x\"\n[target]\nkind = \"moon\"\n").unwrap();
    let out = kiln(&["refs", tmp.path().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("kiln.toml:3: unknown target kind"), "stderr: {stderr}");
}

#[test]
fn images_built_from_each_other_in_a_cycle_exit_2_naming_the_cycle() {
    let tmp = tempfile::tempdir().unwrap();
    for (path, contents) in [("a/Dockerfile", "FROM b\n"), ("b/Dockerfile", "FROM x-a\n")] {
        std::fs::create_dir_all(tmp.path().join(path).parent().unwrap()).unwrap();
        std::fs::write(tmp.path().join(path), contents).unwrap();
    }
    let manifest =
        "instance = \"x\"\n[target]\nkind = \"local\"\n[built.a]\ncontext = \"a\"\n[built.b]\ncontext = \"b\"\n";
    std::fs::write(tmp.path().join("kiln.toml"), manifest).unwrap();
    // `up` refuses it before dialing anything: a manifest error, not an unreachable coordinator.
    let dir = tmp.path().to_str().unwrap();
    for args in [vec!["refs", dir], vec!["up", "--coordinator", "http://127.0.0.1:9", "--connect-timeout", "1", dir]] {
        let out = kiln(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} stderr: {stderr}");
        assert!(stderr.contains("kiln.toml:4: built images build FROM each other in a cycle: a → b → a"), "{stderr}");
        assert!(stderr.contains("(a: a/Dockerfile:1 FROM b; b: b/Dockerfile:1 FROM x-a)"), "{stderr}");
    }
}

#[test]
fn digest_of_a_missing_directory_names_it_and_exits_2() {
    let out = kiln(&["digest", "no-such-context-dir"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("cannot read context directory no-such-context-dir"), "stderr: {stderr}");
    assert!(!stderr.contains("cannot read ."), "stderr: {stderr}");
}

#[test]
fn a_reader_that_stops_early_is_not_an_error() {
    // `kiln digest --list … | head -1`: the pipe closes after the first line.
    let tmp = tempfile::tempdir().unwrap();
    for i in 0..20_000 {
        std::fs::write(tmp.path().join(format!("f{i:05}")), "x").unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["digest", "--list", tmp.path().to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    std::io::Read::read_exact(&mut stdout, &mut first).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.to_lowercase().contains("broken pipe"), "stderr: {stderr}");
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
}

/// An instance whose context holds a fifo, which the walk refuses.
fn with_a_fifo(into: &Path) -> PathBuf {
    let dir = into.join("fifo");
    std::fs::create_dir_all(dir.join("app")).unwrap();
    std::fs::write(
        dir.join("kiln.toml"),
        "instance = \"fifo\"\n[target]\nkind = \"local\"\n[built.app]\ncontext = \"app\"\n",
    )
    .unwrap();
    std::fs::write(dir.join("app/Dockerfile"), "FROM scratch\n").unwrap();
    assert!(Command::new("mkfifo").arg(dir.join("app/pipe")).status().unwrap().success());
    dir
}

/// The walk runs while the coordinator comes up: when it fails, its error is the one shown — also
/// when the coordinator cannot be reached — and the embedded parts stop quietly and free
/// `$KILN_HOME` for the next command.
#[test]
fn a_walk_that_fails_while_the_coordinator_starts_is_what_kiln_up_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = with_a_fifo(tmp.path());
    let home = tmp.path().join("home");
    let up = |extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
        cmd.arg("up").arg(&dir).args(extra).env("KILN_HOME", &home).env_remove("KILN_COORDINATOR");
        cmd.output().unwrap()
    };
    let out = up(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("pipe") && stderr.contains("fifo"), "stderr: {stderr}");
    assert!(!stderr.contains("warning"), "the embedded parts stopped quietly: {stderr}");
    let lock = std::fs::File::open(home.join("embedded.lock")).unwrap();
    assert!(lock.try_lock().is_ok(), "$KILN_HOME is free again");
    drop(lock);

    let url = closed_port_url();
    let out = up(&["--coordinator", &url, "--retry-window", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "the walk's error, not the unreachable coordinator's: {stderr}");
    assert!(stderr.contains("fifo") && !stderr.contains("cannot reach the coordinator"), "stderr: {stderr}");
}
