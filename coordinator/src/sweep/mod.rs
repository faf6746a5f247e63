//! The sweep (DESIGN.md "Reachability", "The converge" step 8): list every store the connected
//! agents hold, gather the roots, plan with `core`'s pure planner, have each store's agent remove
//! what the plan says (delete-if-present, failures reported and skipped), and list again to confirm
//! what went and how many bytes came back.
//!
//! Order matters for the claim to work. Stores are listed *before* the roots are read: a converge
//! claims its refs before it builds, so an image in a listing either predates the roots read (its
//! claim, if any, is in the roots) or was built after it (and is not in the listing, so it cannot
//! be planned away). Reading the roots first would leave a window in which a converge claims and
//! builds a ref after the read but before the listing, and the sweep would take it.
//!
//! Stores are whatever the agents announced (in their hello, or a later `Stores` message): host
//! stores (Docker), node agents' stores (containerd or CRI), and the containerd of every kind node
//! container a host agent reaches. All are listed and swept through the same tasks, addressed by
//! store id, and the planner gives node stores the grace generation and CRI's whole-id rule.

mod ledger;
mod report;
mod roots;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tracing::Instrument;

use kiln_core::sweep::{
    plan, ListedImage, Plan, Policy, RemovalMode, RemovalTarget, StoreId, StoreKind, StoreListing, StorePlan,
};
use kiln_proto::v1 as pb;
use tokio::task::JoinSet;

use crate::engine::{now_ms, Engine};
use crate::events::Events;
use crate::hub::AgentConn;
use crate::model::{ConvergeId, EventKind};
use crate::state::StateError;
use crate::task::{Task, TaskOutcome};
pub(crate) use ledger::Ledger;
use report::{confirm, owner, restrict, target_text, Confirmed};

/// What a sweep is asked to do besides the default (remove, report only the total).
#[derive(Debug, Clone, Default)]
pub(crate) struct SweepOptions {
    /// Plan and report every removal it would make; remove nothing.
    pub dry_run: bool,
    /// Remove only images labeled with this instance (`kiln gc --instance`).
    pub only_instance: Option<String>,
    /// Refs kept besides the stored roots: the converge that sweeps keeps its own refs even if
    /// its claims were already gone.
    pub keep: Vec<String>,
    /// Report each removal (gc, down) and a total even when nothing went. A converge's sweep
    /// reports its total only when it freed something, and failures always.
    pub narrate: bool,
}

/// What a sweep did, as the re-listings confirmed it (or, for a dry run, what it would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SweepTotals {
    pub images: u64,
    pub bytes: u64,
    /// Planned removals that did not happen.
    pub not_removed: usize,
    /// Stores that could not be swept (listing failed, or their containers could not be seen).
    pub skipped_stores: usize,
}

/// Why no sweep could be planned at all.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SweepError {
    /// Without every root a plan could take a ref something still needs, so nothing is removed.
    #[error("cannot read the sweep's roots ({what}), so nothing was removed")]
    Roots {
        what: &'static str,
        #[source]
        err: StateError,
    },
    /// The cluster's objects name images too; a sweep that cannot read them would guess.
    #[error("cannot read the sweep's Kubernetes roots, so nothing was removed")]
    Kubernetes(#[source] crate::kube::KubeError),
}

/// One store and the agent that holds it.
#[derive(Debug, Clone)]
struct Held {
    agent: Arc<AgentConn>,
    store: StoreId,
    kind: StoreKind,
}

/// A store's listing as its agent answered it.
#[derive(Debug)]
struct Read {
    images: Vec<ListedImage>,
    in_use: Vec<String>,
    workloads_listed: bool,
    removes_whole_ids: bool,
}

/// A sweep's plan before anything is removed: what each store holds, the roots read after the
/// listings, and what the planner would remove. The sweep acts on it; the status page's byte
/// ledger only shows it.
#[derive(Debug)]
pub(crate) struct Planned {
    /// The stores listed, with workloads, in agent then store order.
    pub listings: Vec<StoreListing>,
    pub plan: Plan,
    /// Image id → owner (instance, `shared` or `unowned`), over every listing.
    pub owners: HashMap<String, String>,
    pub records: Vec<(crate::model::Record, Option<crate::model::Record>)>,
    /// Stores that cannot be swept now, and why (a sentence that follows "store X not swept: ").
    pub skipped: Vec<(StoreId, String)>,
    /// Each store listed, by id, with the agent that holds it.
    by_store: HashMap<StoreId, Held>,
}

