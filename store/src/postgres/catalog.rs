//! Handler catalog, dead-letter listing, lane rows and counters.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::error::map_err;
use crate::common::{epoch_from_db, from_micros, to_micros, to_u32};
use crate::*;

/// Default page size when [`DeadLetterFilter::limit`] is 0.
const DEFAULT_DEAD_LETTER_PAGE: u32 = 100;

const HANDLER_COLUMNS: &str =
    "id, name, url, event_types, max_attempts, timeout_ms, max_in_flight, secret, state, created_at, \
     rate_limit_per_s, rate_limit_burst, previous_secret, previous_secret_until, state_changed_at, \
     state_reason, failing_since, filter::text AS filter";

pub(super) async fn create_handler(pool: &PgPool, h: NewHandler) -> Result<Handler> {
    let handler = Handler::registered(
        generate_handler_id(),
        h,
        // timestamptz keeps microseconds: truncate so the answer equals a later read.
        from_micros(to_micros(Utc::now())),
    );
    sqlx::query(
        "INSERT INTO handlers (id, name, url, event_types, max_attempts, timeout_ms, max_in_flight, secret, state, created_at, \
         rate_limit_per_s, rate_limit_burst, filter) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13::jsonb)",
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
    .bind(handler.rate_limit.map(|r| i32::try_from(r.per_second).unwrap_or(i32::MAX)))
    .bind(handler.rate_limit.map(|r| i32::try_from(r.burst).unwrap_or(i32::MAX)))
    .bind(handler.filter.as_ref().map(Filter::to_stored))
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
    let id: String = row.try_get("id").map_err(map_err)?;
    let filter = row
        .try_get::<Option<String>, _>("filter")
        .map_err(map_err)?
        .map(|f| Filter::from_stored(&id, &f))
        .transpose()?;
    Ok(Handler {
        id,
        filter,
        name: row.try_get("name").map_err(map_err)?,
        url: row.try_get("url").map_err(map_err)?,
        event_types: row.try_get("event_types").map_err(map_err)?,
        max_attempts: to_u32(i64::from(max_attempts)),
        timeout_ms: u64::try_from(timeout_ms.max(0)).unwrap_or_default(),
        max_in_flight: to_u32(i64::from(max_in_flight)),
        secret: row.try_get("secret").map_err(map_err)?,
        state: HandlerState::parse(&state),
        created_at: row.try_get("created_at").map_err(map_err)?,
        rate_limit: rate_limit(
            row.try_get("rate_limit_per_s").map_err(map_err)?,
            row.try_get("rate_limit_burst").map_err(map_err)?,
        ),
        previous_secret: row.try_get("previous_secret").map_err(map_err)?,
        previous_secret_until: row.try_get("previous_secret_until").map_err(map_err)?,
        state_changed_at: row.try_get("state_changed_at").map_err(map_err)?,
        state_reason: row.try_get("state_reason").map_err(map_err)?,
        failing_since: row.try_get("failing_since").map_err(map_err)?,
    })
}

fn rate_limit(per_s: Option<i32>, burst: Option<i32>) -> Option<RateLimit> {
    Some(RateLimit {
        per_second: to_u32(i64::from(per_s?)),
        burst: to_u32(i64::from(burst?)),
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

/// Also publishes a change's operational event in its transaction
/// ([`crate::operational::state_changed`]); returns what that publish did,
/// for the wake-up after the commit.
pub(super) async fn change_handler_state(
    pool: &PgPool,
    id: &str,
    state: HandlerState,
    reason: &str,
    lanes: u16,
) -> Result<(StateChange, Option<PublishOutcome>)> {
    // The row lock orders concurrent changes: each reads the state the one
    // before it left, so exactly one of two disables sees `enabled`.
    let mut tx = pool.begin().await.map_err(map_err)?;
    let was: String = sqlx::query_scalar("SELECT state FROM handlers WHERE id = $1 FOR UPDATE")
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(map_err)?
        .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    let row = sqlx::query(&format!(
        "UPDATE handlers SET state = $2, \
                state_changed_at = CASE WHEN state = $2 THEN state_changed_at ELSE $4 END, \
                state_reason = CASE WHEN state = $2 THEN state_reason ELSE $3 END, \
                failing_since = CASE WHEN $2 = 'enabled' THEN NULL ELSE failing_since END \
         WHERE id = $1 RETURNING {HANDLER_COLUMNS}"
    ))
    .bind(id)
    .bind(state.as_str())
    .bind(reason)
    .bind(from_micros(to_micros(Utc::now())))
    .fetch_one(&mut *tx)
    .await
    .map_err(map_err)?;
    let handler = handler_from_row(&row)?;
    let was = HandlerState::parse(&was);
    let mut told = None;
    if let Some(e) = (was != handler.state)
        .then(|| crate::operational::state_changed(&handler, true, Utc::now()))
        .flatten()
    {
        let plan = crate::common::PublishPlan::operational(vec![e], lanes)?;
        let (outcome, _) = super::publish::publish_in(&mut tx, None, plan).await?;
        told = Some(outcome);
    }
    tx.commit().await.map_err(map_err)?;
    Ok((StateChange { handler, was }, told))
}

/// Read, merge, check, write: one transaction holding the row lock.
pub(super) async fn update_handler(
    pool: &PgPool,
    id: &str,
    patch: &HandlerPatch,
) -> Result<Handler> {
    let mut tx = pool.begin().await.map_err(map_err)?;
    let row = sqlx::query(&format!(
        "SELECT {HANDLER_COLUMNS} FROM handlers WHERE id = $1 FOR UPDATE"
    ))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await
    .map_err(map_err)?
    .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    let h = handler_from_row(&row)?.patched(patch)?;
    sqlx::query(
        "UPDATE handlers SET name = $2, url = $3, event_types = $4, max_attempts = $5, \
                timeout_ms = $6, max_in_flight = $7, rate_limit_per_s = $8, rate_limit_burst = $9, \
                filter = $10::jsonb \
         WHERE id = $1",
    )
    .bind(id)
    .bind(&h.name)
    .bind(&h.url)
    .bind(&h.event_types)
    .bind(i32::try_from(h.max_attempts).unwrap_or(i32::MAX))
    .bind(i64::try_from(h.timeout_ms).unwrap_or(i64::MAX))
    .bind(i32::try_from(h.max_in_flight).unwrap_or(i32::MAX))
    .bind(
        h.rate_limit
            .map(|r| i32::try_from(r.per_second).unwrap_or(i32::MAX)),
    )
    .bind(
        h.rate_limit
            .map(|r| i32::try_from(r.burst).unwrap_or(i32::MAX)),
    )
    .bind(h.filter.as_ref().map(Filter::to_stored))
    .execute(&mut *tx)
    .await
    .map_err(map_err)?;
    tx.commit().await.map_err(map_err)?;
    Ok(h)
}

pub(super) async fn rotate_handler_secret(
    pool: &PgPool,
    id: &str,
    secret: &str,
    previous_until: DateTime<Utc>,
) -> Result<Handler> {
    let row = sqlx::query(&format!(
        "UPDATE handlers SET previous_secret = secret, previous_secret_until = $3, secret = $2 \
         WHERE id = $1 RETURNING {HANDLER_COLUMNS}"
    ))
    .bind(id)
    .bind(secret)
    .bind(from_micros(to_micros(previous_until)))
    .fetch_optional(pool)
    .await
    .map_err(map_err)?
    .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    handler_from_row(&row)
}

pub(super) async fn mark_handler_failing(
    pool: &PgPool,
    id: &str,
    failing: bool,
    at: DateTime<Utc>,
) -> Result<()> {
    let n = sqlx::query(
        "UPDATE handlers SET failing_since = CASE WHEN $2 THEN coalesce(failing_since, $3) END \
         WHERE id = $1",
    )
    .bind(id)
    .bind(failing)
    .bind(from_micros(to_micros(at)))
    .execute(pool)
    .await
    .map_err(map_err)?
    .rows_affected();
    crate::common::handler_found(n, id)
}

/// Rows one chunk of a handler delete reads in a lane, and one batch of its
/// dead letters removes (each its own short statement).
pub(crate) const DELETE_BATCH: i64 = 2_000;

/// Deletes the handler, then its pending deliveries, then its dead letters;
/// returns how many deliveries and dead letters were discarded.
///
/// The handler row goes first, in its own transaction: from its commit on,
/// publishes route nothing more to it (routes are matched in the publish
/// statement), no dead letter is written for it (`sql/dead_letter.sql`) and
/// nodes discard what is left of it. Its deliveries then go lane by lane,
/// each lane walked in `deliveries_claim (lane, xid)` order in chunks of
/// about [`DELETE_BATCH`] rows of any handler (`sql/delete_chunk.sql`), each
/// chunk its own statement. So a completion that meets one of the rows
/// waits for one chunk, not for the whole backlog (before, one transaction
/// held every row locked while it scanned the table, and the completions of
/// every node waited for it), and the whole delete reads `deliveries` once,
/// with no index on `handler_id` (which would cost WAL at every publish).
/// Its dead letters go in batches of [`DELETE_BATCH`] through
/// `dead_letters_handler (handler_id, id)`.
///
/// Deliveries before dead letters: a dead-letter statement that holds a
/// delivery row when a chunk meets it makes the chunk wait for its commit,
/// so the dead-letter batches, which start after the last chunk, see the
/// dead letter it wrote (test `postgres_only::
/// a_dead_letter_written_during_a_handler_delete_is_discarded_too`).
///
/// A delete interrupted after the handler row went (an error, a crash)
/// leaves the rest to the lane owners, which discard deliveries of an unknown
/// handler; a repeated delete of the same id answers `NotFound` and sweeps
/// what is left of it first.
/// Runs one statement of a handler delete, again when PostgreSQL aborted it
/// for a deadlock (`40P01`: the lane owners discard a deleted handler's rows
/// they hold, in another order), a serialization failure (`40001`) or its
/// lock timeout (`55P03`): the statement changed nothing then, and the
/// handler row is already gone, so only the sweep is left to finish. At most
/// [`DELETE_RETRIES`] more times, 20 ms apart, then the error.
async fn retry_conflicts<T, F, Fut>(mut statement: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, sqlx::Error>>,
{
    let mut tries = 0;
    loop {
        match statement().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                let code = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .map(|c| c.into_owned());
                let conflict = matches!(code.as_deref(), Some("40P01" | "40001" | "55P03"));
                if !conflict || tries >= DELETE_RETRIES {
                    return Err(map_err(e));
                }
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    }
}

/// Repeats of one statement of a handler delete after a conflict.
const DELETE_RETRIES: u32 = 10;

pub(super) async fn delete_handler(pool: &PgPool, id: &str) -> Result<DeletedHandler> {
    // The counts are taken with the handler's removal, in one snapshot: the
    // lane owners that notice the delete first discard some rows themselves
    // while the walk below runs, and those were discarded by this delete too.
    // (The deliveries count reads the table once; a delete is rare.)
    let (removed, pending, dead): (i64, i64, i64) = sqlx::query_as(
        "WITH h AS (DELETE FROM handlers WHERE id = $1 RETURNING id) \
         SELECT (SELECT count(*) FROM h), \
                (SELECT count(*) FROM deliveries WHERE handler_id = $1), \
                (SELECT count(*) FROM dead_letters WHERE handler_id = $1)",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .map_err(map_err)?;
    let lanes: Vec<i32> = sqlx::query_scalar("SELECT lane FROM lanes ORDER BY lane")
        .fetch_all(pool)
        .await
        .map_err(map_err)?;
    let mut deliveries = 0u64;
    for lane in lanes {
        let mut lo = i64::MIN;
        loop {
            let (hi, n): (Option<i64>, i64) = retry_conflicts(|| {
                sqlx::query_as(include_str!("sql/delete_chunk.sql"))
                    .bind(lane)
                    .bind(lo)
                    .bind(id)
                    .bind(DELETE_BATCH)
                    .fetch_one(pool)
            })
            .await?;
            deliveries += n as u64;
            match hi {
                Some(hi) => lo = hi,
                None => break,
            }
        }
    }
    let mut dead_letters = 0u64;
    loop {
        let done = retry_conflicts(|| {
            sqlx::query(
                "DELETE FROM dead_letters WHERE id IN \
                 (SELECT id FROM dead_letters WHERE handler_id = $1 LIMIT $2)",
            )
            .bind(id)
            .bind(DELETE_BATCH)
            .execute(pool)
        })
        .await?
        .rows_affected();
        dead_letters += done;
        if done == 0 {
            break;
        }
    }
    if removed == 0 {
        return Err(StoreError::NotFound(format!("handler {id}")));
    }
    // What the walk found beyond the counts committed after their snapshot.
    Ok(DeletedHandler {
        deliveries: deliveries.max(u64::try_from(pending).unwrap_or_default()),
        dead_letters: dead_letters.max(u64::try_from(dead).unwrap_or_default()),
    })
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
                epoch: epoch_from_db(epoch)?,
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

pub(super) async fn lookup_event(pool: &PgPool, id: &str) -> Result<Option<EventLookup>> {
    type EventRow = (String, Option<String>, i32, Option<i64>, DateTime<Utc>, i64);
    let row: Option<EventRow> = sqlx::query_as(
        "SELECT type, key, lane, seq, published_at, octet_length(payload)::bigint \
         FROM events WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
    .map_err(map_err)?;
    let Some((event_type, key, lane, seq, published_at, size)) = row else {
        return Ok(None);
    };
    let columns = (event_type, key, i64::from(lane), seq, published_at, size);
    let mut event = crate::common::event_lookup(id, columns)?;
    // A completion is written after its event's publish, on the same
    // server clock; the minute only bounds the BRIN range scan.
    let since = published_at - chrono::Duration::minutes(1);
    type RecordRow = (
        String,
        String,
        Option<String>,
        i32,
        DateTime<Utc>,
        Option<String>,
        Option<String>,
    );
    let rows: Vec<RecordRow> = sqlx::query_as(include_str!("sql/lookup_event.sql"))
        .bind(id)
        .bind(lane)
        .bind(since)
        .fetch_all(pool)
        .await
        .map_err(map_err)?;
    for (kind, handler_id, name, attempts, at, last_error, log) in rows {
        let attempts = to_u32(i64::from(attempts));
        let log = crate::common::attempt_log(log.as_deref())?;
        let state = crate::common::delivery_state(&kind, attempts, at, last_error, log)?;
        event.add(handler_id, name, state);
    }
    Ok(Some(event))
}

pub(super) async fn handler_deliveries(
    pool: &PgPool,
    q: &HandlerDeliveriesQuery,
) -> Result<Vec<HandlerDeliveryItem>> {
    let pending = match q.state {
        DeliveryListState::Pending => true,
        DeliveryListState::Dead => false,
        DeliveryListState::Completed => return handler_completions(pool, q).await,
    };
    let rows: Vec<crate::common::RecordRow<DateTime<Utc>>> =
        sqlx::query_as(include_str!("sql/handler_records.sql"))
            .bind(&q.handler_id)
            .bind(crate::common::id_before(&q.after)?)
            .bind(&q.key)
            .bind(i64::from(q.limit.max(1)))
            .bind(pending)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
    crate::common::record_items(rows, |t| t)
}

/// Completions newest first over windows going back from the cursor (see
/// [`Store::handler_deliveries`]): the BRIN index narrows a range scan by
/// time, not by handler, so each window costs its rows of every handler.
async fn handler_completions(
    pool: &PgPool,
    q: &HandlerDeliveriesQuery,
) -> Result<Vec<HandlerDeliveryItem>> {
    type Row = (
        String,
        Option<String>,
        Option<String>,
        Option<i64>,
        Option<i32>,
        i32,
        DateTime<Utc>,
    );
    let cursor = crate::common::completed_before(&q.after)?;
    let top = match &cursor {
        Some((at, _)) => *at,
        None => sqlx::query_scalar("SELECT now()")
            .fetch_one(pool)
            .await
            .map_err(map_err)?,
    };
    let (cursor_at, cursor_event) = cursor.unzip();
    let want = q.limit.max(1) as usize;
    let mut items = Vec::new();
    let mut end: Option<DateTime<Utc>> = None;
    let mut width = chrono::Duration::minutes(1);
    loop {
        let start = (top - width).max(q.completed_since);
        let rows: Vec<Row> = sqlx::query_as(include_str!("sql/handler_completed.sql"))
            .bind(&q.handler_id)
            .bind(start)
            .bind(end)
            .bind(cursor_at)
            .bind(&cursor_event)
            .bind(&q.key)
            .bind((want - items.len()) as i64)
            .fetch_all(pool)
            .await
            .map_err(map_err)?;
        for (event_id, ty, key, seq, lane, attempts, at) in rows {
            let state = DeliveryState::Completed {
                completed_at: at,
                attempts: to_u32(i64::from(attempts)),
            };
            let lane = lane.map(i64::from);
            items.push(crate::common::delivery_item(
                event_id, ty, key, seq, lane, None, state,
            )?);
        }
        if items.len() >= want || start <= q.completed_since {
            return Ok(items);
        }
        end = Some(start);
        width = width * 2;
    }
}
