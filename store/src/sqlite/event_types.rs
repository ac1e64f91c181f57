//! The event-type catalog ([`crate::event_types`]): the `event_types`,
//! `event_type_names` and `catalog` tables (migration 0007), and the
//! publish's check of its cached catalog against the stored version.

use std::borrow::Cow;

use chrono::Utc;
use sqlx::{Row, SqliteConnection};

use super::error::map_err;
use super::publish::json;
use super::SqliteStore;
use crate::common::{from_micros, to_micros, PublishPlan};
use crate::event_types::{Cache, CatalogSettings, Change, EventType, Stored, Write};
use crate::{Result, StoreError};

/// The stored catalog, read on `conn`.
pub(super) async fn load(conn: &mut SqliteConnection) -> Result<Stored> {
    let (version, strict): (i64, bool) =
        sqlx::query_as("SELECT version, strict FROM catalog WHERE id = 0")
            .fetch_one(&mut *conn)
            .await
            .map_err(map_err)?;
    let rows = sqlx::query(
        "SELECT name, description, schema, aliases, deprecated, created_at, updated_at \
         FROM event_types ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(map_err)?;
    let types = rows
        .iter()
        .map(|r| {
            let schema: Option<String> = r.try_get("schema").map_err(map_err)?;
            let aliases: String = r.try_get("aliases").map_err(map_err)?;
            Ok(EventType {
                name: r.try_get("name").map_err(map_err)?,
                description: r.try_get("description").map_err(map_err)?,
                schema: schema
                    .map(|s| serde_json::from_str(&s))
                    .transpose()
                    .map_err(bad)?,
                aliases: serde_json::from_str(&aliases).map_err(bad)?,
                deprecated: r.try_get("deprecated").map_err(map_err)?,
                created_at: from_micros(r.try_get("created_at").map_err(map_err)?),
                updated_at: from_micros(r.try_get("updated_at").map_err(map_err)?),
            })
        })
        .collect::<Result<_>>()?;
    Ok(Stored {
        version,
        settings: CatalogSettings { strict },
        types,
    })
}

fn bad(e: serde_json::Error) -> StoreError {
    StoreError::Database(format!("event_types row is not valid JSON: {e}"))
}

/// The stored catalog, read in a transaction of its own.
pub(super) async fn read(store: &SqliteStore) -> Result<Stored> {
    let mut conn = store.pool().acquire().await.map_err(map_err)?;
    load(&mut conn).await
}

/// Plans and writes `change` in a write transaction, raising the catalog
/// version; returns what it wrote.
pub(super) async fn change(store: &SqliteStore, change: Change) -> Result<Write> {
    let (_guard, mut tx) = store.begin_write().await?;
    let stored = load(&mut tx).await?;
    let write = change.plan(&stored, from_micros(to_micros(Utc::now())))?;
    match &write {
        Write::Put { old, t } => {
            if let Some(old) = old {
                for sql in [
                    "DELETE FROM event_types WHERE name = ?1",
                    "DELETE FROM event_type_names WHERE wire = ?1",
                ] {
                    sqlx::query(sql)
                        .bind(old)
                        .execute(&mut *tx)
                        .await
                        .map_err(map_err)?;
                }
            }
            sqlx::query(
                "INSERT INTO event_types (name, description, schema, aliases, deprecated, \
                 created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )
            .bind(&t.name)
            .bind(&t.description)
            .bind(t.schema.as_ref().map(ToString::to_string))
            .bind(json(&t.aliases)?)
            .bind(t.deprecated)
            .bind(to_micros(t.created_at))
            .bind(to_micros(t.updated_at))
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            let names: Vec<&str> = t.names().collect();
            sqlx::query(
                "INSERT INTO event_type_names (name, wire) SELECT value, ?2 FROM json_each(?1)",
            )
            .bind(json(&names)?)
            .bind(&t.name)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        }
        Write::Settings(s) => {
            sqlx::query("UPDATE catalog SET strict = ?1 WHERE id = 0")
                .bind(s.strict)
                .execute(&mut *tx)
                .await
                .map_err(map_err)?;
        }
    }
    sqlx::query("UPDATE catalog SET version = version + 1 WHERE id = 0")
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    tx.commit().await.map_err(map_err)?;
    Ok(write)
}

/// `plan` as checked against the stored catalog, read on `conn` inside the
/// publish's write transaction: `plan` itself when it was checked against
/// the stored version, else checked again (the cache reloaded first when it
/// is stale).
///
/// # Errors
/// As [`crate::event_types::Snapshot::apply`].
pub(super) async fn checked<'p>(
    conn: &mut SqliteConnection,
    cache: &Cache,
    plan: &'p PublishPlan,
) -> Result<Cow<'p, PublishPlan>> {
    let version: i64 = sqlx::query_scalar("SELECT version FROM catalog WHERE id = 0")
        .fetch_one(&mut *conn)
        .await
        .map_err(map_err)?;
    if plan.catalog_version == Some(version) {
        return Ok(Cow::Borrowed(plan));
    }
    let mut snapshot = cache.get();
    if snapshot.version != version {
        snapshot = cache.replace(&load(conn).await?)?;
    }
    let mut plan = plan.clone();
    snapshot.apply(&mut plan)?;
    Ok(Cow::Owned(plan))
}
