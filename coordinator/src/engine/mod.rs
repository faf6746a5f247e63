//! The converge engine, in DESIGN.md's order: claim every computed ref (and context) before any
//! build; decide per image — skip what the record names *and* the target was seen to hold, deliver
//! what a host holds, build the rest — with the reason for each; ask for the contexts it lacks;
//! build; deliver by the target's branch; record the new generation atomically only when every
//! image is built and delivered. A failure leaves the record untouched and releases the claims.
//!
//! - `decide` — step 3: the decision and its reason per image, presence confirmed.
//! - `execute` — steps 4–6: contexts, builds (through the farm's queue, `schedule`), deliveries,
//!   a ref gone at its use rebuilt.
//! - `parallel` — every image a task of its own, in parallel, in the order of the FROM graph.
//! - `platforms` — a multi-platform image: a task per platform, the emulation preflight, the
//!   index in the registry, each node's own platform.
//! - `running` — the converges running now, for `kiln cancel` and `kiln ps`.
//! - `settled` — the no-op converge, decided before anything is stored and stored in one write.

mod decide;
mod execute;
mod files;
mod parallel;
mod platform_kind;
mod platforms;
pub mod running;
mod settled;

use crate::contexts::Contexts;
use crate::events::Events;
use crate::hub::{AgentConn, HeldRef, Hub, StreamId};
use crate::model::{Action, ConvergeId, EventKind, Reason, Record, RecordedImage, RecordedKind};
use crate::plan::{BuildInputs, PlanImage, PlanKind, UpPlan};
use crate::state::StateStore;
use crate::Config;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// How long a converge waits for a host agent to connect when none is.
const AGENT_WAIT: Duration = Duration::from_secs(10);

/// The claim by which a converge holds a context it is about to build from, so the sweep's
/// collection of the content store leaves it; never a ref, so the image sweep skips it.
pub const CONTEXT_CLAIM_PREFIX: &str = "kiln-context:";

/// Everything a converge needs from the coordinator.
pub struct Engine {
    pub store: Arc<dyn StateStore>,
    pub hub: Arc<Hub>,
    pub contexts: Arc<Contexts>,
    /// Spools images on their way from a host agent to node agents.
    pub relay: crate::relay::Relay,
    pub config: Config,
    pub running: running::Running,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The registry clients of the mirror, kept so that a converge asks a mirror one HEAD per
    /// pinned image and no handshake.
    pub registries: crate::mirror::Registries,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("farm", &self.config.farm).finish_non_exhaustive()
    }
}

/// How a converge ended well: the generation now current, and whether this converge wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Converged {
    pub generation: u64,
    pub changed: bool,
    /// Whether it took claims (to be released when it ends): a converge that found every image
    /// recorded and present took none.
    pub claimed: bool,
}

/// Why a converge failed: the image it failed on, when one, and what happened.
#[derive(Debug)]
pub struct Failure {
    pub image: Option<String>,
    pub reason: String,
}

impl Failure {
    fn of(image: &str, reason: impl Into<String>) -> Failure {
        Failure { image: Some(image.to_string()), reason: reason.into() }
    }
    fn whole(reason: impl Into<String>) -> Failure {
        Failure { image: None, reason: reason.into() }
    }

    /// The converge was cancelled; `why` says by whom or what.
    pub fn cancelled(why: String) -> Failure {
        Failure::whole(format!(
            "cancelled: {why}; nothing was recorded, and `kiln up` again resumes from the build cache"
        ))
    }
}

pub(crate) use decide::moved_inputs;
pub(crate) use execute::owner;

/// `kiln ps`: the converges running here and their build tasks, queued and running.
pub(crate) fn ps(engine: &Engine) -> kiln_proto::v1::PsReply {
    use kiln_proto::v1 as pb;
    let tasks = engine.hub.schedule.tasks();
    let converges = engine
        .running
        .list()
        .into_iter()
        .map(|(id, instance, owner, requested_by, started_ms)| {
            let mut mine: Vec<_> = tasks.iter().filter(|t| t.task.converge == id).collect();
            mine.sort_by_key(|t| (t.agent.is_empty(), t.position, t.task.image.clone()));
            let tasks = mine
                .into_iter()
                .map(|t| pb::PsTask {
                    image: t.task.image.clone(),
                    reference: t.task.reference.clone(),
                    state: t.state().to_string(),
                    agent: t.agent.clone(),
                    millis: t.since.elapsed().as_millis() as u64,
                    position: t.position,
                    wait_ms: t.wait.as_millis() as u64,
                })
                .collect();
            pb::PsConverge { converge_id: id, instance, owner, requested_by, started_ms, tasks }
        })
        .collect();
    let (slots, busy) = engine.hub.schedule.slots();
    pb::PsReply { converges, slots, busy }
}

