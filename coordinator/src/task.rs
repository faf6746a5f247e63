//! The tasks the coordinator hands its agents, what they answer, and why a task produced no
//! answer — as the engine, the delivery and the sweep read them. Prost's types stop at the hub:
//! [`Task`] becomes a `pb::task::Kind` only as it is sent, and an agent's `pb::TaskResult` becomes
//! a [`TaskOutcome`] or a [`TaskFailure`] as it arrives.

use std::collections::BTreeMap;

use kiln_core::digest::TreeDigest;
use kiln_core::sweep::{ListedImage, StoreId};
use kiln_proto::v1 as pb;

/// One task for one agent.
#[derive(Debug, Clone)]
pub enum Task {
    Build(BuildTask),
    /// Host agent: push `reference` to its registry.
    Push {
        reference: String,
    },
    /// List a store: `None` is the agent's host store. `workloads`: also what the store's
    /// containers use (a sweep's roots); `layers`: also each image's layers, and the images Kiln did
    /// not label by their layers alone, so a sweep counts what it frees in real bytes.
    List {
        store: Option<StoreId>,
        workloads: bool,
        layers: bool,
    },
    /// Host agent: the image `reference` names, if any.
    Inspect {
        reference: String,
    },
    /// Delete-if-present: untag `references` (as the store listed them), remove `image_ids` whole.
    Remove {
        store: StoreId,
        references: Vec<String>,
        image_ids: Vec<String>,
    },
    /// Host agent: save image `image_id`, tagged `reference`, into the relay under `relay_key`.
    Export {
        reference: String,
        image_id: String,
        relay_key: String,
    },
    /// Node agent: point `reference` at image `image_id`, from the relay's `relay_key` unless it
    /// holds it already. No key only asks whether it does.
    Import {
        reference: String,
        image_id: String,
        relay_key: Option<String>,
    },
    /// Host agent: load image `image_id`, tagged `reference`, into every node container of kind
    /// cluster `cluster` on its daemon that lacks it under `import_as` (`reference` when empty).
    KindLoad {
        reference: String,
        image_id: String,
        cluster: String,
        import_as: String,
    },
    /// Host agent: tag image `image_id` as `reference` (a farm's hold on another farm's image).
    Tag {
        image_id: String,
        reference: String,
    },
    /// Host agent: whether each ref's manifest is in its registry.
    Probe {
        references: Vec<String>,
    },
}

/// A build of one image on a host agent.
#[derive(Debug, Clone)]
pub struct BuildTask {
    /// The ref the image is tagged with.
    pub tag: String,
    pub context: TreeDigest,
    /// The Dockerfile's path in the context, or its bytes when it lives outside it.
    pub dockerfile: String,
    pub dockerfile_outside: Vec<u8>,
    pub args: BTreeMap<String, String>,
    pub target_stage: String,
    pub platform: String,
    pub labels: BTreeMap<String, String>,
}

impl Task {
    /// The task's kind as spans and messages name it: `build`, `push`.
    pub fn name(&self) -> &'static str {
        match self {
            Task::Build(_) => "build",
            Task::Push { .. } => "push",
            Task::List { .. } => "list",
            Task::Inspect { .. } => "inspect",
            Task::Remove { .. } => "remove",
            Task::Export { .. } => "export",
            Task::Import { .. } => "import",
            Task::KindLoad { .. } => "kind_load",
            Task::Tag { .. } => "tag",
            Task::Probe { .. } => "probe",
        }
    }
}

/// What an agent answered a task that did what it was asked.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskOutcome {
    Built {
        image_id: String,
    },
    Pushed {
        digest: String,
        bytes: u64,
    },
    Listing(Listing),
    /// `None`: the ref names no image on the host.
    Inspected(Option<Inspected>),
    Removed(Removed),
    /// Archive bytes uploaded to the relay.
    Exported {
        bytes: u64,
    },
    /// `skipped`: the node held the image under the ref already, and nothing moved.
    Imported {
        skipped: bool,
        bytes: u64,
    },
    /// Node containers that imported the image, and those that held it already.
    KindLoaded {
        loaded: Vec<String>,
        skipped: Vec<String>,
    },
    Tagged,
    /// Per ref asked, in order: the registry has its manifest. A ref that could not be probed
    /// counts as absent.
    Probed {
        present: Vec<bool>,
    },
}

