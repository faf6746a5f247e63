//! Property: the walk lists exactly the tree's paths, in strictly increasing byte order, whatever
//! the names — in particular names around `/` in byte order (`a-b`, `a.c` before `a/…`; `a0`
//! after), which a walk that sorts each directory on its own must still place right.

use kiln_core::digest::{walk_tree, WalkOptions};
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;

fn component() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(vec![&b"a"[..], b"a-b", b"a.c", b"a0", b"b", b"\xff", b"A"]).prop_map(|c| c.to_vec())
}

proptest! {
    #[test]
    fn the_walk_lists_every_path_in_byte_order(files in prop::collection::vec(prop::collection::vec(component(), 1..4), 1..20)) {
        let dir = tempfile::tempdir().unwrap();
        let mut want = BTreeSet::new();
        for parts in &files {
            let path = parts.join(&b'/');
            let on_disk = dir.path().join(OsStr::from_bytes(&path));
            // A name already used as a file cannot also be a directory: skip the clash.
            if fs::create_dir_all(on_disk.parent().unwrap()).is_err() || on_disk.is_dir() {
                continue;
            }
            if fs::write(&on_disk, b"x").is_ok() {
                for end in 1..=parts.len() {
                    want.insert(parts[..end].join(&b'/'));
                }
            }
        }
        let tree = walk_tree(dir.path(), &WalkOptions::default()).unwrap();
        let got: Vec<Vec<u8>> = tree.entries.iter().map(|e| e.path.clone()).collect();
        prop_assert!(got.windows(2).all(|w| w[0] < w[1]), "not strictly increasing: {:?}", got);
        let want: Vec<Vec<u8>> = want.into_iter().collect();
        prop_assert_eq!(got, want);
    }
}
