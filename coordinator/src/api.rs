//! The CLI-facing `Kiln` service: `Up`, `Down` and `Gc` each open a converge and stream its events
//! (an up sweeps after it succeeds; down deletes the record, then sweeps; gc only sweeps);
//! `Pin`/`Unpin`/`Pins` keep refs through sweeps; `Status`, `Logs`, `Images` and `Agents` read
//! state. A converge runs to its end even if its client goes away.

use crate::engine::{now_ms, step, Engine, Failure};
use crate::events::{to_pb, Events};
use crate::model::{ConvergeId, ConvergeState, EventKind, Owner};
use crate::plan::UpPlan;
use crate::state::StateError;
use crate::sweep::{sweep, SweepError, SweepOptions};
use crate::trust::{Peer, Principal, Role};
use kiln_core::refs::ImageRef;
use kiln_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

mod settled;

/// The `Kiln` gRPC service.
#[derive(Debug, Clone)]
pub struct KilnService {
    pub engine: Arc<Engine>,
}

/// Who asked, for records and events: the verified identity; only the embedded principal (one
/// user, in-process, or `--dev`) is taken at its word, since there is no one else it could be.
fn requester(principal: &Principal, claimed: &str) -> String {
    match principal {
        Principal::Embedded if !claimed.is_empty() => claimed.to_string(),
        other => other.actor(),
    }
}

/// Whether `principal` may converge or take down an instance owned by `owner`; the refusal names
/// the owner.
pub(crate) fn may_own(principal: &Principal, instance: &str, owner: &Owner) -> Result<(), Status> {
    let allowed = match principal {
        Principal::Embedded => true,
        Principal::User { role: Role::Admin, .. } => true,
        Principal::User { name, team, .. } => match &owner.team {
            Some(owning) => team.as_deref() == Some(owning.as_str()),
            None => *name == owner.user,
        },
        _ => false,
    };
    if allowed {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "instance {instance} is owned by {owner}; {} may not change it — ask its owner or an admin",
        principal.actor()
    )))
}

/// Writes one line of the audit log; a failure to write is logged, never the call's failure.
pub(crate) async fn audit(
    engine: &Engine,
    actor: String,
    action: &str,
    target: &str,
    address: String,
    outcome: String,
) {
    let entry = crate::model::AuditRow {
        at_ms: now_ms(),
        actor,
        action: action.to_string(),
        target: target.to_string(),
        address,
        outcome,
    };
    if let Err(err) = engine.store.append_audit(entry).await {
        tracing::warn!(error = %err, "audit entry not written");
    }
}

/// Refuses a call that would change something on a read-only coordinator.
fn writable(engine: &Engine, call: &str) -> Result<(), Status> {
    match engine.config.read_only {
        false => Ok(()),
        true => Err(Status::failed_precondition(format!(
            "this coordinator only reads (another kiln holds its state); {call} must wait for it"
        ))),
    }
}

pub(crate) fn store_status(err: StateError) -> Status {
    match err {
        StateError::ConvergeRunning { .. } => Status::aborted(kiln_core::error_chain(&err)),
        StateError::UnknownConverge { .. } => Status::not_found(kiln_core::error_chain(&err)),
        other => Status::internal(kiln_core::error_chain(&other)),
    }
}

type EventStream = ReceiverStream<Result<pb::ConvergeEvent, Status>>;

/// The converge-log "instance" every `kiln gc` runs under. Instance names are DNS labels, so no
/// manifest can name this one; one gc at a time follows from one running converge per instance.
pub const GC_INSTANCE: &str = "(gc)";

/// How a job run as a converge ended: the `Finished` message and, for an up, the generation now
/// current (0 otherwise); or why it failed.
type JobResult = Result<(String, u64), Failure>;

/// Opens a converge of `instance` for a job, with its `Started` event (`started` names the job —
/// `gc`, `down` — or is empty for an up) in the same write.
async fn open_job(engine: &Engine, instance: &str, requested_by: &str, started: String) -> Result<Opened, Status> {
    let first = (EventKind::Started, None, started);
    let (converge, started) =
        engine.store.open_converge_with(instance, requested_by, first).await.map_err(store_status)?;
    Ok(Opened { id: converge.id, started })
}

/// A converge just opened, and its `Started` event, stored with it.
struct Opened {
    id: ConvergeId,
    started: crate::model::Event,
}

