//! Per-lane queue of deliveries: the ordering state machine (pure code).
//!
//! A [`LaneOwner`](crate::actors::LaneOwner) feeds every claimed batch into
//! one [`LaneQueue`] and asks it which deliveries may be attempted now. The
//! queue decides; the actor only carries the decision out. The queue also
//! keeps the lane's claim cursor, because what it dropped from memory
//! decides where the next claim must read from.
//!
//! ```text
//!   begin_claim ──(ticket, cursor)──▶ store claim ──▶ accept_batch(ticket, rows, next cursor)
//!   accept ──▶ held ids (de-dup) ──▶ slot (handler, key): seq order
//!                  │                 slot (handler, unkeyed): id order
//!                  └── rows of trimmed slots/handlers are left in the store
//!   next_ready(now) ◀── head of each keyed slot, if nothing of that slot is in flight
//!                       and head.due_at <= now; unkeyed: up to the handler's limit
//!   retrying(id) ── the key runner recorded a failed attempt of in-flight `id`
//!   settled(id)  ── after the store acknowledged the completion or dead letter
//!   trim / release ── bounded memory without holding up other keys (below)
//! ```
//!
//! # Invariants kept here (docs/design.md section 2)
//! - **Per-key order**: in a keyed slot at most one delivery is in flight, and
//!   it is the lowest sequence number held. Delivery n+1 is handed out only
//!   after [`LaneQueue::settled`] for n, which the owner calls only once the
//!   store acknowledged n's completion or dead letter.
//! - **No duplicate without a cause**: the store may return a delivery again
//!   (the PostgreSQL claim cursor re-reads rows of transactions that were open
//!   at the previous claim, and a rescan re-reads on purpose). A delivery id
//!   is *held* from its first claim until it is settled, and then kept as a
//!   *tombstone* until a claim issued after the settlement returns: such a
//!   claim ran after the row was removed, so it cannot return it any more.
//!   Claims are numbered by [`LaneQueue::begin_claim`] for this reason, and
//!   answered in the order they were issued (the owner has one at a time).
//! - A key whose head waits (for its `due_at`, or in a retry inside its
//!   key runner) blocks only that key, also when its backlog is larger than
//!   the lane's buffer (next section).
//!
//! # Bounded memory without head-of-line blocking: trim and rescan
//!
//! The owner holds at most a buffer's worth of deliveries per lane (it stops
//! claiming at `cap` held; one claim adds at most about `cap`). Without more,
//! one key whose head keeps failing and whose backlog fills the buffer would
//! stop the lane's other keys from being claimed. So when the buffer is full
//! ([`LaneQueue::trim`]), the queue drops from memory (never from the store)
//! what is *stalled*:
//! - a keyed slot whose in-flight head is being retried (the key runner
//!   reported a failed attempt, [`LaneQueue::retrying`]): all of its queued
//!   deliveries;
//! - a keyed slot whose queued head is not due yet (a delayed delivery, or a
//!   retry scheduled before a restart or failover): all of its queued
//!   deliveries, the head included; its trim is not released before the
//!   head's due time ([`LaneQueue::wake`]);
//! - a handler that cannot attempt anything: held (disabled, or unknown until
//!   the catalog reloads), or whose in-flight limit in the lane is all taken
//!   by deliveries being retried: all of its queued deliveries;
//! - unkeyed deliveries that are not due yet: those, re-read from the
//!   earliest one's cursor once the earliest is due (unkeyed deliveries have
//!   no order, so no trim holds the slot's later rows back).
//!
//! A healthy slot (its head in flight and not failing) is never trimmed, so a
//! plain backlog costs no re-reads. Each trim is remembered, per slot or per
//! handler, with a *resume cursor*: the cursor of the claim that returned the
//! earliest dropped row. Every row of a trimmed slot or handler that a later
//! claim returns is left in the store, so nothing of a key can be accepted
//! past a gap: the key's order is kept by construction.
//!
//! [`LaneQueue::release`] lifts a trim once its cause is gone: a slot when it
//! holds nothing any more (the failing head settled: completed or
//! dead-lettered; a kept not-due head went through) and its handler is not
//! stalled; a handler when it is open again and its limit is not all taken by
//! retries. A release asks for a *rescan*: the next claim moves the cursor
//! back to the smallest resume cursor released (a claim from an older cursor
//! returns every row still stored from that point on, in commit order; the
//! per-key sequence order holds across it, see `lanebus_store`), and from that
//! claim on the released slot accepts rows again. Rows already held or
//! recently settled come back as duplicates and are ignored as above, so
//! nothing is handed out twice. While the cursor is behind the highest cursor
//! reached ([`LaneQueue::rescanning`]), the owner claims again at once after
//! a full batch, so the pass catches up in a few claims.
//!
//! Costs: memory stays within the buffer plus the trim records (one small
//! entry per trimmed slot or handler, gone after its rescan). A rescan
//! happens only when a trim is released, that is after the stalled head
//! settled or the handler recovered, never per tick; it re-reads the lane
//! from the earliest dropped row, so its cost is the rows stored in between.
//! A key that keeps failing one delivery after another is rescanned once per
//! settled delivery while the buffer is full. What remains: a buffer entirely
//! taken by heads being retried (as many failing keys in one lane as the
//! buffer) still holds up the lane until one of them settles.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use chrono::{DateTime, Utc};
use lanebus_store::{ClaimCursor, Delivery};

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

