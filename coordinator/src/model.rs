//! The coordinator's state as domain types: agents, records by generation, converges and their
//! events, claims, the context index and store inventories. These are what the [`crate::state::StateStore`]
//! trait takes and returns, so no backend's types (SQLite rows, PostgreSQL rows) leak past it. The
//! types stored as JSON (a record's images, an event's kind) derive serde; their field names are the
//! stored format, so renaming one is a schema change.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One converge's id: 10 characters of milliseconds since the epoch then 6 random ones, all lowercase
/// Crockford base32, so ids sort by start time as text (`kiln logs` lists them newest first) and two
/// converges opened in the same millisecond still differ.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConvergeId(String);

/// Crockford's base32 alphabet: no `i`, `l`, `o` or `u`, so an id read aloud or retyped is unambiguous.
const CROCKFORD: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";

impl ConvergeId {
    /// A fresh id for a converge opened at `now_ms`.
    pub fn generate(now_ms: u64) -> ConvergeId {
        let mut id = String::with_capacity(16);
        // 10 base32 digits hold 50 bits: milliseconds past the year 10000 still fit.
        for shift in (0..10).rev() {
            id.push(CROCKFORD[((now_ms >> (shift * 5)) & 31) as usize] as char);
        }
        for _ in 0..6 {
            id.push(CROCKFORD[fastrand::usize(..32)] as char);
        }
        ConvergeId(id)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<String> for ConvergeId {
    fn from(id: String) -> ConvergeId {
        ConvergeId(id)
    }
}

impl From<&str> for ConvergeId {
    fn from(id: &str) -> ConvergeId {
        ConvergeId(id.to_owned())
    }
}

impl fmt::Display for ConvergeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One agent's id, as the agent announces it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AgentId(pub String);

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A record's generation. Generations of one instance only ever grow, even across `kiln down`: a
/// converge that started from generation 3 must never mistake a later, unrelated generation 3 for
/// the one it read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How an image came to be in a record; only built images are ever labeled and swept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordedKind {
    Built,
    Brought,
    Pinned,
}

/// One image of a record: the ref it converged to *and* the target it was delivered to, because a
/// ref delivered to `kind` is not yet in a registry — skipping on the ref alone would deliver nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedImage {
    /// The image's name in the manifest (`api`).
    pub name: String,
    /// The ref delivered, e.g. `shop-api:4a77b1c2d3e4-amd64`.
    pub reference: String,
    pub kind: RecordedKind,
    /// The target's identity: `local`, `registry:127.0.0.1:5000`, `kind:kind`, …
    pub target: String,
    /// Tree digest (hex) of the context, for built images.
    pub context: Option<String>,
    /// The `USER` the image declares; `None` when it declares none.
    pub user: Option<String>,
    /// Built images: what their address was computed from, so the next converge can say which
    /// input moved. Absent in records written before Kiln kept them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<AddressInputs>,
    /// Built images: the image id delivered (`sha256:…`), so node stores can be asked whether
    /// they still hold exactly it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
}

impl RecordedImage {
    /// A brought or pinned image: its ref, passed through untouched.
    pub fn passthrough(name: &str, reference: &str, kind: RecordedKind, target: &str) -> RecordedImage {
        RecordedImage {
            name: name.to_string(),
            reference: reference.to_string(),
            kind,
            target: target.to_string(),
            context: None,
            user: None,
            inputs: None,
            image_id: None,
        }
    }
}

/// The inputs of a built image's address (DESIGN.md "The content address"), kept beside it in the
/// record: cheap, and what lets a converge tell "Dockerfile changed" from "build arg VERSION: 1 → 2".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct AddressInputs {
    /// The context's tree digest (64 hex).
    pub tree: String,
    /// blake3 of the Dockerfile's bytes (64 hex); empty when the client did not say.
    #[serde(default)]
    pub dockerfile: String,
    #[serde(default)]
    pub args: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    pub target: String,
    #[serde(default)]
    pub platforms: Vec<String>,
}

