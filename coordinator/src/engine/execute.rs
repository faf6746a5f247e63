//! Steps 4–6 of the converge for the images that need more than a skip: ask the client for the
//! contexts the content store lacks, build, deliver by the target's branch. A ref gone from the host
//! at its use (the push, or the read-back after a delivery) is rebuilt from the build cache, at most
//! twice. Every image's first line says why it is delivered or built.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::sweep::{LABEL_CONTEXT, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
use tracing::Instrument;

use super::decide::{address_inputs, Decision};
use super::{Engine, Failure};
use crate::deliver::{self, DeliverError};
use crate::events::Events;
use crate::hub::AgentConn;
use crate::model::{Action, ConvergeId, EventKind, Reason, RecordedImage, RecordedKind};
use crate::plan::{Target, UpPlan};
use crate::schedule::{Grant, Needs, TaskInfo};
use crate::task::{BuildTask, FailureKind, Inspected, Task, TaskFailure, TaskOutcome};

/// A build lost on its agent is queued again elsewhere at most this often.
const REQUEUES: usize = 2;

/// How a build on one agent went wrong.
pub(super) enum BuildError {
    /// The build failed: it would fail anywhere.
    Failed(Failure),
    /// The agent went away or stalled: the build may run elsewhere.
    AgentLost(TaskFailure),
}

impl From<BuildError> for Failure {
    fn from(err: BuildError) -> Failure {
        match err {
            BuildError::Failed(failure) => failure,
            BuildError::AgentLost(err) => Failure::whole(err.to_string()),
        }
    }
}

/// Who the queue is fair between: the instance's team, else the user who asked.
pub(crate) fn owner(plan: &UpPlan) -> String {
    plan.team.clone().map_or_else(|| plan.requested_by.clone(), |team| format!("team:{team}"))
}

/// How long a converge waits for its client to upload the contexts it asked for.
const UPLOAD_WAIT: Duration = Duration::from_secs(600);
/// A ref gone from the host at its use is rebuilt and the use retried at most this often.
const GONE_RETRIES: usize = 2;