fn store_failure(err: crate::state::StateError) -> Failure {
    Failure::whole(kiln_core::error_chain(&err))
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl Engine {
    /// Runs the converge `id` of `plan` to its end, reporting through `events`. A dry run decides
    /// and says what it would do, and changes nothing anywhere.
    pub async fn up(&self, id: &ConvergeId, plan: &UpPlan, events: &Events) -> Result<Converged, Failure> {
        if plan.mirror_only {
            // `kiln mirror`: the copy alone. The record is read only to say where it stands.
            crate::mirror::mirror_pinned(&self.registries, plan, events).instrument(step("mirror")).await?;
            let record = self.store.record(&plan.instance).await.map_err(store_failure)?;
            return Ok(Converged { generation: record.map_or(0, |r| r.generation.0), changed: false, claimed: false });
        }
        if platforms::multi(plan) {
            platforms::refuse_target(plan)?;
        }
        let built = built_images(plan);
        let record = self.store.record(&plan.instance).await.map_err(store_failure)?;
        // Claim before building: no sweep anywhere may take a ref between its build and delivery,
        // nor the content store a context between its upload and its build. A converge whose
        // every built ref is the one the record names needs no claim to decide: the record keeps
        // those refs from every sweep (it is a root), and no other converge of the instance can
        // change it while this one runs. It claims as soon as it finds anything to build or
        // deliver, before touching it — so the no-op converge, the one a developer waits for,
        // makes two writes fewer (the claim and its release), each a commit behind a busy farm's.
        let covered = record.as_ref().is_some_and(|r| covers(r, &built));
        let mut claimed = false;
        if !plan.dry_run && !covered {
            self.claim(id, &built).await?;
            claimed = true;
        }

        // Pinned images reach their mirror before anything is built: a pin the mirror cannot get
        // fails the converge early, and nothing is recorded that names a copy not made.
        crate::mirror::mirror_pinned(&self.registries, plan, events).instrument(step("mirror")).await?;

        let mut recorded = passthrough(plan);

        if !built.is_empty() {
            let host = self.pick_host(plan).instrument(step("pick host")).await?;
            if platforms::multi(plan) {
                self.check_nodes(plan)?;
            }
            let deciding = self.decide(&host, id, plan, record.as_ref(), &built, events);
            let mut decisions = deciding.instrument(step("decide")).await?;
            if plan.dry_run {
                // Only what is already stored: a dry run uploads nothing, so a context it lacks
                // is told by its tree digest.
                self.name_files(&mut decisions).await;
                for d in &decisions {
                    let kind = EventKind::Would {
                        reference: d.image.reference.clone(),
                        reason: d.reason.clone(),
                        action: d.action,
                    };
                    events.emit(kind, Some(&d.image.name), would_words(d.action, &d.reason));
                }
                let generation = record.as_ref().map_or(0, |r| r.generation.0);
                return Ok(Converged { generation, changed: false, claimed });
            }
            if !claimed && decisions.iter().any(|d| d.action != Action::Skip) {
                self.claim(id, &built).await?;
                claimed = true;
            }
            self.tell_skipped(&decisions, events);
            let generation = record.as_ref().map_or(0, |r| r.generation.0);
            self.ensure_contexts(&decisions, events).instrument(step("contexts")).await?;
            // After the uploads: every context about to be built is stored now, with its list.
            self.name_files(&mut decisions).await;
            let placements = match platforms::multi(plan) {
                true => self.place_platforms(plan, &decisions).instrument(step("platforms")).await?,
                false => platforms::Placements::new(),
            };
            let running = self.run_all(&host, id, plan, &decisions, &placements, generation, events);
            recorded.extend(running.instrument(step("images")).await?);
        }

        // A dry run of brought and pinned images alone said all it had to above: it records
        // nothing, least of all a mirrored ref whose copy it did not make.
        if plan.dry_run {
            return Ok(Converged {
                generation: record.as_ref().map_or(0, |r| r.generation.0),
                changed: false,
                claimed,
            });
        }
        in_manifest_order(plan, &mut recorded);
        // Nothing built, delivered or renamed: the record stands as it is. Writing an identical
        // generation would push the one it replaced out of the nodes' grace, and a sweep would
        // find nothing this converge made collectable.
        if let Some(current) = record.as_ref().filter(|r| r.images == recorded) {
            return Ok(Converged { generation: current.generation.0, changed: false, claimed });
        }
        let expected = record.map(|r| r.generation);
        let writing = self.store.write_record(&plan.instance, expected, recorded);
        let generation = writing.instrument(step("record")).await.map_err(store_failure)?;
        Ok(Converged { generation: generation.0, changed: true, claimed })
    }

    /// Claims the built images' refs and contexts for the converge's lifetime (its lease).
    async fn claim(&self, id: &ConvergeId, built: &[(&PlanImage, &BuildInputs)]) -> Result<(), Failure> {
        let lease = self.config.claim_lease.as_millis() as u64;
        let mut claims: Vec<String> = built.iter().map(|(i, _)| i.reference.clone()).collect();
        claims.extend(built.iter().map(|(_, inputs)| format!("{CONTEXT_CLAIM_PREFIX}{}", inputs.context)));
        let claiming = self.store.claim(id, &claims, now_ms() + lease);
        claiming.instrument(step("claim")).await.map_err(store_failure)
    }

    /// The host agent the converge decides on (its listing, its registry probe) and delivers held
    /// images from: the one whose inventory holds the most of the plan's images, by the
    /// inventories the coordinator keeps — never a live listing per agent. Among equals, one
    /// chosen by the instance's name, so instances spread over the farm and each keeps its own.
    async fn pick_host(&self, plan: &UpPlan) -> Result<Arc<AgentConn>, Failure> {
        self.pick_host_within(plan, AGENT_WAIT).await
    }

    /// [`Engine::pick_host`], waiting at most `wait` for a host to connect.
    async fn pick_host_within(&self, plan: &UpPlan, wait: Duration) -> Result<Arc<AgentConn>, Failure> {
        let deadline = Instant::now() + wait;
        loop {
            let hosts: Vec<_> = self
                .hub
                .connected()
                .into_iter()
                .filter(|a| a.is_host())
                // A multi-platform image's tasks are placed per platform; any host decides.
                .filter(|a| {
                    platforms::multi(plan)
                        || a.platforms.is_empty()
                        || plan.platforms.iter().all(|p| a.platforms.contains(p))
                })
                .collect();
            if !hosts.is_empty() {
                let spread = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    plan.instance.hash(&mut h);
                    h.finish() as usize
                };
                // How many of the plan's images each host holds, from the index: one lookup per
                // image, not one per image and host.
                let mut tally: HashMap<StreamId, usize> = HashMap::new();
                for image in &plan.images {
                    for stream in self.hub.inventory.holders(&HeldRef::of(&image.reference)) {
                        *tally.entry(stream).or_default() += 1;
                    }
                }
                let held = |a: &AgentConn| tally.get(&a.stream).copied().unwrap_or(0);
                let most = hosts.iter().map(|a| held(a)).max().unwrap_or(0);
                let best: Vec<_> = hosts.into_iter().filter(|a| held(a) == most).collect();
                return Ok(best[spread % best.len()].clone());
            }
            if Instant::now() >= deadline {
                return Err(Failure::whole(format!(
                    "no host agent that builds {} is connected to this coordinator — start `kiln-agent` against it",
                    plan.platforms.join(", ")
                )));
            }
            self.hub.changed(deadline - Instant::now()).await;
        }
    }
}

