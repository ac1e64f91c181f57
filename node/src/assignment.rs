//! Which lanes this node owns, at which epoch: the seam between lane
//! ownership (Raft) and the lane owners.
//!
//! A [`LaneAssignment`] yields [`LaneWork`] as a [`tokio::sync::watch`]
//! channel: the lanes the node owns (`lane -> epoch`, each already fenced in
//! the store with [`Store::fence`], so a deposed owner of an older epoch
//! changes nothing any more, docs/design.md invariant 4) and the lanes it must
//! hand over. The node carries out what [`plan_lanes`] decides: start a
//! [`LaneOwner`](crate::actors::LaneOwner) for every owned lane without one,
//! stop the owners whose lane disappeared or changed epoch, drain the ones
//! being handed over and then report them with [`LaneAssignment::released`].
//!
//! ## Fencing per process incarnation
//!
//! The owner name written to the store is unique per process start
//! ([`owner_name`]: `"<node id>/<incarnation>"`). The store's fence succeeds
//! only when the row afterwards reads (owner, epoch), so two processes
//! started with the same `--id` can never both hold a (lane, epoch): the one
//! that fenced second fails and needs a higher epoch.
//!
//! - [`LocalAssignment`] (single node, `lanebus node --single`, in-process
//!   tests) owns every lane at `stored epoch + 1` and re-reads and retries a
//!   lane that someone fenced meanwhile: the last process started wins, the
//!   other's lane owners are fenced out at their next claim and stop.
//! - [`RaftAssignment`] fences the epochs Raft decides. A restarted node
//!   records its new incarnation in Raft before its first lease renewal
//!   (`lanebus_cluster::Command::Incarnate`), which gives its active lanes
//!   `epoch + 1`; until that is applied here a fence at the old epoch fails
//!   (the old process's name is in the row) and is retried.
//!
//! ## Lanes fenced by someone outside the cluster
//!
//! Raft is not the only writer of epochs: a `lanebus node --single` process
//! (or a second cluster) on the same store fences every lane at its stored
//! epoch + 1, under its own name. The cluster's owners are then fenced out
//! (their claims return nothing) and a fence at the Raft epoch fails, since
//! the store already holds that epoch or a higher one. [`RaftAssignment`]
//! treats such a lane as *fenced out*: the lane owner reports it
//! (`LaneDeps::fenced_out`), the lane leaves [`LaneWork::owned`], and if the
//! store still refuses it after [`FENCED_OUT_GRACE`] (a restart's
//! `Incarnate` or a Raft change usually ends the refusal before that) the
//! node logs it at WARN once per lane, lists it in [`FencedOutLanes`]
//! (`/readyz` answers 503 while any is listed), and after
//! [`RaftAssignment::new`]'s `refence_after` (the lease plus the margin)
//! reports the store's epochs to Raft with [`Cluster::refence`]. Raft gives
//! the lanes `max(epoch, store epoch) + 1`, the node fences that, and the
//! outsider's owners are the deposed ones (invariant 4 holds: both sides
//! only ever work at an epoch the store holds for them). A still-running
//! outsider is thus fought at most once per `refence_after` per lane.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::{stream, StreamExt, TryStreamExt};
use lanebus_cluster::{Cluster, ClusterError, NodeLanes};
use lanebus_store::{Epoch, Lane, LaneRow, Store, StoreError};
use tokio::sync::{mpsc, watch};

/// Lanes owned by this node and the epoch of each.
pub type OwnedLanes = BTreeMap<Lane, Epoch>;

/// How long this node may have work under way, as its [`WorkGate`] says
/// now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// No work may be handed over (the lease lapsed, or was never held).
    Closed,
    /// Work may be handed over; every attempt must end by this instant (the
    /// end of the node's holder lease, by its own clock).
    Until(Instant),
    /// No lease bounds the work (a single node).
    Unbounded,
}

/// Whether this node may hand work over right now, and until when: checked
/// by lane owners before dispatching and by key runners before every
/// attempt. In a cluster it is [`Cluster::work_until`] (lease valid by this
/// node's clock, and after a lapse the Raft log applied up to the renewal
/// that ended it): after a pause (SIGSTOP) the actors' timers may fire
/// before the lanes are taken away, and an attempt sent then could overtake
/// the new owner's deliveries of the same key. An attempt starts only if it
/// can end within the room ([`attempt_may_start`]). Always open, without
/// bound, without a cluster.
#[derive(Clone, Default)]
pub struct WorkGate(Option<Arc<dyn Fn() -> Room + Send + Sync>>);

impl WorkGate {
    /// A gate that asks `room` each time.
    pub fn new(room: impl Fn() -> Room + Send + Sync + 'static) -> Self {
        WorkGate(Some(Arc::new(room)))
    }

    /// The room for work now.
    pub fn room(&self) -> Room {
        self.0.as_ref().map_or(Room::Unbounded, |f| f())
    }

    /// Whether work may be handed over now (at all).
    pub fn open(&self) -> bool {
        self.room() != Room::Closed
    }
}

impl std::fmt::Debug for WorkGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "WorkGate(lease)"
        } else {
            "WorkGate(always)"
        })
    }
}

/// How long a closed [`WorkGate`] (or a lease or drain with too little room
/// left for an attempt) defers a dispatch or an attempt before asking
/// again.
pub const GATE_RECHECK: Duration = Duration::from_millis(50);

/// What an attempt's start leaves on top of its handler's timeout before
/// the end of the lease or drain
/// ([`lanebus_cluster::lease::ATTEMPT_SLACK_MS`]).
pub const ATTEMPT_SLACK: Duration = Duration::from_millis(lanebus_cluster::lease::ATTEMPT_SLACK_MS);

/// Whether an attempt whose handler times out after `timeout` may start at
/// `now`: the gate's `room` is open, and the attempt (its timeout plus
/// [`ATTEMPT_SLACK`]) ends by the room's end and by `drain_until`, the
/// bound of a drain under way (a planned handover or a graceful stop).
/// Otherwise it waits: a renewal normally makes room again, and a drain
/// ends at its bound.
pub fn attempt_may_start(
    now: Instant,
    room: Room,
    drain_until: Option<Instant>,
    timeout: Duration,
) -> bool {
    let lease_end = match room {
        Room::Closed => return false,
        Room::Until(end) => Some(end),
        Room::Unbounded => None,
    };
    let end = match (lease_end, drain_until) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    end.is_none_or(|end| now + timeout + ATTEMPT_SLACK <= end)
}

