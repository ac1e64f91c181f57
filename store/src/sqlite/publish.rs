//! Publish: duplicates, per-key sequence numbers, event rows, deliveries.
//!
//! Statements per publish, or per group of concurrent publishes
//! ([`crate::group`]), inside one `BEGIN IMMEDIATE` transaction: one
//! stored-id check (only when the batch has client-supplied ids), one
//! key-counter upsert (only when the batch has keys), one multi-row event
//! insert per [`EVENT_CHUNK`] events, one delivery insert for the handlers
//! without a payload filter, one read of the handlers with one (an empty
//! index read when there are none) and, when any of their filters
//! matched, one more delivery insert; first, one read of the catalog
//! version ([`checked`]).
//!
//! Expected sequences ([`crate::NewEvent::expected_seq`]) are checked right
//! after the key-counter upsert, under the write lock, so the numbers seen
//! are the keys' current ones; a broken one ends the write before any
//! event is inserted, and the transaction is rolled back (inside a
//! caller's transaction: a savepoint around the batch, so the caller's
//! transaction stays usable).

use std::collections::{HashMap, HashSet};

use chrono::Utc;
use sqlx::{Connection as _, SqliteConnection};

use super::error::map_err;
use super::event_types::checked;
use super::SqliteStore;
use crate::common::{check_expected, to_micros, PublishPlan};
use crate::event_types::Cache;
use crate::filter::{Filter, Payload};
use crate::{route, PublishOutcome, Result, StoreError};

/// One new event as `sql/insert_deliveries.sql` reads it: its id, its
/// `deliver_at` (µs) and its cataloged type's aliases.
type DeliveryArg<'a> = (&'a str, Option<i64>, Option<&'a [String]>);

/// Events per multi-row insert (7 parameters each; SQLite allows 32,766).
const EVENT_CHUNK: usize = 500;

