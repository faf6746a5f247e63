//! Step 3 of the converge: for each built image, what to do — skip, deliver, build — and why.
//!
//! "Recorded" is a promise that the image is where the target puts it, so a record entry alone
//! never skips: the converge confirms it at a cost that keeps the no-op fast — one labeled listing
//! per host store for `local`, one manifest HEAD per image for `registry` (all in one task), and for
//! `nodes` and `kind` the delivery itself, which only asks the nodes when they all hold it. What
//! vanished is delivered again, or rebuilt from the build cache, and the reason says so.
//!
//! Not recorded (or `--force`): an image of this farm wearing the exact tag on the host is held (no
//! build); another farm's Kiln image wearing it is used as it is — it is the same address — and
//! this farm's hold tag marks the reliance on the daemon, so the owner's sweep leaves it. A tag
//! another farm's image wears is never moved, `--force` included.

use std::collections::BTreeMap;

use kiln_core::refs::ImageRef;
use kiln_core::sweep::{hold_ref, ListedImage, LABEL_FARM, LABEL_KIND};

use super::{Engine, Failure};
use crate::events::Events;
use crate::hub::{AgentConn, HeldRef};
use crate::model::{Action, AddressInputs, ConvergeId, EventKind, Input, InputChange, Reason, Record, RecordedImage};
use crate::plan::{BuildInputs, PlanImage, Target, UpPlan};
use crate::schedule::Via;
use crate::task::{Task, TaskOutcome};

/// One built image's way through the converge.
#[derive(Debug)]
pub(super) struct Decision<'a> {
    pub image: &'a PlanImage,
    pub inputs: &'a BuildInputs,
    pub action: Action,
    pub reason: Reason,
    /// The record's entry, carried over unchanged when nothing had to move.
    pub recorded: Option<&'a RecordedImage>,
    /// `nodes` and `kind`: the delivery is also the confirmation; it says "recorded" when it moved
    /// nothing.
    pub confirming: bool,
    /// The platform its build is for (empty: the agent's own), and how an agent may build it. A
    /// multi-platform image's decision names its first; each platform's own task gets a copy
    /// naming that one (`platforms`).
    pub platform: String,
    pub via: Via,
    /// One platform's task of a multi-platform image: the content ref its index and node stores
    /// wear (`image.reference` is then the platform ref its build host tags it with).
    pub index: Option<&'a str>,
}

/// A host's labeled listing, with the store it names.
pub(super) struct HostListing {
    pub store: String,
    pub images: Result<Vec<ListedImage>, String>,
}

