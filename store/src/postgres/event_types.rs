//! The event-type catalog ([`crate::event_types`]): the `event_types`,
//! `event_type_names` and `catalog` tables (migration 0008). The publish
//! statement compares the stored catalog version with its batch's
//! (`sql/publish.sql` `$10`) and writes nothing when they differ; the
//! writer then reloads the catalog ([`load`]), checks the batch again and
//! reruns ([`publish`](super::publish)).

use chrono::Utc;
use sqlx::{Connection, PgConnection, PgPool, Row};

use super::error::map_err;
use crate::common::{from_micros, to_micros};
use crate::event_types::{CatalogSettings, Change, EventType, Stored, Write};
use crate::{Result, StoreError};

/// The stored catalog, read on `conn` (one snapshot under `REPEATABLE
/// READ`; under `READ COMMITTED` the version is read first, so a catalog
/// read with a lower version than its rows only costs one more reload).
pub(super) async fn load(conn: &mut PgConnection) -> Result<Stored> {
    let (version, strict): (i64, bool) =
        sqlx::query_as("SELECT version, strict FROM catalog WHERE id = 0")
            .fetch_one(&mut *conn)
            .await
            .map_err(map_err)?;
    let rows = sqlx::query(
        "SELECT name, description, schema::text AS schema, aliases, deprecated, created_at, \
         updated_at FROM event_types ORDER BY name",
    )
    .fetch_all(&mut *conn)
    .await
    .map_err(map_err)?;
    let types = rows
        .iter()
        .map(|r| {
            let schema: Option<String> = r.try_get("schema").map_err(map_err)?;
            Ok(EventType {
                name: r.try_get("name").map_err(map_err)?,
                description: r.try_get("description").map_err(map_err)?,
                schema: schema
                    .map(|s| serde_json::from_str(&s))
                    .transpose()
                    .map_err(|e| {
                        StoreError::Database(format!("event_types.schema is not JSON: {e}"))
                    })?,
                aliases: r.try_get("aliases").map_err(map_err)?,
                deprecated: r.try_get("deprecated").map_err(map_err)?,
                created_at: r.try_get("created_at").map_err(map_err)?,
                updated_at: r.try_get("updated_at").map_err(map_err)?,
            })
        })
        .collect::<Result<_>>()?;
    Ok(Stored {
        version,
        settings: CatalogSettings { strict },
        types,
    })
}

/// The stored catalog, read in one `REPEATABLE READ` transaction.
pub(super) async fn read(pool: &PgPool) -> Result<Stored> {
    let mut conn = pool.acquire().await.map_err(map_err)?;
    let mut tx = conn.begin().await.map_err(map_err)?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    let stored = load(&mut tx).await?;
    tx.commit().await.map_err(map_err)?;
    Ok(stored)
}

/// Plans and writes `change` in one transaction holding the catalog row's
/// lock (catalog changes are serialized), raising the catalog version;
/// returns what it wrote.
pub(super) async fn change(pool: &PgPool, change: Change) -> Result<Write> {
    let mut tx = pool.begin().await.map_err(map_err)?;
    sqlx::query("SELECT 1 FROM catalog WHERE id = 0 FOR UPDATE")
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    let stored = load(&mut tx).await?;
    let write = change.plan(&stored, from_micros(to_micros(Utc::now())))?;
    match &write {
        Write::Put { old, t } => {
            if let Some(old) = old {
                for sql in [
                    "DELETE FROM event_types WHERE name = $1",
                    "DELETE FROM event_type_names WHERE wire = $1",
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
                 created_at, updated_at) VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7)",
            )
            .bind(&t.name)
            .bind(&t.description)
            .bind(t.schema.as_ref().map(ToString::to_string))
            .bind(&t.aliases)
            .bind(t.deprecated)
            .bind(t.created_at)
            .bind(t.updated_at)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
            let names: Vec<&str> = t.names().collect();
            sqlx::query(
                "INSERT INTO event_type_names (name, wire) SELECT n, $2 FROM unnest($1::text[]) AS n",
            )
            .bind(&names)
            .bind(&t.name)
            .execute(&mut *tx)
            .await
            .map_err(map_err)?;
        }
        Write::Settings(s) => {
            sqlx::query("UPDATE catalog SET strict = $1 WHERE id = 0")
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