/// One write of [`Store::publish`](crate::Store::publish) (a group of
/// batches, see [`crate::group`]) in a write transaction of its own.
/// Returns the ids found already stored.
pub(super) async fn write(store: &SqliteStore, plan: &PublishPlan) -> Result<HashSet<String>> {
    let (_guard, mut tx) = store.begin_write().await?;
    match write_in(&mut tx, &store.catalog, plan).await {
        Ok(stored) => {
            tx.commit().await.map_err(map_err)?;
            Ok(stored)
        }
        Err(e) => {
            // Now, not when the connection is next used: the next writer
            // waits for the file's write lock (a broken expectation is an
            // everyday refusal).
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

/// Writes a validated batch on `conn`, which must be inside a write
/// transaction (the caller's, for [`SqliteStore::publish_in`]). Returns the
/// outcome; the caller commits.
pub(super) async fn publish_in(
    conn: &mut SqliteConnection,
    catalog: &Cache,
    mut plan: PublishPlan,
) -> Result<PublishOutcome> {
    let stored = if plan.expects() {
        // A broken expectation rolls back the batch's writes only.
        let mut savepoint = conn.begin().await.map_err(map_err)?;
        let stored = write_in(&mut savepoint, catalog, &plan).await;
        match stored {
            Ok(stored) => {
                savepoint.commit().await.map_err(map_err)?;
                stored
            }
            Err(e) => {
                savepoint.rollback().await.map_err(map_err)?;
                return Err(e);
            }
        }
    } else {
        write_in(conn, catalog, &plan).await?
    };
    plan.drop_stored(&stored);
    Ok(PublishOutcome {
        accepted: plan.fresh.len(),
        duplicates: plan.duplicates,
        lanes: plan.lanes(),
        ids: plan.ids,
    })
}

/// Writes `plan.fresh` but the ids already stored, which it returns, on
/// `conn` inside a write transaction, after checking it against the stored
/// catalog ([`checked`]).
async fn write_in(
    conn: &mut SqliteConnection,
    catalog: &Cache,
    plan: &PublishPlan,
) -> Result<HashSet<String>> {
    let mut plan = checked(conn, catalog, plan).await?;
    let client_ids = plan.client_ids();
    let mut stored = HashSet::new();
    if !client_ids.is_empty() {
        let found: Vec<String> = sqlx::query_scalar(include_str!("sql/stored_ids.sql"))
            .bind(json(&client_ids)?)
            .fetch_all(&mut *conn)
            .await
            .map_err(map_err)?;
        stored.extend(found);
    }
    if !stored.is_empty() {
        plan.to_mut().drop_stored(&stored);
    }
    if !plan.fresh.is_empty() {
        let seqs = assign_seqs(conn, &plan).await?;
        check_expected(plan.fresh.iter().zip(seqs.iter().copied()))?;
        insert_events(conn, &plan, &seqs).await?;
        let ids: Vec<DeliveryArg> = plan
            .fresh
            .iter()
            .map(|e| {
                (
                    e.id.as_str(),
                    e.deliver_at.map(to_micros),
                    e.aliases.as_deref(),
                )
            })
            .collect();
        sqlx::query(include_str!("sql/insert_deliveries.sql"))
            .bind(json(&ids)?)
            .bind(to_micros(Utc::now()))
            .execute(&mut *conn)
            .await
            .map_err(map_err)?;
        insert_filtered(conn, &plan).await?;
    }
    Ok(stored)
}

/// Inserts the deliveries of the handlers with a payload filter (which
/// `insert_deliveries.sql` skips) whose routes and filter match, in batch
/// order: per (handler, key) the ids follow the sequence numbers, as each
/// handler's rows come from one of the two statements only.
async fn insert_filtered(conn: &mut SqliteConnection, plan: &PublishPlan) -> Result<()> {
    let rows: Vec<(String, String, String)> =
        sqlx::query_as(include_str!("sql/filtered_handlers.sql"))
            .fetch_all(&mut *conn)
            .await
            .map_err(map_err)?;
    if rows.is_empty() {
        return Ok(());
    }
    let handlers = rows
        .into_iter()
        .map(|(id, types, filter)| {
            let types: Vec<String> = serde_json::from_str(&types)
                .map_err(|e| StoreError::Database(format!("handlers.event_types of {id}: {e}")))?;
            let filter = Filter::from_stored(&id, &filter)?;
            Ok((id, types, filter))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut pairs: Vec<(&str, &str, Option<i64>)> = Vec::new();
    for e in &plan.fresh {
        let mut payload = Payload::new(e.stored_payload());
        for (hid, types, filter) in &handlers {
            // A cataloged type's aliases match as the type does.
            let aliases = e.aliases.as_deref().unwrap_or_default();
            if (route::any_matches(types, &e.event_type)
                || aliases.iter().any(|a| route::any_matches(types, a)))
                && payload.passes(Some(filter))
            {
                pairs.push((&e.id, hid, e.deliver_at.map(to_micros)));
            }
        }
    }
    if !pairs.is_empty() {
        sqlx::query(include_str!("sql/insert_filtered.sql"))
            .bind(json(&pairs)?)
            .bind(to_micros(Utc::now()))
            .execute(&mut *conn)
            .await
            .map_err(map_err)?;
    }
    Ok(())
}

/// Raises the batch's key counters and returns each fresh event's sequence
/// number (`None` when unkeyed), in batch order.
async fn assign_seqs(conn: &mut SqliteConnection, plan: &PublishPlan) -> Result<Vec<Option<i64>>> {
    let (keys, counts) = plan.key_counts();
    if keys.is_empty() {
        return Ok(vec![None; plan.fresh.len()]);
    }
    let pairs: Vec<(&String, i64)> = keys.iter().zip(counts.iter().copied()).collect();
    let rows: Vec<(String, i64)> = sqlx::query_as(include_str!("sql/bump_key_seqs.sql"))
        .bind(json(&pairs)?)
        .fetch_all(&mut *conn)
        .await
        .map_err(map_err)?;
    let tops: HashMap<String, i64> = rows.into_iter().collect();
    plan.fresh
        .iter()
        .zip(plan.seq_offsets())
        .map(|(e, off)| match &e.key {
            Some(k) => tops.get(k).map(|top| Some(top - off)).ok_or_else(|| {
                StoreError::Database(format!("key counter for {k:?} was not returned"))
            }),
            None => Ok(None),
        })
        .collect()
}

async fn insert_events(
    conn: &mut SqliteConnection,
    plan: &PublishPlan,
    seqs: &[Option<i64>],
) -> Result<()> {
    let now = to_micros(Utc::now());
    for (chunk, chunk_seqs) in plan.fresh.chunks(EVENT_CHUNK).zip(seqs.chunks(EVENT_CHUNK)) {
        let mut sql = String::from(
            "INSERT INTO events (id, type, key, lane, seq, payload, published_at) VALUES ",
        );
        for i in 0..chunk.len() {
            sql.push_str(if i == 0 {
                "(?,?,?,?,?,?,?)"
            } else {
                ",(?,?,?,?,?,?,?)"
            });
        }
        let mut q = sqlx::query(&sql);
        for (e, seq) in chunk.iter().zip(chunk_seqs) {
            q = q
                .bind(&e.id)
                .bind(&e.event_type)
                .bind(&e.key)
                .bind(i64::from(e.lane))
                .bind(*seq)
                .bind(e.stored_payload())
                .bind(now);
        }
        q.execute(&mut *conn).await.map_err(map_err)?;
    }
    Ok(())
}

pub(super) fn json<T: serde::Serialize + ?Sized>(v: &T) -> Result<String> {
    serde_json::to_string(v)
        .map_err(|e| StoreError::Database(format!("encoding statement parameters: {e}")))
}
