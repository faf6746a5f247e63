//! The canonical archive: same tree → same bytes on any host; unpack refuses every way out of its
//! target and every archive whose digest is not the one claimed.

use kiln_core::archive::{pack, unpack, ArchiveError};
use kiln_core::digest::{digest_dir, walk_tree, TreeDigest, WalkOptions};
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use tempfile::TempDir;

fn sample_tree(root: &Path) {
    fs::create_dir_all(root.join("src/deep")).unwrap();
    fs::create_dir_all(root.join("empty")).unwrap();
    fs::write(root.join("Dockerfile"), "FROM scratch\nCOPY . /\n").unwrap();
    fs::write(root.join("src/main.txt"), "hello").unwrap();
    fs::write(root.join("src/deep/run.sh"), "#!/bin/sh\necho hi\n").unwrap();
    fs::set_permissions(root.join("src/deep/run.sh"), fs::Permissions::from_mode(0o755)).unwrap();
    symlink("../main.txt", root.join("src/deep/link")).unwrap();
    let long_dir = "d".repeat(60);
    fs::create_dir_all(root.join(&long_dir)).unwrap();
    fs::write(root.join(&long_dir).join("f".repeat(70)), vec![7u8; 1500]).unwrap();
    symlink(format!("../{}", "x".repeat(120)), root.join(&long_dir).join("longlink")).unwrap();
}

fn packed_bytes(root: &Path) -> (Vec<u8>, TreeDigest) {
    let (tree, digest) = digest_dir(root, &WalkOptions::default()).unwrap();
    let mut out = Vec::new();
    let packed = pack(&tree, &mut out).unwrap();
    assert_eq!(packed.digest, digest, "pack hashes exactly what the walk digested");
    assert_eq!(packed.bytes, out.len() as u64);
    (out, digest)
}

#[test]
fn same_tree_packs_to_same_bytes_wherever_and_whenever_it_lives() {
    let a = TempDir::new().unwrap();
    let b = TempDir::new().unwrap();
    sample_tree(a.path());
    std::thread::sleep(std::time::Duration::from_millis(20)); // other mtimes for b
    sample_tree(b.path());
    fs::set_permissions(b.path().join("src/main.txt"), fs::Permissions::from_mode(0o600)).unwrap();
    let (bytes_a, digest_a) = packed_bytes(a.path());
    let (bytes_b, digest_b) = packed_bytes(b.path());
    assert_eq!(digest_a, digest_b);
    assert!(bytes_a == bytes_b, "archives differ although the trees are the same");
}

#[test]
fn archive_headers_carry_no_time_owner_or_user_name() {
    let a = TempDir::new().unwrap();
    sample_tree(a.path());
    let (bytes, _) = packed_bytes(a.path());
    let mut archive = tar::Archive::new(&bytes[..]);
    let mut names = Vec::new();
    for entry in archive.entries().unwrap() {
        let entry = entry.unwrap();
        let h = entry.header();
        assert_eq!(h.mtime().unwrap(), 0);
        assert_eq!(h.uid().unwrap(), 0);
        assert_eq!(h.gid().unwrap(), 0);
        assert_eq!(h.username_bytes(), Some(&b""[..]));
        names.push(entry.path_bytes().into_owned());
    }
    let tree = walk_tree(a.path(), &WalkOptions::default()).unwrap();
    let walked: Vec<Vec<u8>> = tree
        .entries
        .iter()
        .map(|e| {
            let mut p = e.path.clone();
            if e.kind == kiln_core::digest::EntryKind::Dir {
                p.push(b'/');
            }
            p
        })
        .collect();
    let names: Vec<Vec<u8>> = names.into_iter().map(|n| n.to_vec()).collect();
    assert_eq!(names, walked, "archive holds exactly the digested entries, in digest order");
}

#[test]
fn round_trip_restores_the_tree_and_its_digest() {
    let a = TempDir::new().unwrap();
    sample_tree(a.path());
    let (bytes, digest) = packed_bytes(a.path());
    let out = TempDir::new().unwrap();
    let target = out.path().join("ctx");
    let done = unpack(&bytes[..], &target, Some(&digest)).unwrap();
    assert_eq!(done.digest, digest);
    let (_, again) = digest_dir(&target, &WalkOptions::default()).unwrap();
    assert_eq!(again, digest, "the unpacked tree digests as the original");
    let mode = fs::metadata(target.join("src/deep/run.sh")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o755, "executable bit survives");
    assert_eq!(fs::read_link(target.join("src/deep/link")).unwrap(), Path::new("../main.txt"));
}

