//! The current record of each instance, kept in memory: by the SQLite coordinator that owns the
//! file, for every read; and by a PostgreSQL coordinator for the settled converge's read alone
//! ([`StateStore::settled_record`](super::StateStore::settled_record)), whose store checks the
//! generation in the same transaction as it writes.
//!
//! Why: every converge reads its instance's record first, and under a farm's burst those reads
//! queued for the four reader connections behind hundreds of others (a mean of 28 ms per `record`
//! in `kiln-bench farm`'s `/metrics`), the no-op converge a developer waits for among them. A
//! record changes only through this process's writer, so once read it can be answered from here
//! until this process writes it again.
//!
//! Correctness rests on two rules:
//! - Only a process that is the file's one writer keeps the cache ([`SqliteStore::cache_records`]:
//!   the serving coordinator, which holds `$KILN_HOME`'s lock or is the farm's only coordinator on
//!   that directory). A read-only coordinator beside a writing one reads the file every time.
//! - A write forgets the instance's entry after its commit, and a read fills an entry only if no
//!   write forgot it while the read ran: each entry carries a version from one counter, and a fill
//!   names the version it saw before reading. A read that raced a write therefore never leaves the
//!   older record behind.
//!
//! [`SqliteStore::cache_records`]: super::sqlite::SqliteStore::cache_records

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::model::Record;

/// Entries kept at most; past it the cache starts again empty (a farm of more instances pays
/// one read per instance after each reset, as it did on every converge before).
const ENTRIES: usize = 16_384;

#[derive(Default)]
pub(crate) struct RecordCache {
    enabled: AtomicBool,
    slots: Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    /// Versions handed out so far: never reused, so a version seen before a reset never matches
    /// an entry made after it.
    versions: u64,
    by_instance: HashMap<String, Slot>,
}

struct Slot {
    version: u64,
    /// `None`: not known (never read, or written since).
    record: Option<Option<Record>>,
}

/// What a lookup found: the record, or the version a read must name to fill it.
pub(crate) enum Lookup {
    Hit(Option<Record>),
    Miss(Option<u64>),
}

impl RecordCache {
    pub(crate) fn enable(&self) {
        self.enabled.store(true, Ordering::Release);
    }

    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn lookup(&self, instance: &str) -> Lookup {
        if !self.enabled() {
            return Lookup::Miss(None);
        }
        let mut slots = self.slots();
        if let Some(slot) = slots.by_instance.get(instance) {
            return match &slot.record {
                Some(record) => Lookup::Hit(record.clone()),
                None => Lookup::Miss(Some(slot.version)),
            };
        }
        if slots.by_instance.len() >= ENTRIES {
            slots.by_instance.clear();
        }
        slots.versions += 1;
        let version = slots.versions;
        slots.by_instance.insert(instance.to_owned(), Slot { version, record: None });
        Lookup::Miss(Some(version))
    }

    /// Keeps what a read found, unless a write forgot the entry since `version` was handed out.
    pub(crate) fn fill(&self, instance: &str, version: Option<u64>, record: &Option<Record>) {
        let Some(version) = version else { return };
        let mut slots = self.slots();
        if let Some(slot) = slots.by_instance.get_mut(instance).filter(|s| s.version == version) {
            slot.record = Some(record.clone());
        }
    }

    /// After a write of `instance`'s record has ended (committed, refused or failed): the next
    /// read goes to the file, and no read begun before now may fill the entry.
    pub(crate) fn forget(&self, instance: &str) {
        let mut slots = self.slots();
        slots.versions += 1;
        let version = slots.versions;
        if let Some(slot) = slots.by_instance.get_mut(instance) {
            *slot = Slot { version, record: None };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Generation;

    fn record(generation: u64) -> Option<Record> {
        Some(Record { instance: "shop".into(), generation: Generation(generation), images: vec![], written_at_ms: 0 })
    }

    fn enabled() -> RecordCache {
        let cache = RecordCache::default();
        cache.enable();
        cache
    }

    #[test]
    fn a_disabled_cache_never_answers() {
        let cache = RecordCache::default();
        let Lookup::Miss(version) = cache.lookup("shop") else { panic!("a disabled cache answered") };
        cache.fill("shop", version, &record(1));
        assert!(matches!(cache.lookup("shop"), Lookup::Miss(None)));
    }

    #[test]
    fn a_read_fills_and_the_next_lookup_is_answered() {
        let cache = enabled();
        let Lookup::Miss(version) = cache.lookup("shop") else { panic!("an empty cache answered") };
        cache.fill("shop", version, &record(3));
        assert!(matches!(cache.lookup("shop"), Lookup::Hit(r) if r == record(3)));
    }

    #[test]
    fn a_read_that_raced_a_write_does_not_leave_the_older_record() {
        let cache = enabled();
        let Lookup::Miss(version) = cache.lookup("shop") else { panic!("an empty cache answered") };
        // The write commits and forgets the entry while the read, which saw generation 3, runs.
        cache.forget("shop");
        cache.fill("shop", version, &record(3));
        assert!(matches!(cache.lookup("shop"), Lookup::Miss(Some(_))), "the raced read filled the entry");
    }

    #[test]
    fn a_write_forgets_a_known_record() {
        let cache = enabled();
        let Lookup::Miss(version) = cache.lookup("shop") else { panic!("an empty cache answered") };
        cache.fill("shop", version, &record(3));
        cache.forget("shop");
        let Lookup::Miss(version) = cache.lookup("shop") else { panic!("a forgotten entry answered") };
        cache.fill("shop", version, &record(4));
        assert!(matches!(cache.lookup("shop"), Lookup::Hit(r) if r == record(4)));
    }

    #[test]
    fn a_version_from_before_a_reset_never_fills_an_entry_made_after_it() {
        let cache = enabled();
        let Lookup::Miss(stale) = cache.lookup("shop") else { panic!("an empty cache answered") };
        cache.slots().by_instance.clear();
        let Lookup::Miss(fresh) = cache.lookup("shop") else { panic!("an empty cache answered") };
        assert_ne!(stale, fresh);
        cache.fill("shop", stale, &record(3));
        assert!(matches!(cache.lookup("shop"), Lookup::Miss(_)));
    }
}
