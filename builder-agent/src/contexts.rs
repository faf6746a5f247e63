//! The agent's verified context archives, kept by tree digest so that a task for a context this
//! agent already fetched neither downloads nor verifies it again.
//!
//! The coordinator's placement prefers the agent that built a context before (cache affinity,
//! DESIGN.md "Scheduling"); without this cache that preference only bought Docker's layer cache,
//! and every rebuild, every second image built from one shared context and every platform of a
//! multi-platform build still fetched the whole archive and hashed it again.
//!
//! - An archive enters only after it verified against its digest, under the digest's name: a hit
//!   is exactly as trustworthy as a fresh verify.
//! - A task gets a hard link of its own (its usual `<digest>-<nonce>.tar` in the scratch
//!   directory), so an eviction never pulls the file from under a running build and the task
//!   removes its link as before.
//! - Tasks for one digest take turns at the gate: the second waits for the first's fetch and
//!   then links it, rather than fetching the same bytes twice.
//! - Bounded by a byte budget (`--context-cache`), least recently used out first; an archive
//!   larger than the budget is used and not kept.
//! - Emptied when the agent starts: an entry linked in without an fsync may be torn after a
//!   crash, and a cache is cheaper to refill than to check. Only its own `<digest>.tar` names are
//!   removed.

use kiln_core::digest::TreeDigest;
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The default byte budget of a served agent's cache.
pub const DEFAULT_BUDGET: u64 = 2 << 30;

/// Where the cache lives inside the agent's scratch directory.
const DIR: &str = "kiln-contexts";

#[derive(Debug)]
pub(crate) struct ContextCache {
    dir: PathBuf,
    budget: u64,
    index: Mutex<Index>,
    /// One gate per digest being placed: tasks for one context fetch it once.
    gates: Mutex<HashMap<TreeDigest, Arc<tokio::sync::Mutex<()>>>>,
}

#[derive(Debug, Default)]
struct Index {
    entries: HashMap<TreeDigest, Entry>,
    bytes: u64,
    /// Bumped at every use: the least recently used entry has the smallest.
    clock: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    bytes: u64,
    used: u64,
}

/// How a task's archive was placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placed {
    /// Linked from the cache: not downloaded, not verified again.
    Held,
    /// Fetched and verified by this task.
    Fetched,
}

impl ContextCache {
    /// The cache under `scratch`, emptied; `budget` 0 keeps nothing (every task fetches).
    pub(crate) fn open(scratch: &Path, budget: u64) -> ContextCache {
        let dir = scratch.join(DIR);
        empty(&dir);
        let made = if budget > 0 { std::fs::create_dir_all(&dir) } else { Ok(()) };
        let budget = match made {
            Ok(()) => budget,
            Err(err) => {
                tracing::warn!(dir = %dir.display(), %err, "no context cache: every build fetches its context");
                0
            }
        };
        ContextCache { dir, budget, index: Mutex::default(), gates: Mutex::default() }
    }