/// Lists every store, *then* reads the roots (see the module's note on order), and plans. Tasks
/// carry `converge` (empty for a look that belongs to no converge, as the page's).
pub(crate) async fn plan_sweep(
    engine: &Engine,
    converge: &ConvergeId,
    options: &SweepOptions,
) -> Result<Planned, SweepError> {
    let held = held_stores(&engine.hub.connected());
    let reads = list_all(&held, converge, true, true).await;

    let roots_err = |what| move |err| SweepError::Roots { what, err };
    let records = engine.store.records().await.map_err(roots_err("records"))?;
    let claims = engine.store.live_claims(now_ms()).await.map_err(roots_err("claims"))?;
    let pins = engine.store.pins().await.map_err(roots_err("pins"))?;
    let kubernetes = match &engine.config.kubernetes {
        Some(kube) => crate::kube::gather_roots(kube).await.map_err(SweepError::Kubernetes)?,
        None => Vec::new(),
    };

    let mut listings = Vec::new();
    let mut workloads = BTreeMap::new();
    let mut by_store: HashMap<StoreId, Held> = HashMap::new();
    let mut skipped = Vec::new();
    for (store, read) in held.into_iter().zip(reads) {
        let read = match read {
            Ok(read) if read.workloads_listed => read,
            Ok(_) => {
                let why = "its agent does not report the images its containers use (upgrade the agent)";
                skipped.push((store.store.clone(), why.to_string()));
                continue;
            }
            Err(why) => {
                skipped.push((store.store.clone(), format!("listing it failed: {why}")));
                continue;
            }
        };
        workloads.insert(store.store.clone(), read.in_use);
        listings.push(StoreListing {
            store: store.store.clone(),
            kind: store.kind,
            // `docker rmi <tag>` untags; only a CRI-only node store removes whole ids.
            removal: if read.removes_whole_ids { RemovalMode::PerId } else { RemovalMode::PerRef },
            runs_workloads: false,
            images: read.images,
        });
        by_store.insert(store.store.clone(), store);
    }
    let mut gathered = roots::gather(&records, &claims, &pins, &options.keep, workloads);
    gathered.roots.kubernetes = kubernetes;
    for listing in &mut listings {
        listing.runs_workloads = listing.kind == StoreKind::Host && gathered.hosts_run_workloads;
    }

    let mut plan = plan(&listings, &gathered.roots, &Policy { farm: engine.config.farm.clone() });
    if let Some(instance) = &options.only_instance {
        restrict(&mut plan, instance);
    }
    let owners: HashMap<String, String> =
        listings.iter().flat_map(|l| l.images.iter()).map(|image| (image.id.clone(), owner(image))).collect();
    Ok(Planned { listings, plan, owners, records, skipped, by_store })
}

impl Planned {
    /// The agent that holds `store`.
    pub fn agent_of(&self, store: &StoreId) -> Option<String> {
        self.by_store.get(store).map(|held| held.agent.id.clone())
    }
}

/// The byte ledger now: a dry-run plan that belongs to no converge (nothing is written, no
/// `(gc)` converge is opened) and the contexts a gc would collect.
pub(crate) async fn ledger_now(engine: &Engine) -> Result<Ledger, SweepError> {
    let planned = plan_sweep(engine, &ConvergeId::from(""), &SweepOptions::default()).await?;
    let mut ledger = ledger::ledger(&planned, &engine.config.farm);
    let contexts = engine.store.contexts().await.map_err(|err| SweepError::Roots { what: "contexts", err })?;
    ledger.contexts.contexts = contexts.len() as u64;
    ledger.contexts.bytes = contexts.iter().map(|c| c.bytes).sum();
    let collected = engine
        .contexts
        .collect(&contexts_kept(&planned.records), now_ms(), true)
        .await
        .map_err(|err| SweepError::Roots { what: "contexts", err })?;
    (ledger.contexts.would_collect, ledger.contexts.would_collect_bytes) = (collected.contexts, collected.bytes);
    Ok(ledger)
}