/// One store's images.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Listing {
    pub images: Vec<ListedImage>,
    /// With `workloads`: every image the store's containers use, by ref or image id.
    pub in_use: Vec<String>,
    /// `in_use` was listed: an agent that predates it leaves this false, and its store is not
    /// swept, since what runs there cannot be seen.
    pub workloads_listed: bool,
    /// The store removes whole image ids only (a node reached through CRI alone).
    pub removes_whole_ids: bool,
}

/// An image found on a host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inspected {
    pub id: String,
    pub bytes: u64,
    pub labels: BTreeMap<String, String>,
    /// The image's `USER`, when its config declares one.
    pub user: Option<String>,
}

/// What a removal did, per ref or image id the task named.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Removed {
    pub removed: Vec<String>,
    pub absent: Vec<String>,
    /// `(ref or image id, why)` for every one that could not be removed.
    pub failures: Vec<(String, String)>,
}

/// Why an agent says a task failed: what the coordinator does next depends on it, never on the
/// message's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The agent named no kind, or one newer than this coordinator: a plain failure.
    Unspecified,
    Failed,
    /// The agent cannot run tasks of this kind (a node agent asked to build).
    Unsupported,
    /// The context's bytes did not match their digest; nothing was built.
    ContextMismatch,
    /// The image a push or load needed left the host (swept by someone else).
    ImageGone,
    /// The build ran and a step failed.
    BuildFailed,
    Cancelled,
    /// The agent could not reach its store (the Docker daemon, containerd, the registry).
    StoreUnreachable,
    /// Docker's classic builder lost a cached step's image mid-build: building again succeeds.
    CacheVanished,
    /// The agent is shutting down and took no new task: it may run on another agent.
    Draining,
}

/// An agent's answer that the task failed.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskError {
    pub kind: FailureKind,
    pub message: String,
    /// A failed build: the Dockerfile's 1-based step that failed, when the builder said.
    pub step: Option<u32>,
}

/// Why a task produced no result.
#[derive(Debug, thiserror::Error)]
pub enum TaskFailure {
    #[error("agent {agent} went away while running the task — its stream broke or it was silent past its lease")]
    Lost { agent: String },
    #[error("agent {agent}: {message}")]
    Failed {
        agent: String,
        kind: FailureKind,
        message: String,
        /// A failed build: the Dockerfile's 1-based step that failed, when the builder said.
        step: Option<u32>,
    },
    #[error("agent {agent} answered a task without an outcome")]
    Empty { agent: String },
    #[error("agent {agent} showed no sign of the task for {secs} s (no progress, and its heartbeats do not name it); given up")]
    Stalled { agent: String, secs: u64 },
}

impl TaskFailure {
    /// The agent, not the task, failed: the task may run elsewhere.
    pub fn agent_lost(&self) -> bool {
        matches!(
            self,
            TaskFailure::Lost { .. }
                | TaskFailure::Stalled { .. }
                | TaskFailure::Empty { .. }
                // A task that reached a draining agent before its `GoingAway` reached us.
                | TaskFailure::Failed { kind: FailureKind::Draining, .. }
        )
    }
}

/// A sign of life from a running task: a build's log line, or how far a push or load got.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    pub log_line: Option<String>,
    pub current: u64,
    pub total: u64,
}

impl From<Task> for pb::task::Kind {
    fn from(task: Task) -> pb::task::Kind {
        use pb::task::Kind;
        match task {
            Task::Build(b) => Kind::Build(pb::BuildTask {
                tag: b.tag,
                context_digest: b.context.to_string(),
                dockerfile: b.dockerfile,
                dockerfile_outside: b.dockerfile_outside,
                args: b.args.into_iter().collect(),
                target_stage: b.target_stage,
                platform: b.platform,
                labels: b.labels.into_iter().collect(),
                no_cache: false,
            }),
            Task::Push { reference } => Kind::Push(pb::PushTask { reference }),
            Task::List { store, workloads, layers } => {
                Kind::List(pb::ListTask { workloads, store: store.map(|s| s.0).unwrap_or_default(), layers })
            }
            Task::Inspect { reference } => Kind::Inspect(pb::InspectTask { reference }),
            Task::Remove { store, references, image_ids } => {
                Kind::Remove(pb::RemoveTask { references, store: store.0, image_ids })
            }
            Task::Export { reference, image_id, relay_key } => {
                Kind::Export(pb::ExportTask { reference, image_id, relay_key })
            }
            Task::Import { reference, image_id, relay_key } => {
                Kind::Import(pb::ImportTask { reference, image_id, relay_key: relay_key.unwrap_or_default() })
            }
            Task::KindLoad { reference, image_id, cluster, import_as } => {
                Kind::KindLoad(pb::KindLoadTask { reference, image_id, cluster, import_as })
            }
            Task::Tag { image_id, reference } => Kind::Tag(pb::TagTask { image_id, reference }),
            Task::Probe { references } => Kind::Probe(pb::ProbeTask { references }),
        }
    }
}

