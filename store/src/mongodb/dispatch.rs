//! Dispatch: fencing, claims, completions, reschedules, dead letters, replay.
//!
//! Every fenced write runs in a transaction that first writes the lane
//! documents it relies on ([`fenced_lanes`]), so a concurrent fence either
//! write-conflicts with it (and the batch is retried and sees the new epoch)
//! or waits for it (see the module docs of `mongodb`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use ::mongodb::bson::{doc, Bson, Document};
use ::mongodb::ClientSession;
use chrono::Utc;
use futures::{StreamExt, TryStreamExt};

use super::publish::{bump, delivery_doc, lane_counter};
use super::{
    appended_log, get_int, get_lane, get_opt_int, get_opt_string, get_string, map_err, names,
    MongoStore, TxnResult, FULL_BATCH,
};
use crate::common::{epoch_from_db, epoch_to_db, from_micros, to_micros, to_u32};
use crate::wake::Woken;
use crate::*;

/// Rounds of candidate events one prune batch reads at most (kept events
/// are passed over, see [`prune`]).
const PRUNE_ROUNDS: usize = 8;

/// The last event a retention batch read: `(published_at µs, id)`; the next
/// batch reads on after it (see [`prune`]).
pub(crate) type PruneResume = (i64, String);

/// Lanes per claim aggregation (one `$unionWith` stage each; MongoDB limits
/// a pipeline to 1,000 stages).
const CLAIM_CHUNK: usize = 64;