/// Whether an attempt may be sent now ([`OwnerTie::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Send it.
    Go,
    /// Not now: the gate is closed, or the lease or drain leaves too little
    /// room; ask again later.
    Wait,
    /// Never: its lane owner stopped (the lane moved, or its lease lapsed);
    /// the delivery stays in the store for the lane's next owner.
    Lost,
}

/// What binds the attempts of one lane owner to it, from the owner's claim
/// until their outcomes are stored: shared by the owner, its key runners
/// and their attempts. An attempt asks [`OwnerTie::start`] right before it
/// is sent (once it holds its handler's permit), after it was counted in
/// the dispatcher's per-lane count
/// ([`crate::handler::Dispatcher::lane_attempts_in_flight`]); it stays
/// counted until its outcome is stored. Whoever stops the owner ends its
/// tie first ([`OwnerTie::end`]), so an attempt either was counted before
/// the end (a next owner of the lane on this node waits for it before its
/// first claim) or is never sent.
#[derive(Debug)]
pub struct OwnerTie {
    lane: Lane,
    epoch: Epoch,
    gate: WorkGate,
    /// The owner is still the lane's live owner.
    live: AtomicBool,
    /// Set by a drain: attempts must end by then.
    drain_until: Mutex<Option<Instant>>,
}

impl OwnerTie {
    /// The tie of the owner of `lane` at `epoch`, on a node whose work gate
    /// is `gate`.
    pub fn new(lane: Lane, epoch: Epoch, gate: WorkGate) -> Self {
        OwnerTie {
            lane,
            epoch,
            gate,
            live: AtomicBool::new(true),
            drain_until: Mutex::new(None),
        }
    }

    /// The owner stops: no attempt of it is sent any more.
    pub fn end(&self) {
        self.live.store(false, Ordering::SeqCst);
    }

    /// Whether the owner is still the lane's live owner.
    pub fn live(&self) -> bool {
        self.live.load(Ordering::SeqCst)
    }

    /// The lane.
    pub fn lane(&self) -> Lane {
        self.lane
    }

    /// The epoch the owner works at.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The node's work gate.
    pub fn gate(&self) -> &WorkGate {
        &self.gate
    }

    /// A drain started: attempts must end by `until` (an earlier bound set
    /// before is kept).
    pub fn drain(&self, until: Instant) {
        let mut d = self.drain_until.lock().expect("not poisoned");
        *d = Some(d.map_or(until, |d| d.min(until)));
    }

    /// Whether an attempt whose handler times out after `timeout` may be
    /// sent now ([`start_at`](Self::start_at) the system's now).
    pub fn start(&self, timeout: Duration) -> Start {
        self.start_at(Instant::now(), timeout)
    }

    /// Whether an attempt whose handler times out after `timeout` may be
    /// sent at `now`: its owner is live and the room covers it
    /// ([`attempt_may_start`]).
    pub fn start_at(&self, now: Instant, timeout: Duration) -> Start {
        if !self.live() {
            return Start::Lost;
        }
        let drain_until = *self.drain_until.lock().expect("not poisoned");
        if attempt_may_start(now, self.gate.room(), drain_until, timeout) {
            Start::Go
        } else {
            Start::Wait
        }
    }
}

/// What the node must do with its lanes now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneWork {
    /// Lanes to work, fenced in the store at their epoch.
    pub owned: OwnedLanes,
    /// Lanes to hand over, with the epoch this node holds them at and the
    /// handover: stop claiming, drain in-flight work within the bound, then
    /// [`LaneAssignment::released`].
    pub releasing: ReleasingLanes,
}

/// Lanes this node hands over, lane → [`Handover`].
pub type ReleasingLanes = BTreeMap<Lane, Handover>;

/// A handover of a lane away from this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handover {
    /// The epoch this node holds the lane at (until the release).
    pub epoch: Epoch,
    /// Which handover: the Raft log index it was applied at
    /// ([`lanebus_cluster::Releasing::at`]; `None` for one an older version
    /// recorded). The release names it.
    pub at: Option<u64>,
}

/// The owner name a process writes into the store's lane rows: the node id
/// and this process start's incarnation, so that two processes with the
/// same id never hold the same (lane, epoch).
pub fn owner_name(node_id: &str, incarnation: &str) -> String {
    format!("{node_id}/{incarnation}")
}

/// The node id part of a stored owner name (see [`owner_name`]).
pub fn owner_node(owner: &str) -> &str {
    owner.split_once('/').map_or(owner, |(n, _)| n)
}

/// A lane owner the node runs: its epoch and whether it is draining.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Running {
    /// Epoch it works at.
    pub epoch: Epoch,
    /// A drain for a handover is under way.
    pub draining: bool,
}

/// What the node does to reach [`LaneWork`] from its running owners.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LanePlan {
    /// Start an owner at this epoch.
    pub start: Vec<(Lane, Epoch)>,
    /// Stop at once (lane gone, epoch changed, lease lapsed).
    pub stop: Vec<Lane>,
    /// Drain for a handover (stop claiming; release when drained or at the
    /// bound).
    pub drain: Vec<Lane>,
    /// Being handed over but nothing runs here (e.g. a restarted process):
    /// release that handover at once.
    pub release_now: Vec<(Lane, Handover)>,
}

/// Decides how to go from the `running` owners to `work`. `releases_sent`
/// holds the handovers whose release is already under way (drained or
/// reported), which are not released twice; a lane handed over again (a
/// new handover, the first cancelled) with no owner running here is
/// released again.
///
/// A draining owner whose lane is active again (handover cancelled) is
/// left to finish its drain; the node starts a new owner once it stopped.
pub fn plan_lanes(
    running: &BTreeMap<Lane, Running>,
    work: &LaneWork,
    releases_sent: &ReleasingLanes,
) -> LanePlan {
    let mut plan = LanePlan::default();
    for (&lane, r) in running {
        let owned = work.owned.get(&lane) == Some(&r.epoch);
        let releasing = work.releasing.get(&lane).map(|h| h.epoch) == Some(r.epoch);
        match (r.draining, owned, releasing) {
            (false, true, _) | (true, _, true) | (true, true, false) => {}
            (false, false, true) => plan.drain.push(lane),
            (_, false, false) => plan.stop.push(lane),
        }
    }
    for (&lane, &epoch) in &work.owned {
        if !running.contains_key(&lane) {
            plan.start.push((lane, epoch));
        }
    }
    for (&lane, handover) in &work.releasing {
        if !running.contains_key(&lane) && releases_sent.get(&lane) != Some(handover) {
            plan.release_now.push((lane, *handover));
        }
    }
    plan
}

