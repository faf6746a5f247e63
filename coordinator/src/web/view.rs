//! What the status page shows, gathered in one place: the page renders it as HTML
//! (`render.rs`) and `/api/status` serves it as JSON, so the two never disagree.
//!
//! Everything is read: the state store (agents ever seen, converges, records, owners), the hub
//! (who is connected now, slots) and the queue (tasks queued and building). The byte ledger is the
//! sweep's dry-run plan, which lists every store through its agent, so it is made at most every
//! [`LEDGER_FRESH`] and only while someone looks, in the background; the page says how old it is.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::engine::{now_ms, Engine};
use crate::model::{Converge, ConvergeState, EventKind, Record, RecordedKind};
use crate::state::StateError;
use crate::sweep::Ledger;
use crate::trust::Principal;

/// The most converges listed.
const CONVERGES: usize = 20;
/// The most gc converges listed as recent sweeps.
const SWEEPS: usize = 10;
/// How old the byte ledger may be before a look asks for a new one.
pub(crate) const LEDGER_FRESH: Duration = Duration::from_secs(30);
/// How old it may be once a converge ended after its listing.
const LEDGER_SOON: Duration = Duration::from_secs(3);

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Status {
    pub farm: String,
    pub version: &'static str,
    pub now_ms: u64,
    /// Who is looking: `user:vera (viewer)`, or `open (no TLS)`.
    pub viewer: String,
    /// Set while this coordinator stands by: where the farm's active coordinator serves (empty
    /// while none holds the lease). A standby has no agents and lists no store.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub standby: Option<String>,
    pub agents: Vec<Agent>,
    /// Build slots of the connected host agents, and how many are busy.
    pub slots: u32,
    pub busy: u32,
    pub converges: Vec<ConvergeRow>,
    /// The converge whose log the page shows unless the reader picks one: the newest running,
    /// else the newest.
    pub follow: Option<String>,
    pub instances: Vec<Instance>,
    pub ledger: LedgerView,
    pub sweeps: Vec<Sweep>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Agent {
    pub id: String,
    pub role: String,
    pub platforms: Vec<String>,
    pub stores: Vec<String>,
    /// Announced build slots; unknown (0) for an agent not connected now.
    pub slots: u32,
    pub busy: u32,
    pub version: String,
    pub last_seen_ms: u64,
    pub connected: bool,
    /// Connected, but going away: it finishes what it runs and takes nothing new.
    pub draining: bool,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ConvergeRow {
    pub id: String,
    pub instance: String,
    /// `running`, `succeeded` or `failed`.
    pub state: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub requested_by: String,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    /// Its build tasks queued and building on this coordinator (none once it ended).
    pub tasks: Vec<Task>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Task {
    pub image: String,
    pub reference: String,
    /// `queued`, `building` or `delivering`.
    pub state: &'static str,
    pub agent: String,
    /// Queued: its place in the fair queue (1 = next).
    pub position: u32,
    pub for_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Instance {
    pub instance: String,
    pub generation: u64,
    pub written_at_ms: u64,
    /// Who ran the converge that wrote this generation, when its converge is still listed.
    pub written_by: Option<String>,
    pub owner: Option<String>,
    pub images: Vec<Image>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Image {
    pub name: String,
    pub reference: String,
    pub kind: &'static str,
    /// The `USER` the image declares; `None` when it declares none (it runs as root).
    pub user: Option<String>,
    pub target: String,
}

#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct LedgerView {
    pub ledger: Option<Ledger>,
    /// When the stores were listed for it.
    pub listed_ms: Option<u64>,
    /// Why the last try failed, if it did.
    pub error: Option<String>,
    /// A newer one is being made.
    pub refreshing: bool,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Sweep {
    pub id: String,
    /// `gc`, `gc --dry-run`, `gc --instance shop`.
    pub job: String,
    pub state: &'static str,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub requested_by: String,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    /// Confirmed removed (or, for a dry run, planned): images freed, refs removed, bytes.
    pub images: u64,
    pub removals: u64,
    pub bytes: u64,
    pub failures: u64,
}

/// What the page remembers between looks: facts that never change once known, and the ledger.
#[derive(Debug, Default)]
pub(crate) struct Known {
    /// `(instance, generation)` → who ran the converge that wrote it (`None`: not found).
    writers: Mutex<HashMap<(String, u64), Option<String>>>,
    owners: Mutex<HashMap<String, String>>,
    /// Finished gc converges, summarized once.
    sweeps: Mutex<HashMap<String, Sweep>>,
    ledger: Mutex<LedgerSlot>,
}

#[derive(Debug, Default)]
struct LedgerSlot {
    view: LedgerView,
    /// When the last refresh started (ms), so a look within [`LEDGER_FRESH`] starts none.
    started_ms: Option<u64>,
}

/// Reads everything the page shows.
pub(crate) async fn gather(
    engine: &Arc<Engine>,
    known: &Arc<Known>,
    principal: &Principal,
    open: bool,
    standby: Option<String>,
) -> Result<Status, StateError> {
    let store = &engine.store;
    let now = now_ms();
    let tasks = engine.hub.schedule.tasks();
    let (slots, busy) = engine.hub.schedule.slots();
    let agents = agents(engine, &tasks).await?;
    let converges: Vec<ConvergeRow> = store
        .converges(None, CONVERGES)
        .await?
        .into_iter()
        .map(|c| {
            let mut mine: Vec<Task> = tasks
                .iter()
                .filter(|t| t.task.converge == c.id.as_str())
                .map(|t| Task {
                    image: t.task.image.clone(),
                    reference: t.task.reference.clone(),
                    state: t.state(),
                    agent: t.agent.clone(),
                    position: t.position,
                    for_ms: t.since.elapsed().as_millis() as u64,
                })
                .collect();
            mine.sort_by(|a, b| (a.state, a.position, &a.image).cmp(&(b.state, b.position, &b.image)));
            converge_row(c, mine)
        })
        .collect();
    let last_finished = converges.iter().filter_map(|c| c.finished_ms).max().unwrap_or(0);
    let follow = converges.iter().find(|c| c.state == "running").or(converges.first()).map(|c| c.id.clone());
    let mut instances = Vec::new();
    for (record, _) in store.records().await? {
        instances.push(instance(engine, known, record).await?);
    }
    let sweeps = sweeps(engine, known).await?;
    let viewer = match principal {
        _ if open => "open (no TLS: --dev)".to_string(),
        Principal::User { role, .. } => format!("{} ({})", principal.actor(), role.name()),
        other => other.actor(),
    };
    Ok(Status {
        farm: engine.config.farm.clone(),
        version: crate::hub::VERSION,
        now_ms: now,
        viewer,
        agents,
        slots,
        busy,
        converges,
        follow,
        instances,
        ledger: match &standby {
            None => ledger(engine, known, last_finished),
            Some(_) => LedgerView {
                error: Some("this coordinator stands by: the active one lists the stores".to_string()),
                ..LedgerView::default()
            },
        },
        standby,
        sweeps,
    })
}

/// Every agent ever seen, the connected ones first, as they are now.
async fn agents(engine: &Engine, tasks: &[crate::schedule::TaskView]) -> Result<Vec<Agent>, StateError> {
    let connected = engine.hub.present();
    let busy = |id: &str| tasks.iter().filter(|t| t.agent == id).count() as u32;
    let mut agents: Vec<Agent> = connected
        .iter()
        .map(|conn| Agent {
            id: conn.id.clone(),
            role: conn.role.name().to_string(),
            platforms: conn.platforms.clone(),
            stores: conn.stores().into_iter().map(|s| s.id).collect(),
            slots: if conn.is_host() { conn.slots } else { 0 },
            busy: busy(&conn.id),
            version: conn.version.clone(),
            last_seen_ms: conn.last_seen_ms(),
            connected: true,
            draining: conn.is_draining(),
        })
        .collect();
    for row in engine.store.agents().await? {
        if connected.iter().any(|c| c.id == row.id.0) {
            continue;
        }
        agents.push(Agent {
            id: row.id.0,
            role: row.role.name().to_string(),
            platforms: row.platforms,
            stores: row.stores,
            slots: 0,
            busy: 0,
            version: row.version,
            last_seen_ms: row.last_seen_ms,
            connected: false,
            draining: false,
        });
    }
    Ok(agents)
}

fn converge_row(c: Converge, tasks: Vec<Task>) -> ConvergeRow {
    let reason = match &c.state {
        ConvergeState::Failed { reason } => reason.clone(),
        _ => String::new(),
    };
    ConvergeRow {
        id: c.id.to_string(),
        instance: c.instance,
        state: c.state.name(),
        reason,
        requested_by: c.requested_by,
        started_ms: c.started_ms,
        finished_ms: c.finished_ms,
        tasks,
    }
}

async fn instance(engine: &Engine, known: &Known, record: Record) -> Result<Instance, StateError> {
    let cached = known.owners.lock().unwrap().get(&record.instance).cloned();
    let owner = match cached {
        Some(owner) => Some(owner),
        None => {
            // An instance's owner is set once, at its first converge, and never moves.
            let found = engine.store.owner(&record.instance).await?.map(|o| o.to_string());
            if let Some(owner) = &found {
                known.owners.lock().unwrap().insert(record.instance.clone(), owner.clone());
            }
            found
        }
    };
    let key = (record.instance.clone(), record.generation.0);
    let cached = known.writers.lock().unwrap().get(&key).cloned();
    let written_by = match cached {
        Some(writer) => writer,
        None => {
            let converges = engine.store.converges(Some(&record.instance), 50).await?;
            let (writer, settled) = writer_of(&record, &converges);
            if settled {
                known.writers.lock().unwrap().insert(key, writer.clone());
            }
            writer
        }
    };
    let images = record
        .images
        .iter()
        .map(|i| Image {
            name: i.name.clone(),
            reference: i.reference.clone(),
            kind: match i.kind {
                RecordedKind::Built => "built",
                RecordedKind::Brought => "brought",
                RecordedKind::Pinned => "pinned",
            },
            user: i.user.clone(),
            target: i.target.clone(),
        })
        .collect();
    Ok(Instance {
        instance: record.instance,
        generation: record.generation.0,
        written_at_ms: record.written_at_ms,
        written_by,
        owner,
        images,
    })
}

/// Who wrote `record`: the requester of the instance's converge that was running when the record
/// was written (one converge per instance runs at a time, and a generation is written inside its
/// converge). The record keeps no author of its own; a converge row is never deleted, so this is
/// found while the converge is among the instance's `converges` listed. Returns whether the answer
/// is final: not while the writer is still running (it may be the one), nor ever changes after.
fn writer_of(record: &Record, converges: &[Converge]) -> (Option<String>, bool) {
    let at = record.written_at_ms;
    let during = converges.iter().find(|c| c.started_ms <= at && c.finished_ms.is_none_or(|end| at <= end));
    match during {
        Some(c) => (Some(c.requested_by.clone()), c.finished_ms.is_some()),
        None => (None, true),
    }
}

/// The recent gc converges, each summarized from its events once it finished.
async fn sweeps(engine: &Engine, known: &Known) -> Result<Vec<Sweep>, StateError> {
    let mut sweeps = Vec::new();
    for c in engine.store.converges(Some(crate::api::GC_INSTANCE), SWEEPS).await? {
        if let Some(done) = known.sweeps.lock().unwrap().get(c.id.as_str()) {
            sweeps.push(done.clone());
            continue;
        }
        let events = engine.store.events(&c.id, None).await?;
        let sweep = summarize(c, &events);
        if sweep.finished_ms.is_some() {
            known.sweeps.lock().unwrap().insert(sweep.id.clone(), sweep.clone());
        }
        sweeps.push(sweep);
    }
    Ok(sweeps)
}

/// A gc converge in one line's worth of numbers: removals confirmed (or planned, for a dry run).
fn summarize(c: Converge, events: &[crate::model::Event]) -> Sweep {
    let mut sweep = Sweep {
        id: c.id.to_string(),
        job: "gc".to_string(),
        state: c.state.name(),
        reason: match &c.state {
            ConvergeState::Failed { reason } => reason.clone(),
            _ => String::new(),
        },
        requested_by: c.requested_by,
        started_ms: c.started_ms,
        finished_ms: c.finished_ms,
        images: 0,
        removals: 0,
        bytes: 0,
        failures: 0,
    };
    for event in events {
        match &event.kind {
            EventKind::Started if !event.message.is_empty() => sweep.job = event.message.clone(),
            EventKind::Planned { bytes, .. } | EventKind::Removed { bytes, .. } => {
                sweep.removals += 1;
                sweep.images += u64::from(*bytes > 0);
                sweep.bytes += bytes;
            }
            EventKind::NotRemoved { .. } => sweep.failures += 1,
            // The total the re-listings confirmed, which counts an image freed with no bytes too.
            EventKind::Swept { images, bytes } => (sweep.images, sweep.bytes) = (*images, *bytes),
            _ => {}
        }
    }
    sweep
}

/// The ledger as last made; starts a new one in the background when it is older than
/// [`LEDGER_FRESH`], so no look ever waits on the stores' listings.
fn ledger(engine: &Arc<Engine>, known: &Arc<Known>, last_finished_ms: u64) -> LedgerView {
    let now = now_ms();
    let mut slot = known.ledger.lock().unwrap();
    let stale = slot.started_ms.is_none_or(|at| {
        let age = now.saturating_sub(at);
        // A converge that ended since changed what the stores hold (it built, or swept): look
        // again soon, but not for every converge of a busy farm.
        age >= LEDGER_FRESH.as_millis() as u64 || (last_finished_ms >= at && age >= LEDGER_SOON.as_millis() as u64)
    });
    if stale && !slot.view.refreshing {
        slot.view.refreshing = true;
        slot.started_ms = Some(now);
        let (engine, known) = (engine.clone(), known.clone());
        tokio::spawn(async move {
            let made = crate::sweep::ledger_now(&engine).await;
            let mut slot = known.ledger.lock().unwrap();
            slot.view.refreshing = false;
            match made {
                Ok(ledger) => {
                    slot.view.ledger = Some(ledger);
                    slot.view.listed_ms = Some(now);
                    slot.view.error = None;
                }
                Err(err) => slot.view.error = Some(kiln_core::error_chain(&err)),
            }
        });
    }
    slot.view.clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ConvergeId, Generation};

    fn converge(id: &str, by: &str, started: u64, finished: Option<u64>) -> Converge {
        Converge {
            id: ConvergeId::from(id),
            instance: "shop".into(),
            state: if finished.is_some() { ConvergeState::Succeeded } else { ConvergeState::Running },
            started_ms: started,
            finished_ms: finished,
            requested_by: by.into(),
        }
    }

    #[test]
    fn a_record_was_written_by_the_converge_running_when_it_was_written() {
        let record =
            Record { instance: "shop".into(), generation: Generation(3), images: Vec::new(), written_at_ms: 150 };
        let listed = [converge("c3", "ada", 200, Some(300)), converge("c2", "mo", 100, Some(160))];
        assert_eq!(writer_of(&record, &listed), (Some("mo".into()), true));
        // Written, not yet marked finished: the answer may still be it, but is not final.
        let running = [converge("c2", "mo", 100, None)];
        assert_eq!(writer_of(&record, &running), (Some("mo".into()), false));
        assert_eq!(writer_of(&record, &[converge("c9", "x", 400, Some(500))]), (None, true));
    }

    #[test]
    fn a_gc_is_summed_up_by_what_its_re_listing_confirmed() {
        let event = |seq, kind, message: &str| crate::model::Event {
            seq,
            at_ms: 0,
            image: None,
            kind,
            message: message.to_string(),
        };
        let removed = |bytes| EventKind::Removed {
            store: "docker@h".into(),
            instance: "shop".into(),
            reference: "a:1".into(),
            bytes,
        };
        let events = [
            event(1, EventKind::Started, "gc --instance shop"),
            event(2, removed(0), ""),
            event(3, removed(700), ""),
            event(4, EventKind::NotRemoved { store: "docker@h".into(), reference: "b:1".into() }, "in use"),
            event(5, EventKind::Swept { images: 1, bytes: 700 }, ""),
        ];
        let sweep = summarize(converge("g1", "ada", 1, Some(2)), &events);
        assert_eq!(sweep.job, "gc --instance shop");
        assert_eq!((sweep.removals, sweep.images, sweep.bytes, sweep.failures), (2, 1, 700, 1));
    }
}
