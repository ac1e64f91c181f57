//! Handler catalog, dead-letter listing, lane rows, counters and wake-ups.

use ::mongodb::bson::{doc, Document};
use ::mongodb::options::ReturnDocument;
use ::mongodb::ClientSession;
use chrono::Utc;
use futures::TryStreamExt;

use super::{
    error_code, get_attempt_log, get_int, get_lane, get_opt_int, get_opt_string, get_string,
    map_err, names, MongoStore, TxnResult,
};
use crate::common::{epoch_from_db, from_micros, to_micros, to_u32};
use crate::*;

/// Default page size when [`DeadLetterFilter::limit`] is 0.
const DEFAULT_DEAD_LETTER_PAGE: u32 = 100;

/// Takes the next value of the non-transactional counter `id` (creating it).
async fn next_counter(s: &MongoStore, id: &str) -> Result<i64> {
    let coll = s.coll(names::COUNTERS);
    let take = || {
        coll.find_one_and_update(doc! { "_id": id }, doc! { "$inc": { "n": 1i64 } })
            .upsert(true)
            .return_document(ReturnDocument::After)
    };
    let d = match take().await {
        Ok(d) => d,
        // Two first upserts at once: the loser retries on the winner's document.
        Err(e) if error_code(&e) == Some(11000) => take().await.map_err(map_err)?,
        Err(e) => return Err(map_err(e)),
    };
    let d = d.ok_or_else(|| StoreError::Database(format!("counter {id} not returned")))?;
    get_int(&d, "n")
}

pub(super) async fn create_handler(s: &MongoStore, h: NewHandler) -> Result<Handler> {
    let handler = Handler::registered(
        generate_handler_id(),
        h,
        // Stored with microsecond precision: truncate so the answer equals a later read.
        from_micros(to_micros(Utc::now())),
    );
    let seq = next_counter(s, names::HANDLERS).await?;
    s.coll(names::HANDLERS)
        .insert_one(doc! {
            "_id": &handler.id,
            "seq": seq,
            "name": &handler.name,
            "url": &handler.url,
            "event_types": &handler.event_types,
            "max_attempts": i64::from(handler.max_attempts),
            "timeout_ms": i64::try_from(handler.timeout_ms).unwrap_or(i64::MAX),
            "max_in_flight": i64::from(handler.max_in_flight),
            "secret": &handler.secret,
            "state": handler.state.as_str(),
            "created_at": to_micros(handler.created_at),
            "rate_limit_per_s": rate_limit_field(handler.rate_limit.as_ref(), |r| r.per_second),
            "rate_limit_burst": rate_limit_field(handler.rate_limit.as_ref(), |r| r.burst),
            "filter": filter_field(handler.filter.as_ref()),
        })
        .await
        .map_err(map_err)?;
    Ok(handler)
}

fn handler_from_doc(d: &Document) -> Result<Handler> {
    let event_types = d
        .get_array("event_types")
        .map_err(|e| StoreError::Database(format!("handlers.event_types: {e}")))?
        .iter()
        .map(|b| {
            b.as_str()
                .map(str::to_owned)
                .ok_or_else(|| StoreError::Database(format!("handlers.event_types holds {b:?}")))
        })
        .collect::<Result<_>>()?;
    let id = get_string(d, "_id")?;
    let filter = get_opt_string(d, "filter")?
        .map(|f| Filter::from_stored(&id, &f))
        .transpose()?;
    Ok(Handler {
        id,
        filter,
        name: get_string(d, "name")?,
        url: get_string(d, "url")?,
        event_types,
        max_attempts: to_u32(get_int(d, "max_attempts")?),
        timeout_ms: u64::try_from(get_int(d, "timeout_ms")?.max(0)).unwrap_or_default(),
        max_in_flight: to_u32(get_int(d, "max_in_flight")?),
        secret: get_string(d, "secret")?,
        state: HandlerState::parse(&get_string(d, "state")?),
        created_at: from_micros(get_int(d, "created_at")?),
        rate_limit: match (
            get_opt_int(d, "rate_limit_per_s")?,
            get_opt_int(d, "rate_limit_burst")?,
        ) {
            (Some(per_second), Some(burst)) => Some(RateLimit {
                per_second: to_u32(per_second),
                burst: to_u32(burst),
            }),
            _ => None,
        },
        previous_secret: get_opt_string(d, "previous_secret")?,
        previous_secret_until: get_opt_int(d, "previous_secret_until")?.map(from_micros),
        state_changed_at: get_opt_int(d, "state_changed_at")?.map(from_micros),
        state_reason: get_opt_string(d, "state_reason")?,
        failing_since: get_opt_int(d, "failing_since")?.map(from_micros),
    })
}

