//! File-level why (issue 14), end to end: `kiln up` and `kiln why` as a user runs them, against a
//! served coordinator with a simulated build host (`kiln_e2e::sim`: real gRPC, real uploads and
//! verification, no Docker — no real build is needed to say what moved). The recorded entry list
//! is the coordinator's, kept from the upload it verified: `kiln why` works from a CLI that never
//! walked the recorded tree (its stat cache is off here, and a served coordinator has no other).

use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use kiln::event::Event;
use kiln::{Connect, EventKind, OutputMode, UpArgs, WhyArgs, WhyView};
use kiln_e2e::sim::{write_instance, SimFarm};

async fn up(url: &str, dir: &Path) -> Vec<Event> {
    let args = UpArgs { connect: Connect::remote(url), output: OutputMode::Quiet, ..UpArgs::new(dir) };
    let outcome = kiln::up(args).await.unwrap();
    assert_eq!(outcome.failure, None, "{:#?}", outcome.events);
    outcome.events
}

async fn why(url: &str, dir: &Path, since: Option<u64>) -> Result<WhyView, kiln::CliError> {
    let connect = Connect::remote(url);
    kiln::why(WhyArgs { image: "web".into(), dir: dir.to_path_buf(), since, connect, output: OutputMode::Quiet }).await
}

fn building(events: &[Event]) -> &Event {
    events.iter().find(|e| e.kind == EventKind::Building && e.image == "web").expect("web was built")
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Each class of the file diff, as `kiln why` lists it: (path, detail).
fn class(view: &WhyView, pick: fn(&kiln::why::FileDiff) -> &Vec<kiln::why::FileMove>) -> Vec<(String, String)> {
    let files = view.changes.iter().find_map(|c| c.files.as_ref()).expect("the files were named");
    pick(files).iter().map(|m| (m.path.clone(), m.detail.clone())).collect()
}

fn pair(path: &str, detail: &str) -> (String, String) {
    (path.to_string(), detail.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn up_names_the_files_that_moved_and_why_lists_every_one_by_how() {
    let farm = SimFarm::start(1, 2, Duration::from_millis(20), |_| {}).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shop");
    write_instance(&dir, "why-shop", None, &[("web", "v1")]);
    let web = dir.join("web");
    write(&web.join("src/main.rs"), "fn main() {}\n");
    write(&web.join("old.txt"), "bye\n");
    write(&web.join("run.sh"), "echo hi\n");
    write(&web.join("lib"), "a file for now\n");
    symlink("src", web.join("current")).unwrap();
    up(&farm.url, &dir).await;

    // Nothing moved: nothing is diffed, and `kiln why` says so in one line.
    let view = why(&farm.url, &dir, None).await.unwrap();
    assert!(!view.moved && view.changes.is_empty(), "{view:#?}");
    assert_eq!(kiln::why::why_text(&view), format!("web: nothing moved since generation 1 ({})\n", view.reference));

    // One added, one changed, one removed: `kiln why` before the converge, then its reason.
    write(&web.join("src/new.rs"), "pub fn new() {}\n");
    write(&web.join("src/main.rs"), "fn main() { new() }\n");
    std::fs::remove_file(web.join("old.txt")).unwrap();
    let view = why(&farm.url, &dir, None).await.unwrap();
    assert_eq!(class(&view, |f| &f.added), vec![pair("src/new.rs", "")]);
    assert_eq!(class(&view, |f| &f.changed), vec![pair("src/main.rs", "13 → 20 bytes")]);
    assert_eq!(class(&view, |f| &f.removed), vec![pair("old.txt", "")]);
    let events = up(&farm.url, &dir).await;
    let built = building(&events);
    assert!(
        built.message.ends_with(": context changed: 3 files (+ src/new.rs, ~ src/main.rs, − old.txt)"),
        "{}",
        built.message
    );
    // Typed, as `--json` carries it.
    let files = built.reason.as_ref().and_then(|r| r.changes[0].files.clone()).expect("files in the reason");
    assert_eq!((files.added.count, files.added.paths.clone()), (1, vec!["src/new.rs".to_string()]));
    assert_eq!((files.removed.count, files.changed.count), (1, 1));
    let json = kiln::render::json::line(built);
    assert!(json.contains(r#""files":{"added":{"count":1,"paths":["src/new.rs"]}"#), "{json}");
    assert!(!why(&farm.url, &dir, None).await.unwrap().moved, "recorded as generation 2");

    // Mode, type, link target, and a build arg — each said apart; --since reaches generation 1.
    std::fs::set_permissions(web.join("run.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::remove_file(web.join("lib")).unwrap();
    write(&web.join("lib/a.rs"), "\n");
    std::fs::remove_file(web.join("current")).unwrap();
    symlink("lib", web.join("current")).unwrap();
    let manifest = std::fs::read_to_string(dir.join("kiln.toml")).unwrap() + "args = { VERSION = \"2\" }\n";
    std::fs::write(dir.join("kiln.toml"), manifest).unwrap();
    let view = why(&farm.url, &dir, None).await.unwrap();
    assert_eq!(view.generation, 2);
    assert_eq!(class(&view, |f| &f.added), vec![pair("lib/a.rs", "")]);
    assert_eq!(class(&view, |f| &f.mode_changed), vec![pair("run.sh", "now executable")]);
    assert_eq!(class(&view, |f| &f.type_changed), vec![pair("lib", "file → dir")]);
    assert_eq!(class(&view, |f| &f.retargeted), vec![pair("current", "src → lib")]);
    assert!(class(&view, |f| &f.changed).is_empty() && class(&view, |f| &f.removed).is_empty());
    let words: Vec<&str> = view.changes.iter().map(|c| c.words.as_str()).collect();
    assert!(words.contains(&"build arg VERSION: (none) → 2"), "{words:?}");
    let text = kiln::why::why_text(&view);
    assert!(text.contains("    symlink retargeted:\n      ~ current (src → lib)\n"), "{text}");

    let since = why(&farm.url, &dir, Some(1)).await.unwrap();
    assert_eq!(since.generation, 1);
    assert_eq!(class(&since, |f| &f.added), vec![pair("lib/a.rs", ""), pair("src/new.rs", "")]);
    assert_eq!(class(&since, |f| &f.removed), vec![pair("old.txt", "")]);
    let err = why(&farm.url, &dir, Some(7)).await.unwrap_err().to_string();
    assert!(
        err.contains("generation 7 of instance why-shop is not kept: its record keeps generations 1 and 2"),
        "{err}"
    );

    let err = kiln::why(WhyArgs {
        image: "nope".into(),
        dir: dir.clone(),
        since: None,
        connect: Connect::remote(farm.url.clone()),
        output: OutputMode::Quiet,
    })
    .await
    .unwrap_err();
    assert_eq!(err.exit(), kiln::Exit::Usage);
    assert!(err.to_string().ends_with("names no built image \"nope\" — its built images: web"), "{err}");
    farm.stop().await;
}
