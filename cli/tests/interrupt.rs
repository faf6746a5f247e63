//! Ctrl-C on `kiln up` during a real Docker build: the converge is cancelled, the build stopped on
//! the daemon (its `RUN` process is gone), nothing is recorded, and the exit is 130 — the binary
//! run as a user runs it, with the embedded coordinator and the real daemon.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether a process runs whose command line is exactly `sleep <secs>`; a build's `RUN` step runs
/// as a process of this machine (in its own namespaces), so `/proc` sees it.
fn sleeping(secs: &str) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else { return false };
    entries.flatten().any(|e| {
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
        args.len() == 2 && args[0].ends_with(b"sleep") && args[1] == secs.as_bytes()
    })
}

#[test]
fn ctrl_c_during_a_docker_build_stops_it_records_nothing_and_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("slow");
    let home = tmp.path().join("kiln-home");
    // A number no other test sleeps, so the process found is this build's.
    let secs = format!("{}", 600 + fastrand::u32(..10_000));
    let instance = format!("int{:08x}", fastrand::u32(..));
    kiln_e2e::fixture::write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{instance}\"\n[target]\nkind = \"local\"\n[built.slow]\ncontext = \"slow\"\n"),
    );
    let base = kiln_e2e::docker::busybox_base();
    kiln_e2e::fixture::write(&dir, "slow/Dockerfile", &format!("FROM {base}\nRUN sleep {secs}\n"));

    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["up"])
        .arg(&dir)
        .env("KILN_HOME", &home)
        .env_remove("KILN_COORDINATOR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !sleeping(&secs) {
        assert!(child.try_wait().unwrap().is_none(), "kiln up ended before its build ran");
        assert!(Instant::now() < deadline, "the build's RUN step never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    // What a terminal's Ctrl-C sends.
    let sent = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(130), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("cancelling converge"), "stdout: {stdout}");

    let deadline = Instant::now() + Duration::from_secs(30);
    while sleeping(&secs) {
        assert!(Instant::now() < deadline, "the build's RUN step still runs on the daemon after the cancel");
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["status", "--json", &instance])
        .env("KILN_HOME", &home)
        .env_remove("KILN_COORDINATOR")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(status.status.success(), "{text} {}", String::from_utf8_lossy(&status.stderr));
    assert!(text.contains("cancelled"), "the converge is shown cancelled: {text}");
    assert!(!text.contains(&format!("{instance}-slow:")), "nothing was recorded: {text}");
}
