//! The farm's build queue: every build task of every converge asks here for a slot on a host
//! agent, and waits its turn (DESIGN.md "Scheduling").
//!
//! - Slots: each host agent announces how many builds it runs at once; a [`Grant`] takes one and
//!   gives it back when dropped, so no agent ever runs more than its slots — whatever way the task
//!   ends, cancellation included.
//! - Fairness: waiting tasks queue per owner (the instance's team, else the user who converged it),
//!   and free slots go round-robin across owners, one task per owner per turn. One owner's backlog
//!   of a thousand delays another owner's single task by at most one task per slot.
//! - Placement (`placement`): warm agents first, then the least loaded; a bounded wait for warmth,
//!   by no more tasks per busy warm agent than it has slots.
//!
//! The queue lives in memory: a coordinator that stops loses it with the converges it ran, which
//! its successor marks failed.

mod placement;

use placement::{Candidate, Choice};
pub use placement::{Needs, Via};

use crate::hub::{AgentConn, HeldRef, Inventory};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How long a task whose platform no connected agent builds waits for one to connect.
const NO_AGENT_WAIT: Duration = Duration::from_secs(10);
/// How often the queue is looked at again while tasks wait (for warmth, for an agent): the other
/// wake-ups are a slot freed and an agent joining.
const TICK: Duration = Duration::from_millis(100);
/// How far down one owner's queue a turn looks for a task that fits the free slots: a head waiting
/// for one busy agent does not hold back the owner's others.
const LOOKAHEAD: usize = 32;

/// One build task, as the queue and `kiln ps` show it.
#[derive(Clone, Debug)]
pub struct TaskInfo {
    pub converge: String,
    pub owner: String,
    pub image: String,
    pub reference: String,
    /// The context digest: an agent that built it before is warm for it.
    pub context: String,
}

/// Why a task cannot be given a slot at all.
#[derive(Debug, thiserror::Error)]
pub enum Unplaceable {
    #[error("no host agent that builds {platform} is connected to this coordinator — start `kiln-agent` against it")]
    NoAgent { platform: String },
    #[error("agent {agent}, which holds the image this one builds FROM, is no longer connected")]
    RequiredGone { agent: String },
}

/// A slot on an agent, held while the task runs.
#[derive(Debug)]
pub struct Grant {
    pub agent: Arc<AgentConn>,
    /// `None` once the slot went back some other way (the grant was never received).
    sched: Option<Arc<Scheduler>>,
    seq: u64,
}

impl Grant {
    /// The build is done and the image's delivery runs in the same slot: `kiln ps` says so.
    pub fn delivering(&self) {
        if let Some(sched) = &self.sched {
            if let Some(held) = sched.state.lock().unwrap().running.get_mut(&self.seq) {
                held.delivering = true;
                held.since = Instant::now();
            }
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(sched) = self.sched.take() {
            sched.release(&self.agent, self.seq);
        }
    }
}

/// A queued or running task, for `kiln ps`.
#[derive(Clone, Debug)]
pub struct TaskView {
    pub task: TaskInfo,
    /// Empty while queued.
    pub agent: String,
    /// Running: its build is done and its delivery runs in the slot.
    pub delivering: bool,
    pub since: Instant,
    /// Queued: the place in the fair queue (1 = next) and the estimated wait.
    pub position: u32,
    pub wait: Duration,
}

impl TaskView {
    /// What `kiln ps` and the status page call its state: `queued`, `building` or `delivering`.
    pub fn state(&self) -> &'static str {
        match (self.agent.is_empty(), self.delivering) {
            (true, _) => "queued",
            (false, false) => "building",
            (false, true) => "delivering",
        }
    }
}

/// The queue and the slots of every connected host agent.
#[derive(Debug)]
pub struct Scheduler {
    state: Mutex<State>,
    affinity_wait: Duration,
    ticking: AtomicBool,
    /// Who is warm for a task: asked once per placement attempt, not of every agent.
    inventory: Arc<Inventory>,
}

#[derive(Debug, Default)]
struct State {
    hosts: BTreeMap<String, Host>,
    /// Owners with queued tasks, in the order their next turn comes.
    owners: VecDeque<String>,
    queues: HashMap<String, VecDeque<Waiting>>,
    running: HashMap<u64, Held>,
    next_seq: u64,
    /// Turns among equally loaded agents: the next grant starts looking here.
    turn: usize,
    /// A moving average of how long a slot is held, for the wait a queued task is told.
    mean_ms: f64,
    /// In the dispatch pass under way: how many tasks wait for each busy warm agent's next slot,
    /// and which tasks those are (a pass may look at a task again after a grant).
    lines: HashMap<String, u32>,
    in_line: std::collections::HashSet<u64>,
}