/// A claim request, from [`LaneQueue::begin_claim`]: its number and the
/// cursor to claim from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimTicket {
    n: u64,
    after: ClaimCursor,
}

impl ClaimTicket {
    /// The cursor this claim reads from ([`lanebus_store::LaneClaim::after`]).
    pub fn after(&self) -> &ClaimCursor {
        &self.after
    }
}

#[derive(Debug, Default)]
struct Slot {
    /// Queued, not yet handed out; keyed by (sequence, id) (keyed) or id
    /// (unkeyed). The id breaks ties: a recovery or a replay may hold a
    /// second delivery of one event (the same sequence number).
    pending: BTreeMap<Pos, Delivery>,
    /// Ids handed out and not yet settled.
    in_flight: BTreeSet<i64>,
}

/// Ordering position in a slot: (sequence, id) for keyed deliveries, (id, id)
/// for unkeyed ones.
type Pos = (i64, i64);

/// A held delivery's place.
#[derive(Debug, Clone)]
struct Held {
    slot: SlotKey,
    /// Ordering position in its slot.
    pos: Pos,
    /// Cursor of the claim that returned it (a claim from there re-reads it).
    from: ClaimCursor,
    /// Its payload's length, in bytes ([`LaneQueue::bytes`]).
    size: usize,
}

