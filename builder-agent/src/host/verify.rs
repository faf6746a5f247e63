//! The check before every build: the context archive must unpack safely to exactly the tree the tag
//! addresses (DESIGN.md "The converge", step 5).
//!
//! The archive is unpacked for real — into a throwaway directory — rather than merely hashed,
//! because `kiln_core::archive::unpack` is where the containment rules live (no `..`, no absolute
//! paths, no links leaving the root, no devices); Docker would otherwise be the first to interpret
//! an archive that breaks them. The unpacked copy is then deleted: the build is sent the archive
//! itself, which is byte for byte what was checked.

use super::HostError;
use kiln_core::archive;
use kiln_core::digest::TreeDigest;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

/// Unpacks `archive` into a temporary directory under `scratch`, refuses it unless its tree digest
/// is `expected`, and removes the directory again. Blocking: call it from `spawn_blocking`.
pub fn verify_context(archive: &Path, expected: &TreeDigest, scratch: &Path) -> Result<(), HostError> {
    let input = File::open(archive)
        .map_err(|source| HostError::ContextUnreadable { archive: archive.to_path_buf(), source })?;
    let dir = tempfile::Builder::new()
        .prefix("kiln-verify-")
        .tempdir_in(scratch)
        .map_err(|source| HostError::Scratch { scratch: scratch.to_path_buf(), source })?;
    // Into a fresh subdirectory: unpack wants an empty or missing target it creates itself.
    let target = dir.path().join("tree");
    let outcome = archive::unpack(BufReader::new(input), &target, Some(expected));
    // Deleted whatever the outcome, so a refused archive leaves nothing behind. A failed cleanup
    // only leaks scratch space; it must not turn a verified context into a refused one.
    let leftover = dir.path().to_path_buf();
    if let Err(err) = dir.close() {
        tracing::warn!(dir = %leftover.display(), error = %err, "could not remove a verified context's scratch copy");
    }
    outcome.map(|_| ()).map_err(|source| HostError::ContextRefused { archive: archive.to_path_buf(), source })
}