impl Engine {
    /// Asks the client for the contexts the store lacks and waits for them.
    pub(super) async fn ensure_contexts(&self, decisions: &[Decision<'_>], events: &Events) -> Result<(), Failure> {
        let mut wanted: Vec<String> = Vec::new();
        for d in decisions.iter().filter(|d| d.action == Action::Build) {
            let digest = d.inputs.context.to_string();
            if !wanted.contains(&digest) {
                wanted.push(digest);
            }
        }
        self.ensure(&wanted, decisions, events).await
    }

    async fn ensure(&self, wanted: &[String], decisions: &[Decision<'_>], events: &Events) -> Result<(), Failure> {
        if wanted.is_empty() {
            return Ok(());
        }
        let missing = self.contexts.missing(wanted).await.map_err(|s| Failure::whole(s.message().to_string()))?;
        if missing.is_empty() {
            return Ok(());
        }
        // Before asking: blobs the client reports or sends for them are held from its first call.
        let _awaiting = self.contexts.blobs.expect(&missing);
        events.need_contexts(&missing);
        let still =
            self.contexts.wait_for(&missing, UPLOAD_WAIT).await.map_err(|s| Failure::whole(s.message().to_string()))?;
        if !still.is_empty() {
            return Err(Failure::whole(format!(
                "context(s) {} never arrived — the client stopped before uploading them; run `kiln up` again",
                still.join(", ")
            )));
        }
        for digest in &missing {
            let bytes = self.store.context(digest).await.ok().flatten().map_or(0, |c| c.bytes);
            for d in decisions.iter().filter(|d| &d.inputs.context.to_string() == digest) {
                events.emit(EventKind::Uploaded { bytes }, Some(&d.image.name), format!("tree {}", &digest[..12]));
            }
        }
        Ok(())
    }

    /// Says why an image is delivered without a build (a delivery that only confirms the record
    /// says nothing unless it moves something).
    pub(super) fn announce_held(&self, plan: &UpPlan, d: &Decision<'_>, events: &Events) {
        let name = d.image.name.as_str();
        let reference = d.image.reference.clone();
        match d.action {
            Action::Deliver if !d.confirming => {
                self.metrics.skipped(&d.reason);
                let words = match (&d.reason, &plan.target) {
                    (Reason::Gone { .. }, Target::Registry { .. }) => format!("{} — pushing again", d.reason.words()),
                    (Reason::Gone { .. }, _) => format!("{} — delivering again", d.reason.words()),
                    (reason, _) => format!("{} — {reference}", reason.words()),
                };
                events.emit(
                    EventKind::Held { reference: reference.clone(), reason: Some(d.reason.clone()) },
                    Some(name),
                    words,
                );
            }
            Action::Build | Action::Deliver | Action::Skip => {}
        }
    }

    /// Delivers one image `host` holds (built or held there), and returns its record entry.
    /// `slot`: the build slot held on `host` since its build, if any — a rebuild of a ref gone at
    /// its use runs in it (one is taken when none is held), so the image's build, its delivery and
    /// any rebuild are one task on one agent.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn deliver_from(
        &self,
        host: &Arc<AgentConn>,
        slot: &mut Option<Grant>,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        generation: u64,
        events: &Events,
    ) -> Result<RecordedImage, Failure> {
        let name = d.image.name.as_str();
        let reference = d.image.reference.clone();
        let mut rebuilt = 0;
        if let Some(grant) = slot {
            grant.delivering();
        }
        loop {
            // A sweep elsewhere may take the ref between its build (or held check) and its use:
            // the push finds it gone, or the read-back after a delivery that moves nothing does.
            let delivering = self.deliver(host, id, plan, d, events).instrument(super::step("deliver"));
            let gone = match delivering.await {
                Err(DeliverError::Gone(message)) => message,
                Err(DeliverError::Failed(why)) => return Err(Failure::of(name, why)),
                Ok(moved) => {
                    if d.confirming && rebuilt == 0 {
                        self.confirmed(d, moved, generation, events);
                    }
                    let inspect = Task::Inspect { reference: reference.clone() };
                    match host.run(id.as_str(), inspect, |_| {}).await {
                        Ok(TaskOutcome::Inspected(Some(image))) => {
                            return Ok(self.entry(plan, d, image, rebuilt > 0 || d.action == Action::Build));
                        }
                        Ok(TaskOutcome::Inspected(None)) => {
                            format!("{reference} left host {} right after its delivery", host.id)
                        }
                        Ok(_) => {
                            let why = format!("host {} answered the inspect with something else", host.id);
                            return Err(Failure::of(name, why));
                        }
                        Err(err) => return Err(Failure::of(name, err.to_string())),
                    }
                }
            };
            if rebuilt >= GONE_RETRIES {
                return Err(Failure::of(name, format!("{gone} — gone again after {GONE_RETRIES} rebuilds")));
            }
            rebuilt += 1;
            events.emit(
                EventKind::Note,
                Some(name),
                format!("{gone} — rebuilding from the build cache (retry {rebuilt} of {GONE_RETRIES})"),
            );
            let digest = d.inputs.context.to_string();
            self.ensure(std::slice::from_ref(&digest), std::slice::from_ref(d), events).await?;
            let reason = Reason::Gone { store: crate::sweep::host_store_of(host), generation };
            // On the same agent: the delivery reads the image from there.
            if slot.is_none() {
                *slot = Some(self.acquire(id, plan, d, Some(host.id.clone()), Vec::new(), events).await?);
            }
            let building = self.build(host, id, plan, d, &reason, events).instrument(super::step("build"));
            building.await.map_err(Failure::from)?;
        }
    }

    /// A slot for `d`'s build: on `required` only when given, never on an agent in `lost`.
    async fn acquire(
        &self,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        required: Option<String>,
        lost: Vec<String>,
        events: &Events,
    ) -> Result<Grant, Failure> {
        let name = d.image.name.as_str();
        let task = TaskInfo {
            converge: id.to_string(),
            owner: owner(plan),
            image: name.to_string(),
            reference: d.image.reference.clone(),
            context: d.inputs.context.to_string(),
        };
        let needs = Needs { platform: d.platform.clone(), via: d.via, required, exclude: lost.clone() };
        let on_queued = |position: u32, wait: Duration| {
            let words = format!("queued ({}, ~{} s)", kiln_core::ordinal(position), wait.as_secs().max(1));
            let kind = EventKind::Queued { position, wait_ms: wait.as_millis() as u64 };
            events.emit(kind, Some(name), words);
        };
        let queued = Instant::now();
        match self.hub.schedule.acquire(task, needs, on_queued).await {
            Ok(grant) => {
                self.metrics.dispatch_seconds.observe(queued.elapsed().as_secs_f64());
                Ok(grant)
            }
            Err(why) if lost.is_empty() => Err(Failure::of(name, why.to_string())),
            Err(why) => Err(Failure::of(name, format!("{why}; the build was lost on agent(s) {}", lost.join(", ")))),
        }
    }

    /// Builds `d` on whichever agent the queue gives it (`required`: that agent only), queued
    /// again elsewhere when its agent is lost or stalls, at most [`REQUEUES`] times. Returns the
    /// slot it built in, still held: the delivery runs in it.
    pub(super) async fn build_placed(
        &self,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        reason: &Reason,
        required: Option<String>,
        events: &Events,
    ) -> Result<Grant, Failure> {
        let name = d.image.name.as_str();
        let mut lost: Vec<String> = Vec::new();
        loop {
            let queued = self.acquire(id, plan, d, required.clone(), lost.clone(), events);
            let grant = queued.instrument(super::step("queue")).await?;
            match self.build(&grant.agent, id, plan, d, reason, events).instrument(super::step("build")).await {
                Ok(()) => return Ok(grant),
                Err(BuildError::Failed(failure)) => return Err(failure),
                Err(BuildError::AgentLost(err)) => {
                    lost.push(grant.agent.id.clone());
                    if lost.len() > REQUEUES || required.is_some() {
                        let why = format!(
                            "build of {} failed: {err} (lost on agent(s) {})",
                            d.image.reference,
                            lost.join(", ")
                        );
                        return Err(Failure::of(name, why));
                    }
                    let words = format!("{err} — queued again (retry {} of {REQUEUES})", lost.len());
                    events.emit(EventKind::Requeued { agent: grant.agent.id.clone() }, Some(name), words);
                }
            }
        }
    }

    /// After a `nodes` or `kind` delivery that doubled as the record's confirmation: "recorded"
    /// when it moved nothing, else which nodes had lost it.
    fn confirmed(&self, d: &Decision<'_>, moved: Vec<String>, generation: u64, events: &Events) {
        let name = d.image.name.as_str();
        // One platform's task of a multi-platform image: the nodes hold the content ref, and the
        // record is one — said once, by the set's first platform, when nothing moved.
        let reference = d.index.unwrap_or(&d.image.reference).to_string();
        if let (Some(content), true) = (d.index, moved.is_empty()) {
            if kiln_core::refs::platform_refs(content).first() != Some(&d.image.reference) {
                return;
            }
        }
        let reason = match moved.is_empty() {
            true => Reason::Recorded,
            false => Reason::Gone { store: moved.join(", "), generation },
        };
        self.metrics.skipped(&reason);
        if moved.is_empty() {
            events.emit(
                EventKind::Recorded { reference: reference.clone(), reason: Some(Reason::Recorded) },
                Some(name),
                reference,
            );
        } else {
            let words = format!("{} — delivered again", reason.words());
            events.emit(EventKind::Held { reference, reason: Some(reason) }, Some(name), words);
        }
    }

    /// The record entry of an image this converge delivered. One whose build and delivery both
    /// were skipped keeps its entry as it was, so a no-op writes no generation.
    fn entry(&self, plan: &UpPlan, d: &Decision<'_>, inspected: Inspected, rebuilt: bool) -> RecordedImage {
        if let (Some(entry), false) = (d.recorded, rebuilt) {
            if d.confirming {
                return entry.clone();
            }
        }
        RecordedImage {
            name: d.image.name.clone(),
            reference: d.image.reference.clone(),
            kind: RecordedKind::Built,
            target: plan.target.identity(),
            context: Some(d.inputs.context.to_string()),
            user: inspected.user,
            inputs: Some(address_inputs(d.inputs, &plan.platforms)),
            image_id: Some(inspected.id).filter(|id| !id.is_empty()),
        }
    }

    async fn build(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        reason: &Reason,
        events: &Events,
    ) -> Result<(), BuildError> {
        let name = d.image.name.as_str();
        let inputs = d.inputs;
        let words = match reason {
            Reason::Gone { .. } => format!("{} — rebuilding", reason.words()),
            _ => format!("building {} on {}: {}", d.image.reference, host.id, reason.words()),
        };
        let building = EventKind::Building { reference: d.image.reference.clone(), reason: Some(reason.clone()) };
        events.emit(building, Some(name), words);
        let mut labels = BTreeMap::new();
        if inputs.shared {
            labels.insert(LABEL_KIND.to_string(), "shared".to_string());
        } else {
            labels.insert(LABEL_KIND.to_string(), "image".to_string());
            labels.insert(LABEL_INSTANCE.to_string(), plan.instance.clone());
        }
        labels.insert(LABEL_FARM.to_string(), self.config.farm.clone());
        labels.insert(LABEL_CONTEXT.to_string(), inputs.context.to_string());
        let task = Task::Build(BuildTask {
            tag: d.image.reference.clone(),
            context: inputs.context,
            dockerfile: inputs.dockerfile.clone(),
            dockerfile_outside: inputs.dockerfile_outside.clone(),
            args: inputs.args.clone(),
            target_stage: inputs.target_stage.clone(),
            platform: d.platform.clone(),
            labels,
        });
        let started = Instant::now();
        let mut retried = false;
        let result = loop {
            let result = host
                .run(id.as_str(), task.clone(), |p| {
                    if let Some(line) = p.log_line {
                        events.emit(EventKind::BuildLog, Some(name), line);
                    }
                })
                .await;
            // Docker's classic builder fails a step whose cached parent image was removed while
            // it ran (another sweep or `docker rmi` on the same daemon). Once more builds it anew.
            match &result {
                Err(TaskFailure::Failed { kind: FailureKind::CacheVanished, .. }) if !retried => {
                    retried = true;
                    events.emit(EventKind::Note, Some(name), "a cached build step vanished mid-build; building again");
                }
                _ => break result,
            }
        };
        match result {
            Ok(TaskOutcome::Built { .. }) => {
                self.metrics.built(reason);
                let secs = started.elapsed().as_secs_f64();
                events.emit(EventKind::Built { secs }, Some(name), "");
                Ok(())
            }
            Ok(_) => Err(BuildError::Failed(Failure::of(
                name,
                format!("host {} answered the build with something else", host.id),
            ))),
            Err(err) if err.agent_lost() => Err(BuildError::AgentLost(err)),
            Err(err) => {
                if let TaskFailure::Failed { kind: FailureKind::ContextMismatch, .. } = err {
                    self.contexts.forget(&inputs.context).await;
                }
                // The step as the agent typed it: the builder's count (BuildKit's leaves out a
                // `FROM scratch`, the classic builder's counts every instruction).
                let at = match &err {
                    TaskFailure::Failed { kind: FailureKind::BuildFailed, step: Some(step), .. } => {
                        format!(" at build step {step}")
                    }
                    _ => String::new(),
                };
                Err(BuildError::Failed(Failure::of(name, format!("build of {} failed{at}: {err}", d.image.reference))))
            }
        }
    }

    /// Delivers by the target's branch; returns where it moved the image (empty: nothing needed
    /// to move — every node already held it, or the target is the build host itself).
    async fn deliver(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        events: &Events,
    ) -> Result<Vec<String>, DeliverError> {
        let name = d.image.name.as_str();
        let reference = &d.image.reference;
        // A delivery that only confirms the record says nothing unless it moves something.
        let narrate = !d.confirming;
        match &plan.target {
            Target::Registry { registry } => {
                events.emit(EventKind::Pushing, Some(name), format!("to {registry}"));
                let push = Task::Push { reference: reference.clone() };
                let outcome = host.run(id.as_str(), push, |p| events.progress(name, p.current, p.total)).await?;
                // Anything but "pushed" is not a push: counting it as one would record a ref the
                // registry may not hold.
                let TaskOutcome::Pushed { bytes, .. } = outcome else {
                    return Err(DeliverError::Failed(format!(
                        "host {} answered the push with something else",
                        host.id
                    )));
                };
                events.emit(EventKind::Pushed { bytes }, Some(name), "");
                self.metrics.delivered(plan.target.identity(), bytes);
                Ok(vec![format!("registry {registry}")])
            }
            Target::Local => {
                events.emit(EventKind::Delivered, Some(name), "local target: the build host is where it runs");
                Ok(Vec::new())
            }
            Target::Nodes { cluster } if d.index.is_some() => {
                let done = self.platform_to_nodes(host, id, cluster, d, narrate, events).await?;
                self.metrics.delivered(plan.target.identity(), done.bytes);
                Ok(done.imported)
            }
            Target::Nodes { cluster } => {
                let done = deliver::to_nodes(
                    &self.hub,
                    &self.relay,
                    host,
                    id.as_str(),
                    cluster,
                    reference,
                    name,
                    narrate,
                    events,
                )
                .await?;
                self.metrics.delivered(plan.target.identity(), done.bytes);
                Ok(done.imported)
            }
            Target::Kind { cluster } if d.index.is_some() => {
                Ok(self.platform_to_kind(host, id, cluster, d, narrate, events).await?)
            }
            Target::Kind { cluster } => {
                Ok(deliver::to_kind(host, id.as_str(), cluster, (reference, reference), name, narrate, events).await?)
            }
        }
    }
}
