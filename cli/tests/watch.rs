//! `kiln watch` against the real kernel: a real inotify watcher answering on a real Unix socket,
//! trees changed the ways editors, build tools and people change them, and the one property that
//! matters — a digest the watcher vouched for is the digest a full read computes, after every change.

use filetime::FileTime;
use kiln::watch::{ask, serve, WatcherHandle};
use kiln_core::digest::{cache_file_for, digest_dir, digest_dir_vouched, WalkOptions};
use proptest::prelude::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

fn watcher(tmp: &Path) -> WatcherHandle {
    serve(&tmp.join("run/watch.sock")).unwrap()
}

fn tag(w: &WatcherHandle, root: &Path) -> Vec<u8> {
    let root = fs::canonicalize(root).unwrap();
    ask(&w.socket, &[(root, None)]).unwrap().pop().unwrap().expect("the context is watched")
}

fn tree(tmp: &Path) -> PathBuf {
    let root = tmp.join("ctx");
    fs::create_dir_all(root.join("src/deep")).unwrap();
    fs::write(root.join("Dockerfile"), "FROM scratch\nCOPY . /\n").unwrap();
    fs::write(root.join("src/main.rs"), "fn main() {}\n").unwrap();
    fs::write(root.join("src/deep/data"), "0123456789").unwrap();
    std::os::unix::fs::symlink("main.rs", root.join("src/link")).unwrap();
    root
}

/// One way of changing a tree, run once.
type Change = Box<dyn Fn()>;

/// Each change, made after a question, moves the tag; asking again without a change does not.
#[test]
fn every_kind_of_change_moves_the_tag_and_nothing_else_does() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tree(tmp.path());
    let w = watcher(tmp.path());
    let r = root.clone();
    let changes: Vec<(&str, Change)> = vec![
        ("same-size write", Box::new(move || fs::write(r.join("src/deep/data"), "9876543210").unwrap())),
        ("chmod +x", {
            let r = root.clone();
            Box::new(move || fs::set_permissions(r.join("src/main.rs"), fs::Permissions::from_mode(0o755)).unwrap())
        }),
        ("mtime put back", {
            let r = root.clone();
            Box::new(move || filetime::set_file_mtime(r.join("src/main.rs"), FileTime::from_unix_time(1, 0)).unwrap())
        }),
        ("new file", {
            let r = root.clone();
            Box::new(move || fs::write(r.join("new.txt"), "n").unwrap())
        }),
        ("rename", {
            let r = root.clone();
            Box::new(move || fs::rename(r.join("new.txt"), r.join("src/deep/moved.txt")).unwrap())
        }),
        ("delete", {
            let r = root.clone();
            Box::new(move || fs::remove_file(r.join("src/deep/moved.txt")).unwrap())
        }),
        ("symlink retargeted", {
            let r = root.clone();
            Box::new(move || {
                fs::remove_file(r.join("src/link")).unwrap();
                std::os::unix::fs::symlink("deep/data", r.join("src/link")).unwrap();
            })
        }),
        ("new directory", {
            let r = root.clone();
            Box::new(move || fs::create_dir(r.join("fresh")).unwrap())
        }),
        // The watch on `fresh` was added when the last question found the tree stale.
        ("write inside the new directory", {
            let r = root.clone();
            Box::new(move || fs::write(r.join("fresh/inner"), "i").unwrap())
        }),
        ("atomic save (write a temp file, rename over)", {
            let r = root.clone();
            Box::new(move || {
                fs::write(r.join("src/.main.rs.swp"), "fn main() { 1; }\n").unwrap();
                fs::rename(r.join("src/.main.rs.swp"), r.join("src/main.rs")).unwrap();
            })
        }),
        ("directory removed", {
            let r = root.clone();
            Box::new(move || fs::remove_dir_all(r.join("fresh")).unwrap())
        }),
        ("a directory moved in from outside, then written in", {
            let (r, outside) = (root.clone(), tmp.path().join("outside"));
            Box::new(move || {
                fs::create_dir_all(outside.join("sub")).unwrap();
                fs::rename(&outside, r.join("adopted")).unwrap();
            })
        }),
        ("write deep inside the adopted directory", {
            let r = root.clone();
            Box::new(move || fs::write(r.join("adopted/sub/x"), "x").unwrap())
        }),
    ];
    let mut before = tag(&w, &root);
    for (what, change) in changes {
        assert_eq!(tag(&w, &root), before, "asked again with nothing changed, before: {what}");
        change();
        let after = tag(&w, &root);
        assert_ne!(after, before, "the tag did not move after: {what}");
        before = after;
    }
}

