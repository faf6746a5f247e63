//! `kiln up`: walk and address, ask the coordinator to converge, upload the contexts it asks for,
//! and show its events until it finishes. Every decision — skip, build, deliver, record, sweep —
//! is the coordinator's; the CLI only knows which context directory has which digest.

use std::collections::HashSet;
use std::path::PathBuf;

use kiln_core::manifest::{Manifest, PlatformSource};
use kiln_proto::v1::content_store_client::ContentStoreClient;
use kiln_proto::v1::kiln_client::KilnClient;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::connect::{self, Kind, Link};
use crate::embedded::{with_coordinator, with_coordinator_after};
use crate::error::{CliError, Exit};
use crate::event::{Event, EventKind, Outcome};
use crate::render::{renderer, OutputMode, Render};
use crate::request::{plan_up, UpPlan};
use crate::upload::{upload_on_ladder, UploadError};
use crate::Connect;

/// What `kiln up` is asked.
#[derive(Clone, Debug)]
pub struct UpArgs {
    /// The instance folder holding `kiln.toml`.
    pub dir: PathBuf,
    /// Rebuild and redeliver every built image regardless of records and held images.
    pub force: bool,
    /// Only say what would happen to each image and why; change nothing anywhere.
    pub dry_run: bool,
    pub connect: Connect,
    pub output: OutputMode,
}

impl UpArgs {
    /// `kiln up <dir>` with the embedded coordinator in `$KILN_HOME` and automatic output.
    pub fn new(dir: impl Into<PathBuf>) -> UpArgs {
        UpArgs { dir: dir.into(), force: false, dry_run: false, connect: Connect::default(), output: OutputMode::Auto }
    }
}

/// How a converge the coordinator ran ended, with every event it sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpOutcome {
    pub converge_id: String,
    /// In the order received; the last is `Finished`.
    pub events: Vec<Event>,
    /// `Succeeded` or `Failed` (as the `Finished` event says).
    pub outcome: Outcome,
    /// Why it failed: the first `Failed` event's image and message, else the `Finished` message.
    pub failure: Option<Failure>,
    /// The user stopped it (Ctrl-C): the coordinator cancelled it, and the exit is 130.
    pub interrupted: bool,
}

/// The image that failed a converge (empty when the converge failed as a whole) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub image: String,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.image.is_empty(), self.message.is_empty()) {
            (true, true) => f.write_str("the coordinator gave no reason"),
            (true, false) => f.write_str(&self.message),
            (false, true) => write!(f, "{}: the coordinator gave no reason", self.image),
            (false, false) => write!(f, "{}: {}", self.image, self.message),
        }
    }
}

impl UpOutcome {
    /// From a converge's events, in order; the last must be `Finished`.
    pub fn from_events(events: Vec<Event>) -> UpOutcome {
        let finished = events.iter().rev().find(|e| e.kind == EventKind::Finished);
        let outcome = finished.map_or(Outcome::Unspecified, |e| e.outcome);
        let failure = match outcome {
            Outcome::Succeeded => None,
            _ => events
                .iter()
                .find(|e| e.kind == EventKind::Failed)
                .or(finished)
                .map(|e| Failure { image: e.image.clone(), message: e.message.clone() }),
        };
        let converge_id = events.first().map(|e| e.converge_id.clone()).unwrap_or_default();
        UpOutcome { converge_id, events, outcome, failure, interrupted: false }
    }

    /// 0 when the converge succeeded, 130 when the user interrupted it, 1 otherwise.
    pub fn exit(&self) -> Exit {
        match self.outcome {
            Outcome::Succeeded => Exit::Converged,
            _ if self.interrupted => Exit::Interrupted,
            _ => Exit::Failed,
        }
    }
}

/// `kiln up`, showing events on stdout as `args.output` says.
pub async fn up(args: UpArgs) -> Result<UpOutcome, CliError> {
    let mut render = renderer(args.output);
    up_with(&args, render.as_mut()).await
}