/// Why an image was skipped, delivered again or built. Stored in events as JSON; the words a
/// person reads are [`Reason::words`], the structure is what `--json` carries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// The record names this ref at this target, and the target was seen to hold it.
    Recorded,
    /// A host store holds this farm's image wearing the tag, built by `converge` (when labeled).
    Held {
        #[serde(default)]
        converge: String,
    },
    /// No generation of the record names this image.
    FirstBuild,
    Forced,
    /// Inputs of the address moved since the recorded generation.
    Changed {
        changes: Vec<InputChange>,
    },
    /// The record names it, but `store` no longer holds it (removed outside Kiln).
    Gone {
        store: String,
        generation: u64,
    },
    /// Another farm's Kiln image wears the tag on this daemon: equivalent by address, so used,
    /// and held under this farm's hold tag.
    HeldByFarm {
        farm: String,
    },
}

/// One input of an address that moved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputChange {
    pub input: Input,
    /// The build arg's name; empty otherwise.
    #[serde(default)]
    pub name: String,
    pub before: String,
    pub after: String,
    /// [`Input::Context`]: the files that moved, when the entry lists of both trees were kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<FilesMoved>,
}

/// The paths that moved between two entry lists of a context: added, removed, and changed in
/// place (contents, executable bit, type or symlink target — `kiln why` tells those apart).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct FilesMoved {
    pub added: MovedPaths,
    pub removed: MovedPaths,
    pub changed: MovedPaths,
}

/// How many paths moved one way, and the first [`FilesMoved::KEPT`] of them as a person reads them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct MovedPaths {
    pub count: u64,
    pub paths: Vec<String>,
}

impl FilesMoved {
    /// Names kept per class: events are stored and replayed, so a regenerated folder of a hundred
    /// thousand files must not become a hundred-thousand-name event; `kiln why` lists them all.
    pub const KEPT: usize = 20;
    /// Names the words show before `…`.
    const SHOWN: usize = 3;

    pub fn of(moved: &[kiln_core::digest::diff::Moved]) -> FilesMoved {
        use kiln_core::digest::diff::Class;
        let mut files = FilesMoved::default();
        for m in moved {
            let into = match m.class() {
                Class::Added => &mut files.added,
                Class::Removed => &mut files.removed,
                _ => &mut files.changed,
            };
            into.count += 1;
            if into.paths.len() < Self::KEPT {
                into.paths.push(m.shown());
            }
        }
        files
    }

    pub fn count(&self) -> u64 {
        self.added.count + self.removed.count + self.changed.count
    }

