//! Executing one task from the coordinator: fetch and verify a context, then build; push; list;
//! inspect; remove. Each task answers exactly once, and a failure is an answer (`TaskError`) naming
//! what failed — the agent's stream never breaks because one task did.

use crate::host::{verify_context, BuildSpec, HostError, HostStore, Removal};
use crate::stores::{resolve, Target};
use kiln_core::digest::TreeDigest;
use kiln_proto::v1 as pb;
use pb::task_error::Kind as ErrorKind;
use pb::task_result::Outcome;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tracing::Instrument;

/// What every task shares: the store, the way back to the coordinator, a scratch directory.
pub(crate) struct TaskContext {
    pub store: Arc<dyn HostStore>,
    pub agent_id: String,
    /// The stores last announced to the coordinator (see `stores`).
    pub announced: std::sync::Mutex<Vec<pb::StoreInfo>>,
    pub content: pb::content_store_client::ContentStoreClient<Channel>,
    /// Where an exported image goes on its way to node agents.
    pub relay: pb::image_relay_client::ImageRelayClient<Channel>,
    pub scratch: PathBuf,
    /// Verified archives of contexts built here before (`contexts`).
    pub contexts: Arc<crate::contexts::ContextCache>,
    pub out: mpsc::Sender<pb::AgentMessage>,
    pub metrics: Arc<crate::metrics::AgentMetrics>,
}

pub(crate) type TaskResult = Result<Outcome, Refusal>;

/// A task that failed, as the coordinator gets it: typed, so it decides by the kind (and a failed
/// build's step), never by the words.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub kind: ErrorKind,
    pub message: String,
    /// A failed build: the 1-based step of its Dockerfile that failed, when the builder said; 0 otherwise.
    pub step: u32,
}

/// A task's answer refusing with `kind` and `message`.
pub(crate) fn refuse<T>(why: (ErrorKind, String)) -> Result<T, Refusal> {
    Err(why.into())
}

impl From<(ErrorKind, String)> for Refusal {
    fn from((kind, message): (ErrorKind, String)) -> Refusal {
        Refusal { kind, message, step: 0 }
    }
}

fn failed(err: impl std::fmt::Display) -> (ErrorKind, String) {
    (ErrorKind::Failed, err.to_string())
}

/// A task's span on the agent, named by its kind (`build`, `push`, `import`, …): a child of the
/// coordinator's span for the task (`Task.traceparent`), so it joins the converge's trace.
pub(crate) fn span(task: &pb::Task) -> tracing::Span {
    use pb::task::Kind;
    let kind = match &task.kind {
        Some(Kind::Build(_)) => "build",
        Some(Kind::Push(_)) => "push",
        Some(Kind::List(_)) => "list",
        Some(Kind::Inspect(_)) => "inspect",
        Some(Kind::Remove(_)) => "remove",
        Some(Kind::Export(_)) => "export",
        Some(Kind::Import(_)) => "import",
        Some(Kind::KindLoad(_)) => "kind_load",
        Some(Kind::Tag(_)) => "tag",
        Some(Kind::Probe(_)) => "probe",
        None => "unknown",
    };
    let span = tracing::info_span!("task", otel.name = kind, task = %task.task_id, converge = %task.converge_id);
    kiln_telemetry::follow(&span, &task.traceparent);
    span
}

/// The request of a call the agent makes for a task, carrying the task's trace context.
pub(crate) fn traced<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    kiln_telemetry::inject(request.metadata_mut());
    request
}

pub(crate) async fn execute(ctx: Arc<TaskContext>, task: pb::Task) {
    let span = span(&task);
    run(ctx, task).instrument(span).await
}

