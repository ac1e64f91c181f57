//! `LaneOwner`: one per owned lane; claims the lane's deliveries and hands
//! each key's head to its key runner.
//!
//! ```text
//!  Wake (store push, API publish hint)  ─┐
//!  poll interval, room freed, due timer ─┼─▶ claim (via StoreActor, fenced at epoch)
//!                                        │        │ owned == false ──▶ stop
//!                                        │        ▼
//!                                        │   LaneQueue::accept (de-dup by id)
//!                                        │        ▼
//!                                        └── LaneQueue::next_ready ──Attempt──▶ KeyRunner
//!  Settled(id) from KeyRunner ──▶ LaneQueue::settled ──▶ next head of that key
//! ```
//!
//! Decisions (what is due, what is next per key, what is a duplicate) are in
//! [`LaneQueue`], when to claim and how much in [`ClaimControl`]; this actor
//! only carries them out. It asks the store for
//! more only while it has room (queued + in flight below
//! [`LaneConfig::buffer_cap`]) and at most one claim at a time; a wake-up
//! during a claim triggers another claim right after, so a publish that
//! committed during the claim is not left waiting for the poll.
//!
//! A completion the store refused (fenced out) suspends dispatching until
//! the next claim tells whether the lane is still ours. A claim the store
//! refuses stops the lane (state `fenced_out`) and reports it to the
//! assignment ([`LaneDeps::fenced_out`]), which finds out who holds the lane
//! (see [`crate::assignment`]); without a listener (single node) the stop is
//! logged at WARN.
//!
//! A full buffer does not hold up the lane's other keys behind a key whose
//! head is being retried (or a disabled handler): after each dispatch the
//! queue releases the trims whose cause went and, when the buffer (or the
//! node's payload budget, [`super::budget`]) is full, trims what is stalled
//! ([`LaneQueue::trim`], [`LaneQueue::release`]; the
//! design is in [`crate::ordering`]). Key runners report a failed attempt
//! with [`Retrying`]. The claim cursor lives in the queue, which moves it
//! back for a rescan; while a rescan is under way a full batch is followed
//! by another claim at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use actix::prelude::*;
use chrono::Utc;
use lanebus_store::{ClaimCursor, DeliveryRef, Epoch, HandlerState, Lane, LaneClaim};

use super::budget::{BufferBudget, Reservation};
use super::key_runner::{Attempt, KeyRunner, KeyRunnerDeps};
use super::store_actor::{ClaimLane, DiscardDelivery, StoreActor, StoreCallError};
use crate::assignment::{OwnerTie, WorkGate, GATE_RECHECK};
use crate::catalog::HandlerCatalog;
use crate::claim::{ClaimControl, ClaimStart};
use crate::handler::Dispatcher;
use crate::metrics;
use crate::ordering::{ClaimTicket, HandlerGate, LaneQueue, SlotKey};
use crate::retry::RetryPolicy;

/// Tuning of a lane owner.
#[derive(Debug, Clone, Copy)]
pub struct LaneConfig {
    /// Held deliveries (queued + in flight) at which a lane stops claiming
    /// (default 256, as `--lane-buffer`). A claim asks for up to this many,
    /// because rows already held may come back (PostgreSQL cursor), so a
    /// lane holds at most twice this. Their payloads are bounded node-wide
    /// by [`buffer_bytes`](Self::buffer_bytes).
    ///
    /// The buffer is shared by the lane's keys, but a key whose head keeps
    /// failing (or a disabled handler) does not hold up the others: when the
    /// buffer is full its queued deliveries are dropped from memory and
    /// re-read later (see [`crate::ordering`]). Known limit: a buffer all
    /// taken by heads being retried still waits for one of them to settle.
    pub buffer_cap: usize,
    /// Payload bytes all lanes of the node may hold in memory together
    /// (default 256 MiB, `--buffer-bytes`): a lane claims fewer rows when
    /// the budget is short, and at least one when it holds nothing (see
    /// [`super::budget`]; the bound is this plus one payload per lane).
    pub buffer_bytes: usize,
    /// Claim at least this often without a wake-up (default 100 ms for
    /// stores without push wake-ups, 1 s with).
    pub poll_interval: Duration,
    /// Backoff of failed attempts.
    pub retry: RetryPolicy,
}

