//! `LaneSupervisor`: one per node; owns the node's lane owners. It starts,
//! stops and drains them so that they follow the lane assignment's
//! [`LaneWork`] ([`plan_lanes`] decides), hears their facts as messages
//! and releases a lane handed over once its owner has drained.
//!
//! ```text
//!  LaneWork changed, every second ──▶ plan_lanes ──▶ start │ StopLane │ Drain │ release
//!  OwnerStopped (from a LaneOwner) ──▶ drained: StopLane, release the lane
//!                                  └─▶ stopping: one owner fewer to wait for
//!  a drain's bound (timer)         ──▶ StopLane, release anyway (attempts left
//!                                      in flight are repeated by the next owner)
//!  Shutdown                        ──▶ Drain every owner, start none any more;
//!                                      answer once all stopped, or at the bound
//! ```
//!
//! The owners' addresses are also in a shared map ([`Owners`]) that the
//! node reads to pass wake-ups on; only the supervisor writes it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;
use lanebus_cluster::LeaseConfig;
use lanebus_store::{Epoch, Lane};
use tokio::sync::{oneshot, watch};

use super::lane_owner::{Drain, LaneDeps, LaneOwner, OwnerStopped, StopLane};
use crate::assignment::{
    plan_lanes, Handover, LaneAssignment, LaneWork, OwnerTie, ReleaseOutcome, ReleasingLanes,
    Running,
};

/// How often the supervisor applies the work without a change (a release
/// that failed or was refused is looked at again).
pub const REAPPLY: Duration = Duration::from_secs(1);

/// A running lane owner.
#[derive(Clone)]
pub struct OwnerEntry {
    /// The epoch it works at.
    pub epoch: Epoch,
    /// Its address.
    pub addr: Addr<LaneOwner>,
    /// Ended before the owner is told to stop (see [`OwnerTie`]).
    pub tie: Arc<OwnerTie>,
    /// A drain for a handover is under way.
    pub draining: bool,
}

/// The node's lane owners by lane, written by the supervisor only.
pub type Owners = Arc<Mutex<BTreeMap<Lane, OwnerEntry>>>;

/// How long a lane being handed over may drain before it is released with
/// attempts still in flight.
#[derive(Debug, Clone, Copy)]
pub enum DrainBound {
    /// A set time (`--handover-drain-ms`, or the local drain timeout).
    Fixed(Duration),
    /// [`crate::node::handover_drain_bound`] of the lease and the longest
    /// timeout of the handlers as the catalog has them when the drain
    /// starts: a bound taken at start missed handlers registered later (a
    /// node started before any handler drained for 500 ms, then left 10 s
    /// attempts in flight to the next owner, which sent them again).
    Handover(LeaseConfig),
}

/// The owners a shutdown hands back: address and tie of each.
pub type StoppedOwners = Vec<(Addr<LaneOwner>, Arc<OwnerTie>)>;

/// Command: stop following the work; drain every owner until `until`.
/// The answer on `done` (once every owner stopped, or at `until`) lists
/// the owners, to be stopped for good by the caller.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown {
    /// The drains' bound.
    pub until: Instant,
    /// Where the owners go once drained or at the bound.
    pub done: oneshot::Sender<StoppedOwners>,
}

/// Command: take one step toward the current work now (the answer comes
/// after the owners to start were started).
#[derive(Debug, Clone, Copy, Message)]
#[rtype(result = "()")]
pub struct Apply;

/// A drain for a handover under way.
struct Draining {
    epoch: Epoch,
    addr: Addr<LaneOwner>,
    tie: Arc<OwnerTie>,
    /// The timer of its bound.
    bound: SpawnHandle,
}

/// A shutdown under way.
struct Stopping {
    /// Owners not stopped yet.
    pending: BTreeSet<(Lane, Epoch)>,
    owners: StoppedOwners,
    done: Option<oneshot::Sender<StoppedOwners>>,
}

/// The lane supervisor actor. See the module docs.
pub struct LaneSupervisor {
    owners: Owners,
    deps: LaneDeps,
    assignment: Arc<dyn LaneAssignment>,
    work: watch::Receiver<LaneWork>,
    /// Handovers whose release is under way or done (not released twice).
    releases_sent: ReleasingLanes,
    drain_bound: DrainBound,
    drains: BTreeMap<Lane, Draining>,
    /// Set by [`Shutdown`]: start nothing any more.
    stopping: Option<Stopping>,
}