/// Runs one sweep for the converge (or gc, or down) `converge`, narrating through `events`.
pub(crate) async fn sweep(
    engine: &Engine,
    converge: &ConvergeId,
    options: &SweepOptions,
    events: &Events,
) -> Result<SweepTotals, SweepError> {
    let mut totals = SweepTotals::default();
    let Planned { listings, plan, owners, records, skipped, by_store } = plan_sweep(engine, converge, options).await?;
    for (store, why) in &skipped {
        totals.skipped_stores += 1;
        events.emit(EventKind::Note, None, format!("store {store} not swept: {why}"));
    }
    report_kept_whole(&plan, events);

    if options.dry_run {
        planned(&plan, &owners, events, &mut totals);
        collect_contexts(engine, &records, options, events).await;
        return Ok(totals);
    }

    let mut running = JoinSet::new();
    for (index, store_plan) in plan.stores.iter().enumerate().filter(|(_, p)| !p.removals.is_empty()) {
        let Some(store) = by_store.get(&store_plan.store).cloned() else { continue };
        let (store_plan, owners, converge) = (store_plan.clone(), owners.clone(), converge.clone());
        let before =
            listings.iter().find(|l| l.store == store_plan.store).map(|l| l.images.clone()).unwrap_or_default();
        // In the sweep's span: a spawned task starts outside it.
        let removing = async move { (index, execute(&store, &converge, &store_plan, &owners, &before).await) };
        running.spawn(removing.in_current_span());
    }
    let mut outcomes: Vec<(usize, Result<Confirmed, String>)> = running.join_all().await;
    // Stores ran in parallel; their reports are told in store order, so a replay reads the same.
    outcomes.sort_by_key(|(index, _)| *index);
    for (index, outcome) in outcomes {
        let store = &plan.stores[index].store;
        let confirmed = match outcome {
            Ok(confirmed) => confirmed,
            Err(why) => {
                totals.skipped_stores += 1;
                events.emit(EventKind::Note, None, format!("store {store}: removals unconfirmed: {why}"));
                continue;
            }
        };
        for done in &confirmed.done {
            tracing::info!(%store, reference = %done.target, owner = %done.owner, bytes = done.bytes, "swept");
            if options.narrate {
                let kind = EventKind::Removed {
                    store: store.to_string(),
                    instance: done.owner.clone(),
                    reference: done.target.clone(),
                    bytes: done.bytes,
                };
                events.emit(kind, None, "");
            }
        }
        for not in &confirmed.not_done {
            tracing::warn!(%store, reference = %not.target, why = %not.why, "not swept");
            let kind = EventKind::NotRemoved { store: store.to_string(), reference: not.target.clone() };
            events.emit(kind, None, not.why.clone());
        }
        let (removed, failed) = (confirmed.done.len() as u64, confirmed.not_done.len() as u64);
        engine.metrics.swept(&store.0, removed, confirmed.bytes, failed);
        totals.images += confirmed.images;
        totals.bytes += confirmed.bytes;
        totals.not_removed += confirmed.not_done.len();
    }
    if options.narrate || totals.images > 0 {
        events.emit(EventKind::Swept { images: totals.images, bytes: totals.bytes }, None, "");
    }
    collect_contexts(engine, &records, options, events).await;
    Ok(totals)
}

/// The content store is collected like the images: an uploaded context stays while a record's
/// current or previous generation, or a live claim, names it. `gc --instance` leaves it alone (a
/// context may serve several instances). A failure is said; it never fails the sweep.
async fn collect_contexts(
    engine: &Engine,
    records: &[(crate::model::Record, Option<crate::model::Record>)],
    options: &SweepOptions,
    events: &Events,
) {
    if options.only_instance.is_some() {
        return;
    }
    match engine.contexts.collect(&contexts_kept(records), now_ms(), options.dry_run).await {
        Ok(done) if done.contexts > 0 || done.blobs > 0 || options.narrate => {
            let kind = EventKind::ContextsCollected { count: done.contexts, bytes: done.bytes };
            let verb = if options.dry_run { "would collect" } else { "collected" };
            let blobs = match done.blobs {
                0 => String::new(),
                n => format!(" and {n} file blob(s) no context names"),
            };
            events.emit(kind, None, format!("{verb} {} uploaded context(s){blobs}", done.contexts));
        }
        Ok(_) => {}
        Err(err) => {
            events.emit(EventKind::Note, None, format!("contexts not collected: {}", kiln_core::error_chain(&err)))
        }
    }
}

/// The contexts a record's current or previous generation names: what the content store keeps.
fn contexts_kept(
    records: &[(crate::model::Record, Option<crate::model::Record>)],
) -> std::collections::HashSet<String> {
    records
        .iter()
        .flat_map(|(current, previous)| std::iter::once(current).chain(previous.as_ref()))
        .flat_map(|record| record.images.iter().filter_map(|image| image.context.clone()))
        .collect()
}

/// Every store the agents announced, in agent then store order.
fn held_stores(agents: &[Arc<AgentConn>]) -> Vec<Held> {
    let mut held = Vec::new();
    for agent in agents {
        for info in &agent.stores() {
            let kind = match info.kind() {
                pb::store_info::Kind::Node => StoreKind::Node,
                // An agent that does not say is an older host agent: its one store is its daemon.
                pb::store_info::Kind::Host | pb::store_info::Kind::Unspecified => StoreKind::Host,
            };
            held.push(Held { agent: agent.clone(), store: StoreId(info.id.clone()), kind });
        }
    }
    held
}

