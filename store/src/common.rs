//! Backend-neutral helpers shared by the backends: publish planning
//! (validation by [`crate::rules`], id generation, in-batch duplicates,
//! lanes, per-key sequence offsets) and time conversions.

// A build without a backend (the domain types only) uses none of it.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mongodb")),
    allow(dead_code)
)]

#[cfg(any(feature = "sqlite", feature = "mongodb"))]
use std::collections::BTreeMap;
use std::collections::HashSet;

use chrono::{DateTime, TimeZone, Utc};

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mongodb"))]
pub(crate) use crate::rules::validate_secret;
use crate::{
    generate_event_id, lane_of_event, rules, DeliveryState, Epoch, EventLookup, FailedAttempt,
    HandlerDeliveryItem, Lane, NewEvent, Result, StoreError,
};

/// An epoch as a store binds it (SQL `BIGINT`, BSON `Int64`).
///
/// # Errors
/// [`StoreError::Invalid`] above `i64::MAX`: no store can hold it.
pub(crate) fn epoch_to_db(epoch: Epoch) -> Result<i64> {
    epoch
        .to_i64()
        .map_err(|e| StoreError::Invalid(e.to_string()))
}

/// An epoch as a store read it back.
///
/// # Errors
/// [`StoreError::Database`] for a negative value (the store's data is at
/// fault: it only ever holds epochs written through [`epoch_to_db`]).
pub(crate) fn epoch_from_db(v: i64) -> Result<Epoch> {
    Epoch::try_from(v).map_err(|e| StoreError::Database(e.to_string()))
}

/// Most events accepted in one publish call ([`rules::event::MAX_BATCH`]).
pub const MAX_BATCH: usize = rules::event::MAX_BATCH;

/// An event that passed validation and is not a duplicate within its batch.
#[derive(Debug, Clone)]
pub(crate) struct PlannedEvent {
    /// Position in the caller's batch (0-based, duplicates counted).
    pub index: usize,
    pub id: String,
    pub event_type: String,
    pub key: Option<String>,
    pub lane: Lane,
    pub payload: Vec<u8>,
    /// Whether the id came from the client (only those can already be stored).
    pub client_id: bool,
    /// Delayed delivery: the deliveries' first due time (`None`: at once).
    pub deliver_at: Option<DateTime<Utc>>,
    /// The key's sequence expected just before this event
    /// ([`NewEvent::expected_seq`]; checked by [`check_expected`]).
    pub expected_seq: Option<i64>,
    /// The type as published when the catalog rewrote an alias to the
    /// wire name in `event_type` ([`crate::event_types`]).
    pub sent_type: Option<String>,
    /// The cataloged type's aliases, which routes also match.
    pub aliases: Option<std::sync::Arc<[String]>>,
    /// The cataloged type's personal fields ([`crate::personal`]).
    pub personal: Option<std::sync::Arc<crate::personal::Spec>>,
    /// The payload with its personal fields encrypted, and the spec it was
    /// encrypted by ([`crate::personal::seal_plan`]).
    pub sealed: Option<(std::sync::Arc<crate::personal::Spec>, Vec<u8>)>,
}

impl PlannedEvent {
    /// The payload bytes to store: the encrypted one when sealed.
    pub fn stored_payload(&self) -> &[u8] {
        self.sealed.as_ref().map_or(&self.payload, |s| &s.1)
    }
}

/// A validated publish batch.
#[derive(Debug, Clone)]
pub(crate) struct PublishPlan {
    /// Every input event's id, in input order (the answer's `ids`).
    pub ids: Vec<String>,
    /// Events still to be written, in batch order.
    pub fresh: Vec<PlannedEvent>,
    /// Duplicates found so far (within the batch, then already stored).
    pub duplicates: usize,
    /// The catalog version the events were checked against
    /// ([`crate::event_types::Snapshot::apply`]); `None`: not checked.
    pub catalog_version: Option<i64>,
    /// Whether [`crate::personal::seal_plan`] ran on it (only
    /// [`crate::Store::publish`] does).
    pub sealed: bool,
}

