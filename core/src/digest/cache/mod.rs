//! The stat cache: per context, each file's `lstat` (size, mtime, ctime, inode, device, mode) and
//! content hash, so that an unchanged file is not read again (DESIGN.md "Specs", tree digest v2).
//!
//! It is trusted only the way git trusts its index. A cached hash is used when the file's stat is
//! exactly the cached one *and* the file is not **racily clean**: its mtime and ctime must be
//! strictly older than the moment the run that hashed it started, less a margin. Without that rule
//! an edit landing in the same timestamp tick as the hash read — same size, same mtime — would keep
//! a stale hash forever. Why it is safe: the stamp is taken before the walk, so a file changed
//! after its content was read changes at a time after the stamp; its kernel timestamp is then at
//! least the stamp minus the clock's and the filesystem's granularity, which the margin covers, and
//! cannot equal an older cached one. ctime counts as well as mtime because `utimensat` can put an
//! mtime back but not a ctime.
//!
//! The file is per context root, keyed by machine, kernel, context path, `.dockerignore` and the
//! walk's options, and checksummed: a cache copied from elsewhere, written by another kernel (whose
//! inode or device numbering may differ), under other ignore rules, or torn is ignored — never
//! trusted — and rewritten. It is written to a temporary file and renamed into place; it is not
//! `fsync`ed, since a file torn by a crash fails its checksum and only costs one full read.

mod format;
mod vouched;

pub use format::Rejected;
pub use vouched::{digest_dir_vouched, vouched_file_for, Summary};

use super::{hash_tree, walk_tree, ContentHash, DigestError, Hashed, Tree, WalkOptions};
use std::fs;
use std::ops::Range;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// What the stat cache compares: a file's `lstat` as the walk saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileStat {
    pub size: u64,
    /// Nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    pub dev: u64,
    /// The whole `st_mode`, type and permission bits: a mode flip is a different stat.
    pub mode: u32,
}

impl FileStat {
    pub fn of(meta: &fs::Metadata) -> FileStat {
        FileStat {
            size: meta.size(),
            mtime_ns: nanos(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: nanos(meta.ctime(), meta.ctime_nsec()),
            ino: meta.ino(),
            dev: meta.dev(),
            mode: meta.mode(),
        }
    }
}

fn nanos(secs: i64, nsec: i64) -> i64 {
    secs.saturating_mul(1_000_000_000).saturating_add(nsec)
}

/// How much older than the stamp a file's timestamps must be on filesystems with nanosecond
/// timestamps: the kernel stamps files from a clock that lags the one read for the stamp by up to
/// a tick (10 ms at the lowest common `HZ`); 100 ms leaves room for that many times over.
pub const FINE_MARGIN_NS: i64 = 100_000_000;
/// The same where a file's timestamps carry no nanoseconds at all, taken as a filesystem that
/// keeps whole seconds (ext3, HFS+) or even two (FAT): an edit a second after the stamp can still
/// be dated before it there.
pub const COARSE_MARGIN_NS: i64 = 3_000_000_000;

/// True when a file whose stat matches its cached one may be taken at its cached hash: its
/// timestamps are older than the stamp of the run that hashed it, by the margin (the racy-clean
/// rule, above).
pub fn settled(stat: &FileStat, stamp_ns: i64) -> bool {
    let whole_seconds = stat.mtime_ns % 1_000_000_000 == 0 && stat.ctime_ns % 1_000_000_000 == 0;
    let margin = if whole_seconds { COARSE_MARGIN_NS } else { FINE_MARGIN_NS };
    stat.mtime_ns.max(stat.ctime_ns) < stamp_ns.saturating_sub(margin)
}

/// The current time as a stamp: nanoseconds since the Unix epoch.
pub fn stamp_now() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    i64::try_from(since.as_nanos()).unwrap_or(i64::MAX)
}

/// One context's stat cache, its entries in the walk's order (byte order of path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatCache {
    /// When the run that wrote it started (before its walk), in nanoseconds since the epoch.
    stamp_ns: i64,
    /// Every path, back to back; entries point into it (one allocation, not one per file).
    paths: Vec<u8>,
    entries: Vec<Cached>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Cached {
    path: Range<usize>,
    stat: FileStat,
    hash: ContentHash,
}

impl StatCache {
    /// The cache of a hashed tree: every file entry that carries both its stat and its hash.
    /// `stamp_ns` must have been taken before `tree` was walked.
    pub fn from_tree(tree: &Tree, stamp_ns: i64) -> StatCache {
        let mut paths = Vec::new();
        let mut entries = Vec::new();
        for e in &tree.entries {
            if let (Some(stat), Some(hash)) = (e.stat, e.hash) {
                let start = paths.len();
                paths.extend_from_slice(&e.path);
                entries.push(Cached { path: start..paths.len(), stat, hash });
            }
        }
        StatCache { stamp_ns, paths, entries }
    }