async fn run(ctx: Arc<TaskContext>, task: pb::Task) {
    let id = task.task_id.clone();
    let store = match &task.kind {
        Some(
            pb::task::Kind::List(pb::ListTask { store, .. }) | pb::task::Kind::Remove(pb::RemoveTask { store, .. }),
        ) => store.clone(),
        _ => String::new(),
    };
    let result = match task.kind {
        Some(pb::task::Kind::Build(b)) => {
            let building = ctx.metrics.building();
            let result = build(&ctx, &id, b).await;
            building.finished(result.is_ok());
            result
        }
        Some(pb::task::Kind::Push(p)) => push(&ctx, &id, p).await,
        Some(pb::task::Kind::List(l)) => list(&ctx, l).await,
        Some(pb::task::Kind::Inspect(i)) => inspect(&ctx, i).await,
        Some(pb::task::Kind::Remove(r)) => remove(&ctx, r).await,
        Some(pb::task::Kind::Export(e)) => export(&ctx, e).await,
        Some(pb::task::Kind::KindLoad(k)) => kind_load(&ctx, k).await,
        Some(pb::task::Kind::Tag(t)) => tag(&ctx, t).await,
        Some(pb::task::Kind::Probe(p)) => probe(p).await,
        Some(pb::task::Kind::Import(_)) => refuse((
            ErrorKind::Unsupported,
            format!("host agent {} does not import — send imports to a node agent", ctx.agent_id),
        )),
        None => refuse((ErrorKind::Unsupported, "this agent does not know that kind of task — upgrade it".to_string())),
    };
    if let Ok(outcome) = &result {
        let store = if store.is_empty() { crate::stores::host_store_id(&ctx.agent_id) } else { store };
        ctx.metrics.answered(&store, outcome);
    }
    answer(&ctx.out, id, result).await;
}

/// Sends a task's one answer; a failure is an answer too.
pub(crate) async fn answer(out: &mpsc::Sender<pb::AgentMessage>, task_id: String, result: TaskResult) {
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(Refusal { kind, message, step }) => Outcome::Error(pb::TaskError { kind: kind as i32, message, step }),
    };
    let result = pb::TaskResult { task_id, outcome: Some(outcome) };
    let _ = out.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Result(result)) }).await;
}

async fn progress(ctx: &TaskContext, task_id: &str, log_line: String, current: u64, total: u64) {
    let p = pb::TaskProgress { task_id: task_id.to_string(), log_line, current, total };
    let _ = ctx.out.send(pb::AgentMessage { body: Some(pb::agent_message::Body::Progress(p)) }).await;
}

async fn build(ctx: &TaskContext, task_id: &str, b: pb::BuildTask) -> TaskResult {
    let digest: TreeDigest = b.context_digest.parse().map_err(failed)?;
    let archive = ctx.scratch.join(format!("{digest}-{:08x}.tar", fastrand::u32(..)));
    let result = fetch_verify_build(ctx, task_id, &digest, &archive, b).await;
    let _ = tokio::fs::remove_file(&archive).await;
    result
}

async fn fetch_verify_build(
    ctx: &TaskContext,
    task_id: &str,
    digest: &TreeDigest,
    archive: &Path,
    b: pb::BuildTask,
) -> TaskResult {
    let fetch = || async {
        download(ctx, digest, archive).instrument(tracing::info_span!("fetch", context = %digest)).await?;
        let (a, s, d) = (archive.to_path_buf(), ctx.scratch.clone(), *digest);
        let verifying = tracing::info_span!("verify", context = %digest);
        tokio::task::spawn_blocking(move || verifying.in_scope(|| verify_context(&a, &d, &s)))
            .await
            .map_err(failed)?
            .map_err(|e| (ErrorKind::ContextMismatch, kiln_core::error_chain(&e)))
    };
    let placed = ctx.contexts.place(digest, archive, fetch).await?;
    ctx.metrics.context_placed(placed);
    let spec = BuildSpec {
        tag: b.tag,
        dockerfile: b.dockerfile,
        dockerfile_outside: (!b.dockerfile_outside.is_empty()).then_some(b.dockerfile_outside),
        args: b.args.into_iter().collect(),
        target: (!b.target_stage.is_empty()).then_some(b.target_stage),
        platform: (!b.platform.is_empty()).then_some(b.platform),
        labels: b.labels.into_iter().collect(),
        no_cache: b.no_cache,
    };
    let (log_tx, mut log_rx) = mpsc::channel::<String>(256);
    let store = ctx.store.clone();
    let a = archive.to_path_buf();
    // Aborted with this task: a cancelled build closes its connection to the daemon, which
    // stops the build there.
    let docker = tracing::info_span!("docker build", image = %spec.tag);
    let mut building =
        AbortOnDrop(tokio::spawn(async move { store.build(&a, &spec, log_tx).instrument(docker).await }));
    while let Some(line) = log_rx.recv().await {
        progress(ctx, task_id, line, 0, 0).await;
    }
    let built = (&mut building.0).await.map_err(failed)?.map_err(|e| build_error(&e))?;
    Ok(Outcome::Built(pb::Built { id: built.id }))
}