/// `kiln up`, showing events through `render` (tests pass a [`crate::render::plain::Plain`] over
/// a buffer).
pub async fn up_with(args: &UpArgs, render: &mut dyn Render) -> Result<UpOutcome, CliError> {
    let dir = args.dir.clone();
    let manifest = tokio::task::spawn_blocking(move || Manifest::load(&dir))
        .await
        .map_err(|_| CliError::Panicked { what: "manifest" })??;
    let outcome = if matches!(manifest.platform_source, PlatformSource::Cluster { .. }) {
        // The set comes from the cluster, and is part of every content tag: asked for first.
        let shown = &mut *render;
        with_coordinator(&args.connect, true, |link| async move {
            let manifest = crate::platforms::from_cluster(&link, manifest).await?;
            let plan = prepare(args, manifest, &mut *shown).await?;
            converge(link, &plan, shown).await
        })
        .await
    } else if manifest.built().any(|(_, image)| image.stage.is_some()) {
        // A staging command is the user's program, and may take minutes or fail: nothing is
        // started, and `$KILN_HOME` is not taken, before it has run.
        let plan = prepare(args, manifest, &mut *render).await?;
        with_coordinator(&args.connect, true, |link| converge(link, &plan, &mut *render)).await
    } else {
        let planning = async {
            let plan = prepare(args, manifest, &mut *render).await?;
            Ok((plan, &mut *render))
        };
        with_coordinator_after(&args.connect, true, planning, |link, (plan, shown)| async move {
            converge(link, &plan, shown).await
        })
        .await
    };
    render.finish().map_err(CliError::Output)?;
    outcome
}

/// Step 1: walk and address every built image of `manifest`, as the request says them.
async fn prepare(args: &UpArgs, manifest: Manifest, render: &mut dyn Render) -> Result<UpPlan, CliError> {
    let built: Vec<String> = manifest.built().map(|(name, _)| name.to_string()).collect();
    render.addressing(&built);
    let force = args.force;
    let stat_cache = crate::home::stat_cache_dir(args.connect.coordinator.is_none(), args.connect.kiln_home.as_deref());
    let walk = tracing::info_span!("address", images = built.len());
    let mut plan = tokio::task::spawn_blocking(move || {
        walk.in_scope(|| plan_up(&manifest, force, &crate::home::requested_by(), stat_cache.as_deref()))
    })
    .await
    .map_err(|_| CliError::Panicked { what: "walk" })??;
    plan.request.dry_run = args.dry_run;
    render.addressed(&plan);
    for (name, staged) in &plan.staged {
        render.event(&Event::new(EventKind::Note, name, &staged.words())).map_err(CliError::Output)?;
    }
    Ok(plan)
}

/// How long an interrupted `kiln up` waits for the coordinator to confirm the cancel.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

fn interrupted_outcome(events: Vec<Event>) -> UpOutcome {
    let mut outcome = UpOutcome::from_events(events);
    outcome.interrupted = true;
    outcome.outcome = Outcome::Failed;
    outcome
}

