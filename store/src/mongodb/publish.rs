//! Publish: duplicates, per-key sequence numbers, lane positions, event and
//! delivery documents, all inside the caller's (or our own) transaction.
//!
//! Round trips per publish, or per group of concurrent publishes
//! ([`crate::group`]): one catalog-version `find` (and a catalog reload
//! when it changed: [`super::event_types::checked`]), one stored-id `find` (only when the batch has
//! client-supplied ids), one handlers `find`, [`read_counters`] (a counters
//! `find`), [`raise_counters`] (an `insertMany` of counters seen for the
//! first time, one `updateOne`/`updateMany`), one events `insertMany` and
//! one deliveries `insertMany`; the driver splits an `insertMany` only above
//! 48 MB or 100,000 documents.
//!
//! Expected sequences ([`crate::NewEvent::expected_seq`]) below the
//! numbers [`read_counters`] reads are refused before any write (a counter
//! only grows, so a stale snapshot cannot hide such a conflict); the others
//! are checked after [`raise_counters`]' write: a counter read from a stale
//! snapshot makes that write fail with a write conflict (the transaction is
//! run again), so past it the numbers are the keys' current ones. A broken
//! expectation ends the body before any event is inserted, and the
//! transaction is aborted (a caller's transaction too, which may hold the
//! raised counters: MongoDB has no savepoints; [`MongoStore::publish_in`]).

use std::collections::{BTreeMap, HashMap, HashSet};

use ::mongodb::bson::{doc, spec::BinarySubtype, Binary, Bson, Document};
use ::mongodb::ClientSession;
use chrono::Utc;
use futures::TryStreamExt;

use super::{
    delivery_id, get_int, get_string, names, opt_i64, opt_str, MongoStore, TxnResult, FULL_BATCH,
};
use crate::common::{check_expected, to_micros, PublishPlan};
use crate::filter::{Filter, Payload};
use crate::{route, PublishOutcome, StoreError};

/// Counter id of a key's sequence.
pub(super) fn key_counter(key: &str) -> String {
    format!("k/{key}")
}

/// Counter id of a lane's claim position.
pub(super) fn lane_counter(lane: u16) -> String {
    format!("l/{lane}")
}

/// Raises each counter `id` by `inc` inside the transaction and returns the
/// value each had before (0 for a counter created now): [`read_counters`]
/// then [`raise_counters`].
pub(super) async fn bump(
    s: &MongoStore,
    session: &mut ClientSession,
    incs: &BTreeMap<String, i64>,
) -> TxnResult<HashMap<String, i64>> {
    let read = read_counters(s, session, incs).await?;
    raise_counters(s, session, incs, &read).await?;
    Ok(or_zero(&read))
}

/// `read` with a counter not created yet as 0.
fn or_zero(read: &HashMap<String, Option<i64>>) -> HashMap<String, i64> {
    read.iter()
        .map(|(id, n)| (id.clone(), n.unwrap_or(0)))
        .collect()
}

/// The value of each counter named in `incs` in the transaction's snapshot
/// (`None`: not created yet, as good as 0). A counter only grows, so a
/// value read from a stale snapshot is at most the current one.
async fn read_counters(
    s: &MongoStore,
    session: &mut ClientSession,
    incs: &BTreeMap<String, i64>,
) -> TxnResult<HashMap<String, Option<i64>>> {
    if incs.is_empty() {
        return Ok(HashMap::new());
    }
    let ids: Vec<&String> = incs.keys().collect();
    let found: Vec<Document> = s
        .coll(names::COUNTERS)
        .find(doc! { "_id": { "$in": &ids } })
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect()
        .await?;
    let mut old: HashMap<String, Option<i64>> = incs.keys().map(|id| (id.clone(), None)).collect();
    for d in &found {
        old.insert(get_string(d, "_id")?, Some(get_int(d, "n")?));
    }
    Ok(old)
}