/// A spawned piece of a task, stopped when the task is.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A failed build, typed for the coordinator: it decides by the kind, never by the words.
fn build_error(err: &HostError) -> Refusal {
    let message = kiln_core::error_chain(err);
    let kind = match err {
        // Docker's classic builder, when a cached step's image was removed under it mid-build.
        HostError::BuildFailed { step, .. } if step.contains("unable to find image") => ErrorKind::CacheVanished,
        HostError::BuildFailed { .. } => ErrorKind::BuildFailed,
        HostError::Unreachable { .. } | HostError::Lost { .. } | HostError::TimedOut { .. } => {
            ErrorKind::StoreUnreachable
        }
        _ => ErrorKind::Failed,
    };
    let step = match err {
        HostError::BuildFailed { step, .. } => crate::host::step_number(step).unwrap_or(0),
        _ => 0,
    };
    Refusal { kind, message, step }
}

async fn download(ctx: &TaskContext, digest: &TreeDigest, archive: &Path) -> Result<(), (ErrorKind, String)> {
    let fail = |why: String| failed(format!("fetching context {digest} from the coordinator: {why}"));
    let mut client = ctx.content.clone();
    let mut chunks = client
        .download(traced(pb::DownloadRequest { digest: digest.to_string() }))
        .await
        .map_err(|s| fail(s.message().to_string()))?
        .into_inner();
    let mut file = tokio::fs::File::create(archive).await.map_err(|e| fail(e.to_string()))?;
    while let Some(chunk) = chunks.message().await.map_err(|s| fail(s.message().to_string()))? {
        file.write_all(&chunk.data).await.map_err(|e| fail(e.to_string()))?;
    }
    file.flush().await.map_err(|e| fail(e.to_string()))?;
    Ok(())
}

/// How long a push keeps retrying a registry that refuses connections (DESIGN.md "Talking across
/// the network": an action that was never delivered is sent again on the ladder).
const PUSH_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

async fn push(ctx: &TaskContext, task_id: &str, p: pb::PushTask) -> TaskResult {
    use kiln_core::retry::{Ladder, LadderConfig};
    let mut ladder = Ladder::new(LadderConfig::with_window(PUSH_WINDOW), fastrand::u64(..));
    let started = std::time::Instant::now();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        match push_once(ctx, task_id, &p).await {
            Err(PushError::Refused(why)) => match ladder.next_sleep(started.elapsed()) {
                Some(sleep) => {
                    let line = format!("registry refused the connection ({why}); retrying (attempt {})", attempts + 1);
                    progress(ctx, task_id, line, 0, 0).await;
                    tokio::time::sleep(sleep).await;
                }
                None => {
                    return refuse(failed(format!(
                        "{why} — gave up after {attempts} attempts in {} s",
                        started.elapsed().as_secs()
                    )))
                }
            },
            Err(PushError::Other(err)) => return refuse(err),
            Ok(outcome) => {
                if attempts > 1 {
                    // ADR-0042's line, where the converge shows it, when the retry cost something.
                    let line = format!(
                        "kiln.routability seat=push attempts={attempts} ms={} last=connection refused url={}",
                        started.elapsed().as_millis(),
                        p.reference
                    );
                    tracing::info!("{line}");
                    progress(ctx, task_id, line, 0, 0).await;
                }
                return Ok(outcome);
            }
        }
    }
}

enum PushError {
    /// The registry refused the connection: nothing was delivered, so the push may be sent again.
    Refused(String),
    Other((ErrorKind, String)),
}