/// Runs `job` as the converge `opened`: its events persisted and streamed to `live`, `Started`
/// first and `Finished` last, the converge marked succeeded or failed. The job runs to its end
/// even if the client goes away.
fn spawn_job<F, Fut>(engine: Arc<Engine>, opened: Opened, live: crate::events::Live, audited: Audited, job: F)
where
    F: FnOnce(Arc<Engine>, ConvergeId, Events) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = JobResult> + Send + 'static,
{
    // Started in the call's span, so the converge joins the caller's trace; it outlives the call.
    let action = audited.action;
    let span = tracing::info_span!("converge", otel.name = %format!("converge {action}"), converge = %opened.id, kind = action);
    let job = async move {
        let started_at = std::time::Instant::now();
        let Opened { id, started } = opened;
        let _ = live.send(Ok(crate::events::to_pb(&id, &started))).await;
        let (events, writer) = Events::start(engine.store.clone(), id.clone(), live);
        let result = job(engine.clone(), id.clone(), events.clone()).await;
        let (state, finished) = match result {
            Ok((message, generation)) => {
                (ConvergeState::Succeeded, (EventKind::Finished { succeeded: true, generation }, message))
            }
            Err(failure) => {
                events.emit(EventKind::Failed, failure.image.as_deref(), failure.reason.clone());
                let finished = (EventKind::Finished { succeeded: false, generation: 0 }, failure.reason.clone());
                (ConvergeState::Failed { reason: failure.reason }, finished)
            }
        };
        let outcome = match &state {
            ConvergeState::Failed { reason } => format!("failed: {reason}"),
            _ => "ok".to_string(),
        };
        counted(&engine.metrics, &audited, &state, started_at.elapsed());
        // Marked finished in the write that stores `Finished`, before it is sent (`Events::finish`).
        events.finish(state, finished.0, finished.1);
        drop(events);
        let _ = writer.await;
        audit(
            &engine,
            audited.actor,
            audited.action,
            &audited.target,
            audited.address,
            format!("{outcome} (converge {id})"),
        )
        .await;
    };
    tokio::spawn(job.instrument(span));
}

/// Counts a job that ended in `kiln_converges_total` and `kiln_converge_duration_seconds`.
fn counted(metrics: &crate::metrics::Metrics, job: &Audited, state: &ConvergeState, took: std::time::Duration) {
    use crate::metrics::names::{ConvergeLabels, JobLabels};
    let outcome = match state {
        ConvergeState::Failed { .. } => "failed",
        _ => "succeeded",
    };
    let labels = ConvergeLabels { kind: job.action, outcome, owner: job.owner.clone() };
    metrics.converges.get_or_create(&labels).inc();
    metrics.converge_seconds.get_or_create(&JobLabels { kind: job.action, outcome }).observe(took.as_secs_f64());
}

/// Runs the converge until it ends, is cancelled (`kiln cancel`), or its client goes away. A
/// cancelled converge's futures are dropped: its queued tasks leave the queue, its agents are
/// told to stop what they run, and the record is never written.
async fn cancellable(
    engine: &Engine,
    id: &ConvergeId,
    plan: &UpPlan,
    events: &Events,
    client: crate::events::Live,
) -> Result<crate::engine::Converged, Failure> {
    let owner = crate::engine::owner(plan);
    let mut ticket = engine.running.enter(id.as_str(), &plan.instance, &owner, &plan.requested_by);
    tokio::select! {
        result = engine.up(id, plan, events) => result,
        why = ticket.cancelled() => Err(Failure::cancelled(why)),
        () = client.closed() => Err(Failure::cancelled(
            "its client went away (Ctrl-C, or the connection dropped)".to_string(),
        )),
    }
}

/// What the audit log says of a job once it ends.
#[derive(Clone)]
struct Audited {
    actor: String,
    action: &'static str,
    target: String,
    address: String,
    /// Whom the job counts for in `kiln_converges_total`: an up's owner in the queue's sense (its
    /// team, else its user); the user who asked for a down or a gc.
    owner: String,
}