/// Raises each counter `id` by `inc`, from the values `old` that
/// [`read_counters`] read in this transaction.
///
/// The write fails with a write conflict if any of these documents changed
/// since the snapshot (or is being changed by another open transaction), so
/// once it succeeds the values in `old` are the ones these increments apply
/// to.
async fn raise_counters(
    s: &MongoStore,
    session: &mut ClientSession,
    incs: &BTreeMap<String, i64>,
    old: &HashMap<String, Option<i64>>,
) -> TxnResult<()> {
    let coll = s.coll(names::COUNTERS);
    // A counter not created yet is inserted (a concurrent first insert is a
    // write conflict or a duplicate key, both retried).
    let (missing, existing): (Vec<(&String, i64)>, Vec<(&String, i64)>) = incs
        .iter()
        .map(|(id, n)| (id, *n))
        .partition(|(id, _)| old[*id].is_none());
    let missing: Vec<Document> = missing
        .iter()
        .map(|(id, n)| doc! { "_id": *id, "n": *n })
        .collect();
    if !missing.is_empty() {
        coll.insert_many(missing).session(&mut *session).await?;
    }
    match existing.as_slice() {
        [] => {}
        [(id, n)] => {
            coll.update_one(doc! { "_id": *id }, doc! { "$inc": { "n": *n } })
                .session(&mut *session)
                .await?;
        }
        many => {
            // One statement for all: each document adds its own increment.
            let branches: Vec<Document> = many
                .iter()
                .map(|(id, n)| doc! { "case": { "$eq": ["$_id", *id] }, "then": *n })
                .collect();
            let in_ids: Vec<&String> = many.iter().map(|(id, _)| *id).collect();
            coll.update_many(
                doc! { "_id": { "$in": in_ids } },
                vec![doc! { "$set": { "n": { "$add": [
                    "$n",
                    { "$switch": { "branches": branches, "default": 0i64 } }
                ] } } }],
            )
            .session(&mut *session)
            .await?;
        }
    }
    Ok(())
}

/// One write of [`Store::publish`](crate::Store::publish) (a group of
/// batches, see [`crate::group`]) in a transaction of its own, with the
/// documented retries. Returns the ids found already stored.
pub(super) async fn write(s: &MongoStore, plan: &PublishPlan) -> crate::Result<HashSet<String>> {
    in_transaction!(s, |sess| write_in(s, sess, plan.clone()))
}

/// Writes `plan.fresh` but the ids already stored, which it returns.
async fn write_in(
    s: &MongoStore,
    session: &mut ClientSession,
    plan: PublishPlan,
) -> TxnResult<HashSet<String>> {
    let (_, stored) = publish_with(s, session, plan).await?;
    Ok(stored)
}

/// Writes a validated batch inside the transaction on `session` (the
/// caller's, for [`MongoStore::publish_in`]). Returns the outcome; the
/// caller commits.
pub(super) async fn publish_in(
    s: &MongoStore,
    session: &mut ClientSession,
    plan: PublishPlan,
) -> TxnResult<PublishOutcome> {
    Ok(publish_with(s, session, plan).await?.0)
}