/// What was trimmed: one slot, or every slot of a handler.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum TrimKey {
    Slot(SlotKey),
    Handler(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TrimState {
    /// Rows are left in the store; waiting for the cause to go.
    Stalled,
    /// Released; the next claim starts the rescan.
    Released,
    /// Rows are accepted again from claims numbered this or later.
    Since(u64),
}

#[derive(Debug, Clone)]
struct Trim {
    /// Cursor from which a claim returns every dropped row.
    resume: ClaimCursor,
    state: TrimState,
    /// A keyed slot dropped whole because its head is not due before this
    /// time (delayed delivery, a retry from before a restart): not released
    /// before then ([`LaneQueue::wake`]).
    until: Option<DateTime<Utc>>,
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
    held: HashMap<i64, Held>,
    /// Settled or dropped ids, with the ticket count when they were removed.
    tombstones: HashMap<i64, u64>,
    /// Tickets issued so far.
    tickets: u64,
    in_flight_per_handler: HashMap<String, usize>,
    queued: usize,
    in_flight: usize,
    /// Payload bytes of the held deliveries (queued and in flight).
    bytes: usize,
    /// Claim cursor of the lane.
    cursor: ClaimCursor,
    /// Highest cursor reached.
    high_water: i64,
    /// In-flight ids whose key runner reported a failed attempt.
    retrying: HashSet<i64>,
    /// Slots and handlers whose rows are (partly) left in the store.
    trims: HashMap<TrimKey, Trim>,
    /// A release asked the next claim to read from here.
    rescan_from: Option<ClaimCursor>,
    /// Unkeyed deliveries not due yet, dropped from a full buffer: the
    /// earliest due time among them and the cursor to re-read them from.
    deferred: Option<(DateTime<Utc>, ClaimCursor)>,
}

impl LaneQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Numbers a claim before it is sent to the store, and tells where it
    /// reads from (a released trim moves the cursor back, see the module docs).
    pub fn begin_claim(&mut self) -> ClaimTicket {
        self.tickets += 1;
        if let Some(from) = self.rescan_from.take() {
            self.cursor = self.cursor.earliest(&from);
            for t in self.trims.values_mut() {
                if t.state == TrimState::Released {
                    t.state = TrimState::Since(self.tickets);
                }
            }
        }
        ClaimTicket {
            n: self.tickets,
            after: self.cursor.clone(),
        }
    }

    /// Takes a claimed batch and the store's next cursor for the lane.
    /// Returns how many deliveries were new.
    pub fn accept_batch(
        &mut self,
        ticket: ClaimTicket,
        deliveries: Vec<Delivery>,
        next_after: impl Into<ClaimCursor>,
    ) -> usize {
        let next_after = next_after.into();
        let n = ticket.n;
        let new = self.accept(ticket, deliveries);
        self.high_water = self.high_water.max(next_after.pos);
        if n == self.tickets {
            self.cursor = next_after;
        }
        new
    }

    /// Takes a claimed batch (claimed with `ticket`) without moving the
    /// cursor. Deliveries already held or recently settled are ignored, and
    /// so are those of a trimmed slot or handler (left in the store until
    /// the trim is released). Returns how many were new.
    pub fn accept(&mut self, ticket: ClaimTicket, deliveries: Vec<Delivery>) -> usize {
        let mut new = 0;
        for d in deliveries {
            if self.held.contains_key(&d.id) || self.tombstones.contains_key(&d.id) {
                continue;
            }
            let slot_key = SlotKey::of(&d);
            if !self.trims.is_empty() && self.rejects(&slot_key, &ticket) {
                continue;
            }
            // Keyed slots order by sequence; unkeyed (or a keyed delivery
            // without a sequence, which the store never returns) by id.
            let pos = match (&d.key, d.seq) {
                (Some(_), Some(seq)) => (seq, d.id),
                _ => (d.id, d.id),
            };
            self.held.insert(
                d.id,
                Held {
                    slot: slot_key.clone(),
                    pos,
                    from: ticket.after.clone(),
                    size: d.payload.len(),
                },
            );
            self.bytes += d.payload.len();
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
            .retain(|_, removed_at| *removed_at >= ticket.n);
        // A claim of the rescan read every row of a released trim from its
        // resume cursor on: the trim is over.
        self.trims
            .retain(|_, t| !matches!(t.state, TrimState::Since(s) if ticket.n >= s));
        new
    }

    fn rejects(&self, slot: &SlotKey, ticket: &ClaimTicket) -> bool {
        let blocks = |k: TrimKey| {
            self.trims.get(&k).is_some_and(|t| match t.state {
                TrimState::Since(s) => ticket.n < s,
                TrimState::Stalled | TrimState::Released => true,
            })
        };
        blocks(TrimKey::Slot(slot.clone())) || blocks(TrimKey::Handler(slot.handler_id.clone()))
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
                        Some((p, d)) if due(d) <= now => *p,
                        _ => break,
                    }
                } else {
                    match slot.pending.iter().find(|(_, d)| due(d) <= now) {
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
                    s.pending.values().next().map(due).filter(|&at| at > now)
                } else {
                    s.pending.values().map(due).filter(|&at| at > now).min()
                }
            })
            .chain(self.trims.values().filter_map(|t| t.until))
            .chain(self.deferred.as_ref().map(|(at, _)| *at))
            .min()
    }

    /// Records that the in-flight delivery `id` failed an attempt and waits
    /// for its retry: its key (and, if all of its handler's limit is taken
    /// by such, its handler) is stalled. Returns `false` if it is not in flight.
    pub fn retrying(&mut self, id: i64) -> bool {
        let in_flight = self
            .held
            .get(&id)
            .and_then(|h| self.slots.get(&h.slot))
            .is_some_and(|s| s.in_flight.contains(&id));
        if in_flight {
            self.retrying.insert(id);
        }
        in_flight
    }

    /// Removes a delivery handed out by [`next_ready`](Self::next_ready),
    /// after the store acknowledged its completion or dead letter (or its row
    /// turned out to be gone). Unblocks its key. Returns its slot, or `None`
    /// if the id was not in flight.
    pub fn settled(&mut self, id: i64) -> Option<SlotKey> {
        let slot_key = self.held.get(&id)?.slot.clone();
        let slot = self.slots.get_mut(&slot_key)?;
        if !slot.in_flight.remove(&id) {
            return None;
        }
        if let Some(h) = self.held.remove(&id) {
            self.bytes -= h.size;
        }
        self.retrying.remove(&id);
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
        let Some(Held {
            slot: slot_key,
            pos,
            ..
        }) = self.held.get(&d.id).cloned()
        else {
            return false;
        };
        let Some(slot) = self.slots.get_mut(&slot_key) else {
            return false;
        };
        if !slot.in_flight.remove(&d.id) {
            return false;
        }
        self.retrying.remove(&d.id);
        slot.pending.insert(pos, d);
        self.in_flight -= 1;
        self.queued += 1;
        if let Some(n) = self.in_flight_per_handler.get_mut(&slot_key.handler_id) {
            *n = n.saturating_sub(1);
        }
        true
    }

    /// Drops every *queued* delivery of a handler (deleted, or unknown after a
    /// catalog reload). In-flight ones settle as usual. Returns the dropped ids
    /// (the owner discards their rows). Rows a trim of the handler left in
    /// the store are read again (a rescan from the trim's resume cursor): the
    /// delete removed those it saw, but a publish that committed after the
    /// delete may have left some, which must be found to be discarded.
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
                if let Some(h) = self.held.remove(&d.id) {
                    self.bytes -= h.size;
                }
                self.tombstones.insert(d.id, self.tickets);
                self.queued -= 1;
                dropped.push(d.id);
            }
            if slot.in_flight.is_empty() {
                self.slots.remove(&k);
            }
        }
        let mut resume = None::<ClaimCursor>;
        self.trims.retain(|k, t| {
            let of_handler = match k {
                TrimKey::Slot(s) => s.handler_id == handler_id,
                TrimKey::Handler(h) => h == handler_id,
            };
            if of_handler {
                resume = Some(earliest(resume.take(), &t.resume));
            }
            !of_handler
        });
        if let Some(from) = resume {
            self.rescan_from = Some(earliest(self.rescan_from.take(), &from));
        }
        dropped
    }

    /// Whether `handler` can attempt nothing now: held, or its limit in the
    /// lane all taken by deliveries being retried.
    fn handler_stalled(handler: &str, gate: HandlerGate, retrying: &HashMap<&str, usize>) -> bool {
        match gate {
            HandlerGate::Hold => true,
            HandlerGate::Open { max_in_flight } => {
                retrying.get(handler).copied().unwrap_or(0) >= max_in_flight.max(1)
            }
        }
    }

    fn retrying_per_handler(&self) -> HashMap<&str, usize> {
        let mut per: HashMap<&str, usize> = HashMap::new();
        for id in &self.retrying {
            if let Some(h) = self.held.get(id) {
                *per.entry(h.slot.handler_id.as_str()).or_default() += 1;
            }
        }
        per
    }

    /// When `cap` or more deliveries are held, drops from memory (not from
    /// the store) the queued deliveries of stalled slots and handlers, and
    /// remembers where to re-read them (module docs). Returns the dropped ids.
    pub fn trim(
        &mut self,
        now: DateTime<Utc>,
        cap: usize,
        mut gate: impl FnMut(&str) -> HandlerGate,
    ) -> Vec<i64> {
        if self.queued + self.in_flight < cap || self.queued == 0 {
            return Vec::new();
        }
        let retrying = self.retrying_per_handler();
        // (slot, whole handler stalled)
        let mut plan: Vec<(SlotKey, bool)> = Vec::new();
        // Keyed slots whose head is not due, with its due time.
        let mut waiting_heads: Vec<(SlotKey, DateTime<Utc>)> = Vec::new();
        // Unkeyed slots holding deliveries that are not due.
        let mut not_due_unkeyed: Vec<SlotKey> = Vec::new();
        let mut gates: HashMap<&str, HandlerGate> = HashMap::new();
        for (k, slot) in &self.slots {
            if slot.pending.is_empty() {
                continue;
            }
            let g = *gates
                .entry(k.handler_id.as_str())
                .or_insert_with(|| gate(&k.handler_id));
            if Self::handler_stalled(&k.handler_id, g, &retrying) {
                plan.push((k.clone(), true));
            } else if k.key.is_some() {
                match slot.in_flight.iter().next() {
                    Some(id) if self.retrying.contains(id) => plan.push((k.clone(), false)),
                    Some(_) => {}
                    None => {
                        if let Some(head) = slot.pending.values().next() {
                            if due(head) > now {
                                waiting_heads.push((k.clone(), due(head)));
                            }
                        }
                    }
                }
            } else if slot.pending.values().any(|d| due(d) > now) {
                not_due_unkeyed.push(k.clone());
            }
        }
        let mut dropped = Vec::new();
        for (k, whole_handler) in plan {
            let resume = self.drop_queued(&k, &mut dropped);
            let key = if whole_handler {
                TrimKey::Handler(k.handler_id.clone())
            } else {
                TrimKey::Slot(k)
            };
            self.trims
                .entry(key)
                .and_modify(|t| {
                    t.resume = t.resume.earliest(&resume);
                    t.state = TrimState::Stalled;
                })
                .or_insert(Trim {
                    resume,
                    state: TrimState::Stalled,
                    until: None,
                });
        }
        // A keyed slot whose head waits for its time (delayed delivery):
        // dropped whole, head included, and read again once the head is
        // due; its later deliveries stay behind it in the store (order).
        for (k, until) in waiting_heads {
            let resume = self.drop_queued(&k, &mut dropped);
            self.trims
                .entry(TrimKey::Slot(k))
                .and_modify(|t| {
                    t.resume = t.resume.earliest(&resume);
                    t.state = TrimState::Stalled;
                    t.until = Some(t.until.map_or(until, |u| u.max(until)));
                })
                .or_insert(Trim {
                    resume,
                    state: TrimState::Stalled,
                    until: Some(until),
                });
        }
        // Unkeyed deliveries that are not due: dropped, and read again from
        // the earliest dropped one's cursor once the earliest is due. Unkeyed
        // deliveries have no order, so later rows of the slot are still taken.
        for k in not_due_unkeyed {
            let slot = self.slots.get_mut(&k).expect("planned");
            let later: Vec<Pos> = slot
                .pending
                .iter()
                .filter(|(_, d)| due(d) > now)
                .map(|(p, _)| *p)
                .collect();
            for pos in later {
                let d = slot.pending.remove(&pos).expect("listed");
                let h = self.held.remove(&d.id).expect("a queued delivery is held");
                self.bytes -= h.size;
                self.queued -= 1;
                // No tombstone: the rescan at its time must take it again.
                let (at, from) = self
                    .deferred
                    .get_or_insert_with(|| (due(&d), h.from.clone()));
                *at = (*at).min(due(&d));
                *from = from.earliest(&h.from);
                dropped.push(d.id);
            }
            if slot.pending.is_empty() && slot.in_flight.is_empty() {
                self.slots.remove(&k);
            }
        }
        dropped
    }

    /// Drops every queued delivery of the slot `k` from memory (their rows
    /// stay in the store), adding their ids to `dropped`, and forgets the
    /// slot if nothing of it is in flight. Returns the cursor from which a
    /// claim returns them all again. `k` must be a slot with queued
    /// deliveries (every queued delivery is held).
    fn drop_queued(&mut self, k: &SlotKey, dropped: &mut Vec<i64>) -> ClaimCursor {
        let slot = self.slots.get_mut(k).expect("planned");
        let mut resume = ClaimCursor::at(i64::MAX);
        for (_, d) in std::mem::take(&mut slot.pending) {
            let h = self.held.remove(&d.id).expect("a queued delivery is held");
            resume = resume.earliest(&h.from);
            self.bytes -= h.size;
            self.queued -= 1;
            dropped.push(d.id);
        }
        if slot.in_flight.is_empty() {
            self.slots.remove(k);
        }
        resume
    }

    /// Lifts the time condition of what [`trim`](Self::trim) dropped for
    /// not being due, once `now` reached it: a waiting keyed slot becomes
    /// releasable ([`release`](Self::release)), deferred unkeyed deliveries
    /// ask for a rescan at once. Returns whether anything was woken.
    pub fn wake(&mut self, now: DateTime<Utc>) -> bool {
        let mut woke = false;
        for t in self.trims.values_mut() {
            if t.until.is_some_and(|u| u <= now) {
                t.until = None;
                woke = true;
            }
        }
        if self.deferred.as_ref().is_some_and(|(at, _)| *at <= now) {
            let (_, from) = self.deferred.take().expect("checked");
            self.rescan_from = Some(earliest(self.rescan_from.take(), &from));
            woke = true;
        }
        woke
    }

    /// Lifts the trims whose cause is gone (module docs) and asks for a
    /// rescan from their resume cursor. Returns whether a rescan is pending.
    pub fn release(&mut self, mut gate: impl FnMut(&str) -> HandlerGate) -> bool {
        if self.trims.is_empty() {
            return self.rescan_from.is_some();
        }
        let retrying = self.retrying_per_handler();
        let mut gates: HashMap<String, HandlerGate> = HashMap::new();
        let mut released = Vec::new();
        for (k, t) in &self.trims {
            if t.state != TrimState::Stalled || t.until.is_some() {
                continue;
            }
            let handler = match k {
                TrimKey::Slot(s) => s.handler_id.as_str(),
                TrimKey::Handler(h) => h.as_str(),
            };
            let g = *gates
                .entry(handler.to_string())
                .or_insert_with(|| gate(handler));
            if Self::handler_stalled(handler, g, &retrying) {
                continue;
            }
            if let TrimKey::Slot(s) = k {
                if self.slots.contains_key(s) {
                    continue;
                }
            }
            released.push(k.clone());
        }
        for k in released {
            let t = self.trims.get_mut(&k).expect("present");
            t.state = TrimState::Released;
            self.rescan_from = Some(earliest(self.rescan_from.take(), &t.resume));
        }
        self.rescan_from.is_some()
    }

    /// Whether the cursor is behind the highest cursor reached (a rescan is
    /// under way): a full batch should be followed by another claim at once.
    pub fn rescanning(&self) -> bool {
        self.cursor.pos < self.high_water || self.rescan_from.is_some()
    }

    /// Whether some rows of the lane are left in the store by a trim.
    pub fn trimmed(&self) -> bool {
        !self.trims.is_empty()
    }

    /// Handler ids with rows left in the store by a trim.
    pub fn trimmed_handlers(&self) -> BTreeSet<String> {
        self.trims
            .keys()
            .map(|k| match k {
                TrimKey::Slot(s) => s.handler_id.clone(),
                TrimKey::Handler(h) => h.clone(),
            })
            .collect()
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

    /// Payload bytes of the deliveries held (queued and in flight), as
    /// [`crate::budget`] counts them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the slot has nothing queued or in flight (its key runner can go).
    pub fn slot_idle(&self, slot: &SlotKey) -> bool {
        !self.slots.contains_key(slot)
    }
}