#[test]
fn a_digest_other_than_the_claimed_one_is_refused() {
    let a = TempDir::new().unwrap();
    sample_tree(a.path());
    let (bytes, _) = packed_bytes(a.path());
    let out = TempDir::new().unwrap();
    let claimed = TreeDigest([9u8; 32]);
    let err = unpack(&bytes[..], &out.path().join("ctx"), Some(&claimed)).unwrap_err();
    assert!(matches!(err, ArchiveError::DigestMismatch { .. }), "{err}");
    assert!(err.to_string().contains(&claimed.to_string()), "{err}");
}

#[test]
fn unpack_refuses_a_non_empty_target() {
    let out = TempDir::new().unwrap();
    fs::write(out.path().join("already"), "x").unwrap();
    let err = unpack(&empty_archive()[..], out.path(), None).unwrap_err();
    assert!(err.to_string().contains("not empty"), "{err}");
}

fn empty_archive() -> Vec<u8> {
    vec![0u8; 1024]
}

/// A raw tar stream built entry by entry, so tests can write what `kiln pack` never would.
struct Hostile(Vec<u8>);

impl Hostile {
    fn new() -> Self {
        Hostile(Vec::new())
    }
    fn entry(mut self, name: &[u8], kind: tar::EntryType, link: &[u8], data: &[u8]) -> Self {
        let mut h = tar::Header::new_ustar();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        self.0.extend_from_slice(h.as_bytes());
        self.0.extend_from_slice(data);
        self.0.resize(self.0.len().div_ceil(512) * 512, 0);
        self
    }
    fn pax_path(self, path: &[u8]) -> Self {
        let mut rec = Vec::new();
        let body = 4 + path.len() + 3;
        let len = body + (body + 3).to_string().len();
        rec.extend_from_slice(format!("{len} path=").as_bytes());
        rec.extend_from_slice(path);
        rec.push(b'\n');
        assert_eq!(rec.len(), len);
        self.entry(b"././@PaxHeader", tar::EntryType::XHeader, b"", &rec)
    }
    fn file(self, name: &str, data: &str) -> Self {
        self.entry(name.as_bytes(), tar::EntryType::Regular, b"", data.as_bytes())
    }
    fn done(mut self) -> Vec<u8> {
        self.0.extend_from_slice(&[0u8; 1024]);
        self.0
    }
}

/// Unpacks `archive` into `<tmp>/box/ctx` and asserts it is refused naming `why`, and that nothing
/// appeared beside the target.
fn assert_refused(archive: Vec<u8>, why: &str) {
    let tmp = TempDir::new().unwrap();
    let boxed = tmp.path().join("box");
    fs::create_dir(&boxed).unwrap();
    let err = unpack(&archive[..], &boxed.join("ctx"), None).unwrap_err();
    assert!(err.to_string().contains(why), "expected `{why}` in: {err}");
    let beside: Vec<_> = fs::read_dir(&boxed).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(beside, vec![std::ffi::OsString::from("ctx")], "nothing written beside the target");
    let above: Vec<_> = fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(above, vec![std::ffi::OsString::from("box")], "nothing written above the target");
}

#[test]
fn absolute_paths_are_refused() {
    let tmp = TempDir::new().unwrap();
    let outside = tmp.path().join("evil");
    let archive = Hostile::new().file(outside.to_str().unwrap(), "x").done();
    assert_refused(archive, "absolute paths");
    assert!(!outside.exists());
}

#[test]
fn dot_dot_is_refused() {
    assert_refused(Hostile::new().file("../evil", "x").done(), "`..`");
    assert_refused(Hostile::new().file("a/../../evil", "x").done(), "`..`");
}

#[test]
fn a_pax_record_cannot_rewrite_a_path_out_of_the_root() {
    let archive = Hostile::new().pax_path(b"../../evil").file("innocent", "x").done();
    assert_refused(archive, "`..`");
    let archive = Hostile::new().pax_path(b"/tmp/evil-kiln").file("innocent", "x").done();
    assert_refused(archive, "absolute");
}

#[test]
fn symlinks_leaving_the_root_are_refused() {
    let archive = Hostile::new().entry(b"link", tar::EntryType::Symlink, b"../outside", b"").done();
    assert_refused(archive, "outside the root");
    let archive = Hostile::new().entry(b"link", tar::EntryType::Symlink, b"/etc", b"").done();
    assert_refused(archive, "the target is absolute");
}

#[test]
fn nothing_is_written_through_a_symlink() {
    // `sub` is a link to a directory inside the root; writing `sub/x` would go through it.
    let archive = Hostile::new()
        .entry(b"real/", tar::EntryType::Directory, b"", b"")
        .entry(b"sub", tar::EntryType::Symlink, b"real", b"")
        .file("sub/x", "through the link")
        .done();
    assert_refused(archive, "through a symlink");
}

