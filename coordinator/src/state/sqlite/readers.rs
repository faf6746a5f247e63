//! Reads on connections of their own, beside the writer's.
//!
//! Why: the writer answers a call only once the group holding it has committed, so a read sent
//! to it waited for a commit's fsync and for every call queued ahead of it. Under a farm's burst
//! of converges that was a no-op converge's record read waiting 160 ms behind event writes it
//! has nothing to do with, and every token check of every call waiting the same way. In WAL mode
//! a reader never waits for the writer and sees exactly what had committed when its transaction
//! began; since the writer answers only after committing, a read made after a write was answered
//! sees that write.
//!
//! Each read runs in a transaction of its own (a consistent snapshot across its statements) on a
//! `query_only` connection, on the blocking pool. At most [`READERS`] run at once; idle
//! connections are kept for the next read, so a read costs no open once the pool is warm.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use rusqlite::Connection;
use tokio::sync::Semaphore;

use super::Cached;
use crate::state::StateError;

/// Reads at once: more only queue on two cores' worth of SQLite; fewer would make a sweep's
/// listing hold up a token check.
pub(super) const READERS: usize = 4;

pub(super) struct Readers {
    path: PathBuf,
    busy_timeout: std::time::Duration,
    permits: Semaphore,
    idle: Mutex<Vec<Connection>>,
}

impl Readers {
    pub(super) fn new(path: PathBuf, busy_timeout: std::time::Duration) -> Readers {
        Readers { path, busy_timeout, permits: Semaphore::new(READERS), idle: Mutex::new(Vec::new()) }
    }

    /// Runs `f` in a read transaction on a reader connection. `what` names the call in errors.
    pub(super) async fn read<T, F>(&self, what: String, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StateError> + Send + 'static,
    {
        let stopped = || StateError::Writer { what: what.clone() };
        let _permit = self.permits.acquire().await.map_err(|_| stopped())?;
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let (path, busy_timeout) = (self.path.clone(), self.busy_timeout);
        let named = what.clone();
        let ran = tokio::task::spawn_blocking(move || {
            let mut conn = match idle {
                Some(conn) => conn,
                None => open(&path, busy_timeout).map_err(|err| backend(&named, err))?,
            };
            let result = in_read(&mut conn, &named, f);
            Ok::<_, StateError>((conn, result))
        })
        .await
        .map_err(|_| StateError::Writer { what: format!("{what} (the read panicked)") })?;
        let (conn, result) = ran?;
        // A connection whose read failed may be mid-transaction or broken: not kept.
        if result.is_ok() {
            self.idle.lock().unwrap_or_else(PoisonError::into_inner).push(conn);
        }
        result
    }
}

fn open(path: &std::path::Path, busy_timeout: std::time::Duration) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(busy_timeout)?;
    conn.set_prepared_statement_cache_capacity(super::STATEMENT_CACHE);
    // A reader that tried to write would bypass the writer's group and its order: refused here.
    conn.pragma_update(None, "query_only", true)?;
    Ok(conn)
}

fn backend(what: &str, err: rusqlite::Error) -> StateError {
    StateError::Backend { what: what.to_owned(), err: Box::new(err) }
}

/// `f` in a deferred transaction: its statements read one snapshot. Always rolled back — it
/// wrote nothing — which also ends it when `f` failed or panicked.
fn in_read<T>(
    conn: &mut Connection,
    what: &str,
    f: impl FnOnce(&mut Connection) -> Result<T, StateError>,
) -> Result<T, StateError> {
    conn.exec("BEGIN DEFERRED", []).map_err(|err| backend(what, err))?;
    let result = match catch_unwind(AssertUnwindSafe(|| f(conn))) {
        Ok(result) => result,
        Err(_) => Err(StateError::Writer { what: format!("{what} (the read panicked)") }),
    };
    conn.exec("ROLLBACK", []).map_err(|err| backend(what, err))?;
    result
}