impl Default for LaneConfig {
    fn default() -> Self {
        LaneConfig {
            buffer_cap: 256,
            buffer_bytes: 256 << 20,
            poll_interval: Duration::from_millis(100),
            retry: RetryPolicy::default(),
        }
    }
}

/// State of a lane on this node, as `GET /admin/lanes` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneState {
    /// Claiming and delivering.
    Active,
    /// Stopped (unassigned, handed over, or the node is stopping).
    Stopped,
    /// Stopped because the store refused a claim: another process holds the
    /// lane at this epoch or a higher one.
    FencedOut,
}

impl LaneState {
    /// The API's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            LaneState::Active => "active",
            LaneState::Stopped => "stopped",
            LaneState::FencedOut => "fenced_out",
        }
    }
}

/// One lane's observable state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneStatus {
    /// Epoch this node owns the lane at.
    pub epoch: Epoch,
    /// Active or stopped.
    pub state: LaneState,
    /// Deliveries queued on this node.
    pub queued: usize,
    /// Deliveries being attempted.
    pub in_flight: usize,
    /// How long the same oldest transaction had held the lane's claim
    /// cursor open when the lane last claimed (PostgreSQL; `None` when no
    /// transaction was open below the cursor then).
    pub horizon_held: Option<Duration>,
}

/// Observable state of every lane owner of the node (admin API, tests).
#[derive(Debug, Default)]
pub struct LaneBoard {
    lanes: RwLock<BTreeMap<Lane, LaneStatus>>,
    budget: BufferBudget,
}

impl LaneBoard {
    /// The node-wide budget of buffered payload bytes, shared by its lanes.
    pub fn budget(&self) -> &BufferBudget {
        &self.budget
    }

    /// Snapshot by lane number.
    pub fn snapshot(&self) -> BTreeMap<Lane, LaneStatus> {
        self.lanes.read().expect("not poisoned").clone()
    }

    fn set(&self, lane: Lane, status: LaneStatus) {
        self.lanes
            .write()
            .expect("not poisoned")
            .insert(lane, status);
    }

    /// The longest [`LaneStatus::horizon_held`] of the active lanes (`None`:
    /// none had a transaction open below its cursor at its last claim), for
    /// `lanebus_claim_horizon_age_seconds`.
    pub fn horizon_age(&self) -> Option<Duration> {
        self.lanes
            .read()
            .expect("not poisoned")
            .values()
            .filter(|s| s.state == LaneState::Active)
            .filter_map(|s| s.horizon_held)
            .max()
    }

    /// Sum of queued and in-flight deliveries over the active lanes.
    pub fn held(&self) -> usize {
        self.lanes
            .read()
            .expect("not poisoned")
            .values()
            .filter(|s| s.state == LaneState::Active)
            .map(|s| s.queued + s.in_flight)
            .sum()
    }
}

/// Fact: new deliveries may be waiting in the lane (store push, API hint).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Wake;

/// Fact: the handler catalog was reloaded.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct CatalogChanged;

/// Command: stop claiming and handing out; the lane owner stops once
/// nothing of the lane is in flight (graceful shutdown, planned handover).
/// Deliveries waiting for a retry count as in flight: the caller bounds the
/// wait at `until` and then sends [`StopLane`]; their failed attempts are
/// already recorded in the store. No attempt, retries included, starts that
/// could not end by `until` ([`OwnerTie::drain`]).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Drain {
    /// The drain's bound.
    pub until: std::time::Instant,
}