/// Writes `plan` in the transaction on `session`; returns the outcome and
/// the ids found already stored.
async fn publish_with(
    s: &MongoStore,
    session: &mut ClientSession,
    mut plan: PublishPlan,
) -> TxnResult<(PublishOutcome, HashSet<String>)> {
    super::event_types::checked(s, session, &mut plan).await?;
    let client_ids = plan.client_ids();
    let mut stored = HashSet::new();
    if !client_ids.is_empty() {
        let filter = doc! { "_id": { "$in": &client_ids } };
        stored = super::dispatch::strings_in(s, session, names::EVENTS, filter, "_id")
            .await?
            .into_iter()
            .collect();
        plan.drop_stored(&stored);
    }
    let accepted = plan.fresh.len();
    if accepted == 0 {
        let out = PublishOutcome {
            accepted,
            duplicates: plan.duplicates,
            lanes: Vec::new(),
            ids: plan.ids,
        };
        return Ok((out, stored));
    }

    // Handlers in creation order, read in the transaction's snapshot;
    // disabled ones too (their deliveries are kept until they are enabled).
    let handlers: Vec<(String, Vec<String>, Option<Filter>)> = s
        .coll(names::HANDLERS)
        .find(doc! {})
        .projection(doc! { "_id": 1, "event_types": 1, "filter": 1 })
        .sort(doc! { "seq": 1 })
        .batch_size(FULL_BATCH)
        .session(&mut *session)
        .await?
        .stream(&mut *session)
        .try_collect::<Vec<Document>>()
        .await?
        .iter()
        .map(|d| {
            let types = d
                .get_array("event_types")
                .map_err(|e| StoreError::Database(format!("handlers.event_types: {e}")))?
                .iter()
                .filter_map(|b| b.as_str().map(str::to_owned))
                .collect();
            let id = get_string(d, "_id")?;
            let filter = match d.get("filter") {
                Some(Bson::String(f)) => Some(Filter::from_stored(&id, f)?),
                _ => None,
            };
            Ok((id, types, filter))
        })
        .collect::<crate::Result<_>>()?;

    // One delivery per (event, handler whose routes and payload filter
    // match), in batch order, so a key's positions follow its sequence
    // numbers.
    let mut pairs: Vec<(usize, &str)> = Vec::new();
    let mut incs: BTreeMap<String, i64> = BTreeMap::new();
    for (i, e) in plan.fresh.iter().enumerate() {
        let mut payload = Payload::new(e.stored_payload());
        for (hid, types, filter) in &handlers {
            // A cataloged type's aliases match as the type does.
            let aliases = e.aliases.as_deref().unwrap_or_default();
            if (route::any_matches(types, &e.event_type)
                || aliases.iter().any(|a| route::any_matches(types, a)))
                && payload.passes(filter.as_ref())
            {
                pairs.push((i, hid));
                *incs.entry(lane_counter(e.lane)).or_default() += 1;
            }
        }
    }
    let (keys, counts) = plan.key_counts();
    for (k, n) in keys.iter().zip(counts) {
        incs.insert(key_counter(k), n);
    }
    let read = read_counters(s, session, &incs).await?;
    let old = or_zero(&read);

    let now = to_micros(Utc::now());
    let offsets = plan.seq_offsets();
    let seqs: Vec<Option<i64>> = plan
        .fresh
        .iter()
        .zip(&offsets)
        .map(|(e, off)| {
            e.key.as_ref().map(|k| {
                let id = key_counter(k);
                old[&id] + incs[&id] - off
            })
        })
        .collect();
    // A counter only grows, so an expectation below the number read is
    // broken however old the snapshot: refused before the counters' write,
    // which would meet (and wait out) any other open writer of the key.
    // The rest are decided once that write has made the numbers current.
    let checked = check_expected(plan.fresh.iter().zip(seqs.iter().copied()));
    if let Err(StoreError::SeqConflict { expected, at, .. }) = &checked {
        if expected < at {
            return Err(checked.unwrap_err().into());
        }
    }
    raise_counters(s, session, &incs, &read).await?;
    checked?;
    let events: Vec<Document> = plan
        .fresh
        .iter()
        .zip(&seqs)
        .map(|(e, seq)| {
            doc! {
                "_id": &e.id,
                "type": &e.event_type,
                "key": opt_str(e.key.as_deref()),
                "lane": i32::from(e.lane),
                "seq": opt_i64(*seq),
                "payload": Bson::Binary(Binary { subtype: BinarySubtype::Generic, bytes: e.stored_payload().to_vec() }),
                "published_at": now,
            }
        })
        .collect();
    s.coll(names::EVENTS)
        .insert_many(events)
        .session(&mut *session)
        .await?;

    if !pairs.is_empty() {
        let mut next_pos: HashMap<u16, i64> = HashMap::new();
        let deliveries: Vec<Document> = pairs
            .iter()
            .map(|&(i, hid)| {
                let e = &plan.fresh[i];
                let pos = next_pos
                    .entry(e.lane)
                    .or_insert_with(|| old[&lane_counter(e.lane)]);
                *pos += 1;
                let due = e.deliver_at.map_or(now, to_micros);
                delivery_doc(e.lane, *pos, hid, &e.id, e.key.as_deref(), seqs[i], due)
            })
            .collect();
        s.coll(names::DELIVERIES)
            .insert_many(deliveries)
            .session(&mut *session)
            .await?;
    }
    let out = PublishOutcome {
        accepted,
        duplicates: plan.duplicates,
        lanes: plan.lanes(),
        ids: plan.ids,
    };
    Ok((out, stored))
}

/// A fresh delivery document (attempts 0, due at `due_at` µs).
pub(super) fn delivery_doc(
    lane: u16,
    pos: i64,
    handler_id: &str,
    event_id: &str,
    key: Option<&str>,
    seq: Option<i64>,
    due_at: i64,
) -> Document {
    doc! {
        "_id": delivery_id(lane, pos),
        "lane": i32::from(lane),
        "pos": pos,
        "handler_id": handler_id,
        "event_id": event_id,
        "key": opt_str(key),
        "seq": opt_i64(seq),
        "attempts": 0i64,
        "due_at": due_at,
        "last_error": Bson::Null,
    }
}