pub(super) async fn list_handlers(s: &MongoStore) -> Result<Vec<Handler>> {
    let docs: Vec<Document> = s
        .coll(names::HANDLERS)
        .find(doc! {})
        .sort(doc! { "seq": 1 })
        .await
        .map_err(map_err)?
        .try_collect()
        .await
        .map_err(map_err)?;
    docs.iter().map(handler_from_doc).collect()
}

pub(super) async fn get_handler(s: &MongoStore, id: &str) -> Result<Handler> {
    let d = s
        .coll(names::HANDLERS)
        .find_one(doc! { "_id": id })
        .await
        .map_err(map_err)?
        .ok_or_else(|| StoreError::NotFound(format!("handler {id}")))?;
    handler_from_doc(&d)
}

/// Sets the state, and time and reason when it changes (enabling clears
/// `failing_since`), and answers the state before: one `findOneAndUpdate`
/// whose filter matches only a handler in another state, so of concurrent
/// calls exactly one matches. [`StoreError::NotFound`] if absent.
pub(super) async fn change_handler_state(
    s: &MongoStore,
    id: &str,
    state: HandlerState,
    reason: &str,
) -> Result<HandlerState> {
    let mut set = doc! {
        "state": state.as_str(),
        "state_changed_at": to_micros(Utc::now()),
        "state_reason": reason,
    };
    if state == HandlerState::Enabled {
        set.insert("failing_since", ::mongodb::bson::Bson::Null);
    }
    let before = s
        .coll(names::HANDLERS)
        .find_one_and_update(
            doc! { "_id": id, "state": { "$ne": state.as_str() } },
            doc! { "$set": set },
        )
        .return_document(ReturnDocument::Before)
        .await
        .map_err(map_err)?;
    match before {
        Some(d) => Ok(HandlerState::parse(&get_string(&d, "state")?)),
        None => {
            // Already in that state, or absent.
            get_handler(s, id).await?;
            Ok(state)
        }
    }
}

/// One number of a rate limit as stored: `null` when there is no limit.
fn rate_limit_field(r: Option<&RateLimit>, f: fn(&RateLimit) -> u32) -> ::mongodb::bson::Bson {
    r.map_or(::mongodb::bson::Bson::Null, |r| {
        ::mongodb::bson::Bson::Int64(i64::from(f(r)))
    })
}

/// A payload filter as stored: its compact JSON as a string (numbers kept
/// exactly as given), `null` for none.
pub(super) fn filter_field(f: Option<&Filter>) -> ::mongodb::bson::Bson {
    f.map_or(::mongodb::bson::Bson::Null, |f| {
        ::mongodb::bson::Bson::String(f.to_stored())
    })
}

/// Read, merge, check, write (the last of concurrent changes wins).
pub(super) async fn update_handler(
    s: &MongoStore,
    id: &str,
    patch: &HandlerPatch,
) -> Result<Handler> {
    let h = get_handler(s, id).await?.patched(patch)?;
    let rate = |f: fn(&RateLimit) -> u32| rate_limit_field(h.rate_limit.as_ref(), f);
    let r = s
        .coll(names::HANDLERS)
        .update_one(
            doc! { "_id": id },
            doc! { "$set": {
                "name": &h.name,
                "url": &h.url,
                "event_types": &h.event_types,
                "max_attempts": i64::from(h.max_attempts),
                "timeout_ms": i64::try_from(h.timeout_ms).unwrap_or(i64::MAX),
                "max_in_flight": i64::from(h.max_in_flight),
                "rate_limit_per_s": rate(|r| r.per_second),
                "rate_limit_burst": rate(|r| r.burst),
                "filter": filter_field(h.filter.as_ref()),
            } },
        )
        .await
        .map_err(map_err)?;
    if r.matched_count == 0 {
        return Err(StoreError::NotFound(format!("handler {id}")));
    }
    Ok(h)
}