impl PublishPlan {
    /// Validates every event (nothing is written when one fails), generates
    /// missing ids, computes lanes and drops ids repeated within the batch.
    pub fn new(events: Vec<NewEvent>, lanes: u16) -> Result<Self> {
        rules::event::batch(&events, Utc::now())?;
        Ok(Self::checked(events, lanes))
    }

    /// As [`new`](Self::new), for lanebus's own operational events
    /// ([`rules::event::operational_batch`]).
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mongodb"))]
    pub fn operational(events: Vec<NewEvent>, lanes: u16) -> Result<Self> {
        rules::event::operational_batch(&events, Utc::now())?;
        Ok(Self::checked(events, lanes))
    }

    /// The lanes of the events still to be written, ascending, each once.
    pub fn lanes(&self) -> Vec<Lane> {
        let lanes: std::collections::BTreeSet<Lane> = self.fresh.iter().map(|e| e.lane).collect();
        lanes.into_iter().collect()
    }

    /// The plan of a batch whose events passed their rules.
    fn checked(events: Vec<NewEvent>, lanes: u16) -> Self {
        let mut seen = HashSet::with_capacity(events.len());
        let mut ids = Vec::with_capacity(events.len());
        let mut fresh = Vec::with_capacity(events.len());
        let mut duplicates = 0;
        for (index, e) in events.into_iter().enumerate() {
            let client_id = e.id.is_some();
            let id = e.id.unwrap_or_else(generate_event_id);
            ids.push(id.clone());
            if !seen.insert(id.clone()) {
                duplicates += 1;
                continue;
            }
            let lane = lane_of_event(e.key.as_deref(), &id, lanes);
            fresh.push(PlannedEvent {
                index,
                id,
                event_type: e.event_type,
                key: e.key,
                lane,
                payload: e.payload,
                client_id,
                deliver_at: e.deliver_at,
                expected_seq: e.expected_seq,
                sent_type: None,
                aliases: None,
                personal: None,
                sealed: None,
            });
        }
        PublishPlan {
            ids,
            fresh,
            duplicates,
            catalog_version: None,
            sealed: false,
        }
    }

    /// Whether an event still to be written expects a sequence
    /// ([`NewEvent::expected_seq`]).
    pub fn expects(&self) -> bool {
        self.fresh.iter().any(|e| e.expected_seq.is_some())
    }

    /// Whether this batch expects a sequence of a key that an event of
    /// `earlier` writes: written after them in one group, its expectation
    /// would count their events, which its publisher cannot have seen
    /// ([`crate::group`] starts a new group at it instead).
    pub fn expects_after<'a>(&self, earlier: impl IntoIterator<Item = &'a PublishPlan>) -> bool {
        let keys: HashSet<&str> = self
            .fresh
            .iter()
            .filter(|e| e.expected_seq.is_some())
            .filter_map(|e| e.key.as_deref())
            .collect();
        !keys.is_empty()
            && earlier
                .into_iter()
                .flat_map(|p| &p.fresh)
                .any(|e| e.key.as_deref().is_some_and(|k| keys.contains(k)))
    }

    #[cfg(any(feature = "sqlite", feature = "mongodb"))]
    /// Client-supplied ids still to be written (those that may already be stored).
    pub fn client_ids(&self) -> Vec<String> {
        self.fresh
            .iter()
            .filter(|e| e.client_id)
            .map(|e| e.id.clone())
            .collect()
    }

    #[cfg(any(feature = "sqlite", feature = "mongodb"))]
    /// Drops events whose id is in `stored`, counting them as duplicates.
    pub fn drop_stored(&mut self, stored: &HashSet<String>) {
        if stored.is_empty() {
            return;
        }
        let before = self.fresh.len();
        self.fresh.retain(|e| !stored.contains(&e.id));
        self.duplicates += before - self.fresh.len();
    }

    #[cfg(any(feature = "sqlite", feature = "mongodb"))]
    /// The batch's keys, sorted (the lock order), with how many fresh events
    /// each has.
    pub fn key_counts(&self) -> (Vec<String>, Vec<i64>) {
        let mut m: BTreeMap<&str, i64> = BTreeMap::new();
        for e in &self.fresh {
            if let Some(k) = &e.key {
                *m.entry(k).or_default() += 1;
            }
        }
        m.into_iter().map(|(k, n)| (k.to_owned(), n)).unzip()
    }

    #[cfg(any(feature = "sqlite", feature = "mongodb"))]
    /// Per fresh event: how many later events of the batch share its key
    /// (0 for the last one and for unkeyed events). After the key's counter
    /// was raised by the key's count to `top`, the event's sequence number is
    /// `top - offset`.
    pub fn seq_offsets(&self) -> Vec<i64> {
        let mut remaining: BTreeMap<&str, i64> = BTreeMap::new();
        for e in &self.fresh {
            if let Some(k) = &e.key {
                *remaining.entry(k).or_default() += 1;
            }
        }
        self.fresh
            .iter()
            .map(|e| match &e.key {
                Some(k) => {
                    let r = remaining.get_mut(k.as_str()).map_or(0, |r| {
                        *r -= 1;
                        *r
                    });
                    r
                }
                None => 0,
            })
            .collect()
    }
}

