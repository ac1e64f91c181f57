//! Schema migrations (`store/migrations/postgres/`), applied under an
//! advisory lock, the `meta` table that records them, and the SQL interface
//! (`sql/functions.sql`), installed again whenever its text changes.

use sqlx::{PgConnection, PgPool};

use super::error::map_err;
use crate::{Result, StoreError};

/// Advisory lock key serializing migrations (`lanebus` in ASCII).
const MIGRATION_LOCK: i64 = 0x006c_616e_6562_7573;

/// Schema migrations, applied in order; version `i + 1` is `MIGRATIONS[i]`.
const MIGRATIONS: &[&str] = &[
    include_str!("../../migrations/postgres/0001_init.sql"),
    include_str!("../../migrations/postgres/0002_handler_controls.sql"),
    include_str!("../../migrations/postgres/0003_retention.sql"),
    include_str!("../../migrations/postgres/0004_late_completions.sql"),
    include_str!("../../migrations/postgres/0005_held_backfill.sql"),
    include_str!("../../migrations/postgres/0006_claim_txid.sql"),
    include_str!("../../migrations/postgres/0007_attempt_log.sql"),
    include_str!("../../migrations/postgres/0008_event_types.sql"),
    include_str!("../../migrations/postgres/0009_handler_filters.sql"),
    include_str!("../../migrations/postgres/0010_subject_keys.sql"),
];

/// The SQL interface: `sql/functions.sql` with the publish statement
/// (`sql/publish.sql`) in place of its marker line, so that the functions
/// run the statement [`crate::Store::publish`] runs.
pub(crate) fn functions_sql() -> String {
    include_str!("sql/functions.sql").replace("--@publish.sql\n", include_str!("sql/publish.sql"))
}

/// Applies pending migrations in one transaction (idempotent; safe while
/// other nodes run) and, for a new database, creates `lanes` lanes. Returns
/// the store's lane count (an existing store keeps its own).
pub(super) async fn migrate(pool: &PgPool, lanes: u16) -> Result<u16> {
    let mut tx = pool.begin().await.map_err(map_err)?;
    // A migration may wait for another node's and rewrite large tables.
    lift_timeouts(&mut tx).await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    sqlx::query("CREATE TABLE IF NOT EXISTS meta (key text PRIMARY KEY, value text NOT NULL)")
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    let version: i64 = match meta_get(&mut tx, "schema_version").await? {
        Some(v) => v.parse().map_err(|_| {
            StoreError::Database(format!("meta.schema_version {v:?} is not a number"))
        })?,
        None => 0,
    };
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StoreError::Database(format!(
            "database schema version {version} is newer than this build knows ({known})"
        )));
    }
    for (i, sql) in MIGRATIONS
        .iter()
        .copied()
        .enumerate()
        .skip(version as usize)
    {
        // A plain string runs as a simple query: several statements at once.
        sqlx::Executor::execute(&mut *tx, sql)
            .await
            .map_err(map_err)?;
        meta_set(&mut tx, "schema_version", &(i + 1).to_string()).await?;
    }
    // The functions, when this build's text differs from the installed one
    // (`CREATE OR REPLACE` only then: each replace invalidates the plans of
    // every session that uses them).
    let functions = functions_sql();
    let digest = format!("{:016x}", crate::lane::fnv1a_64(functions.as_bytes()));
    if meta_get(&mut tx, "functions").await?.as_deref() != Some(digest.as_str()) {
        sqlx::Executor::execute(&mut *tx, functions.as_str())
            .await
            .map_err(map_err)?;
        meta_set(&mut tx, "functions", &digest).await?;
    }
    let lanes =
        match meta_get(&mut tx, "lanes").await? {
            Some(v) => v.parse::<u16>().ok().filter(|&l| l > 0).ok_or_else(|| {
                StoreError::Database(format!("meta.lanes {v:?} is not a lane count"))
            })?,
            None => {
                meta_set(&mut tx, "lanes", &lanes.to_string()).await?;
                sqlx::query(
                "INSERT INTO lanes (lane) SELECT generate_series(0, $1 - 1) ON CONFLICT DO NOTHING",
            )
            .bind(i32::from(lanes))
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
                lanes
            }
        };
    tx.commit().await.map_err(map_err)?;
    Ok(lanes)
}

/// Lifts [`SESSION_DEFAULTS`]' statement and lock timeouts for the rest of
/// the transaction (`SET LOCAL`), for work that may rightly take long.
pub(crate) async fn lift_timeouts(conn: &mut PgConnection) -> Result<()> {
    sqlx::Executor::execute(
        conn,
        "SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0",
    )
    .await
    .map_err(map_err)?;
    Ok(())
}

async fn meta_get(conn: &mut PgConnection, key: &str) -> Result<Option<String>> {
    sqlx::query_scalar("SELECT value FROM meta WHERE key = $1")
        .bind(key)
        .fetch_optional(conn)
        .await
        .map_err(map_err)
}

async fn meta_set(conn: &mut PgConnection, key: &str, value: &str) -> Result<()> {
    sqlx::query("INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value")
        .bind(key)
        .bind(value)
        .execute(conn)
        .await
        .map_err(map_err)?;
    Ok(())
}
