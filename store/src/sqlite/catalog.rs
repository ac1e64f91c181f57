//! Handler catalog, dead-letter listing, lane rows and counters.

use chrono::Utc;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection, SqlitePool};

use super::error::map_err;
use super::publish::json;
use crate::common::{epoch_from_db, from_micros, to_micros, to_u32};
use crate::*;

/// Default page size when [`DeadLetterFilter::limit`] is 0.
const DEFAULT_DEAD_LETTER_PAGE: u32 = 100;

const HANDLER_COLUMNS: &str =
    "id, name, url, event_types, max_attempts, timeout_ms, max_in_flight, secret, state, created_at, \
     rate_limit_per_s, rate_limit_burst, previous_secret, previous_secret_until, state_changed_at, \
     state_reason, failing_since, filter";

pub(super) async fn create_handler(conn: &mut SqliteConnection, h: NewHandler) -> Result<Handler> {
    let handler = Handler::registered(
        generate_handler_id(),
        h,
        // Stored with microsecond precision: truncate so the answer equals a later read.
        from_micros(to_micros(Utc::now())),
    );
    sqlx::query(
        "INSERT INTO handlers (id, name, url, event_types, max_attempts, timeout_ms, max_in_flight, secret, state, created_at, \
         rate_limit_per_s, rate_limit_burst, filter) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
    )
    .bind(&handler.id)
    .bind(&handler.name)
    .bind(&handler.url)
    .bind(json(&handler.event_types)?)
    .bind(i64::from(handler.max_attempts))
    .bind(i64::try_from(handler.timeout_ms).unwrap_or(i64::MAX))
    .bind(i64::from(handler.max_in_flight))
    .bind(&handler.secret)
    .bind(handler.state.as_str())
    .bind(to_micros(handler.created_at))
    .bind(handler.rate_limit.map(|r| i64::from(r.per_second)))
    .bind(handler.rate_limit.map(|r| i64::from(r.burst)))
    .bind(filter_json(handler.filter.as_ref()))
    .execute(conn)
    .await
    .map_err(map_err)?;
    Ok(handler)
}

fn handler_from_row(row: &SqliteRow) -> Result<Handler> {
    let types: String = row.try_get("event_types").map_err(map_err)?;
    let state: String = row.try_get("state").map_err(map_err)?;
    let timeout_ms: i64 = row.try_get("timeout_ms").map_err(map_err)?;
    let id: String = row.try_get("id").map_err(map_err)?;
    Ok(Handler {
        name: row.try_get("name").map_err(map_err)?,
        url: row.try_get("url").map_err(map_err)?,
        event_types: serde_json::from_str(&types).map_err(|e| {
            StoreError::Database(format!(
                "handlers.event_types is not a JSON array of strings: {e}"
            ))
        })?,
        max_attempts: to_u32(row.try_get("max_attempts").map_err(map_err)?),
        timeout_ms: u64::try_from(timeout_ms.max(0)).unwrap_or_default(),
        max_in_flight: to_u32(row.try_get("max_in_flight").map_err(map_err)?),
        secret: row.try_get("secret").map_err(map_err)?,
        state: HandlerState::parse(&state),
        created_at: from_micros(row.try_get("created_at").map_err(map_err)?),
        rate_limit: match (
            row.try_get::<Option<i64>, _>("rate_limit_per_s")
                .map_err(map_err)?,
            row.try_get::<Option<i64>, _>("rate_limit_burst")
                .map_err(map_err)?,
        ) {
            (Some(per_second), Some(burst)) => Some(RateLimit {
                per_second: to_u32(per_second),
                burst: to_u32(burst),
            }),
            _ => None,
        },
        previous_secret: row.try_get("previous_secret").map_err(map_err)?,
        previous_secret_until: time(row, "previous_secret_until")?,
        state_changed_at: time(row, "state_changed_at")?,
        state_reason: row.try_get("state_reason").map_err(map_err)?,
        failing_since: time(row, "failing_since")?,
        filter: row
            .try_get::<Option<String>, _>("filter")
            .map_err(map_err)?
            .map(|f| Filter::from_stored(&id, &f))
            .transpose()?,
        id,
    })
}

/// A filter as stored: compact JSON, `NULL` for none.
fn filter_json(f: Option<&Filter>) -> Option<String> {
    f.map(Filter::to_stored)
}

fn time(row: &SqliteRow, column: &str) -> Result<Option<chrono::DateTime<Utc>>> {
    Ok(row
        .try_get::<Option<i64>, _>(column)
        .map_err(map_err)?
        .map(from_micros))
}