/// How long the store must keep refusing a lane Raft gives this node before
/// the node calls it fenced out by an outsider (WARN, [`FencedOutLanes`],
/// `/readyz`): a restarted process's new epochs and Raft moves settle well
/// within this.
pub const FENCED_OUT_GRACE: Duration = Duration::from_secs(1);

/// A lane Raft gives this node that the store holds for someone else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedOut {
    /// The epoch Raft gives this node.
    pub epoch: Epoch,
    /// The owner name the store holds (`<node id>/<incarnation>`).
    pub store_owner: Option<String>,
    /// The epoch the store holds (at least `epoch`).
    pub store_epoch: Epoch,
}

/// Lanes of this node fenced out by someone outside the cluster, shared
/// between the [`RaftAssignment`] that finds them and the node's `/readyz`.
pub type FencedOutLanes = Arc<Mutex<BTreeMap<Lane, FencedOut>>>;

/// Why an assignment could not start.
#[derive(Debug, thiserror::Error)]
pub enum AssignmentError {
    /// The store failed while reading or fencing lanes.
    #[error("lane assignment: {0}")]
    Store(#[from] StoreError),
    /// Another node kept raising a lane's epoch concurrently.
    #[error("lane {lane} could not be fenced at epoch {epoch}: another owner raced")]
    Raced {
        /// The lane.
        lane: Lane,
        /// The epoch we tried.
        epoch: Epoch,
    },
}

/// Source of this node's lane ownership.
#[async_trait]
pub trait LaneAssignment: Send + Sync + 'static {
    /// Starts the assignment and returns the watch of owned lanes. The value
    /// changes whenever ownership changes; every lane in it is already fenced
    /// at its epoch.
    ///
    /// # Errors
    /// [`AssignmentError`] when the initial fencing fails.
    async fn start(&self) -> Result<watch::Receiver<LaneWork>, AssignmentError>;

    /// The node has drained `lane` in `handover` (listed in
    /// [`LaneWork::releasing`]), or gave up waiting at the bound: the next
    /// owner may take it. Names the handover, so that it cannot end a
    /// later one.
    async fn released(&self, lane: Lane, handover: Handover) -> ReleaseOutcome {
        let _ = (lane, handover);
        ReleaseOutcome::Released
    }

    /// The owner name this process fences lanes with ([`owner_name`]).
    fn owner(&self) -> &str;

    /// Where lane owners report that the store refused their claim at
    /// `(lane, epoch)` (fenced out). `None`: nobody listens, the lane just
    /// stops (single node: the process that fenced later keeps the lane).
    fn fenced_out_reports(&self) -> Option<mpsc::UnboundedSender<(Lane, Epoch)>> {
        None
    }
}

/// What became of a release ([`LaneAssignment::released`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// Recorded: the next owner may take the lane.
    Released,
    /// Refused: the lane was not being released by this node when the
    /// release was applied (the handover was cancelled, or this node's view
    /// is behind). The supervisor releases it again at a later step if its
    /// view still lists the lane releasing with no owner running (a new
    /// handover at the same epoch; or a view still behind, refused again).
    Refused,
    /// Not recorded (e.g. no Raft leader now): report it again.
    Failed,
}

/// Single-node assignment: owns every lane, fenced at `current epoch + 1`.
pub struct LocalAssignment {
    store: Arc<dyn Store>,
    owner: String,
    sender: std::sync::Mutex<Option<watch::Sender<LaneWork>>>,
}

impl LocalAssignment {
    /// An assignment of every lane of `store` to `node_id`, under a new
    /// incarnation (a fresh UUID).
    pub fn new(store: Arc<dyn Store>, node_id: impl Into<String>) -> Self {
        let incarnation = uuid::Uuid::now_v7().simple().to_string();
        LocalAssignment {
            store,
            owner: owner_name(&node_id.into(), &incarnation),
            sender: std::sync::Mutex::new(None),
        }
    }
}

/// The epochs a new owner of every lane takes: one above the stored epoch.
pub fn next_epochs(rows: &[LaneRow]) -> Vec<(Lane, Epoch)> {
    rows.iter().map(|r| (r.lane, r.epoch.next())).collect()
}

#[async_trait]
impl LaneAssignment for LocalAssignment {
    fn owner(&self) -> &str {
        &self.owner
    }

    async fn start(&self) -> Result<watch::Receiver<LaneWork>, AssignmentError> {
        let mut owned = OwnedLanes::new();
        let rows = self.store.lane_rows().await?;
        warn_if_others_own(&rows, owner_node(&self.owner));
        let mut todo = next_epochs(&rows);
        // A lane fenced concurrently by someone else is re-read and retried a
        // few times; a single node only races with its own previous life.
        for _round in 0..5 {
            let store = &self.store;
            let node_id = &self.owner;
            let results: Vec<(Lane, Epoch, bool)> = stream::iter(todo.iter().copied())
                .map(|(lane, epoch)| async move {
                    let ok = store.fence(lane, node_id, epoch).await?;
                    Ok::<_, StoreError>((lane, epoch, ok))
                })
                .buffer_unordered(16)
                .try_collect()
                .await?;
            let failed: Vec<Lane> = results
                .iter()
                .filter_map(|&(lane, epoch, ok)| {
                    if ok {
                        owned.insert(lane, epoch);
                        None
                    } else {
                        Some(lane)
                    }
                })
                .collect();
            if failed.is_empty() {
                let (tx, rx) = watch::channel(LaneWork {
                    owned,
                    releasing: ReleasingLanes::new(),
                });
                *self.sender.lock().expect("not poisoned") = Some(tx);
                return Ok(rx);
            }
            let rows = self.store.lane_rows().await?;
            todo = next_epochs(&rows)
                .into_iter()
                .filter(|(l, _)| failed.contains(l))
                .collect();
        }
        let (lane, epoch) = todo.first().copied().unwrap_or((0, Epoch::ZERO));
        Err(AssignmentError::Raced { lane, epoch })
    }
}

