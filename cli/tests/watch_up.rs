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

    // Against served coordinators the stat caches are the user's, shared by every farm: a tree
    // vouched for after a converge on one farm is not walked for the next farm either, and that
    // farm, which lacks the context, still gets it whole (the upload walks it then).
    std::env::set_var("XDG_CACHE_HOME", tmp.path().join("cache"));
    let served = |farm: &kiln_e2e::Farm| UpArgs { connect: Connect::remote(&farm.url), ..up() };
    let mut first_farm = kiln_e2e::Farm::start(&tmp.path().join("farm-a")).await;
    let on_a = kiln::up(served(&first_farm)).await.unwrap();
    assert_eq!(on_a.outcome, Outcome::Succeeded, "{:#?}", on_a.events);
    first_farm.stop().await;
    // Its images go, so the second farm must build, and so needs the contexts.
    kiln_e2e::fixture::remove_built(&dir);
    let user_stat = kiln::home::stat_cache_dir(false, None).unwrap();
    let plan = kiln::request::plan_up(&manifest, false, "test", Some(&user_stat)).unwrap();
    assert!(plan.contexts.values().all(|c| c.tree.is_none()), "vouched for after the converge on the first farm");
    let mut second_farm = kiln_e2e::Farm::start(&tmp.path().join("farm-b")).await;
    let on_b = kiln::up(served(&second_farm)).await.unwrap();
    assert_eq!(on_b.outcome, Outcome::Succeeded, "{:#?}", on_b.events);
    assert!(
        on_b.events.iter().any(|e| e.kind == EventKind::NeedContexts),
        "the second farm asked for the contexts it lacks: {:#?}",
        on_b.events
    );
    assert_eq!(images(&on_b.events, EventKind::Built), ["web", "worker"]);
    second_farm.stop().await;
    kiln_e2e::fixture::remove_built(&dir);
    watcher.stop();
}