#[test]
fn hardlinks_devices_and_fifos_are_refused() {
    assert_refused(Hostile::new().file("a", "x").entry(b"b", tar::EntryType::Link, b"a", b"").done(), "hardlinks");
    assert_refused(Hostile::new().entry(b"dev", tar::EntryType::Char, b"", b"").done(), "device");
    assert_refused(Hostile::new().entry(b"dev", tar::EntryType::Block, b"", b"").done(), "device");
    assert_refused(Hostile::new().entry(b"p", tar::EntryType::Fifo, b"", b"").done(), "fifo");
}

#[test]
fn repeated_or_reordered_entries_are_refused() {
    assert_refused(Hostile::new().file("b", "1").file("a", "2").done(), "increasing");
    assert_refused(Hostile::new().file("a", "1").file("a", "2").done(), "increasing");
}

#[test]
fn a_file_under_a_file_is_refused() {
    assert_refused(Hostile::new().file("a", "1").file("a/b", "2").done(), "parent is a file");
}

#[test]
fn verify_applies_the_same_checks_without_writing() {
    let a = TempDir::new().unwrap();
    sample_tree(a.path());
    let (bytes, digest) = packed_bytes(a.path());
    let done = kiln_core::archive::verify(&bytes[..], &digest).unwrap();
    assert_eq!(done.digest, digest);
    let other = TreeDigest([1u8; 32]);
    let err = kiln_core::archive::verify(&bytes[..], &other).unwrap_err();
    assert!(matches!(err, ArchiveError::DigestMismatch { .. }), "{err}");
    let through_link = Hostile::new()
        .entry(b"real/", tar::EntryType::Directory, b"", b"")
        .entry(b"sub", tar::EntryType::Symlink, b"real", b"")
        .file("sub/x", "through the link")
        .done();
    let err = kiln_core::archive::verify(&through_link[..], &digest).unwrap_err();
    assert!(err.to_string().contains("through a symlink"), "{err}");
    let escaping = Hostile::new().file("../evil", "x").done();
    assert!(kiln_core::archive::verify(&escaping[..], &digest).is_err());
}

#[test]
fn a_verified_archive_gives_the_entry_list_the_walk_saw() {
    let a = TempDir::new().unwrap();
    sample_tree(a.path());
    let (bytes, digest) = packed_bytes(a.path());
    let (done, list) = kiln_core::archive::verify_listed(&bytes[..], &digest, 1 << 20).unwrap();
    assert_eq!(done.digest, digest);
    let (tree, _) = digest_dir(a.path(), &WalkOptions::default()).unwrap();
    let listed = kiln_core::digest::list::decode_for(&list.unwrap(), &digest).unwrap();
    let walked: Vec<_> = tree.entries.into_iter().map(|e| (e.path, e.kind, e.size, e.link_target, e.hash)).collect();
    let read: Vec<_> = listed.into_iter().map(|e| (e.path, e.kind, e.size, e.link_target, e.hash)).collect();
    assert_eq!(read, walked);
    // Too long to keep: verified all the same, listed not at all.
    let (_, none) = kiln_core::archive::verify_listed(&bytes[..], &digest, 64).unwrap();
    assert_eq!(none, None);
}

