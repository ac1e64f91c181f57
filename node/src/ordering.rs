//! Per-lane queue of deliveries: the ordering state machine (pure code).
//!
//! A [`LaneOwner`](crate::actors::LaneOwner) feeds every claimed batch into
//! one [`LaneQueue`] and asks it which deliveries may be attempted now. The
//! queue decides; the actor only carries the decision out.
//!
//! ```text
//!   claim batch ──accept──▶ held ids (de-dup) ──▶ slot (handler, key): seq order
//!                                                 slot (handler, unkeyed): id order
//!   next_ready(now) ◀── head of each keyed slot, if nothing of that slot is in flight
//!                       and head.due_at <= now; unkeyed: up to the handler's limit
//!   settled(id)  ── after the store acknowledged the completion or dead letter
//! ```
//!
//! # Invariants kept here (DESIGN.md section 2)
//! - **Per-key order**: in a keyed slot at most one delivery is in flight, and
//!   it is the lowest sequence number held. Delivery n+1 is handed out only
//!   after [`LaneQueue::settled`] for n, which the owner calls only once the
//!   store acknowledged n's completion or dead letter.
//! - **No duplicate without a cause**: the store may return a delivery again
//!   (the PostgreSQL claim cursor re-reads rows of transactions that were open
//!   at the previous claim). A delivery id is *held* from its first claim
//!   until it is settled, and then kept as a *tombstone* until a claim issued
//!   after the settlement returns: such a claim ran after the row was removed,
//!   so it cannot return it any more. Claims are numbered by
//!   [`LaneQueue::begin_claim`] for this reason.
//! - A key whose head waits (for its `due_at`, or in a retry inside its
//!   key handler) blocks only that key.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, Utc};
use lanebus_store::Delivery;

/// Ordering unit: deliveries of one handler and one key are handed out one
/// at a time in sequence order; unkeyed ones of a handler concurrently.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotKey {
    /// Handler id.
    pub handler_id: String,
    /// Event key; `None` for unkeyed deliveries.
    pub key: Option<String>,
}

impl SlotKey {
    /// The slot of a delivery.
    pub fn of(d: &Delivery) -> Self {
        SlotKey {
            handler_id: d.handler_id.clone(),
            key: d.key.clone(),
        }
    }
}

/// Number of a claim request, from [`LaneQueue::begin_claim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ClaimTicket(u64);

#[derive(Debug, Default)]
struct Slot {
    /// Queued, not yet handed out; keyed by sequence (keyed) or id (unkeyed).
    pending: BTreeMap<i64, Delivery>,
    /// Ids handed out and not yet settled.
    in_flight: BTreeSet<i64>,
}

/// How the queue may treat a handler right now (from the handler catalog).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandlerGate {
    /// Attempt, with at most this many of its deliveries in flight in the lane.
    Open {
        /// Concurrency limit for this handler in this lane (>= 1).
        max_in_flight: usize,
    },
    /// Keep its deliveries queued without attempting them (disabled handler,
    /// or unknown until the catalog is reloaded).
    Hold,
}

/// The per-lane ordering state. See the module docs.
#[derive(Debug, Default)]
pub struct LaneQueue {
    slots: HashMap<SlotKey, Slot>,
    /// Every id queued or in flight, with its slot and ordering position.
    held: HashMap<i64, (SlotKey, i64)>,
    /// Settled or dropped ids, with the ticket count when they were removed.
    tombstones: HashMap<i64, u64>,
    /// Tickets issued so far.
    tickets: u64,
    in_flight_per_handler: HashMap<String, usize>,
    queued: usize,
    in_flight: usize,
}