/// The wire's outcome is a oneof that holds the failure too: converting it is where the two part.
impl TryFrom<pb::task_result::Outcome> for TaskOutcome {
    type Error = TaskError;

    fn try_from(outcome: pb::task_result::Outcome) -> Result<TaskOutcome, TaskError> {
        use pb::task_result::Outcome;
        Ok(match outcome {
            Outcome::Error(e) => return Err(TaskError::from(e)),
            Outcome::Built(b) => TaskOutcome::Built { image_id: b.id },
            Outcome::Pushed(p) => TaskOutcome::Pushed { digest: p.digest, bytes: p.bytes },
            Outcome::Listing(l) => TaskOutcome::Listing(Listing {
                images: l.images.into_iter().map(crate::convert::listed_image).collect(),
                in_use: l.in_use,
                workloads_listed: l.workloads_listed,
                removes_whole_ids: l.removes_whole_ids,
            }),
            Outcome::Inspected(i) => TaskOutcome::Inspected(i.present.then(|| Inspected {
                id: i.id,
                bytes: i.bytes,
                labels: i.labels.into_iter().collect(),
                user: i.declares_user.then_some(i.user),
            })),
            Outcome::Removed(r) => TaskOutcome::Removed(Removed {
                removed: r.removed,
                absent: r.absent,
                failures: r.failures.into_iter().map(|f| (f.reference, f.reason)).collect(),
            }),
            Outcome::Exported(e) => TaskOutcome::Exported { bytes: e.bytes },
            Outcome::Imported(i) => TaskOutcome::Imported { skipped: i.skipped, bytes: i.bytes },
            Outcome::KindLoaded(k) => TaskOutcome::KindLoaded { loaded: k.loaded, skipped: k.skipped },
            Outcome::Tagged(_) => TaskOutcome::Tagged,
            Outcome::Probed(p) => TaskOutcome::Probed { present: p.present },
        })
    }
}

impl From<pb::TaskError> for TaskError {
    fn from(e: pb::TaskError) -> TaskError {
        TaskError { kind: e.kind().into(), step: (e.step > 0).then_some(e.step), message: e.message }
    }
}

impl From<pb::task_error::Kind> for FailureKind {
    fn from(kind: pb::task_error::Kind) -> FailureKind {
        use pb::task_error::Kind;
        match kind {
            Kind::Unspecified => FailureKind::Unspecified,
            Kind::Failed => FailureKind::Failed,
            Kind::Unsupported => FailureKind::Unsupported,
            Kind::ContextMismatch => FailureKind::ContextMismatch,
            Kind::ImageGone => FailureKind::ImageGone,
            Kind::BuildFailed => FailureKind::BuildFailed,
            Kind::Cancelled => FailureKind::Cancelled,
            Kind::StoreUnreachable => FailureKind::StoreUnreachable,
            Kind::CacheVanished => FailureKind::CacheVanished,
            Kind::Draining => FailureKind::Draining,
        }
    }
}

