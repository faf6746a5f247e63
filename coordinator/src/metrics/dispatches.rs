//! The dispatch log: when each build task was queued and when it got its slot, per ref, for the
//! benchmarks (`kiln-bench farm`) and the scheduler's tests. Process-wide and bounded: the newest
//! entries are kept. The same moments feed `kiln_dispatch_latency_seconds` (`Metrics`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// How many dispatches are remembered.
const KEPT: usize = 100_000;

#[derive(Default)]
struct Dispatches {
    enqueued: HashMap<String, u64>,
    granted: VecDeque<Dispatch>,
}

/// One build task's way through the queue, in microseconds since the epoch.
#[derive(Clone, Debug)]
pub struct Dispatch {
    pub reference: String,
    pub enqueued_us: u64,
    pub granted_us: u64,
}

static DISPATCHES: Mutex<Option<Dispatches>> = Mutex::new(None);

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

pub(crate) fn enqueued(reference: &str) {
    let mut all = DISPATCHES.lock().unwrap();
    let all = all.get_or_insert_with(Dispatches::default);
    if all.enqueued.len() >= KEPT {
        all.enqueued.clear();
    }
    all.enqueued.insert(reference.to_string(), now_us());
}

pub(crate) fn granted(reference: &str) {
    let mut all = DISPATCHES.lock().unwrap();
    let all = all.get_or_insert_with(Dispatches::default);
    let Some(enqueued_us) = all.enqueued.remove(reference) else { return };
    if all.granted.len() >= KEPT {
        all.granted.pop_front();
    }
    all.granted.push_back(Dispatch { reference: reference.to_string(), enqueued_us, granted_us: now_us() });
}

/// The build tasks given a slot, oldest first: when each was queued and when it got its slot.
pub fn dispatches() -> Vec<Dispatch> {
    DISPATCHES.lock().unwrap().as_ref().map(|d| d.granted.iter().cloned().collect()).unwrap_or_default()
}