    /// Puts the verified archive of `digest` at `archive` (a path of the task's own): linked from
    /// the cache when it holds it, else made by `fetch` (which downloads and verifies into
    /// `archive`) and kept.
    pub(crate) async fn place<E, F, Fut>(&self, digest: &TreeDigest, archive: &Path, fetch: F) -> Result<Placed, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        if self.budget == 0 {
            return fetch().await.map(|()| Placed::Fetched);
        }
        let gate = self.gates.lock().unwrap().entry(*digest).or_default().clone();
        let placed = {
            let _turn = gate.lock().await;
            match self.link_out(digest, archive) {
                true => Ok(Placed::Held),
                false => match fetch().await {
                    Ok(()) => {
                        self.keep(digest, archive);
                        Ok(Placed::Fetched)
                    }
                    Err(err) => Err(err),
                },
            }
        };
        let mut gates = self.gates.lock().unwrap();
        // Only the map and this task hold it: nobody waits at this gate.
        if Arc::strong_count(&gate) == 2 {
            gates.remove(digest);
        }
        placed
    }

    fn path(&self, digest: &TreeDigest) -> PathBuf {
        self.dir.join(format!("{digest}.tar"))
    }

    /// Links the held archive to `archive`; false when not held (or gone from the disk).
    fn link_out(&self, digest: &TreeDigest, archive: &Path) -> bool {
        let mut index = self.index.lock().unwrap();
        index.clock += 1;
        let now = index.clock;
        let Some(entry) = index.entries.get_mut(digest) else { return false };
        entry.used = now;
        // A hard link is one metadata write: done in place rather than on the blocking pool,
        // whose hand-off costs more than the link.
        match std::fs::hard_link(self.path(digest), archive) {
            Ok(()) => true,
            Err(err) => {
                tracing::warn!(context = %digest, %err, "a cached context could not be linked; fetching it again");
                let gone = index.entries.remove(digest).map_or(0, |e| e.bytes);
                index.bytes -= gone;
                let _ = std::fs::remove_file(self.path(digest));
                false
            }
        }
    }

    /// Keeps the just-verified `archive` of `digest`, evicting the least recently used beyond the budget.
    fn keep(&self, digest: &TreeDigest, archive: &Path) {
        let Ok(bytes) = std::fs::metadata(archive).map(|m| m.len()) else { return };
        if bytes > self.budget {
            return;
        }
        let path = self.path(digest);
        let _ = std::fs::remove_file(&path);
        if let Err(err) = std::fs::hard_link(archive, &path) {
            tracing::warn!(context = %digest, %err, "a verified context could not be kept");
            return;
        }
        let mut index = self.index.lock().unwrap();
        index.clock += 1;
        let used = index.clock;
        if let Some(old) = index.entries.insert(*digest, Entry { bytes, used }) {
            index.bytes -= old.bytes;
        }
        index.bytes += bytes;
        while index.bytes > self.budget {
            let Some((&oldest, _)) = index.entries.iter().min_by_key(|(_, e)| e.used) else { break };
            let gone = index.entries.remove(&oldest).map_or(0, |e| e.bytes);
            index.bytes -= gone;
            let _ = std::fs::remove_file(self.path(&oldest));
        }
    }

    /// The digests held now (tests).
    #[cfg(test)]
    fn held(&self) -> Vec<TreeDigest> {
        self.index.lock().unwrap().entries.keys().copied().collect()
    }
}

