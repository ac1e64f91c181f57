//! Subjects' data keys ([`crate::personal`]): table `subject_keys`.

use sqlx::Row;

use super::error::map_err;
use super::publish::json;
use super::SqliteStore;
use crate::common::to_micros;
use crate::personal::WrappedKey;
use crate::Result;

fn row(r: &sqlx::sqlite::SqliteRow) -> Result<WrappedKey> {
    Ok(WrappedKey {
        subject: r.try_get("subject").map_err(map_err)?,
        key_id: r.try_get("key_id").map_err(map_err)?,
        wrapped: r.try_get("wrapped").map_err(map_err)?,
    })
}

/// The keys of `subjects`, or every key (`None`), by subject.
pub(super) async fn get(s: &SqliteStore, subjects: Option<&[String]>) -> Result<Vec<WrappedKey>> {
    sqlx::query(
        "SELECT subject, key_id, wrapped FROM subject_keys \
         WHERE ?1 IS NULL OR subject IN (SELECT value FROM json_each(?1)) ORDER BY subject",
    )
    .bind(subjects.map(json).transpose()?)
    .fetch_all(&s.pool)
    .await
    .map_err(map_err)?
    .iter()
    .map(row)
    .collect()
}

pub(super) async fn all(s: &SqliteStore) -> Result<Vec<WrappedKey>> {
    get(s, None).await
}

pub(super) async fn insert(s: &SqliteStore, keys: &[WrappedKey]) -> Result<()> {
    let (_guard, mut tx) = s.begin_write().await?;
    let now = to_micros(chrono::Utc::now());
    for k in keys {
        sqlx::query(
            "INSERT INTO subject_keys (subject, key_id, wrapped, created_at) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (subject) DO NOTHING",
        )
        .bind(&k.subject)
        .bind(&k.key_id)
        .bind(&k.wrapped)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    }
    tx.commit().await.map_err(map_err)
}

pub(super) async fn delete(s: &SqliteStore, subject: &str) -> Result<bool> {
    let (_guard, mut tx) = s.begin_write().await?;
    let n = sqlx::query("DELETE FROM subject_keys WHERE subject = ?1")
        .bind(subject)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?
        .rows_affected();
    tx.commit().await.map_err(map_err)?;
    Ok(n > 0)
}

pub(super) async fn replace(s: &SqliteStore, old: &WrappedKey, new: &WrappedKey) -> Result<bool> {
    let (_guard, mut tx) = s.begin_write().await?;
    let n = sqlx::query(
        "UPDATE subject_keys SET key_id = ?1, wrapped = ?2 WHERE subject = ?3 AND wrapped = ?4",
    )
    .bind(&new.key_id)
    .bind(&new.wrapped)
    .bind(&old.subject)
    .bind(&old.wrapped)
    .execute(&mut *tx)
    .await
    .map_err(map_err)?
    .rows_affected();
    tx.commit().await.map_err(map_err)?;
    Ok(n > 0)
}