/// Why a lane owner stopped ([`OwnerStopped`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// A drain ended with nothing in flight.
    Drained,
    /// The store refused a claim: another process holds the lane.
    FencedOut,
    /// Told to ([`StopLane`]), or the node's store actor is gone.
    Ended,
}

/// Fact, to the owner's supervisor: a lane owner stopped.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct OwnerStopped {
    /// Its lane.
    pub lane: Lane,
    /// The epoch it worked at.
    pub epoch: Epoch,
    /// Why.
    pub why: StopCause,
}

/// Command: stop the lane now (ownership moved, or a drain took too long).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct StopLane;

/// How a delivery left its key runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettledOutcome {
    /// The store recorded the completion.
    Completed,
    /// The store moved it to the dead letters.
    DeadLettered,
    /// The store refused the write: fenced out, or the row is gone.
    Refused,
    /// Its handler was deleted: nothing was sent (the row, if a late publish
    /// left one, was discarded). Says nothing about the lane's ownership.
    HandlerGone,
}

/// Fact: a delivery handed out to a key runner is done with.
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Settled {
    /// Delivery id.
    pub id: i64,
    /// What happened.
    pub outcome: SettledOutcome,
}

/// Fact: an in-flight delivery was not attempted because its handler is
/// disabled (a `410 Gone`, or by hand); any failed attempt is recorded.
/// The owner puts it back at the head of its key, where it waits until the
/// handler is enabled again.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct Parked {
    /// The delivery, with its attempt count and due time as recorded.
    pub delivery: lanebus_store::Delivery,
}

/// Fact: an in-flight delivery failed an attempt and waits for its retry
/// (the reschedule is recorded in the store).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Retrying {
    /// Delivery id.
    pub id: i64,
}

/// Everything a lane owner needs from the node.
#[derive(Clone)]
pub struct LaneDeps {
    /// The node's store actor.
    pub store_actor: Addr<StoreActor>,
    /// Handler catalog.
    pub catalog: Arc<HandlerCatalog>,
    /// Hands deliveries over.
    pub dispatcher: Dispatcher,
    /// Observable state of the node's lanes.
    pub board: Arc<LaneBoard>,
    /// Tuning.
    pub config: LaneConfig,
    /// Closed while this node must not hand work over (lease lapsed).
    pub gate: WorkGate,
    /// Where a lane owner reports `(lane, epoch)` when the store refuses its
    /// claim ([`crate::assignment::LaneAssignment::fenced_out_reports`]).
    pub fenced_out: Option<tokio::sync::mpsc::UnboundedSender<(Lane, Epoch)>>,
    /// Hears that the owner stopped ([`super::LaneSupervisor`]).
    pub supervisor: Option<Recipient<OwnerStopped>>,
}

/// A claim's room in the node's budget, given back when the claim is
/// answered ([`ClaimRoom::settle`]) or, unanswered, when dropped: an owner
/// stopped with its claim under way has the claim's future dropped by
/// actix, and room kept for good would shrink every later claim of the
/// node.
struct ClaimRoom {
    board: Arc<LaneBoard>,
    reservation: Option<Reservation>,
}

impl ClaimRoom {
    /// Gives the room back, learning from the `rows` new deliveries of
    /// `bytes` payload bytes the claim brought ([`BufferBudget::claimed`]).
    fn settle(mut self, bytes: usize, rows: usize) {
        if let Some(r) = self.reservation.take() {
            self.board.budget().claimed(r, bytes, rows);
        }
    }
}

impl Drop for ClaimRoom {
    fn drop(&mut self) {
        if let Some(r) = self.reservation.take() {
            self.board.budget().claimed(r, 0, 0);
        }
    }
}

