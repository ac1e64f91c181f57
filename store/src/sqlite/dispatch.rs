//! Dispatch: fencing, claims, completions, reschedules, dead letters, replay.
//!
//! Every write is conditioned on the lane's epoch by a join with `lanes` in
//! the same statement; the batched inputs travel as one JSON array parameter
//! (`json_each`), so each operation is one or two statements whatever the
//! batch size.

use std::collections::{HashMap, HashSet};

use chrono::Utc;
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use super::error::map_err;
use super::publish::json;
use crate::common::{epoch_from_db, epoch_to_db, from_micros, to_micros, to_u32};
use crate::*;

/// Lanes per claim statement (3 parameters and one `UNION ALL` member each;
/// SQLite allows 500 members).
const CLAIM_CHUNK: usize = 64;

pub(super) async fn fence(
    conn: &mut SqliteConnection,
    lane: Lane,
    owner: &str,
    epoch: Epoch,
) -> Result<bool> {
    sqlx::query("UPDATE lanes SET epoch = ?1, owner = ?2 WHERE lane = ?3 AND epoch < ?1")
        .bind(epoch_to_db(epoch)?)
        .bind(owner)
        .bind(i64::from(lane))
        .execute(&mut *conn)
        .await
        .map_err(map_err)?;
    let row: Option<(Option<String>, i64)> =
        sqlx::query_as("SELECT owner, epoch FROM lanes WHERE lane = ?1")
            .bind(i64::from(lane))
            .fetch_optional(&mut *conn)
            .await
            .map_err(map_err)?;
    Ok(match row {
        Some((Some(o), e)) => o == owner && epoch_from_db(e)? == epoch,
        _ => false,
    })
}

/// Reads the requested lanes inside the caller's read transaction.
pub(super) async fn claim(
    conn: &mut SqliteConnection,
    claims: &[LaneClaim],
) -> Result<Vec<LaneBatch>> {
    let lanes: Vec<i64> = claims.iter().map(|c| i64::from(c.lane)).collect();
    let epochs: HashMap<i64, Epoch> = sqlx::query_as::<_, (i64, i64)>(
        "SELECT lane, epoch FROM lanes WHERE lane IN (SELECT value FROM json_each(?1))",
    )
    .bind(json(&lanes)?)
    .fetch_all(&mut *conn)
    .await
    .map_err(map_err)?
    .into_iter()
    .map(|(lane, epoch)| Ok((lane, epoch_from_db(epoch)?)))
    .collect::<Result<_>>()?;
    let mut batches: Vec<LaneBatch> = claims
        .iter()
        .map(|c| LaneBatch {
            lane: c.lane,
            owned: epochs.get(&i64::from(c.lane)) == Some(&c.epoch),
            deliveries: Vec::new(),
            next_after: c.after.clone(),
        })
        .collect();
    let owned: Vec<(usize, &LaneClaim)> = claims
        .iter()
        .enumerate()
        .filter(|(i, c)| batches[*i].owned && c.limit > 0)
        .collect();
    for chunk in owned.chunks(CLAIM_CHUNK) {
        let member = include_str!("sql/claim_member.sql");
        let mut sql = String::with_capacity(chunk.len() * (member.len() + 12));
        for i in 0..chunk.len() {
            if i > 0 {
                sql.push_str("\nUNION ALL\n");
            }
            sql.push_str(member);
        }
        let mut q = sqlx::query(&sql);
        for (i, c) in chunk {
            q = q
                .bind(*i as i64)
                .bind(i64::from(c.lane))
                .bind(c.after.pos)
                .bind(i64::from(c.limit));
        }
        for row in q.fetch_all(&mut *conn).await.map_err(map_err)? {
            let slot: i64 = row.try_get("slot").map_err(map_err)?;
            let i = usize::try_from(slot)
                .ok()
                .filter(|&i| i < batches.len())
                .ok_or_else(|| StoreError::Database(format!("claim row for slot {slot}")))?;
            let d = delivery_from_row(&row, claims[i].epoch)?;
            let b = &mut batches[i];
            b.next_after.pos = b.next_after.pos.max(d.id);
            b.deliveries.push(d);
        }
    }
    for b in &mut batches {
        b.deliveries.sort_by_key(|d| d.id);
    }
    Ok(batches)
}

