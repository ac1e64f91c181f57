//! Schema migrations (`store/migrations/sqlite/`), applied in one
//! `BEGIN IMMEDIATE` transaction, and the `meta` table that records them.

use sqlx::SqliteConnection;

use super::error::map_err;
use super::SqliteStore;
use crate::{Result, StoreError};

/// Schema migrations, applied in order; version `i + 1` is `MIGRATIONS[i]`.
const MIGRATIONS: &[&str] = &[
    include_str!("../../migrations/sqlite/0001_init.sql"),
    include_str!("../../migrations/sqlite/0002_handler_controls.sql"),
    include_str!("../../migrations/sqlite/0003_retention.sql"),
    include_str!("../../migrations/sqlite/0004_late_completions.sql"),
    include_str!("../../migrations/sqlite/0005_held_backfill.sql"),
    include_str!("../../migrations/sqlite/0006_attempt_log.sql"),
    include_str!("../../migrations/sqlite/0007_event_types.sql"),
    include_str!("../../migrations/sqlite/0008_handler_filters.sql"),
    include_str!("../../migrations/sqlite/0009_subject_keys.sql"),
];

/// Applies pending migrations in one write transaction (idempotent; safe
/// while other processes use the file) and, for a new file, creates `lanes`
/// lanes. Returns the store's lane count (an existing store keeps its own).
pub(super) async fn migrate(store: &SqliteStore, lanes: u16) -> Result<u16> {
    let (_guard, mut tx) = store.begin_write().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    )
    .execute(&mut *tx)
    .await
    .map_err(map_err)?;
    let version: i64 = meta_get(&mut tx, "schema_version")
        .await?
        .map_or(Ok(0), |v| {
            v.parse().map_err(|_| {
                StoreError::Database(format!("meta.schema_version {v:?} is not a number"))
            })
        })?;
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StoreError::Database(format!(
            "database schema version {version} is newer than this build knows ({known})"
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        sqlx::query(sql).execute(&mut *tx).await.map_err(map_err)?;
        meta_set(&mut tx, "schema_version", &(i + 1).to_string()).await?;
    }
    let lanes = match meta_get(&mut tx, "lanes").await? {
        Some(v) => {
            v.parse::<u16>().ok().filter(|&l| l > 0).ok_or_else(|| {
                StoreError::Database(format!("meta.lanes {v:?} is not a lane count"))
            })?
        }
        None => {
            meta_set(&mut tx, "lanes", &lanes.to_string()).await?;
            sqlx::query(
                "WITH RECURSIVE n(lane) AS (SELECT 0 UNION ALL SELECT lane + 1 FROM n WHERE lane + 1 < ?1) \
                 INSERT OR IGNORE INTO lanes (lane, owner, epoch) SELECT lane, NULL, 0 FROM n",
            )
            .bind(i64::from(lanes))
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            lanes
        }
    };
    tx.commit().await.map_err(map_err)?;
    Ok(lanes)
}

async fn meta_get(conn: &mut SqliteConnection, key: &str) -> Result<Option<String>> {
    sqlx::query_scalar("SELECT value FROM meta WHERE key = ?1")
        .bind(key)
        .fetch_optional(conn)
        .await
        .map_err(map_err)
}

async fn meta_set(conn: &mut SqliteConnection, key: &str, value: &str) -> Result<()> {
    sqlx::query("INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value")
        .bind(key)
        .bind(value)
        .execute(conn)
        .await
        .map_err(map_err)?;
    Ok(())
}