/// A granted slot: the task, the agent and since when it is in its phase.
#[derive(Debug)]
struct Held {
    task: TaskInfo,
    agent: String,
    /// When the slot was granted: how long slots are held, for the wait a queued task is told.
    granted: Instant,
    since: Instant,
    delivering: bool,
}

#[derive(Debug)]
struct Host {
    conn: Arc<AgentConn>,
    busy: u32,
}

#[derive(Debug)]
struct Waiting {
    seq: u64,
    task: TaskInfo,
    /// The task's ref as inventories spell it, made once for every placement attempt.
    held: HeldRef,
    needs: Needs,
    since: Instant,
    grant: oneshot::Sender<Result<Grant, Unplaceable>>,
}

impl Scheduler {
    pub fn new(affinity_wait: Duration, inventory: Arc<Inventory>) -> Arc<Scheduler> {
        Arc::new(Scheduler {
            state: Mutex::new(State { mean_ms: 1_000.0, ..State::default() }),
            affinity_wait,
            ticking: AtomicBool::new(false),
            inventory,
        })
    }

    /// A host agent connected (or connected again: its new stream replaces the old one, and the
    /// old stream's slots come back as its tasks fail).
    pub fn joined(self: &Arc<Self>, conn: Arc<AgentConn>) {
        self.state.lock().unwrap().hosts.insert(conn.id.clone(), Host { conn, busy: 0 });
        self.dispatch();
    }

    /// Whether a build slot on `agent` is held: a build, or the delivery that follows it in the same slot.
    pub fn holds_slot(&self, agent: &str) -> bool {
        self.state.lock().unwrap().running.values().any(|held| held.agent == agent)
    }

    /// A host agent's stream ended.
    pub fn left(self: &Arc<Self>, conn: &Arc<AgentConn>) {
        let mut state = self.state.lock().unwrap();
        if state.hosts.get(&conn.id).is_some_and(|h| Arc::ptr_eq(&h.conn, conn)) {
            state.hosts.remove(&conn.id);
        }
        state.refuse_unplaceable();
        drop(state);
        self.dispatch();
    }

    /// Waits for a slot for `task`. `on_queued` hears the task's place and estimated wait when
    /// no slot is free at once. Dropping the future leaves the queue.
    pub async fn acquire(
        self: &Arc<Self>,
        task: TaskInfo,
        needs: Needs,
        on_queued: impl FnOnce(u32, Duration),
    ) -> Result<Grant, Unplaceable> {
        let (tx, rx) = oneshot::channel();
        let seq = {
            let mut state = self.state.lock().unwrap();
            state.next_seq += 1;
            let seq = state.next_seq;
            let owner = task.owner.clone();
            crate::metrics::enqueued(&task.reference);
            let held = HeldRef::of(&task.reference);
            let waiting = Waiting { seq, task, held, needs, since: Instant::now(), grant: tx };
            let queue = state.queues.entry(owner.clone()).or_default();
            queue.push_back(waiting);
            if queue.len() == 1 {
                state.owners.push_back(owner);
            }
            seq
        };
        let _leave = Leave { sched: self.clone(), seq };
        self.dispatch();
        if let Some((position, wait)) = self.position(seq) {
            on_queued(position, wait);
        }
        match rx.await {
            Ok(result) => result,
            // The sender lives in the queue until it is answered; dropped unanswered only if the
            // scheduler itself went away.
            Err(_) => Err(Unplaceable::NoAgent { platform: "any platform".to_string() }),
        }
    }

    /// Total slots of the connected host agents, and how many are taken.
    pub fn slots(&self) -> (u32, u32) {
        let state = self.state.lock().unwrap();
        state.hosts.values().fold((0, 0), |(s, b), h| (s + h.conn.slots, b + h.busy))
    }

    /// Every queued and running task.
    pub fn tasks(&self) -> Vec<TaskView> {
        let state = self.state.lock().unwrap();
        let mut views: Vec<TaskView> = state
            .running
            .values()
            .map(|held| TaskView {
                task: held.task.clone(),
                agent: held.agent.clone(),
                delivering: held.delivering,
                since: held.since,
                position: 0,
                wait: Duration::ZERO,
            })
            .collect();
        for queue in state.queues.values() {
            for w in queue {
                let (position, wait) = state.position_of(w.seq).unwrap_or((0, Duration::ZERO));
                let agent = String::new();
                views.push(TaskView { task: w.task.clone(), agent, delivering: false, since: w.since, position, wait });
            }
        }
        views
    }

    fn waiting(&self) -> bool {
        !self.state.lock().unwrap().owners.is_empty()
    }

    fn position(&self, seq: u64) -> Option<(u32, Duration)> {
        self.state.lock().unwrap().position_of(seq)
    }

