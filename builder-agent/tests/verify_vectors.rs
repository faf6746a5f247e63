//! The agent's check before every build agrees with the CLI on every conformance vector of the
//! tree digest: an archive packed the way `kiln up` packs it verifies against the pinned digest,
//! and against any other digest is refused. No Docker needed.

use kiln_agent::host::{verify_context, HostError};
use kiln_core::archive;
use kiln_core::digest::vectors::VECTORS;
use kiln_core::digest::{cache_file_for, digest_dir_cached, walk_tree, TreeDigest, WalkOptions};
use std::fs::File;
use std::io::BufWriter;

#[test]
fn the_agent_verifies_every_vector_at_its_pinned_digest_and_refuses_any_other() {
    let scratch = tempfile::tempdir().unwrap();
    for (i, v) in VECTORS.iter().enumerate() {
        let ctx = tempfile::tempdir().unwrap();
        (v.build)(ctx.path()).unwrap();
        let pinned: TreeDigest = v.digest.parse().unwrap();
        // The CLI addresses with its stat cache, then packs a fresh walk when asked to upload.
        let cache = cache_file_for(scratch.path(), ctx.path());
        let (_, hashed, _) = digest_dir_cached(ctx.path(), &WalkOptions::default(), &cache).unwrap();
        assert_eq!(hashed.digest, pinned, "vector {}: the CLI's digest", v.name);
        let path = scratch.path().join(format!("{}.tar", v.name));
        let tree = walk_tree(ctx.path(), &WalkOptions::default()).unwrap();
        let packed = archive::pack(&tree, BufWriter::new(File::create(&path).unwrap())).unwrap();
        assert_eq!(packed.digest, pinned, "vector {}: the packed digest", v.name);

        verify_context(&path, &pinned, scratch.path())
            .unwrap_or_else(|err| panic!("vector {}: the agent refused its own tree: {err}", v.name));
        let other: TreeDigest = VECTORS[(i + 1) % VECTORS.len()].digest.parse().unwrap();
        match verify_context(&path, &other, scratch.path()) {
            Err(HostError::ContextRefused { source: archive::ArchiveError::DigestMismatch { actual, .. }, .. }) => {
                assert_eq!(actual, pinned, "vector {}", v.name)
            }
            other => panic!("vector {}: expected a digest mismatch, got {other:?}", v.name),
        }
    }
}