impl Engine {
    /// Decides every built image of `plan`; events say only what is decided for sure here (the
    /// skips); the rest is told as it happens.
    pub(super) async fn decide<'a>(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &'a UpPlan,
        record: Option<&'a Record>,
        built: &[(&'a PlanImage, &'a BuildInputs)],
        events: &Events,
    ) -> Result<Vec<Decision<'a>>, Failure> {
        let target = plan.target.identity();
        let generation = record.map_or(0, |r| r.generation.0);
        let entry = |image: &PlanImage| {
            record.and_then(|r| {
                r.images
                    .iter()
                    .find(|ri| ri.name == image.name && ri.reference == image.reference && ri.target == target)
            })
        };
        let in_record: Vec<bool> = built.iter().map(|(image, _)| !plan.force && entry(image).is_some()).collect();

        // Confirm the registry's copies first: a no-op converge to a registry lists nothing else.
        let mut present: Vec<Option<bool>> = vec![None; built.len()];
        if let Target::Registry { .. } = plan.target {
            let asked: Vec<usize> = (0..built.len()).filter(|&i| in_record[i]).collect();
            if !asked.is_empty() {
                let refs = asked.iter().map(|&i| built[i].0.reference.clone()).collect();
                let answers = probe(host, id, refs).await;
                for (i, answer) in asked.into_iter().zip(answers) {
                    present[i] = Some(answer);
                }
            }
        }
        let needs_listing = built
            .iter()
            .enumerate()
            .any(|(i, _)| !in_record[i] || present[i] == Some(false) || matches!(plan.target, Target::Local));
        // Only a recorded image is looked for on other hosts (`worn_anywhere`): a build, forced or
        // first, is held or not by its own host's store alone, so a farm's rebuilds list one host.
        let anywhere = in_record.iter().any(|&r| r);
        let listings = match needs_listing {
            true => self.list_hosts(host, plan, id, anywhere).await,
            false => Vec::new(),
        };
        let host_store = crate::sweep::host_store_of(host);

        let mut decisions = Vec::with_capacity(built.len());
        for (i, &(image, inputs)) in built.iter().enumerate() {
            let recorded = entry(image);
            let platform = plan.platforms.first().cloned().unwrap_or_default();
            let decision = |action, reason, confirming| Decision {
                image,
                inputs,
                action,
                reason,
                recorded,
                confirming,
                platform: platform.clone(),
                via: Via::Native,
                index: None,
            };
            if in_record[i] {
                match &plan.target {
                    Target::Kind { .. } | Target::Nodes { .. } => {
                        decisions.push(decision(Action::Deliver, Reason::Recorded, true));
                        continue;
                    }
                    Target::Local => {
                        if let Some((_, found)) = worn_anywhere(&listings, &image.reference) {
                            self.hold_if_foreign(host, id, plan, found, &image.reference, events).await;
                            decisions.push(decision(Action::Skip, Reason::Recorded, false));
                            continue;
                        }
                    }
                    Target::Registry { .. } => {
                        if present[i] == Some(true) {
                            decisions.push(decision(Action::Skip, Reason::Recorded, false));
                            continue;
                        }
                    }
                }
            }
            let gone = in_record[i].then(|| Reason::Gone {
                store: match &plan.target {
                    Target::Registry { registry } => format!("registry {registry}"),
                    _ => host_store.clone(),
                },
                generation,
            });
            // Held on the host that would build it: the build is skipped, the delivery runs.
            let held = listings
                .iter()
                .find(|l| l.store == host_store)
                .and_then(|l| l.images.as_ref().ok())
                .and_then(|images| wears(images, &image.reference));
            let reason = match held {
                Some(found) if !self.ours(found) => {
                    let farm = found.labels.get(LABEL_FARM).cloned().unwrap_or_default();
                    self.hold_if_foreign(host, id, plan, found, &image.reference, events).await;
                    decisions.push(decision(Action::Deliver, gone.unwrap_or(Reason::HeldByFarm { farm }), false));
                    continue;
                }
                Some(_) if !plan.force => {
                    // Not a label: a converge id in the config would give every rebuild of one
                    // address a new image id, and nodes holding the old one would import again.
                    let converge = self.store.builder_of(&image.reference).await.ok().flatten();
                    let converge = converge.map(|c| c.to_string()).unwrap_or_default();
                    decisions.push(decision(Action::Deliver, gone.unwrap_or(Reason::Held { converge }), false));
                    continue;
                }
                _ if plan.force => Reason::Forced,
                _ => gone.unwrap_or_else(|| changed(record, image, inputs, plan)),
            };
            decisions.push(decision(Action::Build, reason, false));
        }
        Ok(decisions)
    }

    /// Whether `image` is labeled as built by this farm.
    fn ours(&self, image: &ListedImage) -> bool {
        image.labels.get(LABEL_FARM).map(String::as_str) == Some(self.config.farm.as_str())
    }

    /// Marks this farm's reliance on another farm's image on the daemon itself, unless it already
    /// is. A failed tag is said and not fatal: the converge still delivers what the record names;
    /// without the hold the owner's sweep may take the tag later, and the next converge rebuilds.
    async fn hold_if_foreign(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        plan: &UpPlan,
        image: &ListedImage,
        reference: &str,
        events: &Events,
    ) {
        if self.ours(image) || plan.dry_run {
            return;
        }
        let Some(hold) = hold_ref(&self.config.farm, reference) else { return };
        if image.refs.iter().any(|r| ImageRef::parse(r).ok() == ImageRef::parse(&hold).ok()) {
            return;
        }
        let task = Task::Tag { image_id: image.id.clone(), reference: hold.clone() };
        match host.run(id.as_str(), task, |_| {}).await {
            Ok(TaskOutcome::Tagged) => {}
            Ok(_) => {
                events.emit(EventKind::Note, None, format!("host {} cannot tag {hold} (an older agent?)", host.id))
            }
            Err(err) => events.emit(EventKind::Note, None, format!("holding {reference} as {hold} failed: {err}")),
        }
    }

    /// One host's listing, timed in `kiln_host_listing_duration_seconds`.
    async fn listed(&self, agent: &AgentConn, id: &ConvergeId) -> HostListing {
        let started = std::time::Instant::now();
        let images = list(agent, id.as_str()).await;
        self.metrics.host_listing_seconds.observe(started.elapsed().as_secs_f64());
        HostListing { store: crate::sweep::host_store_of(agent), images }
    }

    /// The labeled listing of `host`, and, for a `local` target when `anywhere` (an image is
    /// recorded), of every other host whose inventory (as the coordinator keeps it) shows one of
    /// the plan's images: a recorded image may sit on any of them. Listed at once, each under the
    /// task deadline: one slow agent holds no other.
    async fn list_hosts(&self, host: &AgentConn, plan: &UpPlan, id: &ConvergeId, anywhere: bool) -> Vec<HostListing> {
        let mut hosts: Vec<std::sync::Arc<AgentConn>> = Vec::new();
        if let (Target::Local, true) = (&plan.target, anywhere) {
            let holding: std::collections::HashSet<crate::hub::StreamId> =
                plan.images.iter().flat_map(|i| self.hub.inventory.holders(&HeldRef::of(&i.reference))).collect();
            let holds_one = |a: &AgentConn| holding.contains(&a.stream);
            hosts =
                self.hub.connected().into_iter().filter(|a| a.is_host() && a.id != host.id && holds_one(a)).collect();
        }
        let others = futures_util::future::join_all(hosts.iter().map(|other| self.listed(other, id)));
        let (first, others) = tokio::join!(self.listed(host, id), others);
        let mut listings = vec![first];
        listings.extend(others);
        for listing in &listings {
            if let Err(err) = &listing.images {
                tracing::warn!(store = %listing.store, error = %err, "host listing failed; it counts as holding nothing");
            }
        }
        listings
    }
}

