//! The schema, as an ordered list of migrations. Each is applied in its own transaction together with
//! its `schema_migrations` row, so a crash mid-migration leaves the database at the version before it.
//! A database at a version this code does not know is refused: an older kiln writing rows a newer
//! schema interprets differently would corrupt state silently.
//!
//! PostgreSQL keeps its own list (`../postgres/migrations.rs`: its types, JSONB, the leader lease),
//! so a new table or column is a migration in each.

use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::state::StateError;

/// Versions in order, starting at 1, never edited once released: a change is a new entry.
const MIGRATIONS: &[(u32, &str)] = &[(1, V1), (2, V2), (3, V3), (4, V4)];

/// The newest schema version this code knows.
pub const SCHEMA_VERSION: u32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

const V1: &str = r#"
CREATE TABLE agents (
    id           TEXT PRIMARY KEY,
    role         TEXT NOT NULL,
    stores       TEXT NOT NULL,   -- JSON array of store identities
    platforms    TEXT NOT NULL,   -- JSON array
    version      TEXT NOT NULL,
    last_seen_ms INTEGER NOT NULL
);

-- The highest generation ever written per instance, kept across `kiln down` so numbers never repeat.
CREATE TABLE instance_generations (
    instance        TEXT PRIMARY KEY,
    last_generation INTEGER NOT NULL
);

CREATE TABLE records (
    instance      TEXT NOT NULL REFERENCES instance_generations (instance),
    generation    INTEGER NOT NULL,
    images        TEXT NOT NULL,  -- JSON array of recorded images
    written_at_ms INTEGER NOT NULL,
    PRIMARY KEY (instance, generation)
);

CREATE TABLE converges (
    id           TEXT PRIMARY KEY,
    instance     TEXT NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('running', 'succeeded', 'failed')),
    reason       TEXT,
    started_ms   INTEGER NOT NULL,
    finished_ms  INTEGER,
    requested_by TEXT NOT NULL
);
-- The database itself refuses a second running converge of one instance, whatever process asks.
CREATE UNIQUE INDEX converges_one_running ON converges (instance) WHERE state = 'running';
CREATE INDEX converges_by_start ON converges (started_ms);
CREATE INDEX converges_by_instance ON converges (instance, started_ms);

CREATE TABLE events (
    converge_id TEXT NOT NULL REFERENCES converges (id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL,
    at_ms       INTEGER NOT NULL,
    image       TEXT,
    kind        TEXT NOT NULL,    -- JSON, so a new kind needs no migration
    message     TEXT NOT NULL,
    PRIMARY KEY (converge_id, seq)
);

CREATE TABLE claims (
    converge_id TEXT NOT NULL REFERENCES converges (id) ON DELETE CASCADE,
    reference   TEXT NOT NULL,
    expires_ms  INTEGER NOT NULL,
    PRIMARY KEY (converge_id, reference)
);
CREATE INDEX claims_by_expiry ON claims (expires_ms);

CREATE TABLE contexts (
    digest       TEXT PRIMARY KEY,
    bytes        INTEGER NOT NULL,
    stored_at_ms INTEGER NOT NULL
);

CREATE TABLE inventories (
    store     TEXT PRIMARY KEY,
    listing   TEXT NOT NULL,
    listed_ms INTEGER NOT NULL
);
"#;

// Pins (`kiln pin <ref>`): refs every sweep keeps until they are unpinned. Stored in one spelling
// (Docker's short form, or an image id), so unpinning `docker.io/library/x` finds the pin `x`.
const V2: &str = r#"
CREATE TABLE pins (
    reference    TEXT PRIMARY KEY,
    pinned_at_ms INTEGER NOT NULL,
    pinned_by    TEXT NOT NULL
);
"#;

// Trust (DESIGN.md "Trust"): user tokens and agents' join tokens, kept as hashes of their
// secrets; revoked agents; who owns each instance; the audit log of every mutating call.
const V3: &str = r#"
CREATE TABLE tokens (
    id         TEXT PRIMARY KEY,
    hash       TEXT NOT NULL,
    user_name  TEXT NOT NULL,
    role       TEXT NOT NULL CHECK (role IN ('admin', 'member', 'viewer')),
    team       TEXT,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER,
    revoked_ms INTEGER
);

CREATE TABLE join_tokens (
    id         TEXT PRIMARY KEY,
    hash       TEXT NOT NULL,
    role       TEXT NOT NULL,
    cluster    TEXT NOT NULL,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    used_ms    INTEGER
);

CREATE TABLE revoked_agents (
    id         TEXT PRIMARY KEY,
    revoked_ms INTEGER NOT NULL
);

-- The first converge of an instance sets its owner: its manifest's team, else its user.
CREATE TABLE owners (
    instance  TEXT PRIMARY KEY,
    team      TEXT,
    user_name TEXT NOT NULL
);

CREATE TABLE audit (
    seq     INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms   INTEGER NOT NULL,
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,
    address TEXT NOT NULL,
    outcome TEXT NOT NULL
);
CREATE INDEX audit_by_time ON audit (at_ms);
"#;

// Entry lists of stored contexts (their canonical streams), so "context changed" can name the files
// that moved. A table of their own: listing and collecting contexts never reads them.
const V4: &str = r#"
CREATE TABLE context_entries (
    digest TEXT PRIMARY KEY,
    stream BLOB NOT NULL
);
"#;

/// Brings the database to [`SCHEMA_VERSION`]; returns the versions this call applied.
pub(super) fn migrate(conn: &mut Connection, path: &Path, now_ms: u64) -> Result<Vec<u32>, StateError> {
    let open_err = |err: rusqlite::Error| StateError::Open { path: path.to_owned(), err: Box::new(err) };
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at INTEGER NOT NULL)",
    )
    .map_err(open_err)?;

    let mut applied = Vec::new();
    for &(version, sql) in MIGRATIONS {
        // The version is re-read inside the write transaction: two processes opening one fresh
        // database at once must not both apply the same migration.
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(open_err)?;
        let current = current_version(&tx).map_err(open_err)?;
        if current > SCHEMA_VERSION {
            let database = path.display().to_string();
            return Err(StateError::SchemaTooNew { database, found: current, known: SCHEMA_VERSION });
        }
        if current >= version {
            continue;
        }
        let migrate_err = |err: rusqlite::Error| StateError::Migrate {
            database: path.display().to_string(),
            version,
            from: current,
            err: Box::new(err),
        };
        tx.execute_batch(sql).map_err(migrate_err)?;
        tx.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?1, ?2)", (version, now_ms))
            .map_err(migrate_err)?;
        tx.commit().map_err(migrate_err)?;
        applied.push(version);
    }
    Ok(applied)
}

fn current_version(conn: &Connection) -> rusqlite::Result<u32> {
    let version: Option<u32> = conn.query_row("SELECT MAX(version) FROM schema_migrations", [], |row| row.get(0))?;
    Ok(version.unwrap_or(0))
}