/// The current secret becomes the previous one: a compare-and-set on the
/// secret read, repeated if a concurrent rotation came first.
pub(super) async fn rotate_handler_secret(
    s: &MongoStore,
    id: &str,
    secret: &str,
    previous_until: chrono::DateTime<Utc>,
) -> Result<Handler> {
    for _ in 0..8 {
        let current = get_handler(s, id).await?;
        let r = s
            .coll(names::HANDLERS)
            .update_one(
                doc! { "_id": id, "secret": &current.secret },
                doc! { "$set": {
                    "secret": secret,
                    "previous_secret": &current.secret,
                    "previous_secret_until": to_micros(previous_until),
                } },
            )
            .await
            .map_err(map_err)?;
        if r.matched_count == 1 {
            return get_handler(s, id).await;
        }
    }
    Err(StoreError::Conflict(format!(
        "handler {id}: secret rotated concurrently, try again"
    )))
}

pub(super) async fn mark_handler_failing(
    s: &MongoStore,
    id: &str,
    failing: bool,
    at: chrono::DateTime<Utc>,
) -> Result<()> {
    let (filter, set) = if failing {
        (
            doc! { "_id": id, "failing_since": ::mongodb::bson::Bson::Null },
            doc! { "failing_since": to_micros(at) },
        )
    } else {
        (
            doc! { "_id": id },
            doc! { "failing_since": ::mongodb::bson::Bson::Null },
        )
    };
    let r = s
        .coll(names::HANDLERS)
        .update_one(filter, doc! { "$set": set })
        .await
        .map_err(map_err)?;
    if r.matched_count == 0 {
        get_handler(s, id).await?;
    }
    Ok(())
}

/// Removes the handler, its deliveries and its dead letters; returns
/// (handlers removed, what was discarded).
pub(super) async fn delete_handler(
    s: &MongoStore,
    session: &mut ClientSession,
    id: &str,
) -> TxnResult<(u64, DeletedHandler)> {
    let removed = s
        .coll(names::HANDLERS)
        .delete_one(doc! { "_id": id })
        .session(&mut *session)
        .await?
        .deleted_count;
    if removed == 0 {
        return Ok((0, DeletedHandler::default()));
    }
    let deliveries = s
        .coll(names::DELIVERIES)
        .delete_many(doc! { "handler_id": id })
        .session(&mut *session)
        .await?
        .deleted_count;
    let dead_letters = s
        .coll(names::DEAD_LETTERS)
        .delete_many(doc! { "handler_id": id })
        .session(&mut *session)
        .await?
        .deleted_count;
    Ok((
        removed,
        DeletedHandler {
            deliveries,
            dead_letters,
        },
    ))
}

pub(super) async fn list_dead_letters(
    s: &MongoStore,
    filter: &DeadLetterFilter,
) -> Result<Vec<DeadLetter>> {
    let limit = if filter.limit == 0 {
        DEFAULT_DEAD_LETTER_PAGE
    } else {
        filter.limit
    };
    let mut m = doc! { "_id": { "$gt": filter.after_id.unwrap_or(0) } };
    if let Some(h) = &filter.handler_id {
        m.insert("handler_id", h);
    }
    let pipeline = vec![
        doc! { "$match": m },
        doc! { "$sort": { "_id": 1 } },
        doc! { "$limit": i64::from(limit) },
        doc! { "$lookup": {
            "from": names::EVENTS, "localField": "event_id", "foreignField": "_id",
            "pipeline": [ { "$project": { "type": 1 } } ], "as": "event",
        } },
    ];
    let docs = aggregate(s, names::DEAD_LETTERS, pipeline).await?;
    docs.iter()
        .map(|d| {
            let event_type = joined_event(d)
                .and_then(|e| e.get_str("type").ok())
                .unwrap_or_default()
                .to_string();
            Ok(DeadLetter {
                id: get_int(d, "_id")?,
                handler_id: get_string(d, "handler_id")?,
                event_id: get_string(d, "event_id")?,
                event_type,
                key: get_opt_string(d, "key")?,
                seq: get_opt_int(d, "seq")?,
                attempts: to_u32(get_int(d, "attempts")?),
                last_error: get_string(d, "last_error")?,
                failed_at: from_micros(get_int(d, "failed_at")?),
            })
        })
        .collect()
}