/// The plan's images that are built, each with its inputs, in the manifest's order.
fn built_images(plan: &UpPlan) -> Vec<(&PlanImage, &BuildInputs)> {
    let built = plan.images.iter().filter_map(|i| match &i.kind {
        PlanKind::Built(inputs) => Some((i, inputs)),
        _ => None,
    });
    built.collect()
}

/// Whether `record` names every built ref: then the record alone keeps them from every sweep,
/// and deciding them needs no claim.
fn covers(record: &Record, built: &[(&PlanImage, &BuildInputs)]) -> bool {
    let names =
        |i: &PlanImage| record.images.iter().any(|r| r.kind == RecordedKind::Built && r.reference == i.reference);
    built.iter().all(|(i, _)| names(i))
}

/// The record entries of the plan's brought and pinned images, which pass through untouched:
/// never built, labeled or inspected.
fn passthrough(plan: &UpPlan) -> Vec<RecordedImage> {
    let target = plan.target.identity();
    let mut recorded = Vec::new();
    for image in &plan.images {
        let kind = match image.kind {
            PlanKind::Built(_) => continue,
            PlanKind::Brought => RecordedKind::Brought,
            PlanKind::Pinned => RecordedKind::Pinned,
        };
        recorded.push(RecordedImage::passthrough(&image.name, &image.reference, kind, &target));
    }
    recorded
}

/// Puts record entries in the manifest's order, the order the record keeps.
fn in_manifest_order(plan: &UpPlan, recorded: &mut [RecordedImage]) {
    let order: BTreeMap<&str, usize> = plan.images.iter().enumerate().map(|(i, im)| (im.name.as_str(), i)).collect();
    recorded.sort_by_key(|r| order.get(r.name.as_str()).copied().unwrap_or(usize::MAX));
}

/// The span of one step of the converge (DESIGN.md's numbering: claim, decide, contexts, images,
/// record), a child of the converge's.
pub(crate) fn step(name: &'static str) -> tracing::Span {
    tracing::info_span!("step", otel.name = name)
}

/// A dry run's line: `would build: context changed (…)`, `would skip: recorded`.
fn would_words(action: Action, reason: &Reason) -> String {
    format!("would {}: {}", action.word(), reason.words())
}
