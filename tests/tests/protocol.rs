//! The converge at the protocol level, against the real Docker daemon: a raw gRPC client in place
//! of the CLI, so these tests can also send what the CLI never would.

use kiln_e2e::{docker, wire, Farm};
use kiln_proto::v1::converge_event::Kind;
use std::path::Path;

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), &dest).unwrap();
        }
    }
}

/// A private copy of an example with a unique instance name, so tests never share tags.
fn example(name: &str, into: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
    let dir = into.join(name);
    copy_dir(&src, &dir);
    let manifest = dir.join("kiln.toml");
    let unique = format!("t{:08x}", fastrand::u32(..));
    let text = std::fs::read_to_string(&manifest).unwrap().replacen("instance = \"hello\"", &format!("instance = \"{unique}\""), 1);
    std::fs::write(&manifest, text).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_up_builds_and_a_second_records_without_docker() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = example("hello", tmp.path());
    let mut farm = Farm::start(&tmp.path().join("home")).await;

    let events = wire::up(&farm.url, &dir, false).await;
    let last = events.last().unwrap();
    assert_eq!(last.kind(), Kind::Finished, "{events:#?}");
    assert!(last.message.starts_with("succeeded"), "{events:#?}");
    assert_eq!(wire::images_with(&events, Kind::Built), vec!["web", "worker"]);
    assert_eq!(farm.builds(), 2);

    let events = wire::up(&farm.url, &dir, false).await;
    assert_eq!(wire::images_with(&events, Kind::Recorded), vec!["web", "worker"], "{events:#?}");
    assert_eq!(farm.builds(), 2, "a no-op converge sends no build to Docker");
    farm.stop().await;
    let (req, _) = wire::up_request(&dir, false);
    for image in req.images.iter().filter(|i| !i.context_digest.is_empty()) {
        docker::remove(&image.reference);
    }
}
