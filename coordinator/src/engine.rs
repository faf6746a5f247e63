//! The converge engine, in DESIGN.md's order: claim every computed ref before any build; skip by
//! record (build and delivery), else by a labeled image of this farm wearing the exact tag (build
//! only), else build; ask for the contexts it lacks; deliver by the target's branch; record the new
//! generation atomically only when every image is built and delivered. A failure leaves the record
//! untouched and releases the claims.

use crate::contexts::Contexts;
use crate::deliver::{self, DeliverError};
use crate::events::Events;
use crate::hub::{AgentConn, Hub, TaskFailure};
use crate::model::{ConvergeId, EventKind, RecordedImage, RecordedKind};
use crate::plan::{BuildInputs, PlanImage, PlanKind, Target, UpPlan};
use crate::store::Store;
use crate::Config;
use kiln_core::refs::ImageRef;
use kiln_core::sweep::{ListedImage, LABEL_CONTEXT, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
use kiln_proto::v1 as pb;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a converge waits for its client to upload the contexts it asked for.
const UPLOAD_WAIT: Duration = Duration::from_secs(600);
/// How long a converge waits for a host agent to connect when none is.
const AGENT_WAIT: Duration = Duration::from_secs(10);
/// A ref gone from the host at its use is rebuilt and the use retried at most this often.
const GONE_RETRIES: usize = 2;

/// Everything a converge needs from the coordinator.
pub struct Engine {
    pub store: Arc<dyn Store>,
    pub hub: Arc<Hub>,
    pub contexts: Arc<Contexts>,
    /// Spools images on their way from a host agent to node agents.
    pub relay: crate::relay::Relay,
    pub config: Config,
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
}

fn store_failure(err: crate::store::StoreError) -> Failure {
    Failure::whole(kiln_core::error_chain(&err))
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// One built image's way through the converge.
#[derive(Debug)]
struct Work<'a> {
    image: &'a PlanImage,
    inputs: &'a BuildInputs,
    build: bool,
}

impl Engine {
    /// Runs the converge `id` of `plan` to its end, reporting through `events`.
    pub async fn up(&self, id: &ConvergeId, plan: &UpPlan, events: &Events) -> Result<Converged, Failure> {
        match &plan.target {
            Target::Kind { .. } | Target::Nodes { .. } | Target::Registry { .. } | Target::Local => {}
        }
        if plan.platforms.len() > 1 {
            return Err(Failure::whole(format!(
                "platforms {} need a multi-platform builder; Kiln's agents build one platform per image for now — list one platform",
                plan.platforms.join(", ")
            )));
        }
        // Claim before building: no sweep anywhere may take a ref between its build and delivery.
        let refs: Vec<String> =
            plan.images.iter().filter(|i| matches!(i.kind, PlanKind::Built(_))).map(|i| i.reference.clone()).collect();
        let lease = self.config.claim_lease.as_millis() as u64;
        self.store.claim(id, &refs, now_ms() + lease).await.map_err(store_failure)?;

        let record = self.store.record(&plan.instance).await.map_err(store_failure)?;
        let target = plan.target.identity();
        let mut recorded: Vec<RecordedImage> = Vec::new();
        let mut work: Vec<Work<'_>> = Vec::new();
        for image in &plan.images {
            let inputs = match &image.kind {
                PlanKind::Built(inputs) => inputs,
                // Brought and pinned images pass through untouched: never built, labeled or inspected.
                PlanKind::Brought | PlanKind::Pinned => {
                    let kind = if matches!(image.kind, PlanKind::Brought) {
                        RecordedKind::Brought
                    } else {
                        RecordedKind::Pinned
                    };
                    recorded.push(RecordedImage {
                        name: image.name.clone(),
                        reference: image.reference.clone(),
                        kind,
                        target: target.clone(),
                        context: None,
                        user: None,
                    });
                    continue;
                }
            };
            let in_record = record.as_ref().and_then(|r| {
                r.images
                    .iter()
                    .find(|ri| ri.name == image.name && ri.reference == image.reference && ri.target == target)
            });
            match in_record {
                Some(ri) if !plan.force => {
                    events.emit(EventKind::Recorded, Some(&image.name), image.reference.clone());
                    recorded.push(ri.clone());
                }
                _ => work.push(Work { image, inputs, build: true }),
            }
        }

        if !work.is_empty() {
            let host = self.pick_host(plan, &work).await?;
            if !plan.force {
                self.mark_held(&host, id, &mut work, events).await;
            }
            self.ensure_contexts(&work, events).await?;
            for w in &work {
                let user = self.build_and_deliver(&host, id, plan, w, events).await?;
                recorded.push(RecordedImage {
                    name: w.image.name.clone(),
                    reference: w.image.reference.clone(),
                    kind: RecordedKind::Built,
                    target: target.clone(),
                    context: Some(w.inputs.context.to_string()),
                    user,
                });
                self.store.renew_claims(id, now_ms() + lease).await.map_err(store_failure)?;
            }
        }

        // Keep the manifest's order in the record.
        let order: BTreeMap<&str, usize> =
            plan.images.iter().enumerate().map(|(i, im)| (im.name.as_str(), i)).collect();
        recorded.sort_by_key(|r| order.get(r.name.as_str()).copied().unwrap_or(usize::MAX));
        // Nothing built, delivered or renamed: the record stands as it is. Writing an identical
        // generation would push the one it replaced out of the nodes' grace, and a sweep would
        // find nothing this converge made collectable.
        if let Some(current) = record.as_ref().filter(|r| r.images == recorded) {
            return Ok(Converged { generation: current.generation.0, changed: false });
        }
        let expected = record.map(|r| r.generation);
        let generation = self.store.write_record(&plan.instance, expected, recorded).await.map_err(store_failure)?;
        Ok(Converged { generation: generation.0, changed: true })
    }

    /// A host agent that can build the platform set, preferring one that already holds images.
    async fn pick_host(&self, plan: &UpPlan, work: &[Work<'_>]) -> Result<Arc<AgentConn>, Failure> {
        let deadline = Instant::now() + AGENT_WAIT;
        loop {
            let hosts: Vec<_> = self
                .hub
                .connected()
                .into_iter()
                .filter(|a| a.is_host())
                .filter(|a| a.platforms.is_empty() || plan.platforms.iter().all(|p| a.platforms.contains(p)))
                .collect();
            if hosts.len() == 1 {
                return Ok(hosts.into_iter().next().unwrap());
            }
            if hosts.len() > 1 {
                let mut best = (0usize, hosts[0].clone());
                for host in hosts {
                    let listing = list(&host, "").await.unwrap_or_default();
                    let held = work.iter().filter(|w| wears(&listing, &w.image.reference).is_some()).count();
                    if held > best.0 {
                        best = (held, host);
                    }
                }
                return Ok(best.1);
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

    /// Marks images the host holds — labeled by this farm, wearing the exact tag — as not needing a
    /// build. A listing that fails reads as "holds nothing"; an unlabeled look-alike never counts.
    async fn mark_held(&self, host: &AgentConn, id: &ConvergeId, work: &mut [Work<'_>], events: &Events) {
        let listing = match list(host, id.as_str()).await {
            Ok(listing) => listing,
            Err(err) => {
                events.emit(
                    EventKind::Note,
                    None,
                    format!("listing host {} failed, so it counts as holding nothing: {err}", host.id),
                );
                return;
            }
        };
        for w in work.iter_mut() {
            let Some(found) = wears(&listing, &w.image.reference) else { continue };
            let ours = found.labels.get(LABEL_KIND).is_some_and(|k| !k.is_empty())
                && found.labels.get(LABEL_FARM).map(String::as_str) == Some(self.config.farm.as_str());
            if ours {
                w.build = false;
                events.emit(EventKind::Held, Some(&w.image.name), format!("{} on {}", w.image.reference, host.id));
            }
        }
    }

    /// Asks the client for the contexts the store lacks and waits for them.
    async fn ensure_contexts(&self, work: &[Work<'_>], events: &Events) -> Result<(), Failure> {
        let mut wanted: Vec<String> = Vec::new();
        for w in work.iter().filter(|w| w.build) {
            let d = w.inputs.context.to_string();
            if !wanted.contains(&d) {
                wanted.push(d);
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        let missing = self.contexts.missing(&wanted).await.map_err(|s| Failure::whole(s.message().to_string()))?;
        if missing.is_empty() {
            return Ok(());
        }
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
            for w in work.iter().filter(|w| w.build && &w.inputs.context.to_string() == digest) {
                events.emit(EventKind::Uploaded { bytes }, Some(&w.image.name), format!("tree {}", &digest[..12]));
            }
        }
        Ok(())
    }

    async fn build_and_deliver(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &UpPlan,
        w: &Work<'_>,
        events: &Events,
    ) -> Result<Option<String>, Failure> {
        if w.build {
            self.build(host, id, plan, w, events).await?;
        }
        let mut rebuilt = 0;
        loop {
            // A sweep elsewhere may take the ref between its build (or held check) and its use:
            // the push finds it gone, or the read-back after a delivery that moves nothing does.
            let gone = match self.deliver(host, id, plan, w, events).await {
                Err(DeliverError::Gone(message)) => message,
                Err(DeliverError::Failed(why)) => return Err(Failure::of(&w.image.name, why)),
                Ok(()) => {
                    let inspect = pb::task::Kind::Inspect(pb::InspectTask { reference: w.image.reference.clone() });
                    match host.run(id.as_str(), inspect, |_| {}).await {
                        Ok(pb::task_result::Outcome::Inspected(i)) if i.present => {
                            return Ok(i.declares_user.then_some(i.user))
                        }
                        Ok(pb::task_result::Outcome::Inspected(_)) => {
                            format!("{} left host {} right after its delivery", w.image.reference, host.id)
                        }
                        Ok(_) => {
                            let why = format!("host {} answered the inspect with something else", host.id);
                            return Err(Failure::of(&w.image.name, why));
                        }
                        Err(err) => return Err(Failure::of(&w.image.name, err.to_string())),
                    }
                }
            };
            if rebuilt >= GONE_RETRIES {
                return Err(Failure::of(&w.image.name, format!("{gone} — gone again after {GONE_RETRIES} rebuilds")));
            }
            rebuilt += 1;
            events.emit(
                EventKind::Note,
                Some(&w.image.name),
                format!("{gone} — rebuilding from the build cache (retry {rebuilt} of {GONE_RETRIES})"),
            );
            self.ensure_contexts(std::slice::from_ref(&Work { build: true, ..*w }), events).await?;
            self.build(host, id, plan, w, events).await?;
        }
    }

    async fn build(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &UpPlan,
        w: &Work<'_>,
        events: &Events,
    ) -> Result<(), Failure> {
        let name = w.image.name.as_str();
        events.emit(EventKind::Building, Some(name), format!("{} on {}", w.image.reference, host.id));
        let mut labels = BTreeMap::new();
        if w.inputs.shared {
            labels.insert(LABEL_KIND.to_string(), "shared".to_string());
        } else {
            labels.insert(LABEL_KIND.to_string(), "image".to_string());
            labels.insert(LABEL_INSTANCE.to_string(), plan.instance.clone());
        }
        labels.insert(LABEL_FARM.to_string(), self.config.farm.clone());
        labels.insert(LABEL_CONTEXT.to_string(), w.inputs.context.to_string());
        let task = pb::BuildTask {
            tag: w.image.reference.clone(),
            context_digest: w.inputs.context.to_string(),
            dockerfile: w.inputs.dockerfile.clone(),
            dockerfile_outside: w.inputs.dockerfile_outside.clone(),
            args: w.inputs.args.clone().into_iter().collect(),
            target_stage: w.inputs.target_stage.clone(),
            platform: plan.platforms.first().cloned().unwrap_or_default(),
            labels: labels.into_iter().collect(),
            no_cache: false,
        };
        let started = Instant::now();
        let mut retried = false;
        let result = loop {
            let result = host
                .run(id.as_str(), pb::task::Kind::Build(task.clone()), |p| {
                    if !p.log_line.is_empty() {
                        events.emit(EventKind::BuildLog, Some(name), p.log_line);
                    }
                })
                .await;
            // Docker's classic builder fails a step whose cached parent image was removed while
            // it ran (another sweep or `docker rmi` on the same daemon). Once more builds it anew.
            match &result {
                Err(TaskFailure::Failed { message, .. }) if !retried && message.contains("unable to find image") => {
                    retried = true;
                    events.emit(EventKind::Note, Some(name), "a cached build step vanished mid-build; building again");
                }
                _ => break result,
            }
        };
        match result {
            Ok(pb::task_result::Outcome::Built(_)) => {
                let secs = started.elapsed().as_secs_f64();
                events.emit(EventKind::Built { secs }, Some(name), "");
                Ok(())
            }
            Ok(_) => Err(Failure::of(name, format!("host {} answered the build with something else", host.id))),
            Err(err) => {
                if let TaskFailure::Failed { kind: pb::task_error::Kind::ContextMismatch, .. } = err {
                    self.contexts.forget(&w.inputs.context).await;
                }
                Err(Failure::of(name, format!("build of {} failed: {err}", w.image.reference)))
            }
        }
    }

    async fn deliver(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &UpPlan,
        w: &Work<'_>,
        events: &Events,
    ) -> Result<(), DeliverError> {
        let name = w.image.name.as_str();
        match &plan.target {
            Target::Registry { registry } => {
                events.emit(EventKind::Pushing, Some(name), format!("to {registry}"));
                let push = pb::task::Kind::Push(pb::PushTask { reference: w.image.reference.clone() });
                let outcome = host.run(id.as_str(), push, |p| events.progress(name, p.current, p.total)).await?;
                let bytes = match outcome {
                    pb::task_result::Outcome::Pushed(p) => p.bytes,
                    _ => 0,
                };
                events.emit(EventKind::Pushed { bytes }, Some(name), "");
            }
            Target::Local => {
                events.emit(EventKind::Delivered, Some(name), "local target: the build host is where it runs");
            }
            Target::Nodes { cluster } => {
                let reference = &w.image.reference;
                deliver::to_nodes(&self.hub, &self.relay, host, id.as_str(), cluster, reference, name, events).await?;
            }
            Target::Kind { cluster } => {
                deliver::to_kind(host, id.as_str(), cluster, &w.image.reference, name, events).await?;
            }
        }
        Ok(())
    }
}

/// Lists a host store; an error is a reason, so the caller can say why it counts as empty.
async fn list(host: &AgentConn, converge: &str) -> Result<Vec<ListedImage>, String> {
    match host.run(converge, pb::task::Kind::List(pb::ListTask::default()), |_| {}).await {
        Ok(pb::task_result::Outcome::Listing(l)) => {
            Ok(l.images.into_iter().map(crate::convert::listed_image).collect())
        }
        Ok(_) => Err("the agent answered the listing with something else".to_string()),
        Err(err) => Err(err.to_string()),
    }
}

/// The listed image wearing exactly `reference` (after normalization), if any.
fn wears<'a>(listing: &'a [ListedImage], reference: &str) -> Option<&'a ListedImage> {
    let want = ImageRef::parse(reference).ok()?;
    listing.iter().find(|img| img.refs.iter().any(|r| ImageRef::parse(r).is_ok_and(|r| r == want)))
}