/// The lane owner actor. See the module docs.
pub struct LaneOwner {
    lane: Lane,
    epoch: Epoch,
    deps: LaneDeps,
    /// Shared with the key runners and their attempts.
    tie: Arc<OwnerTie>,
    queue: LaneQueue,
    /// When to claim and how much ([`crate::claim`]).
    ctl: ClaimControl,
    claim_retry: Option<SpawnHandle>,
    /// A dispatch deferred by the closed work gate is scheduled.
    gate_recheck: bool,
    reloading: bool,
    /// Unknown handlers were met during a reload that may have started
    /// before they were seen: reload once more before dropping anything.
    reload_again: bool,
    key_runners: HashMap<SlotKey, Addr<KeyRunner>>,
    due_timer: Option<(chrono::DateTime<Utc>, SpawnHandle)>,
    /// The queue's payload bytes as last counted in the node's budget.
    counted_bytes: std::cell::Cell<usize>,
    /// The store refused a claim: the lane stopped for that reason.
    fenced_out: bool,
}

impl LaneOwner {
    /// An owner of `lane` at `epoch` (already fenced in the store).
    pub fn new(lane: Lane, epoch: Epoch, deps: LaneDeps) -> Self {
        LaneOwner {
            lane,
            epoch,
            tie: Arc::new(OwnerTie::new(lane, epoch, deps.gate.clone())),
            deps,
            queue: LaneQueue::new(),
            ctl: ClaimControl::new(),
            claim_retry: None,
            gate_recheck: false,
            reloading: false,
            reload_again: false,
            key_runners: HashMap::new(),
            due_timer: None,
            counted_bytes: std::cell::Cell::new(0),
            fenced_out: false,
        }
    }

    /// What binds this owner's attempts to it. Whoever stops the owner ends
    /// it first ([`OwnerTie::end`]), before another owner of the lane may
    /// start on this node; the owner ends it itself when it stops.
    pub fn tie(&self) -> Arc<OwnerTie> {
        self.tie.clone()
    }

    /// Brings the node's budget up to date with the queue's payload bytes.
    fn count_bytes(&self) {
        let now = self.queue.bytes();
        let before = self.counted_bytes.replace(now);
        if before != now {
            self.deps.board.budget().moved(before, now);
        }
    }

    fn held(&self) -> usize {
        self.queue.queued() + self.queue.in_flight()
    }