    fn release(self: &Arc<Self>, conn: &Arc<AgentConn>, seq: u64) {
        let mut state = self.state.lock().unwrap();
        if let Some(held) = state.running.remove(&seq) {
            let ms = held.granted.elapsed().as_secs_f64() * 1_000.0;
            state.mean_ms = state.mean_ms * 0.9 + ms * 0.1;
        }
        // Only the stream that took the slot gives it back: an agent that connected again
        // starts with the slots of its new stream.
        if let Some(host) = state.hosts.get_mut(&conn.id).filter(|h| Arc::ptr_eq(&h.conn, conn)) {
            host.busy = host.busy.saturating_sub(1);
        }
        drop(state);
        self.dispatch();
    }

    fn leave(&self, seq: u64) {
        let mut state = self.state.lock().unwrap();
        let mut emptied = None;
        for (owner, queue) in state.queues.iter_mut() {
            if let Some(at) = queue.iter().position(|w| w.seq == seq) {
                queue.remove(at);
                if queue.is_empty() {
                    emptied = Some(owner.clone());
                }
                break;
            }
        }
        if let Some(owner) = emptied {
            state.queues.remove(&owner);
            state.owners.retain(|o| *o != owner);
        }
    }

    /// Gives free slots to waiting tasks, one owner per turn, until none fits.
    fn dispatch(self: &Arc<Self>) {
        let mut state = self.state.lock().unwrap();
        let mut still_waiting = false;
        // Lines for warm agents are drawn again each pass, in the queue's order.
        state.lines.clear();
        state.in_line.clear();
        'turns: loop {
            if state.owners.is_empty() || !state.hosts.values().any(|h| h.busy < h.conn.slots) {
                still_waiting |= !state.owners.is_empty();
                break;
            }
            for _ in 0..state.owners.len() {
                let owner = state.owners.pop_front().expect("owners is not empty");
                let placed = state.place_one(self, &owner, self.affinity_wait);
                still_waiting |= placed.waiting;
                if state.queues.get(&owner).is_some_and(|q| !q.is_empty()) {
                    state.owners.push_back(owner);
                } else {
                    state.queues.remove(&owner);
                }
                if placed.granted {
                    // The owner just served goes to the back: the next free slot is another's.
                    continue 'turns;
                }
            }
            break;
        }
        drop(state);
        if still_waiting {
            self.tick();
        }
    }

    /// While tasks wait, look again every [`TICK`]: affinity waits end and agents connect without
    /// a slot freeing.
    fn tick(self: &Arc<Self>) {
        if self.ticking.swap(true, Ordering::AcqRel) {
            return;
        }
        let sched = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(TICK).await;
                let Some(sched) = sched.upgrade() else { return };
                sched.state.lock().unwrap().refuse_unplaceable();
                sched.dispatch();
                if sched.waiting() {
                    continue;
                }
                sched.ticking.store(false, Ordering::Release);
                // A task queued between the look and the store found the ticker still running and
                // left the looking to it: take it back up.
                if sched.waiting() && !sched.ticking.swap(true, Ordering::AcqRel) {
                    continue;
                }
                return;
            }
        });
    }
}

/// What one owner's turn did.
struct Placed {
    granted: bool,
    waiting: bool,
}

impl State {
    /// Answers the tasks no connected agent could ever run: the agent they require is gone, or
    /// none builds their platform and none connected within [`NO_AGENT_WAIT`]. Looked at on the
    /// ticks and when an agent leaves — not on every dispatch, which sees only free slots.
    fn refuse_unplaceable(&mut self) {
        let hosts: Vec<(String, Vec<String>, Vec<String>)> = self
            .hosts
            .values()
            .map(|h| (h.conn.id.clone(), h.conn.platforms.clone(), h.conn.emulates.clone()))
            .collect();
        for queue in self.queues.values_mut() {
            let mut i = 0;
            while i < queue.len() {
                let w = &queue[i];
                let eligible = hosts.iter().any(|(id, platforms, emulates)| {
                    let platform_ok = placement::runs(platforms, emulates, &w.needs);
                    platform_ok && w.needs.required.as_deref().is_none_or(|r| r == id)
                });
                let refuse = match (&w.needs.required, eligible) {
                    (_, true) => None,
                    (Some(agent), false) => Some(Unplaceable::RequiredGone { agent: agent.clone() }),
                    (None, false) if w.since.elapsed() >= NO_AGENT_WAIT => {
                        Some(Unplaceable::NoAgent { platform: w.needs.platform.clone() })
                    }
                    (None, false) => None,
                };
                match refuse {
                    Some(why) => {
                        let w = queue.remove(i).expect("index in range");
                        let _ = w.grant.send(Err(why));
                    }
                    None => i += 1,
                }
            }
        }
        self.queues.retain(|_, q| !q.is_empty());
        let queues = &self.queues;
        self.owners.retain(|o| queues.contains_key(o));
    }