fn delivery_from_row(row: &SqliteRow, epoch: Epoch) -> Result<Delivery> {
    let lane: i64 = row.try_get("lane").map_err(map_err)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(map_err)?;
    Ok(Delivery {
        id: row.try_get("id").map_err(map_err)?,
        lane: Lane::try_from(lane)
            .map_err(|_| StoreError::Database(format!("lane {lane} out of range")))?,
        epoch,
        handler_id: row.try_get("handler_id").map_err(map_err)?,
        event_id: row.try_get("event_id").map_err(map_err)?,
        event_type: row.try_get("type").map_err(map_err)?,
        key: row.try_get("key").map_err(map_err)?,
        seq: row.try_get("seq").map_err(map_err)?,
        attempts: to_u32(row.try_get("attempts").map_err(map_err)?),
        due_at: from_micros(row.try_get("due_at").map_err(map_err)?),
        last_error: row.try_get("last_error").map_err(map_err)?,
        payload: payload.into(),
        published_at: from_micros(row.try_get("published_at").map_err(map_err)?),
        replay: row
            .try_get::<Option<i64>, _>("replay")
            .map_err(map_err)?
            .is_some_and(|r| r != 0),
    })
}

/// Keeps the first occurrence of each id (a repeated ref would otherwise
/// append two completion rows).
fn first_by_id<T, F: Fn(&T) -> i64>(items: &[T], id: F) -> Vec<&T> {
    let mut seen = HashSet::with_capacity(items.len());
    items.iter().filter(|i| seen.insert(id(i))).collect()
}

pub(super) async fn complete(
    conn: &mut SqliteConnection,
    done: &[DeliveryRef],
) -> Result<Vec<i64>> {
    let refs: Vec<(i64, Lane, i64, u32)> = first_by_id(done, |r| r.id)
        .into_iter()
        .map(|r| Ok((r.id, r.lane, epoch_to_db(r.epoch)?, r.attempts)))
        .collect::<Result<_>>()?;
    let refs = json(&refs)?;
    let now = to_micros(Utc::now());
    for sql in [
        include_str!("sql/complete_insert.sql"),
        include_str!("sql/late_insert.sql"),
    ] {
        sqlx::query(sql)
            .bind(&refs)
            .bind(now)
            .execute(&mut *conn)
            .await
            .map_err(map_err)?;
    }
    delete_fenced(conn, &refs).await
}

/// Fenced delete without completion rows (`Store::discard`).
pub(super) async fn discard(conn: &mut SqliteConnection, refs: &[DeliveryRef]) -> Result<Vec<i64>> {
    let refs: Vec<(i64, Lane, i64)> = first_by_id(refs, |r| r.id)
        .into_iter()
        .map(|r| Ok((r.id, r.lane, epoch_to_db(r.epoch)?)))
        .collect::<Result<_>>()?;
    delete_fenced(conn, &json(&refs)?).await
}

async fn delete_fenced(conn: &mut SqliteConnection, refs_json: &str) -> Result<Vec<i64>> {
    let mut ids: Vec<i64> = sqlx::query_scalar(include_str!("sql/delete_fenced.sql"))
        .bind(refs_json)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_err)?;
    ids.sort_unstable();
    Ok(ids)
}

pub(super) async fn reschedule(
    conn: &mut SqliteConnection,
    items: &[Reschedule],
) -> Result<Vec<i64>> {
    type Row<'a> = (i64, Lane, i64, u32, i64, &'a str, Option<&'a FailedAttempt>);
    let rows: Vec<Row> = first_by_id(items, |r| r.id)
        .into_iter()
        .map(|r| {
            Ok((
                r.id,
                r.lane,
                epoch_to_db(r.epoch)?,
                r.attempts,
                to_micros(r.due_at),
                r.last_error.as_str(),
                r.failure.as_ref(),
            ))
        })
        .collect::<Result<_>>()?;
    let mut ids: Vec<i64> = sqlx::query_scalar(include_str!("sql/reschedule.sql"))
        .bind(json(&rows)?)
        .bind(ATTEMPT_LOG_LEN as i64)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_err)?;
    ids.sort_unstable();
    Ok(ids)
}

