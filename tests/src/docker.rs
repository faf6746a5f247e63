//! The test's own view of the Docker daemon, through the `docker` CLI: what it holds, and the
//! look-alike images a test plants next to Kiln's.

use std::process::Command;

fn docker(args: &[&str]) -> (bool, String) {
    let out = Command::new("docker").args(args).output().expect("the docker CLI must be installed");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The id of the image `reference` names, if the daemon has it.
pub fn image_id(reference: &str) -> Option<String> {
    let (ok, out) = docker(&["image", "inspect", "--format", "{{.Id}}", reference]);
    ok.then_some(out)
}

/// The `os/architecture` the image `reference` names is for, as its config says.
pub fn platform(reference: &str) -> Option<String> {
    let (ok, out) = docker(&["image", "inspect", "--format", "{{.Os}}/{{.Architecture}}", reference]);
    ok.then_some(out)
}

/// One label of the image `reference` names.
pub fn label(reference: &str, key: &str) -> Option<String> {
    let format = format!("{{{{index .Config.Labels \"{key}\"}}}}");
    let (ok, out) = docker(&["image", "inspect", "--format", &format, reference]);
    (ok && !out.is_empty() && out != "<no value>").then_some(out)
}

/// Removes `reference` if present (test clean-up; delete-if-present). Untagged parents stay: they
/// may be the build cache another test's build is reading at this moment.
pub fn remove(reference: &str) {
    let _ = docker(&["rmi", "--force", "--no-prune", reference]);
}

/// Plants an unlabeled image wearing `reference`: a `docker import` of a one-file tar — exactly
/// the hand-built look-alike Kiln must never trust.
pub fn plant_unlabeled(reference: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("planted"), reference).unwrap();
    let tar = dir.path().join("planted.tar");
    let status = Command::new("tar").arg("-cf").arg(&tar).arg("-C").arg(dir.path()).arg("planted").status().unwrap();
    assert!(status.success());
    let (ok, out) = docker(&["import", tar.to_str().unwrap(), reference]);
    assert!(ok, "docker import failed: {out}");
    image_id(reference).unwrap()
}

/// Plants an image wearing `reference` that carries Kiln's labels with another farm's id.
pub fn plant_other_farm(reference: &str, farm: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), "other farm").unwrap();
    std::fs::write(
        dir.path().join("Dockerfile"),
        format!("FROM scratch\nCOPY f /f\nLABEL kiln.dev/kind=image kiln.dev/instance=hello kiln.dev/farm={farm}\n"),
    )
    .unwrap();
    let out = Command::new("docker")
        .env("DOCKER_BUILDKIT", "0")
        .args(["build", "-q", "--no-cache", "-t", reference])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "docker build failed: {}", String::from_utf8_lossy(&out.stderr));
    image_id(reference).unwrap()
}

/// Plants an image wearing every ref in `references`, built `FROM scratch` from one file holding
/// `content` (so different contents are different images) and carrying `labels`: what a sweep test
/// needs to make garbage of this farm, another farm's images, or look-alikes.
pub fn plant_labeled(references: &[&str], labels: &[(&str, &str)], content: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f"), content).unwrap();
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    let mut dockerfile = "FROM scratch\nCOPY f /f\n".to_string();
    if !labels.is_empty() {
        dockerfile.push_str(&format!("LABEL {}\n", labels.join(" ")));
    }
    std::fs::write(dir.path().join("Dockerfile"), dockerfile).unwrap();
    let mut command = Command::new("docker");
    // No cache: a cached step's image may be removed by another test's clean-up mid-build, and
    // the classic builder then fails with "unable to find image".
    command.env("DOCKER_BUILDKIT", "0").args(["build", "-q", "--no-cache"]);
    for reference in references {
        command.args(["-t", reference]);
    }
    let out = command.arg(dir.path()).output().unwrap();
    assert!(out.status.success(), "docker build failed: {}", String::from_utf8_lossy(&out.stderr));
    image_id(references[0]).unwrap()
}

/// Creates (does not start) a container from `reference`, returning its id; the image is then in
/// use by a stopped container.
pub fn create_container(reference: &str) -> String {
    let (ok, out) = docker(&["create", reference, "/nothing-to-run"]);
    assert!(ok, "docker create {reference} failed: {out}");
    out
}

/// Removes a container (test clean-up).
pub fn remove_container(id: &str) {
    let _ = docker(&["rm", "--force", id]);
}

/// The base image test Dockerfiles may `RUN` in: `kiln-test/busybox:1`, a `docker import` of a
/// rootfs holding the static busybox and its applet links. Made once per daemon.
pub const BUSYBOX: &str = "kiln-test/busybox:1";

pub fn busybox_base() -> &'static str {
    static MADE: std::sync::Once = std::sync::Once::new();
    MADE.call_once(|| {
        if image_id(BUSYBOX).is_some() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("rootfs/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::copy("/bin/busybox", bin.join("busybox")).expect("busybox-static must be installed (scripts/setup)");
        for applet in ["sh", "sleep", "echo", "cat", "true", "false", "ls"] {
            std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
        }
        let tar = dir.path().join("rootfs.tar");
        let ok = Command::new("tar")
            .arg("-cf")
            .arg(&tar)
            .arg("-C")
            .arg(dir.path().join("rootfs"))
            .arg(".")
            .status()
            .unwrap();
        assert!(ok.success());
        let (ok, out) = docker(&["import", tar.to_str().unwrap(), BUSYBOX]);
        assert!(ok, "docker import of the busybox base failed: {out}");
    });
    BUSYBOX
}

/// Every image of repository `repo` as `repo:tag id` lines, sorted: what a test compares before
/// and after something that must not touch the daemon.
pub fn images_named(repo: &str) -> Vec<String> {
    let out = Command::new("docker")
        .args(["images", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}", repo])
        .output()
        .unwrap();
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    lines.sort();
    lines
}

/// The layers (diff ids) of the image `reference` names, bottom first.
pub fn layers(reference: &str) -> Vec<String> {
    let (ok, out) =
        docker(&["image", "inspect", "--format", "{{range .RootFS.Layers}}{{println .}}{{end}}", reference]);
    assert!(ok, "no image {reference}: {out}");
    out.lines().filter(|l| !l.is_empty()).map(str::to_string).collect()
}

/// What `args` print in a throwaway container of `reference` (removed after).
pub fn run(reference: &str, args: &[&str]) -> String {
    let mut all = vec!["run", "--rm", "--network", "none", reference];
    all.extend_from_slice(args);
    let (ok, out) = docker(&all);
    assert!(ok, "docker run {reference} {args:?} failed: {out}");
    out
}