pub(super) async fn lane_rows(s: &MongoStore) -> Result<Vec<LaneRow>> {
    let backlog: Vec<Document> = s
        .coll(names::DELIVERIES)
        .aggregate(vec![
            doc! { "$group": { "_id": "$lane", "n": { "$sum": 1i64 } } },
        ])
        .await
        .map_err(map_err)?
        .try_collect()
        .await
        .map_err(map_err)?;
    let mut by_lane = std::collections::HashMap::new();
    for d in &backlog {
        by_lane.insert(get_lane(d, "_id")?, get_int(d, "n")?);
    }
    let lanes: Vec<Document> = s
        .coll(names::LANES)
        .find(doc! { "_id": { "$lt": i32::from(s.lanes) } })
        .sort(doc! { "_id": 1 })
        .await
        .map_err(map_err)?
        .try_collect()
        .await
        .map_err(map_err)?;
    lanes
        .iter()
        .map(|d| {
            let lane = get_lane(d, "_id")?;
            Ok(LaneRow {
                lane,
                owner: get_opt_string(d, "owner")?,
                epoch: epoch_from_db(get_int(d, "epoch")?)?,
                backlog: by_lane.get(&lane).copied().unwrap_or(0),
            })
        })
        .collect()
}

pub(super) async fn counts(s: &MongoStore) -> Result<StoreCounts> {
    let count = |name: &'static str| async move {
        s.coll(name)
            .count_documents(doc! {})
            .await
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX))
            .map_err(map_err)
    };
    let (events, deliveries, completions, dead_letters) = futures::try_join!(
        count(names::EVENTS),
        count(names::DELIVERIES),
        count(names::COMPLETIONS),
        count(names::DEAD_LETTERS),
    )?;
    Ok(StoreCounts {
        events,
        deliveries,
        completions,
        dead_letters,
    })
}