/// Every store the connected agents announced, listed in parallel (without workloads), in agent
/// then store order: `(agent, store, its images or why it could not be listed)`. `kiln images`.
pub(crate) async fn list_every_store(
    agents: &[Arc<AgentConn>],
) -> Vec<(String, String, Result<Vec<ListedImage>, String>)> {
    let held = held_stores(agents);
    // Not on behalf of a converge: tasks carry an empty converge id, as before.
    let reads = list_all(&held, &ConvergeId::from(""), false, false).await;
    held.into_iter().zip(reads).map(|(h, read)| (h.agent.id.clone(), h.store.0, read.map(|r| r.images))).collect()
}

/// Lists every store in parallel; the answers come back in `held`'s order.
async fn list_all(held: &[Held], converge: &ConvergeId, workloads: bool, layers: bool) -> Vec<Result<Read, String>> {
    let mut listing = JoinSet::new();
    for (index, store) in held.iter().cloned().enumerate() {
        let converge = converge.clone();
        listing.spawn(async move { (index, list(&store, &converge, workloads, layers).await) }.in_current_span());
    }
    let mut reads = listing.join_all().await;
    reads.sort_by_key(|(index, _)| *index);
    reads.into_iter().map(|(_, read)| read).collect()
}

async fn list(store: &Held, converge: &ConvergeId, workloads: bool, with_layers: bool) -> Result<Read, String> {
    // A sweep's listings carry layers, so what it frees is counted in real bytes.
    let task = Task::List { store: Some(store.store.clone()), workloads, layers: with_layers };
    match store.agent.run(converge.as_str(), task, |_| {}).await {
        Ok(TaskOutcome::Listing(l)) => Ok(Read {
            images: l.images,
            in_use: l.in_use,
            workloads_listed: l.workloads_listed,
            removes_whole_ids: l.removes_whole_ids,
        }),
        Ok(_) => Err(format!("agent {} answered the listing with something else", store.agent.id)),
        Err(err) => Err(err.to_string()),
    }
}

/// Sends one store's removals, then lists it again and judges them against what is left.
async fn execute(
    store: &Held,
    converge: &ConvergeId,
    store_plan: &StorePlan,
    owners: &HashMap<String, String>,
    before: &[ListedImage],
) -> Result<Confirmed, String> {
    let (mut references, mut image_ids) = (Vec::new(), Vec::new());
    for removal in &store_plan.removals {
        match &removal.target {
            RemovalTarget::Ref(reference) => references.push(reference.clone()),
            RemovalTarget::Id(id) => image_ids.push(id.clone()),
        }
    }
    let task = Task::Remove { store: store.store.clone(), references, image_ids };
    let mut failures: HashMap<String, String> = HashMap::new();
    match store.agent.run(converge.as_str(), task, |_| {}).await {
        Ok(TaskOutcome::Removed(removed)) => failures.extend(removed.failures),
        // The task may have run in part; the re-listing below says what went.
        Ok(_) => {
            let why = format!("agent {} answered the removal with something else", store.agent.id);
            failures.extend(store_plan.removals.iter().map(|r| (target_text(&r.target).to_string(), why.clone())));
        }
        Err(err) => {
            let why = err.to_string();
            failures.extend(store_plan.removals.iter().map(|r| (target_text(&r.target).to_string(), why.clone())));
        }
    }
    let after = list(store, converge, false, true).await.map_err(|why| format!("listing it again failed: {why}"))?;
    Ok(confirm(store_plan, owners, before, &after.images, &failures))
}

/// A dry run's report: every removal it would make, and what it would free.
fn planned(plan: &Plan, owners: &HashMap<String, String>, events: &Events, totals: &mut SweepTotals) {
    for store_plan in &plan.stores {
        for removal in &store_plan.removals {
            let kind = EventKind::Planned {
                store: store_plan.store.to_string(),
                instance: owners.get(&removal.id).cloned().unwrap_or_default(),
                reference: target_text(&removal.target).to_string(),
                bytes: removal.bytes,
            };
            events.emit(kind, None, "");
            totals.images += u64::from(removal.frees);
        }
        totals.bytes += store_plan.freed_bytes;
    }
}

/// CRI cannot untag: an id with both kept and garbage refs stays whole, and the user hears why.
fn report_kept_whole(plan: &Plan, events: &Events) {
    for store_plan in &plan.stores {
        for kept in &store_plan.kept_whole {
            events.emit(
                EventKind::Note,
                None,
                format!(
                    "store {}: image {} kept whole — {} is still needed and this store cannot untag {}",
                    store_plan.store,
                    kept.id,
                    kept.kept_by,
                    kept.garbage_refs.join(", ")
                ),
            );
        }
    }
}

/// The id of `agent`'s host store, as it announced it: what reasons and events name a host by.
pub(crate) fn host_store_of(agent: &AgentConn) -> String {
    agent
        .stores()
        .into_iter()
        .find(|s| matches!(s.kind(), pb::store_info::Kind::Host | pb::store_info::Kind::Unspecified))
        .map_or_else(|| format!("docker@{}", agent.id), |s| s.id)
}