/// Checks the expected sequences ([`NewEvent::expected_seq`]) of the
/// events a write is about to store, each with the sequence number it was
/// assigned, in write order (a batch, or a group's merged batches; events
/// found already stored left out, as they are not checked): each
/// expectation must equal its event's sequence minus one. Called inside the
/// transaction that raised the key counters, before it commits.
///
/// # Errors
/// [`StoreError::SeqConflict`] for the first expectation that does not
/// hold, with the key's sequence before the write as `current` (its first
/// written event's number minus one) and before the event as `at`.
pub(crate) fn check_expected<'a>(
    written: impl IntoIterator<Item = (&'a PlannedEvent, Option<i64>)>,
) -> Result<()> {
    let mut first: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for (e, seq) in written {
        let (Some(key), Some(seq)) = (e.key.as_deref(), seq) else {
            continue;
        };
        let before = *first.entry(key).or_insert(seq) - 1;
        if let Some(expected) = e.expected_seq.filter(|&x| x != seq - 1) {
            return Err(StoreError::SeqConflict {
                key: key.to_owned(),
                expected,
                current: before,
                index: e.index,
                at: seq - 1,
            });
        }
    }
    Ok(())
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// `Ok` if a statement on handler `id` touched a row, else
/// [`StoreError::NotFound`](crate::StoreError::NotFound).
pub(crate) fn handler_found(rows: u64, id: &str) -> Result<()> {
    if rows == 0 {
        Err(crate::StoreError::NotFound(format!("handler {id}")))
    } else {
        Ok(())
    }
}

/// Microseconds since the Unix epoch (the SQLite time representation).
pub(crate) fn to_micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

/// Inverse of [`to_micros`]; out-of-range values clamp to the epoch.
pub(crate) fn from_micros(us: i64) -> DateTime<Utc> {
    Utc.timestamp_micros(us).single().unwrap_or_default()
}

/// Converts a stored non-negative integer to `u32`, clamping on overflow.
pub(crate) fn to_u32(v: i64) -> u32 {
    u32::try_from(v.max(0)).unwrap_or(u32::MAX)
}

/// An [`EventLookup`] without records yet, from the columns of its event:
/// `(type, key, lane, seq, published_at, payload size in bytes)`.
pub(crate) fn event_lookup(
    id: &str,
    (event_type, key, lane, seq, published_at, size): (
        String,
        Option<String>,
        i64,
        Option<i64>,
        DateTime<Utc>,
        i64,
    ),
) -> Result<EventLookup> {
    Ok(EventLookup {
        id: id.to_owned(),
        event_type,
        key,
        seq,
        lane: Lane::try_from(lane)
            .map_err(|_| StoreError::Database(format!("lane {lane} out of range")))?,
        published_at,
        payload_bytes: u64::try_from(size).unwrap_or(0),
        handlers: Vec::new(),
    })
}

/// The [`DeliveryState`] of one record read by an event lookup: `kind` is
/// `pending`, `completed` or `dead_lettered`; `at` its due, completion or
/// failure time.
pub(crate) fn delivery_state(
    kind: &str,
    attempts: u32,
    at: DateTime<Utc>,
    last_error: Option<String>,
    attempt_log: Vec<FailedAttempt>,
) -> Result<DeliveryState> {
    Ok(match kind {
        "pending" => DeliveryState::Pending {
            attempts,
            due_at: at,
            last_error,
            attempt_log,
        },
        "completed" => DeliveryState::Completed {
            completed_at: at,
            attempts,
        },
        "dead_lettered" => DeliveryState::DeadLettered {
            failed_at: at,
            attempts,
            last_error: last_error.unwrap_or_default(),
            attempt_log,
        },
        other => {
            return Err(StoreError::Database(format!(
                "event lookup read a record of kind {other:?}"
            )))
        }
    })
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
/// An attempt log as the SQL backends store it: a JSON array of
/// [`FailedAttempt`]s (NULL: empty).
pub(crate) fn attempt_log(json: Option<&str>) -> Result<Vec<FailedAttempt>> {
    json.map_or(Ok(Vec::new()), |j| {
        serde_json::from_str(j).map_err(|e| {
            StoreError::Database(format!("attempt_log is not a list of attempts: {e}"))
        })
    })
}

#[cfg(feature = "postgres")]
/// A failed attempt as PostgreSQL binds it: its JSON object, or NULL.
pub(crate) fn failure_json(f: Option<&FailedAttempt>) -> Result<Option<String>> {
    f.map(|f| {
        serde_json::to_string(f)
            .map_err(|e| StoreError::Database(format!("failed attempt to JSON: {e}")))
    })
    .transpose()
}

/// A [`HandlerDeliveryItem`] from its columns: `id` the delivery or
/// dead-letter id, `lane` as stored (`None`: its event is pruned).
#[allow(clippy::too_many_arguments)]
pub(crate) fn delivery_item(
    event_id: String,
    event_type: Option<String>,
    key: Option<String>,
    seq: Option<i64>,
    lane: Option<i64>,
    id: Option<i64>,
    state: DeliveryState,
) -> Result<HandlerDeliveryItem> {
    let lane = lane
        .map(|l| {
            Lane::try_from(l).map_err(|_| StoreError::Database(format!("lane {l} out of range")))
        })
        .transpose()?;
    Ok(HandlerDeliveryItem {
        event_id,
        event_type,
        key,
        seq,
        lane,
        id,
        state,
    })
}

/// A pending delivery's or dead letter's row, as the SQL backends read
/// it: `(kind, id, event id, type, key, seq, lane, attempts, time, last
/// error, attempt log JSON)`, `T` the backend's time column.
pub(crate) type RecordRow<T> = (
    String,
    i64,
    String,
    Option<String>,
    Option<String>,
    Option<i64>,
    i64,
    i64,
    T,
    Option<String>,
    Option<String>,
);

/// The items of [`RecordRow`]s, `time` converting the time column.
pub(crate) fn record_items<T>(
    rows: Vec<RecordRow<T>>,
    time: impl Fn(T) -> DateTime<Utc>,
) -> Result<Vec<HandlerDeliveryItem>> {
    rows.into_iter()
        .map(
            |(kind, id, event, ty, key, seq, lane, attempts, at, error, log)| {
                let log = attempt_log(log.as_deref())?;
                let state = delivery_state(&kind, to_u32(attempts), time(at), error, log)?;
                delivery_item(event, ty, key, seq, Some(lane), Some(id), state)
            },
        )
        .collect()
}

/// The id bound of a pending or dead page: ids below it.
pub(crate) fn id_before(after: &Option<crate::DeliveriesCursor>) -> Result<i64> {
    match after {
        None => Ok(i64::MAX),
        Some(crate::DeliveriesCursor::Id(id)) => Ok(*id),
        Some(other) => Err(StoreError::Invalid(format!(
            "cursor {other:?} does not page pending deliveries or dead letters"
        ))),
    }
}

/// The cursor of a completed page as `(completed_at, event_id)`.
pub(crate) fn completed_before(
    after: &Option<crate::DeliveriesCursor>,
) -> Result<Option<(DateTime<Utc>, String)>> {
    match after {
        None => Ok(None),
        Some(crate::DeliveriesCursor::Completed { at, event_id }) => {
            Ok(Some((*at, event_id.clone())))
        }
        Some(other) => Err(StoreError::Invalid(format!(
            "cursor {other:?} does not page completions"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoreError;

    fn ev(id: Option<&str>, key: Option<&str>) -> NewEvent {
        NewEvent {
            id: id.map(Into::into),
            event_type: "t".into(),
            key: key.map(Into::into),
            payload: b"{}".to_vec(),
            deliver_at: None,
            expected_seq: None,
        }
    }

    fn expecting(id: &str, key: &str, expected: Option<i64>) -> NewEvent {
        NewEvent {
            expected_seq: expected,
            ..ev(Some(id), Some(key))
        }
    }

    #[test]
    fn expectations_count_the_earlier_events_of_their_key() {
        let plan = PublishPlan::new(
            vec![
                expecting("a", "k", Some(4)),
                expecting("b", "j", None),
                expecting("c", "k", None),
                expecting("d", "k", Some(6)),
            ],
            16,
        )
        .expect("valid");
        assert!(plan.expects());
        // k at 4 before the write: a takes 5, c 6, d 7.
        let seqs = [Some(5), Some(1), Some(6), Some(7)];
        assert!(check_expected(plan.fresh.iter().zip(seqs)).is_ok());
        // k at 5: a's expectation fails, naming where k stood.
        let seqs = [Some(6), Some(1), Some(7), Some(8)];
        let err = check_expected(plan.fresh.iter().zip(seqs)).unwrap_err();
        assert!(
            matches!(&err, StoreError::SeqConflict { key, expected: 4, current: 5, index: 0, at: 5 } if key == "k"),
            "{err:?}"
        );
        // A later expectation of the batch counts its earlier events.
        let plan = PublishPlan::new(
            vec![expecting("a", "k", Some(0)), expecting("b", "k", Some(0))],
            16,
        )
        .expect("valid");
        let err = check_expected(plan.fresh.iter().zip([Some(1), Some(2)])).unwrap_err();
        assert!(
            matches!(
                &err,
                StoreError::SeqConflict {
                    expected: 0,
                    current: 0,
                    index: 1,
                    at: 1,
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn a_batch_expecting_a_key_of_earlier_batches_waits() {
        let earlier = PublishPlan::new(vec![ev(Some("x"), Some("k"))], 16).expect("valid");
        let other = PublishPlan::new(vec![ev(Some("y"), Some("j"))], 16).expect("valid");
        let plan = PublishPlan::new(vec![expecting("a", "k", Some(3))], 16).expect("valid");
        assert!(plan.expects_after([&other, &earlier]));
        assert!(!plan.expects_after([&other]));
        // Without an expectation, a batch of the key joins the group.
        assert!(!earlier.expects_after([&earlier]));
    }

    #[test]
    fn plan_dedups_within_batch_and_offsets_count_later_events_of_the_key() {
        let plan = PublishPlan::new(
            vec![
                ev(Some("a"), Some("k")),
                ev(Some("a"), Some("k")),
                ev(None, Some("k")),
                ev(None, None),
                ev(Some("b"), Some("j")),
                ev(Some("c"), Some("k")),
            ],
            16,
        )
        .expect("valid");
        assert_eq!(plan.ids.len(), 6);
        assert_eq!(plan.duplicates, 1);
        assert_eq!(plan.fresh.len(), 5);
        assert_eq!(
            plan.key_counts(),
            (vec!["j".to_string(), "k".to_string()], vec![1, 3])
        );
        assert_eq!(plan.seq_offsets(), vec![2, 1, 0, 0, 0]);
        assert_eq!(plan.client_ids(), vec!["a", "b", "c"]);
    }

    #[test]
    fn plan_refuses_a_batch_with_one_bad_event() {
        let err = PublishPlan::new(vec![ev(Some("ok"), None), ev(Some("has space"), None)], 16)
            .unwrap_err();
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.starts_with("events[1]: event id")),
            "{err}"
        );
    }
}