/// Asks `host` whether each ref's manifest is in its registry. A probe that cannot be made counts
/// as "absent": the converge then pushes, which is always safe.
async fn probe(host: &AgentConn, id: &ConvergeId, references: Vec<String>) -> Vec<bool> {
    let asked = references.len();
    match host.run(id.as_str(), Task::Probe { references }, |_| {}).await {
        Ok(TaskOutcome::Probed { present }) if present.len() == asked => present,
        _ => vec![false; asked],
    }
}

/// Lists a host store; an error is a reason, so the caller can say why it counts as empty.
pub(super) async fn list(host: &AgentConn, converge: &str) -> Result<Vec<ListedImage>, String> {
    let task = Task::List { store: None, workloads: false, layers: false };
    match host.run(converge, task, |_| {}).await {
        Ok(TaskOutcome::Listing(l)) => Ok(l.images),
        Ok(_) => Err("the agent answered the listing with something else".to_string()),
        Err(err) => Err(err.to_string()),
    }
}

/// The Kiln image wearing exactly `reference` (after normalization), if any. An unlabeled image
/// never answers for a tag (ADR-0041): it is not Kiln's, so it proves nothing about the address.
pub(crate) fn wears<'a>(listing: &'a [ListedImage], reference: &str) -> Option<&'a ListedImage> {
    let want = ImageRef::parse(reference).ok()?;
    listing
        .iter()
        .filter(|img| img.labels.get(LABEL_KIND).is_some_and(|k| !k.is_empty()))
        .find(|img| img.refs.iter().any(|r| ImageRef::parse(r).is_ok_and(|r| r == want)))
}

fn worn_anywhere<'a>(listings: &'a [HostListing], reference: &str) -> Option<(&'a str, &'a ListedImage)> {
    listings.iter().find_map(|l| {
        let images = l.images.as_ref().ok()?;
        wears(images, reference).map(|found| (l.store.as_str(), found))
    })
}

/// Why an image the record does not name at this ref must be built: which inputs of its address
/// moved since the recorded generation, or that none ever named it.
pub(super) fn changed(record: Option<&Record>, image: &PlanImage, inputs: &BuildInputs, plan: &UpPlan) -> Reason {
    let Some(before) = record.and_then(|r| r.images.iter().find(|ri| ri.name == image.name)) else {
        return Reason::FirstBuild;
    };
    let now = address_inputs(inputs, &plan.platforms);
    Reason::Changed { changes: moved_inputs(before, &now, &plan.target.identity()) }
}

/// The inputs of `before`'s address that differ in `now`, delivered to `target`: what both a
/// converge's reason and `kiln why` say moved. Empty when nothing did.
pub(crate) fn moved_inputs(before: &RecordedImage, now: &AddressInputs, target: &str) -> Vec<InputChange> {
    let Some(was) = &before.inputs else {
        // A record from before Kiln kept inputs: the tree digest is all it can compare.
        let mut changes = Vec::new();
        if let Some(context) = before.context.as_ref().filter(|c| **c != now.tree) {
            changes.push(change(Input::Context, "", context, &now.tree));
        }
        return changes;
    };
    let mut changes = Vec::new();
    if was.dockerfile != now.dockerfile && !was.dockerfile.is_empty() && !now.dockerfile.is_empty() {
        changes.push(change(Input::Dockerfile, "", &was.dockerfile, &now.dockerfile));
    }
    if was.tree != now.tree {
        changes.push(change(Input::Context, "", &was.tree, &now.tree));
    }
    let names: std::collections::BTreeSet<&String> = was.args.keys().chain(now.args.keys()).collect();
    for name in names {
        let (a, b) = (was.args.get(name), now.args.get(name));
        if a != b {
            changes.push(change(Input::BuildArg, name, a.map_or("", String::as_str), b.map_or("", String::as_str)));
        }
    }
    if was.target != now.target {
        changes.push(change(Input::Target, "", &was.target, &now.target));
    }
    if was.platforms != now.platforms {
        changes.push(change(Input::Platforms, "", &was.platforms.join(","), &now.platforms.join(",")));
    }
    if changes.is_empty() && before.target != target {
        changes.push(change(Input::Delivery, "", &before.target, target));
    }
    changes
}

fn change(input: Input, name: &str, before: &str, after: &str) -> InputChange {
    // Which files moved is added once both contexts' entry lists are at hand (`files.rs`).
    InputChange { input, name: name.to_string(), before: before.to_string(), after: after.to_string(), files: None }
}

/// What the record keeps of a built image's address.
pub(super) fn address_inputs(inputs: &BuildInputs, platforms: &[String]) -> AddressInputs {
    let mut platforms = platforms.to_vec();
    platforms.sort();
    AddressInputs {
        tree: inputs.context.to_string(),
        dockerfile: inputs.dockerfile_digest.clone(),
        args: inputs.args.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<BTreeMap<_, _>>(),
        target: inputs.target_stage.clone(),
        platforms,
    }
}