/// Removes the archives a cache in `dir` kept (`<64 hex>.tar`), and nothing else: a file of
/// another name there is not Kiln's to remove, whoever pointed `--scratch` at that directory.
fn empty(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let ours = name
            .to_str()
            .and_then(|n| n.strip_suffix(".tar"))
            .is_some_and(|stem| stem.len() == 64 && stem.bytes().all(|b| b.is_ascii_hexdigit()));
        if ours {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn digest(n: u8) -> TreeDigest {
        TreeDigest([n; 32])
    }

    /// A fetch that writes `bytes` bytes of `fill` to `archive` and counts itself.
    async fn fetch(archive: &Path, bytes: usize, fill: u8, count: &AtomicUsize) -> Result<(), String> {
        count.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        std::fs::write(archive, vec![fill; bytes]).map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_second_task_for_a_context_links_the_first_ones_archive_without_fetching() {
        let scratch = tempfile::tempdir().unwrap();
        let cache = ContextCache::open(scratch.path(), 1 << 20);
        let fetches = AtomicUsize::new(0);
        let (a, b) = (scratch.path().join("a.tar"), scratch.path().join("b.tar"));
        let first = cache.place(&digest(1), &a, || fetch(&a, 100, 7, &fetches)).await.unwrap();
        std::fs::remove_file(&a).unwrap();
        let second = cache.place(&digest(1), &b, || fetch(&b, 100, 9, &fetches)).await.unwrap();
        assert_eq!((first, second), (Placed::Fetched, Placed::Held));
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        assert_eq!(std::fs::read(&b).unwrap(), vec![7; 100], "the second task got the first one's bytes");
    }

    #[tokio::test]
    async fn tasks_for_one_context_at_once_fetch_it_once() {
        let scratch = tempfile::tempdir().unwrap();
        let cache = ContextCache::open(scratch.path(), 1 << 20);
        let fetches = AtomicUsize::new(0);
        let paths: Vec<PathBuf> = (0..4).map(|i| scratch.path().join(format!("t{i}.tar"))).collect();
        let two = digest(2);
        let placed =
            futures_util::future::join_all(paths.iter().map(|p| cache.place(&two, p, || fetch(p, 10, 1, &fetches))))
                .await;
        assert_eq!(fetches.load(Ordering::SeqCst), 1);
        assert_eq!(placed.iter().filter(|p| **p == Ok(Placed::Fetched)).count(), 1);
        assert!(paths.iter().all(|p| std::fs::read(p).unwrap() == vec![1; 10]));
        assert!(cache.gates.lock().unwrap().is_empty(), "no gate outlives its waiters");
    }

    #[tokio::test]
    async fn a_failed_fetch_keeps_nothing_and_the_next_task_fetches_again() {
        let scratch = tempfile::tempdir().unwrap();
        let cache = ContextCache::open(scratch.path(), 1 << 20);
        let archive = scratch.path().join("x.tar");
        let refused: Result<Placed, String> =
            cache.place(&digest(3), &archive, || async { Err("mismatch".into()) }).await;
        assert_eq!(refused, Err("mismatch".to_string()));
        assert!(cache.held().is_empty());
        let fetches = AtomicUsize::new(0);
        let placed = cache.place(&digest(3), &archive, || fetch(&archive, 5, 3, &fetches)).await.unwrap();
        assert_eq!((placed, fetches.load(Ordering::SeqCst)), (Placed::Fetched, 1));
    }

    #[tokio::test]
    async fn the_budget_evicts_the_least_recently_used_and_never_a_linked_task_archive() {
        let scratch = tempfile::tempdir().unwrap();
        let cache = ContextCache::open(scratch.path(), 250);
        let fetches = AtomicUsize::new(0);
        let path = |n: u8| scratch.path().join(format!("task{n}.tar"));
        for n in [1, 2] {
            let p = path(n);
            cache.place(&digest(n), &p, || fetch(&p, 100, n, &fetches)).await.unwrap();
        }
        // 1 is used again, so 2 is the least recent when 3 arrives.
        let again = scratch.path().join("again.tar");
        assert_eq!(cache.place(&digest(1), &again, || fetch(&again, 100, 0, &fetches)).await, Ok(Placed::Held));
        let p3 = path(3);
        cache.place(&digest(3), &p3, || fetch(&p3, 100, 3, &fetches)).await.unwrap();
        let mut held = cache.held();
        held.sort();
        assert_eq!(held, vec![digest(1), digest(3)]);
        assert!(!cache.path(&digest(2)).exists(), "the evicted archive left the cache");
        assert_eq!(std::fs::read(path(2)).unwrap(), vec![2; 100], "a task's own link outlives the eviction");
        // Larger than the whole budget: used, not kept.
        let big = scratch.path().join("big.tar");
        cache.place(&digest(4), &big, || fetch(&big, 300, 4, &fetches)).await.unwrap();
        assert!(!cache.held().contains(&digest(4)));
    }

    #[tokio::test]
    async fn a_budget_of_zero_fetches_every_time_and_an_agent_start_empties_the_cache() {
        let scratch = tempfile::tempdir().unwrap();
        let fetches = AtomicUsize::new(0);
        let archive = scratch.path().join("a.tar");
        let kept = ContextCache::open(scratch.path(), 1 << 20);
        kept.place(&digest(5), &archive, || fetch(&archive, 10, 5, &fetches)).await.unwrap();
        assert!(kept.path(&digest(5)).exists());
        let someone_elses = scratch.path().join(DIR).join("notes.txt");
        std::fs::write(&someone_elses, "not Kiln's").unwrap();
        let restarted = ContextCache::open(scratch.path(), 1 << 20);
        assert!(!restarted.path(&digest(5)).exists(), "a restarted agent trusts nothing it kept before");
        assert!(someone_elses.exists(), "only the cache's own archives are removed");
        let off = ContextCache::open(scratch.path(), 0);
        for _ in 0..2 {
            assert_eq!(off.place(&digest(5), &archive, || fetch(&archive, 10, 5, &fetches)).await, Ok(Placed::Fetched));
        }
        assert_eq!(fetches.load(Ordering::SeqCst), 3);
    }
}
