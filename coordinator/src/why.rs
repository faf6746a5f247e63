//! `Kiln.Why` (`kiln why IMAGE`): which inputs of one built image moved since a recorded
//! generation, with that generation's entry list so the CLI can name every file against its own
//! walk. The comparison is the converge's own (`engine::moved_inputs`), so `kiln why` and the
//! reason `kiln up` gives never disagree about what moved.
//!
//! Only a read: it opens no converge and writes nothing. Entry lists name a team's files, so the
//! instance's owners (and admins) may ask, as for downloading its contexts.

use std::collections::BTreeMap;

use kiln_proto::v1 as pb;
use tonic::Status;

use crate::api::{may_own, store_status};
use crate::engine::{moved_inputs, Engine};
use crate::events::reason_to_pb;
use crate::model::{AddressInputs, Input, Reason, Record, RecordedKind};
use crate::plan::Target;
use crate::trust::Principal;

pub(crate) async fn why(engine: &Engine, principal: &Principal, req: pb::WhyRequest) -> Result<pb::WhyReply, Status> {
    let instance = req.instance;
    let missing = |field: &str| Status::invalid_argument(format!("WhyRequest.{field} is missing"));
    if instance.is_empty() {
        return Err(missing("instance"));
    }
    let image = req.image.ok_or_else(|| missing("image"))?;
    if image.name.is_empty() {
        return Err(missing("image.name"));
    }
    let target = Target::of(&instance, req.target.ok_or_else(|| missing("target"))?)?;
    let store = &engine.store;
    if let Some(owner) = store.owner(&instance).await.map_err(store_status)? {
        may_own(principal, &instance, &owner).map_err(|_| {
            Status::permission_denied(format!(
                "instance {instance} is owned by {owner}; {} may not read its files — ask its owner or an admin",
                principal.actor()
            ))
        })?;
    }
    let record = recorded_generation(engine, &instance, req.generation).await?;
    let generation = record.generation.0;
    let Some(recorded) = record.images.iter().find(|i| i.name == image.name) else {
        return Ok(pb::WhyReply { generation, reason: Some(reason_to_pb(&Reason::FirstBuild)), ..Default::default() });
    };
    if recorded.kind != RecordedKind::Built {
        return Err(Status::invalid_argument(format!(
            "image {} of instance {instance} is not built by Kiln (it is {}); `kiln why` explains built images",
            image.name, recorded.reference
        )));
    }
    let mut platforms = req.platforms;
    platforms.sort();
    let now = AddressInputs {
        tree: image.context_digest,
        dockerfile: image.dockerfile_digest,
        args: image.args.into_iter().collect::<BTreeMap<_, _>>(),
        target: image.target_stage,
        platforms,
    };
    let changes = moved_inputs(recorded, &now, &target.identity());
    // Nothing is diffed when nothing moved: the list goes out only with a context change.
    let entries = match changes.iter().find(|c| c.input == Input::Context) {
        Some(context) => store.context_entries(&context.before).await.map_err(store_status)?.unwrap_or_default(),
        None => Vec::new(),
    };
    let words = changes.iter().map(|c| c.words()).collect();
    Ok(pb::WhyReply {
        generation,
        reference: recorded.reference.clone(),
        reason: Some(reason_to_pb(&Reason::Changed { changes })),
        words,
        entries,
    })
}

/// The record's current generation (`asked` 0 or its number) or the one it replaced; any other
/// was pruned, and the refusal names the generations that are kept.
async fn recorded_generation(engine: &Engine, instance: &str, asked: u64) -> Result<Record, Status> {
    let current = engine.store.record(instance).await.map_err(store_status)?.ok_or_else(|| {
        Status::not_found(format!("instance {instance} has no record — `kiln up` converges it first"))
    })?;
    if asked == 0 || asked == current.generation.0 {
        return Ok(current);
    }
    let previous = engine.store.previous_record(instance).await.map_err(store_status)?;
    match previous {
        Some(previous) if previous.generation.0 == asked => Ok(previous),
        previous => {
            let kept = match &previous {
                Some(p) => format!("generations {} and {}", p.generation.0, current.generation.0),
                None => format!("generation {}", current.generation.0),
            };
            Err(Status::not_found(format!(
                "generation {asked} of instance {instance} is not kept: its record keeps {kept} — pass one of them to --since"
            )))
        }
    }
}
