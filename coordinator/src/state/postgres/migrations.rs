//! The PostgreSQL schema, as an ordered list of migrations, under the SQLite store's rules: each is
//! applied in its own transaction together with its `schema_migrations` row (PostgreSQL's DDL is
//! transactional, so a crash mid-migration leaves the version before it), and a database at a
//! version this code does not know is refused. Several coordinators may start at once against a
//! fresh database: a transaction-scoped advisory lock makes them migrate one after another.
//!
//! Types: milliseconds and counters are `BIGINT`; what the model stores as JSON is `JSONB`, so a
//! field added to `RecordedImage` or a new event kind needs no migration. An inventory's listing
//! is `JSON`, which keeps the lister's text byte for byte. Text sorts use `COLLATE "C"` in the
//! queries, so listings come back in byte order as on SQLite, whatever the database's locale.

use deadpool_postgres::Object;

use crate::state::StateError;

/// Versions in order, starting at 1, never edited once released: a change is a new entry.
const MIGRATIONS: &[(u32, &str)] = &[(1, V1), (2, V2), (3, V3)];

/// The newest schema version this code knows.
pub const SCHEMA_VERSION: u32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// Any fixed number: every kiln migrating this database takes the same lock.
const MIGRATION_LOCK: i64 = 0x6b69_6c6e_5f6d_6967; // "kiln_mig"

// Version 1 is SQLite's versions 1 and 2 (pins) plus what a farm needs: the converge's event
// counter (`last_seq`, so concurrent appends serialize on the converge's row) and the lease.
const V1: &str = r#"
CREATE TABLE agents (
    id           TEXT PRIMARY KEY,
    role         TEXT NOT NULL,
    stores       JSONB NOT NULL,
    platforms    JSONB NOT NULL,
    version      TEXT NOT NULL,
    last_seen_ms BIGINT NOT NULL
);

-- The highest generation ever written per instance, kept across `kiln down` so numbers never
-- repeat; its row is the lock a record's compare-and-set takes.
CREATE TABLE instance_generations (
    instance        TEXT PRIMARY KEY,
    last_generation BIGINT NOT NULL
);

CREATE TABLE records (
    instance      TEXT NOT NULL REFERENCES instance_generations (instance),
    generation    BIGINT NOT NULL,
    images        JSONB NOT NULL,
    written_at_ms BIGINT NOT NULL,
    PRIMARY KEY (instance, generation)
);

CREATE TABLE converges (
    id           TEXT PRIMARY KEY,
    instance     TEXT NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('running', 'succeeded', 'failed')),
    reason       TEXT,
    started_ms   BIGINT NOT NULL,
    finished_ms  BIGINT,
    requested_by TEXT NOT NULL,
    last_seq     BIGINT NOT NULL DEFAULT 0
);
-- The database itself refuses a second running converge of one instance, whichever coordinator asks.
CREATE UNIQUE INDEX converges_one_running ON converges (instance) WHERE state = 'running';
CREATE INDEX converges_by_start ON converges (started_ms);
CREATE INDEX converges_by_instance ON converges (instance, started_ms);

CREATE TABLE events (
    converge_id TEXT NOT NULL REFERENCES converges (id) ON DELETE CASCADE,
    seq         BIGINT NOT NULL,
    at_ms       BIGINT NOT NULL,
    image       TEXT,
    kind        JSONB NOT NULL,
    message     TEXT NOT NULL,
    PRIMARY KEY (converge_id, seq)
);
-- Which converge built a ref ("held (built by converge X)"): only `building` events are indexed.
CREATE INDEX events_building ON events ((kind->>'reference'), at_ms) WHERE kind->>'kind' = 'building';

CREATE TABLE claims (
    converge_id TEXT NOT NULL REFERENCES converges (id) ON DELETE CASCADE,
    reference   TEXT NOT NULL,
    expires_ms  BIGINT NOT NULL,
    PRIMARY KEY (converge_id, reference)
);
CREATE INDEX claims_by_expiry ON claims (expires_ms);

CREATE TABLE contexts (
    digest       TEXT PRIMARY KEY,
    bytes        BIGINT NOT NULL,
    stored_at_ms BIGINT NOT NULL
);

CREATE TABLE inventories (
    store     TEXT PRIMARY KEY,
    listing   JSON NOT NULL,
    listed_ms BIGINT NOT NULL
);