async fn push_once(ctx: &TaskContext, task_id: &str, p: &pb::PushTask) -> Result<Outcome, PushError> {
    // A ref swept by someone else since its build is not a push failure but a reason to rebuild.
    if let Ok(None) = ctx.store.inspect(&p.reference).await {
        return Err(PushError::Other((ErrorKind::ImageGone, format!("{} is no longer on this host", p.reference))));
    }
    let (tx, mut rx) = mpsc::channel(64);
    let store = ctx.store.clone();
    let reference = p.reference.clone();
    let pushing = tokio::spawn(async move { store.push(&reference, tx).await });
    let mut layers: std::collections::BTreeMap<String, (u64, u64)> = Default::default();
    while let Some(pp) = rx.recv().await {
        layers.insert(pp.layer, (pp.current, pp.total));
        let (current, total) = layers.values().fold((0, 0), |(c, t), (lc, lt)| (c + lc, t + lt));
        progress(ctx, task_id, String::new(), current, total).await;
    }
    match pushing.await.map_err(|e| PushError::Other(failed(e)))? {
        Ok(pushed) => {
            Ok(Outcome::Pushed(pb::Pushed { digest: pushed.digest.unwrap_or_default(), bytes: pushed.bytes }))
        }
        Err(HostError::RegistryRefused { why, .. }) => Err(PushError::Refused(why)),
        // Swept between the check above and the push itself: still a reason to rebuild.
        Err(_) if matches!(ctx.store.inspect(&p.reference).await, Ok(None)) => {
            Err(PushError::Other((ErrorKind::ImageGone, format!("{} left this host during its push", p.reference))))
        }
        Err(err) => Err(PushError::Other(failed(kiln_core::error_chain(&err)))),
    }
}

async fn list(ctx: &TaskContext, l: pb::ListTask) -> TaskResult {
    if let Target::Kind(node) = resolve(ctx, &l.store).await? {
        return crate::node::tasks::list(&*node, l).await;
    }
    // Containers first: an image a container starts using between the two reads is then listed
    // (and kept by its tag's root, if any) rather than seen unused.
    let in_use = match l.workloads {
        true => ctx.store.images_in_use().await.map_err(|e: HostError| failed(kiln_core::error_chain(&e)))?,
        false => Vec::new(),
    };
    let images = match l.layers {
        true => ctx.store.list_with_layers().await,
        false => ctx.store.list_labeled().await,
    }
    .map_err(|e: HostError| failed(kiln_core::error_chain(&e)))?;
    let Outcome::Listing(out) = listing(images) else { unreachable!("listing() builds a listing") };
    Ok(Outcome::Listing(pb::Listing { in_use, workloads_listed: l.workloads, removes_whole_ids: false, ..out }))
}

async fn tag(ctx: &TaskContext, t: pb::TagTask) -> TaskResult {
    ctx.store.tag(&t.image_id, &t.reference).await.map_err(|e| failed(kiln_core::error_chain(&e)))?;
    Ok(Outcome::Tagged(pb::Tagged {}))
}

async fn probe(p: pb::ProbeTask) -> TaskResult {
    let answers = crate::registry::probe(&p.references).await;
    let mut out = pb::Probed::default();
    for (reference, answer) in p.references.iter().zip(answers) {
        match answer {
            Ok(present) => {
                out.present.push(present);
                out.errors.push(String::new());
            }
            Err(why) => {
                tracing::warn!(%reference, %why, "registry probe failed; the ref counts as absent");
                out.present.push(false);
                out.errors.push(why);
            }
        }
    }
    Ok(Outcome::Probed(out))
}

async fn inspect(ctx: &TaskContext, i: pb::InspectTask) -> TaskResult {
    let info = ctx.store.inspect(&i.reference).await.map_err(|e| failed(kiln_core::error_chain(&e)))?;
    Ok(Outcome::Inspected(match info {
        None => pb::Inspected { present: false, ..Default::default() },
        Some(info) => pb::Inspected {
            present: true,
            id: info.id,
            bytes: info.bytes,
            labels: info.labels.into_iter().collect(),
            declares_user: info.user.is_some(),
            user: info.user.unwrap_or_default(),
        },
    }))
}

async fn remove(ctx: &TaskContext, r: pb::RemoveTask) -> TaskResult {
    if let Target::Kind(node) = resolve(ctx, &r.store).await? {
        return crate::node::tasks::remove(&*node, r).await;
    }
    let mut out = pb::Removed::default();
    // Every removal is tried: one failure is reported, never allowed to abandon the rest. Tags go
    // before ids, so an id whose last tag this task takes is already gone when its turn comes.
    for reference in r.references {
        let result = ctx.store.remove_tag(&reference).await;
        record(&mut out, reference, result);
    }
    for id in r.image_ids {
        let result = ctx.store.remove_image(&id).await;
        record(&mut out, id, result);
    }
    Ok(Outcome::Removed(out))
}

