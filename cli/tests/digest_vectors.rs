//! `kiln digest`, `kiln pack` and `kiln unpack` as a user runs them, on every conformance vector
//! of the tree digest: the pinned digest with a cold stat cache and with a warm one, and `--list`
//! showing each file's content hash (what `b3sum` prints).

use kiln_core::digest::vectors::VECTORS;
use std::path::Path;
use std::process::{Command, Output};

fn kiln(cache: &Path, args: &[&std::ffi::OsStr]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("XDG_CACHE_HOME", cache)
        .env_remove("KILN_COORDINATOR")
        .output()
        .expect("the kiln binary runs");
    assert!(out.status.success(), "kiln {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_string()
}

#[test]
fn kiln_digest_prints_every_pinned_digest_cold_and_warm() {
    let cache = tempfile::tempdir().unwrap();
    for v in VECTORS {
        let ctx = tempfile::tempdir().unwrap();
        (v.build)(ctx.path()).unwrap();
        let dir = ctx.path().as_os_str();
        assert_eq!(last_line(&kiln(cache.path(), &["digest".as_ref(), dir])), v.digest, "vector {} cold", v.name);
        assert_eq!(last_line(&kiln(cache.path(), &["digest".as_ref(), dir])), v.digest, "vector {} warm", v.name);
    }
    let written = std::fs::read_dir(cache.path().join("kiln/stat")).unwrap().count();
    assert_eq!(written, VECTORS.len(), "one stat cache per context");
}

#[test]
fn kiln_digest_list_shows_each_files_content_hash() {
    let cache = tempfile::tempdir().unwrap();
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(ctx.path().join("a.txt"), b"alpha").unwrap();
    std::os::unix::fs::symlink("a.txt", ctx.path().join("link")).unwrap();
    let out = kiln(cache.path(), &["digest".as_ref(), "--list".as_ref(), ctx.path().as_os_str()]);
    let text = String::from_utf8_lossy(&out.stdout);
    let file = text.lines().find(|l| l.ends_with("  a.txt")).expect(&text);
    assert!(file.contains(&blake3::hash(b"alpha").to_hex().to_string()), "{file}");
    let link = text.lines().find(|l| l.contains("link -> a.txt")).expect(&text);
    assert!(link.starts_with("symlink") && link.contains("  -  "), "{link}");
}

#[test]
fn kiln_unpack_accepts_each_vector_at_its_pinned_digest() {
    let cache = tempfile::tempdir().unwrap();
    for v in VECTORS {
        let ctx = tempfile::tempdir().unwrap();
        (v.build)(ctx.path()).unwrap();
        let work = tempfile::tempdir().unwrap();
        let archive = work.path().join("ctx.tar");
        let out = work.path().join("out");
        kiln(cache.path(), &["pack".as_ref(), ctx.path().as_os_str(), "-o".as_ref(), archive.as_os_str()]);
        let unpacked = kiln(
            cache.path(),
            &["unpack".as_ref(), archive.as_os_str(), out.as_os_str(), "--expect".as_ref(), v.digest.as_ref()],
        );
        assert_eq!(last_line(&unpacked), v.digest, "vector {}", v.name);
    }
}
