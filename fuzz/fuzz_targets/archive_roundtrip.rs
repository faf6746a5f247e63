//! Structured input (`arbitrary`) building a tree in a scratch directory → `pack` → `unpack` →
//! the same tree digest and the same entries, file contents and modes included.
//!
//! Names come from a small pool so that entries collide, nest and get ignored: long ones (pax
//! `path` records), a non-UTF-8 one, `Dockerfile` and `.dockerignore`; link targets from a pool
//! that climbs, descends, escapes and outgrows ustar's 100-byte field.
#![no_main]

use arbitrary::Arbitrary;
use kiln_core::archive::{pack, unpack, verify};
use kiln_core::digest::{digest_dir, walk_tree, EntryKind, WalkOptions};
use kiln_fuzz::{empty_dir, join, list_tree, scratch, Found};
use libfuzzer_sys::fuzz_target;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::OnceLock;

#[derive(Arbitrary, Debug)]
struct Input {
    entries: Vec<Spec>,
    ignore: Vec<u8>,
    dockerfile: Option<u8>,
}

#[derive(Arbitrary, Debug)]
struct Spec {
    path: Vec<u8>,
    kind: Kind,
}

#[derive(Arbitrary, Debug)]
enum Kind {
    File { content: Vec<u8>, exec: bool },
    Dir,
    Symlink { target: u8 },
}

fn names() -> &'static [Vec<u8>] {
    static NAMES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    NAMES.get_or_init(|| {
        vec![
            b"a".to_vec(),
            b"b".to_vec(),
            b"src".to_vec(),
            b"Dockerfile".to_vec(),
            b"x.txt".to_vec(),
            b"\xffraw".to_vec(),
            b"caf\xc3\xa9".to_vec(),
            b"-".to_vec(),
            vec![b'n'; 99],
            vec![b'm'; 120],
        ]
    })
}

fn link_targets() -> &'static [Vec<u8>] {
    static TARGETS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    TARGETS.get_or_init(|| {
        let mut long = b"../".repeat(1);
        long.extend(vec![b'l'; 130]);
        vec![
            b"a".to_vec(),
            b"../a".to_vec(),
            b"./b/src".to_vec(),
            b"../../x.txt".to_vec(),
            b"a/../b".to_vec(),
            b"/etc/passwd".to_vec(),
            long,
            b"".to_vec(),
        ]
    })
}

const IGNORE_LINES: &[&str] =
    &["a", "!a/b", "**/b", "*.txt", "src", "!src/Dockerfile", "b/**", "Dockerfile", ".dockerignore", "[ab]", "#x"];

struct Dirs {
    _dir: tempfile::TempDir,
    tree: PathBuf,
    out: PathBuf,
}

fn dirs() -> &'static Dirs {
    static DIRS: OnceLock<Dirs> = OnceLock::new();
    DIRS.get_or_init(|| {
        let dir = scratch();
        let tree = dir.path().join("tree");
        let out = dir.path().join("out");
        fs::create_dir(&tree).unwrap();
        fs::create_dir(&out).unwrap();
        Dirs { _dir: dir, tree, out }
    })
}

fuzz_target!(|input: Input| {
    let dirs = dirs();
    build(&dirs.tree, &input);
    roundtrip(dirs, &input);
    empty_dir(&dirs.tree);
    empty_dir(&dirs.out);
});

fn build(root: &std::path::Path, input: &Input) {
    for spec in input.entries.iter().take(24) {
        let parts: Vec<&[u8]> =
            spec.path.iter().take(4).map(|&i| names()[i as usize % names().len()].as_slice()).collect();
        if parts.is_empty() {
            continue;
        }
        let rel = parts.join(&b'/');
        let on_disk = join(root, &rel);
        if fs::symlink_metadata(&on_disk).is_ok() {
            continue;
        }
        // A parent that is a file or a link makes the entry impossible: skip it.
        if let Some(parent) = on_disk.parent() {
            if fs::create_dir_all(parent).is_err() {
                continue;
            }
        }
        let _ = match &spec.kind {
            Kind::File { content, exec } => fs::write(&on_disk, content).and_then(|()| {
                let mode = if *exec { 0o755 } else { 0o644 };
                fs::set_permissions(&on_disk, fs::Permissions::from_mode(mode))
            }),
            Kind::Dir => fs::create_dir(&on_disk),
            Kind::Symlink { target } => {
                let target = &link_targets()[*target as usize % link_targets().len()];
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(target), &on_disk)
            }
        };
    }
    if !input.ignore.is_empty() {
        let text: Vec<&str> =
            input.ignore.iter().take(6).map(|&i| IGNORE_LINES[i as usize % IGNORE_LINES.len()]).collect();
        let _ = fs::write(root.join(".dockerignore"), text.join("\n"));
    }
}

fn roundtrip(dirs: &Dirs, input: &Input) {
    let options = WalkOptions {
        dockerfile: input.dockerfile.map(|i| if i % 2 == 0 { "Dockerfile" } else { "src/Dockerfile" }.to_string()),
    };
    // A tree the walk refuses (a link out of the root, a bad .dockerignore) is never packed.
    let Ok((tree, digest)) = digest_dir(&dirs.tree, &options) else {
        return;
    };
    let mut bytes = Vec::new();
    let packed = pack(&tree, &mut bytes).expect("a walked tree packs");
    assert_eq!(packed.digest, digest, "pack hashed other entries than the walk");
    assert_eq!(packed.bytes, bytes.len() as u64);

    let unpacked = unpack(&bytes[..], &dirs.out, Some(&digest)).expect("a packed tree unpacks to its digest");
    assert_eq!(unpacked.digest, digest);
    assert_eq!(unpacked.entries, tree.entries.len() as u64);
    assert_eq!(verify(&bytes[..], &digest).expect("a packed tree verifies"), unpacked);

    let again = walk_tree(&dirs.out, &options).expect("an unpacked tree walks");
    let shape = |t: &kiln_core::digest::Tree| {
        t.entries.iter().map(|e| (e.path.clone(), e.kind, e.size, e.link_target.clone())).collect::<Vec<_>>()
    };
    assert_eq!(shape(&again), shape(&tree), "the unpacked tree lists other entries");
    let (_, redigested) = digest_dir(&dirs.out, &options).expect("an unpacked tree digests");
    assert_eq!(redigested, digest);

    let before = list_tree(&dirs.tree);
    let after = list_tree(&dirs.out);
    for entry in &tree.entries {
        let find = |list: &[(Vec<u8>, Found)]| list.iter().find(|(p, _)| *p == entry.path).map(|(_, f)| f.clone());
        let (was, is) = (find(&before), find(&after));
        match entry.kind {
            EntryKind::File | EntryKind::ExecFile => {
                let (Some(Found::File { content: a, .. }), Some(Found::File { content: b, mode })) = (was, is) else {
                    panic!("{:?} is not a file on both sides", entry.path);
                };
                assert_eq!(a, b, "{:?} changed content", entry.path);
                let want = if entry.kind == EntryKind::ExecFile { 0o755 } else { 0o644 };
                assert_eq!(mode, want, "{:?}", entry.path);
            }
            EntryKind::Symlink => assert_eq!(was, is, "{:?}", entry.path),
            EntryKind::Dir => assert_eq!(is, Some(Found::Dir), "{:?}", entry.path),
        }
    }
}