pub(super) async fn list_handlers(pool: &SqlitePool) -> Result<Vec<Handler>> {
    sqlx::query(&format!(
        "SELECT {HANDLER_COLUMNS} FROM handlers ORDER BY rowid"
    ))
    .fetch_all(pool)
    .await
    .map_err(map_err)?
    .iter()
    .map(handler_from_row)
    .collect()
}

pub(super) async fn get_handler<'e, E>(ex: E, id: &str) -> Result<Handler>
where
    E: sqlx::Executor<'e, Database = sqlx::Sqlite>,
{
    let row = sqlx::query(&format!(
        "SELECT {HANDLER_COLUMNS} FROM handlers WHERE id = ?1"
    ))
    .bind(id)
    .fetch_optional(ex)
    .await
    .map_err(map_err)?
    .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    handler_from_row(&row)
}

/// Deletes the handler's deliveries and dead letters, then the handler; the
/// caller's transaction is dropped (rolled back) on [`StoreError::NotFound`].
pub(super) async fn delete_handler(
    conn: &mut SqliteConnection,
    id: &str,
) -> Result<DeletedHandler> {
    let discarded = sqlx::query("DELETE FROM deliveries WHERE handler_id = ?1")
        .bind(id)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    let dead_letters = sqlx::query("DELETE FROM dead_letters WHERE handler_id = ?1")
        .bind(id)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    let removed = sqlx::query("DELETE FROM handlers WHERE id = ?1")
        .bind(id)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    if removed == 0 {
        return Err(StoreError::NotFound(format!("handler {id}")));
    }
    Ok(DeletedHandler {
        deliveries: discarded,
        dead_letters,
    })
}

pub(super) async fn list_dead_letters(
    pool: &SqlitePool,
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
            Ok(DeadLetter {
                id: row.try_get("id").map_err(map_err)?,
                handler_id: row.try_get("handler_id").map_err(map_err)?,
                event_id: row.try_get("event_id").map_err(map_err)?,
                event_type: row.try_get("type").map_err(map_err)?,
                key: row.try_get("key").map_err(map_err)?,
                seq: row.try_get("seq").map_err(map_err)?,
                attempts: to_u32(row.try_get("attempts").map_err(map_err)?),
                last_error: row.try_get("last_error").map_err(map_err)?,
                failed_at: from_micros(row.try_get("failed_at").map_err(map_err)?),
            })
        })
        .collect()
}

pub(super) async fn lane_rows(pool: &SqlitePool) -> Result<Vec<LaneRow>> {
    let rows: Vec<(i64, Option<String>, i64, i64)> =
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
                epoch: epoch_from_db(epoch)?,
                backlog,
            })
        })
        .collect()
}

