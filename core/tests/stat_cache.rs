//! The stat cache on real files: what it lets the digest skip, and every way a cache is refused.

use filetime::FileTime;
use kiln_core::digest::{cache_file_for, digest_dir, digest_dir_cached, CacheKey, Rejected, StatCache, WalkOptions};
use std::fs;
use std::path::Path;
use std::time::Duration;

fn write(root: &Path, rel: &str, content: &[u8]) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, content).unwrap();
}

/// A context whose files are past the racy window (their ctimes cannot be set back, so wait).
fn settled_context() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for i in 0..50 {
        write(d.path(), &format!("src/f{i:02}"), format!("file {i}").as_bytes());
    }
    write(d.path(), "Dockerfile", b"FROM scratch\n");
    std::thread::sleep(Duration::from_millis(150));
    d
}

fn opts() -> WalkOptions {
    WalkOptions::default()
}

#[test]
fn a_warm_cache_reads_no_file_and_gives_the_same_digest() {
    let ctx = settled_context();
    let cache = tempfile::tempdir().unwrap();
    let file = cache_file_for(cache.path(), ctx.path());
    let (_, first, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert!(matches!(used.rejected, Some(Rejected::Missing)));
    assert!(used.written);
    assert_eq!(first.read, 51);

    let (tree, second, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert_eq!((second.read, second.recalled), (0, 51));
    assert!(used.rejected.is_none() && !used.written, "nothing changed, nothing rewritten");
    assert_eq!(second.digest, first.digest);
    assert_eq!(second.digest, digest_dir(ctx.path(), &opts()).unwrap().1);
    assert!(tree.entries.iter().filter(|e| e.stat.is_some()).all(|e| e.hash.is_some()));
}

#[test]
fn an_edit_within_the_same_mtime_is_seen() {
    let ctx = settled_context();
    let cache = tempfile::tempdir().unwrap();
    let file = cache_file_for(cache.path(), ctx.path());
    digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    let target = ctx.path().join("src/f07");
    let before = fs::metadata(&target).unwrap();
    fs::write(&target, b"FILE 7").unwrap(); // same size
    filetime::set_file_mtime(&target, FileTime::from_last_modification_time(&before)).unwrap();
    let (_, hashed, _) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert_eq!(hashed.read, 1);
    assert_eq!(hashed.digest, digest_dir(ctx.path(), &opts()).unwrap().1);
}

#[test]
fn files_hashed_inside_the_racy_window_are_read_again() {
    let ctx = tempfile::tempdir().unwrap();
    write(ctx.path(), "fresh", b"just written");
    let cache = tempfile::tempdir().unwrap();
    let file = cache_file_for(cache.path(), ctx.path());
    digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    // Written moments before the first run's stamp: its cached hash is not trusted yet.
    let (_, hashed, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert_eq!(hashed.read, 1);
    assert!(used.written, "re-read files refresh the stamp");
}

#[test]
fn a_cache_from_another_machine_is_ignored() {
    let ctx = settled_context();
    let cache = tempfile::tempdir().unwrap();
    let file = cache_file_for(cache.path(), ctx.path());
    let (tree, _, _) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    let mut elsewhere = CacheKey::here(ctx.path(), &opts());
    elsewhere.machine = b"another-machine".to_vec();
    StatCache::from_tree(&tree, kiln_core::digest::stamp_now()).save(&file, &elsewhere).unwrap();
    let (_, hashed, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert!(matches!(used.rejected, Some(Rejected::Foreign)), "{:?}", used.rejected);
    assert_eq!(hashed.read, 51);
}

#[test]
fn a_changed_dockerignore_voids_the_cache() {
    let ctx = settled_context();
    let cache = tempfile::tempdir().unwrap();
    let file = cache_file_for(cache.path(), ctx.path());
    digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    write(ctx.path(), ".dockerignore", b"src/f0*\n");
    let (_, hashed, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert!(matches!(used.rejected, Some(Rejected::Foreign)), "{:?}", used.rejected);
    assert_eq!(hashed.digest, digest_dir(ctx.path(), &opts()).unwrap().1);
}

#[test]
fn a_truncated_or_garbled_cache_is_ignored() {
    let ctx = settled_context();
    let cache = tempfile::tempdir().unwrap();
    let file = cache_file_for(cache.path(), ctx.path());
    let (_, want, _) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    let whole = fs::read(&file).unwrap();
    for bad in [whole[..whole.len() / 2].to_vec(), Vec::new(), b"garbage".to_vec()] {
        fs::write(&file, &bad).unwrap();
        let (_, hashed, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
        assert!(matches!(used.rejected, Some(Rejected::Corrupt(_))), "{:?}", used.rejected);
        assert_eq!((hashed.read, hashed.digest), (51, want.digest));
    }
}

#[test]
fn a_cache_that_cannot_be_written_does_not_fail_the_digest() {
    let ctx = settled_context();
    let blocker = tempfile::NamedTempFile::new().unwrap();
    // The cache "directory" is a file: creating it fails.
    let file = blocker.path().join("sub/x.stat");
    let (_, hashed, used) = digest_dir_cached(ctx.path(), &opts(), &file).unwrap();
    assert!(used.write_error.is_some());
    assert_eq!(hashed.digest, digest_dir(ctx.path(), &opts()).unwrap().1);
}
