//! Group commit: one thread owns the connection and runs every call, and the calls that queued
//! while a commit was being synced to disk go into the next transaction together, each in a
//! savepoint of its own. A call's answer is sent only after the transaction holding it committed.
//!
//! Why: with `synchronous = FULL` (the default, and what a record of what every owner converged
//! deserves) every commit is an fsync, about 2 ms on these disks. A farm's 200 concurrent
//! converges make thousands of small writes; one transaction each queued them behind each other
//! for seconds, and every read (a no-op `kiln up`'s) waited in the same queue. Grouped, one fsync
//! covers every write that arrived meanwhile, and durability is unchanged: nobody hears "done"
//! before the disk has it.
//!
//! A call that fails rolls back to its own savepoint and leaves the others in the group alone; a
//! panic does the same. A commit that fails fails every call of the group.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use rusqlite::{Connection, ErrorCode};

use super::Cached;
use crate::state::{Clock, StateError};

/// Why a group's transaction did not commit; every call of the group hears it.
#[derive(Clone, Debug)]
struct GroupFailure {
    /// Another process held the write lock past the busy timeout.
    busy: bool,
    why: String,
}

/// What the writer does once the group's transaction ended: `Ok` when it committed.
type Finish = Box<dyn FnOnce(Result<(), GroupFailure>) + Send>;
/// A call: run on the connection (`None`: its group could not begin, and it is not run).
type Job = Box<dyn for<'c> FnOnce(Option<(&'c mut Connection, u64)>) -> Finish + Send>;

/// The most calls one transaction takes: bounds how long the first of them waits for its answer.
pub(super) const GROUP: usize = 256;

/// The connection's thread, fed through a channel; it stops when the store is dropped.
pub(super) struct Writer {
    jobs: Option<mpsc::Sender<Job>>,
    /// Transactions begun: fewer than the calls when calls share them.
    begun: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
    path: PathBuf,
}

impl Drop for Writer {
    /// Waits for the thread to close the connection: the file may be deleted and made anew right
    /// after (a test wiping its state), and a connection closing late would checkpoint into, or
    /// delete, the new file's WAL.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        tracing::debug!(path = %self.path.display(), transactions = self.begun.load(Ordering::Relaxed), "state writer stopped");
    }
}

impl Writer {
    /// `group`: the most calls one transaction takes (1: a transaction per call, the baseline
    /// `kiln-bench state-writes` compares with).
    pub(super) fn start(
        conn: Connection,
        clock: Arc<dyn Clock>,
        path: PathBuf,
        group: usize,
    ) -> std::io::Result<Writer> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let begun = Arc::new(AtomicU64::new(0));
        let counter = begun.clone();
        let thread = std::thread::Builder::new()
            .name("kiln-sqlite".into())
            .spawn(move || work(conn, clock, queue, &counter, group.max(1)))?;
        Ok(Writer { jobs: Some(jobs), begun, thread: Some(thread), path })
    }

    /// How many transactions the writer began so far.
    #[cfg(test)]
    fn begun(&self) -> u64 {
        self.begun.load(Ordering::Relaxed)
    }

    /// Runs `f` with the connection and the clock's now, inside the next group's transaction.
    pub(super) async fn run<T, F>(&self, what: String, f: F) -> Result<T, StateError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, u64) -> Result<T, StateError> + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let gone = what.clone();
        let path = self.path.clone();
        let job: Job = Box::new(move |conn| {
            let result = conn.map(|(conn, now_ms)| in_savepoint(conn, &what, |conn| f(conn, now_ms)));
            Box::new(move |committed| {
                let result = match (result, committed) {
                    (Some(Err(err)), _) => Err(err),
                    (Some(Ok(value)), Ok(())) => Ok(value),
                    (_, Err(GroupFailure { busy: true, why })) => Err(StateError::Busy { path, what, err: why.into() }),
                    (_, Err(GroupFailure { why, .. })) => Err(StateError::Backend { what, err: why.into() }),
                    (None, Ok(())) => Err(StateError::Writer { what }),
                };
                let _ = answer.send(result);
            })
        });
        let stopped = || StateError::Writer { what: gone.clone() };
        self.jobs.as_ref().ok_or_else(stopped)?.send(job).map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }
}

fn work(mut conn: Connection, clock: Arc<dyn Clock>, queue: mpsc::Receiver<Job>, begun: &AtomicU64, most: usize) {
    while let Ok(first) = queue.recv() {
        let group: Vec<Job> = std::iter::once(first).chain(queue.try_iter().take(most - 1)).collect();
        begun.fetch_add(1, Ordering::Relaxed);
        let committed = match conn.exec("BEGIN IMMEDIATE", []) {
            Err(err) => Err(failure(&err, "could not begin a transaction")),
            Ok(_) => {
                let now_ms = clock.now_ms();
                let finishes: Vec<Finish> = group.into_iter().map(|job| job(Some((&mut conn, now_ms)))).collect();
                let committed = conn.exec("COMMIT", []).map(|_| ()).map_err(|err| {
                    let _ = conn.execute_batch("ROLLBACK");
                    failure(&err, "the transaction failed to commit")
                });
                for finish in finishes {
                    finish(committed.clone());
                }
                continue;
            }
        };
        for job in group {
            job(None)(committed.clone());
        }
    }
}