pub(super) async fn counts(pool: &SqlitePool) -> Result<StoreCounts> {
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

pub(super) async fn change_handler_state(
    conn: &mut SqliteConnection,
    id: &str,
    state: HandlerState,
    reason: &str,
) -> Result<()> {
    let n = sqlx::query(
        "UPDATE handlers SET state = ?1, \
                state_changed_at = CASE WHEN state = ?1 THEN state_changed_at ELSE ?4 END, \
                state_reason = CASE WHEN state = ?1 THEN state_reason ELSE ?3 END, \
                failing_since = CASE WHEN ?1 = 'enabled' THEN NULL ELSE failing_since END \
         WHERE id = ?2",
    )
    .bind(state.as_str())
    .bind(id)
    .bind(reason)
    .bind(to_micros(Utc::now()))
    .execute(conn)
    .await
    .map_err(map_err)?
    .rows_affected();
    crate::common::handler_found(n, id)
}

/// Read, merge, check, write, in the caller's write transaction.
pub(super) async fn update_handler(
    conn: &mut SqliteConnection,
    id: &str,
    patch: &HandlerPatch,
) -> Result<Handler> {
    let h = get_handler(&mut *conn, id).await?.patched(patch)?;
    sqlx::query(
        "UPDATE handlers SET name = ?2, url = ?3, event_types = ?4, max_attempts = ?5, \
                timeout_ms = ?6, max_in_flight = ?7, rate_limit_per_s = ?8, rate_limit_burst = ?9, \
                filter = ?10 \
         WHERE id = ?1",
    )
    .bind(id)
    .bind(&h.name)
    .bind(&h.url)
    .bind(json(&h.event_types)?)
    .bind(i64::from(h.max_attempts))
    .bind(i64::try_from(h.timeout_ms).unwrap_or(i64::MAX))
    .bind(i64::from(h.max_in_flight))
    .bind(h.rate_limit.map(|r| i64::from(r.per_second)))
    .bind(h.rate_limit.map(|r| i64::from(r.burst)))
    .bind(filter_json(h.filter.as_ref()))
    .execute(conn)
    .await
    .map_err(map_err)?;
    Ok(h)
}

pub(super) async fn rotate_handler_secret(
    conn: &mut SqliteConnection,
    id: &str,
    secret: &str,
    previous_until: chrono::DateTime<Utc>,
) -> Result<()> {
    let n = sqlx::query(
        "UPDATE handlers SET previous_secret = secret, previous_secret_until = ?3, secret = ?2 \
         WHERE id = ?1",
    )
    .bind(id)
    .bind(secret)
    .bind(to_micros(previous_until))
    .execute(conn)
    .await
    .map_err(map_err)?
    .rows_affected();
    crate::common::handler_found(n, id)
}

pub(super) async fn mark_handler_failing(
    conn: &mut SqliteConnection,
    id: &str,
    failing: bool,
    at: chrono::DateTime<Utc>,
) -> Result<()> {
    let n = sqlx::query(
        "UPDATE handlers SET failing_since = CASE WHEN ?2 THEN coalesce(failing_since, ?3) END \
         WHERE id = ?1",
    )
    .bind(id)
    .bind(failing)
    .bind(to_micros(at))
    .execute(conn)
    .await
    .map_err(map_err)?
    .rows_affected();
    crate::common::handler_found(n, id)
}

pub(super) async fn lookup_event(pool: &SqlitePool, id: &str) -> Result<Option<EventLookup>> {
    type EventRow = (String, Option<String>, i64, Option<i64>, i64, i64);
    let row: Option<EventRow> = sqlx::query_as(
        "SELECT type, key, lane, seq, published_at, length(payload) FROM events WHERE id = ?1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
    .map_err(map_err)?;
    let Some((event_type, key, lane, seq, published_at, size)) = row else {
        return Ok(None);
    };
    let columns = (event_type, key, lane, seq, from_micros(published_at), size);
    let mut event = crate::common::event_lookup(id, columns)?;
    type RecordRow = (
        String,
        String,
        Option<String>,
        i64,
        i64,
        Option<String>,
        Option<String>,
    );
    let rows: Vec<RecordRow> = sqlx::query_as(include_str!("sql/lookup_event.sql"))
        .bind(id)
        .bind(lane)
        .fetch_all(pool)
        .await
        .map_err(map_err)?;
    for (kind, handler_id, name, attempts, at, last_error, log) in rows {
        let (at, log) = (from_micros(at), crate::common::attempt_log(log.as_deref())?);
        let state = crate::common::delivery_state(&kind, to_u32(attempts), at, last_error, log)?;
        event.add(handler_id, name, state);
    }
    Ok(Some(event))
}

pub(super) async fn handler_deliveries(
    pool: &SqlitePool,
    q: &HandlerDeliveriesQuery,
) -> Result<Vec<HandlerDeliveryItem>> {
    let pending = match q.state {
        DeliveryListState::Pending => true,
        DeliveryListState::Dead => false,
        DeliveryListState::Completed => return handler_completions(pool, q).await,
    };
    let rows: Vec<crate::common::RecordRow<i64>> =
        sqlx::query_as(include_str!("sql/handler_records.sql"))
            .bind(&q.handler_id)
            .bind(crate::common::id_before(&q.after)?)
            .bind(&q.key)
            .bind(i64::from(q.limit.max(1)))
            .bind(pending)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
    crate::common::record_items(rows, from_micros)
}

async fn handler_completions(
    pool: &SqlitePool,
    q: &HandlerDeliveriesQuery,
) -> Result<Vec<HandlerDeliveryItem>> {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<i64>,
        i64,
        i64,
    );
    let (at, event_id) = match crate::common::completed_before(&q.after)? {
        Some((at, event_id)) => (to_micros(at), event_id),
        None => (i64::MAX, String::new()),
    };
    let rows: Vec<Row> = sqlx::query_as(include_str!("sql/handler_completed.sql"))
        .bind(&q.handler_id)
        .bind(to_micros(q.completed_since))
        .bind(at)
        .bind(event_id)
        .bind(&q.key)
        .bind(i64::from(q.limit.max(1)))
        .fetch_all(pool)
        .await
        .map_err(map_err)?;
    rows.into_iter()
        .map(|(event_id, ty, key, seq, lane, attempts, at)| {
            let state = DeliveryState::Completed {
                completed_at: from_micros(at),
                attempts: to_u32(attempts),
            };
            crate::common::delivery_item(event_id, ty, key, seq, lane, None, state)
        })
        .collect()
}
