//! An entry list kept and sent as bytes: exactly the canonical stream the tree digest hashes
//! ([`super::StreamHasher`]'s table), nothing added.
//!
//! Choosing the stream itself as the encoding makes a stored list check itself: its digest under
//! [`super::TREE_DIGEST_CONTEXT`] must be the tree digest it is stored under, so a list read back
//! from a database, or received from a coordinator, is trusted only when [`decode_for`] finds
//! exactly that digest — a stale or mixed-up list can never name files that did not move.

use super::{ContentHash, Entry, EntryKind, EntryListError, StreamHasher, TreeDigest, TREE_DIGEST_CONTEXT};

/// The canonical stream of `entries` (which must be in canonical order, files hashed).
pub fn encode(entries: &[Entry]) -> Result<Vec<u8>, EntryListError> {
    let mut hasher = StreamHasher::recording(usize::MAX);
    super::feed::feed_entries(&mut hasher, entries)?;
    Ok(hasher.finish_recorded().1.unwrap_or_default())
}

/// The tree digest a stream encodes.
pub fn digest_of(stream: &[u8]) -> TreeDigest {
    let mut hasher = blake3::Hasher::new_derive_key(TREE_DIGEST_CONTEXT);
    hasher.update(stream);
    TreeDigest(*hasher.finalize().as_bytes())
}

/// The entries of `stream`, if it is the entry list of `expected` and well formed.
pub fn decode_for(stream: &[u8], expected: &TreeDigest) -> Result<Vec<Entry>, ListError> {
    let actual = digest_of(stream);
    if actual != *expected {
        return Err(ListError::OtherTree { expected: *expected, actual });
    }
    decode(stream)
}

/// The entries of a canonical stream, in its order; `stat` is never known here.
pub fn decode(stream: &[u8]) -> Result<Vec<Entry>, ListError> {
    let mut at = Cursor { stream, pos: 0 };
    let mut entries: Vec<Entry> = Vec::new();
    while at.pos < stream.len() {
        let start = at.pos;
        let kind = match at.take(1)?[0] {
            b'd' => EntryKind::Dir,
            b'f' => EntryKind::File,
            b'x' => EntryKind::ExecFile,
            b'l' => EntryKind::Symlink,
            other => {
                return Err(ListError::Malformed { at: start, why: format!("unknown entry type byte {other:#04x}") })
            }
        };
        let len = at.len()?;
        let path = at.take(len)?.to_vec();
        if let Some(previous) = entries.last().filter(|p| p.path >= path) {
            let why = format!("entry {} comes after {}", shown(&path), shown(&previous.path));
            return Err(ListError::Malformed { at: start, why });
        }
        let mut entry = Entry { path, kind, size: 0, link_target: Vec::new(), stat: None, hash: None };
        match kind {
            EntryKind::Dir => {}
            EntryKind::Symlink => {
                let len = at.len()?;
                entry.link_target = at.take(len)?.to_vec();
                entry.size = len as u64;
            }
            EntryKind::File | EntryKind::ExecFile => {
                entry.size = u64::from_le_bytes(at.take(8)?.try_into().expect("8 bytes"));
                entry.hash = Some(ContentHash(at.take(32)?.try_into().expect("32 bytes")));
            }
        }
        entries.push(entry);
    }
    Ok(entries)
}

struct Cursor<'a> {
    stream: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ListError> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.stream.len()).ok_or(ListError::Malformed {
            at: self.pos,
            why: format!("it ends inside an entry ({n} more bytes expected)"),
        })?;
        let bytes = &self.stream[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    /// A length field, bounded by what is left so a corrupt one never allocates.
    fn len(&mut self) -> Result<usize, ListError> {
        let at = self.pos;
        let len = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"));
        match usize::try_from(len).ok().filter(|&l| l <= self.stream.len() - self.pos) {
            Some(len) => Ok(len),
            None => Err(ListError::Malformed { at, why: format!("a length of {len} bytes passes its end") }),
        }
    }
}

/// A path as a person reads it: UTF-8 as it is, any other byte as `\xNN`, so two names that
/// differ only in invalid bytes never print alike.
pub fn shown(path: &[u8]) -> String {
    let mut out = String::with_capacity(path.len());
    for chunk in path.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Why an entry list cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    #[error("the entry list is of tree {actual}, not of tree {expected} — it was stored under the wrong digest; it is ignored")]
    OtherTree { expected: TreeDigest, actual: TreeDigest },
    #[error("the entry list is malformed at byte {at}: {why}")]
    Malformed { at: usize, why: String },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::digest_entries;

    fn file(path: &[u8], exec: bool, body: &[u8]) -> Entry {
        let kind = if exec { EntryKind::ExecFile } else { EntryKind::File };
        let hash = Some(ContentHash::of(body));
        Entry { path: path.to_vec(), kind, size: body.len() as u64, link_target: Vec::new(), stat: None, hash }
    }

    fn tree() -> Vec<Entry> {
        let dir =
            Entry { path: b"d".to_vec(), kind: EntryKind::Dir, size: 0, link_target: vec![], stat: None, hash: None };
        let link = Entry {
            path: b"d/l".to_vec(),
            kind: EntryKind::Symlink,
            size: 4,
            link_target: b"../a".to_vec(),
            stat: None,
            hash: None,
        };
        vec![file(b"a", false, b"hello"), dir, link, file(b"d/run\xff", true, b"#!/bin/sh\n")]
    }

    #[test]
    fn a_list_round_trips_and_hashes_to_its_tree_digest() {
        let entries = tree();
        let stream = encode(&entries).unwrap();
        let digest = digest_entries(&entries).unwrap();
        assert_eq!(digest_of(&stream), digest);
        assert_eq!(decode_for(&stream, &digest).unwrap(), entries);
    }

    #[test]
    fn a_list_of_another_tree_is_refused() {
        let stream = encode(&tree()).unwrap();
        let other = digest_entries(&tree()[..1]).unwrap();
        assert!(matches!(decode_for(&stream, &other), Err(ListError::OtherTree { .. })));
    }

    #[test]
    fn a_truncated_or_garbled_list_is_refused_without_panicking() {
        let stream = encode(&tree()).unwrap();
        for cut in 1..stream.len() {
            // Every proper prefix either ends between entries (and reads as fewer) or is refused.
            if let Ok(entries) = decode(&stream[..cut]) {
                assert!(entries.len() < tree().len(), "cut {cut}");
            }
        }
        let mut huge = stream.clone();
        huge[1..9].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&huge), Err(ListError::Malformed { at: 1, .. })));
        assert!(matches!(decode(b"q"), Err(ListError::Malformed { at: 0, .. })));
    }

    #[test]
    fn a_recording_past_its_limit_keeps_nothing() {
        let mut hasher = StreamHasher::recording(16);
        hasher.dir(b"a-rather-long-directory-name");
        let (digest, kept) = hasher.finish_recorded();
        assert_eq!(kept, None);
        let mut plain = StreamHasher::new();
        plain.dir(b"a-rather-long-directory-name");
        assert_eq!(plain.finish(), digest, "recording never changes the digest");
    }

    #[test]
    fn names_that_are_not_utf8_show_their_bytes() {
        assert_eq!(shown(b"src/main.rs"), "src/main.rs");
        assert_eq!(shown(b"caf\xc3\xa9"), "café");
        assert_eq!(shown(b"bad\xff\xfe.txt"), "bad\\xff\\xfe.txt");
    }
}
