//! Arbitrary bytes into the archive reader: `unpack` and `verify`.
//!
//! After every input the target checks:
//! - nothing was written outside the unpack's target (the whole scratch directory is listed and
//!   compared with how it was before), and inside it only directories, files of mode 0644/0755
//!   and symlinks that stay inside the root exist;
//! - `verify` and `unpack` agree: an archive one refuses the other refuses too (save the
//!   filesystem's own refusals, which only `unpack` meets), and they hash the same digest;
//! - `unpack` succeeds only when the digest matches: with the digest it hashed it succeeds again,
//!   with any other it is refused (`DigestMismatch`);
//! - a tree unpacked without implicit parents or a `.dockerignore` walks back to the digest
//!   `unpack` reported (tree digest = archive entries).
//!
//! Run with `-rss_limit_mb` (FUZZING.md) so a header that makes the reader allocate what the
//! input never carries is a finding.
#![no_main]

use kiln_core::archive::{unpack, verify, ArchiveError};
use kiln_core::digest::{check_link_target, digest_dir, TreeDigest, WalkOptions};
use kiln_fuzz::{empty_dir, list_tree, scratch, Found};
use libfuzzer_sys::fuzz_target;
use std::fs;
use std::path::PathBuf;
use std::sync::OnceLock;

struct Sandbox {
    _dir: tempfile::TempDir,
    root: PathBuf,
    /// Holds the unpack targets; emptied after every input.
    boxed: PathBuf,
    before: Vec<(Vec<u8>, Found)>,
}

fn sandbox() -> &'static Sandbox {
    static SANDBOX: OnceLock<Sandbox> = OnceLock::new();
    SANDBOX.get_or_init(|| {
        let dir = scratch();
        let root = dir.path().to_path_buf();
        // Things an escaping entry would overwrite or write through.
        fs::create_dir_all(root.join("outside/deep")).unwrap();
        fs::write(root.join("outside/secret"), "keep").unwrap();
        std::os::unix::fs::symlink("../outside", root.join("outside/deep/up")).unwrap();
        let boxed = root.join("box");
        fs::create_dir(&boxed).unwrap();
        let before = list_tree(&root);
        Sandbox { _dir: dir, root, boxed, before }
    })
}

const CLAIMED: TreeDigest = TreeDigest([0x5a; 32]);

fuzz_target!(|data: &[u8]| {
    let sandbox = sandbox();
    let target = sandbox.boxed.join("ctx");
    let verified = verify(data, &CLAIMED);
    let unpacked = unpack(data, &target, None);
    check_containment(sandbox, &target, unpacked.is_ok());

    match (&unpacked, &verified) {
        (Ok(done), Err(ArchiveError::DigestMismatch { expected, actual })) => {
            assert_eq!(*expected, CLAIMED);
            assert_eq!(*actual, done.digest, "verify and unpack hash different digests");
        }
        (Ok(done), other) => panic!("unpack hashed {} but verify answered {other:?}", done.digest),
        (Err(ArchiveError::Create { .. }), _) => {}
        (Err(err), Err(ArchiveError::DigestMismatch { .. })) => panic!("verify accepts what unpack refuses: {err}"),
        (Err(ArchiveError::DigestMismatch { .. }), _) => panic!("unpack without a claim refused a digest"),
        (Err(_), Ok(done)) => panic!("verify matched the made-up digest: {done:?}"),
        (Err(_), Err(_)) => {}
    }

    if let Ok(done) = unpacked {
        let written = list_tree(&target);
        let has_ignore = written.iter().any(|(path, _)| path == b".dockerignore");
        if written.len() as u64 == done.entries && !has_ignore {
            let (_, walked) = digest_dir(&target, &WalkOptions::default()).expect("an unpacked tree walks");
            assert_eq!(walked, done.digest, "the unpacked tree digests differently from its archive");
        }

        let again = sandbox.boxed.join("again");
        let same = unpack(data, &again, Some(&done.digest)).expect("unpack with the digest it hashed");
        assert_eq!(same, done);
        empty_dir(&sandbox.boxed);
        let mut other = done.digest;
        other.0[0] ^= 1;
        match unpack(data, &again, Some(&other)) {
            Err(ArchiveError::DigestMismatch { expected, actual }) => {
                assert_eq!(expected, other);
                assert_eq!(actual, done.digest);
            }
            outcome => panic!("unpack with a wrong digest: {outcome:?}"),
        }
        check_containment(sandbox, &again, false);
    }
    empty_dir(&sandbox.boxed);
});

/// Nothing outside `target` changed; inside it, only what an unpack may create. A refused unpack
/// may leave a file it was writing at 0600 (the caller discards the target), so modes are checked
/// only after a success.
fn check_containment(sandbox: &Sandbox, target: &std::path::Path, succeeded: bool) {
    let prefix = target.strip_prefix(&sandbox.root).unwrap().as_os_str().as_encoded_bytes().to_vec();
    let mut inside_prefix = prefix.clone();
    inside_prefix.push(b'/');
    let now = list_tree(&sandbox.root);
    let outside: Vec<_> =
        now.iter().filter(|(path, _)| *path != prefix && !path.starts_with(&inside_prefix)).cloned().collect();
    assert_eq!(outside, sandbox.before, "something was written outside the target");
    for (path, found) in now.iter().filter(|(path, _)| path.starts_with(&inside_prefix)) {
        let rel = &path[inside_prefix.len()..];
        match found {
            Found::Dir => {}
            Found::File { mode, .. } => {
                assert!(!succeeded || *mode == 0o644 || *mode == 0o755, "{rel:?} has mode {mode:o}")
            }
            Found::Symlink { target } => {
                assert!(check_link_target(rel, target).is_ok(), "{rel:?} links outside: {target:?}")
            }
            Found::Other => panic!("{rel:?} is neither a directory, a file nor a symlink"),
        }
    }
}
