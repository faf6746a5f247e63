//! What each connected agent holds, as the coordinator last saw it, kept both ways round: per
//! stream (does this agent hold X?) and per ref or context (who holds X?).
//!
//! Placement asks "who is warm for this task" once per task and per dispatch; asked of every
//! agent in turn, with a thousand agents that was a million lock-and-hash lookups per round of a
//! farm's burst, the largest cost in the coordinator's profile. Asked of the index it is one.
//!
//! Entries are kept per *stream* (one connection of an agent), not per agent id: an agent that
//! connects again starts empty, and the old stream's late answers can neither fill the new one's
//! inventory nor outlive the old stream in the index.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use super::HeldRef;

/// One connection of an agent: unique for the coordinator's life.
pub type StreamId = u64;

#[derive(Debug, Default)]
pub struct Inventory {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Live streams only: a stream that left is forgotten, and what it reports after is ignored.
    streams: HashMap<StreamId, Sets>,
    /// Normalized ref → the streams whose last listing, or a build since, showed it.
    holders: HashMap<String, Vec<StreamId>>,
    /// Context digest → the streams that built it (their layer cache is warm for it).
    builders: HashMap<String, Vec<StreamId>>,
}

#[derive(Debug, Default)]
struct Sets {
    held: HashSet<String>,
    built: HashSet<String>,
}

impl Inventory {
    /// A stream connected: its inventory starts empty.
    pub fn join(&self, stream: StreamId) {
        self.inner.lock().unwrap().streams.entry(stream).or_default();
    }

    /// A stream ended (or a newer one replaced it): everything it held leaves the index.
    pub fn leave(&self, stream: StreamId) {
        let mut inner = self.inner.lock().unwrap();
        let Some(sets) = inner.streams.remove(&stream) else { return };
        for reference in &sets.held {
            unindex(&mut inner.holders, reference, stream);
        }
        for context in &sets.built {
            unindex(&mut inner.builders, context, stream);
        }
    }

    /// The stream built `reference` from `context`.
    pub fn built(&self, stream: StreamId, reference: HeldRef, context: String) {
        let mut inner = self.inner.lock().unwrap();
        let Inner { streams, holders, builders } = &mut *inner;
        let Some(sets) = streams.get_mut(&stream) else { return };
        if sets.held.insert(reference.0.clone()) {
            holders.entry(reference.0).or_default().push(stream);
        }
        if sets.built.insert(context.clone()) {
            builders.entry(context).or_default().push(stream);
        }
    }

    /// The stream's labeled listing: its held refs are exactly these now (what it built stays).
    pub fn listed(&self, stream: StreamId, refs: HashSet<String>) {
        let mut inner = self.inner.lock().unwrap();
        let Inner { streams, holders, .. } = &mut *inner;
        let Some(sets) = streams.get_mut(&stream) else { return };
        for gone in sets.held.difference(&refs) {
            unindex(holders, gone, stream);
        }
        for new in refs.difference(&sets.held) {
            holders.entry(new.clone()).or_default().push(stream);
        }
        sets.held = refs;
    }

    /// Whether the stream's inventory shows `reference`.
    pub fn holds(&self, stream: StreamId, reference: &HeldRef) -> bool {
        self.inner.lock().unwrap().streams.get(&stream).is_some_and(|s| s.held.contains(&reference.0))
    }

    /// The streams whose inventory shows `reference`.
    pub fn holders(&self, reference: &HeldRef) -> Vec<StreamId> {
        self.inner.lock().unwrap().holders.get(&reference.0).cloned().unwrap_or_default()
    }

    /// The streams warm for a build of `reference` from `context`: they hold the image or built
    /// the context before.
    pub fn warm(&self, reference: &HeldRef, context: &str) -> Vec<StreamId> {
        let inner = self.inner.lock().unwrap();
        let mut warm = inner.holders.get(&reference.0).cloned().unwrap_or_default();
        for s in inner.builders.get(context).into_iter().flatten() {
            if !warm.contains(s) {
                warm.push(*s);
            }
        }
        warm
    }
}

fn unindex(index: &mut HashMap<String, Vec<StreamId>>, key: &str, stream: StreamId) {
    if let Some(streams) = index.get_mut(key) {
        streams.retain(|s| *s != stream);
        if streams.is_empty() {
            index.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> HeldRef {
        HeldRef::of(s)
    }

    #[test]
    fn a_build_and_a_listing_show_in_both_directions() {
        let inv = Inventory::default();
        inv.join(1);
        inv.join(2);
        inv.built(1, r("web:1"), "ctx-a".into());
        assert!(inv.holds(1, &r("web:1")) && !inv.holds(2, &r("web:1")));
        assert_eq!(inv.holders(&r("docker.io/library/web:1")), [1], "one spelling per ref");
        assert_eq!(inv.warm(&r("other:1"), "ctx-a"), [1], "built the context: warm for a new tag of it");
        inv.listed(2, [HeldRef::of("web:1").0, HeldRef::of("db:2").0].into());
        let mut holders = inv.holders(&r("web:1"));
        holders.sort();
        assert_eq!(holders, [1, 2]);
        assert_eq!(inv.warm(&r("web:1"), "ctx-a").len(), 2, "each stream once");
        // A later listing without it: no longer held there, and no longer indexed.
        inv.listed(2, [HeldRef::of("db:2").0].into());
        assert_eq!(inv.holders(&r("web:1")), [1]);
        assert!(inv.holders(&r("db:2")) == [2] && !inv.holds(2, &r("web:1")));
    }

    #[test]
    fn a_stream_that_left_is_forgotten_and_its_late_reports_ignored() {
        let inv = Inventory::default();
        inv.join(1);
        inv.built(1, r("web:1"), "ctx-a".into());
        inv.leave(1);
        assert!(inv.holders(&r("web:1")).is_empty() && inv.warm(&r("web:1"), "ctx-a").is_empty());
        // The old stream's build finishing after it left, and a listing: neither lands.
        inv.built(1, r("web:2"), "ctx-b".into());
        inv.listed(1, [HeldRef::of("web:3").0].into());
        assert!(!inv.holds(1, &r("web:2")) && inv.holders(&r("web:3")).is_empty());
        assert!(inv.inner.lock().unwrap().holders.is_empty() && inv.inner.lock().unwrap().builders.is_empty());
        // The agent's new stream starts empty.
        inv.join(2);
        assert!(!inv.holds(2, &r("web:1")));
    }
}
