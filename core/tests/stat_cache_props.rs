//! Property: digesting with the stat cache and without it agree, over random trees and random
//! edits — rewrites, same-size edits with the mtime forced back (`utimensat`), renames, mode flips,
//! symlink retargets, deletions — applied both after the cache settled and inside its racy window.

use filetime::FileTime;
use kiln_core::digest::{cache_file_for, digest_dir, digest_dir_cached, WalkOptions};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::Duration;

#[derive(Clone, Debug)]
enum Op {
    Rewrite(usize, Vec<u8>),
    /// Same size, other bytes, mtime put back: only the ctime (and the racy rule) can tell.
    SameSizeSameMtime(usize),
    Rename(usize, String),
    FlipExec(usize),
    Retarget(usize, usize),
    Delete(usize),
}

fn file_name() -> impl Strategy<Value = String> {
    ("[a-c]", "[a-e]{1,3}").prop_map(|(dir, name)| format!("{dir}/{name}"))
}

fn tree() -> impl Strategy<Value = BTreeMap<String, (Vec<u8>, bool)>> {
    prop::collection::btree_map(file_name(), (prop::collection::vec(any::<u8>(), 0..48), any::<bool>()), 1..10)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<usize>(), prop::collection::vec(any::<u8>(), 0..48)).prop_map(|(i, c)| Op::Rewrite(i, c)),
        any::<usize>().prop_map(Op::SameSizeSameMtime),
        (any::<usize>(), file_name()).prop_map(|(i, n)| Op::Rename(i, n)),
        any::<usize>().prop_map(Op::FlipExec),
        (any::<usize>(), any::<usize>()).prop_map(|(l, t)| Op::Retarget(l, t)),
        any::<usize>().prop_map(Op::Delete),
    ]
}

fn files(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["a", "b", "c"] {
        if let Ok(items) = fs::read_dir(root.join(dir)) {
            for item in items.flatten() {
                if item.file_type().unwrap().is_file() {
                    out.push(format!("{dir}/{}", item.file_name().to_string_lossy()));
                }
            }
        }
    }
    out.sort();
    out
}

fn apply(root: &Path, op: &Op) {
    let present = files(root);
    if present.is_empty() {
        return;
    }
    let pick = |i: usize| root.join(&present[i % present.len()]);
    match op {
        Op::Rewrite(i, content) => fs::write(pick(*i), content).unwrap(),
        Op::SameSizeSameMtime(i) => {
            let path = pick(*i);
            let meta = fs::metadata(&path).unwrap();
            let flipped: Vec<u8> = fs::read(&path).unwrap().iter().map(|b| b ^ 0xa5).collect();
            fs::write(&path, flipped).unwrap();
            filetime::set_file_mtime(&path, FileTime::from_last_modification_time(&meta)).unwrap();
        }
        Op::Rename(i, name) => {
            let to = root.join(name);
            if !to.exists() {
                fs::create_dir_all(to.parent().unwrap()).unwrap();
                fs::rename(pick(*i), to).unwrap();
            }
        }
        Op::FlipExec(i) => {
            let path = pick(*i);
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            fs::set_permissions(&path, fs::Permissions::from_mode(mode ^ 0o111)).unwrap();
        }
        Op::Retarget(l, t) => {
            let link = root.join(format!("link{}", l % 3));
            let _ = fs::remove_file(&link);
            symlink(&present[t % present.len()], link).unwrap();
        }
        Op::Delete(i) => fs::remove_file(pick(*i)).unwrap(),
    }
}

fn build(root: &Path, tree: &BTreeMap<String, (Vec<u8>, bool)>) {
    for (path, (content, exec)) in tree {
        let p = root.join(path);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, content).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(if *exec { 0o755 } else { 0o644 })).unwrap();
    }
    symlink(tree.keys().next().unwrap(), root.join("link0")).unwrap();
}

/// Both ways, and the cached one must have recalled every file the edits left alone.
fn check(root: &Path, cache: &Path, untouched_at_least: usize) -> Result<(), TestCaseError> {
    let (_, cached, _) = digest_dir_cached(root, &WalkOptions::default(), cache).unwrap();
    let (_, plain) = digest_dir(root, &WalkOptions::default()).unwrap();
    prop_assert_eq!(cached.digest, plain);
    prop_assert!(cached.recalled >= untouched_at_least, "recalled {} < {}", cached.recalled, untouched_at_least);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn hashing_with_and_without_the_cache_agrees(
        initial in tree(),
        settled_edits in prop::collection::vec(op(), 0..6),
        racy_edits in prop::collection::vec(op(), 1..4),
    ) {
        let ctx = tempfile::tempdir().unwrap();
        let home = tempfile::tempdir().unwrap();
        let root = ctx.path();
        build(root, &initial);
        let cache = cache_file_for(home.path(), root);
        // Past the racy window, so that the first cache can vouch for files (ctimes cannot be
        // set back; only waiting makes a file settled).
        std::thread::sleep(Duration::from_millis(150));
        check(root, &cache, 0)?;
        let before = files(root);
        for op in &settled_edits {
            apply(root, op);
        }
        // Every op touches at most one file (a rename: two paths), so at least this many files
        // are as the cache saw them.
        let untouched = before.len().saturating_sub(2 * settled_edits.len());
        check(root, &cache, untouched)?;
        // Edits right after a cache write: inside its racy window.
        for op in &racy_edits {
            apply(root, op);
        }
        check(root, &cache, 0)?;
        check(root, &cache, 0)?;
    }
}
