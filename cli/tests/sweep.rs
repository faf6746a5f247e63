//! `kiln gc`, `kiln down` and `kiln pin` through the library the binary calls, against the
//! embedded default (the real coordinator and host agent, in-process) and this machine's Docker.

use kiln::{Connect, DownArgs, EventKind, Exit, GcArgs, OutputMode, PinArgs, UpArgs};
use std::path::{Path, PathBuf};
use std::process::Command;

/// examples/hello under a unique instance name; `kiln refs` computes its content refs.
fn hello(into: &Path) -> PathBuf {
    let dir = into.join("hello");
    kiln_e2e::fixture::copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/hello"), &dir);
    let manifest = dir.join("kiln.toml");
    let instance = format!("clisw{:08x}", fastrand::u32(..));
    let text = std::fs::read_to_string(&manifest)
        .unwrap()
        .replace("instance = \"hello\"", &format!("instance = \"{instance}\""));
    std::fs::write(&manifest, text).unwrap();
    dir
}

fn present(reference: &str) -> bool {
    Command::new("docker").args(["image", "inspect", reference]).output().unwrap().status.success()
}

async fn up(dir: &Path, home: &Path) -> kiln::UpOutcome {
    let args = UpArgs {
        dir: dir.to_path_buf(),
        force: false,
        dry_run: false,
        connect: Connect::embedded_in(home),
        output: OutputMode::Quiet,
    };
    kiln::up(args).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_dry_run_plans_and_down_removes_the_instances_images() {
    let tmp = tempfile::tempdir().unwrap();
    let home = tmp.path().join("kiln-home");
    let dir = hello(tmp.path());
    assert_eq!(up(&dir, &home).await.exit(), Exit::Converged);
    let first_web = kiln_e2e::fixture::reference(&dir, "web");
    std::fs::write(dir.join("web/index.html"), "<p>edited</p>\n").unwrap();
    assert_eq!(up(&dir, &home).await.exit(), Exit::Converged);
    let (web, worker) = (kiln_e2e::fixture::reference(&dir, "web"), kiln_e2e::fixture::reference(&dir, "worker"));

    // Pinned images are kept by every sweep, down included.
    let pinned = kiln::pin(PinArgs {
        reference: first_web.clone(),
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    })
    .await
    .unwrap();
    assert!(pinned.changed);

    let plan = kiln::gc(GcArgs {
        dry_run: true,
        instance: None,
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    })
    .await
    .unwrap();
    assert_eq!(plan.run.exit(), Exit::Converged);
    assert!(plan.refs().is_empty(), "the record and its grace generation keep everything: {:#?}", plan.stores);

    let down =
        kiln::down(DownArgs { dir: dir.clone(), connect: Connect::embedded_in(&home), output: OutputMode::Quiet })
            .await
            .unwrap();
    assert_eq!(down.run.exit(), Exit::Converged, "{:#?}", down.run.events);
    assert!(down.run.events.iter().any(|e| e.kind == EventKind::RecordDeleted));
    let mut expected = vec![web.clone(), worker.clone()];
    expected.sort();
    assert_eq!(down.refs(), expected, "its images go, except the pinned one");
    assert_eq!(down.stores.len(), 1);
    let owner = down.stores[0].owners.keys().next().unwrap();
    assert!(owner.starts_with("clisw"), "bytes are counted per instance: {:#?}", down.stores);
    assert!(!present(&web) && !present(&worker));
    assert!(present(&first_web), "the pin kept it");

    let unpinned = kiln::unpin(PinArgs {
        reference: first_web.clone(),
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    })
    .await
    .unwrap();
    assert!(unpinned.changed && unpinned.pins.is_empty());
    let gc = kiln::gc(GcArgs { connect: Connect::embedded_in(&home), output: OutputMode::Quiet, ..GcArgs::default() })
        .await
        .unwrap();
    assert_eq!(gc.refs(), vec![first_web.clone()]);
    assert!(!present(&first_web));
}