/// `kiln up --dry-run`: decides like a converge and streams what it would do, under an id no
/// converge carries. Nothing is opened, claimed, uploaded, built, delivered, recorded or logged.
fn dry_run(engine: Arc<Engine>, plan: UpPlan) -> EventStream {
    let (live, rx) = mpsc::channel(256);
    let id = ConvergeId::from(format!("dry-run-{}", ConvergeId::generate(now_ms())));
    let span = tracing::info_span!("converge", otel.name = "converge up --dry-run", converge = %id, kind = "up");
    let job = async move {
        let (events, writer) = Events::ephemeral(id.clone(), live);
        events.emit(EventKind::Started, None, if plan.mirror_only { "mirror --dry-run" } else { "dry run" });
        match engine.up(&id, &plan, &events).await {
            Ok(done) => {
                let message = match plan.mirror_only {
                    true => format!("{} would be mirrored as listed", plan.instance),
                    false => format!("{} would converge from generation {}", plan.instance, done.generation),
                };
                events.emit(EventKind::Finished { succeeded: true, generation: done.generation }, None, message);
            }
            Err(failure) => {
                events.emit(EventKind::Failed, failure.image.as_deref(), failure.reason.clone());
                events.emit(EventKind::Finished { succeeded: false, generation: 0 }, None, failure.reason);
            }
        }
        drop(events);
        let _ = writer.await;
    };
    tokio::spawn(job.instrument(span));
    ReceiverStream::new(rx)
}

/// A sweep that could not be planned fails the gc or down that asked for it.
fn sweep_failure(err: SweepError) -> Failure {
    Failure { image: None, reason: kiln_core::error_chain(&err) }
}

/// The one spelling a pin is stored under: Docker's short form of a ref, or a full image id.
fn pin_spelling(raw: &str) -> Result<String, Status> {
    let raw = raw.trim();
    if let Some(hex) = raw.strip_prefix("sha256:") {
        if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Ok(raw.to_string());
        }
    }
    match ImageRef::parse(raw) {
        Ok(parsed) => Ok(parsed.familiar()),
        Err(err) => Err(Status::invalid_argument(format!(
            "{raw:?} is neither an image ref nor an image id ({}) — pin `repo:tag`, `repo@sha256:…` or `sha256:<64 hex>`",
            kiln_core::error_chain(&err)
        ))),
    }
}

fn pins_reply(changed: bool, pins: Vec<crate::model::Pin>) -> pb::PinsReply {
    let pins = pins
        .into_iter()
        .map(|p| pb::Pinned { reference: p.reference, pinned_at_ms: p.pinned_at_ms, pinned_by: p.pinned_by })
        .collect();
    pb::PinsReply { changed, pins }
}