/// A tar stream that never ends by itself: `head`, then `fill` bytes for as long as it is read.
/// Counts what was read, so a test can show a reader stopped early instead of buffering.
struct Endless {
    head: Vec<u8>,
    at: usize,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl std::io::Read for Endless {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = if self.at < self.head.len() {
            let n = buf.len().min(self.head.len() - self.at);
            buf[..n].copy_from_slice(&self.head[self.at..self.at + n]);
            self.at += n;
            n
        } else {
            buf.fill(b'a');
            buf.len()
        };
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

/// A header of `kind` claiming `size` bytes of content, as a hostile client would send first.
fn claiming(name: &[u8], kind: tar::EntryType, size: u64) -> Vec<u8> {
    let mut h = tar::Header::new_ustar();
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(size);
    h.set_cksum();
    h.as_bytes().to_vec()
}

#[test]
fn a_huge_pax_record_is_refused_at_the_limit_without_being_buffered() {
    use kiln_core::archive::{verify, ENTRY_METADATA_MAX};
    for kind in [tar::EntryType::XHeader, tar::EntryType::GNULongName, tar::EntryType::GNULongLink] {
        // A first, innocent entry, then a record claiming 300 MB.
        let mut head = Hostile::new().file("a", "x").0;
        head.extend(claiming(b"././@PaxHeader", kind, 300 << 20));
        let read = std::rc::Rc::new(std::cell::Cell::new(0));
        let endless = Endless { head, at: 0, read: read.clone() };
        let err = verify(endless, &TreeDigest([0; 32])).unwrap_err();
        assert!(matches!(err, ArchiveError::MetadataTooLarge { .. }), "{kind:?}: {err}");
        let msg = err.to_string();
        assert!(msg.contains("after a:") && msg.contains("exceed 1 MiB"), "names the entry and the limit: {msg}");
        assert!(read.get() < ENTRY_METADATA_MAX + (64 << 10), "{kind:?}: read {} bytes before refusing", read.get());
    }
}

#[test]
fn records_over_the_limit_are_refused_by_unpack_too_and_shorter_ones_pass() {
    use kiln_core::archive::ENTRY_METADATA_MAX;
    let long = vec![b'p'; ENTRY_METADATA_MAX as usize + 1];
    assert_refused(Hostile::new().pax_path(&long).file("innocent", "x").done(), "exceed 1 MiB");

    // Long paths are what pax records are for: one of 4 KiB (Linux's PATH_MAX) is read as before.
    let path = format!("{}/f", "d".repeat(4000));
    let archive = Hostile::new().pax_path(path.as_bytes()).file("ignored", "x").done();
    let done = kiln_core::archive::verify(&archive[..], &TreeDigest([0; 32])).unwrap_err();
    assert!(matches!(done, ArchiveError::DigestMismatch { .. }), "read to its end: {done}");
}

#[test]
fn a_directory_or_symlink_with_content_is_refused() {
    let archive = Hostile::new().entry(b"d/", tar::EntryType::Directory, b"", &[0u8; 4096]).done();
    assert_refused(archive, "carries content");
    let archive = Hostile::new().entry(b"l", tar::EntryType::Symlink, b"x", b"data").done();
    assert_refused(archive, "carries content");
}

/// Blobs by content hash, as a content store keeps them, read by `pack_with`.
fn blob_reader(
    blobs: &std::collections::HashMap<[u8; 32], Vec<u8>>,
) -> impl FnMut(&kiln_core::digest::Entry) -> Result<Box<dyn std::io::Read>, ArchiveError> + '_ {
    move |entry| Ok(Box::new(std::io::Cursor::new(blobs[&entry.hash.unwrap().0].clone())))
}

#[test]
fn an_archive_assembled_from_the_entry_list_and_blobs_is_the_one_packed_from_the_folder() {
    let tmp = TempDir::new().unwrap();
    sample_tree(tmp.path());
    let (packed, digest) = packed_bytes(tmp.path());
    let (tree, _) = digest_dir(tmp.path(), &WalkOptions::default()).unwrap();
    let mut blobs = std::collections::HashMap::new();
    for entry in tree.entries.iter().filter(|e| e.hash.is_some()) {
        let path = tmp.path().join(String::from_utf8(entry.path.clone()).unwrap());
        blobs.insert(entry.hash.unwrap().0, fs::read(path).unwrap());
    }
    // Only the list travels: decoded, it carries no stat and no root.
    let list = kiln_core::digest::list::encode(&tree.entries).unwrap();
    let entries = kiln_core::digest::list::decode_for(&list, &digest).unwrap();
    let mut assembled = Vec::new();
    let done =
        kiln_core::archive::pack_with(Path::new("blobs"), &entries, &mut blob_reader(&blobs), &mut assembled).unwrap();
    assert_eq!(done.digest, digest);
    assert_eq!(assembled, packed, "byte for byte the archive the CLI packs");
    assert_eq!(kiln_core::archive::packed_size(&entries), packed.len() as u64);
}

#[test]
fn a_blob_that_is_not_its_hashs_bytes_is_refused_while_assembling() {
    let tmp = TempDir::new().unwrap();
    sample_tree(tmp.path());
    let (tree, _) = digest_dir(tmp.path(), &WalkOptions::default()).unwrap();
    let mut blobs = std::collections::HashMap::new();
    for entry in tree.entries.iter().filter(|e| e.hash.is_some()) {
        let path = tmp.path().join(String::from_utf8(entry.path.clone()).unwrap());
        let mut bytes = fs::read(path).unwrap();
        if entry.path == b"src/main.txt" {
            bytes[0] ^= 1; // same length, other bytes
        }
        blobs.insert(entry.hash.unwrap().0, bytes);
    }
    let err =
        kiln_core::archive::pack_with(Path::new("blobs"), &tree.entries, &mut blob_reader(&blobs), std::io::sink())
            .unwrap_err();
    assert!(matches!(&err, ArchiveError::Refused { path, .. } if path == "src/main.txt"), "{err}");
}
