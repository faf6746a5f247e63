//! Step 5 for every image at once: each image that needs more than a skip is a task of its own,
//! built wherever the queue gives it a slot and delivered from there; an image built `FROM`
//! another image of the converge waits for it and builds on the agent that holds it (each
//! platform of a multi-platform image on the agent holding the base's image of that platform). The first
//! failure ends the converge: the other tasks are dropped, which takes them out of the queue and
//! stops what their agents run.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::watch;
use tracing::Instrument;

use super::decide::Decision;
use super::platforms::Placements;
use super::{store_failure, Engine, Failure};
use crate::events::Events;
use crate::hub::{AgentConn, HeldRef};
use crate::model::{Action, ConvergeId, RecordedImage};
use crate::plan::UpPlan;

/// Where one image of the converge ended up: per platform it was built for (the decision's
/// platform for a one-platform image), the agent holding that platform's image.
pub(super) type Holders = Vec<(String, String)>;

/// Where each image of the converge ended up, once it is there. `None` inside: the image failed.
pub(super) struct Graph {
    done: HashMap<String, watch::Sender<Option<Option<Holders>>>>,
}

impl Graph {
    fn new(decisions: &[Decision<'_>]) -> Graph {
        let done = decisions.iter().map(|d| (d.image.name.clone(), watch::channel(None).0)).collect();
        Graph { done }
    }

    fn finish(&self, name: &str, holders: Option<Holders>) {
        if let Some(tx) = self.done.get(name) {
            tx.send_replace(Some(holders));
        }
    }

    /// Waits for `name`; where it is held (empty: nowhere known, or not built here), or `Err` if
    /// it failed.
    pub(super) async fn wait(&self, name: &str) -> Result<Holders, ()> {
        let Some(tx) = self.done.get(name) else { return Ok(Vec::new()) };
        let mut rx = tx.subscribe();
        loop {
            if let Some(holders) = rx.borrow_and_update().clone() {
                return holders.ok_or(());
            }
            if rx.changed().await.is_err() {
                return Err(());
            }
        }
    }
}

impl Engine {
    /// Runs every decision to its record entry, in parallel; entries come back in decision order.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_all(
        &self,
        home: &Arc<AgentConn>,
        id: &ConvergeId,
        plan: &UpPlan,
        decisions: &[Decision<'_>],
        placements: &Placements,
        generation: u64,
        events: &Events,
    ) -> Result<Vec<RecordedImage>, Failure> {
        let graph = Graph::new(decisions);
        let mut tasks: FuturesUnordered<_> = decisions
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let graph = &graph;
                let span = tracing::info_span!("image", otel.name = %format!("image {}", d.image.name), action = d.action.word());
                async move {
                    let result = match placements.get(&d.image.name).filter(|_| d.action != Action::Skip) {
                        Some(vias) => self.run_platforms(home, id, plan, d, vias, generation, events, graph).await,
                        None => self.run_one(home, id, plan, d, generation, events, graph).await,
                    };
                    graph.finish(&d.image.name, result.as_ref().ok().map(|(_, holders)| holders.clone()));
                    (i, result.map(|(entry, _)| entry))
                }
                .instrument(span)
            })
            .collect();
        let lease = self.config.claim_lease;
        let mut renew = tokio::time::interval((lease / 3).max(std::time::Duration::from_millis(100)));
        renew.tick().await;
        let mut entries: Vec<Option<RecordedImage>> = vec![None; decisions.len()];
        loop {
            tokio::select! {
                next = tasks.next() => match next {
                    Some((i, Ok(entry))) => entries[i] = Some(entry),
                    // Dropping `tasks` drops the rest: out of the queue, stopped on their agents.
                    Some((_, Err(failure))) => return Err(failure),
                    None => break,
                },
                _ = renew.tick() => {
                    let until = super::now_ms() + lease.as_millis() as u64;
                    self.store.renew_claims(id, until).await.map_err(store_failure)?;
                }
            }
        }
        Ok(entries.into_iter().map(|e| e.expect("every task answered")).collect())
    }

    /// One image: wait for the images it builds FROM, then skip, deliver, or build and deliver.
    /// Returns its record entry and the agent holding it (for the images built FROM it).
    #[allow(clippy::too_many_arguments)]
    async fn run_one(
        &self,
        home: &Arc<AgentConn>,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        generation: u64,
        events: &Events,
        graph: &Graph,
    ) -> Result<(RecordedImage, Holders), Failure> {
        let name = d.image.name.as_str();
        // The base exists on the daemon that built it: the child builds there too.
        let mut required = None;
        for base in &d.inputs.from {
            match graph.wait(base).await {
                Ok(holders) => required = required.or(holders.into_iter().next().map(|(_, agent)| agent)),
                Err(()) => {
                    return Err(Failure::of(name, format!("not built: the image it builds FROM, {base}, failed")))
                }
            }
        }
        match (d.action, d.recorded) {
            (Action::Skip, Some(entry)) => {
                let holder = home.holds(&HeldRef::of(&d.image.reference)).then(|| home.id.clone());
                Ok((entry.clone(), holder.map(|agent| (d.platform.clone(), agent)).into_iter().collect()))
            }
            (Action::Build, _) => {
                let grant = self.build_placed(id, plan, d, &d.reason, required, events).await?;
                let agent = grant.agent.clone();
                let mut slot = Some(grant);
                let entry = self.deliver_from(&agent, &mut slot, id, plan, d, generation, events).await?;
                Ok((entry, vec![(d.platform.clone(), agent.id.clone())]))
            }
            _ => {
                self.announce_held(plan, d, events);
                let entry = self.deliver_from(home, &mut None, id, plan, d, generation, events).await?;
                Ok((entry, vec![(d.platform.clone(), home.id.clone())]))
            }
        }
    }
}
