//! The tree digest's conformance vectors (`kiln_core::digest::vectors`): each tree digests to its
//! pinned value through the walk, through an independent encoding of DESIGN.md's spec written
//! here from the bytes up, and through a pack → verify → unpack round trip.

use kiln_core::archive;
use kiln_core::digest::vectors::VECTORS;
use kiln_core::digest::{digest_dir, walk_tree, EntryKind, TreeDigest, WalkOptions, TREE_DIGEST_CONTEXT};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn built(build: fn(&Path) -> std::io::Result<()>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path()).unwrap();
    dir
}

/// DESIGN.md's v2 stream, encoded without `StreamHasher`: the entry list comes from the walk (what
/// is listed is the walk's business, tested in digest.rs), every byte of the encoding from here.
fn by_the_spec(root: &Path) -> TreeDigest {
    let tree = walk_tree(root, &WalkOptions::default()).unwrap();
    let mut h = blake3::Hasher::new_derive_key(TREE_DIGEST_CONTEXT);
    for e in &tree.entries {
        let kind = match e.kind {
            EntryKind::Dir => b'd',
            EntryKind::File => b'f',
            EntryKind::ExecFile => b'x',
            EntryKind::Symlink => b'l',
        };
        h.update(&[kind]).update(&(e.path.len() as u64).to_le_bytes()).update(&e.path);
        match e.kind {
            EntryKind::Dir => {}
            EntryKind::Symlink => {
                h.update(&(e.link_target.len() as u64).to_le_bytes()).update(&e.link_target);
            }
            EntryKind::File | EntryKind::ExecFile => {
                let content = fs::read(root.join(std::ffi::OsStr::from_bytes(&e.path))).unwrap();
                h.update(&(content.len() as u64).to_le_bytes()).update(blake3::hash(&content).as_bytes());
            }
        }
    }
    TreeDigest(*h.finalize().as_bytes())
}

#[test]
fn every_vector_digests_to_its_pinned_value() {
    let mut wrong = Vec::new();
    for v in VECTORS {
        let dir = built(v.build);
        let (_, digest) = digest_dir(dir.path(), &WalkOptions::default()).unwrap();
        if digest.to_string() != v.digest {
            wrong.push(format!("{}: pinned {:?}, computed {digest}", v.name, v.digest));
        }
    }
    assert!(wrong.is_empty(), "digests differ from the pinned vectors:\n{}", wrong.join("\n"));
}

#[test]
fn the_pinned_values_follow_from_the_spec_alone() {
    for v in VECTORS {
        let dir = built(v.build);
        assert_eq!(by_the_spec(dir.path()).to_string(), v.digest, "vector {}", v.name);
    }
}

#[test]
fn every_vector_survives_pack_verify_and_unpack() {
    for v in VECTORS {
        let dir = built(v.build);
        let (tree, digest) = digest_dir(dir.path(), &WalkOptions::default()).unwrap();
        let mut bytes = Vec::new();
        let packed = archive::pack(&tree, &mut bytes).unwrap();
        assert_eq!(packed.digest, digest, "vector {}: pack hashed other bytes", v.name);
        assert_eq!(archive::verify(&bytes[..], &digest).unwrap().digest, digest, "vector {}", v.name);
        let out = tempfile::tempdir().unwrap();
        let target = out.path().join("ctx");
        archive::unpack(&bytes[..], &target, Some(&digest)).unwrap();
        // The unpacked tree digests the same, so the walk and the archive reader agree.
        let (_, again) = digest_dir(&target, &WalkOptions::default()).unwrap();
        assert_eq!(again, digest, "vector {}", v.name);
    }
}

#[test]
fn the_vectors_are_distinct_trees() {
    let mut seen: Vec<&str> = VECTORS.iter().map(|v| v.digest).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), VECTORS.len());
}