#[test]
fn a_context_replaced_under_its_path_or_a_restarted_watcher_never_repeats_a_tag() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tree(tmp.path());
    let w = watcher(tmp.path());
    let first = tag(&w, &root);
    // The whole folder swapped for a copy: the old watches follow the old directory.
    fs::rename(&root, tmp.path().join("old")).unwrap();
    tree(tmp.path());
    let swapped = tag(&w, &root);
    assert_ne!(swapped, first);
    fs::write(tmp.path().join("old/src/main.rs"), "changed in the old copy").unwrap();
    let _ = tag(&w, &root);
    fs::write(root.join("src/main.rs"), "changed in the new one").unwrap();
    assert_ne!(tag(&w, &root), swapped, "the new directory is the one watched");

    let now = tag(&w, &root);
    w.stop();
    let again = watcher(tmp.path());
    assert_ne!(tag(&again, &root), now, "a tag of the watcher before is never one of this one");
}

#[test]
fn what_cannot_be_watched_is_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let w = watcher(tmp.path());
    let file = tmp.path().join("plain");
    fs::write(&file, "x").unwrap();
    let contexts = [PathBuf::from("/proc/sys"), file.clone(), tmp.path().join("missing")].map(|p| (p, None));
    let answers = ask(&w.socket, &contexts).unwrap();
    let why: Vec<String> = answers.into_iter().map(|a| a.expect_err("refused")).collect();
    assert!(why[0].contains("filesystem"), "{}", why[0]);
    assert!(why[1].contains("not a directory"), "{}", why[1]);
    assert!(why[2].contains("cannot read"), "{}", why[2]);
    assert!(ask(&w.socket, &[(PathBuf::from("relative/ctx"), None)]).unwrap()[0].is_err());
}

#[test]
fn what_the_walk_leaves_out_moves_nothing_until_the_dockerignore_says_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tree(tmp.path());
    fs::create_dir_all(root.join("target/debug")).unwrap();
    fs::write(root.join(".dockerignore"), "target\n**/*.log\n").unwrap();
    let w = watcher(tmp.path());
    let before = tag(&w, &root);
    // A build writing its output, and a log beside the sources: no walk reads either.
    fs::create_dir_all(root.join("target/debug/deps")).unwrap();
    fs::write(root.join("target/debug/deps/out.o"), "object").unwrap();
    fs::write(root.join("src/run.log"), "log line").unwrap();
    assert_eq!(tag(&w, &root), before, "changes the walk never reads leave the tag alone");
    let watches_before = w.watcher.counts().1;
    fs::write(root.join(".dockerignore"), "**/*.log\n").unwrap();
    let after = tag(&w, &root);
    assert_ne!(after, before, "new ignore rules are a change");
    assert!(w.watcher.counts().1 > watches_before, "target/ is watched now that the walk reads it");
    fs::write(root.join("target/debug/deps/out.o"), "object, rebuilt").unwrap();
    assert_ne!(tag(&w, &root), after, "target/ is part of the context now");
    // The Dockerfile a walk keeps whatever the patterns say is watched for a context walked so.
    fs::write(root.join(".dockerignore"), "**/*.log\nci/\n").unwrap();
    fs::create_dir_all(root.join("ci")).unwrap();
    fs::write(root.join("ci/Dockerfile"), "FROM scratch\n").unwrap();
    let kept = (fs::canonicalize(&root).unwrap(), Some("ci/Dockerfile".to_string()));
    let first = ask(&w.socket, std::slice::from_ref(&kept)).unwrap().pop().unwrap().unwrap();
    fs::write(root.join("ci/Dockerfile"), "FROM scratch\nCOPY . /\n").unwrap();
    let second = ask(&w.socket, std::slice::from_ref(&kept)).unwrap().pop().unwrap().unwrap();
    assert_ne!(first, second, "the kept Dockerfile under an excluded folder is watched");
}

