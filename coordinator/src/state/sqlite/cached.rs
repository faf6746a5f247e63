//! The SQLite state's statements, prepared once per connection, and a savepoint that uses them.

use rusqlite::Connection;

/// Statements kept prepared per connection, by their text (rusqlite's statement cache). Under a
/// farm's burst, parsing the same few dozen statements on every call was a tenth of the
/// coordinator's CPU (`sqlite3Prepare` in a `perf record` of `kiln-bench farm --external`).
pub(crate) trait Cached {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize>;
    fn one_row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>;
    /// A savepoint inside the call's own: its statements land together or not at all.
    fn nested(&self) -> rusqlite::Result<Nested<'_>>;
}

impl Cached for Connection {
    fn exec<P: rusqlite::Params>(&self, sql: &str, params: P) -> rusqlite::Result<usize> {
        self.prepare_cached(sql)?.execute(params)
    }

    fn one_row<T, P, F>(&self, sql: &str, params: P, f: F) -> rusqlite::Result<T>
    where
        P: rusqlite::Params,
        F: FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    {
        self.prepare_cached(sql)?.query_row(params, f)
    }

    fn nested(&self) -> rusqlite::Result<Nested<'_>> {
        self.exec("SAVEPOINT kiln_nested", [])?;
        Ok(Nested { conn: self, done: false })
    }
}

/// rusqlite's `Savepoint`, with its statements cached: released by `commit`, rolled back when
/// dropped without it (an early `?` return).
pub(crate) struct Nested<'c> {
    conn: &'c Connection,
    done: bool,
}

impl Nested<'_> {
    pub(crate) fn commit(mut self) -> rusqlite::Result<()> {
        self.done = true;
        self.conn.exec("RELEASE kiln_nested", []).map(|_| ())
    }
}

impl std::ops::Deref for Nested<'_> {
    type Target = Connection;
    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl Drop for Nested<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.conn.exec("ROLLBACK TO kiln_nested", []);
            let _ = self.conn.exec("RELEASE kiln_nested", []);
        }
    }
}

/// How many statements each connection keeps prepared: more than the store has, so none is
/// ever parsed twice.
pub(crate) const STATEMENT_CACHE: usize = 128;

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch("CREATE TABLE t (v INTEGER)").unwrap();
        conn
    }

    fn count(conn: &Connection) -> i64 {
        conn.one_row("SELECT COUNT(*) FROM t", [], |row| row.get(0)).unwrap()
    }

    #[test]
    fn a_nested_savepoint_keeps_its_writes_only_when_committed() {
        let conn = table();
        {
            let tx = conn.nested().unwrap();
            tx.exec("INSERT INTO t (v) VALUES (?1)", [1]).unwrap();
            // Dropped without `commit`: an early `?` return.
        }
        assert_eq!(count(&conn), 0, "a dropped savepoint rolls its writes back");
        let tx = conn.nested().unwrap();
        tx.exec("INSERT INTO t (v) VALUES (?1)", [2]).unwrap();
        tx.commit().unwrap();
        assert_eq!(count(&conn), 1, "a committed savepoint keeps its writes");
        assert!(conn.is_autocommit(), "no savepoint is left open");
    }

    #[test]
    fn one_nested_inside_another_rolls_back_alone() {
        let conn = table();
        let outer = conn.nested().unwrap();
        outer.exec("INSERT INTO t (v) VALUES (?1)", [1]).unwrap();
        {
            let inner = outer.nested().unwrap();
            inner.exec("INSERT INTO t (v) VALUES (?1)", [2]).unwrap();
        }
        outer.commit().unwrap();
        assert_eq!(count(&conn), 1, "the outer write stays, the inner one went");
        assert!(conn.is_autocommit());
    }
}
