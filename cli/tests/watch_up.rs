//! `kiln up` with `kiln watch` running, end to end on the real Docker daemon: a no-op converge
//! takes every context's digest from the watcher without walking it, and an edit is still built.
//! One test in its own binary, since it points `KILN_WATCH_SOCKET` at its watcher.

use kiln::{Connect, EventKind, Outcome, OutputMode, UpArgs};
use kiln_core::manifest::Manifest;
use std::path::Path;

fn images(events: &[kiln::Event], kind: EventKind) -> Vec<String> {
    let mut images: Vec<String> = events.iter().filter(|e| e.kind == kind).map(|e| e.image.clone()).collect();
    images.sort();
    images
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_noop_up_walks_nothing_the_watcher_vouches_for_and_an_edit_still_builds() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hello");
    kiln_e2e::fixture::copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/hello"), &dir);
    let manifest_file = dir.join("kiln.toml");
    let text = std::fs::read_to_string(&manifest_file)
        .unwrap()
        .replace("instance = \"hello\"", &format!("instance = \"watch{:08x}\"", fastrand::u32(..)));
    std::fs::write(&manifest_file, text).unwrap();
    let home = tmp.path().join("kiln-home");
    let watcher = kiln::watch::serve(&tmp.path().join("run/watch.sock")).unwrap();
    std::env::set_var("KILN_WATCH_SOCKET", &watcher.socket);
    std::env::remove_var("KILN_WATCH");
    let up = || UpArgs {
        dir: dir.clone(),
        force: false,
        dry_run: false,
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    };

    let first = kiln::up(up()).await.unwrap();
    assert_eq!(first.outcome, Outcome::Succeeded, "{:#?}", first.events);
    assert_eq!(images(&first.events, EventKind::Built), ["web", "worker"]);

    // What `kiln up` plans with: the first converge walked both contexts under the watcher's
    // tags, so now neither is walked (a walked context carries its entry list).
    let stat = kiln::home::stat_cache_dir(true, Some(&home)).unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    let plan = kiln::request::plan_up(&manifest, false, "test", Some(&stat)).unwrap();
    assert_eq!(plan.contexts.len(), 2);
    assert!(plan.contexts.values().all(|c| c.tree.is_none()), "a context the watcher vouches for is not walked");
    let walked = kiln::request::plan_up(&manifest, false, "test", None).unwrap();
    assert_eq!(
        plan.contexts.keys().collect::<Vec<_>>(),
        walked.contexts.keys().collect::<Vec<_>>(),
        "the vouched digests are the digests of a full read"
    );

    let second = kiln::up(up()).await.unwrap();
    assert_eq!(images(&second.events, EventKind::Recorded), ["web", "worker"], "{:#?}", second.events);

    std::fs::write(dir.join("web/index.html"), "<h1>edited while watched</h1>\n").unwrap();
    let third = kiln::up(up()).await.unwrap();
    assert_eq!(images(&third.events, EventKind::Built), ["web"], "{:#?}", third.events);
    assert_eq!(images(&third.events, EventKind::Recorded), ["worker"]);

    // The images go again, so the test leaves nothing on the daemon.
    let down = kiln::down(kiln::DownArgs {
        dir: dir.clone(),
        connect: Connect::embedded_in(&home),
        output: OutputMode::Quiet,
    });
    assert_eq!(down.await.unwrap().run.outcome, Outcome::Succeeded);
    watcher.stop();
}