impl LaneSupervisor {
    /// A supervisor of lane owners built from `deps`, following `work` of
    /// `assignment`, publishing its owners in `owners`.
    pub fn new(
        owners: Owners,
        deps: LaneDeps,
        assignment: Arc<dyn LaneAssignment>,
        work: watch::Receiver<LaneWork>,
        drain_bound: DrainBound,
    ) -> Self {
        LaneSupervisor {
            owners,
            deps,
            assignment,
            work,
            releases_sent: ReleasingLanes::new(),
            drain_bound,
            drains: BTreeMap::new(),
            stopping: None,
        }
    }

    /// The drain bound for a drain starting now.
    fn drain_bound(&self) -> Duration {
        match &self.drain_bound {
            DrainBound::Fixed(d) => *d,
            DrainBound::Handover(lease) => {
                crate::node::handover_drain_bound(lease, self.deps.catalog.longest_timeout_ms())
            }
        }
    }

    /// One step toward the current work.
    fn apply(&mut self, ctx: &mut Context<Self>) {
        if self.stopping.is_some() {
            return;
        }
        let work = self.work.borrow().clone();
        self.releases_sent
            .retain(|l, h| work.releasing.get(l) == Some(h));
        let owners = self.owners.clone();
        let mut owners = owners.lock().expect("not poisoned");
        let running: BTreeMap<Lane, Running> = owners
            .iter()
            .map(|(&l, o)| {
                (
                    l,
                    Running {
                        epoch: o.epoch,
                        draining: o.draining,
                    },
                )
            })
            .collect();
        let plan = plan_lanes(&running, &work, &self.releases_sent);
        for lane in &plan.stop {
            if let Some(o) = owners.remove(lane) {
                o.tie.end();
                o.addr.do_send(StopLane);
            }
        }
        // Owners that stopped by themselves (fenced out) before their drain
        // began: nothing of theirs is in flight, the drain is over at once.
        let mut stopped = Vec::new();
        for &lane in &plan.drain {
            let Some(o) = owners.get_mut(&lane) else {
                continue;
            };
            if !o.addr.connected() {
                stopped.push((lane, o.epoch));
            }
            o.draining = true;
            let bound = self.drain_bound();
            o.addr.do_send(Drain {
                until: Instant::now() + bound,
            });
            if let Some(&h) = work.releasing.get(&lane) {
                self.releases_sent.insert(lane, h);
            }
            tracing::info!(
                lane,
                epoch = o.epoch.0,
                bound_ms = bound.as_millis() as u64,
                "handing the lane over: draining"
            );
            let epoch = o.epoch;
            let timer = ctx.run_later(bound, move |act, ctx| act.drained(lane, epoch, true, ctx));
            self.drains.insert(
                lane,
                Draining {
                    epoch,
                    addr: o.addr.clone(),
                    tie: o.tie.clone(),
                    bound: timer,
                },
            );
        }
        for &(lane, epoch) in &plan.start {
            let owner = LaneOwner::new(lane, epoch, self.deps.clone());
            let tie = owner.tie();
            owners.insert(
                lane,
                OwnerEntry {
                    epoch,
                    addr: owner.start(),
                    tie,
                    draining: false,
                },
            );
        }
        if !(plan.start.is_empty() && plan.stop.is_empty() && plan.drain.is_empty()) {
            tracing::info!(
                lanes = owners.len(),
                started = plan.start.len(),
                stopped = plan.stop.len(),
                draining = plan.drain.len(),
                "lane owners running"
            );
        }
        drop(owners);
        for (lane, epoch) in stopped {
            self.drained(lane, epoch, false, ctx);
        }
        for &(lane, handover) in &plan.release_now {
            self.releases_sent.insert(lane, handover);
            self.release(lane, handover, ctx);
        }
    }