CREATE TABLE pins (
    reference    TEXT PRIMARY KEY,
    pinned_at_ms BIGINT NOT NULL,
    pinned_by    TEXT NOT NULL
);

-- The farm's leadership: exactly one row. Token 0 is "never led"; each acquisition adds one.
CREATE TABLE leader_lease (
    one         BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (one),
    token       BIGINT NOT NULL,
    holder      TEXT NOT NULL,
    addr        TEXT NOT NULL,
    acquired_at TIMESTAMPTZ NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL
);
INSERT INTO leader_lease (token, holder, addr, acquired_at, expires_at)
    VALUES (0, '', '', to_timestamp(0), to_timestamp(0));
"#;

// Trust (DESIGN.md "Trust"): the same tables as SQLite's version 3.
const V2: &str = r#"
CREATE TABLE tokens (
    id         TEXT PRIMARY KEY,
    hash       TEXT NOT NULL,
    user_name  TEXT NOT NULL,
    role       TEXT NOT NULL CHECK (role IN ('admin', 'member', 'viewer')),
    team       TEXT,
    created_ms BIGINT NOT NULL,
    expires_ms BIGINT,
    revoked_ms BIGINT
);

CREATE TABLE join_tokens (
    id         TEXT PRIMARY KEY,
    hash       TEXT NOT NULL,
    role       TEXT NOT NULL,
    cluster    TEXT NOT NULL,
    created_ms BIGINT NOT NULL,
    expires_ms BIGINT NOT NULL,
    used_ms    BIGINT
);

CREATE TABLE revoked_agents (
    id         TEXT PRIMARY KEY,
    revoked_ms BIGINT NOT NULL
);

CREATE TABLE owners (
    instance  TEXT PRIMARY KEY,
    team      TEXT,
    user_name TEXT NOT NULL
);

CREATE TABLE audit (
    seq     BIGSERIAL PRIMARY KEY,
    at_ms   BIGINT NOT NULL,
    actor   TEXT NOT NULL,
    action  TEXT NOT NULL,
    target  TEXT NOT NULL,
    address TEXT NOT NULL,
    outcome TEXT NOT NULL
);
CREATE INDEX audit_by_time ON audit (at_ms);
"#;

// Entry lists of stored contexts: SQLite's version 4.
const V3: &str = r#"
CREATE TABLE context_entries (
    digest TEXT PRIMARY KEY,
    stream BYTEA NOT NULL
);
"#;

/// Brings the database to [`SCHEMA_VERSION`]; returns the versions this call applied.
pub(super) async fn migrate(client: &mut Object, database: &str, now_ms: u64) -> Result<Vec<u32>, StateError> {
    let mut applied = Vec::new();
    for &(version, sql) in MIGRATIONS {
        let open_err = |err: tokio_postgres::Error| StateError::Backend {
            what: format!("reading the schema version of {database}"),
            err: Box::new(err),
        };
        let tx = client.transaction().await.map_err(open_err)?;
        // The version is re-read under the lock: two coordinators starting on one fresh database
        // must not both apply the same migration.
        tx.batch_execute(&format!(
            "SET LOCAL client_min_messages = warning; SELECT pg_advisory_xact_lock({MIGRATION_LOCK}); \
             CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at BIGINT NOT NULL)"
        ))
        .await
        .map_err(open_err)?;
        let current: Option<i32> =
            tx.query_one("SELECT MAX(version) FROM schema_migrations", &[]).await.map_err(open_err)?.get(0);
        let current = current.map_or(0, |v| v as u32);
        if current > SCHEMA_VERSION {
            return Err(StateError::SchemaTooNew {
                database: database.to_owned(),
                found: current,
                known: SCHEMA_VERSION,
            });
        }
        if current >= version {
            continue;
        }
        let migrate_err = |err: tokio_postgres::Error| StateError::Migrate {
            database: database.to_owned(),
            version,
            from: current,
            err: Box::new(err),
        };
        tx.batch_execute(sql).await.map_err(migrate_err)?;
        tx.execute(
            "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2)",
            &[&(version as i32), &super::int(now_ms)],
        )
        .await
        .map_err(migrate_err)?;
        tx.commit().await.map_err(migrate_err)?;
        applied.push(version);
    }
    Ok(applied)
}