    fn claim(&mut self, ctx: &mut Context<Self>) {
        let (lane, cap) = (self.lane, self.deps.config.buffer_cap);
        let dispatcher = &self.deps.dispatcher;
        let want = match self.ctl.start(self.held(), cap, || {
            dispatcher.lane_attempts_in_flight(lane)
        }) {
            ClaimStart::Hold => return,
            ClaimStart::Want(want) => want,
        };
        // Fewer rows when the node's payload budget is short.
        let reservation =
            self.deps
                .board
                .budget()
                .reserve(want, self.held(), self.deps.config.buffer_bytes);
        let Some(limit) = self.ctl.limit(reservation.rows) else {
            // Spent: a settlement here or the poll interval tries again.
            // Meanwhile what this lane holds but cannot attempt (a disabled
            // handler's deliveries, a retried key's followers) must not pin
            // the budget, or lanes holding only such would never claim
            // again: leave it in the store.
            self.deps.board.budget().claimed(reservation, 0, 0);
            self.trim_stalled();
            return;
        };
        let room = ClaimRoom {
            board: self.deps.board.clone(),
            reservation: Some(reservation),
        };
        let ticket = self.queue.begin_claim();
        let claim = LaneClaim {
            lane: self.lane,
            epoch: self.epoch,
            after: ticket.after().clone(),
            limit,
        };
        let fut = self.deps.store_actor.send(ClaimLane(claim));
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            act.ctl.answered();
            let res = res.unwrap_or(Err(StoreCallError::Stopped));
            let bytes_before = act.queue.bytes();
            let rows_before = act.held();
            let res = res.map(|batch| (batch, bytes_before, rows_before));
            match res {
                Ok((batch, _, _)) if !batch.owned => {
                    room.settle(0, 0);
                    act.fenced_out = true;
                    match &act.deps.fenced_out {
                        // The assignment finds out who holds it and says so
                        // once per lane (a cluster's moves do this too).
                        Some(report) => {
                            tracing::debug!(lane = act.lane, epoch = act.epoch.0, "fenced out: stopping the lane");
                            let _ = report.send((act.lane, act.epoch));
                        }
                        None => tracing::warn!(
                            lane = act.lane,
                            epoch = act.epoch.0,
                            "fenced out: another process fenced this lane in the store; the lane \
                             stays stopped until this process restarts"
                        ),
                    }
                    ctx.stop();
                }
                Ok((batch, bytes_before, rows_before)) => {
                    let returned = batch.deliveries.len();
                    act.ctl.claimed(returned, limit);
                    let moved = batch.next_after.passed(ticket.after());
                    act.ctl
                        .note_horizon(batch.next_after.open.first().copied(), Instant::now());
                    let new = act.accepted(ticket, batch.deliveries, batch.next_after, ctx);
                    room.settle(
                        act.queue.bytes().saturating_sub(bytes_before),
                        act.held().saturating_sub(rows_before),
                    );
                    act.count_bytes();
                    act.dispatch(ctx);
                    let queue = &act.queue;
                    if act.ctl.go_on(returned, limit, new, moved, || {
                        queue.rescanning() || queue.trimmed()
                    }) {
                        act.claim(ctx);
                    }
                }
                Err(StoreCallError::Stopped) => {
                    room.settle(0, 0);
                    ctx.stop();
                }
                Err(e) => {
                    room.settle(0, 0);
                    let wait = act.ctl.failed();
                    tracing::warn!(lane = act.lane, error = %e, retry_in_ms = wait.as_millis() as u64, "claim failed");
                    if let Some(h) = act.claim_retry.take() {
                        ctx.cancel_future(h);
                    }
                    act.claim_retry = Some(ctx.run_later(wait, |act, ctx| {
                        act.claim_retry = None;
                        act.claim(ctx);
                    }));
                }
            }
        }));
    }

    fn accepted(
        &mut self,
        ticket: ClaimTicket,
        deliveries: Vec<lanebus_store::Delivery>,
        next_after: ClaimCursor,
        ctx: &mut Context<Self>,
    ) -> usize {
        let new = self.queue.accept_batch(ticket, deliveries, next_after);
        if new > 0 {
            let catalog = self.deps.catalog.all();
            if self
                .queue
                .queued_handlers()
                .iter()
                .any(|h| !catalog.contains_key(h))
            {
                self.reload_catalog(ctx);
            }
        }
        new
    }

    /// A handler id we do not know: reload, then drop (and discard) what is
    /// still unknown. Only a reload that started after the deliveries were
    /// seen may condemn them, so one asked for during a reload runs after it.
    fn reload_catalog(&mut self, ctx: &mut Context<Self>) {
        if self.reloading {
            self.reload_again = true;
            return;
        }
        self.reloading = true;
        let catalog = self.deps.catalog.clone();
        let fut = async move { catalog.reload_fresh().await };
        ctx.spawn(fut.into_actor(self).map(|res, act, ctx| {
            act.reloading = false;
            if std::mem::take(&mut act.reload_again) {
                act.reload_catalog(ctx);
                return;
            }
            match res {
                Ok(()) => act.drop_unknown_handlers(ctx),
                Err(e) => {
                    tracing::warn!(lane = act.lane, error = %e, "handler catalog reload failed")
                }
            }
            act.dispatch(ctx);
        }));
    }

    /// Drops the queued deliveries of handlers the catalog no longer has
    /// (confirmed gone by a reload started after they were seen) and
    /// discards their rows: `DELETE /v1/handlers/{id}` removed the rows it
    /// saw, but a publish that read the handler before the delete and
    /// committed after it leaves rows nobody would ever complete.
    fn drop_unknown_handlers(&mut self, ctx: &mut Context<Self>) {
        let catalog = self.deps.catalog.all();
        self.deps.dispatcher.retain_known(&catalog);
        let mut handlers = self.queue.queued_handlers();
        handlers.extend(self.queue.trimmed_handlers());
        for h in handlers {
            if catalog.contains_key(&h) {
                continue;
            }
            let dropped = self.queue.drop_handler(&h);
            if dropped.is_empty() {
                continue;
            }
            tracing::debug!(lane = self.lane, handler = %h, dropped = dropped.len(), "dropped deliveries of a deleted handler");
            let refs: Vec<_> = dropped
                .iter()
                .map(|&id| DeliveryRef {
                    id,
                    lane: self.lane,
                    epoch: self.epoch,
                    attempts: 0,
                })
                .collect();
            let sa = self.deps.store_actor.clone();
            let (lane, handler) = (self.lane, h.clone());
            let fut = async move {
                let answers = futures::future::join_all(
                    refs.into_iter().map(|r| sa.send(DiscardDelivery(r))),
                )
                .await;
                let discarded = answers.iter().filter(|a| matches!(a, Ok(Ok(true)))).count();
                let failed = answers.iter().filter(|a| !matches!(a, Ok(Ok(_)))).count();
                if discarded > 0 {
                    metrics::orphans_discarded(&handler, discarded);
                    tracing::info!(lane, handler = %handler, discarded, "discarded deliveries of a deleted handler (published as it was deleted)");
                }
                if failed > 0 {
                    tracing::warn!(lane, handler = %handler, failed, "could not discard deliveries of a deleted handler; a later claim finds them again");
                }
            };
            ctx.spawn(fut.into_actor(self));
        }
    }

    /// Drops from memory every stalled delivery of the lane (as a full
    /// buffer would, [`LaneQueue::trim`]), for the node's payload budget.
    fn trim_stalled(&mut self) {
        let catalog = self.deps.catalog.all();
        let gate = |h: &str| match catalog.get(h) {
            Some(c) if c.state == HandlerState::Enabled => HandlerGate::Open {
                max_in_flight: c.max_in_flight.max(1) as usize,
            },
            _ => HandlerGate::Hold,
        };
        let dropped = self.queue.trim(Utc::now(), 1, gate);
        if !dropped.is_empty() {
            tracing::debug!(
                lane = self.lane,
                dropped = dropped.len(),
                "payload budget spent: left stalled deliveries in the store"
            );
            let queue = &self.queue;
            self.key_runners.retain(|slot, _| !queue.slot_idle(slot));
            self.publish_status();
        }
    }

    fn dispatch(&mut self, ctx: &mut Context<Self>) {
        if self.ctl.draining() {
            self.publish_status();
            if self.queue.in_flight() == 0 {
                ctx.stop();
            }
            return;
        }
        if !self.deps.gate.open() {
            // This node's lease lapsed: hand nothing over; the lane is taken
            // away shortly, or the gate opens again at the same epoch.
            self.publish_status();
            if !self.gate_recheck {
                self.gate_recheck = true;
                ctx.run_later(GATE_RECHECK, |act, ctx| {
                    act.gate_recheck = false;
                    act.dispatch(ctx);
                });
            }
            return;
        }
        if self.ctl.suspect() {
            self.publish_status();
            return;
        }
        let now = Utc::now();
        let catalog = self.deps.catalog.all();
        let gate = |h: &str| match catalog.get(h) {
            Some(c) if c.state == HandlerState::Enabled => HandlerGate::Open {
                max_in_flight: c.max_in_flight.max(1) as usize,
            },
            _ => HandlerGate::Hold,
        };
        let ready = self.queue.next_ready(now, gate);
        for delivery in ready {
            let Some(handler) = catalog.get(&delivery.handler_id).cloned() else {
                continue;
            };
            let slot = SlotKey::of(&delivery);
            let attempt = Attempt { delivery, handler };
            if slot.key.is_some() {
                let addr = self.key_runners.entry(slot).or_insert_with(|| {
                    KeyRunner::new(key_runner_deps(&self.deps, &self.tie, ctx.address())).start()
                });
                addr.do_send(attempt);
            } else {
                // Unkeyed: a key runner per delivery, gone when it settles.
                KeyRunner::new(key_runner_deps(&self.deps, &self.tie, ctx.address()))
                    .start()
                    .do_send(attempt);
            }
        }
        // Stalled keys and handlers must not hold up the rest of the lane;
        // what was left in the store for not being due comes back when due.
        self.queue.wake(now);
        let rescan = self.queue.release(gate);
        let cap = self.deps.config.buffer_cap.max(1);
        // When the node's payload budget is spent, stalled deliveries (a
        // disabled handler's, a retried key's followers) make room too, or
        // they would pin the budget and slow every other lane to one
        // delivery at a time.
        let spent = self.deps.board.budget().held() >= self.deps.config.buffer_bytes;
        let dropped = self.queue.trim(now, if spent { 1 } else { cap }, gate);
        if !dropped.is_empty() {
            tracing::debug!(
                lane = self.lane,
                dropped = dropped.len(),
                "buffer or payload budget full: left stalled deliveries in the store"
            );
            self.count_bytes();
            let queue = &self.queue;
            self.key_runners.retain(|slot, _| !queue.slot_idle(slot));
        }
        if (rescan || !dropped.is_empty()) && self.held() < cap {
            self.claim(ctx);
        }
        self.arm_due_timer(ctx);
        self.publish_status();
    }

    fn arm_due_timer(&mut self, ctx: &mut Context<Self>) {
        let Some(due) = self.queue.next_due(Utc::now()) else {
            return;
        };
        if let Some((at, handle)) = self.due_timer {
            if at <= due {
                return;
            }
            ctx.cancel_future(handle);
        }
        let wait = (due - Utc::now()).to_std().unwrap_or(Duration::ZERO) + Duration::from_millis(1);
        let handle = ctx.run_later(wait, |act, ctx| {
            act.due_timer = None;
            act.dispatch(ctx);
        });
        self.due_timer = Some((due, handle));
    }

    fn publish_status(&self) {
        self.count_bytes();
        let (queued, in_flight) = (self.queue.queued(), self.queue.in_flight());
        self.deps.board.set(
            self.lane,
            LaneStatus {
                epoch: self.epoch,
                state: LaneState::Active,
                queued,
                in_flight,
                horizon_held: self.ctl.horizon_held(),
            },
        );
        metrics::lane_depth(self.lane, queued, in_flight);
    }
}

