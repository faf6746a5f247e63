//! The settled converge: a `kiln up` whose every image is recorded and confirmed where its target
//! puts it. It is decided before anything is stored, and then stored whole in one write
//! ([`StateStore::settle_converge`](crate::state::StateStore::settle_converge)) instead of being
//! opened, logged and finished in three. Why: it is the call a developer waits on, and on a
//! busy farm each write waits for a commit behind everyone else's builds.
//!
//! It decides exactly as [`Engine::up`] does (the same record, the same confirmation, the same
//! decisions), and says the same events. Anything else gives up, and the converge runs the
//! usual way from its start: `--force`, an image to build or deliver, a pin to mirror, images to
//! publish, a multi-platform image, a target whose confirmation is a delivery (`nodes`, `kind`),
//! no host connected right now, or any error. Giving up after deciding costs the converge one
//! more record read and one more listing; it happens only when the record names every ref the
//! converge computes and something still has to move (an image gone from its store, another
//! target), so neither a farm's first builds nor a forced rebuild pay it.

use super::decide::Decision;
use super::{built_images, covers, in_manifest_order, passthrough, platforms, step, Engine};
use crate::events::Events;
use crate::model::{Action, ConvergeId, EventKind, Generation, Reason};
use crate::plan::{Target, UpPlan};
use std::time::Duration;
use tracing::Instrument;

/// What a settled converge says and where it stands.
#[derive(Debug)]
pub struct Settled {
    /// The record's current generation, which the converge leaves as it is.
    pub generation: Generation,
    /// Its events between `Started` and `Finished`, in the order told.
    pub events: Vec<(EventKind, Option<String>, String)>,
}

impl Engine {
    /// Decides `plan` as the converge `id` and returns what it would say when nothing is to
    /// change; `None` when it must run the usual way. Writes nothing to the state.
    pub async fn settled(&self, id: &ConvergeId, plan: &UpPlan) -> Option<Settled> {
        let publishes = self.config.kubernetes.is_some() && plan.namespace.is_some();
        let simple_target = matches!(plan.target, Target::Local | Target::Registry { .. });
        let mirrors = plan.images.iter().any(|image| image.mirrored_from.is_some());
        // `--force` rebuilds everything: deciding it here would only list the host twice.
        let usual = plan.dry_run || plan.force || plan.mirror_only || platforms::multi(plan);
        if usual || publishes || mirrors || !simple_target {
            return None;
        }
        let record = self.store.settled_record(&plan.instance).await.ok()??;
        let built = built_images(plan);
        // The usual converge claims unless the record names every built ref; this one never does.
        if !covers(&record, &built) {
            return None;
        }
        let (events, collected) = Events::collecting(id.clone());
        let mut recorded = passthrough(plan);
        if !built.is_empty() {
            // No waiting for a host: that is the usual converge's to do, and to say.
            let host = self.pick_host_within(plan, Duration::ZERO).await.ok()?;
            let deciding = self.decide(&host, id, plan, Some(&record), &built, &events);
            let decisions = deciding.instrument(step("decide")).await.ok()?;
            if decisions.iter().any(|d| d.action != Action::Skip) {
                return None;
            }
            self.tell_skipped(&decisions, &events);
            recorded.extend(decisions.iter().filter_map(|d| d.recorded.cloned()));
        }
        in_manifest_order(plan, &mut recorded);
        if recorded != record.images {
            return None;
        }
        Some(Settled { generation: record.generation, events: collected.take(events) })
    }

    /// The `Recorded` event and the skip count of each image skipped, as the usual converge tells
    /// them once it has decided.
    pub(super) fn tell_skipped(&self, decisions: &[Decision<'_>], events: &Events) {
        for d in decisions.iter().filter(|d| d.action == Action::Skip) {
            self.metrics.skipped(&Reason::Recorded);
            let kind = EventKind::Recorded { reference: d.image.reference.clone(), reason: Some(Reason::Recorded) };
            events.emit(kind, Some(&d.image.name), d.image.reference.clone());
        }
    }
}