impl From<pb::TaskProgress> for Progress {
    fn from(p: pb::TaskProgress) -> Progress {
        let log_line = Some(p.log_line).filter(|l| !l.is_empty());
        Progress { log_line, current: p.current, total: p.total }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::task_result::Outcome;
    use std::collections::HashSet;

    #[test]
    fn every_failure_kind_on_the_wire_reads_as_a_kind_of_its_own() {
        let known: Vec<pb::task_error::Kind> = (0..64).filter_map(|n| pb::task_error::Kind::try_from(n).ok()).collect();
        let read: HashSet<FailureKind> = known.iter().map(|k| FailureKind::from(*k)).collect();
        assert_eq!(read.len(), known.len(), "two wire kinds read as one: the engine could not tell them apart");
    }

    #[test]
    fn a_failure_kind_newer_than_the_coordinator_reads_as_a_plain_failure() {
        let newer = pb::TaskError { kind: 64, message: "it broke".into(), step: 0 };
        let read = TaskError::from(newer);
        assert_eq!(read.kind, FailureKind::Unspecified);
        assert!(
            !TaskFailure::Failed { agent: "a".into(), kind: read.kind, message: read.message, step: None }.agent_lost()
        );
    }

    #[test]
    fn an_error_outcome_is_a_task_error_with_its_kind_and_step() {
        let error =
            pb::TaskError { kind: pb::task_error::Kind::BuildFailed as i32, message: "RUN false".into(), step: 3 };
        let read = TaskOutcome::try_from(Outcome::Error(error)).unwrap_err();
        assert_eq!(read, TaskError { kind: FailureKind::BuildFailed, message: "RUN false".into(), step: Some(3) });
        let unnumbered = pb::TaskError { kind: pb::task_error::Kind::Failed as i32, message: "no".into(), step: 0 };
        assert_eq!(TaskOutcome::try_from(Outcome::Error(unnumbered)).unwrap_err().step, None, "step 0 is no step");
    }

    #[test]
    fn only_a_draining_agent_of_all_failure_kinds_counts_as_lost() {
        let known = (0..64).filter_map(|n| pb::task_error::Kind::try_from(n).ok());
        for kind in known {
            let failure =
                TaskFailure::Failed { agent: "a".into(), kind: kind.into(), message: String::new(), step: None };
            assert_eq!(failure.agent_lost(), kind == pb::task_error::Kind::Draining, "{kind:?}");
        }
    }

    #[test]
    fn an_absent_image_inspects_as_none_and_an_undeclared_user_as_no_user() {
        let absent = pb::Inspected { present: false, id: "sha256:stale".into(), ..Default::default() };
        assert_eq!(TaskOutcome::try_from(Outcome::Inspected(absent)).unwrap(), TaskOutcome::Inspected(None));
        let root = pb::Inspected { present: true, id: "sha256:a".into(), declares_user: false, ..Default::default() };
        let Ok(TaskOutcome::Inspected(Some(found))) = TaskOutcome::try_from(Outcome::Inspected(root)) else {
            panic!("a present image reads as found")
        };
        assert_eq!((found.id.as_str(), found.user), ("sha256:a", None));
    }

    fn web_build() -> BuildTask {
        BuildTask {
            tag: "web:1".into(),
            context: TreeDigest([7; 32]),
            dockerfile: "Dockerfile".into(),
            dockerfile_outside: Vec::new(),
            args: BTreeMap::from([("V".into(), "1".into())]),
            target_stage: String::new(),
            platform: "linux/amd64".into(),
            labels: BTreeMap::new(),
        }
    }

    #[test]
    fn each_task_goes_out_as_the_wire_kind_of_its_name() {
        let store = StoreId("docker@a".into());
        let build = web_build();
        let tasks = [
            Task::Build(build),
            Task::Push { reference: "r".into() },
            Task::List { store: None, workloads: false, layers: false },
            Task::Inspect { reference: "r".into() },
            Task::Remove { store, references: vec![], image_ids: vec![] },
            Task::Export { reference: "r".into(), image_id: "i".into(), relay_key: "k".into() },
            Task::Import { reference: "r".into(), image_id: "i".into(), relay_key: None },
            Task::KindLoad {
                reference: "r".into(),
                image_id: "i".into(),
                cluster: "c".into(),
                import_as: String::new(),
            },
            Task::Tag { image_id: "i".into(), reference: "r".into() },
            Task::Probe { references: vec![] },
        ];
        for task in tasks {
            let name = task.name();
            let wire = pb::task::Kind::from(task);
            let wire_name = format!("{wire:?}");
            let wire_name = wire_name.split('(').next().unwrap();
            assert_eq!(wire_name.to_lowercase(), name.replace('_', ""), "task {name} went out as {wire_name}");
        }
    }

    #[test]
    fn a_build_carries_its_context_digest_and_args_onto_the_wire() {
        let build = BuildTask {
            target_stage: "app".into(),
            labels: BTreeMap::from([("kiln.farm".into(), "f".into())]),
            ..web_build()
        };
        let context = build.context.to_string();
        let pb::task::Kind::Build(wire) = Task::Build(build).into() else { panic!("a build goes out as a build") };
        assert_eq!(wire.context_digest, context);
        assert_eq!(wire.args.get("V").map(String::as_str), Some("1"));
        assert_eq!(wire.labels.get("kiln.farm").map(String::as_str), Some("f"));
        assert_eq!((wire.target_stage.as_str(), wire.platform.as_str()), ("app", "linux/amd64"));
    }

    #[test]
    fn an_import_without_a_relay_key_only_asks() {
        let ask = Task::Import { reference: "r".into(), image_id: "i".into(), relay_key: None };
        let pb::task::Kind::Import(wire) = ask.into() else { panic!("an import goes out as an import") };
        assert_eq!(wire.relay_key, "", "an empty key is the wire's way to only ask");
    }
}