    /// The drain of `lane` at `epoch` ended: its owner stopped, or the
    /// bound was reached (`timed_out`). Stops the owner for good and
    /// releases the lane if it is still to be handed over.
    fn drained(&mut self, lane: Lane, epoch: Epoch, timed_out: bool, ctx: &mut Context<Self>) {
        if self.drains.get(&lane).is_none_or(|d| d.epoch != epoch) {
            return;
        }
        let Some(d) = self.drains.remove(&lane) else {
            return;
        };
        if !timed_out {
            ctx.cancel_future(d.bound);
        }
        if timed_out && d.addr.connected() {
            tracing::warn!(
                lane,
                epoch = epoch.0,
                "drain bound reached: in-flight deliveries left to the next owner"
            );
        }
        // Ended before the release: the next owner may start at once.
        d.tie.end();
        d.addr.do_send(StopLane);
        {
            let mut owners = self.owners.lock().expect("not poisoned");
            if owners
                .get(&lane)
                .is_some_and(|o| o.epoch == epoch && o.draining)
            {
                owners.remove(&lane);
            }
        }
        let handover = self.work.borrow().releasing.get(&lane).copied();
        if let Some(h) = handover.filter(|h| h.epoch == epoch) {
            // The handover in view now: the owner drained without a break,
            // whichever handovers came and went meanwhile.
            self.releases_sent.insert(lane, h);
            self.release(lane, h, ctx);
        } else {
            self.apply(ctx);
        }
    }

    /// Tells the assignment `lane` may go to its next owner in `handover`;
    /// if it could not be told, the next step asks again. A refused
    /// release is forgotten too, and looked at again at the next change or
    /// [`REAPPLY`] (not at once: this node's view may still be behind the
    /// state that refused it). A lane handed over again since (the first
    /// handover cancelled) is released for the new handover when this node
    /// ran no owner for it in between ([`plan_lanes`]); a release for the
    /// old one is refused, whatever this node's view showed.
    fn release(&mut self, lane: Lane, handover: Handover, ctx: &mut Context<Self>) {
        let assignment = self.assignment.clone();
        let fut = async move { assignment.released(lane, handover).await };
        ctx.spawn(
            fut.into_actor(self)
                .map(move |outcome, act, ctx| match outcome {
                    ReleaseOutcome::Released => act.apply(ctx),
                    ReleaseOutcome::Failed => {
                        act.forget_release(lane, handover);
                        act.apply(ctx);
                    }
                    ReleaseOutcome::Refused => act.forget_release(lane, handover),
                }),
        );
    }

    /// Forgets the release of `lane` in `handover` (not one of a later
    /// handover sent meanwhile).
    fn forget_release(&mut self, lane: Lane, handover: Handover) {
        if self.releases_sent.get(&lane) == Some(&handover) {
            self.releases_sent.remove(&lane);
        }
    }

    /// Answers the shutdown with the owners (once).
    fn shut_down(&mut self) {
        if let Some(s) = &mut self.stopping {
            if let Some(done) = s.done.take() {
                let _ = done.send(std::mem::take(&mut s.owners));
            }
        }
    }
}

impl Actor for LaneSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(usize::MAX >> 4);
        self.deps.supervisor = Some(ctx.address().recipient());
        // Follows the assignment; the stream ends when the assignment does.
        let changes = futures::stream::unfold(self.work.clone(), |mut work| async move {
            work.changed().await.ok()?;
            Some((Apply, work))
        });
        ctx.add_stream(changes);
        ctx.run_interval(REAPPLY, |act, ctx| act.apply(ctx));
    }
}

impl StreamHandler<Apply> for LaneSupervisor {
    fn handle(&mut self, _: Apply, ctx: &mut Self::Context) {
        self.apply(ctx);
    }

    fn finished(&mut self, _: &mut Self::Context) {
        // The assignment stopped: the owners stay as they are.
    }
}

impl Handler<Apply> for LaneSupervisor {
    type Result = ();

    fn handle(&mut self, _: Apply, ctx: &mut Self::Context) {
        self.apply(ctx);
    }
}

impl Handler<OwnerStopped> for LaneSupervisor {
    type Result = ();

    fn handle(&mut self, msg: OwnerStopped, ctx: &mut Self::Context) {
        tracing::debug!(lane = msg.lane, epoch = msg.epoch.0, why = ?msg.why, "lane owner stopped");
        if let Some(s) = &mut self.stopping {
            s.pending.remove(&(msg.lane, msg.epoch));
            if s.pending.is_empty() {
                self.shut_down();
            }
        }
        // Drained, or stopped otherwise during a drain (fenced out): the
        // drain is over either way.
        self.drained(msg.lane, msg.epoch, false, ctx);
    }
}

impl Handler<Shutdown> for LaneSupervisor {
    type Result = ();