    /// `3 files (+ src/new.rs, ~ src/main.rs, − old.txt)`: added first, then changed, then
    /// removed, at most three names.
    fn words(&self) -> String {
        let count = self.count();
        let marked = [("+", &self.added), ("~", &self.changed), ("−", &self.removed)];
        let names: Vec<String> =
            marked.iter().flat_map(|(mark, moved)| moved.paths.iter().map(move |p| format!("{mark} {p}"))).collect();
        let mut shown = names.iter().take(Self::SHOWN).cloned().collect::<Vec<_>>().join(", ");
        if count > Self::SHOWN as u64 {
            shown.push_str(", …");
        }
        let noun = if count == 1 { "file" } else { "files" };
        format!("{count} {noun} ({shown})")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Input {
    Context,
    Dockerfile,
    BuildArg,
    Target,
    Platforms,
    Delivery,
}

impl Reason {
    /// The reason as a person reads it after the image's name: `recorded`, `context changed
    /// (tree 92eeaa18… → 4f01c2d9…)`, `gone from docker@host1 since generation 4 (removed outside Kiln)`.
    pub fn words(&self) -> String {
        match self {
            Reason::Recorded => "recorded".to_string(),
            Reason::Held { converge } if converge.is_empty() => "held (not in the record)".to_string(),
            Reason::Held { converge } => format!("held (built by converge {converge}, not in the record)"),
            Reason::FirstBuild => "first build".to_string(),
            Reason::Forced => "--force".to_string(),
            Reason::Changed { changes } if changes.is_empty() => {
                "inputs changed (recorded before Kiln kept an image's inputs)".to_string()
            }
            Reason::Changed { changes } => changes.iter().map(InputChange::words).collect::<Vec<_>>().join("; "),
            Reason::Gone { store, generation } => {
                format!("gone from {store} since generation {generation} (removed outside Kiln)")
            }
            Reason::HeldByFarm { farm } => format!("held by farm {farm} (same address; its image is used)"),
        }
    }
}

impl InputChange {
    /// One input's part of [`Reason::words`]: `build arg VERSION: 1 → 2`.
    pub fn words(&self) -> String {
        let short = |d: &str| if d.len() > 8 { format!("{}…", &d[..8]) } else { d.to_string() };
        let side = |v: &str| if v.is_empty() { "(none)".to_string() } else { v.to_string() };
        match self.input {
            Input::Context => match &self.files {
                Some(files) if files.count() > 0 => format!("context changed: {}", files.words()),
                _ => format!("context changed (tree {} → {})", short(&self.before), short(&self.after)),
            },
            Input::Dockerfile => "Dockerfile changed".to_string(),
            Input::BuildArg => format!("build arg {}: {} → {}", self.name, side(&self.before), side(&self.after)),
            Input::Target => format!("target stage changed ({} → {})", side(&self.before), side(&self.after)),
            Input::Platforms => {
                let set = |v: &str| v.split(',').filter(|p| !p.is_empty()).map(short_platform).collect::<Vec<_>>();
                let (before, after) = (set(&self.before), set(&self.after));
                let mut moved: Vec<String> =
                    after.iter().filter(|p| !before.contains(p)).map(|p| format!("+{p}")).collect();
                moved.extend(before.iter().filter(|p| !after.contains(p)).map(|p| format!("-{p}")));
                format!("platforms changed: {}", moved.join(" "))
            }
            Input::Delivery => format!("delivery changed ({} → {})", side(&self.before), side(&self.after)),
        }
    }
}

/// `linux/arm64` → `arm64`, as content tags spell platforms.
fn short_platform(oci: &str) -> String {
    kiln_core::refs::Platform::parse(oci).map(|p| p.to_string()).unwrap_or_else(|_| oci.to_string())
}

/// One generation of an instance's converged `name → ref` map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub instance: String,
    pub generation: Generation,
    pub images: Vec<RecordedImage>,
    pub written_at_ms: u64,
}

/// Where a converge stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConvergeState {
    Running,
    Succeeded,
    Failed { reason: String },
}

impl ConvergeState {
    /// The word stored and shown for this state.
    pub fn name(&self) -> &'static str {
        match self {
            ConvergeState::Running => "running",
            ConvergeState::Succeeded => "succeeded",
            ConvergeState::Failed { .. } => "failed",
        }
    }
}

impl fmt::Display for ConvergeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConvergeState::Failed { reason } => write!(f, "failed: {reason}"),
            other => f.write_str(other.name()),
        }
    }
}

/// One converge of one instance, as `kiln logs` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Converge {
    pub id: ConvergeId,
    pub instance: String,
    pub state: ConvergeState,
    pub started_ms: u64,
    /// Set once the converge succeeded or failed.
    pub finished_ms: Option<u64>,
    /// Who asked: a user name, a CI job, a host.
    pub requested_by: String,
}