impl LaneQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Numbers a claim before it is sent to the store.
    pub fn begin_claim(&mut self) -> ClaimTicket {
        self.tickets += 1;
        ClaimTicket(self.tickets)
    }

    /// Takes a claimed batch (claimed with `ticket`). Deliveries already held
    /// or recently settled are ignored. Returns how many were new.
    pub fn accept(&mut self, ticket: ClaimTicket, deliveries: Vec<Delivery>) -> usize {
        let mut new = 0;
        for d in deliveries {
            if self.held.contains_key(&d.id) || self.tombstones.contains_key(&d.id) {
                continue;
            }
            let slot_key = SlotKey::of(&d);
            // Keyed slots order by sequence; unkeyed (or a keyed delivery
            // without a sequence, which the store never returns) by id.
            let pos = match (&d.key, d.seq) {
                (Some(_), Some(seq)) => seq,
                _ => d.id,
            };
            self.held.insert(d.id, (slot_key.clone(), pos));
            self.slots
                .entry(slot_key)
                .or_default()
                .pending
                .insert(pos, d);
            self.queued += 1;
            new += 1;
        }
        // A claim issued after a removal was acknowledged cannot return the
        // removed row: forget tombstones older than this claim.
        self.tombstones
            .retain(|_, removed_at| *removed_at >= ticket.0);
        new
    }

    /// Hands out every delivery that may be attempted at `now`, marking them
    /// in flight. `gate` tells per handler whether and how many may run.
    pub fn next_ready(
        &mut self,
        now: DateTime<Utc>,
        mut gate: impl FnMut(&str) -> HandlerGate,
    ) -> Vec<Delivery> {
        let mut out = Vec::new();
        let mut gates: HashMap<String, HandlerGate> = HashMap::new();
        for (slot_key, slot) in self.slots.iter_mut() {
            if slot.pending.is_empty() {
                continue;
            }
            let g = *gates
                .entry(slot_key.handler_id.clone())
                .or_insert_with(|| gate(&slot_key.handler_id));
            let HandlerGate::Open { max_in_flight } = g else {
                continue;
            };
            let running = self
                .in_flight_per_handler
                .entry(slot_key.handler_id.clone())
                .or_default();
            loop {
                if *running >= max_in_flight.max(1) {
                    break;
                }
                if slot_key.key.is_some() && !slot.in_flight.is_empty() {
                    break;
                }
                // Keyed: only the head, and only when due (a waiting head
                // blocks its key). Unkeyed: any due one, in id order.
                let pos = if slot_key.key.is_some() {
                    match slot.pending.iter().next() {
                        Some((p, d)) if d.due_at <= now => *p,
                        _ => break,
                    }
                } else {
                    match slot.pending.iter().find(|(_, d)| d.due_at <= now) {
                        Some((p, _)) => *p,
                        None => break,
                    }
                };
                let d = slot.pending.remove(&pos).expect("present");
                slot.in_flight.insert(d.id);
                *running += 1;
                self.queued -= 1;
                self.in_flight += 1;
                out.push(d);
            }
        }
        out
    }

    /// Earliest `due_at` later than `now` among queued deliveries that wait
    /// for their time and are not blocked behind an in-flight delivery of
    /// their key: when the owner should look again. Deliveries already due
    /// but held back (handler limit, disabled or unknown handler) are not
    /// counted: a settlement or a catalog change releases them, not the clock.
    pub fn next_due(&self, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.slots
            .iter()
            .filter_map(|(k, s)| {
                if k.key.is_some() {
                    if !s.in_flight.is_empty() {
                        return None;
                    }
                    s.pending
                        .values()
                        .next()
                        .map(|d| d.due_at)
                        .filter(|&at| at > now)
                } else {
                    s.pending
                        .values()
                        .map(|d| d.due_at)
                        .filter(|&at| at > now)
                        .min()
                }
            })
            .min()
    }

    /// Removes a delivery handed out by [`next_ready`](Self::next_ready),
    /// after the store acknowledged its completion or dead letter (or its row
    /// turned out to be gone). Unblocks its key. Returns its slot, or `None`
    /// if the id was not in flight.
    pub fn settled(&mut self, id: i64) -> Option<SlotKey> {
        let (slot_key, _) = self.held.get(&id).cloned()?;
        let slot = self.slots.get_mut(&slot_key)?;
        if !slot.in_flight.remove(&id) {
            return None;
        }
        self.held.remove(&id);
        self.tombstones.insert(id, self.tickets);
        self.in_flight -= 1;
        if let Some(n) = self.in_flight_per_handler.get_mut(&slot_key.handler_id) {
            *n = n.saturating_sub(1);
        }
        if slot.pending.is_empty() && slot.in_flight.is_empty() {
            self.slots.remove(&slot_key);
        }
        Some(slot_key)
    }

    /// Puts an in-flight delivery back at the head of its slot, to be handed
    /// out again at `d.due_at` (when its attempt could not be carried out,
    /// for instance because the store was unreachable). Returns `false` if it
    /// was not in flight.
    pub fn requeue(&mut self, d: Delivery) -> bool {
        let Some((slot_key, pos)) = self.held.get(&d.id).cloned() else {
            return false;
        };
        let Some(slot) = self.slots.get_mut(&slot_key) else {
            return false;
        };
        if !slot.in_flight.remove(&d.id) {
            return false;
        }
        slot.pending.insert(pos, d);
        self.in_flight -= 1;
        self.queued += 1;
        if let Some(n) = self.in_flight_per_handler.get_mut(&slot_key.handler_id) {
            *n = n.saturating_sub(1);
        }
        true
    }

    /// Drops every *queued* delivery of a handler (deleted, or unknown after a
    /// catalog reload). In-flight ones settle as usual. Returns the dropped ids.
    pub fn drop_handler(&mut self, handler_id: &str) -> Vec<i64> {
        let mut dropped = Vec::new();
        let keys: Vec<SlotKey> = self
            .slots
            .keys()
            .filter(|k| k.handler_id == handler_id)
            .cloned()
            .collect();
        for k in keys {
            let slot = self.slots.get_mut(&k).expect("present");
            for (_, d) in std::mem::take(&mut slot.pending) {
                self.held.remove(&d.id);
                self.tombstones.insert(d.id, self.tickets);
                self.queued -= 1;
                dropped.push(d.id);
            }
            if slot.in_flight.is_empty() {
                self.slots.remove(&k);
            }
        }
        dropped
    }

    /// Handler ids with queued deliveries.
    pub fn queued_handlers(&self) -> BTreeSet<String> {
        self.slots
            .iter()
            .filter(|(_, s)| !s.pending.is_empty())
            .map(|(k, _)| k.handler_id.clone())
            .collect()
    }

    /// Deliveries queued and not handed out.
    pub fn queued(&self) -> usize {
        self.queued
    }

    /// Deliveries handed out and not yet settled.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether the slot has nothing queued or in flight (its key handler can go).
    pub fn slot_idle(&self, slot: &SlotKey) -> bool {
        !self.slots.contains_key(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    fn t0() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    fn d(id: i64, handler: &str, key: Option<&str>, seq: i64) -> Delivery {
        Delivery {
            id,
            lane: 0,
            handler_id: handler.into(),
            event_id: format!("evt_{id}"),
            event_type: "issues.opened".into(),
            key: key.map(Into::into),
            seq: key.map(|_| seq),
            attempts: 0,
            due_at: t0(),
            last_error: None,
            payload: bytes::Bytes::from_static(b"{}"),
            published_at: t0(),
        }
    }

    fn open(_: &str) -> HandlerGate {
        HandlerGate::Open { max_in_flight: 64 }
    }

    fn ids(v: &[Delivery]) -> Vec<i64> {
        let mut ids: Vec<i64> = v.iter().map(|d| d.id).collect();
        ids.sort();
        ids
    }

    #[test]
    fn hands_out_only_the_head_of_each_key_in_sequence_order() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        // Arrival order differs from sequence order on purpose.
        q.accept(
            t,
            vec![
                d(12, "h", Some("a"), 2),
                d(11, "h", Some("a"), 1),
                d(20, "h", Some("b"), 1),
            ],
        );
        let first = q.next_ready(t0(), open);
        assert_eq!(ids(&first), vec![11, 20]);
        assert!(q.next_ready(t0(), open).is_empty(), "n+1 must wait for n");
        assert!(q.settled(11).is_some());
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![12]);
        assert_eq!(q.queued(), 0);
        assert_eq!(q.in_flight(), 2);
    }

    #[test]
    fn same_key_of_different_handlers_are_independent() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        q.accept(
            t,
            vec![
                d(1, "h1", Some("a"), 1),
                d(2, "h2", Some("a"), 1),
                d(3, "h1", Some("a"), 2),
            ],
        );
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![1, 2]);
    }

    #[test]
    fn duplicates_are_ignored_while_held_and_until_a_later_claim_returns() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        assert_eq!(
            q.accept(t1, vec![d(1, "h", Some("a"), 1), d(1, "h", Some("a"), 1)]),
            1
        );
        let t2 = q.begin_claim();
        assert_eq!(q.next_ready(t0(), open).len(), 1);
        // The row is re-read while in flight: ignored.
        assert_eq!(q.accept(t2, vec![d(1, "h", Some("a"), 1)]), 0);
        // Claim t3 is issued before the completion is acknowledged...
        let t3 = q.begin_claim();
        assert!(q.settled(1).is_some());
        // ...so it may still return the row: ignored thanks to the tombstone.
        assert_eq!(q.accept(t3, vec![d(1, "h", Some("a"), 1)]), 0);
        assert!(q.next_ready(t0(), open).is_empty());
        // A claim issued after the acknowledgement clears the tombstone.
        let t4 = q.begin_claim();
        assert_eq!(q.accept(t4, vec![]), 0);
        assert!(q.tombstones.is_empty());
    }

    #[test]
    fn a_key_whose_head_is_not_due_blocks_only_that_key() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        let mut late = d(1, "h", Some("a"), 1);
        late.due_at = t0() + Duration::seconds(5);
        q.accept(
            t,
            vec![late, d(2, "h", Some("a"), 2), d(3, "h", Some("b"), 1)],
        );
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![3]);
        assert_eq!(q.next_due(t0()), Some(t0() + Duration::seconds(5)));
        // A due head held back by its handler does not ask for a timer.
        assert_eq!(q.next_due(t0() + Duration::seconds(5)), None);
        assert!(q.next_ready(t0() + Duration::seconds(4), open).is_empty());
        assert_eq!(
            ids(&q.next_ready(t0() + Duration::seconds(5), open)),
            vec![1]
        );
        assert_eq!(
            q.next_due(t0()),
            None,
            "key a is blocked behind its in-flight head"
        );
    }

    #[test]
    fn unkeyed_run_concurrently_up_to_the_limit_and_skip_not_due_ones() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        let mut later = d(1, "h", None, 0);
        later.due_at = t0() + Duration::seconds(1);
        q.accept(
            t,
            vec![
                later,
                d(2, "h", None, 0),
                d(3, "h", None, 0),
                d(4, "h", None, 0),
            ],
        );
        let lim = |_: &str| HandlerGate::Open { max_in_flight: 2 };
        assert_eq!(ids(&q.next_ready(t0(), lim)), vec![2, 3]);
        assert!(q.next_ready(t0(), lim).is_empty(), "limit reached");
        q.settled(2);
        assert_eq!(ids(&q.next_ready(t0(), lim)), vec![4]);
        q.settled(3);
        assert!(q.next_ready(t0(), lim).is_empty(), "1 is not due yet");
        assert_eq!(
            ids(&q.next_ready(t0() + Duration::seconds(1), lim)),
            vec![1]
        );
    }

    #[test]
    fn handler_limit_also_bounds_keyed_slots() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        q.accept(
            t,
            vec![
                d(1, "h", Some("a"), 1),
                d(2, "h", Some("b"), 1),
                d(3, "h", Some("c"), 1),
            ],
        );
        let got = q.next_ready(t0(), |_| HandlerGate::Open { max_in_flight: 2 });
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn held_handlers_stay_queued_and_deleted_ones_are_dropped() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        q.accept(
            t,
            vec![
                d(1, "gone", Some("a"), 1),
                d(2, "gone", None, 0),
                d(3, "ok", Some("a"), 1),
            ],
        );
        let gate = |h: &str| {
            if h == "gone" {
                HandlerGate::Hold
            } else {
                open(h)
            }
        };
        assert_eq!(ids(&q.next_ready(t0(), gate)), vec![3]);
        assert_eq!(q.queued_handlers(), BTreeSet::from(["gone".to_string()]));
        let mut dropped = q.drop_handler("gone");
        dropped.sort();
        assert_eq!(dropped, vec![1, 2]);
        assert_eq!(q.queued(), 0);
        // A re-read of a dropped row is ignored.
        assert_eq!(q.accept(t, vec![d(1, "gone", Some("a"), 1)]), 0);
    }

    #[test]
    fn requeue_puts_the_head_back_and_keeps_the_order() {
        let mut q = LaneQueue::new();
        let t = q.begin_claim();
        q.accept(t, vec![d(1, "h", Some("a"), 1), d(2, "h", Some("a"), 2)]);
        let mut head = q.next_ready(t0(), open).pop().unwrap();
        head.due_at = t0() + Duration::seconds(2);
        head.attempts = 1;
        assert!(q.requeue(head));
        assert!(q.next_ready(t0(), open).is_empty(), "2 must not overtake 1");
        let again = q.next_ready(t0() + Duration::seconds(2), open);
        assert_eq!(ids(&again), vec![1]);
        assert_eq!(again[0].attempts, 1);
        assert!(q.settled(99).is_none());
        assert!(q.settled(1).is_some());
        assert!(!q.slot_idle(&SlotKey {
            handler_id: "h".into(),
            key: Some("a".into())
        }));
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![2]);
        q.settled(2);
        assert!(q.slot_idle(&SlotKey {
            handler_id: "h".into(),
            key: Some("a".into())
        }));
    }
}