    /// Gives at most one of `owner`'s tasks a slot.
    fn place_one(&mut self, sched: &Arc<Scheduler>, owner: &str, affinity_wait: Duration) -> Placed {
        let Some(mut queue) = self.queues.remove(owner) else { return Placed { granted: false, waiting: false } };
        let mut placed = Placed { granted: false, waiting: false };
        let mut i = 0;
        while i < queue.len().min(LOOKAHEAD) {
            let w = &queue[i];
            if w.grant.is_closed() {
                queue.remove(i);
                continue;
            }
            if self.in_line.contains(&w.seq) {
                // Already in line for a warm agent this pass: no slot freed since.
                placed.waiting = true;
                i += 1;
                continue;
            }
            let waited = w.since.elapsed();
            let warm = sched.inventory.warm(&w.held, &w.task.context);
            let ids: Vec<&String> = self.hosts.keys().collect();
            let candidates: Vec<Candidate<'_>> = self
                .hosts
                .values()
                .map(|h| Candidate {
                    id: &h.conn.id,
                    platforms: &h.conn.platforms,
                    emulates: &h.conn.emulates,
                    slots: h.conn.slots,
                    busy: h.busy,
                    warm: warm.contains(&h.conn.stream),
                    waiting: self.lines.get(&h.conn.id).copied().unwrap_or(0),
                })
                .collect();
            let choice = placement::choose(&candidates, &w.needs, waited, affinity_wait, self.turn);
            match choice {
                Choice::On(at) => {
                    let id = ids[at].clone();
                    let w = queue.remove(i).expect("index in range");
                    self.turn = at + 1;
                    let host = self.hosts.get_mut(&id).expect("candidate is a host");
                    host.busy += 1;
                    let grant = Grant { agent: host.conn.clone(), sched: Some(sched.clone()), seq: w.seq };
                    let now = Instant::now();
                    let held =
                        Held { task: w.task.clone(), agent: id.clone(), granted: now, since: now, delivering: false };
                    self.running.insert(w.seq, held);
                    crate::metrics::granted(&w.task.reference);
                    // A receiver gone meanwhile drops the grant here, which frees the slot again.
                    if let Err(Ok(mut grant)) = w.grant.send(Ok(grant)) {
                        // Released here, under the lock the grant's drop would take.
                        grant.sched = None;
                        self.running.remove(&w.seq);
                        if let Some(host) = self.hosts.get_mut(&id) {
                            host.busy -= 1;
                        }
                        continue;
                    }
                    placed.granted = true;
                    break;
                }
                // Tasks no agent could ever run are answered by `refuse_unplaceable`, on the
                // ticks and when an agent leaves — one place for that rule.
                Choice::WaitWarm(at) => {
                    *self.lines.entry(ids[at].clone()).or_default() += 1;
                    self.in_line.insert(w.seq);
                    placed.waiting = true;
                    i += 1;
                }
                Choice::Wait => {
                    placed.waiting = true;
                    i += 1;
                }
            }
        }
        placed.waiting |= queue.len() > LOOKAHEAD;
        if !queue.is_empty() {
            self.queues.insert(owner.to_string(), queue);
        }
        placed
    }

    /// A queued task's place in the round-robin order and its estimated wait: the tasks ahead of
    /// it in its owner's queue, and as many of every other owner's as will be served before it.
    fn position_of(&self, seq: u64) -> Option<(u32, Duration)> {
        let (owner, index) = self
            .queues
            .iter()
            .find_map(|(owner, q)| q.iter().position(|w| w.seq == seq).map(|i| (owner.as_str(), i)))?;
        let turn = self.owners.iter().position(|o| o == owner).unwrap_or(0);
        let mut ahead = index;
        for (at, other) in self.owners.iter().enumerate().filter(|(_, o)| *o != owner) {
            // Owners whose turn comes first get one more task in before this one.
            let rounds = if at < turn { index + 1 } else { index };
            ahead += self.queues.get(other).map_or(0, |q| q.len().min(rounds));
        }
        let slots = self.hosts.values().map(|h| h.conn.slots).sum::<u32>().max(1) as f64;
        let wait = Duration::from_millis((((ahead + 1) as f64 / slots).ceil() * self.mean_ms) as u64);
        Some((ahead as u32 + 1, wait))
    }
}

/// Takes a task out of the queue when its waiter goes away (a cancelled converge).
struct Leave {
    sched: Arc<Scheduler>,
    seq: u64,
}

impl Drop for Leave {
    fn drop(&mut self) {
        self.sched.leave(self.seq);
    }
}