/// What an event says happened. Stored as JSON (`{"kind":"uploaded","bytes":…}`), so a new kind needs
/// no migration; a kind this kiln does not know reads back as [`EventKind::Unknown`] with its message
/// intact, so `kiln logs` of a converge a newer kiln ran still replays.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    Started,
    /// Skipped build and delivery: the current record names this ref and this target, and the
    /// target was seen to hold it.
    Recorded {
        #[serde(default)]
        reference: String,
        #[serde(default)]
        reason: Option<Reason>,
    },
    /// Skipped build: an image labeled by this farm (or, held, another farm's) already wears the
    /// tag; or the record names it and only its delivery vanished. The delivery follows.
    Held {
        #[serde(default)]
        reference: String,
        #[serde(default)]
        reason: Option<Reason>,
    },
    Uploaded {
        bytes: u64,
    },
    Building {
        #[serde(default)]
        reference: String,
        #[serde(default)]
        reason: Option<Reason>,
    },
    /// A dry run's decision: the image would be skipped (`recorded`), delivered or built, and why.
    Would {
        reference: String,
        reason: Reason,
        action: Action,
    },
    /// One line of build output (the line is the event's message).
    BuildLog,
    Built {
        secs: f64,
    },
    Pushing,
    Pushed {
        bytes: u64,
    },
    Delivered,
    Failed,
    /// How the converge ended; `kiln logs` replays it without a second lookup.
    Finished {
        #[serde(default)]
        succeeded: bool,
        /// An up that succeeded: the generation now current.
        #[serde(default)]
        generation: u64,
    },
    Note,
    /// A removal a dry-run sweep would make. `instance` is the image's owner: an instance,
    /// `shared` or `unowned`; `bytes` what it would free (0 when other refs keep the image).
    Planned {
        store: String,
        instance: String,
        reference: String,
        bytes: u64,
    },
    /// A removal the store's re-listing confirmed; `bytes` freed as confirmed, not as planned.
    Removed {
        store: String,
        instance: String,
        reference: String,
        bytes: u64,
    },
    /// A planned removal that did not happen; the message says why.
    NotRemoved {
        store: String,
        reference: String,
    },
    /// A sweep's total, as the stores' re-listings confirmed it.
    Swept {
        images: u64,
        bytes: u64,
    },
    /// `kiln down` deleted the instance's record.
    RecordDeleted {
        instance: String,
    },
    /// The sweep collected uploaded contexts no record or claim names.
    ContextsCollected {
        count: u64,
        bytes: u64,
    },
    /// A build task waits for a slot: its place in the fair queue (1 = next) and the wait told.
    Queued {
        position: u32,
        wait_ms: u64,
    },
    /// A build task given up on `agent` (lost, stalled) and queued again.
    Requeued {
        agent: String,
    },
    /// A pinned image copied into the mirror at its pinned digest: `blobs` copied with `bytes`
    /// (mounted and present blobs not counted), in `millis`.
    Mirrored {
        reference: String,
        bytes: u64,
        blobs: u64,
        millis: u64,
    },
    /// A pinned image the mirror already holds at its digest: nothing copied.
    InMirror {
        reference: String,
    },
    /// A dry run's copy: `reference` would be copied from `from`.
    WouldMirror {
        reference: String,
        from: String,
    },
    /// A kind written by a newer kiln.
    #[serde(other)]
    Unknown,
}

/// A user token as stored: only the hash of its secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRow {
    pub id: String,
    pub hash: String,
    pub user: String,
    pub role: crate::trust::Role,
    pub team: Option<String>,
    pub created_ms: u64,
    pub expires_ms: Option<u64>,
    pub revoked_ms: Option<u64>,
}

/// A one-time join token for an agent, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinRow {
    pub id: String,
    pub hash: String,
    pub role: AgentRole,
    pub cluster: String,
    pub created_ms: u64,
    pub expires_ms: u64,
    pub used_ms: Option<u64>,
}

/// Who owns an instance: its manifest's team, else the user who first converged it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub team: Option<String>,
    pub user: String,
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.team {
            Some(team) => write!(f, "team {team}"),
            None => write!(f, "{}", self.user),
        }
    }
}

/// One line of the audit log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRow {
    pub at_ms: u64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub address: String,
    pub outcome: String,
}

/// What a converge does with one built image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Neither build nor delivery: the target holds it.
    Skip,
    /// No build: deliver what a host holds.
    Deliver,
    Build,
}

