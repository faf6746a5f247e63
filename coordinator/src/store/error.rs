//! Why a store call failed. Every variant names the object (file, instance, converge) and, when one
//! is known, the fix; the backend's own error is kept as the source, boxed, so the trait carries no
//! SQLite or PostgreSQL type.

use std::path::PathBuf;

use crate::model::{ConvergeId, ConvergeState, Generation};

/// A backend's error, kept only as a source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
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
    #[error("cannot apply schema migration {version} to the state database {path}; it was left at version {from}")]
    Migrate {
        path: PathBuf,
        version: u32,
        from: u32,
        #[source]
        err: BoxError,
    },
    #[error(
        "state database {path} is at schema version {found}, but this kiln knows versions up to {known} — \
         a newer kiln wrote it; upgrade kiln (an older one must not open it)"
    )]
    SchemaTooNew { path: PathBuf, found: u32, known: u32 },
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
    #[error("the state store's worker thread stopped while {what}")]
    Worker {
        what: String,
        #[source]
        err: tokio::task::JoinError,
    },
}

fn generation_text(generation: &Option<Generation>) -> String {
    match generation {
        Some(g) => format!("generation {g}"),
        None => "no record".to_owned(),
    }
}