/// Logs at WARN when other nodes own lanes of the store a single node is
/// about to take: a cluster (or another `--single` process) shares it. The
/// single node fences every lane anyway, so their owners are fenced out; a
/// cluster takes its lanes back after its lease plus margin (see the module
/// docs), and then this process's lanes stop.
fn warn_if_others_own(rows: &[LaneRow], me: &str) {
    let others: BTreeSet<&str> = rows
        .iter()
        .filter_map(|r| r.owner.as_deref().map(owner_node))
        .filter(|n| *n != me)
        .collect();
    if !others.is_empty() {
        let lanes = rows
            .iter()
            .filter(|r| r.owner.as_deref().is_some_and(|o| owner_node(o) != me))
            .count();
        tracing::warn!(
            lanes,
            owners = ?others,
            "--single on a store whose lanes other nodes own: fencing every lane anyway; \
             their owners are fenced out, and a cluster on this store takes its lanes back \
             after its lease plus margin (then this process's lanes stop). Give a single \
             node a store of its own"
        );
    }
}

/// Lanes through Raft: fences the lanes [`Cluster::node_lanes`] gives this
/// node at their epochs and publishes them with the lanes it asks this
/// node to hand over.
///
/// A fence that fails (the store holds that epoch under another name or a
/// higher epoch) is retried every 250 ms while Raft still gives the lane at
/// that epoch: Raft moves on (a new incarnation's epochs, a reassignment)
/// and the retry then fences the new epoch. A lapsed lease empties
/// `node_lanes`, so every owner stops by itself. A lane that someone
/// outside the cluster holds in the store is re-fenced through Raft (see
/// the module docs, "Lanes fenced by someone outside the cluster").
/// [`RaftLanes`] decides all this; the assignment's task carries it out.
pub struct RaftAssignment {
    cluster: Arc<Cluster>,
    store: Arc<dyn Store>,
    owner: String,
    sender: std::sync::Mutex<Option<watch::Sender<LaneWork>>>,
    refence_after: Duration,
    fenced_out: FencedOutLanes,
    reports: mpsc::UnboundedSender<(Lane, Epoch)>,
    reports_rx: std::sync::Mutex<Option<mpsc::UnboundedReceiver<(Lane, Epoch)>>>,
}

impl RaftAssignment {
    /// The assignment of `cluster`'s node, fencing in `store` under
    /// [`owner_name`] of its id and incarnation. A lane fenced out by an
    /// outsider is listed in `fenced_out` after [`FENCED_OUT_GRACE`] and
    /// re-fenced through Raft once it has been refused for `refence_after`
    /// (the node passes the lease plus the margin, the same bound as a
    /// failover).
    pub fn new(
        cluster: Arc<Cluster>,
        store: Arc<dyn Store>,
        refence_after: Duration,
        fenced_out: FencedOutLanes,
    ) -> Self {
        let owner = owner_name(&cluster.node_id().to_string(), cluster.incarnation());
        let (reports, rx) = mpsc::unbounded_channel();
        RaftAssignment {
            cluster,
            store,
            owner,
            sender: std::sync::Mutex::new(None),
            refence_after,
            fenced_out,
            reports,
            reports_rx: std::sync::Mutex::new(Some(rx)),
        }
    }
}

/// A lane the store keeps refusing: since when, and what the store holds.
#[derive(Debug, Clone)]
struct Refused {
    since: Instant,
    /// When `refence_after` is counted from (reset when a re-fence did not
    /// move Raft on).
    due: Instant,
    found: FencedOut,
    warned: bool,
}

/// How long a [`RaftAssignment`] with fences pending waits before trying
/// them again.
pub const FENCE_RETRY: Duration = Duration::from_millis(250);

/// How long a [`RaftAssignment`] with nothing pending waits for news
/// (Raft's changes and lane owners' reports wake it earlier).
pub const IDLE_LOOK: Duration = Duration::from_secs(3600);

/// The decisions of a [`RaftAssignment`] (pure: no IO, no clock). Raft's
/// lanes, the store's answers and `now` go in; out come the lanes to fence,
/// the fenced lanes to publish, the lanes fenced out by an outsider to
/// report (WARN, [`FencedOutLanes`]) and to re-fence through Raft, and when
/// to look again. See the module docs, "Lanes fenced by someone outside
/// the cluster".
#[derive(Debug, Clone)]
pub struct RaftLanes {
    refence_after: Duration,
    /// Lanes fenced in the store at the epoch Raft gives them.
    fenced: OwnedLanes,
    /// Lanes the store refuses at the epoch Raft gives them.
    refused: BTreeMap<Lane, Refused>,
}

impl RaftLanes {
    /// Nothing fenced yet; a lane refused for `refence_after` is re-fenced
    /// through Raft.
    pub fn new(refence_after: Duration) -> Self {
        RaftLanes {
            refence_after,
            fenced: OwnedLanes::new(),
            refused: BTreeMap::new(),
        }
    }

    /// Raft gives this node `want` (lane → epoch): a lane gone or at another
    /// epoch is no longer fenced (it stops without waiting for other lanes'
    /// fences), and no longer refused (a new epoch may be fenced).
    pub fn raft_gives(&mut self, want: &OwnedLanes) {
        self.fenced.retain(|l, e| want.get(l) == Some(e));
        self.refused
            .retain(|l, r| want.get(l) == Some(&r.found.epoch));
    }

    /// The lanes of `want` to fence now: neither fenced nor refused. A
    /// refused lane is not fenced again at the same epoch (the store never
    /// lowers it): it waits for a new one from Raft.
    pub fn to_fence(&self, want: &OwnedLanes) -> OwnedLanes {
        want.iter()
            .filter(|(l, _)| !self.fenced.contains_key(l) && !self.refused.contains_key(l))
            .map(|(&l, &e)| (l, e))
            .collect()
    }

    /// The fences of `done` held, and Raft now gives `want` (the lease may
    /// have lapsed or Raft moved on meanwhile): the lanes fenced at the
    /// epoch Raft still gives them are worked.
    pub fn fenced(&mut self, done: OwnedLanes, want: &OwnedLanes) {
        self.fenced
            .extend(done.into_iter().filter(|(l, e)| want.get(l) == Some(e)));
        self.fenced.retain(|l, e| want.get(l) == Some(e));
    }