impl Action {
    pub fn word(self) -> &'static str {
        match self {
            Action::Skip => "skip",
            Action::Deliver => "deliver",
            Action::Build => "build",
        }
    }
}

/// One event of a converge, numbered from 1 without gaps within its converge.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub seq: u64,
    pub at_ms: u64,
    /// The manifest image this event is about, if any.
    pub image: Option<String>,
    pub kind: EventKind,
    pub message: String,
}

/// An in-flight converge's hold on a ref: a root for every sweep until `expires_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub converge: ConvergeId,
    pub reference: String,
    pub expires_ms: u64,
}

/// A ref every sweep keeps until it is unpinned (`kiln pin`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pin {
    /// Docker's short form of a ref (`x:1`, `reg:5000/a/b@sha256:…`), or an image id `sha256:<hex>`.
    pub reference: String,
    pub pinned_at_ms: u64,
    /// Who asked, as the client said (`user@host`).
    pub pinned_by: String,
}

/// What an agent does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AgentRole {
    /// Builds; holds a host store.
    Host,
    /// Holds a node store.
    Node,
    /// Both at once (the embedded default's host agent on a machine that also runs the images).
    Both,
}

impl AgentRole {
    pub fn name(self) -> &'static str {
        match self {
            AgentRole::Host => "host",
            AgentRole::Node => "node",
            AgentRole::Both => "both",
        }
    }

    pub fn from_name(name: &str) -> Option<AgentRole> {
        match name {
            "host" => Some(AgentRole::Host),
            "node" => Some(AgentRole::Node),
            "both" => Some(AgentRole::Both),
            _ => None,
        }
    }
}

impl fmt::Display for AgentRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An agent as last seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentRow {
    pub id: AgentId,
    pub role: AgentRole,
    /// The stores it manages, by identity.
    pub stores: Vec<String>,
    /// The platforms it builds for, e.g. `linux/amd64`.
    pub platforms: Vec<String>,
    /// The agent's kiln version.
    pub version: String,
    pub last_seen_ms: u64,
}

/// An uploaded context in the index; its bytes are a file named by `digest` elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextRow {
    /// The tree digest, hex.
    pub digest: String,
    /// The archive's size.
    pub bytes: u64,
    pub stored_at_ms: u64,
}