/// Steps 2–9 as seen from the CLI: ask, upload on demand, show, until `Finished`.
pub(crate) async fn converge(link: Link, plan: &UpPlan, render: &mut dyn Render) -> Result<UpOutcome, CliError> {
    let kiln = KilnClient::new(link.channel.clone());
    let store = ContentStoreClient::new(link.channel.clone());
    let response = connect::call(&link, "Up", Kind::Action, || {
        let mut kiln = kiln.clone();
        let request = plan.request.clone();
        async move { kiln.up(request).await }
    })
    .await?;
    let mut stream = response.into_inner();

    let (progress_tx, mut progress) = mpsc::unbounded_channel();
    let mut uploads: JoinSet<(String, Result<crate::upload::Uploaded, UploadError>)> = JoinSet::new();
    let mut in_flight: HashSet<String> = HashSet::new();
    let mut events: Vec<Event> = Vec::new();
    let mut interrupted: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            // Ctrl-C cancels the converge and waits (briefly) for the coordinator to say its
            // builds were stopped; a second Ctrl-C, or no answer, leaves at once.
            _ = tokio::signal::ctrl_c() => {
                if interrupted.is_some() {
                    return Ok(interrupted_outcome(events));
                }
                interrupted = Some(std::time::Instant::now());
                let id = events.first().map(|e| e.converge_id.clone()).unwrap_or_default();
                let words = format!("interrupted — cancelling converge {id} (Ctrl-C again to leave at once)");
                render.event(&Event::new(EventKind::Note, "", &words)).map_err(CliError::Output)?;
                if !id.is_empty() {
                    let mut kiln = kiln.clone();
                    let cancel = kiln.cancel(kiln_proto::v1::CancelRequest { converge_id: id });
                    if tokio::time::timeout(CANCEL_WAIT, cancel).await.is_err() {
                        return Ok(interrupted_outcome(events));
                    }
                } else {
                    return Ok(interrupted_outcome(events));
                }
            }
            _ = tokio::time::sleep(CANCEL_WAIT), if interrupted.is_some_and(|at| at.elapsed() >= CANCEL_WAIT) => {
                return Ok(interrupted_outcome(events));
            }
            message = stream.message() => {
                let event = match message {
                    Ok(Some(wire)) => Event::from(wire),
                    Ok(None) => {
                        let converge_id = events.first().map_or("(not started)".to_string(), |e| e.converge_id.clone());
                        return Err(CliError::StreamEnded { at: link.at.clone(), converge_id });
                    }
                    Err(status) => {
                        let converge_id = events.first().map_or("(not started)".to_string(), |e| e.converge_id.clone());
                        return Err(connect::broke(&link, "Up", &converge_id, status));
                    }
                };
                render.event(&event).map_err(CliError::Output)?;
                if event.kind == EventKind::NeedContexts {
                    for digest in &event.contexts {
                        let source = plan
                            .contexts
                            .get(digest)
                            .ok_or_else(|| CliError::UnknownContext { digest: digest.clone() })?;
                        // Asked twice while the first upload runs: one upload answers both.
                        if in_flight.insert(digest.clone()) {
                            let (store, digest, source, tx) = (store.clone(), digest.clone(), source.clone(), progress_tx.clone());
                            let (url, window) = (link.url.clone(), link.window);
                            // A span of its own, in the command's trace: the task would start outside it.
                            let span = tracing::info_span!("upload", context = %digest);
                            uploads.spawn(async move {
                                let result = upload_on_ladder(store, digest.clone(), source, Some(tx), &url, window).await;
                                (digest, result)
                            }.instrument(span));
                        }
                    }
                }
                let finished = event.kind == EventKind::Finished;
                events.push(event);
                if finished {
                    let mut outcome = UpOutcome::from_events(events);
                    outcome.interrupted = interrupted.is_some();
                    return Ok(outcome);
                }
            }
            Some(joined) = uploads.join_next(), if !uploads.is_empty() => {
                let (digest, result) = joined.map_err(|_| CliError::Panicked { what: "upload" })?;
                in_flight.remove(&digest);
                match result {
                    Ok(sent) => render.event(&Event::new(EventKind::Note, "", &sent.words(&digest))).map_err(CliError::Output)?,
                    Err(err) => {
                        let dir = plan.contexts.get(&digest).map(|c| c.dir.clone()).unwrap_or_default();
                        return Err(CliError::Upload { dir, short: digest.chars().take(12).collect(), err: Box::new(err) });
                    }
                }
            }
            Some((digest, sent)) = progress.recv() => render.upload_progress(&digest, sent),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: EventKind, image: &str, message: &str) -> Event {
        Event { converge_id: "c-9".into(), ..Event::new(kind, image, message) }
    }

    #[test]
    fn a_succeeded_converge_exits_0_without_a_failure() {
        let events = vec![
            ev(EventKind::Started, "", ""),
            Event { outcome: Outcome::Succeeded, ..ev(EventKind::Finished, "", "") },
        ];
        let outcome = UpOutcome::from_events(events);
        assert_eq!((outcome.exit(), outcome.failure, outcome.converge_id.as_str()), (Exit::Converged, None, "c-9"));
    }

    #[test]
    fn a_failed_converge_exits_1_naming_the_first_failed_image() {
        let events = vec![
            ev(EventKind::Failed, "worker", "build failed: RUN exited 1"),
            ev(EventKind::Failed, "web", "cancelled: another image failed"),
            Event { outcome: Outcome::Failed, ..ev(EventKind::Finished, "", "1 image failed") },
        ];
        let outcome = UpOutcome::from_events(events);
        assert_eq!(outcome.exit(), Exit::Failed);
        assert_eq!(outcome.exit().code(), 1);
        assert_eq!(outcome.failure.unwrap().to_string(), "worker: build failed: RUN exited 1");
    }

    #[test]
    fn a_converge_failed_as_a_whole_gives_the_finished_message() {
        let events = vec![Event {
            outcome: Outcome::Failed,
            ..ev(EventKind::Finished, "", "no host agent is connected — start one with kiln-agent")
        }];
        let outcome = UpOutcome::from_events(events);
        assert_eq!(outcome.failure.unwrap().to_string(), "no host agent is connected — start one with kiln-agent");
    }
}