    /// The cached hash of the file at `path`, if its stat is the cached one and it has settled.
    pub fn recall(&self, path: &[u8], stat: &FileStat) -> Option<ContentHash> {
        let at = self.entries.binary_search_by(|c| self.path(c).cmp(path)).ok()?;
        self.vouch(&self.entries[at], stat)
    }

    /// A cursor that recalls paths given in increasing order by walking the cache once, as a
    /// walk's entries come: a merge instead of a binary search per file.
    pub fn cursor(&self) -> Cursor<'_> {
        Cursor { cache: self, next: 0 }
    }

    fn path(&self, c: &Cached) -> &[u8] {
        &self.paths[c.path.clone()]
    }

    fn vouch(&self, cached: &Cached, stat: &FileStat) -> Option<ContentHash> {
        (cached.stat == *stat && settled(stat, self.stamp_ns)).then_some(cached.hash)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn stamp_ns(&self) -> i64 {
        self.stamp_ns
    }
}

/// See [`StatCache::cursor`].
#[derive(Debug)]
pub struct Cursor<'a> {
    cache: &'a StatCache,
    next: usize,
}

impl Cursor<'_> {
    /// [`StatCache::recall`] for a path after every path asked before; a path out of order is
    /// simply not found (and so read), never mistaken for another.
    pub fn recall(&mut self, path: &[u8], stat: &FileStat) -> Option<ContentHash> {
        let entries = &self.cache.entries;
        while self.next < entries.len() && self.cache.path(&entries[self.next]) < path {
            self.next += 1;
        }
        let cached = entries.get(self.next).filter(|c| self.cache.path(c) == path)?;
        self.next += 1;
        self.cache.vouch(cached, stat)
    }
}

/// What a cache file must match to be trusted. Fields are public so that a test can stand in for
/// another machine or kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    /// `/etc/machine-id`, else the host name: inode and device numbers mean nothing elsewhere.
    pub machine: Vec<u8>,
    /// The kernel's release and build: another kernel may number devices differently.
    pub kernel: Vec<u8>,
    /// The context's canonical path.
    pub context: Vec<u8>,
    /// blake3 of the `.dockerignore` (empty when there is none) and the walk's options: what
    /// decides which entries the walk lists.
    pub walk: [u8; 32],
}

impl CacheKey {
    /// The key of the context at `root` walked with `opts`, on this machine and kernel.
    pub fn here(root: &Path, opts: &WalkOptions) -> CacheKey {
        let first = |paths: &[&str]| paths.iter().find_map(|p| fs::read(p).ok()).unwrap_or_default();
        let machine = first(&["/etc/machine-id", "/var/lib/dbus/machine-id", "/proc/sys/kernel/hostname"]);
        let mut kernel = first(&["/proc/sys/kernel/osrelease"]);
        kernel.extend_from_slice(&first(&["/proc/sys/kernel/version"]));
        let context = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
        let mut walk = blake3::Hasher::new();
        let ignore = fs::read(root.join(".dockerignore")).unwrap_or_default();
        walk.update(&(ignore.len() as u64).to_le_bytes()).update(&ignore);
        walk.update(opts.dockerfile.as_deref().unwrap_or("").as_bytes());
        CacheKey {
            machine,
            kernel,
            context: context.as_os_str().as_bytes().to_vec(),
            walk: *walk.finalize().as_bytes(),
        }
    }
}

/// The cache file of the context at `root` under `cache_dir`: one file per context path.
pub fn cache_file_for(cache_dir: &Path, root: &Path) -> PathBuf {
    let context = fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let name = blake3::hash(context.as_os_str().as_bytes()).to_hex();
    cache_dir.join(format!("{}.stat", &name[..32]))
}

/// How a cached digest went with its cache.
#[derive(Debug)]
pub struct CacheUse {
    /// Why the cache file was not used, if it was not (a first run finds it `Missing`).
    pub rejected: Option<Rejected>,
    /// Whether a new cache file was written (not when every file was recalled and none is gone).
    pub written: bool,
    /// A cache that could not be written costs the next run a full read, never the digest.
    pub write_error: Option<std::io::Error>,
}