impl KilnService {
    /// The instance's owner must be the caller (or the caller's team); a first converge makes the
    /// caller's team — as the manifest names it — or the caller the owner. A dry run checks
    /// without claiming.
    async fn owned_by_caller(&self, principal: &Principal, plan: &UpPlan, address: &str) -> Result<(), Status> {
        let Principal::User { name, team, .. } = principal else { return Ok(()) };
        let wanted_team = plan.team.clone();
        if let Some(t) = &wanted_team {
            if team.as_deref() != Some(t.as_str()) && !principal.is_admin() {
                return Err(Status::permission_denied(format!(
                    "instance {} names team {t} in its manifest, but {} is not in it",
                    plan.instance,
                    principal.actor()
                )));
            }
        }
        let claim = Owner { team: wanted_team, user: name.clone() };
        let owner = match plan.dry_run {
            true => self.engine.store.owner(&plan.instance).await.map_err(store_status)?.unwrap_or(claim),
            false => self.engine.store.own(&plan.instance, claim).await.map_err(store_status)?,
        };
        if let Err(refused) = may_own(principal, &plan.instance, &owner) {
            audit(
                &self.engine,
                principal.actor(),
                "up",
                &plan.instance,
                address.to_string(),
                format!("refused: {}", refused.message()),
            )
            .await;
            return Err(refused);
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl pb::kiln_server::Kiln for KilnService {
    type UpStream = EventStream;

    async fn up(&self, request: Request<pb::UpRequest>) -> Result<Response<EventStream>, Status> {
        let (principal, address) = (Principal::of(&request), Peer::of(&request));
        let mut plan = UpPlan::try_from(request.into_inner())?;
        plan.requested_by = requester(&principal, &plan.requested_by);
        if !plan.dry_run {
            writable(&self.engine, "Up")?;
        }
        self.owned_by_caller(&principal, &plan, &address).await?;
        if plan.dry_run {
            return Ok(Response::new(dry_run(self.engine.clone(), plan)));
        }
        // `kiln mirror` is a job of its own (its Started names it, as gc's and down's do): it
        // copies, and publishes, sweeps and records nothing.
        let (action, started) = match plan.mirror_only {
            true => ("mirror", format!("mirror {}", plan.instance)),
            false => ("up", String::new()),
        };
        let owner = crate::engine::owner(&plan);
        let audited = Audited { actor: principal.actor(), action, target: plan.instance.clone(), address, owner };
        if !plan.mirror_only {
            if let Some(stream) = settled::settled_up(&self.engine, &plan, &audited).await? {
                return Ok(Response::new(stream));
            }
        }
        let opened = open_job(&self.engine, &plan.instance, &plan.requested_by, started).await?;
        let (live, rx) = mpsc::channel(256);
        // The client's end of the stream: gone (Ctrl-C, a vanished CLI) cancels the converge.
        let client = live.clone();
        spawn_job(self.engine.clone(), opened, live, audited, move |engine, id, events| async move {
            let mut result = cancellable(&engine, &id, &plan, &events, client).await;
            if plan.mirror_only {
                let pinned = plan.images.iter().filter(|i| i.mirrored_from.is_some()).count();
                return result.map(|done| (format!("{pinned} pinned image(s) in the mirror"), done.generation));
            }
            if let Ok(done) = result {
                result = crate::kube::published(&engine.config, &plan, done.generation, &events).await.map(|()| done);
            }
            // Swept while the claims still hold: this converge's refs are roots until released,
            // and are named as kept besides. A failed converge sweeps nothing, and neither does
            // one that changed nothing: a no-op converge costs a walk and one RPC, no Docker call.
            if result.as_ref().is_ok_and(|done| done.changed) {
                let keep = plan.images.iter().map(|image| image.reference.clone()).collect();
                let options = SweepOptions { keep, ..SweepOptions::default() };
                if let Err(err) = sweep(&engine, &id, &options, &events).instrument(step("sweep")).await {
                    events.emit(EventKind::Note, None, format!("not swept: {}", kiln_core::error_chain(&err)));
                }
            }
            // A converge that ended well without claiming (every image recorded and present)
            // has nothing to release; one that failed may have claimed before it did.
            if result.as_ref().map_or(true, |done| done.claimed) {
                if let Err(err) = engine.store.release_claims(&id).await {
                    tracing::warn!(converge = %id, error = %err, "claims not released; they expire on their lease");
                }
            }
            result.map(|done| match done.changed {
                true => (format!("{} at generation {}", plan.instance, done.generation), done.generation),
                false => (format!("{} unchanged at generation {}", plan.instance, done.generation), done.generation),
            })
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type DownStream = EventStream;

    async fn down(&self, request: Request<pb::DownRequest>) -> Result<Response<EventStream>, Status> {
        writable(&self.engine, "Down")?;
        let (principal, address) = (Principal::of(&request), Peer::of(&request));
        let req = request.into_inner();
        if req.instance.is_empty() {
            return Err(Status::invalid_argument("DownRequest.instance is empty — name the instance to take down"));
        }
        if let Some(owner) = self.engine.store.owner(&req.instance).await.map_err(store_status)? {
            if let Err(refused) = may_own(&principal, &req.instance, &owner) {
                audit(
                    &self.engine,
                    principal.actor(),
                    "down",
                    &req.instance,
                    address,
                    format!("refused: {}", refused.message()),
                )
                .await;
                return Err(refused);
            }
        }
        let requested_by = requester(&principal, &req.requested_by);
        // A converge of the instance: refused while one runs, so down never races an up of it.
        let opened = open_job(&self.engine, &req.instance, &requested_by, format!("down {}", req.instance)).await?;
        let (live, rx) = mpsc::channel(256);
        let (target, owner) = (req.instance.clone(), requested_by.clone());
        let audited = Audited { actor: principal.actor(), action: "down", target, address, owner };
        spawn_job(self.engine.clone(), opened, live, audited, move |engine, id, events| async move {
            let instance = req.instance;
            match engine.store.delete_record(&instance).await {
                Ok(true) => events.emit(EventKind::RecordDeleted { instance: instance.clone() }, None, ""),
                Ok(false) => events.emit(EventKind::Note, None, format!("instance {instance} has no record")),
                Err(err) => return Err(Failure { image: None, reason: kiln_core::error_chain(&err) }),
            }
            crate::kube::unpublished(&engine.config, &instance, &events).await?;
            // Its roots are gone; what another instance's roots name stays.
            let options = SweepOptions { narrate: true, ..SweepOptions::default() };
            sweep(&engine, &id, &options, &events).instrument(step("sweep")).await.map_err(sweep_failure)?;
            Ok((String::new(), 0))
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type GcStream = EventStream;

    async fn gc(&self, request: Request<pb::GcRequest>) -> Result<Response<EventStream>, Status> {
        writable(&self.engine, "Gc")?;
        let (principal, address) = (Principal::of(&request), Peer::of(&request));
        let req = request.into_inner();
        let requested_by = requester(&principal, &req.requested_by);
        let mut job = "gc".to_string();
        if req.dry_run {
            job.push_str(" --dry-run");
        }
        if !req.instance.is_empty() {
            job.push_str(&format!(" --instance {}", req.instance));
        }
        let opened = open_job(&self.engine, GC_INSTANCE, &requested_by, job.clone()).await?;
        let (live, rx) = mpsc::channel(256);
        let owner = requested_by.clone();
        let audited = Audited { actor: principal.actor(), action: "gc", target: job, address, owner };
        spawn_job(self.engine.clone(), opened, live, audited, move |engine, id, events| async move {
            let options = SweepOptions {
                dry_run: req.dry_run,
                only_instance: Some(req.instance).filter(|i| !i.is_empty()),
                keep: Vec::new(),
                narrate: true,
            };
            let totals =
                sweep(&engine, &id, &options, &events).instrument(step("sweep")).await.map_err(sweep_failure)?;
            // Removals that failed were reported one by one and did not stop the rest, so the gc
            // itself succeeded; the summary says what is left over.
            let mut summary = Vec::new();
            if req.dry_run {
                summary.push("nothing was removed".to_string());
            }
            if totals.not_removed > 0 {
                summary.push(format!("{} removal(s) failed", totals.not_removed));
            }
            if totals.skipped_stores > 0 {
                summary.push(format!("{} store(s) not swept", totals.skipped_stores));
            }
            Ok((summary.join("; "), 0))
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn pin(&self, request: Request<pb::PinRequest>) -> Result<Response<pb::PinsReply>, Status> {
        writable(&self.engine, "Pin")?;
        let (principal, address) = (Principal::of(&request), Peer::of(&request));
        let req = request.into_inner();
        let reference = pin_spelling(&req.reference)?;
        let store = &self.engine.store;
        let changed = store.pin(&reference, &requester(&principal, &req.requested_by)).await.map_err(store_status)?;
        audit(&self.engine, principal.actor(), "pin", &reference, address, "ok".into()).await;
        Ok(Response::new(pins_reply(changed, store.pins().await.map_err(store_status)?)))
    }

    async fn unpin(&self, request: Request<pb::PinRequest>) -> Result<Response<pb::PinsReply>, Status> {
        writable(&self.engine, "Unpin")?;
        let (principal, address) = (Principal::of(&request), Peer::of(&request));
        let reference = pin_spelling(&request.into_inner().reference)?;
        let store = &self.engine.store;
        let changed = store.unpin(&reference).await.map_err(store_status)?;
        audit(&self.engine, principal.actor(), "unpin", &reference, address, "ok".into()).await;
        Ok(Response::new(pins_reply(changed, store.pins().await.map_err(store_status)?)))
    }

    async fn pins(&self, _request: Request<pb::PinsRequest>) -> Result<Response<pb::PinsReply>, Status> {
        Ok(Response::new(pins_reply(false, self.engine.store.pins().await.map_err(store_status)?)))
    }

    async fn status(&self, request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusReply>, Status> {
        let want = request.into_inner().instance;
        let store = &self.engine.store;
        let mut instances = Vec::new();
        for (record, _) in store.records().await.map_err(store_status)? {
            if !want.is_empty() && record.instance != want {
                continue;
            }
            let images = record
                .images
                .iter()
                .map(|ri| pb::RecordedImage {
                    name: ri.name.clone(),
                    reference: ri.reference.clone(),
                    kind: match ri.kind {
                        crate::model::RecordedKind::Built => pb::image_spec::Kind::Built,
                        crate::model::RecordedKind::Brought => pb::image_spec::Kind::Brought,
                        crate::model::RecordedKind::Pinned => pb::image_spec::Kind::Pinned,
                    } as i32,
                    target: ri.target.clone(),
                    user: ri.user.clone().unwrap_or_default(),
                    declares_user: ri.user.is_some(),
                })
                .collect();
            instances.push(pb::InstanceStatus {
                instance: record.instance.clone(),
                generation: record.generation.0,
                images,
                written_at_ms: record.written_at_ms,
            });
        }
        let filter = (!want.is_empty()).then_some(want.as_str());
        let converges = store
            .converges(filter, 20)
            .await
            .map_err(store_status)?
            .into_iter()
            .map(|c| {
                let (outcome, reason) = match &c.state {
                    ConvergeState::Running => (pb::Outcome::Running, String::new()),
                    ConvergeState::Succeeded => (pb::Outcome::Succeeded, String::new()),
                    ConvergeState::Failed { reason } => (pb::Outcome::Failed, reason.clone()),
                };
                pb::ConvergeSummary {
                    id: c.id.to_string(),
                    instance: c.instance,
                    outcome: outcome as i32,
                    reason,
                    started_ms: c.started_ms,
                    finished_ms: c.finished_ms.unwrap_or(0),
                    requested_by: c.requested_by,
                }
            })
            .collect();
        Ok(Response::new(pb::StatusReply { instances, converges }))
    }

    type LogsStream = EventStream;

    async fn logs(&self, request: Request<pb::LogsRequest>) -> Result<Response<EventStream>, Status> {
        let req = request.into_inner();
        let id = crate::model::ConvergeId::from(req.converge_id.as_str());
        let store = self.engine.store.clone();
        if store.converge(&id).await.map_err(store_status)?.is_none() {
            return Err(Status::not_found(format!("no converge {id} — `kiln status` lists recent ones")));
        }
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            let mut after = None;
            // A converge is marked finished just before its `Finished` event is written: one
            // more look after that catches the event.
            let mut idle_after_end = 0;
            loop {
                let batch = match store.events(&id, after).await {
                    Ok(batch) => batch,
                    Err(err) => {
                        let _ = tx.send(Err(store_status(err))).await;
                        return;
                    }
                };
                for event in &batch {
                    after = Some(event.seq);
                    if tx.send(Ok(to_pb(&id, event))).await.is_err() {
                        return;
                    }
                }
                let finished = batch.iter().any(|e| matches!(e.kind, EventKind::Finished { .. }));
                let running = matches!(store.converge(&id).await, Ok(Some(c)) if c.state == ConvergeState::Running);
                if !running && batch.is_empty() {
                    idle_after_end += 1;
                }
                if !req.follow || finished || idle_after_end >= 2 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn images(&self, request: Request<pb::ImagesRequest>) -> Result<Response<pb::ImagesReply>, Status> {
        let all_farms = request.into_inner().all_farms;
        let farm = self.engine.config.farm.clone();
        let hold_key = kiln_core::sweep::farm_key(&farm);
        let mut stores = Vec::new();
        for (agent, store, listed) in crate::sweep::list_every_store(&self.engine.hub.connected()).await {
            let (images, error) = match listed {
                Ok(images) => {
                    let json =
                        serde_json::to_string(&images.iter().map(|i| (&i.id, &i.refs, i.bytes)).collect::<Vec<_>>())
                            .unwrap_or_default();
                    let _ = self.engine.store.put_inventory(&store, json, now_ms()).await;
                    (images, String::new())
                }
                Err(error) => (Vec::new(), error),
            };
            // A node store lists everything it holds (the planner needs it all); shown, like a host
            // store's listing, are the images Kiln labeled.
            // This farm's: what it built, and what it holds of another farm's (its hold tags).
            let ours = |i: &kiln_core::sweep::ListedImage| {
                i.labels.get(kiln_core::sweep::LABEL_FARM) == Some(&farm)
                    || i.refs.iter().any(|r| kiln_core::sweep::hold_key(r) == Some(hold_key.as_str()))
            };
            let images = images
                .into_iter()
                .filter(|i| i.labels.contains_key(kiln_core::sweep::LABEL_KIND))
                .filter(|i| all_farms || ours(i))
                .map(crate::convert::wire_image)
                .collect();
            stores.push(pb::StoreImages { store, agent, images, error });
        }
        Ok(Response::new(pb::ImagesReply { stores, farm }))
    }

    async fn audit(&self, request: Request<pb::AuditRequest>) -> Result<Response<pb::AuditReply>, Status> {
        let principal = Principal::of(&request);
        // An admin reads every entry; anyone else only their own.
        let actor = (!principal.is_admin()).then(|| principal.actor());
        let since = request.into_inner().since_ms;
        let rows = self.engine.store.audit(since, actor.as_deref()).await.map_err(store_status)?;
        let entries = rows
            .into_iter()
            .map(|r| pb::AuditEntry {
                at_ms: r.at_ms,
                actor: r.actor,
                action: r.action,
                target: r.target,
                address: r.address,
                outcome: r.outcome,
            })
            .collect();
        Ok(Response::new(pb::AuditReply { entries }))
    }

    async fn cancel(&self, request: Request<pb::CancelRequest>) -> Result<Response<pb::CancelReply>, Status> {
        writable(&self.engine, "Cancel")?;
        let (principal, address) = (Principal::of(&request), Peer::of(&request));
        let id = request.into_inner().converge_id;
        let Some(instance) = self.engine.running.instance_of(&id) else {
            return Err(Status::not_found(format!(
                "converge {id} is not running on this coordinator — `kiln ps` lists the running ones"
            )));
        };
        if let Some(owner) = self.engine.store.owner(&instance).await.map_err(store_status)? {
            if let Err(refused) = may_own(&principal, &instance, &owner) {
                let outcome = format!("refused: {}", refused.message());
                audit(&self.engine, principal.actor(), "cancel", &id, address, outcome).await;
                return Err(refused);
            }
        }
        self.engine.running.cancel(&id, format!("cancelled by {}", principal.actor()));
        audit(&self.engine, principal.actor(), "cancel", &id, address, "ok".to_string()).await;
        Ok(Response::new(pb::CancelReply { instance }))
    }

    async fn why(&self, request: Request<pb::WhyRequest>) -> Result<Response<pb::WhyReply>, Status> {
        let principal = Principal::of(&request);
        crate::why::why(&self.engine, &principal, request.into_inner()).await.map(Response::new)
    }

    async fn ps(&self, _request: Request<pb::PsRequest>) -> Result<Response<pb::PsReply>, Status> {
        Ok(Response::new(crate::engine::ps(&self.engine)))
    }

    async fn who_am_i(&self, request: Request<pb::WhoAmIRequest>) -> Result<Response<pb::WhoAmIReply>, Status> {
        let principal = Principal::of(&request);
        let (role, team) = match &principal {
            Principal::User { role, team, .. } => (role.name().to_string(), team.clone().unwrap_or_default()),
            Principal::Embedded => ("admin".to_string(), String::new()),
            Principal::Agent { .. } => ("agent".to_string(), String::new()),
            Principal::Anonymous => (String::new(), String::new()),
        };
        Ok(Response::new(pb::WhoAmIReply { actor: principal.actor(), role, team }))
    }

    async fn cluster_platforms(
        &self,
        request: Request<pb::ClusterPlatformsRequest>,
    ) -> Result<Response<pb::ClusterPlatformsReply>, Status> {
        let req = request.into_inner();
        Ok(Response::new(crate::cluster::platforms(&self.engine, &req.kind, &req.cluster).await?))
    }

    async fn agents(&self, _request: Request<pb::AgentsRequest>) -> Result<Response<pb::AgentsReply>, Status> {
        let present = self.engine.hub.present();
        let rows = self.engine.store.agents().await.map_err(store_status)?;
        let agents = rows
            .into_iter()
            .map(|row| {
                let conn = present.iter().find(|a| a.id == row.id.0);
                pb::AgentInfo {
                    connected: conn.is_some(),
                    draining: conn.is_some_and(|a| a.is_draining()),
                    emulates: conn.map(|a| a.emulates.clone()).unwrap_or_default(),
                    id: row.id.0,
                    role: match row.role {
                        crate::model::AgentRole::Host => pb::Role::Host,
                        crate::model::AgentRole::Node => pb::Role::Node,
                        crate::model::AgentRole::Both => pb::Role::Both,
                    } as i32,
                    stores: row.stores,
                    platforms: row.platforms,
                    version: row.version,
                    last_seen_ms: row.last_seen_ms,
                }
            })
            .collect();
        Ok(Response::new(pb::AgentsReply { agents }))
    }
}
