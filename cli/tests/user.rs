//! The build-time `USER` (ADR-0037's one surviving rule): read from a built image's config when it
//! is built, kept in the record beside its ref, shown by `kiln status` and `kiln status --json`;
//! a brought ref is never inspected, so it shows none even when its image declares one.

use std::path::Path;
use std::process::Command;

use kiln::{Connect, EventKind, Outcome, OutputMode, UpArgs};
use kiln_e2e::fixture::{unique, write};

/// An image the user owns that declares `USER 4242`, built by hand (not by Kiln, no labels).
fn plant_brought_with_user(reference: &str) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "f", "brought\n");
    write(dir.path(), "Dockerfile", "FROM scratch\nCOPY f /f\nUSER 4242\n");
    let out = Command::new("docker")
        .env("DOCKER_BUILDKIT", "0")
        .args(["build", "-q", "--no-cache", "-t", reference])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "docker build failed: {}", String::from_utf8_lossy(&out.stderr));
}

fn kiln_status(home: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("status")
        .args(args)
        .env("KILN_HOME", home)
        .env_remove("KILN_COORDINATOR")
        .output()
        .unwrap();
    assert!(out.status.success(), "kiln status: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_built_images_user_and_none_for_a_brought_one() {
    let tmp = tempfile::tempdir().unwrap();
    let instance = unique("user");
    let brought = format!("kiln-test/{instance}-brought:1");
    plant_brought_with_user(&brought);
    let dir = tmp.path().join("shop");
    let manifest = format!(
        "instance = \"{instance}\"\n[target]\nkind = \"local\"\n\
         [built.app]\ncontext = \"app\"\n[built.rootful]\ncontext = \"rootful\"\n\
         [brought.tool]\nref = \"{brought}\"\n"
    );
    write(&dir, "kiln.toml", &manifest);
    write(&dir, "app/Dockerfile", "FROM scratch\nCOPY app.txt /app.txt\nUSER 1000:1000\n");
    write(&dir, "app/app.txt", "app\n");
    write(&dir, "rootful/Dockerfile", "FROM scratch\nCOPY r.txt /r.txt\n");
    write(&dir, "rootful/r.txt", "rootful\n");
    let home = tmp.path().join("kiln-home");

    let args = UpArgs { connect: Connect::embedded_in(&home), output: OutputMode::Quiet, ..UpArgs::new(&dir) };
    let up = kiln::up(args).await.unwrap();
    assert_eq!(up.outcome, Outcome::Succeeded, "{:#?}", up.events);

    let json: serde_json::Value = serde_json::from_str(&kiln_status(&home, &["--json", &instance])).unwrap();
    let images = json["instances"][0]["images"].as_array().expect("the instance's recorded images");
    let user_of = |name: &str| {
        let image = images.iter().find(|i| i["name"] == name).unwrap_or_else(|| panic!("no {name} in {json}"));
        image.get("user").cloned().unwrap_or_else(|| panic!("{name} has no user field: {image}"))
    };
    assert_eq!(user_of("app"), "1000:1000");
    assert_eq!(user_of("rootful"), serde_json::Value::Null, "a built image without USER declares none");
    assert_eq!(user_of("tool"), serde_json::Value::Null, "a brought ref is never inspected, whatever it declares");

    let text = kiln_status(&home, &[&instance]);
    let line = |name: &str| text.lines().find(|l| l.trim_start().starts_with(name)).unwrap().to_string();
    assert!(line("app").ends_with("USER 1000:1000"), "{text}");
    assert!(line("rootful").ends_with("no USER"), "{text}");
    assert!(line("tool").ends_with(&brought), "nothing is said of a brought ref's user: {text}");

    for e in up.events.iter().filter(|e| e.kind == EventKind::Building) {
        kiln_e2e::docker::remove(&e.reference);
    }
    kiln_e2e::docker::remove(&brought);
}