/// Reads the event and its records inside the caller's snapshot
/// transaction (see [`Store::lookup_event`] for the indexes used; the
/// payload is read to measure it).
pub(super) async fn lookup_event(
    s: &MongoStore,
    session: &mut ClientSession,
    id: &str,
) -> TxnResult<Option<EventLookup>> {
    let Some(e) = s
        .coll(names::EVENTS)
        .find_one(doc! { "_id": id })
        .session(&mut *session)
        .await?
    else {
        return Ok(None);
    };
    let payload_bytes = e
        .get_binary_generic("payload")
        .map_err(|err| StoreError::Database(format!("events.payload: {err}")))?
        .len();
    let columns = (
        get_string(&e, "type")?,
        get_opt_string(&e, "key")?,
        get_int(&e, "lane")?,
        get_opt_int(&e, "seq")?,
        from_micros(get_int(&e, "published_at")?),
        i64::try_from(payload_bytes).unwrap_or(i64::MAX),
    );
    let mut event = crate::common::event_lookup(id, columns)?;
    let lane = event.lane;
    let reads = [
        (
            "pending",
            names::DELIVERIES,
            doc! { "lane": i32::from(lane), "event_id": id },
            "due_at",
        ),
        (
            "completed",
            names::COMPLETIONS,
            doc! { "event_id": id },
            "completed_at",
        ),
        (
            "dead_lettered",
            names::DEAD_LETTERS,
            doc! { "event_id": id },
            "failed_at",
        ),
    ];
    let mut records = Vec::new();
    for (kind, coll, filter, at) in reads {
        let docs: Vec<Document> = s
            .coll(coll)
            .find(filter)
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        for d in &docs {
            let state = crate::common::delivery_state(
                kind,
                to_u32(get_int(d, "attempts")?),
                from_micros(get_int(d, at)?),
                get_opt_string(d, "last_error")?,
                get_attempt_log(d)?,
            )?;
            records.push((get_string(d, "handler_id")?, state));
        }
    }
    let mut ids: Vec<&str> = records.iter().map(|(h, _)| h.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut names_of = std::collections::HashMap::new();
    if !ids.is_empty() {
        let handlers: Vec<Document> = s
            .coll(names::HANDLERS)
            .find(doc! { "_id": { "$in": ids } })
            .projection(doc! { "name": 1 })
            .session(&mut *session)
            .await?
            .stream(&mut *session)
            .try_collect()
            .await?;
        for h in &handlers {
            names_of.insert(get_string(h, "_id")?, get_string(h, "name")?);
        }
    }
    for (handler_id, state) in records {
        let name = names_of.get(&handler_id).cloned();
        event.add(handler_id, name, state);
    }
    Ok(Some(event))
}

/// See [`Store::handler_deliveries`]: one aggregation per page, the
/// records in their order and limit, then their events (`$lookup` by
/// primary key; after the limit unless the key filter needs the event).
pub(super) async fn handler_deliveries(
    s: &MongoStore,
    q: &HandlerDeliveriesQuery,
) -> Result<Vec<HandlerDeliveryItem>> {
    let limit = i64::from(q.limit.max(1));
    let (coll, mut m, sort, at) = match q.state {
        DeliveryListState::Pending | DeliveryListState::Dead => {
            let before = crate::common::id_before(&q.after)?;
            let m = doc! { "handler_id": &q.handler_id, "_id": { "$lt": before } };
            let (coll, at) = if q.state == DeliveryListState::Pending {
                (names::DELIVERIES, "due_at")
            } else {
                (names::DEAD_LETTERS, "failed_at")
            };
            (coll, m, doc! { "_id": -1 }, at)
        }
        DeliveryListState::Completed => {
            let since = to_micros(q.completed_since);
            let mut m = doc! { "completed_at": { "$gte": since }, "handler_id": &q.handler_id };
            if let Some((at, event_id)) = crate::common::completed_before(&q.after)? {
                let at = to_micros(at);
                m.insert(
                    "$or",
                    vec![
                        doc! { "completed_at": { "$lt": at } },
                        doc! { "completed_at": at, "event_id": { "$lt": event_id } },
                    ],
                );
            }
            let sort = doc! { "completed_at": -1, "event_id": -1 };
            (names::COMPLETIONS, m, sort, "completed_at")
        }
    };
    let completed = q.state == DeliveryListState::Completed;
    let lookup = doc! { "$lookup": {
        "from": names::EVENTS, "localField": "event_id", "foreignField": "_id",
        "pipeline": [ { "$project": { "type": 1, "key": 1, "seq": 1, "lane": 1 } } ],
        "as": "event",
    } };
    let mut pipeline = Vec::new();
    match (&q.key, completed) {
        (Some(key), true) => {
            pipeline.extend([
                doc! { "$match": m },
                doc! { "$sort": sort },
                lookup,
                doc! { "$match": { "event.key": key } },
                doc! { "$limit": limit },
            ]);
        }
        (key, _) => {
            if let Some(key) = key {
                m.insert("key", key);
            }
            pipeline.extend([
                doc! { "$match": m },
                doc! { "$sort": sort },
                doc! { "$limit": limit },
                lookup,
            ]);
        }
    }
    let docs = aggregate(s, coll, pipeline).await?;
    docs.iter()
        .map(|d| {
            let event = joined_event(d);
            let attempts = to_u32(get_int(d, "attempts")?);
            let time = from_micros(get_int(d, at)?);
            let (id, key, seq, lane, state) = if completed {
                let (key, seq, lane) = match event {
                    Some(e) => (
                        get_opt_string(e, "key")?,
                        get_opt_int(e, "seq")?,
                        Some(get_int(e, "lane")?),
                    ),
                    None => (None, None, None),
                };
                let state =
                    crate::common::delivery_state("completed", attempts, time, None, Vec::new())?;
                (None, key, seq, lane, state)
            } else {
                let kind = if q.state == DeliveryListState::Pending {
                    "pending"
                } else {
                    "dead_lettered"
                };
                let error = get_opt_string(d, "last_error")?;
                let log = get_attempt_log(d)?;
                let state = crate::common::delivery_state(kind, attempts, time, error, log)?;
                let (key, seq) = (get_opt_string(d, "key")?, get_opt_int(d, "seq")?);
                let lane = Some(get_int(d, "lane")?);
                (Some(get_int(d, "_id")?), key, seq, lane, state)
            };
            let event_type = event
                .and_then(|e| e.get_str("type").ok())
                .map(str::to_owned);
            let event_id = get_string(d, "event_id")?;
            crate::common::delivery_item(event_id, event_type, key, seq, lane, id, state)
        })
        .collect()
}

/// Runs an aggregation on `coll` outside a transaction.
async fn aggregate(s: &MongoStore, coll: &str, pipeline: Vec<Document>) -> Result<Vec<Document>> {
    s.coll(coll)
        .aggregate(pipeline)
        .await
        .map_err(map_err)?
        .try_collect()
        .await
        .map_err(map_err)
}

/// The event a `$lookup` into `event` found, if any (none once pruned).
fn joined_event(d: &Document) -> Option<&Document> {
    d.get_array("event")
        .ok()
        .and_then(|a| a.first())
        .and_then(|e| e.as_document())
}