    /// The fences of `failed` (lane → Raft epoch) did not hold at `now`, and
    /// the store's lane rows read `rows`: notes the lanes the store holds
    /// for someone else than `me` at that epoch or a higher one. The store
    /// never lowers an epoch, so a fence at that Raft epoch cannot succeed
    /// any more: only a new epoch from Raft helps. (A lane held at a lower
    /// epoch is retried.)
    pub fn refused(&mut self, failed: &OwnedLanes, rows: &[LaneRow], me: &str, now: Instant) {
        for row in rows {
            let Some(&epoch) = failed.get(&row.lane) else {
                continue;
            };
            if row.epoch < epoch || row.owner.as_deref() == Some(me) {
                continue;
            }
            let found = FencedOut {
                epoch,
                store_owner: row.owner.clone(),
                store_epoch: row.epoch,
            };
            self.refused.insert(
                row.lane,
                Refused {
                    since: now,
                    due: now,
                    found,
                    warned: false,
                },
            );
        }
    }

    /// A lane owner's claim was refused at (`lane`, `epoch`): if that is
    /// the fenced epoch, fence the lane again (and find out who holds it).
    pub fn fenced_out(&mut self, lane: Lane, epoch: Epoch) {
        if self.fenced.get(&lane) == Some(&epoch) {
            self.fenced.remove(&lane);
        }
    }

    /// The lanes to work: fenced at the epoch Raft gives them.
    pub fn owned(&self) -> &OwnedLanes {
        &self.fenced
    }

    /// The lanes refused for [`FENCED_OUT_GRACE`] at `now` that were not
    /// reported yet: each is to be logged at WARN, once.
    pub fn newly_fenced_out(&mut self, now: Instant) -> Vec<(Lane, FencedOut)> {
        let mut out = Vec::new();
        for (&lane, r) in self.refused.iter_mut() {
            if !r.warned && now.saturating_duration_since(r.since) >= FENCED_OUT_GRACE {
                r.warned = true;
                out.push((lane, r.found.clone()));
            }
        }
        out
    }

    /// The lanes reported fenced out (for [`FencedOutLanes`]).
    pub fn fenced_out_lanes(&self) -> BTreeMap<Lane, FencedOut> {
        self.refused
            .iter()
            .filter(|(_, r)| r.warned)
            .map(|(&l, r)| (l, r.found.clone()))
            .collect()
    }

    /// The lanes refused for `refence_after` at `now`, as
    /// [`Cluster::refence`] takes them (lane, Raft epoch, store epoch):
    /// Raft gives them an epoch above the store's. Each is asked again
    /// after another `refence_after` if Raft did not move (refused, no
    /// leader).
    pub fn refences_due(&mut self, now: Instant) -> Vec<(u16, Epoch, Epoch)> {
        let after = self.refence_after;
        self.refused
            .iter_mut()
            .filter(|(_, r)| now.saturating_duration_since(r.due) >= after)
            .map(|(&l, r)| {
                r.due = now;
                (l, r.found.epoch, r.found.store_epoch)
            })
            .collect()
    }

    /// How long after `now` to look again without news: [`FENCE_RETRY`]
    /// while fences are `pending`, else [`IDLE_LOOK`]; earlier when a
    /// refused lane's grace or re-fence falls due (but at least 10 ms).
    pub fn next_look(&self, now: Instant, pending: bool) -> Duration {
        let mut wait = if pending { FENCE_RETRY } else { IDLE_LOOK };
        for r in self.refused.values() {
            let next = if r.warned {
                (r.due + self.refence_after).saturating_duration_since(now)
            } else {
                (r.since + FENCED_OUT_GRACE).saturating_duration_since(now)
            };
            wait = wait.min(next.max(Duration::from_millis(10)));
        }
        wait
    }
}

/// What a round of fences did.
struct Fenced {
    /// The fences that held.
    done: OwnedLanes,
    /// Some did not.
    some_failed: bool,
}

/// Fences `todo` in `store` under `owner`; notes the lanes refused.
async fn fence(
    lanes: &mut RaftLanes,
    store: &Arc<dyn Store>,
    owner: &str,
    todo: OwnedLanes,
) -> Fenced {
    let asked = todo.len();
    let done = fence_all(store.clone(), owner.to_owned(), todo.clone()).await;
    let some_failed = done.len() < asked;
    if some_failed {
        let failed: OwnedLanes = todo
            .into_iter()
            .filter(|(l, _)| !done.contains_key(l))
            .collect();
        match store.lane_rows().await {
            Ok(rows) => lanes.refused(&failed, &rows, owner, Instant::now()),
            Err(e) => tracing::warn!(error = %e, "reading lane rows failed"),
        }
    }
    Fenced { done, some_failed }
}

/// Logs the lanes newly fenced out by an outsider at WARN (once each) and
/// lists the fenced-out ones in `shared`.
fn report_fenced_out(lanes: &mut RaftLanes, shared: &FencedOutLanes) {
    for (lane, found) in lanes.newly_fenced_out(Instant::now()) {
        tracing::warn!(
            lane,
            epoch = found.epoch.0,
            store_owner = found.store_owner.as_deref().unwrap_or(""),
            store_epoch = found.store_epoch.0,
            "lane fenced out by a process outside the cluster (a --single node on this \
             store?): not delivering it until Raft re-fences it above the store's epoch"
        );
    }
    *shared.lock().expect("not poisoned") = lanes.fenced_out_lanes();
}

/// Asks Raft to give the lanes `due` (lane, Raft epoch, store epoch) an
/// epoch above the store's ([`Cluster::refence`]).
async fn refence(cluster: &Cluster, due: Vec<(u16, Epoch, Epoch)>) {
    if due.is_empty() {
        return;
    }
    let lanes = due.len();
    match cluster.refence(due).await {
        Ok(()) => tracing::info!(
            lanes,
            "lanes fenced out by an outsider: Raft re-assigned them above the store's epochs"
        ),
        Err(e) => tracing::warn!(lanes, error = %e, "re-fencing through Raft failed"),
    }
}