    fn handle(&mut self, msg: Shutdown, ctx: &mut Self::Context) {
        let owners = std::mem::take(&mut *self.owners.lock().expect("not poisoned"));
        for o in owners.values() {
            o.addr.do_send(Drain { until: msg.until });
        }
        let pending = owners
            .iter()
            .filter(|(_, o)| o.addr.connected())
            .map(|(&l, o)| (l, o.epoch))
            .collect::<BTreeSet<_>>();
        let empty = pending.is_empty();
        self.stopping = Some(Stopping {
            pending,
            owners: owners.into_values().map(|o| (o.addr, o.tie)).collect(),
            done: Some(msg.done),
        });
        if empty {
            self.shut_down();
        } else {
            let wait = msg.until.saturating_duration_since(Instant::now());
            ctx.run_later(wait, |act, _| act.shut_down());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use async_trait::async_trait;
    use tokio::sync::mpsc;

    use super::*;
    use crate::actors::{LaneBoard, LaneConfig, StoreActor, StoreActorConfig};
    use crate::assignment::{AssignmentError, OwnedLanes, WorkGate};
    use crate::catalog::HandlerCatalog;
    use crate::handler::Dispatcher;
    use crate::webhook::WebhookSender;

    /// An assignment the test drives: its work is `work`, releases go to
    /// `released` (lane and the handover's index).
    struct Fake {
        work: watch::Receiver<LaneWork>,
        released: mpsc::UnboundedSender<(Lane, Option<u64>)>,
        /// Answers to the releases, in order; then `Released`.
        answers: std::sync::Mutex<Vec<ReleaseOutcome>>,
    }

    #[async_trait]
    impl LaneAssignment for Fake {
        async fn start(&self) -> Result<watch::Receiver<LaneWork>, AssignmentError> {
            Ok(self.work.clone())
        }

        async fn released(&self, lane: Lane, handover: Handover) -> ReleaseOutcome {
            let _ = self.released.send((lane, handover.at));
            let mut answers = self.answers.lock().expect("not poisoned");
            if answers.is_empty() {
                ReleaseOutcome::Released
            } else {
                answers.remove(0)
            }
        }

        fn owner(&self) -> &str {
            "t/1"
        }
    }

    fn lanes(of: &[(Lane, Epoch)]) -> OwnedLanes {
        of.iter().copied().collect()
    }

    /// The next release the [`Fake`] got (lane, handover index), within a
    /// minute; `what` names it if none came.
    async fn next_release(
        rx: &mut mpsc::UnboundedReceiver<(Lane, Option<u64>)>,
        what: &str,
    ) -> Option<(Lane, Option<u64>)> {
        tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: no release within a minute"))
    }

    /// Lanes handed over at epoch 1 in the handover applied at `at`.
    fn handing(of: &[Lane], at: u64) -> ReleasingLanes {
        let h = Handover {
            epoch: Epoch(1),
            at: Some(at),
        };
        of.iter().map(|&l| (l, h)).collect()
    }

    /// Lane deps over `store` with default settings and no handlers.
    async fn deps_of(store: &Arc<dyn lanebus_store::Store>) -> LaneDeps {
        let catalog = Arc::new(HandlerCatalog::new(store.clone()));
        catalog.reload_fresh().await.expect("reload");
        LaneDeps {
            store_actor: StoreActor::new(store.clone(), StoreActorConfig::default()).start(),
            catalog,
            dispatcher: Dispatcher::new(
                WebhookSender::new(Default::default()).expect("sender"),
                HashMap::new(),
                store.lanes(),
            ),
            board: Arc::new(LaneBoard::default()),
            config: LaneConfig::default(),
            gate: WorkGate::default(),
            fenced_out: None,
            supervisor: None,
        }
    }

    /// A supervisor over the test's [`Fake`] assignment.
    struct Supervised {
        store: Arc<dyn lanebus_store::Store>,
        work: watch::Sender<LaneWork>,
        released: mpsc::UnboundedReceiver<(Lane, Option<u64>)>,
        owners: Owners,
        sup: Addr<LaneSupervisor>,
    }

    /// A supervisor started and applied once, owning `owned` at epoch 1
    /// (each fenced for `t/1` in a fresh in-memory store), drains bounded
    /// at an hour, its releases answered `answers` in order (then
    /// `Released`).
    async fn supervised(owned: &[Lane], answers: Vec<ReleaseOutcome>) -> Supervised {
        let store = lanebus_store::open("sqlite::memory:").await.expect("store");
        for &lane in owned {
            assert!(store.fence(lane, "t/1", Epoch(1)).await.expect("fence"));
        }
        let deps = deps_of(&store).await;
        let (work, work_rx) = watch::channel(LaneWork {
            owned: owned.iter().map(|&l| (l, Epoch(1))).collect(),
            releasing: ReleasingLanes::new(),
        });
        let (released_tx, released) = mpsc::unbounded_channel();
        let assignment = Arc::new(Fake {
            work: work_rx.clone(),
            released: released_tx,
            answers: std::sync::Mutex::new(answers),
        });
        let owners = Owners::default();
        let sup = LaneSupervisor::new(
            owners.clone(),
            deps,
            assignment,
            work_rx,
            DrainBound::Fixed(Duration::from_secs(3600)),
        )
        .start();
        sup.send(Apply).await.expect("applied");
        Supervised {
            store,
            work,
            released,
            owners,
            sup,
        }
    }

    /// A lane whose owner already stopped on its own (fenced out by
    /// another owner) and is then handed over is released at once, not
    /// at the drain's bound (an hour here): nothing of it is in flight.
    #[test]
    fn a_handover_of_a_lane_whose_owner_stopped_releases_at_once() {
        actix_rt::System::new().block_on(async {
            let Supervised {
                store,
                work,
                released: mut released_rx,
                owners,
                sup: _sup,
            } = supervised(&[1], Vec::new()).await;

            // Another owner takes lane 1 in the store: this one's next claim
            // is refused and it stops by itself.
            assert!(store.fence(1, "t/2", Epoch(2)).await.expect("fence 2"));
            let stopped = |o: &Owners| {
                o.lock()
                    .unwrap()
                    .get(&1)
                    .is_some_and(|e| !e.addr.connected())
            };
            let deadline = Instant::now() + Duration::from_secs(60);
            while !stopped(&owners) {
                assert!(
                    Instant::now() < deadline,
                    "lane 1's owner never stopped: {:?}",
                    owners.lock().unwrap().keys().collect::<Vec<_>>()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }

            work.send_replace(LaneWork {
                owned: OwnedLanes::new(),
                releasing: handing(&[1], 10),
            });
            let lane = next_release(&mut released_rx, "released before the drain's bound").await;
            assert_eq!(lane, Some((1, Some(10))));
        });
    }

    /// A release refused by the cluster (the handover was cancelled when
    /// it was applied) is not taken for done: when this node's view still
    /// lists the lane releasing at that epoch (a new handover of the lane,
    /// seen without the active state in between), the lane is released
    /// again, not left releasing for good with no owner running it.
    #[test]
    fn a_refused_release_is_sent_again_while_the_lane_is_still_releasing() {
        actix_rt::System::new().block_on(async {
            let Supervised {
                work,
                released: mut released_rx,
                sup: _sup,
                ..
            } = supervised(&[1], vec![ReleaseOutcome::Refused]).await;
            work.send_replace(LaneWork {
                owned: OwnedLanes::new(),
                releasing: handing(&[1], 10),
            });
            let first = next_release(&mut released_rx, "drained and released").await;
            assert_eq!(first, Some((1, Some(10))));
            // Refused; the view still shows lane 1 releasing at epoch 1.
            let again = tokio::time::timeout(REAPPLY * 5, released_rx.recv())
                .await
                .expect("released again after the refusal");
            assert_eq!(again, Some((1, Some(10))));
        });
    }

    /// A handover cancelled after this node's release went out (refused),
    /// then a new one of the same lane at the same epoch: the owner run in
    /// between is drained, and the release names the new handover, not
    /// the one drained first.
    #[test]
    fn each_release_names_the_handover_it_drained() {
        actix_rt::System::new().block_on(async {
            let Supervised {
                work,
                released: mut released_rx,
                owners,
                sup: _sup,
                ..
            } = supervised(&[1], vec![ReleaseOutcome::Refused]).await;
            let minute = Duration::from_secs(60);
            work.send_replace(LaneWork {
                owned: OwnedLanes::new(),
                releasing: handing(&[1], 10),
            });
            let first = next_release(&mut released_rx, "released").await;
            assert_eq!(first, Some((1, Some(10))));
            // Cancelled: lane 1 is active here again, a new owner runs.
            work.send_replace(LaneWork {
                owned: lanes(&[(1, Epoch(1))]),
                releasing: ReleasingLanes::new(),
            });
            let deadline = Instant::now() + minute;
            while !owners.lock().unwrap().get(&1).is_some_and(|o| !o.draining) {
                assert!(Instant::now() < deadline, "no new owner for lane 1");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            work.send_replace(LaneWork {
                owned: OwnedLanes::new(),
                releasing: handing(&[1], 12),
            });
            let second = next_release(&mut released_rx, "released again").await;
            assert_eq!(second, Some((1, Some(12))));
        });
    }

    /// A lane owner stopped while its claim is under way (the store actor
    /// has not answered) gives that claim's reservation back to the node's
    /// budget: actix drops the claim's future unpolled when the owner
    /// stops, and a reservation kept for good shrinks the later claims of
    /// every lane on the node (a lane holding deliveries claims none while
    /// reservations fill the budget; one holding nothing still claims one).
    #[test]
    fn an_owner_stopped_during_its_claim_gives_its_reservation_back() {
        actix_rt::System::new().block_on(async {
            let store = lanebus_store::open("sqlite::memory:").await.expect("store");
            assert!(store.fence(1, "t/1", Epoch(1)).await.expect("fence"));
            let mut deps = deps_of(&store).await;
            // The store actor runs on its own arbiter, kept busy until the
            // owner has stopped: the claim waits in its mailbox.
            let arbiter = actix::Arbiter::new();
            let s = store.clone();
            deps.store_actor = StoreActor::start_in_arbiter(&arbiter.handle(), move |_| {
                StoreActor::new(s, StoreActorConfig::default())
            });
            let (unblock, blocked) = std::sync::mpsc::channel::<()>();
            let (busy_tx, busy_rx) = oneshot::channel::<()>();
            arbiter.spawn(async move {
                let _ = busy_tx.send(());
                let _ = blocked.recv();
            });
            busy_rx.await.expect("arbiter busy");
            let board = deps.board.clone();
            let owner = LaneOwner::new(1, Epoch(1), deps).start();
            let deadline = Instant::now() + Duration::from_secs(60);
            while board.budget().reserved() == 0 {
                assert!(Instant::now() < deadline, "the owner never claimed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            owner.do_send(StopLane);
            while owner.connected() {
                assert!(Instant::now() < deadline, "the owner never stopped");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let left = board.budget().reserved();
            let _ = unblock.send(());
            arbiter.stop();
            assert_eq!(left, 0, "bytes still reserved by the stopped owner's claim");
            assert_eq!(board.budget().held(), 0);
        });
    }

    /// With drain bounds of an hour, only the owners' facts can end a
    /// handover's drain or a shutdown within the test's deadline.
    #[test]
    fn drains_end_when_the_owners_say_they_stopped() {
        actix_rt::System::new().block_on(async {
            let Supervised {
                work,
                released: mut released_rx,
                owners,
                sup,
                ..
            } = supervised(&[0, 1], Vec::new()).await;
            let hour = Duration::from_secs(3600);
            let running = |o: &Owners| {
                o.lock()
                    .unwrap()
                    .iter()
                    .map(|(&l, e)| (l, e.epoch, e.draining))
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                running(&owners),
                [(0, Epoch(1), false), (1, Epoch(1), false)]
            );

            // Lane 1 is handed over: its owner holds nothing, drains at once
            // and says so; the lane is released long before the bound.
            work.send_replace(LaneWork {
                owned: lanes(&[(0, Epoch(1))]),
                releasing: handing(&[1], 10),
            });
            let lane = next_release(&mut released_rx, "released before the drain's bound").await;
            assert_eq!(lane, Some((1, Some(10))));
            sup.send(Apply).await.expect("applied");
            assert_eq!(running(&owners), [(0, Epoch(1), false)]);

            // Shutdown: answered once lane 0's owner drained, not at the
            // bound; nothing starts afterwards.
            let (done, drained) = oneshot::channel();
            sup.do_send(Shutdown {
                until: Instant::now() + hour,
                done,
            });
            let stopped = tokio::time::timeout(Duration::from_secs(60), drained)
                .await
                .expect("answered before the bound")
                .expect("answered");
            assert_eq!(stopped.len(), 1);
            assert!(!stopped[0].0.connected(), "lane 0's owner stopped");
            sup.send(Apply).await.expect("applied");
            assert!(
                running(&owners).is_empty(),
                "started nothing after the shutdown"
            );
        });
    }
}
