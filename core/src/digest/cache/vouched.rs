//! A digest a file watcher vouches for: the result of a context's last walk, kept beside its stat
//! cache with the watcher's tag for the context at the time that walk began. When the watcher
//! answers the same tag again, nothing in the tree has changed since before the walk, so its
//! result is the tree's digest now and the walk is skipped — not one `lstat`.
//!
//! Why that holds: the tag is asked for *before* the walk, and the watcher answers only after it
//! has taken in every change the kernel queued until then (an inotify event is queued inside the
//! syscall that made the change). A change made before the question is then seen by the walk that
//! follows; a change made after it moves the tag. The watcher is `kiln watch`; what it cannot see
//! (a write through a shared `mmap`, or through a hard link made from outside the tree after the
//! walk) is said in its documentation, and a tree that has hard links when walked is never vouched
//! for ([`super::super::Tree::linked`]).
//!
//! ```text
//! b"KILNVOUC"  u32 format  [32] key digest  u32 tag length, tag
//! [32] tree digest  u64 entries  u64 archive bytes
//! [32] blake3 of everything above
//! ```
//! Little-endian, written atomically like the stat cache; anything that does not read back whole,
//! under this key and this tag, is ignored.

use super::format::{key_digest, write_atomically};
use super::{digest_dir_cached, CacheKey};
use crate::digest::{DigestError, Tree, TreeDigest, WalkOptions};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"KILNVOUC";
const FORMAT: u32 = 1;

/// What a walk found, as much as a converge needs when nothing moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Summary {
    pub digest: TreeDigest,
    pub entries: u64,
    /// The canonical archive's size: a 512-byte header per entry, contents padded to 512, and the
    /// two zero blocks that end it.
    pub archive_bytes: u64,
}

impl Summary {
    pub fn of(tree: &Tree, digest: TreeDigest) -> Summary {
        let archive_bytes = tree.entries.iter().map(|e| 512 + e.size.div_ceil(512) * 512).sum::<u64>() + 1024;
        Summary { digest, entries: tree.entries.len() as u64, archive_bytes }
    }
}

/// The file beside `cache_file` (a context's stat cache) that holds its vouched result.
pub fn vouched_file_for(cache_file: &Path) -> PathBuf {
    cache_file.with_extension("vouched")
}

/// Digests the context at `root`. With `tag` — what the watcher answered for `root` just now — a
/// result recorded under that same tag is returned without walking (`None` for the tree);
/// otherwise the tree is walked with its stat cache ([`digest_dir_cached`]) and, unless it has
/// hard links, its result is recorded under `tag` for the next run.
pub fn digest_dir_vouched(
    root: &Path,
    opts: &WalkOptions,
    cache_file: &Path,
    tag: Option<&[u8]>,
) -> Result<(Option<Tree>, Summary), DigestError> {
    let vouched = vouched_file_for(cache_file);
    let key = tag.map(|_| CacheKey::here(root, opts));
    if let (Some(tag), Some(key)) = (tag, &key) {
        if let Some(summary) = load(&vouched, key, tag) {
            return Ok((None, summary));
        }
    }
    let (tree, hashed, _) = digest_dir_cached(root, opts, cache_file)?;
    let summary = Summary::of(&tree, hashed.digest);
    if let (Some(tag), Some(key)) = (tag, &key) {
        if tree.linked {
            let _ = std::fs::remove_file(&vouched);
        } else {
            // A result that cannot be recorded costs the next run a walk, never the digest.
            let _ = write_atomically(&vouched, &encode(key, tag, &summary));
        }
    }
    Ok((Some(tree), summary))
}

fn encode(key: &CacheKey, tag: &[u8], summary: &Summary) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 4 + 32 + 4 + tag.len() + 48 + 32);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&key_digest(key));
    out.extend_from_slice(&(tag.len() as u32).to_le_bytes());
    out.extend_from_slice(tag);
    out.extend_from_slice(&summary.digest.0);
    out.extend_from_slice(&summary.entries.to_le_bytes());
    out.extend_from_slice(&summary.archive_bytes.to_le_bytes());
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// The recorded result, if the file is whole and was written under `key` and `tag`.
fn load(file: &Path, key: &CacheKey, tag: &[u8]) -> Option<Summary> {
    decode(&std::fs::read(file).ok()?, key, tag)
}

fn decode(bytes: &[u8], key: &CacheKey, tag: &[u8]) -> Option<Summary> {
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(32)?)?;
    if blake3::hash(body).as_bytes() != sum {
        return None;
    }
    let mut want = Vec::with_capacity(body.len());
    want.extend_from_slice(MAGIC);
    want.extend_from_slice(&FORMAT.to_le_bytes());
    want.extend_from_slice(&key_digest(key));
    want.extend_from_slice(&(tag.len() as u32).to_le_bytes());
    want.extend_from_slice(tag);
    let rest = body.strip_prefix(&want[..])?;
    let rest: &[u8; 48] = rest.try_into().ok()?;
    let u64_at = |at: usize| u64::from_le_bytes(rest[at..at + 8].try_into().expect("8 bytes"));
    Some(Summary {
        digest: TreeDigest(rest[..32].try_into().expect("32 bytes")),
        entries: u64_at(32),
        archive_bytes: u64_at(40),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> CacheKey {
        CacheKey { machine: b"m1".to_vec(), kernel: b"6.1".to_vec(), context: b"/ctx".to_vec(), walk: [3; 32] }
    }

    fn summary() -> Summary {
        Summary { digest: TreeDigest([7; 32]), entries: 20_001, archive_bytes: 92_160_512 }
    }

    #[test]
    fn a_result_reads_back_under_its_key_and_tag_only() {
        let bytes = encode(&key(), b"w1:42", &summary());
        assert_eq!(decode(&bytes, &key(), b"w1:42"), Some(summary()));
        assert_eq!(decode(&bytes, &key(), b"w1:43"), None, "the tree moved since");
        assert_eq!(decode(&bytes, &key(), b"w2:42"), None, "another watcher's tag");
        assert_eq!(decode(&bytes, &key(), b"w1:4"), None, "a prefix of the tag");
        assert_eq!(decode(&bytes, &CacheKey { walk: [4; 32], ..key() }, b"w1:42"), None, "another .dockerignore");
        assert_eq!(decode(&bytes, &CacheKey { context: b"/o".to_vec(), ..key() }, b"w1:42"), None);
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_ignored() {
        let bytes = encode(&key(), b"w1:42", &summary());
        for len in 0..bytes.len() {
            assert_eq!(decode(&bytes[..len], &key(), b"w1:42"), None, "truncated to {len}");
        }
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert_eq!(decode(&bad, &key(), b"w1:42"), None, "byte {at} flipped");
        }
    }
}
