//! The stat cache's file: what it holds, how it is checked when read, how it is replaced.
//!
//! ```text
//! b"KILNSTAT"  u32 format  [32] key digest  i64 stamp (ns)  u64 count
//! count × ( u32 path length, path, u64 size, i64 mtime ns, i64 ctime ns, u64 ino, u64 dev,
//!           u32 mode, [32] content hash )
//! [32] blake3 of everything above
//! ```
//! Little-endian throughout. The key digest covers the tree digest's spec version too, so a cache
//! written for another spec is refused like one from another machine.

use super::{CacheKey, Cached, FileStat, StatCache};
use crate::digest::{ContentHash, TREE_DIGEST_VERSION};
use std::fs;
use std::io::{self, Write};
use std::path::Path;

const MAGIC: &[u8; 8] = b"KILNSTAT";
const FORMAT: u32 = 1;
const HEAD: usize = 8 + 4 + 32 + 8 + 8;
/// Fixed bytes of an entry besides its path.
const ENTRY_FIXED: usize = 4 + 8 + 8 + 8 + 8 + 8 + 4 + 32;

/// Why a cache file was not used. Every reason leads to the same thing: hash every file, and
/// write a fresh cache.
#[derive(Debug, thiserror::Error)]
pub enum Rejected {
    #[error("no stat cache yet")]
    Missing,
    #[error("the stat cache cannot be read")]
    Unreadable(#[source] io::Error),
    #[error("the stat cache is corrupt ({0}) — ignored, it will be rewritten")]
    Corrupt(&'static str),
    #[error("the stat cache was written for another machine, kernel, context, .dockerignore or digest spec — ignored")]
    Foreign,
}

pub(super) fn key_digest(key: &CacheKey) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&TREE_DIGEST_VERSION.to_le_bytes());
    for field in [&key.machine[..], &key.kernel, &key.context, &key.walk] {
        h.update(&(field.len() as u64).to_le_bytes()).update(field);
    }
    *h.finalize().as_bytes()
}

pub(super) fn encode(cache: &StatCache, key: &CacheKey) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + cache.paths.len() + cache.entries.len() * ENTRY_FIXED + 32);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&key_digest(key));
    out.extend_from_slice(&cache.stamp_ns.to_le_bytes());
    out.extend_from_slice(&(cache.entries.len() as u64).to_le_bytes());
    for c in &cache.entries {
        let path = &cache.paths[c.path.clone()];
        out.extend_from_slice(&(path.len() as u32).to_le_bytes());
        out.extend_from_slice(path);
        let s = &c.stat;
        out.extend_from_slice(&s.size.to_le_bytes());
        out.extend_from_slice(&s.mtime_ns.to_le_bytes());
        out.extend_from_slice(&s.ctime_ns.to_le_bytes());
        out.extend_from_slice(&s.ino.to_le_bytes());
        out.extend_from_slice(&s.dev.to_le_bytes());
        out.extend_from_slice(&s.mode.to_le_bytes());
        out.extend_from_slice(&c.hash.0);
    }
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// A cursor over the checked body; every read is bounds-checked, so a lying count or length is
/// `Corrupt`, never a panic or a huge allocation.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Rejected> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or(Rejected::Corrupt("truncated"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Rejected> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }
    fn u32(&mut self) -> Result<u32, Rejected> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, Rejected> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, Rejected> {
        Ok(i64::from_le_bytes(self.array()?))
    }
}