#[test]
fn a_second_watcher_on_a_live_socket_is_refused_and_a_dead_ones_socket_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let w = watcher(tmp.path());
    let err = serve(&w.socket).unwrap_err();
    assert!(err.to_string().contains("already answers"), "{err}");
    assert!(ask(&w.socket, &[]).is_ok(), "the first still answers");
    // A killed watcher leaves its socket file behind; nobody answers on it.
    let stale = tmp.path().join("stale/watch.sock");
    fs::create_dir_all(stale.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let taken = serve(&stale).unwrap();
    let root = tree(tmp.path());
    assert!(ask(&taken.socket, &[(fs::canonicalize(root).unwrap(), None)]).unwrap()[0].is_ok());
    let mode = fs::metadata(&stale).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "only its user may connect");
    // A folder the watcher makes is its user's alone; one that exists is left as it is.
    let made = tmp.path().join("fresh/run/watch.sock");
    let fresh = serve(&made).unwrap();
    assert_eq!(fs::metadata(made.parent().unwrap()).unwrap().permissions().mode() & 0o777, 0o700);
    fresh.stop();
    let shared = tmp.path().join("shared");
    fs::create_dir(&shared).unwrap();
    fs::set_permissions(&shared, fs::Permissions::from_mode(0o755)).unwrap();
    let beside = serve(&shared.join("watch.sock")).unwrap();
    assert_eq!(fs::metadata(&shared).unwrap().permissions().mode() & 0o777, 0o755, "an existing folder is not changed");
    beside.stop();
}

/// `digest_dir_vouched` as `kiln up` runs it: the tag asked first, then the vouched result or a
/// walk. Returns the digest and whether a walk happened.
fn vouched_digest(w: &WatcherHandle, root: &Path, cache: &Path) -> (String, bool) {
    let t = tag(w, root);
    let file = cache_file_for(cache, root);
    let (tree, summary) = digest_dir_vouched(root, &WalkOptions::default(), &file, Some(&t)).unwrap();
    (summary.digest.to_string(), tree.is_some())
}

#[test]
fn an_unchanged_tree_is_not_walked_and_a_tree_with_hard_links_always_is() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tree(tmp.path());
    let cache = tmp.path().join("stat");
    let w = watcher(tmp.path());
    let (first, walked) = vouched_digest(&w, &root, &cache);
    assert!(walked, "the first digest walks");
    let (second, walked) = vouched_digest(&w, &root, &cache);
    assert_eq!(second, first);
    assert!(!walked, "nothing changed: the vouched result is taken");
    fs::write(root.join("src/main.rs"), "edited").unwrap();
    let (third, walked) = vouched_digest(&w, &root, &cache);
    assert!(walked);
    assert_ne!(third, first);
    assert_eq!(third, digest_dir(&root, &WalkOptions::default()).unwrap().1.to_string());

    // A second name outside the tree could change the file without an event in it.
    fs::hard_link(root.join("src/main.rs"), tmp.path().join("alias")).unwrap();
    for _ in 0..2 {
        let (_, walked) = vouched_digest(&w, &root, &cache);
        assert!(walked, "a tree with a hard-linked file is walked every time");
    }
    fs::write(tmp.path().join("alias"), "changed through the other name").unwrap();
    let (now, _) = vouched_digest(&w, &root, &cache);
    assert_eq!(now, digest_dir(&root, &WalkOptions::default()).unwrap().1.to_string());
}

