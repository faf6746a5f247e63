//! Why a store call failed. Every variant names the object (file, instance, converge) and, when one
//! is known, the fix; the backend's own error is kept as the source, boxed, so the trait carries no
//! SQLite or PostgreSQL type.

use std::path::PathBuf;

use crate::model::{ConvergeId, ConvergeState, Generation};

/// A backend's error, kept only as a source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot create the state directory {dir} — check that its parent exists and is writable")]
    CreateDir {
        dir: PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("cannot open the state database {path} — check that it is a kiln state file and that it is writable")]
    Open {
        path: PathBuf,
        #[source]
        err: BoxError,
    },
    /// `database` is the SQLite file or the PostgreSQL URL without its password.
    #[error("cannot apply schema migration {version} to the state database {database}; it was left at version {from}")]
    Migrate {
        database: String,
        version: u32,
        from: u32,
        #[source]
        err: BoxError,
    },
    #[error(
        "state database {database} is at schema version {found}, but this kiln knows versions up to {known} — \
         a newer kiln wrote it; upgrade kiln (an older one must not open it)"
    )]
    SchemaTooNew { database: String, found: u32, known: u32 },
    // The URL itself is not repeated: it may hold a password.
    #[error(
        "the state database URL is not a PostgreSQL connection string \
         (postgres://user:password@host:port/database) — check --state"
    )]
    DatabaseUrl {
        #[source]
        err: BoxError,
    },
    #[error(
        "cannot reach the PostgreSQL state database {database} while {what} — check that the server runs \
         and that the URL's host, port, user, password and database name are right"
    )]
    Unreachable {
        database: String,
        what: String,
        #[source]
        err: BoxError,
    },
    #[error("state database {path} stayed locked by another process while {what} — retry once the other kiln is done")]
    Busy {
        path: PathBuf,
        what: String,
        #[source]
        err: BoxError,
    },
    #[error("state store failed while {what}")]
    Backend {
        what: String,
        #[source]
        err: BoxError,
    },
    #[error("state store row {what} is unreadable — it was written by a newer kiln or edited by hand; upgrade kiln")]
    Corrupt {
        what: String,
        #[source]
        err: BoxError,
    },
    #[error(
        "the record of instance {instance} moved while this converge ran (it started from {}, the record is now at {}) \
         — nothing was recorded; run `kiln up` again to converge from the new record",
        generation_text(.expected),
        generation_text(.actual)
    )]
    RecordMoved { instance: String, expected: Option<Generation>, actual: Option<Generation> },
    #[error(
        "instance {instance} already has converge {running} running — wait for it to finish, \
         or watch it with `kiln logs {running}`"
    )]
    ConvergeRunning { instance: String, running: ConvergeId },
    #[error("no converge {id} is known to this state store")]
    UnknownConverge { id: ConvergeId },
    #[error("converge {id} has already finished ({state}); it can no longer claim refs or finish again")]
    ConvergeFinished { id: ConvergeId, state: ConvergeState },
    #[error("converge {id} cannot be finished as running — finish it as succeeded or failed")]
    FinishAsRunning { id: ConvergeId },
    #[error(
        "this coordinator ({holder}) lost the farm's leadership: its fencing token {token} was superseded by \
         token {current}{} — nothing was written; it must stand by until it leads again",
        active_text(.active)
    )]
    Fenced { holder: String, token: u64, current: u64, active: Option<String> },
    #[error(
        "this coordinator is not the farm's active coordinator{} — send the request there; a standby \
         writes nothing",
        active_text(.active)
    )]
    NotLeader { active: Option<String> },
    #[error("the state store's writer stopped while {what}")]
    Writer { what: String },
}

fn generation_text(generation: &Option<Generation>) -> String {
    match generation {
        Some(g) => format!("generation {g}"),
        None => "no record".to_owned(),
    }
}

/// Who leads instead, for [`StateError::Fenced`] and [`StateError::NotLeader`].
fn active_text(active: &Option<String>) -> String {
    match active {
        Some(addr) => format!(" (the active coordinator is at {addr})"),
        None => " (no coordinator holds the lease right now; a standby takes it over when it lapses)".to_owned(),
    }
}