/// Takes the file's bytes whole: the cache's paths stay where they are in it, uncopied.
pub(super) fn decode(bytes: Vec<u8>, key: &CacheKey) -> Result<StatCache, Rejected> {
    if bytes.len() < HEAD + 32 {
        return Err(Rejected::Corrupt("shorter than its header"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    if blake3::hash(body).as_bytes() != sum {
        return Err(Rejected::Corrupt("checksum mismatch"));
    }
    let mut r = Reader { bytes: body, at: 0 };
    if r.take(8)? != MAGIC || r.u32()? != FORMAT {
        return Err(Rejected::Corrupt("not a stat cache of this format"));
    }
    if r.array::<32>()? != key_digest(key) {
        return Err(Rejected::Foreign);
    }
    let stamp_ns = r.i64()?;
    let count = r.u64()?;
    // Each entry takes at least its fixed bytes: a count the body cannot hold is a lie.
    if count > (body.len() / ENTRY_FIXED) as u64 {
        return Err(Rejected::Corrupt("more entries than bytes"));
    }
    let mut cache = StatCache { stamp_ns, paths: Vec::with_capacity(body.len()), entries: Vec::new() };
    cache.entries.reserve(count as usize);
    for _ in 0..count {
        let len = r.u32()? as usize;
        let path = r.take(len)?;
        let start = cache.paths.len();
        if let Some(prev) = cache.entries.last() {
            if cache.paths[prev.path.clone()] >= *path {
                return Err(Rejected::Corrupt("entries out of order"));
            }
        }
        cache.paths.extend_from_slice(path);
        let stat = FileStat {
            size: r.u64()?,
            mtime_ns: r.i64()?,
            ctime_ns: r.i64()?,
            ino: r.u64()?,
            dev: r.u64()?,
            mode: r.u32()?,
        };
        let hash = ContentHash(r.array()?);
        cache.entries.push(Cached { path: start..cache.paths.len(), stat, hash });
    }
    if r.at != body.len() {
        return Err(Rejected::Corrupt("bytes after the last entry"));
    }
    Ok(cache)
}

pub(super) fn load(file: &Path, key: &CacheKey) -> Result<StatCache, Rejected> {
    let bytes = match fs::read(file) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(Rejected::Missing),
        Err(err) => return Err(Rejected::Unreadable(err)),
    };
    decode(bytes, key)
}

/// Writes beside the target and renames over it, so a reader sees the old file or the new one,
/// never half of one; two writers race harmlessly (the last rename wins, both files whole).
pub(super) fn save(cache: &StatCache, file: &Path, key: &CacheKey) -> io::Result<()> {
    write_atomically(file, &encode(cache, key))
}

/// `bytes` as `file`, through a temporary file beside it renamed into place.
pub(super) fn write_atomically(file: &Path, bytes: &[u8]) -> io::Result<()> {
    if let Some(dir) = file.parent() {
        fs::create_dir_all(dir)?;
    }
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = file.with_file_name(format!(".{name}.{}.{:x}", std::process::id(), fastrand::u64(..)));
    let written = fs::File::create(&tmp).and_then(|mut f| f.write_all(bytes));
    match written.and_then(|()| fs::rename(&tmp, file)) {
        Ok(()) => Ok(()),
        Err(err) => {
            let _ = fs::remove_file(&tmp);
            Err(err)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn key() -> CacheKey {
        CacheKey { machine: b"m1".to_vec(), kernel: b"6.1".to_vec(), context: b"/ctx".to_vec(), walk: [3; 32] }
    }

    fn sample() -> StatCache {
        let e = |path: &[u8], n: u8| crate::digest::Entry {
            path: path.to_vec(),
            kind: crate::digest::EntryKind::File,
            size: n as u64,
            link_target: Vec::new(),
            stat: Some(FileStat { size: n as u64, mtime_ns: -5, ctime_ns: 77, ino: 9, dev: 2, mode: 0o100755 }),
            hash: Some(ContentHash([n; 32])),
        };
        let tree = crate::digest::Tree {
            root: PathBuf::from("/ctx"),
            entries: vec![e(b"a", 1), e(b"caf\xe9/b", 2)],
            linked: false,
        };
        StatCache::from_tree(&tree, 1_700_000_000_000_000_000)
    }

    #[test]
    fn a_cache_reads_back_as_written() {
        let (want, back) = (sample(), decode(encode(&sample(), &key()), &key()).unwrap());
        assert_eq!((back.len(), back.stamp_ns()), (want.len(), want.stamp_ns()));
        for e in &want.entries {
            assert_eq!(back.recall(want.path(e), &e.stat), Some(e.hash));
        }
    }

    #[test]
    fn a_cache_for_another_key_is_foreign() {
        let bytes = encode(&sample(), &key());
        for other in [
            CacheKey { machine: b"m2".to_vec(), ..key() },
            CacheKey { kernel: b"6.2".to_vec(), ..key() },
            CacheKey { context: b"/other".to_vec(), ..key() },
            CacheKey { walk: [4; 32], ..key() },
        ] {
            assert!(matches!(decode(bytes.clone(), &other), Err(Rejected::Foreign)), "{other:?}");
        }
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_refused() {
        let bytes = encode(&sample(), &key());
        for len in 0..bytes.len() {
            assert!(decode(bytes[..len].to_vec(), &key()).is_err(), "truncated to {len}");
        }
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            assert!(decode(bad, &key()).is_err(), "byte {at} flipped");
        }
    }
}