fn key_runner_deps(deps: &LaneDeps, tie: &Arc<OwnerTie>, owner: Addr<LaneOwner>) -> KeyRunnerDeps {
    KeyRunnerDeps {
        epoch: tie.epoch(),
        owner,
        store_actor: deps.store_actor.clone(),
        dispatcher: deps.dispatcher.clone(),
        catalog: deps.catalog.clone(),
        retry: deps.config.retry,
        tie: tie.clone(),
    }
}

impl Actor for LaneOwner {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(usize::MAX >> 4);
        self.publish_status();
        // Catalog reloads: drop deliveries of deleted handlers, start newly
        // known or re-enabled ones.
        let mut versions = self.deps.catalog.subscribe();
        let me = ctx.address().recipient::<CatalogChanged>();
        tokio::spawn(async move {
            while versions.changed().await.is_ok() {
                if me.try_send(CatalogChanged).is_err() && !me.connected() {
                    break;
                }
            }
        });
        ctx.run_interval(self.deps.config.poll_interval, |act, ctx| act.claim(ctx));
        self.claim(ctx);
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        // Its attempts not sent yet are never sent; its deliveries are
        // dropped with it.
        self.tie.end();
        let counted = self.counted_bytes.replace(0);
        self.deps.board.budget().moved(counted, 0);
        self.deps.board.set(
            self.lane,
            LaneStatus {
                epoch: self.epoch,
                state: if self.fenced_out {
                    LaneState::FencedOut
                } else {
                    LaneState::Stopped
                },
                queued: 0,
                in_flight: 0,
                horizon_held: None,
            },
        );
        metrics::lane_depth(self.lane, 0, 0);
        if let Some(s) = &self.deps.supervisor {
            let why = if self.fenced_out {
                StopCause::FencedOut
            } else if self.ctl.draining() && self.queue.in_flight() == 0 {
                StopCause::Drained
            } else {
                StopCause::Ended
            };
            s.do_send(OwnerStopped {
                lane: self.lane,
                epoch: self.epoch,
                why,
            });
        }
    }
}