/// The earlier of an optional cursor and `c` ([`ClaimCursor::earliest`]).
fn earliest(a: Option<ClaimCursor>, c: &ClaimCursor) -> ClaimCursor {
    match a {
        Some(a) => a.earliest(c),
        None => c.clone(),
    }
}

/// When `d` may be attempted, on this node's clock. A delivery due at its
/// event's publish (neither delayed nor retried: its due time was written
/// by the store's clock, like `published_at`) is due at once, so a node
/// whose clock is behind the store's does not hold fresh deliveries back.
/// A retry's due time was written by an owner's clock (a node's), a delayed
/// one's by the publisher (`deliver_at`): those are compared with `now`.
fn due(d: &Delivery) -> DateTime<Utc> {
    if d.due_at <= d.published_at {
        DateTime::<Utc>::MIN_UTC
    } else {
        d.due_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;
    use lanebus_store::Epoch;

    fn t0() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc)
    }

    fn d(id: i64, handler: &str, key: Option<&str>, seq: i64) -> Delivery {
        Delivery {
            id,
            lane: 0,
            epoch: Epoch(1),
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
            replay: false,
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
            t.clone(),
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

    #[test]
    fn a_fresh_delivery_is_due_at_once_whatever_the_clocks() {
        // The store's clock is 2 s ahead of this node's: a fresh delivery's
        // due time (its publish time) lies in the node's future.
        let mut q = LaneQueue::new();
        let mut fresh = d(1, "h", Some("a"), 1);
        fresh.published_at = t0() + Duration::seconds(2);
        fresh.due_at = fresh.published_at;
        let mut retried = d(2, "h", Some("b"), 1);
        retried.attempts = 1;
        retried.due_at = t0() + Duration::seconds(2);
        let t = q.begin_claim();
        q.accept(t, vec![fresh, retried]);
        assert_eq!(
            ids(&q.next_ready(t0(), open)),
            vec![1],
            "fresh: at once; retry: at its time"
        );
        assert_eq!(q.next_due(t0()), Some(t0() + Duration::seconds(2)));
    }

    fn slot(h: &str, k: Option<&str>) -> SlotKey {
        SlotKey {
            handler_id: h.into(),
            key: k.map(Into::into),
        }
    }

    /// Deliveries of `key` to handler `h`: seqs `from..=to`, ids `base + seq`.
    fn run_of(key: &str, base: i64, from: i64, to: i64) -> Vec<Delivery> {
        (from..=to)
            .map(|s| d(base + s, "h", Some(key), s))
            .collect()
    }

    #[test]
    fn a_retried_head_with_a_large_backlog_does_not_hold_up_other_keys() {
        let mut q = LaneQueue::new();
        let cap = 4;
        let t1 = q.begin_claim();
        assert_eq!(t1.after().pos, 0);
        q.accept_batch(t1, run_of("a", 100, 1, 6), 106);
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![101]);
        // Full, but the head is healthy: nothing is trimmed.
        assert!(q.trim(t0(), cap, open).is_empty());
        assert!(q.retrying(101));
        let mut dropped = q.trim(t0(), cap, open);
        dropped.sort();
        assert_eq!(dropped, vec![102, 103, 104, 105, 106]);
        assert_eq!((q.queued(), q.in_flight()), (0, 1));
        assert!(!q.release(open), "the head still fails");
        // The cursor goes on: later rows of `a` stay in the store, `b` flows.
        let t2 = q.begin_claim();
        assert_eq!(t2.after().pos, 106);
        let mut batch = run_of("a", 100, 7, 8);
        batch.push(d(201, "h", Some("b"), 1));
        assert_eq!(q.accept_batch(t2, batch, 201), 1);
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![201]);
        q.settled(201);
        // The head completes: `a` is released and re-read from where its
        // dropped rows were read, in order, without repeating the head.
        assert!(q.settled(101).is_some());
        assert!(q.release(open));
        assert!(q.rescanning());
        let t3 = q.begin_claim();
        assert_eq!(t3.after().pos, 0, "rescan from the resume cursor");
        // A re-read row of `b` (settled before this claim was issued) and
        // the head of `a` would be duplicates; the store no longer returns
        // the completed head.
        let mut again = run_of("a", 100, 2, 8);
        again.push(d(201, "h", Some("b"), 1));
        assert_eq!(q.accept_batch(t3, again, 201), 7);
        assert!(!q.trimmed());
        let mut order = Vec::new();
        loop {
            let got = q.next_ready(t0(), open);
            if got.is_empty() {
                break;
            }
            assert_eq!(got.len(), 1, "one at a time per key");
            order.push(got[0].seq.unwrap());
            q.settled(got[0].id);
        }
        assert_eq!(order, vec![2, 3, 4, 5, 6, 7, 8]);
        assert!(
            !q.rescanning(),
            "caught up: cursor back at its high-water mark"
        );
    }

    #[test]
    fn a_claim_issued_before_the_release_cannot_fill_the_released_key() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        q.accept_batch(t1, run_of("a", 100, 1, 3), 103);
        q.next_ready(t0(), open);
        q.retrying(101);
        assert_eq!(q.trim(t0(), 2, open).len(), 2);
        let stale = q.begin_claim();
        q.settled(101);
        assert!(q.release(open));
        // The stale claim read from past the dropped rows: seq 4 must not
        // be accepted before 2 and 3.
        assert_eq!(q.accept(stale, run_of("a", 100, 4, 4)), 0);
        let t = q.begin_claim();
        assert_eq!(t.after().pos, 0);
        assert_eq!(q.accept_batch(t, run_of("a", 100, 2, 4), 104), 3);
        assert_eq!(q.next_ready(t0(), open)[0].seq, Some(2));
    }

    #[test]
    fn a_held_handler_is_left_in_the_store_until_it_opens() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        q.accept_batch(
            t1,
            vec![
                d(1, "off", Some("a"), 1),
                d(2, "off", Some("a"), 2),
                d(3, "off", None, 0),
                d(4, "ok", Some("a"), 1),
            ],
            4,
        );
        let gate = |h: &str| {
            if h == "off" {
                HandlerGate::Hold
            } else {
                open(h)
            }
        };
        assert_eq!(ids(&q.next_ready(t0(), gate)), vec![4]);
        let mut dropped = q.trim(t0(), 4, gate);
        dropped.sort();
        assert_eq!(dropped, vec![1, 2, 3]);
        assert_eq!(q.queued(), 0);
        let t2 = q.begin_claim();
        // New rows of the held handler, any key, stay in the store.
        assert_eq!(
            q.accept_batch(
                t2,
                vec![d(5, "off", Some("z"), 1), d(6, "ok", Some("b"), 1)],
                6
            ),
            1
        );
        assert!(!q.release(gate));
        assert!(q.release(open), "enabled again");
        let t3 = q.begin_claim();
        assert_eq!(t3.after().pos, 0);
        let all = vec![
            d(1, "off", Some("a"), 1),
            d(2, "off", Some("a"), 2),
            d(3, "off", None, 0),
            d(5, "off", Some("z"), 1),
            d(6, "ok", Some("b"), 1),
        ];
        assert_eq!(q.accept_batch(t3, all, 6), 4);
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![1, 3, 5, 6]);
    }

    #[test]
    fn a_head_not_due_leaves_its_key_in_the_store_until_it_is_due() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        let mut late = d(1, "h", Some("a"), 1);
        late.due_at = t0() + Duration::seconds(30);
        q.accept_batch(
            t1,
            vec![
                late.clone(),
                d(2, "h", Some("a"), 2),
                d(3, "h", Some("a"), 3),
                d(4, "h", Some("b"), 1),
            ],
            4,
        );
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![4]);
        // Full: the waiting key goes whole, head included (a buffer of
        // delayed heads must not hold up the lane).
        assert_eq!(q.trim(t0(), 3, open), vec![1, 2, 3]);
        assert!(q.slot_idle(&slot("h", Some("a"))));
        assert_eq!(q.next_due(t0()), Some(late.due_at));
        // Later rows of the key stay in the store; other keys flow.
        let t2 = q.begin_claim();
        assert_eq!(
            q.accept_batch(
                t2,
                vec![d(5, "h", Some("a"), 4), d(6, "h", Some("c"), 1)],
                6
            ),
            1
        );
        assert!(!q.release(open), "not before the head is due");
        let later = t0() + Duration::seconds(30);
        assert!(!q.wake(t0() + Duration::seconds(29)));
        assert!(q.wake(later));
        assert!(q.release(open));
        let t = q.begin_claim();
        assert_eq!(t.after().pos, 0, "rescan from the dropped head");
        let all = vec![
            late,
            d(2, "h", Some("a"), 2),
            d(3, "h", Some("a"), 3),
            d(5, "h", Some("a"), 4),
        ];
        assert_eq!(q.accept_batch(t, all, 6), 4);
        let mut order = Vec::new();
        loop {
            let got: Vec<Delivery> = q
                .next_ready(later, open)
                .into_iter()
                .filter(|d| d.key.as_deref() == Some("a"))
                .collect();
            if got.is_empty() {
                break;
            }
            order.push(got[0].seq.unwrap());
            q.settled(got[0].id);
        }
        assert_eq!(order, vec![1, 2, 3, 4]);
    }

    #[test]
    fn unkeyed_deliveries_not_due_do_not_fill_the_buffer() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        let mut a = d(1, "h", None, 0);
        let mut b = d(2, "h", None, 0);
        a.due_at = t0() + Duration::seconds(60);
        b.due_at = t0() + Duration::seconds(30);
        q.accept_batch(t1, vec![a, b, d(3, "h", None, 0)], 3);
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![3]);
        let mut dropped = q.trim(t0(), 3, open);
        dropped.sort();
        assert_eq!(dropped, vec![1, 2]);
        assert_eq!((q.queued(), q.in_flight()), (0, 1));
        // New unkeyed rows of the handler are taken at once.
        let t2 = q.begin_claim();
        assert_eq!(q.accept_batch(t2, vec![d(4, "h", None, 0)], 4), 1);
        assert_eq!(ids(&q.next_ready(t0(), open)), vec![4]);
        assert_eq!(q.next_due(t0()), Some(t0() + Duration::seconds(30)));
        assert!(!q.wake(t0()));
        let at = t0() + Duration::seconds(30);
        assert!(q.wake(at));
        let t3 = q.begin_claim();
        assert_eq!(t3.after().pos, 0, "rescan from the earliest dropped row");
        let mut a = d(1, "h", None, 0);
        a.due_at = t0() + Duration::seconds(60);
        let mut b = d(2, "h", None, 0);
        b.due_at = at;
        assert_eq!(q.accept_batch(t3, vec![a, b], 4), 2);
        assert_eq!(ids(&q.next_ready(at, open)), vec![2]);
    }

    #[test]
    fn a_handler_whose_limit_is_all_taken_by_retries_is_stalled() {
        let mut q = LaneQueue::new();
        let one = |_: &str| HandlerGate::Open { max_in_flight: 1 };
        let t1 = q.begin_claim();
        q.accept_batch(
            t1,
            vec![
                d(1, "h", Some("a"), 1),
                d(2, "h", Some("b"), 1),
                d(3, "h", None, 0),
            ],
            3,
        );
        assert_eq!(q.next_ready(t0(), one).len(), 1);
        // A healthy delivery in flight: no trim even when full.
        assert!(q.trim(t0(), 3, one).is_empty());
        let in_flight_id = [1, 2, 3]
            .into_iter()
            .find(|id| q.retrying(*id))
            .expect("one in flight");
        assert_eq!(q.trim(t0(), 3, one).len(), 2);
        assert!(!q.release(one));
        q.settled(in_flight_id);
        assert!(q.release(one));
    }

    #[test]
    fn payload_bytes_are_counted_while_held_and_freed_when_they_leave() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        // Payload `{}`: 2 bytes each.
        q.accept_batch(
            t1,
            vec![
                d(1, "h", Some("a"), 1),
                d(2, "h", Some("a"), 2),
                d(3, "h", Some("b"), 1),
                d(4, "off", Some("c"), 1),
            ],
            4,
        );
        assert_eq!(q.bytes(), 8);
        // A repeat is not counted twice.
        let t2 = q.begin_claim();
        q.accept_batch(t2, vec![d(1, "h", Some("a"), 1)], 4);
        assert_eq!(q.bytes(), 8);
        let out = q.next_ready(t0(), |h| {
            if h == "off" {
                HandlerGate::Hold
            } else {
                open(h)
            }
        });
        assert_eq!(out.len(), 2);
        // In flight still counts; settled does not.
        assert_eq!(q.bytes(), 8);
        q.settled(1);
        assert_eq!(q.bytes(), 6);
        // Requeued: still held.
        let three = out.into_iter().find(|d| d.id == 3).expect("3 handed out");
        assert!(q.requeue(three));
        assert_eq!(q.bytes(), 6);
        // Trimmed and dropped ones leave memory.
        assert_eq!(q.drop_handler("off"), vec![4]);
        assert_eq!(q.bytes(), 4);
        let hold = |_: &str| HandlerGate::Hold;
        assert_eq!(q.trim(t0(), 1, hold).len(), 2);
        assert_eq!(q.bytes(), 0);
    }

    #[test]
    fn deleting_a_handler_forgets_its_trims_and_rescans_once_for_late_rows() {
        let mut q = LaneQueue::new();
        let t1 = q.begin_claim();
        q.accept_batch(
            t1,
            vec![d(1, "off", Some("a"), 1), d(2, "off", Some("a"), 2)],
            2,
        );
        let hold = |_: &str| HandlerGate::Hold;
        assert_eq!(q.trim(t0(), 2, hold).len(), 2);
        assert_eq!(q.trimmed_handlers(), BTreeSet::from(["off".to_string()]));
        assert!(q.drop_handler("off").is_empty());
        assert!(!q.trimmed());
        // Rows a late publish left for it must be found to be discarded:
        // one rescan from where the trim left rows.
        assert!(q.release(hold));
        let t2 = q.begin_claim();
        assert_eq!(t2.after().pos, 0);
        // Read again, they are queued (and dropped once the catalog
        // confirms the handler is gone); no rescan after that one.
        assert_eq!(
            q.accept_batch(
                t2,
                vec![d(1, "off", Some("a"), 1), d(2, "off", Some("a"), 2)],
                2
            ),
            2
        );
        assert_eq!(q.drop_handler("off"), vec![1, 2]);
        assert!(!q.release(hold));
    }
}