/// Walks and digests the context at `root` like [`super::digest_dir`], taking unchanged files'
/// hashes from the stat cache in `cache_file` and writing it back.
pub fn digest_dir_cached(
    root: &Path,
    opts: &WalkOptions,
    cache_file: &Path,
) -> Result<(Tree, Hashed, CacheUse), DigestError> {
    // Before the walk: every stat and read below happens after it (the racy-clean rule).
    let stamp = stamp_now();
    // The cache file is read while the tree is walked: neither needs the other, and reading and
    // checking a 20,000-file cache (2 MB) after the walk cost 2–3 ms of a 36 ms warm digest.
    let (walked, (key, loaded)) = std::thread::scope(|scope| {
        let loader = scope.spawn(|| {
            let key = CacheKey::here(root, opts);
            let loaded = format::load(cache_file, &key);
            (key, loaded)
        });
        let walked = walk_tree(root, opts);
        (walked, loader.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    });
    let mut tree = walked?;
    let (cache, rejected) = match loaded {
        Ok(cache) => (Some(cache), None),
        Err(why) => (None, Some(why)),
    };
    let hashed = hash_tree(&mut tree, cache.as_ref())?;
    let unchanged = cache.as_ref().is_some_and(|c| hashed.read == 0 && hashed.recalled == c.len());
    let mut used = CacheUse { rejected, written: false, write_error: None };
    if !unchanged {
        match format::save(&StatCache::from_tree(&tree, stamp), cache_file, &key) {
            Ok(()) => used.written = true,
            Err(err) => used.write_error = Some(err),
        }
    }
    Ok((tree, hashed, used))
}

impl StatCache {
    /// Reads the cache file at `file`, refusing one that does not match `key` or its checksum.
    pub fn load(file: &Path, key: &CacheKey) -> Result<StatCache, Rejected> {
        format::load(file, key)
    }

    /// Writes the cache to `file` atomically (a temporary file renamed into place).
    pub fn save(&self, file: &Path, key: &CacheKey) -> std::io::Result<()> {
        format::save(self, file, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(mtime_ns: i64, ctime_ns: i64) -> FileStat {
        FileStat { size: 4, mtime_ns, ctime_ns, ino: 7, dev: 1, mode: 0o100644 }
    }

    const S: i64 = 1_700_000_000_123_456_789;

    #[test]
    fn a_file_touched_within_the_margin_of_the_stamp_is_racy() {
        assert!(settled(&stat(S - FINE_MARGIN_NS - 1, S - FINE_MARGIN_NS - 1), S));
        assert!(!settled(&stat(S - FINE_MARGIN_NS, S - FINE_MARGIN_NS), S), "exactly at the margin");
        assert!(!settled(&stat(S - 1, S - 1), S));
        assert!(!settled(&stat(S + 5, S + 5), S), "a timestamp after the stamp");
    }

    #[test]
    fn a_late_ctime_makes_a_file_racy_whatever_its_mtime() {
        // `utimensat` can put an mtime back to before the stamp; the ctime then says when.
        assert!(!settled(&stat(S - 60_000_000_000, S - 1_000), S));
    }

    #[test]
    fn whole_second_timestamps_get_the_coarse_margin() {
        let second = (S / 1_000_000_000 - 2) * 1_000_000_000;
        assert!(!settled(&stat(second, second), S), "two seconds before, on a whole-second filesystem");
        let older = second - COARSE_MARGIN_NS;
        assert!(settled(&stat(older, older), S));
        assert!(settled(&stat(second + 1, second + 1), S), "nanoseconds present: the fine margin");
    }

    #[test]
    fn recall_needs_the_same_stat_and_a_settled_file() {
        let old = S - 10_000_000_000;
        let hash = ContentHash([9; 32]);
        let mk = |path: &[u8]| super::super::Entry {
            path: path.to_vec(),
            kind: super::super::EntryKind::File,
            size: 4,
            link_target: Vec::new(),
            stat: Some(stat(old, old)),
            hash: Some(hash),
        };
        let tree = Tree { root: PathBuf::from("/ctx"), entries: vec![mk(b"a"), mk(b"b/c"), mk(b"d")], linked: false };
        let cache = StatCache::from_tree(&tree, S);
        assert_eq!(cache.recall(b"b/c", &stat(old, old)), Some(hash));
        assert_eq!(cache.recall(b"b/x", &stat(old, old)), None, "not cached");
        assert_eq!(cache.recall(b"d", &stat(old, old + 1)), None, "ctime moved");
        let moved = FileStat { ino: 8, ..stat(old, old) };
        assert_eq!(cache.recall(b"a", &moved), None, "another inode");
        let chmodded = FileStat { mode: 0o100755, ..stat(old, old) };
        assert_eq!(cache.recall(b"a", &chmodded), None, "mode flipped");
        let racy = StatCache::from_tree(&tree, old + FINE_MARGIN_NS);
        assert_eq!(racy.recall(b"a", &stat(old, old)), None, "hashed within the racy window");

        let mut cursor = cache.cursor();
        assert_eq!(cursor.recall(b"a", &stat(old, old)), Some(hash));
        assert_eq!(cursor.recall(b"b", &stat(old, old)), None, "not cached, between two that are");
        assert_eq!(cursor.recall(b"d", &stat(old, old)), Some(hash), "b/c skipped over");
        assert_eq!(cursor.recall(b"a", &stat(old, old)), None, "out of order: not found, not wrong");
    }
}
