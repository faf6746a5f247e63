//! The coordinator's state as domain types: agents, records by generation, converges and their
//! events, claims, the context index and store inventories. These are what the [`crate::store::Store`]
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
    /// Skipped build and delivery: the current record names this ref and this target.
    Recorded,
    /// Skipped build: an image labeled by this farm already wears the tag.
    Held,
    Uploaded {
        bytes: u64,
    },
    Building,
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
    /// A kind written by a newer kiln.
    #[serde(other)]
    Unknown,
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
        for kind in [EventKind::Uploaded { bytes: 42 }, EventKind::Built { secs: 0.1 + 0.2 }, EventKind::Held] {
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(serde_json::from_str::<EventKind>(&json).unwrap(), kind, "{json}");
        }
        assert_eq!(serde_json::to_string(&EventKind::Pushed { bytes: 7 }).unwrap(), r#"{"kind":"pushed","bytes":7}"#);
    }

    #[test]
    fn an_event_kind_from_a_newer_kiln_reads_as_unknown() {
        let kind: EventKind = serde_json::from_str(r#"{"kind":"teleported","meters":3}"#).unwrap();
        assert_eq!(kind, EventKind::Unknown);
    }
}