impl Handler<Wake> for LaneOwner {
    type Result = ();

    fn handle(&mut self, _: Wake, ctx: &mut Self::Context) {
        self.claim(ctx);
    }
}

impl Handler<CatalogChanged> for LaneOwner {
    type Result = ();

    fn handle(&mut self, _: CatalogChanged, ctx: &mut Self::Context) {
        if !self.reloading {
            self.drop_unknown_handlers(ctx);
        }
        self.dispatch(ctx);
    }
}

impl Handler<Drain> for LaneOwner {
    type Result = ();

    fn handle(&mut self, msg: Drain, ctx: &mut Self::Context) {
        self.tie.drain(msg.until);
        self.ctl.drain();
        self.dispatch(ctx);
    }
}

impl Handler<StopLane> for LaneOwner {
    type Result = ();

    fn handle(&mut self, _: StopLane, ctx: &mut Self::Context) {
        self.tie.end();
        ctx.stop();
    }
}

impl Handler<Parked> for LaneOwner {
    type Result = ();

    fn handle(&mut self, msg: Parked, ctx: &mut Self::Context) {
        if self.queue.requeue(msg.delivery) {
            self.dispatch(ctx);
        }
    }
}

impl Handler<Retrying> for LaneOwner {
    type Result = ();

    fn handle(&mut self, msg: Retrying, ctx: &mut Self::Context) {
        if self.queue.retrying(msg.id) {
            self.dispatch(ctx);
        }
    }
}