#[derive(Clone, Debug)]
enum Edit {
    Write(usize, Vec<u8>),
    /// New bytes of the same length, with the old mtime put back (`utimensat`).
    SameSizeSameMtime(usize),
    Chmod(usize),
    Remove(usize),
    Rename(usize, usize),
    Mkdir(usize),
    Retarget(usize),
    /// Rewrites `.dockerignore` with one of a few rule sets (excluding a folder, a name pattern,
    /// with and without exceptions, or nothing).
    Ignore(usize),
}

const IGNORES: [&str; 4] = ["d3\n", "*7\n!d2/f7\n", "d1\n!d1/f5\n", ""];

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (0..12usize, proptest::collection::vec(any::<u8>(), 0..64)).prop_map(|(i, b)| Edit::Write(i, b)),
        (0..12usize).prop_map(Edit::SameSizeSameMtime),
        (0..12usize).prop_map(Edit::Chmod),
        (0..12usize).prop_map(Edit::Remove),
        (0..12usize, 0..12usize).prop_map(|(a, b)| Edit::Rename(a, b)),
        (0..4usize).prop_map(Edit::Mkdir),
        (0..12usize).prop_map(Edit::Retarget),
        (0..IGNORES.len()).prop_map(Edit::Ignore),
    ]
}

/// File `i` of the property's tree: spread over the root and three directories that may not
/// exist yet.
fn nth(root: &Path, i: usize) -> PathBuf {
    match i % 4 {
        0 => root.join(format!("f{i}")),
        d => root.join(format!("d{d}/f{i}")),
    }
}

fn apply(root: &Path, e: &Edit) {
    let _ = match e {
        Edit::Write(i, bytes) => {
            fs::create_dir_all(nth(root, *i).parent().unwrap()).and_then(|()| fs::write(nth(root, *i), bytes))
        }
        Edit::SameSizeSameMtime(i) => {
            let path = nth(root, *i);
            fs::read(&path).and_then(|old| {
                let mtime = FileTime::from_last_modification_time(&fs::metadata(&path)?);
                fs::write(&path, old.iter().map(|b| b.wrapping_add(1)).collect::<Vec<u8>>())?;
                filetime::set_file_mtime(&path, mtime)
            })
        }
        Edit::Chmod(i) => fs::metadata(nth(root, *i)).and_then(|m| {
            let mode = m.permissions().mode() ^ 0o100;
            fs::set_permissions(nth(root, *i), fs::Permissions::from_mode(mode))
        }),
        Edit::Remove(i) => fs::remove_file(nth(root, *i)),
        Edit::Rename(a, b) => fs::rename(nth(root, *a), nth(root, *b)),
        Edit::Mkdir(d) => fs::create_dir_all(root.join(format!("d{d}"))),
        Edit::Retarget(i) => {
            let link = root.join("link");
            let _ = fs::remove_file(&link);
            std::os::unix::fs::symlink(format!("f{i}"), link)
        }
        Edit::Ignore(k) => fs::write(root.join(".dockerignore"), IGNORES[*k]),
    };
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// The property: after any sequence of edits, the digest through the watcher is the digest of
    /// a full read — whether it walked or took the vouched result.
    #[test]
    fn the_watched_digest_is_always_the_full_digest(edits in proptest::collection::vec(edit(), 1..24)) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ctx");
        fs::create_dir_all(root.join("d1")).unwrap();
        for i in 0..12 {
            apply(&root, &Edit::Write(i, vec![i as u8; i]));
        }
        apply(&root, &Edit::Ignore(0));
        let cache = tmp.path().join("stat");
        let w = watcher(tmp.path());
        for e in &edits {
            apply(&root, e);
            let (got, _) = vouched_digest(&w, &root, &cache);
            let full = digest_dir(&root, &WalkOptions::default()).unwrap().1.to_string();
            prop_assert_eq!(&got, &full, "after {:?}", e);
            let (again, walked) = vouched_digest(&w, &root, &cache);
            prop_assert_eq!(&again, &full);
            prop_assert!(!walked, "nothing changed between the two: the second is vouched for");
        }
    }
}