pub(super) async fn dead_letter(
    conn: &mut SqliteConnection,
    items: &[DeadLetterRequest],
) -> Result<Vec<i64>> {
    type Row<'a> = (i64, Lane, i64, u32, &'a str, Option<&'a FailedAttempt>);
    let rows: Vec<Row> = first_by_id(items, |r| r.id)
        .into_iter()
        .map(|r| {
            let failure = r.failure.as_ref();
            Ok((
                r.id,
                r.lane,
                epoch_to_db(r.epoch)?,
                r.attempts,
                r.last_error.as_str(),
                failure,
            ))
        })
        .collect::<Result<_>>()?;
    let rows = json(&rows)?;
    sqlx::query(include_str!("sql/dead_letter_insert.sql"))
        .bind(&rows)
        .bind(to_micros(Utc::now()))
        .bind(ATTEMPT_LOG_LEN as i64)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?;
    delete_fenced(conn, &rows).await
}

pub(super) async fn replay_dead_letters(
    conn: &mut SqliteConnection,
    ids: &[i64],
    handler_id: Option<&str>,
    failed_since: Option<chrono::DateTime<Utc>>,
    failed_until: Option<chrono::DateTime<Utc>>,
) -> Result<u64> {
    let since = failed_since.map(to_micros);
    let until = failed_until.map(to_micros);
    let now = to_micros(Utc::now());
    let ids = if ids.is_empty() {
        None
    } else {
        Some(json(ids)?)
    };
    let replayed = sqlx::query(include_str!("sql/replay_insert.sql"))
        .bind(&ids)
        .bind(handler_id)
        .bind(now)
        .bind(since)
        .bind(until)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    let removed = sqlx::query(include_str!("sql/replay_delete.sql"))
        .bind(&ids)
        .bind(handler_id)
        .bind(now)
        .bind(since)
        .bind(until)
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    if removed != replayed {
        return Err(StoreError::Database(format!(
            "replay moved {replayed} dead letters but removed {removed}"
        )));
    }
    Ok(replayed)
}

pub(super) async fn recover(
    conn: &mut SqliteConnection,
    handler_id: &str,
    since: chrono::DateTime<Utc>,
) -> Result<RecoverOutcome> {
    let since = to_micros(since);
    let (completed, found): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(e.id) FROM \
         (SELECT DISTINCT event_id FROM completions WHERE handler_id = ?1 AND completed_at >= ?2) c \
         LEFT JOIN events e ON e.id = c.event_id",
    )
    .bind(handler_id)
    .bind(since)
    .fetch_one(&mut *conn)
    .await
    .map_err(map_err)?;
    let recovered = sqlx::query(include_str!("sql/recover_insert.sql"))
        .bind(handler_id)
        .bind(since)
        .bind(to_micros(Utc::now()))
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    let n = |v: i64| u64::try_from(v).unwrap_or_default();
    Ok(RecoverOutcome {
        recovered,
        already_pending: n(found).saturating_sub(recovered),
        pruned: n(completed - found),
    })
}

pub(super) async fn prune(
    conn: &mut SqliteConnection,
    before: chrono::DateTime<Utc>,
    limit: u32,
) -> Result<Pruned> {
    let before = to_micros(before);
    // Oldest first (rowid order is completion order for these append-only
    // tables); only completions are counted. The scan stops at the first
    // row young enough to keep (it read the whole table under the write
    // lock whenever fewer than `limit` rows qualified).
    let mut completions = 0;
    for table in ["completions", "late_completions"] {
        let removed = sqlx::query(&format!(
            "DELETE FROM {table} WHERE rowid IN \
             (SELECT rowid FROM {table} WHERE completed_at < ?1 AND rowid < coalesce(\
                (SELECT y.rowid FROM {table} y WHERE y.completed_at >= ?1 ORDER BY y.rowid LIMIT 1), \
                9223372036854775807) \
              ORDER BY rowid LIMIT ?2)"
        ))
        .bind(before)
        .bind(i64::from(limit))
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
        if table == "completions" {
            completions = removed;
        }
    }
    let events = sqlx::query(include_str!("sql/prune_events.sql"))
        .bind(before)
        .bind(i64::from(limit))
        .execute(&mut *conn)
        .await
        .map_err(map_err)?
        .rows_affected();
    Ok(Pruned {
        completions,
        events,
    })
}

/// [`Store::wakeups`](crate::Store::wakeups): SQLite has no notification
/// between processes, so lane owners poll.
pub(super) fn wakeups() -> Result<Wakeups> {
    Ok(Wakeups::Poll)
}