impl Handler<Settled> for LaneOwner {
    type Result = ();

    fn handle(&mut self, msg: Settled, ctx: &mut Self::Context) {
        if let Some(slot) = self.queue.settled(msg.id) {
            if self.queue.slot_idle(&slot) {
                self.key_runners.remove(&slot);
            }
        }
        if msg.outcome == SettledOutcome::Refused {
            // Fenced out or the row vanished: hold dispatch until a claim
            // tells whether the lane is still ours.
            self.ctl.refused();
        }
        self.dispatch(ctx);
        if self
            .ctl
            .after_settled(|| self.held(), self.deps.config.buffer_cap)
        {
            self.claim(ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lane that stops claiming (its buffer full behind a slow receiver)
    /// last saw a transaction open below its cursor 5 s after first seeing
    /// it: the gauge says 5 s a minute later, not 65 s, which would tell
    /// of a session left open that may have ended long ago.
    #[test]
    fn the_horizon_age_is_as_of_the_lanes_last_claim() {
        let board = LaneBoard::default();
        let mut c = crate::claim::ClaimControl::new();
        let t0 = Instant::now();
        c.note_horizon(Some(41), t0);
        c.note_horizon(Some(41), t0 + Duration::from_secs(5));
        board.set(
            1,
            LaneStatus {
                epoch: Epoch(1),
                state: LaneState::Active,
                queued: 256,
                in_flight: 64,
                horizon_held: c.horizon_held(),
            },
        );
        assert_eq!(board.horizon_age(), Some(Duration::from_secs(5)));
    }
}
