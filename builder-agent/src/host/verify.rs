//! The check before every build: the context archive must unpack safely to exactly the tree the tag
//! addresses (DESIGN.md "The converge", step 5).
//!
//! `kiln_core::archive::verify` applies exactly the checks `unpack` applies — no `..`, no absolute
//! paths, no links leaving the root, no devices, entries in canonical order — and recomputes the
//! digest, without writing a file: Docker is never the first to interpret an archive that breaks
//! them, and the check costs one read of the archive rather than a write of the whole tree. The
//! build is then sent the archive itself, byte for byte what was checked.

use super::HostError;
use kiln_core::archive;
use kiln_core::digest::TreeDigest;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

/// Refuses `archive` unless it is a canonical archive of the tree `expected`. `scratch` is unused
/// since the check writes nothing; it stays in the signature for callers that pass one. Blocking:
/// call it from `spawn_blocking`.
pub fn verify_context(archive: &Path, expected: &TreeDigest, _scratch: &Path) -> Result<(), HostError> {
    let input = File::open(archive)
        .map_err(|source| HostError::ContextUnreadable { archive: archive.to_path_buf(), source })?;
    archive::verify(BufReader::with_capacity(1 << 20, input), expected)
        .map(|_| ())
        .map_err(|source| HostError::ContextRefused { archive: archive.to_path_buf(), source })
}
