//! `examples/farm/README.md`, run as written with the real binaries: a served coordinator with
//! TLS, a build host enrolled by join token, a user with a token, and `kiln up` against it — plus
//! what a newcomer gets wrong: a plaintext client at a TLS coordinator, a served coordinator with
//! no TLS material, `--dev` on a public address, a token file others can read.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

/// A binary of this workspace, built beside `kiln` by `cargo test --workspace`.
fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_kiln")).with_file_name(name);
    assert!(
        path.is_file(),
        "{} is not built — run `cargo test --workspace` (or `cargo build --workspace`)",
        path.display()
    );
    path
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_string()
}

/// A child stopped by its PID when the test ends, however it ends.
struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn kiln(args: &[&str], token: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(args).env_remove("KILN_COORDINATOR").env_remove("KILN_TOKEN").env("HOME", "/nonexistent");
    if let Some(token) = token {
        cmd.env("KILN_TOKEN", token);
    }
    cmd.output().unwrap()
}

#[test]
fn the_farm_walk_through_converges_over_tls_with_an_enrolled_agent_and_a_token() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let state_arg = state.to_str().unwrap();

    // 1. The farm.
    run(Command::new(bin("kiln-coordinator")).args([
        "init",
        "--farm",
        "demo",
        "--state",
        state_arg,
        "--san",
        "localhost",
        "--san",
        "127.0.0.1",
    ]));
    assert!(state.join("tls/ca.pem").is_file());

    // 2. Served, TLS from what `init` made.
    let mut coordinator = Killed(
        Command::new(bin("kiln-coordinator"))
            .args(["--state", state_arg, "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    BufReader::new(coordinator.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("{line}")).to_string();
    let url = format!("https://{addr}");

    // 3. A build host, enrolled.
    let join = last_line(&run(Command::new(bin("kiln-coordinator")).args([
        "enroll",
        "--state",
        state_arg,
        "--role",
        "host",
        "--expires",
        "10m",
    ])));
    assert!(join.starts_with("kjoin_"), "{join}");
    let agent_state = tmp.path().join("agent");
    let _agent = Killed(
        Command::new(bin("kiln-agent"))
            .args(["--coordinator", &url, "--join", &join, "--id", "farm-host-1"])
            .arg("--state")
            .arg(&agent_state)
            .arg("--scratch")
            .arg(tmp.path().join("scratch"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // 4. A user.
    let token = last_line(&run(Command::new(bin("kiln-coordinator"))
        .args(["token", "create", "--state", state_arg, "--user", "alice", "--role", "member", "--team", "payments"])));
    assert!(token.starts_with("kiln_"), "{token}");

    // 5. The converge, trusting the farm's CA.
    let instance = tmp.path().join("farm");
    kiln_e2e::fixture::copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/farm"), &instance);
    let manifest = instance.join("kiln.toml");
    let unique = format!("farm{:08x}", fastrand::u32(..));
    std::fs::write(&manifest, std::fs::read_to_string(&manifest).unwrap().replace("farm-demo", &unique)).unwrap();
    let ca = state.join("tls/ca.pem");
    let up = |args: &[&str]| {
        let mut all = vec!["--coordinator", url.as_str(), "--ca", ca.to_str().unwrap()];
        all.extend_from_slice(args);
        kiln(&all, Some(&token))
    };
    let out = up(&["up", instance.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = up(&["up", instance.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("app      recorded"), "{stdout}");
    let whoami = up(&["whoami"]);
    assert_eq!(String::from_utf8_lossy(&whoami.stdout).trim(), "user:alice (member, team payments)");

    // A plaintext client at this TLS coordinator is told so, not left retrying.
    let out = kiln(&["--coordinator", &format!("http://{addr}"), "--connect-timeout", "5", "status"], Some(&token));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("TLS") || stderr.to_lowercase().contains("tls"), "the message names TLS: {stderr}");
    // Without the farm's CA, the coordinator's certificate is not trusted.
    let out = kiln(&["--coordinator", &url, "--connect-timeout", "5", "status"], Some(&token));
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));

    let image = format!("{unique}-app");
    for line in String::from_utf8_lossy(
        &Command::new("docker")
            .args(["images", "--format", "{{.Repository}}:{{.Tag}}", &image])
            .output()
            .unwrap()
            .stdout,
    )
    .lines()
    {
        let _ = Command::new("docker").args(["rmi", line]).output();
    }
}

#[test]
fn a_served_coordinator_without_tls_refuses_to_start_and_dev_binds_loopback_only() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().to_str().unwrap();
    let out = Command::new(bin("kiln-coordinator"))
        .args(["--state", state, "--farm", "x", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("kiln-coordinator init"), "{stderr}");
    let out = Command::new(bin("kiln-coordinator"))
        .args(["--state", state, "--farm", "x", "--listen", "0.0.0.0:0", "--dev"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("binds loopback only"), "{stderr}");
}

#[test]
fn a_token_file_others_can_read_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("token");
    std::fs::write(&file, "kiln_0123456789ab_secret").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = kiln(&["--coordinator", "https://127.0.0.1:1", "--token-file", file.to_str().unwrap(), "status"], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("chmod 600"), "{stderr}");
}