/// Raises the lane's epoch to `epoch` for `owner` (write concern majority)
/// and confirms it with a read at read concern majority in the same causally
/// consistent session, so it reads its own write and nothing a rollback
/// could take back: a fence is reported held only once it is durable on a
/// majority, and a competing fence another node wrote is seen only then.
pub(super) async fn fence(s: &MongoStore, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool> {
    let stored = epoch_to_db(epoch)?;
    let lanes = s.coll(names::LANES);
    let mut session = s
        .client()
        .start_session()
        .causal_consistency(true)
        .await
        .map_err(map_err)?;
    lanes
        .update_one(
            doc! { "_id": i32::from(lane), "epoch": { "$lt": stored } },
            doc! { "$set": { "epoch": stored, "owner": owner } },
        )
        .write_concern(::mongodb::options::WriteConcern::majority())
        .session(&mut session)
        .await
        .map_err(map_err)?;
    let row = lanes
        .find_one(doc! { "_id": i32::from(lane) })
        .read_concern(::mongodb::options::ReadConcern::majority())
        .session(&mut session)
        .await
        .map_err(map_err)?;
    Ok(match row {
        Some(d) => d.get_str("owner").ok() == Some(owner) && get_int(&d, "epoch")? == stored,
        None => false,
    })
}

/// Reads the requested lanes inside the caller's snapshot transaction.
pub(super) async fn claim(
    s: &MongoStore,
    session: &mut ClientSession,
    claims: &[LaneClaim],
) -> TxnResult<Vec<LaneBatch>> {
    let lane_ids: Vec<i32> = claims.iter().map(|c| i32::from(c.lane)).collect();
    let epochs = lane_epochs(s, session, &lane_ids).await?;
    let mut batches: Vec<LaneBatch> = claims
        .iter()
        .map(|c| LaneBatch {
            lane: c.lane,
            owned: epochs.get(&c.lane) == Some(&c.epoch),
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
        let mut pipeline: Vec<Document> = Vec::with_capacity(chunk.len() + 4);
        for (n, (slot, c)) in chunk.iter().enumerate() {
            let sub = vec![
                doc! { "$match": { "lane": i32::from(c.lane), "pos": { "$gt": c.after.pos } } },
                doc! { "$sort": { "pos": 1 } },
                doc! { "$limit": i64::from(c.limit) },
                // Not needed to attempt a delivery.
                doc! { "$project": { "attempt_log": 0 } },
                doc! { "$addFields": { "slot": *slot as i64 } },
            ];
            if n == 0 {
                pipeline.extend(sub);
            } else {
                pipeline
                    .push(doc! { "$unionWith": { "coll": names::DELIVERIES, "pipeline": sub } });
            }
        }
        pipeline.push(doc! { "$lookup": {
            "from": names::EVENTS, "localField": "event_id", "foreignField": "_id", "as": "event",
        } });
        let rows: Vec<Document> = s
            .coll(names::DELIVERIES)
            .aggregate(pipeline)
            .batch_size(FULL_BATCH)
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        for row in rows {
            let slot = get_int(&row, "slot")?;
            let i = usize::try_from(slot)
                .ok()
                .filter(|&i| i < batches.len())
                .ok_or_else(|| StoreError::Database(format!("claim row for slot {slot}")))?;
            let pos = get_int(&row, "pos")?;
            let b = &mut batches[i];
            b.next_after.pos = b.next_after.pos.max(pos);
            b.deliveries.push(delivery_from_doc(&row, claims[i].epoch)?);
        }
    }
    for b in &mut batches {
        b.deliveries.sort_by_key(|d| d.id);
    }
    Ok(batches)
}

async fn lane_epochs(
    s: &MongoStore,
    session: &mut ClientSession,
    lanes: &[i32],
) -> TxnResult<HashMap<Lane, Epoch>> {
    let rows: Vec<Document> = s
        .coll(names::LANES)
        .find(doc! { "_id": { "$in": lanes } })
        .projection(doc! { "epoch": 1 })
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?;
    let mut out = HashMap::with_capacity(rows.len());
    for r in &rows {
        out.insert(get_lane(r, "_id")?, epoch_from_db(get_int(r, "epoch")?)?);
    }
    Ok(out)
}

fn delivery_from_doc(d: &Document, epoch: Epoch) -> Result<Delivery> {
    let event = d
        .get_array("event")
        .ok()
        .and_then(|a| a.first())
        .and_then(Bson::as_document)
        .ok_or_else(|| {
            StoreError::Database(format!("delivery {:?} has no event document", d.get("_id")))
        })?;
    let payload = event
        .get_binary_generic("payload")
        .map_err(|e| StoreError::Database(format!("events.payload: {e}")))?
        .clone();
    Ok(Delivery {
        id: get_int(d, "_id")?,
        lane: get_lane(d, "lane")?,
        epoch,
        handler_id: get_string(d, "handler_id")?,
        event_id: get_string(d, "event_id")?,
        event_type: get_string(event, "type")?,
        key: get_opt_string(d, "key")?,
        seq: get_opt_int(d, "seq")?,
        attempts: to_u32(get_int(d, "attempts")?),
        due_at: from_micros(get_int(d, "due_at")?),
        last_error: get_opt_string(d, "last_error")?,
        payload: payload.into(),
        published_at: from_micros(get_int(event, "published_at")?),
        replay: d.get_bool("replay").unwrap_or(false),
    })
}

/// Reads the epochs of the lanes of `pairs` in the transaction's snapshot
/// and writes the lane documents whose epoch is the requested one
/// (`$inc: {writes: 1}`); returns those `(lane, epoch)` pairs.
///
/// The write is what makes a concurrent fence conflict with (or wait for)
/// this transaction: a fence committed after the snapshot, or still open,
/// makes the write fail with a write conflict, and the retry reads the new
/// epoch. Lanes the caller does not own are not written.
async fn fenced_lanes(
    s: &MongoStore,
    session: &mut ClientSession,
    pairs: impl Iterator<Item = (Lane, Epoch)>,
) -> TxnResult<HashSet<(Lane, Epoch)>> {
    let pairs: HashSet<(Lane, Epoch)> = pairs.collect();
    let lanes: Vec<i32> = pairs
        .iter()
        .map(|(l, _)| i32::from(*l))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let epochs = lane_epochs(s, session, &lanes).await?;
    let owned: HashSet<(Lane, Epoch)> = pairs
        .into_iter()
        .filter(|(l, e)| epochs.get(l) == Some(e))
        .collect();
    if !owned.is_empty() {
        let owned_lanes: Vec<i32> = owned.iter().map(|(l, _)| i32::from(*l)).collect();
        s.coll(names::LANES)
            .update_many(
                doc! { "_id": { "$in": owned_lanes } },
                doc! { "$inc": { "writes": 1i64 } },
            )
            .session(&mut *session)
            .await?;
    }
    Ok(owned)
}

/// Keeps the first occurrence of each id (a repeated ref would otherwise
/// append two completion records).
fn first_by_id<T, F: Fn(&T) -> i64>(items: &[T], id: F) -> Vec<&T> {
    let mut seen = HashSet::with_capacity(items.len());
    items.iter().filter(|i| seen.insert(id(i))).collect()
}

/// The pending delivery documents of `refs` (id, lane, epoch) whose lane is
/// fenced to the caller, by id. Writes the lane documents (see
/// [`fenced_lanes`]).
async fn fenced_deliveries(
    s: &MongoStore,
    session: &mut ClientSession,
    refs: &[(i64, Lane, Epoch)],
) -> TxnResult<BTreeMap<i64, Document>> {
    let owned = fenced_lanes(s, session, refs.iter().map(|r| (r.1, r.2))).await?;
    let wanted: HashMap<i64, Lane> = refs
        .iter()
        .filter(|r| owned.contains(&(r.1, r.2)))
        .map(|r| (r.0, r.1))
        .collect();
    if wanted.is_empty() {
        return Ok(BTreeMap::new());
    }
    let ids: Vec<i64> = wanted.keys().copied().collect();
    let docs: Vec<Document> = s
        .coll(names::DELIVERIES)
        .find(doc! { "_id": { "$in": ids } })
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?;
    let mut out = BTreeMap::new();
    for d in docs {
        let id = get_int(&d, "_id")?;
        // A ref naming another lane than the delivery's changes nothing.
        if wanted.get(&id) == Some(&get_lane(&d, "lane")?) {
            out.insert(id, d);
        }
    }
    Ok(out)
}

/// The first step of every fenced write (complete, discard, reschedule,
/// dead letter): the pending delivery documents of `items` (the first item
/// of each id) whose lane is fenced to the caller, read and deleted in the
/// caller's transaction, by id; and the items by id. Empty when none is.
async fn take_fenced<'a, T>(
    s: &MongoStore,
    session: &mut ClientSession,
    items: &'a [T],
    key: impl Fn(&T) -> (i64, Lane, Epoch),
) -> TxnResult<(HashMap<i64, &'a T>, BTreeMap<i64, Document>)> {
    let items = first_by_id(items, |i| key(i).0);
    let keys: Vec<(i64, Lane, Epoch)> = items.iter().map(|i| key(i)).collect();
    let found = fenced_deliveries(s, session, &keys).await?;
    if !found.is_empty() {
        let ids: Vec<i64> = found.keys().copied().collect();
        delete_deliveries(s, session, &ids).await?;
    }
    let by_id = items.into_iter().map(|i| (key(i).0, i)).collect();
    Ok((by_id, found))
}

async fn delete_deliveries(
    s: &MongoStore,
    session: &mut ClientSession,
    ids: &[i64],
) -> TxnResult<()> {
    let deleted = s
        .coll(names::DELIVERIES)
        .delete_many(doc! { "_id": { "$in": ids } })
        .session(&mut *session)
        .await?
        .deleted_count;
    if deleted != ids.len() as u64 {
        return Err(StoreError::Database(format!(
            "deleted {deleted} of {} deliveries read in the same transaction",
            ids.len()
        ))
        .into());
    }
    Ok(())
}

pub(super) async fn complete(
    s: &MongoStore,
    session: &mut ClientSession,
    done: &[DeliveryRef],
) -> TxnResult<Vec<i64>> {
    let (by_id, found) = take_fenced(s, session, done, |r| (r.id, r.lane, r.epoch)).await?;
    if found.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = found.keys().copied().collect();
    let now = to_micros(Utc::now());
    let records: Vec<Document> = found
        .iter()
        .map(|(id, d)| {
            Ok(doc! {
                "event_id": get_string(d, "event_id")?,
                "handler_id": get_string(d, "handler_id")?,
                "attempts": i64::from(by_id[id].attempts),
                "completed_at": now,
            })
        })
        .collect::<Result<_>>()?;
    s.coll(names::COMPLETIONS)
        .insert_many(records)
        .session(&mut *session)
        .await?;
    Ok(ids)
}

/// Fenced delete without completion records (`Store::discard`).
pub(super) async fn discard(
    s: &MongoStore,
    session: &mut ClientSession,
    refs: &[DeliveryRef],
) -> TxnResult<Vec<i64>> {
    let (_, found) = take_fenced(s, session, refs, |r| (r.id, r.lane, r.epoch)).await?;
    Ok(found.into_keys().collect())
}

pub(super) async fn reschedule(
    s: &MongoStore,
    session: &mut ClientSession,
    items: &[Reschedule],
) -> TxnResult<Vec<i64>> {
    // Documents of different values cannot be updated in one statement
    // without a bulk write (MongoDB 8.0): replace them instead, delete plus
    // insert, two statements whatever the batch size.
    let (by_id, found) = take_fenced(s, session, items, |r| (r.id, r.lane, r.epoch)).await?;
    if found.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = found.keys().copied().collect();
    let replaced: Vec<Document> = found
        .into_iter()
        .map(|(id, mut d)| {
            let r = by_id[&id];
            d.insert("attempts", i64::from(r.attempts));
            d.insert("due_at", to_micros(r.due_at));
            d.insert("last_error", r.last_error.as_str());
            d.insert("attempt_log", appended_log(&d, r.failure.as_ref())?);
            Ok(d)
        })
        .collect::<Result<_>>()?;
    s.coll(names::DELIVERIES)
        .insert_many(replaced)
        .session(&mut *session)
        .await?;
    Ok(ids)
}

pub(super) async fn dead_letter(
    s: &MongoStore,
    session: &mut ClientSession,
    items: &[DeadLetterRequest],
) -> TxnResult<Vec<i64>> {
    let (by_id, found) = take_fenced(s, session, items, |r| (r.id, r.lane, r.epoch)).await?;
    if found.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = found.keys().copied().collect();
    // A deleted handler's delivery (left by a publish that read the handler
    // before the delete) goes without a dead letter: nobody could replay it
    // and it would keep its event from being pruned.
    let handler_ids: Vec<String> = found
        .values()
        .filter_map(|d| d.get_str("handler_id").ok().map(str::to_string))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    let known: HashSet<String> = strings_in(
        s,
        session,
        names::HANDLERS,
        doc! { "_id": { "$in": handler_ids } },
        "_id",
    )
    .await?
    .into_iter()
    .collect();
    let found: BTreeMap<i64, Document> = found
        .into_iter()
        .filter(|(_, d)| d.get_str("handler_id").is_ok_and(|h| known.contains(h)))
        .collect();
    if found.is_empty() {
        return Ok(ids);
    }
    let mut incs = BTreeMap::new();
    incs.insert(names::DEAD_LETTERS.to_string(), found.len() as i64);
    let mut next = bump(s, session, &incs).await?[names::DEAD_LETTERS];
    let now = to_micros(Utc::now());
    let letters: Vec<Document> = found
        .into_iter()
        .map(|(id, d)| {
            let r = by_id[&id];
            next += 1;
            Ok(doc! {
                "_id": next,
                "handler_id": d.get("handler_id").cloned().unwrap_or(Bson::Null),
                "event_id": d.get("event_id").cloned().unwrap_or(Bson::Null),
                "lane": d.get("lane").cloned().unwrap_or(Bson::Null),
                "key": d.get("key").cloned().unwrap_or(Bson::Null),
                "seq": d.get("seq").cloned().unwrap_or(Bson::Null),
                "attempts": i64::from(r.attempts),
                "last_error": r.last_error.as_str(),
                "failed_at": now,
                "attempt_log": appended_log(&d, r.failure.as_ref())?,
            })
        })
        .collect::<Result<_>>()?;
    s.coll(names::DEAD_LETTERS)
        .insert_many(letters)
        .session(&mut *session)
        .await?;
    Ok(ids)
}

/// Puts the selected dead letters back as fresh deliveries with new
/// positions (so the owner's cursor sees them); dead letters of a deleted
/// handler are not replayed.
pub(super) async fn replay_dead_letters(
    s: &MongoStore,
    session: &mut ClientSession,
    ids: &[i64],
    handler_id: Option<&str>,
    failed_since: Option<chrono::DateTime<Utc>>,
    failed_until: Option<chrono::DateTime<Utc>>,
) -> TxnResult<u64> {
    let mut filter = Document::new();
    if !ids.is_empty() {
        filter.insert("_id", doc! { "$in": ids });
    }
    if let Some(h) = handler_id {
        filter.insert("handler_id", h);
    }
    let mut failed = Document::new();
    if let Some(t) = failed_since {
        failed.insert("$gte", to_micros(t));
    }
    if let Some(t) = failed_until {
        failed.insert("$lt", to_micros(t));
    }
    if !failed.is_empty() {
        filter.insert("failed_at", failed);
    }
    let letters: Vec<Document> = s
        .coll(names::DEAD_LETTERS)
        .find(filter)
        .sort(doc! { "_id": 1 })
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?;
    let handler_ids: Vec<String> = letters
        .iter()
        .map(|d| get_string(d, "handler_id"))
        .collect::<Result<HashSet<_>>>()?
        .into_iter()
        .collect();
    let filter = doc! { "_id": { "$in": handler_ids } };
    let existing: HashSet<String> = strings_in(s, session, names::HANDLERS, filter, "_id")
        .await?
        .into_iter()
        .collect();
    let mut chosen = Vec::new();
    for d in letters {
        if existing.contains(&get_string(&d, "handler_id")?) {
            chosen.push(d);
        }
    }
    if chosen.is_empty() {
        return Ok(0);
    }
    // (lane, key, seq) order: the cursor is the position, so a key's
    // replays are claimed in sequence order.
    let mut sorted = Vec::with_capacity(chosen.len());
    for d in chosen {
        let order = (
            get_lane(&d, "lane")?,
            get_opt_string(&d, "key")?,
            get_opt_int(&d, "seq")?,
            get_int(&d, "_id")?,
        );
        sorted.push((order, d));
    }
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let chosen: Vec<Document> = sorted.into_iter().map(|(_, d)| d).collect();
    let mut incs: BTreeMap<String, i64> = BTreeMap::new();
    for d in &chosen {
        *incs.entry(lane_counter(get_lane(d, "lane")?)).or_default() += 1;
    }
    let mut next = bump(s, session, &incs).await?;
    let now = to_micros(Utc::now());
    let mut deliveries = Vec::with_capacity(chosen.len());
    for d in &chosen {
        let lane = get_lane(d, "lane")?;
        let pos = next.entry(lane_counter(lane)).or_default();
        *pos += 1;
        deliveries.push(delivery_doc(
            lane,
            *pos,
            &get_string(d, "handler_id")?,
            &get_string(d, "event_id")?,
            get_opt_string(d, "key")?.as_deref(),
            get_opt_int(d, "seq")?,
            now,
        ));
    }
    s.coll(names::DELIVERIES)
        .insert_many(deliveries)
        .session(&mut *session)
        .await?;
    let chosen_ids: Vec<i64> = chosen
        .iter()
        .map(|d| get_int(d, "_id"))
        .collect::<Result<_>>()?;
    s.coll(names::DEAD_LETTERS)
        .delete_many(doc! { "_id": { "$in": &chosen_ids } })
        .session(&mut *session)
        .await?;
    Ok(chosen_ids.len() as u64)
}

/// The documents of `coll` matching `filter`, with the fields of
/// `projection`, read in the transaction in one round trip.
async fn find_in(
    s: &MongoStore,
    session: &mut ClientSession,
    coll: &str,
    filter: Document,
    projection: Document,
) -> TxnResult<Vec<Document>> {
    Ok(s.coll(coll)
        .find(filter)
        .projection(projection)
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?)
}

/// The string field `field` of every document of `coll` matching `filter`.
pub(super) async fn strings_in(
    s: &MongoStore,
    session: &mut ClientSession,
    coll: &str,
    filter: Document,
    field: &str,
) -> TxnResult<Vec<String>> {
    find_in(s, session, coll, filter, doc! { field: 1 })
        .await?
        .iter()
        .map(|d| Ok(get_string(d, field)?))
        .collect()
}

/// Writes the `retention` counter document: recoveries and prune batches
/// both do, so one of two concurrent ones write-conflicts and retries, and a
/// prune never removes an event a recovery is putting back.
async fn retention_lock(s: &MongoStore, session: &mut ClientSession) -> TxnResult<()> {
    s.coll(names::COUNTERS)
        .update_one(doc! { "_id": "retention" }, doc! { "$inc": { "n": 1i64 } })
        .upsert(true)
        .session(&mut *session)
        .await?;
    Ok(())
}

/// Recovery (see `Store::recover`): one fresh delivery marked `replay` per
/// still-stored event whose delivery to `handler_id` completed at or after
/// `since`, unless one is pending. Serialized with prune batches
/// ([`retention_lock`]).
pub(super) async fn recover(
    s: &MongoStore,
    session: &mut ClientSession,
    handler_id: &str,
    since: chrono::DateTime<Utc>,
) -> TxnResult<RecoverOutcome> {
    retention_lock(s, session).await?;
    let ids: Vec<String> = strings_in(
        s,
        session,
        names::COMPLETIONS,
        doc! { "completed_at": { "$gte": to_micros(since) }, "handler_id": handler_id },
        "event_id",
    )
    .await?
    .into_iter()
    .collect::<std::collections::BTreeSet<_>>()
    .into_iter()
    .collect();
    if ids.is_empty() {
        return Ok(RecoverOutcome::default());
    }
    let events = find_in(
        s,
        session,
        names::EVENTS,
        doc! { "_id": { "$in": &ids } },
        doc! { "_id": 1, "lane": 1, "key": 1, "seq": 1 },
    )
    .await?;
    let pending: HashSet<String> = strings_in(
        s,
        session,
        names::DELIVERIES,
        doc! { "handler_id": handler_id, "event_id": { "$in": &ids } },
        "event_id",
    )
    .await?
    .into_iter()
    .collect();
    let mut chosen = Vec::new();
    for e in &events {
        let id = get_string(e, "_id")?;
        if pending.contains(&id) {
            continue;
        }
        let order = (
            get_lane(e, "lane")?,
            get_opt_string(e, "key")?,
            get_opt_int(e, "seq")?,
            id,
        );
        chosen.push(order);
    }
    chosen.sort();
    let outcome = RecoverOutcome {
        recovered: chosen.len() as u64,
        already_pending: (events.len() - chosen.len()) as u64,
        pruned: (ids.len() - events.len()) as u64,
    };
    if chosen.is_empty() {
        return Ok(outcome);
    }
    let mut incs: BTreeMap<String, i64> = BTreeMap::new();
    for (lane, ..) in &chosen {
        *incs.entry(lane_counter(*lane)).or_default() += 1;
    }
    let mut next = bump(s, session, &incs).await?;
    let now = to_micros(Utc::now());
    let deliveries: Vec<Document> = chosen
        .iter()
        .map(|(lane, key, seq, id)| {
            let pos = next.entry(lane_counter(*lane)).or_default();
            *pos += 1;
            let mut d = delivery_doc(*lane, *pos, handler_id, id, key.as_deref(), *seq, now);
            d.insert("replay", true);
            d
        })
        .collect();
    s.coll(names::DELIVERIES)
        .insert_many(deliveries)
        .session(&mut *session)
        .await?;
    Ok(outcome)
}

/// One retention batch (see `Store::prune`), in the caller's transaction:
/// completions through the `completed_at` index, then events through the
/// `published_at` index, keeping those with a pending delivery, a dead
/// letter or a completion at or after the cutoff (retention counts from an
/// event's last completion, not its publish).
pub(super) async fn prune(
    s: &MongoStore,
    session: &mut ClientSession,
    before: chrono::DateTime<Utc>,
    limit: u32,
    from: Option<PruneResume>,
) -> TxnResult<(Pruned, Option<PruneResume>)> {
    retention_lock(s, session).await?;
    let before = to_micros(before);
    let old: Vec<Bson> = s
        .coll(names::COMPLETIONS)
        .find(doc! { "completed_at": { "$lt": before } })
        .projection(doc! { "_id": 1 })
        .limit(i64::from(limit))
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect::<Vec<Document>>()
        .await?
        .into_iter()
        .filter_map(|d| d.get("_id").cloned())
        .collect();
    let completions = if old.is_empty() {
        0
    } else {
        s.coll(names::COMPLETIONS)
            .delete_many(doc! { "_id": { "$in": old } })
            .session(&mut *session)
            .await?
            .deleted_count
    };
    // Events still pending or dead-lettered are kept and passed over: the
    // candidates are read in (published_at, _id) order from where the last
    // batch stopped (`from`), a few rounds per batch, so kept events at the
    // front cannot stop the pruning of later ones (a `$nin` of the kept ones
    // from the oldest event on did: with 8 rounds' worth of them, every
    // batch read only those, for good). At the end of the events the next
    // batch starts again from the oldest.
    let mut cursor = from;
    let mut gone: Vec<String> = Vec::new();
    let mut at_end = false;
    for _ in 0..PRUNE_ROUNDS {
        let want = i64::from(limit) - gone.len() as i64;
        if want <= 0 {
            break;
        }
        let mut filter = doc! { "published_at": { "$lt": before } };
        if let Some((p, id)) = &cursor {
            filter.insert(
                "$or",
                vec![
                    doc! { "published_at": { "$gt": *p } },
                    doc! { "published_at": *p, "_id": { "$gt": id.as_str() } },
                ],
            );
        }
        let found: Vec<Document> = s
            .coll(names::EVENTS)
            .find(filter)
            .projection(doc! { "_id": 1, "published_at": 1 })
            .sort(doc! { "published_at": 1, "_id": 1 })
            .limit(want)
            .batch_size(FULL_BATCH)
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect::<Vec<Document>>()
            .await?;
        let candidates: Vec<String> = found
            .iter()
            .map(|d| get_string(d, "_id"))
            .collect::<Result<_>>()?;
        if let Some(last) = found.last() {
            cursor = Some((get_int(last, "published_at")?, get_string(last, "_id")?));
        }
        if (candidates.len() as i64) < want {
            at_end = true;
        }
        if candidates.is_empty() {
            break;
        }
        let mut held: HashSet<String> = HashSet::new();
        for coll in [names::DELIVERIES, names::DEAD_LETTERS] {
            let filter = doc! { "event_id": { "$in": &candidates } };
            held.extend(strings_in(s, session, coll, filter, "event_id").await?);
        }
        let recent =
            doc! { "event_id": { "$in": &candidates }, "completed_at": { "$gte": before } };
        held.extend(strings_in(s, session, names::COMPLETIONS, recent, "event_id").await?);
        gone.extend(candidates.into_iter().filter(|id| !held.contains(id)));
        if at_end {
            break;
        }
    }
    let next = if at_end { None } else { cursor };
    let events = if gone.is_empty() {
        0
    } else {
        s.coll(names::EVENTS)
            .delete_many(doc! { "_id": { "$in": gone } })
            .session(&mut *session)
            .await?
            .deleted_count
    };
    Ok((
        Pruned {
            completions,
            events,
        },
        next,
    ))
}

/// Wait before reopening a broken change stream.
const STREAM_REOPEN: Duration = Duration::from_secs(1);

/// Change stream on delivery inserts, projected to the resume token and
/// the delivery's lane.
async fn open_stream(
    s: &MongoStore,
) -> ::mongodb::error::Result<
    ::mongodb::change_stream::ChangeStream<
        ::mongodb::change_stream::event::ChangeStreamEvent<Document>,
    >,
> {
    s.coll(names::DELIVERIES)
        .watch()
        .pipeline([
            doc! { "$match": { "operationType": "insert" } },
            doc! { "$project": { "_id": 1, "operationType": 1, "fullDocument.lane": 1 } },
        ])
        .await
}

/// What a delivery insert's change event wakes: the delivery's lane, or
/// every lane when the event does not carry it.
fn woken_by(event: &::mongodb::change_stream::event::ChangeStreamEvent<Document>) -> Woken {
    let lane = event
        .full_document
        .as_ref()
        .and_then(|d| d.get("lane"))
        .and_then(|l| match l {
            Bson::Int32(l) => Lane::try_from(*l).ok(),
            Bson::Int64(l) => Lane::try_from(*l).ok(),
            _ => None,
        });
    match lane {
        Some(l) => Woken::Lanes([l].into()),
        None => Woken::All,
    }
}

/// Change events a wake-up channel queues before it wakes every lane
/// instead (the receiver merges what is queued).
const STREAM_QUEUE: usize = 1024;

/// [`Store::wakeups`](crate::Store::wakeups): a change stream on delivery
/// inserts, or polling when the server offers none.
pub(super) async fn wakeups(s: &MongoStore) -> Result<Wakeups> {
    let stream = match open_stream(s).await {
        Ok(stream) => stream,
        Err(e) => {
            tracing::info!(backend = "mongodb", mechanism = "poll", error = %e,
                "store wake-ups: the server offers no change stream; lane owners poll");
            return Ok(Wakeups::Poll);
        }
    };
    tracing::info!(
        backend = "mongodb",
        mechanism = "change_stream",
        collection = names::DELIVERIES,
        "store wake-ups: change stream on delivery inserts"
    );
    let (tx, rx) = crate::wake::channel(STREAM_QUEUE);
    let store = s.clone();
    tokio::spawn(async move {
        let mut stream = Some(stream);
        loop {
            let mut current = match stream.take() {
                Some(c) => c,
                None => match open_stream(&store).await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "mongodb change stream cannot be reopened; retrying");
                        if tx.is_closed() {
                            return;
                        }
                        // Wake the owners anyway while the stream is down.
                        tx.send(Woken::All);
                        tokio::time::sleep(STREAM_REOPEN).await;
                        continue;
                    }
                },
            };
            loop {
                tokio::select! {
                    item = current.next() => match item {
                        // Merged while queued (crate::wake).
                        Some(Ok(event)) => tx.send(woken_by(&event)),
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "mongodb change stream failed; reopening");
                            break;
                        }
                        None => break,
                    },
                    () = tx.closed() => return,
                }
            }
            tx.send(Woken::All);
            tokio::time::sleep(STREAM_REOPEN).await;
        }
    });
    Ok(Wakeups::Push(rx))
}