/// Fences `todo` at their epochs; returns those that hold now.
async fn fence_all(store: Arc<dyn Store>, owner: String, todo: OwnedLanes) -> OwnedLanes {
    let results: Vec<Option<(Lane, Epoch)>> = stream::iter(todo)
        .map(|(lane, epoch)| {
            let (store, owner) = (store.clone(), owner.clone());
            async move {
                let owner = owner.as_str();
                match store.fence(lane, owner, epoch).await {
                    Ok(true) => Some((lane, epoch)),
                    Ok(false) => {
                        tracing::debug!(
                            lane,
                            epoch = epoch.0,
                            "fence refused: the store holds this epoch or a higher one"
                        );
                        None
                    }
                    Err(e) => {
                        tracing::warn!(lane, epoch = epoch.0, error = %e, "fence failed");
                        None
                    }
                }
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().flatten().collect()
}

/// A [`NodeLanes`] as the lanes Raft gives this node and those it hands
/// over.
fn node_lanes(view: &NodeLanes) -> (OwnedLanes, ReleasingLanes) {
    let releasing = view
        .releasing
        .iter()
        .map(|(&l, r)| {
            let handover = Handover {
                epoch: r.epoch,
                at: r.at,
            };
            (l, handover)
        })
        .collect();
    (view.owned.clone(), releasing)
}

#[async_trait]
impl LaneAssignment for RaftAssignment {
    fn owner(&self) -> &str {
        &self.owner
    }

    fn fenced_out_reports(&self) -> Option<mpsc::UnboundedSender<(Lane, Epoch)>> {
        Some(self.reports.clone())
    }

    async fn start(&self) -> Result<watch::Receiver<LaneWork>, AssignmentError> {
        let (tx, rx) = watch::channel(LaneWork::default());
        *self.sender.lock().expect("not poisoned") = Some(tx.clone());
        let mut lanes_rx = self.cluster.node_lanes();
        let store = self.store.clone();
        let owner = self.owner.clone();
        let cluster = self.cluster.clone();
        let refence_after = self.refence_after;
        let shared = self.fenced_out.clone();
        let mut reports = self
            .reports_rx
            .lock()
            .expect("not poisoned")
            .take()
            .expect("started once");
        tokio::spawn(async move {
            let mut lanes = RaftLanes::new(refence_after);
            loop {
                // Owned and releasing from one applied state: read apart, a
                // lane being handed over could look neither (stopped, not
                // drained) or both.
                let (want, releasing) = node_lanes(&lanes_rx.borrow_and_update());
                lanes.raft_gives(&want);
                let publish = |fenced: &OwnedLanes, releasing: &ReleasingLanes| {
                    let work = LaneWork {
                        owned: fenced.clone(),
                        releasing: releasing.clone(),
                    };
                    tx.send_if_modified(|v| {
                        let changed = *v != work;
                        *v = work;
                        changed
                    });
                };
                publish(lanes.owned(), &releasing);
                let todo = lanes.to_fence(&want);
                let pending = !todo.is_empty() && {
                    let pending = fence(&mut lanes, &store, &owner, todo).await;
                    // The state may have moved on during the fence: both
                    // from the newest (the loop reads it again anyway).
                    let (now_owned, now_releasing) = node_lanes(&lanes_rx.borrow());
                    lanes.fenced(pending.done, &now_owned);
                    publish(lanes.owned(), &now_releasing);
                    pending.some_failed
                };
                report_fenced_out(&mut lanes, &shared);
                // Applied here, a re-fence changes `lanes_rx`.
                refence(&cluster, lanes.refences_due(Instant::now())).await;
                let wait = lanes.next_look(Instant::now(), pending);
                tokio::select! {
                    r = lanes_rx.changed() => if r.is_err() { return },
                    _ = tx.closed() => return,
                    report = reports.recv() => {
                        // A lane owner was fenced out at a claim.
                        let Some((lane, epoch)) = report else { return };
                        lanes.fenced_out(lane, epoch);
                    }
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        });
        Ok(rx)
    }

    async fn released(&self, lane: Lane, handover: Handover) -> ReleaseOutcome {
        match self.cluster.release(lane, handover.at).await {
            Ok(()) => {
                tracing::info!(lane, "lane released to its next owner");
                ReleaseOutcome::Released
            }
            Err(ClusterError::Refused(reason)) => {
                tracing::info!(lane, %reason, "release refused (handover cancelled?)");
                ReleaseOutcome::Refused
            }
            Err(e) => {
                tracing::warn!(lane, error = %e, "release failed; will retry");
                ReleaseOutcome::Failed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    fn epochs(of: &[(Lane, u64)]) -> OwnedLanes {
        of.iter().map(|&(l, e)| (l, Epoch(e))).collect()
    }

    fn handovers(of: &[(Lane, u64, u64)]) -> ReleasingLanes {
        of.iter()
            .map(|&(l, e, at)| {
                let h = Handover {
                    epoch: Epoch(e),
                    at: Some(at),
                };
                (l, h)
            })
            .collect()
    }

    fn run(epoch: Epoch, draining: bool) -> Running {
        Running { epoch, draining }
    }

    #[test]
    fn owners_start_stop_and_drain_as_the_work_says() {
        let running = BTreeMap::from([
            (0, run(Epoch(1), false)), // still owned: kept
            (1, run(Epoch(1), false)), // epoch moved: stopped
            (2, run(Epoch(1), false)), // handed over: drained
            (3, run(Epoch(1), true)),  // drain under way: kept
            (4, run(Epoch(1), false)), // gone: stopped
            (5, run(Epoch(1), true)),  // drain, then the lease lapsed: stopped
        ]);
        let work = LaneWork {
            owned: epochs(&[(0, 1), (1, 2), (6, 3)]),
            releasing: handovers(&[(2, 1, 10), (3, 1, 10), (7, 4, 10), (8, 4, 10), (9, 4, 12)]),
        };
        // 8's release of this handover is under way; 9's was for an earlier
        // handover (cancelled since).
        let sent = handovers(&[(8, 4, 10), (9, 4, 11)]);
        let plan = plan_lanes(&running, &work, &sent);
        assert_eq!(plan.start, vec![(6, Epoch(3))]);
        assert_eq!(plan.stop, vec![1, 4, 5]);
        assert_eq!(plan.drain, vec![2]);
        let released: Vec<_> = plan.release_now.iter().map(|&(l, h)| (l, h.at)).collect();
        assert_eq!(released, vec![(7, Some(10)), (9, Some(12))]);
        // Lane 1 starts again at its new epoch once its old owner is gone.
        let running = BTreeMap::from([(0, run(Epoch(1), false))]);
        assert_eq!(
            plan_lanes(&running, &work, &ReleasingLanes::new()).start,
            vec![(1, Epoch(2)), (6, Epoch(3))]
        );
    }

    #[test]
    fn a_cancelled_handover_lets_the_drain_finish() {
        let running = BTreeMap::from([(0, run(Epoch(5), true))]);
        let work = LaneWork {
            owned: epochs(&[(0, 5)]),
            releasing: ReleasingLanes::new(),
        };
        assert_eq!(
            plan_lanes(&running, &work, &ReleasingLanes::new()),
            LanePlan::default()
        );
    }

    fn row(lane: Lane, owner: &str, epoch: Epoch) -> LaneRow {
        LaneRow {
            lane,
            owner: Some(owner.into()),
            epoch,
            backlog: 0,
        }
    }

    #[test]
    fn refused_lanes_are_those_held_elsewhere_at_our_epoch_or_above() {
        let clock = ManualClock::new();
        let rows = vec![
            row(0, "7/aa", Epoch(3)), // an outsider at our epoch: refused
            row(1, "7/aa", Epoch(9)), // an outsider above it: refused
            row(2, "2/bb", Epoch(2)), // an older owner: a retry will fence
            row(3, "1/me", Epoch(3)), // ours already
            row(4, "7/aa", Epoch(9)), // not one we failed to fence
        ];
        let want = epochs(&[(0, 3), (1, 3), (2, 3), (3, 3), (4, 3)]);
        let mut lanes = RaftLanes::new(Duration::from_secs(30));
        lanes.raft_gives(&want);
        assert_eq!(lanes.to_fence(&want), want);
        let failed = epochs(&[(0, 3), (1, 3), (2, 3), (3, 3)]);
        lanes.fenced(epochs(&[(4, 3)]), &want);
        lanes.refused(&failed, &rows, "1/me", clock.now());
        // Refused lanes are not fenced again at the same epoch.
        assert_eq!(lanes.to_fence(&want), epochs(&[(2, 3), (3, 3)]));
        assert_eq!(lanes.owned(), &epochs(&[(4, 3)]));
        // Listed (and logged) only after the grace, once.
        clock.advance(FENCED_OUT_GRACE - Duration::from_millis(1));
        assert!(lanes.newly_fenced_out(clock.now()).is_empty());
        assert!(lanes.fenced_out_lanes().is_empty());
        assert_eq!(
            lanes.next_look(clock.now(), false),
            Duration::from_millis(10),
            "looks again at the grace (at least 10 ms on)"
        );
        clock.advance(Duration::from_millis(1));
        let warned = lanes.newly_fenced_out(clock.now());
        assert_eq!(warned.iter().map(|w| w.0).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(warned[1].1.store_epoch, Epoch(9));
        assert_eq!(warned[1].1.store_owner.as_deref(), Some("7/aa"));
        assert!(lanes.newly_fenced_out(clock.now()).is_empty(), "once");
        assert_eq!(lanes.fenced_out_lanes().len(), 2);
        // A new epoch from Raft ends the refusal of lane 1.
        let want = epochs(&[(0, 3), (1, 10), (2, 3), (3, 3), (4, 3)]);
        lanes.raft_gives(&want);
        assert_eq!(lanes.fenced_out_lanes().keys().collect::<Vec<_>>(), [&0]);
        assert!(lanes.to_fence(&want).contains_key(&1));
    }

    #[test]
    fn a_refused_lane_is_re_fenced_through_raft_after_the_bound_and_again() {
        let clock = ManualClock::new();
        let refence_after = Duration::from_secs(20);
        let mut lanes = RaftLanes::new(refence_after);
        let want = epochs(&[(5, 4)]);
        lanes.raft_gives(&want);
        lanes.refused(&want, &[row(5, "9/x", Epoch(6))], "1/me", clock.now());
        assert_eq!(lanes.next_look(clock.now(), true), FENCE_RETRY);
        assert_eq!(lanes.next_look(clock.now(), false), FENCED_OUT_GRACE);
        clock.advance(FENCED_OUT_GRACE);
        assert_eq!(lanes.newly_fenced_out(clock.now()).len(), 1);
        assert_eq!(
            lanes.next_look(clock.now(), false),
            refence_after - FENCED_OUT_GRACE
        );
        assert!(lanes.refences_due(clock.now()).is_empty());
        clock.advance(refence_after - FENCED_OUT_GRACE - Duration::from_millis(1));
        assert!(lanes.refences_due(clock.now()).is_empty());
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            lanes.refences_due(clock.now()),
            vec![(5, Epoch(4), Epoch(6))]
        );
        assert!(lanes.refences_due(clock.now()).is_empty(), "counted anew");
        assert_eq!(lanes.next_look(clock.now(), false), refence_after);
        // Raft did not move (no leader): asked again after the bound.
        clock.advance(refence_after);
        assert_eq!(
            lanes.refences_due(clock.now()),
            vec![(5, Epoch(4), Epoch(6))]
        );
        // Raft moved the lane above the store's epoch: fenced at last.
        let want = epochs(&[(5, 7)]);
        lanes.raft_gives(&want);
        assert_eq!(lanes.to_fence(&want), want);
        lanes.fenced(want.clone(), &want);
        assert_eq!(lanes.owned(), &want);
        assert_eq!(lanes.next_look(clock.now(), false), IDLE_LOOK);
    }

    #[test]
    fn fenced_lanes_follow_raft_and_the_owners_reports() {
        let mut lanes = RaftLanes::new(Duration::from_secs(20));
        let want = epochs(&[(0, 1), (1, 1), (2, 1)]);
        lanes.raft_gives(&want);
        // Raft moved lane 2 while the fences ran: not worked at epoch 1.
        let moved = epochs(&[(0, 1), (1, 1), (2, 2)]);
        lanes.fenced(want.clone(), &moved);
        assert_eq!(lanes.owned(), &epochs(&[(0, 1), (1, 1)]));
        // A lane gone stops at once; one at a new epoch is fenced anew.
        let want = epochs(&[(1, 1), (2, 2)]);
        lanes.raft_gives(&want);
        assert_eq!(lanes.owned(), &epochs(&[(1, 1)]));
        assert_eq!(lanes.to_fence(&want), epochs(&[(2, 2)]));
        // An owner fenced out at an old epoch changes nothing; at the
        // fenced one, the lane is fenced again.
        lanes.fenced_out(1, Epoch(0));
        assert_eq!(lanes.owned(), &epochs(&[(1, 1)]));
        lanes.fenced_out(1, Epoch(1));
        assert!(lanes.owned().is_empty());
        assert_eq!(lanes.to_fence(&want), want);
    }

    #[test]
    fn an_attempt_starts_only_if_it_ends_within_the_lease_and_the_drain() {
        let t0 = ManualClock::new().now();
        let ms = Duration::from_millis;
        let timeout = ms(10_000);
        // Lease ends at t0 + 15 s: room for 10 s plus the 100 ms slack until
        // t0 + 4.9 s.
        let lease = Room::Until(t0 + ms(15_000));
        assert!(attempt_may_start(t0, lease, None, timeout));
        assert!(attempt_may_start(t0 + ms(4_900), lease, None, timeout));
        assert!(!attempt_may_start(t0 + ms(4_901), lease, None, timeout));
        assert!(!attempt_may_start(t0 + ms(14_999), lease, None, timeout));
        // A drain bound of t0 + 10.5 s comes first.
        let drain = Some(t0 + ms(10_500));
        assert!(attempt_may_start(t0 + ms(400), lease, drain, timeout));
        assert!(!attempt_may_start(t0 + ms(401), lease, drain, timeout));
        // Without a lease, only the drain bounds it; closed, nothing starts.
        assert!(attempt_may_start(
            t0 + ms(99_999),
            Room::Unbounded,
            None,
            timeout
        ));
        assert!(!attempt_may_start(
            t0 + ms(401),
            Room::Unbounded,
            drain,
            timeout
        ));
        assert!(!attempt_may_start(t0, Room::Closed, None, ms(1)));
    }

    #[test]
    fn a_drain_bound_only_moves_earlier_and_an_ended_tie_sends_nothing() {
        let clock = ManualClock::new();
        let t0 = clock.now();
        let tie = OwnerTie::new(3, Epoch(7), WorkGate::default());
        assert_eq!(tie.start_at(t0, Duration::from_secs(3_600)), Start::Go);
        tie.drain(t0 + Duration::from_secs(60));
        tie.drain(t0 + Duration::from_secs(600));
        assert_eq!(tie.start_at(t0, Duration::from_secs(60)), Start::Wait);
        assert_eq!(tie.start_at(t0, Duration::from_secs(30)), Start::Go);
        clock.advance(Duration::from_millis(29_900));
        assert_eq!(
            tie.start_at(clock.now(), Duration::from_secs(30)),
            Start::Go
        );
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            tie.start_at(clock.now(), Duration::from_secs(30)),
            Start::Wait,
            "30 s plus the slack no longer fit before the drain's bound"
        );
        assert_eq!(
            tie.start_at(clock.now(), Duration::from_secs(29)),
            Start::Go
        );
        assert_eq!((tie.lane(), tie.epoch()), (3, Epoch(7)));
        tie.end();
        assert_eq!(tie.start_at(t0, Duration::from_secs(30)), Start::Lost);
        assert_eq!(tie.start(Duration::from_secs(30)), Start::Lost);
    }

    /// A work gate over a holder lease on a manual clock, as the node wires
    /// it to [`Cluster::work_until`]: renewed every 2 s, a 15 s lease
    /// leaves room for a 10 s attempt until 4.9 s after the last renewal;
    /// without renewals (cut off) nothing starts, and the gate closes at
    /// the lease's end.
    #[test]
    fn attempts_start_while_the_renewed_lease_covers_them() {
        use lanebus_cluster::lease::HolderLease;
        let clock = Arc::new(ManualClock::new());
        let t0 = clock.now();
        let cfg = lanebus_cluster::LeaseConfig::default();
        let holder = Arc::new(Mutex::new(HolderLease::default()));
        let ms = move |t: Instant| t.duration_since(t0).as_millis() as u64;
        let gate = {
            let (clock, holder) = (clock.clone(), holder.clone());
            WorkGate::new(move || {
                let h = holder.lock().unwrap();
                let now = ms(clock.now());
                match h.ends_at_ms(&cfg) {
                    Some(end) if h.valid(&cfg, now) => Room::Until(t0 + Duration::from_millis(end)),
                    _ => Room::Closed,
                }
            })
        };
        let tie = OwnerTie::new(0, Epoch(1), gate.clone());
        let ten_s = Duration::from_secs(10);
        assert_eq!(
            tie.start_at(clock.now(), ten_s),
            Start::Wait,
            "no lease yet"
        );
        for _ in 0..5 {
            holder
                .lock()
                .unwrap()
                .committed(&cfg, ms(clock.now()), None);
            assert_eq!(tie.start_at(clock.now(), ten_s), Start::Go);
            clock.advance(Duration::from_millis(cfg.renew_interval_ms));
        }
        // Cut off after the renewal sent 2 s ago: room until 4.9 s after it.
        clock.advance(Duration::from_millis(2_900));
        assert_eq!(tie.start_at(clock.now(), ten_s), Start::Go);
        clock.advance(Duration::from_millis(1));
        assert_eq!(tie.start_at(clock.now(), ten_s), Start::Wait);
        assert!(gate.open(), "shorter attempts still fit");
        clock.advance(Duration::from_millis(10_098));
        assert!(gate.open());
        clock.advance(Duration::from_millis(1));
        assert!(!gate.open(), "the lease ended 15 s after the last renewal");
    }

    #[test]
    fn owner_names_carry_the_incarnation() {
        let a = owner_name("3", "aa");
        assert_ne!(a, owner_name("3", "bb"));
        assert_eq!(owner_node(&a), "3");
        assert_eq!(owner_node("plain"), "plain");
    }

    #[test]
    fn a_new_owner_takes_the_next_epoch_of_every_lane() {
        let rows = vec![
            LaneRow {
                lane: 0,
                owner: None,
                epoch: Epoch(0),
                backlog: 0,
            },
            LaneRow {
                lane: 1,
                owner: Some("n1".into()),
                epoch: Epoch(7),
                backlog: 3,
            },
        ];
        assert_eq!(next_epochs(&rows), vec![(0, Epoch(1)), (1, Epoch(8))]);
    }
}