fn failure(err: &rusqlite::Error, doing: &str) -> GroupFailure {
    let code = err.sqlite_error_code();
    GroupFailure {
        busy: matches!(code, Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)),
        why: format!("{doing}: {err}"),
    }
}

/// Runs `f` in a savepoint of its own: released when it succeeds, rolled back when it fails or
/// panics, so one call's failure never undoes or leaks into another call of its group.
fn in_savepoint<T>(
    conn: &mut Connection,
    what: &str,
    f: impl FnOnce(&mut Connection) -> Result<T, StateError>,
) -> Result<T, StateError> {
    let backend = |err: rusqlite::Error| StateError::Backend { what: what.to_owned(), err: Box::new(err) };
    conn.exec("SAVEPOINT kiln_call", []).map_err(backend)?;
    let result = match catch_unwind(AssertUnwindSafe(|| f(conn))) {
        Ok(result) => result,
        Err(_) => Err(StateError::Writer { what: format!("{what} (the call panicked)") }),
    };
    if result.is_err() {
        conn.exec("ROLLBACK TO kiln_call", []).map_err(backend)?;
    }
    conn.exec("RELEASE kiln_call", []).map_err(backend)?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::SystemClock;

    fn writer(dir: &std::path::Path) -> Writer {
        let path = dir.join("w.db");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA journal_mode = wal; CREATE TABLE t (v INTEGER)").unwrap();
        Writer::start(conn, Arc::new(SystemClock), path, GROUP).unwrap()
    }

    fn insert(v: i64) -> impl FnOnce(&mut Connection, u64) -> Result<(), StateError> {
        move |c, _| {
            c.execute("INSERT INTO t (v) VALUES (?1)", [v])
                .map(drop)
                .map_err(|e| StateError::Backend { what: format!("inserting {v}"), err: Box::new(e) })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_queued_behind_a_transaction_share_the_next_and_a_failing_one_undoes_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let writer = Arc::new(writer(dir.path()));
        // The first call holds the writer's thread until every other call is queued behind it.
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let holding = {
            let writer = writer.clone();
            tokio::spawn(async move { writer.run("holding".into(), move |_, _| Ok(wait.recv().is_ok())).await })
        };
        let mut calls = tokio::task::JoinSet::new();
        for v in 0..20i64 {
            let writer = writer.clone();
            calls.spawn(async move {
                let result = writer
                    .run(format!("call {v}"), move |c, now| {
                        insert(v)(c, now)?;
                        // Call 7 wrote its row, then failed: its row must go, the others' stay.
                        match v {
                            7 => Err(StateError::Writer { what: "call 7 fails on purpose".into() }),
                            _ => Ok(()),
                        }
                    })
                    .await;
                (v, result.is_ok())
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        go.send(()).unwrap();
        assert!(holding.await.unwrap().unwrap(), "the holder was let go");
        let mut ok: Vec<(i64, bool)> = calls.join_all().await;
        ok.sort();
        assert!(ok.iter().all(|(v, ok)| *ok == (*v != 7)), "{ok:?}");

        let rows = writer
            .run("reading".into(), |c, _| {
                let mut stmt = c.prepare("SELECT v FROM t ORDER BY v").unwrap();
                let rows = stmt.query_map([], |r| r.get::<_, i64>(0)).unwrap();
                Ok(rows.map(Result::unwrap).collect::<Vec<i64>>())
            })
            .await
            .unwrap();
        let expected: Vec<i64> = (0..20).filter(|v| *v != 7).collect();
        assert_eq!(rows, expected);
        // 22 calls (the holder, 20 writers, the reader): one transaction each would be 22.
        assert!(writer.begun() < 22, "calls that queued together committed together: {} transactions", writer.begun());
    }

    #[tokio::test]
    async fn a_panicking_call_is_an_error_and_the_writer_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let writer = writer(dir.path());
        let panicked = writer.run("panicking".into(), |c, now| -> Result<(), StateError> {
            insert(1)(c, now)?;
            panic!("on purpose")
        });
        assert!(matches!(panicked.await, Err(StateError::Writer { .. })));
        writer.run("inserting 2".into(), insert(2)).await.unwrap();
        let count = writer
            .run("counting".into(), |c, _| {
                Ok(c.query_row("SELECT count(*), sum(v) FROM t", [], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?))
                })
                .unwrap())
            })
            .await
            .unwrap();
        assert_eq!(count, (1, 2), "the panicking call's row was rolled back");
    }
}