/// A store's last listing, kept as the JSON its lister wrote so the store never needs to know its
/// shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inventory {
    pub store: String,
    pub listing_json: String,
    pub listed_at_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converge_ids_sort_by_start_time() {
        let earlier = ConvergeId::generate(1_700_000_000_000);
        let later = ConvergeId::generate(1_700_000_000_001);
        assert!(earlier < later, "{earlier} should sort before {later}");
        assert_eq!(earlier.as_str().len(), 16);
        assert!(earlier.as_str().bytes().all(|b| CROCKFORD.contains(&b)));
    }

    #[test]
    fn event_kinds_round_trip_through_json() {
        let held = EventKind::Held { reference: "x:1".into(), reason: Some(Reason::Held { converge: "c1".into() }) };
        for kind in [EventKind::Uploaded { bytes: 42 }, EventKind::Built { secs: 0.1 + 0.2 }, held] {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind, "{json}");
        }
        assert_eq!(serde_json::to_string(&EventKind::Pushed { bytes: 7 }).unwrap(), r#"{"kind":"pushed","bytes":7}"#);
    }

    #[test]
    fn events_stored_before_reasons_still_read() {
        let old: EventKind = serde_json::from_str(r#"{"kind":"recorded"}"#).unwrap();
        assert_eq!(old, EventKind::Recorded { reference: String::new(), reason: None });
        let finished: EventKind = serde_json::from_str(r#"{"kind":"finished","succeeded":true}"#).unwrap();
        assert_eq!(finished, EventKind::Finished { succeeded: true, generation: 0 });
        let image: RecordedImage = serde_json::from_str(
            r#"{"name":"web","reference":"w:1","kind":"built","target":"local","context":null,"user":null}"#,
        )
        .unwrap();
        assert_eq!((image.inputs, image.image_id), (None, None));
    }

    #[test]
    fn reasons_read_as_sentences() {
        let change = |input, name: &str, before: &str, after: &str| InputChange {
            input,
            name: name.into(),
            before: before.into(),
            after: after.into(),
            files: None,
        };
        let words = |reason: Reason| reason.words();
        assert_eq!(words(Reason::Recorded), "recorded");
        assert_eq!(words(Reason::FirstBuild), "first build");
        assert_eq!(words(Reason::Forced), "--force");
        assert_eq!(
            words(Reason::Held { converge: "01jabc".into() }),
            "held (built by converge 01jabc, not in the record)"
        );
        assert_eq!(
            words(Reason::Gone { store: "docker@host1".into(), generation: 4 }),
            "gone from docker@host1 since generation 4 (removed outside Kiln)"
        );
        let tree = |c: char| c.to_string().repeat(64);
        assert_eq!(
            words(Reason::Changed { changes: vec![change(Input::Context, "", &tree('9'), &tree('4'))] }),
            "context changed (tree 99999999… → 44444444…)"
        );
        assert_eq!(
            words(Reason::Changed { changes: vec![change(Input::Dockerfile, "", "a", "b")] }),
            "Dockerfile changed"
        );
        assert_eq!(
            words(Reason::Changed { changes: vec![change(Input::BuildArg, "VERSION", "1", "2")] }),
            "build arg VERSION: 1 → 2"
        );
        assert_eq!(
            words(Reason::Changed { changes: vec![change(Input::Target, "", "", "runtime")] }),
            "target stage changed ((none) → runtime)"
        );
        assert_eq!(
            words(Reason::Changed {
                changes: vec![change(Input::Platforms, "", "linux/amd64", "linux/amd64,linux/arm64")]
            }),
            "platforms changed: +arm64"
        );
    }

    #[test]
    fn a_context_change_names_its_files_when_both_entry_lists_were_kept() {
        use kiln_core::digest::diff::{How, Moved};
        use kiln_core::digest::EntryKind;
        let moved = |path: &str, how| Moved { path: path.as_bytes().to_vec(), how };
        let changed = || How::Changed { size_before: 1, size_after: 2 };
        let context = |files: Vec<Moved>| Reason::Changed {
            changes: vec![InputChange {
                input: Input::Context,
                name: String::new(),
                before: "9".repeat(64),
                after: "4".repeat(64),
                files: Some(FilesMoved::of(&files)),
            }],
        };
        let three = vec![
            moved("old.txt", How::Removed(EntryKind::File)),
            moved("src/main.rs", changed()),
            moved("src/new.rs", How::Added(EntryKind::File)),
        ];
        assert_eq!(context(three).words(), "context changed: 3 files (+ src/new.rs, ~ src/main.rs, − old.txt)");
        let one = vec![moved("run.sh", How::ModeChanged { executable: true, content_changed: false })];
        assert_eq!(context(one).words(), "context changed: 1 file (~ run.sh)");
        let many: Vec<Moved> = (0..30).map(|i| moved(&format!("gen/{i:02}.rs"), How::Added(EntryKind::File))).collect();
        let reason = context(many);
        assert_eq!(reason.words(), "context changed: 30 files (+ gen/00.rs, + gen/01.rs, + gen/02.rs, …)");
        let Reason::Changed { changes } = &reason else { unreachable!() };
        let files = changes[0].files.as_ref().unwrap();
        assert_eq!((files.added.count, files.added.paths.len()), (30, FilesMoved::KEPT), "counted all, kept some");
        // Stored in events as JSON, and read back whole.
        let json = serde_json::to_string(&reason).unwrap();
        assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), reason);
    }

    #[test]
    fn an_event_kind_from_a_newer_kiln_reads_as_unknown() {
        let kind: EventKind = serde_json::from_str(r#"{"kind":"teleported","meters":3}"#).unwrap();
        assert_eq!(kind, EventKind::Unknown);
    }
}
