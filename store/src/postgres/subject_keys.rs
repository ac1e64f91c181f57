//! Subjects' data keys ([`crate::personal`]): table `subject_keys`.

use sqlx::{PgPool, Row};

use super::error::map_err;
use crate::personal::WrappedKey;
use crate::Result;

fn row(r: &sqlx::postgres::PgRow) -> Result<WrappedKey> {
    Ok(WrappedKey {
        subject: r.try_get("subject").map_err(map_err)?,
        key_id: r.try_get("key_id").map_err(map_err)?,
        wrapped: r.try_get("wrapped").map_err(map_err)?,
    })
}

/// The keys of `subjects`, or every key (`None`), by subject.
pub(super) async fn get(pool: &PgPool, subjects: Option<&[String]>) -> Result<Vec<WrappedKey>> {
    sqlx::query(
        "SELECT subject, key_id, wrapped FROM subject_keys \
         WHERE $1::text[] IS NULL OR subject = ANY($1) ORDER BY subject",
    )
    .bind(subjects)
    .fetch_all(pool)
    .await
    .map_err(map_err)?
    .iter()
    .map(row)
    .collect()
}

pub(super) async fn all(s: &PgPool) -> Result<Vec<WrappedKey>> {
    get(s, None).await
}

pub(super) async fn insert(pool: &PgPool, keys: &[WrappedKey]) -> Result<()> {
    let subjects: Vec<&str> = keys.iter().map(|k| k.subject.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|k| k.key_id.as_str()).collect();
    let wrapped: Vec<&[u8]> = keys.iter().map(|k| k.wrapped.as_slice()).collect();
    sqlx::query(
        "INSERT INTO subject_keys (subject, key_id, wrapped) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::bytea[]) \
         ON CONFLICT (subject) DO NOTHING",
    )
    .bind(subjects)
    .bind(ids)
    .bind(wrapped)
    .execute(pool)
    .await
    .map_err(map_err)?;
    Ok(())
}

pub(super) async fn delete(pool: &PgPool, subject: &str) -> Result<bool> {
    let n = sqlx::query("DELETE FROM subject_keys WHERE subject = $1")
        .bind(subject)
        .execute(pool)
        .await
        .map_err(map_err)?
        .rows_affected();
    Ok(n > 0)
}

pub(super) async fn replace(pool: &PgPool, old: &WrappedKey, new: &WrappedKey) -> Result<bool> {
    let n = sqlx::query(
        "UPDATE subject_keys SET key_id = $1, wrapped = $2 WHERE subject = $3 AND wrapped = $4",
    )
    .bind(&new.key_id)
    .bind(&new.wrapped)
    .bind(&old.subject)
    .bind(&old.wrapped)
    .execute(pool)
    .await
    .map_err(map_err)?
    .rows_affected();
    Ok(n > 0)
}
