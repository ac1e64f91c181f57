//! Handler catalog, dead-letter listing, lane rows and counters.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::map_err;
use crate::common::{from_micros, to_micros, to_u32};
use crate::*;

/// Default page size when [`DeadLetterFilter::limit`] is 0.
const DEFAULT_DEAD_LETTER_PAGE: u32 = 100;

const HANDLER_COLUMNS: &str =
    "id, name, url, event_types, max_attempts, timeout_ms, max_in_flight, secret, state, created_at";

pub(super) async fn create_handler(pool: &PgPool, h: NewHandler) -> Result<Handler> {
    let handler = Handler {
        id: generate_handler_id(),
        name: h.name,
        url: h.url,
        event_types: h.event_types,
        max_attempts: h.max_attempts,
        timeout_ms: h.timeout_ms,
        max_in_flight: h.max_in_flight,
        secret: h.secret,
        state: HandlerState::Enabled,
        // timestamptz keeps microseconds: truncate so the answer equals a later read.
        created_at: from_micros(to_micros(Utc::now())),
    };
    sqlx::query(
        "INSERT INTO handlers (id, name, url, event_types, max_attempts, timeout_ms, max_in_flight, secret, state, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(&handler.id)
    .bind(&handler.name)
    .bind(&handler.url)
    .bind(&handler.event_types)
    .bind(i32::try_from(handler.max_attempts).unwrap_or(i32::MAX))
    .bind(i64::try_from(handler.timeout_ms).unwrap_or(i64::MAX))
    .bind(i32::try_from(handler.max_in_flight).unwrap_or(i32::MAX))
    .bind(&handler.secret)
    .bind(handler.state.as_str())
    .bind(handler.created_at)
    .execute(pool)
    .await
    .map_err(map_err)?;
    Ok(handler)
}

fn handler_from_row(row: &PgRow) -> Result<Handler> {
    let state: String = row.try_get("state").map_err(map_err)?;
    let timeout_ms: i64 = row.try_get("timeout_ms").map_err(map_err)?;
    let max_attempts: i32 = row.try_get("max_attempts").map_err(map_err)?;
    let max_in_flight: i32 = row.try_get("max_in_flight").map_err(map_err)?;
    Ok(Handler {
        id: row.try_get("id").map_err(map_err)?,
        name: row.try_get("name").map_err(map_err)?,
        url: row.try_get("url").map_err(map_err)?,
        event_types: row.try_get("event_types").map_err(map_err)?,
        max_attempts: to_u32(i64::from(max_attempts)),
        timeout_ms: u64::try_from(timeout_ms.max(0)).unwrap_or_default(),
        max_in_flight: to_u32(i64::from(max_in_flight)),
        secret: row.try_get("secret").map_err(map_err)?,
        state: HandlerState::parse(&state),
        created_at: row.try_get("created_at").map_err(map_err)?,
    })
}

pub(super) async fn list_handlers(pool: &PgPool) -> Result<Vec<Handler>> {
    sqlx::query(&format!(
        "SELECT {HANDLER_COLUMNS} FROM handlers ORDER BY pos"
    ))
    .fetch_all(pool)
    .await
    .map_err(map_err)?
    .iter()
    .map(handler_from_row)
    .collect()
}

pub(super) async fn get_handler(pool: &PgPool, id: &str) -> Result<Handler> {
    let row = sqlx::query(&format!(
        "SELECT {HANDLER_COLUMNS} FROM handlers WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(pool)
    .await
    .map_err(map_err)?
    .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    handler_from_row(&row)
}

pub(super) async fn set_handler_state(
    pool: &PgPool,
    id: &str,
    state: HandlerState,
) -> Result<Handler> {
    let row = sqlx::query(&format!(
        "UPDATE handlers SET state = $2 WHERE id = $1 RETURNING {HANDLER_COLUMNS}"
    ))
    .bind(id)
    .bind(state.as_str())
    .fetch_optional(pool)
    .await
    .map_err(map_err)?
    .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    handler_from_row(&row)
}

/// Deletes the handler and its pending deliveries in one statement; returns
/// how many deliveries were discarded.
pub(super) async fn delete_handler(pool: &PgPool, id: &str) -> Result<u64> {
    let (removed, discarded): (i64, i64) = sqlx::query_as(
        "WITH h AS (DELETE FROM handlers WHERE id = $1 RETURNING id), \
              d AS (DELETE FROM deliveries WHERE handler_id = $1 AND EXISTS (SELECT 1 FROM h) RETURNING 1) \
         SELECT (SELECT count(*) FROM h), (SELECT count(*) FROM d)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .map_err(map_err)?;
    if removed == 0 {
        return Err(StoreError::NotFound(format!("handler {id}")));
    }
    Ok(u64::try_from(discarded).unwrap_or_default())
}

pub(super) async fn list_dead_letters(
    pool: &PgPool,
    filter: &DeadLetterFilter,
) -> Result<Vec<DeadLetter>> {
    let limit = if filter.limit == 0 {
        DEFAULT_DEAD_LETTER_PAGE
    } else {
        filter.limit
    };
    let rows = sqlx::query(include_str!("sql/list_dead_letters.sql"))
        .bind(&filter.handler_id)
        .bind(filter.after_id.unwrap_or(0))
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await
        .map_err(map_err)?;
    rows.iter()
        .map(|row| {
            let attempts: i32 = row.try_get("attempts").map_err(map_err)?;
            let failed_at: DateTime<Utc> = row.try_get("failed_at").map_err(map_err)?;
            Ok(DeadLetter {
                id: row.try_get("id").map_err(map_err)?,
                handler_id: row.try_get("handler_id").map_err(map_err)?,
                event_id: row.try_get("event_id").map_err(map_err)?,
                event_type: row.try_get("type").map_err(map_err)?,
                key: row.try_get("key").map_err(map_err)?,
                seq: row.try_get("seq").map_err(map_err)?,
                attempts: to_u32(i64::from(attempts)),
                last_error: row.try_get("last_error").map_err(map_err)?,
                failed_at,
            })
        })
        .collect()
}

pub(super) async fn lane_rows(pool: &PgPool) -> Result<Vec<LaneRow>> {
    let rows: Vec<(i32, Option<String>, i64, i64)> =
        sqlx::query_as(include_str!("sql/lane_rows.sql"))
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
    rows.into_iter()
        .map(|(lane, owner, epoch, backlog)| {
            Ok(LaneRow {
                lane: Lane::try_from(lane)
                    .map_err(|_| StoreError::Database(format!("lane {lane} out of range")))?,
                owner,
                epoch,
                backlog,
            })
        })
        .collect()
}

pub(super) async fn counts(pool: &PgPool) -> Result<StoreCounts> {
    let (events, deliveries, completions, dead_letters): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM deliveries), \
                (SELECT count(*) FROM completions), (SELECT count(*) FROM dead_letters)",
    )
    .fetch_one(pool)
    .await
    .map_err(map_err)?;
    Ok(StoreCounts {
        events,
        deliveries,
        completions,
        dead_letters,
    })
}