fn record(out: &mut pb::Removed, reference: String, result: Result<Removal, HostError>) {
    match result {
        Ok(Removal::Removed) => out.removed.push(reference),
        Ok(Removal::Absent) => out.absent.push(reference),
        Err(err) => {
            let reason = kiln_core::error_chain(&err);
            tracing::warn!(%reference, %reason, "removal failed; the rest proceed");
            out.failed.push(format!("{reference}: {reason}"));
            out.failures.push(pb::RemovalFailure { reference, reason });
        }
    }
}

/// A store's images as the wire carries them; callers add what they know of workloads.
pub(crate) fn listing(images: Vec<kiln_core::sweep::ListedImage>) -> Outcome {
    let images = images
        .into_iter()
        .map(|i| pb::ListedImage {
            id: i.id,
            refs: i.refs,
            digests: i.digests,
            labels: i.labels.into_iter().collect(),
            bytes: i.bytes,
            layers: i.layers.into_iter().map(|l| pb::Layer { chain: l.chain, bytes: l.bytes }).collect(),
        })
        .collect();
    Outcome::Listing(pb::Listing { images, ..Default::default() })
}

/// `docker save` the image and upload the archive to the coordinator's relay, streamed: the one
/// export a delivery to every node of a cluster needs.
async fn export(ctx: &TaskContext, e: pb::ExportTask) -> TaskResult {
    use futures_util::StreamExt;
    // The tag may have moved (or gone) since the converge read it: exporting another image would
    // only fail on every node's verification, so say so here, as a reason to rebuild.
    match ctx.store.inspect(&e.reference).await.map_err(|err| failed(kiln_core::error_chain(&err)))? {
        Some(info) if e.image_id.is_empty() || info.id == e.image_id => {}
        Some(info) => {
            return refuse((
                ErrorKind::ImageGone,
                format!("{} names {} on this host now, not {}", e.reference, info.id, e.image_id),
            ))
        }
        None => return refuse((ErrorKind::ImageGone, format!("{} left this host before its export", e.reference))),
    }
    let archive = ctx.store.export(&e.reference).await.map_err(|err| failed(kiln_core::error_chain(&err)))?;
    let (tx, rx) = mpsc::channel::<pb::RelayChunk>(4);
    // A save failing mid-way ends the upload early; the pump keeps the error to name it, rather
    // than the relay's complaint about a short archive.
    let key = e.relay_key.clone();
    let pump = tokio::spawn(async move {
        let mut archive = archive;
        let mut key = Some(key);
        while let Some(chunk) = archive.next().await {
            let data = chunk?;
            let chunk = pb::RelayChunk { key: key.take().unwrap_or_default(), data };
            if tx.send(chunk).await.is_err() {
                break;
            }
        }
        Ok::<(), HostError>(())
    });
    let chunks = tokio_stream::wrappers::ReceiverStream::new(rx);
    let put = ctx.relay.clone().put(traced(chunks)).await;
    if let Ok(Err(err)) = pump.await {
        return refuse(failed(kiln_core::error_chain(&err)));
    }
    let reply = put.map_err(|s| failed(format!("the coordinator's relay refused the archive: {}", s.message())))?;
    Ok(Outcome::Exported(pb::Exported { bytes: reply.into_inner().bytes }))
}

/// Loads the image into the kind cluster's node containers on this host, checking first that the
/// tag still names the image the converge built.
async fn kind_load(ctx: &TaskContext, k: pb::KindLoadTask) -> TaskResult {
    match ctx.store.inspect(&k.reference).await.map_err(|err| failed(kiln_core::error_chain(&err)))? {
        Some(info) if info.id == k.image_id => {}
        _ => {
            return refuse((
                ErrorKind::ImageGone,
                format!("{} no longer names {} on this host", k.reference, k.image_id),
            ))
        }
    }
    let load = ctx
        .store
        .kind_load(
            &k.cluster,
            &k.reference,
            &k.image_id,
            if k.import_as.is_empty() { &k.reference } else { &k.import_as },
        )
        .await
        .map_err(|err| failed(kiln_core::error_chain(&err)))?;
    // Before the answer, so a sweep that follows this delivery already sees the nodes it reached.
    crate::stores::announce(ctx).await;
    Ok(Outcome::KindLoaded(pb::KindLoaded { loaded: load.loaded, skipped: load.skipped }))
}
