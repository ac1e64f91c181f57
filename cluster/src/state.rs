//! The replicated state machine: members, node leases and the lane table, and
//! the [`Command`]s that change them.
//!
//! [`ClusterState::apply`] is pure and deterministic (no clock, no IO): every
//! node applies the same committed commands in the same order and ends with
//! the same state. Wall-clock or monotonic times never enter it; the leader
//! keeps *when* it applied each renewal in memory on its own clock (see
//! [`crate::cluster`] and [`crate::lease`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::assignment::{self, Change, LaneEntry, LaneState};
use crate::{Epoch, NodeId};

/// A cluster member as the state machine records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Address of the member's Raft RPC server (`IP:PORT`).
    pub raft_addr: String,
    /// Address of the member's HTTP API (`IP:PORT`), so that other nodes can
    /// forward requests to it.
    pub http_addr: String,
    /// Removal requested ([`Command::RemoveNode`]): the member hands its
    /// lanes over and receives none; it is forgotten once it owns none.
    pub leaving: bool,
}

/// What the state machine knows of a node's lease: only deterministic data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    /// Renewals applied so far (0: the node never renewed, so it is not live).
    pub renewals: u64,
    /// Log index of the last applied renewal.
    pub last_index: u64,
}

/// A command proposed through Raft. Each variant says who sends it and why it
/// is allowed. New variants go at the end: the Raft log and snapshots store
/// commands with bincode, which numbers variants in order, so a node must
/// read the entries older versions wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Record a member and its addresses. Sent by the leader when a node joins
    /// (before it becomes a Raft learner) and by a bootstrapping node for
    /// itself. Allowed for a new id, and as a no-op for a known id with the
    /// same addresses; an address change of a known id is refused (the node
    /// must be removed first), so a typo cannot steal another node's identity.
    AddNode {
        /// The node's id.
        node: NodeId,
        /// Raft RPC address.
        raft_addr: String,
        /// HTTP API address.
        http_addr: String,
    },
    /// Planned removal of a member: it is marked leaving, the leader hands its
    /// lanes over (it stays alive meanwhile, see
    /// [`assignment::plan_draining`]), then removes it from the Raft
    /// membership and proposes [`Command::Forget`]. Allowed for any member.
    RemoveNode {
        /// The node to remove.
        node: NodeId,
    },
    /// Drop a leaving member's record. Sent by the leader; allowed only when
    /// the member is leaving and owns no lane any more (so no lane is left
    /// with an owner nobody knows).
    Forget {
        /// The node to forget.
        node: NodeId,
    },
    /// A node renews its lease. Sent by every member every
    /// `renew_interval_ms`; allowed for members only (a stranger cannot keep
    /// itself live). The leader notes on its own clock when it applied it.
    RenewLease {
        /// The renewing node.
        node: NodeId,
    },
    /// Lane changes planned by the leader with [`assignment::plan_draining`]
    /// over its live set; applied with [`assignment::apply`], which ignores a
    /// handover whose premise no longer holds. Written by older versions;
    /// the leader now proposes [`Command::ApplyPlanned`], whose assignments
    /// carry their premise too.
    Apply {
        /// The planned changes, applied in order.
        changes: Vec<Change>,
    },
    /// A node process started: `incarnation` names this start of the
    /// process (unique per start). Sent by every node before its first lease
    /// renewal. When it differs from the recorded one, every lane the node
    /// owns in state [`LaneState::Active`] gets `epoch + 1`
    /// ([`bump_restarted`]): the previous process fenced those lanes in the
    /// store under its own incarnation, and the store lets only one process
    /// hold a given (lane, epoch), so the new process needs new epochs. The
    /// same incarnation again is a no-op (a retried proposal must not bump
    /// twice). Allowed for members only. Lanes the node was releasing are
    /// left alone: the new process holds nothing of them and releases them
    /// at once.
    Incarnate {
        /// The node.
        node: NodeId,
        /// Unique name of this process start (e.g. a UUID).
        incarnation: String,
    },
    /// The old owner of a lane in handover has drained it: the target owns it
    /// now at `epoch + 1` ([`assignment::apply_release`]), whichever
    /// handover is under way. Written by older versions; a node now sends
    /// [`Command::ReleaseHandover`], which names the handover. Allowed only
    /// when the lane is being released by `from`.
    Release {
        /// The lane.
        lane: u16,
        /// The releasing (old) owner.
        from: NodeId,
    },
    /// The owner of active lanes found them fenced in the store by someone
    /// outside the cluster (e.g. a `lanebus node --single` process on the
    /// same store): the store holds `store_epoch` (at least the Raft epoch)
    /// under another name, so the owner can neither claim nor fence them.
    /// Each listed lane still owned by `node` in state
    /// [`LaneState::Active`] at `epoch` gets
    /// `max(epoch, store_epoch) + 1` ([`refence_lanes`]), which the owner
    /// then fences; the outsider is deposed like any older owner (docs/design.md
    /// invariant 4). A lane whose owner or epoch changed meanwhile is left
    /// alone (a retried or stale report bumps nothing). Sent by the owner
    /// after the lease plus the margin, so a still-running outsider is not
    /// fought more often than that. Allowed for members only.
    Refence {
        /// The reporting owner.
        node: NodeId,
        /// `(lane, Raft epoch the owner holds, epoch found in the store)`.
        lanes: Vec<(u16, Epoch, Epoch)>,
    },
    /// A node stopping gracefully gives its lease up: it counts as not live
    /// (as if it never renewed) until its next renewal, so the leader moves
    /// its lanes at once instead of after the lease and the margin. Sent by
    /// the node itself once its lanes are drained and stopped (nothing of
    /// theirs is in flight); allowed for members only.
    ReleaseLease {
        /// The stopping node.
        node: NodeId,
    },
    /// [`Command::Apply`] with its premise: the leader planned `changes`
    /// over the state applied up to log index `planned_at`. An
    /// [`Change::Assign`] (a lane without a live owner) is applied only if
    /// the premise still holds ([`ClusterState::assign_premise_holds`]):
    /// the lane is still at the epoch it was planned from, and its owner has
    /// not renewed its lease since `planned_at` (a renewal applied between
    /// the plan and this command means the owner is alive and working the
    /// lane: moving it would bump the epoch under a live owner). Refused
    /// assignments are skipped; the leader's next tick plans again. The
    /// other changes check their own premise, as in [`Command::Apply`].
    /// What the leader proposes; [`Command::Apply`] stays for the log
    /// entries older versions wrote.
    ApplyPlanned {
        /// The planned changes, applied in order.
        changes: Vec<Change>,
        /// Log index of the state the plan was made over.
        planned_at: u64,
    },
    /// [`Command::Release`] of one handover: the one applied at log index
    /// `at` (`None`: a handover an older version recorded without its
    /// index). Sent by the old owner once it has drained the lane; allowed
    /// only when that handover is still under way with `from` as owner. A
    /// release meant for a cancelled handover is refused even if the lane
    /// was handed over again at the same epoch since: its node may have
    /// run an owner for the lane in between, which nobody drained.
    ReleaseHandover {
        /// The lane.
        lane: u16,
        /// The releasing (old) owner.
        from: NodeId,
        /// Log index of the handover ([`Releasing::at`]).
        at: Option<u64>,
    },
}

/// The answer of the state machine to one command.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommandResult {
    /// Whether the command changed (or confirmed) the state; `false` with a
    /// `reason` when it was refused.
    pub ok: bool,
    /// Why the command was refused (lowercase, no final period).
    pub reason: Option<String>,
    /// Log index the command was applied at (set for
    /// [`Command::RenewLease`]: a node whose lease lapsed works again only
    /// once it applied the log up to its renewal, see
    /// [`crate::lease::HolderLease`]).
    #[serde(default)]
    pub index: Option<u64>,
}

impl CommandResult {
    fn ok() -> Self {
        CommandResult {
            ok: true,
            reason: None,
            index: None,
        }
    }
    fn refused(reason: String) -> Self {
        CommandResult {
            ok: false,
            reason: Some(reason),
            index: None,
        }
    }
}

/// The application part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Members by id.
    pub members: BTreeMap<NodeId, Member>,
    /// Lease records by node id.
    pub leases: BTreeMap<NodeId, LeaseRecord>,
    /// The lane table, indexed by lane number.
    pub lanes: Vec<LaneEntry>,
    /// The current process incarnation of each node ([`Command::Incarnate`]).
    pub incarnations: BTreeMap<NodeId, String>,
}

/// A node restarted under a new incarnation: its active lanes get
/// `epoch + 1` so that the new process can fence them in the store (the old
/// one holds the current epochs there). Returns how many lanes moved on.
pub fn bump_restarted(lanes: &mut [LaneEntry], node: NodeId) -> usize {
    let mut n = 0;
    for e in lanes.iter_mut() {
        if e.owner == Some(node) && e.state == LaneState::Active {
            e.epoch = e.epoch.next();
            n += 1;
        }
    }
    n
}

/// [`Command::Refence`]: every `(lane, epoch, store_epoch)` that `node`
/// still owns in state [`LaneState::Active`] at `epoch` moves to
/// `max(epoch, store_epoch) + 1`. Returns how many lanes moved on.
pub fn refence_lanes(
    lanes: &mut [LaneEntry],
    node: NodeId,
    report: &[(u16, Epoch, Epoch)],
) -> usize {
    let mut n = 0;
    for &(lane, epoch, store_epoch) in report {
        let Some(e) = lanes.get_mut(usize::from(lane)) else {
            continue;
        };
        if e.owner == Some(node) && e.state == LaneState::Active && e.epoch == epoch {
            e.epoch = epoch.max(store_epoch).next();
            n += 1;
        }
    }
    n
}

impl ClusterState {
    /// An empty state with `lanes` unassigned lanes.
    pub fn new(lanes: u16) -> Self {
        ClusterState {
            members: BTreeMap::new(),
            leases: BTreeMap::new(),
            lanes: vec![LaneEntry::UNASSIGNED; usize::from(lanes)],
            incarnations: BTreeMap::new(),
        }
    }

    /// Lanes owned by `node` (in any state).
    pub fn lanes_of(&self, node: NodeId) -> usize {
        self.lanes.iter().filter(|e| e.owner == Some(node)).count()
    }

    /// Applies one committed command at log index `index`.
    pub fn apply(&mut self, index: u64, cmd: &Command) -> CommandResult {
        match cmd {
            Command::AddNode {
                node,
                raft_addr,
                http_addr,
            } => match self.members.get(node) {
                Some(m) if &m.raft_addr == raft_addr && &m.http_addr == http_addr => {
                    CommandResult::ok()
                }
                Some(m) => CommandResult::refused(format!(
                    "node {node} is already a member with raft_addr {} and http_addr {}",
                    m.raft_addr, m.http_addr
                )),
                None => {
                    self.members.insert(
                        *node,
                        Member {
                            raft_addr: raft_addr.clone(),
                            http_addr: http_addr.clone(),
                            leaving: false,
                        },
                    );
                    CommandResult::ok()
                }
            },
            Command::RemoveNode { node } => match self.members.get_mut(node) {
                Some(m) => {
                    m.leaving = true;
                    CommandResult::ok()
                }
                None => CommandResult::refused(format!("node {node} is not a member")),
            },
            Command::Forget { node } => match self.members.get(node) {
                Some(m) if m.leaving && self.lanes_of(*node) == 0 => {
                    self.members.remove(node);
                    self.leases.remove(node);
                    self.incarnations.remove(node);
                    CommandResult::ok()
                }
                Some(_) => CommandResult::refused(format!(
                    "node {node} is not leaving or still owns lanes"
                )),
                None => CommandResult::ok(),
            },
            Command::RenewLease { node } => {
                if !self.members.contains_key(node) {
                    return CommandResult::refused(format!("node {node} is not a member"));
                }
                let rec = self.leases.entry(*node).or_default();
                rec.renewals += 1;
                rec.last_index = index;
                CommandResult {
                    index: Some(index),
                    ..CommandResult::ok()
                }
            }
            Command::ReleaseLease { node } => {
                if !self.members.contains_key(node) {
                    return CommandResult::refused(format!("node {node} is not a member"));
                }
                if let Some(rec) = self.leases.get_mut(node) {
                    rec.renewals = 0;
                }
                CommandResult::ok()
            }
            Command::Incarnate { node, incarnation } => {
                if !self.members.contains_key(node) {
                    return CommandResult::refused(format!("node {node} is not a member"));
                }
                if self.incarnations.get(node) == Some(incarnation) {
                    return CommandResult::ok();
                }
                self.incarnations.insert(*node, incarnation.clone());
                bump_restarted(&mut self.lanes, *node);
                CommandResult::ok()
            }
            Command::Refence { node, lanes } => {
                if !self.members.contains_key(node) {
                    return CommandResult::refused(format!("node {node} is not a member"));
                }
                refence_lanes(&mut self.lanes, *node, lanes);
                CommandResult::ok()
            }
            Command::Apply { changes } => {
                for &change in changes {
                    let lane = change.lane();
                    // A plan made for another lane count changes nothing.
                    if usize::from(lane) < self.lanes.len() {
                        assignment::apply(&mut self.lanes, change, index);
                    }
                }
                CommandResult::ok()
            }
            Command::ApplyPlanned {
                changes,
                planned_at,
            } => {
                for &change in changes {
                    let lane = change.lane();
                    if usize::from(lane) >= self.lanes.len() {
                        continue;
                    }
                    if let Change::Assign { lane, epoch, .. } = change {
                        if !self.assign_premise_holds(lane, epoch, *planned_at) {
                            continue;
                        }
                    }
                    assignment::apply(&mut self.lanes, change, index);
                }
                CommandResult::ok()
            }
            Command::Release { lane, from } => {
                let at = self
                    .lanes
                    .get(usize::from(*lane))
                    .and_then(|e| e.state.handover())
                    .and_then(|(_, at)| at);
                self.release(*lane, *from, at)
            }
            Command::ReleaseHandover { lane, from, at } => self.release(*lane, *from, *at),
        }
    }

    fn release(&mut self, lane: u16, from: NodeId, at: Option<u64>) -> CommandResult {
        if usize::from(lane) >= self.lanes.len() {
            return CommandResult::refused(format!("lane {lane} does not exist"));
        }
        if assignment::apply_release(&mut self.lanes, lane, from, at) {
            return CommandResult::ok();
        }
        let named = at.map_or_else(|| "without index".to_string(), |i| format!("at {i}"));
        CommandResult::refused(format!(
            "lane {lane} is not being released by node {from} in the handover {named}"
        ))
    }

    /// Whether an assignment of `lane` at `epoch`, planned over the state
    /// applied up to log index `planned_at`, still has its premise: the
    /// lane is at `epoch - 1` (nothing moved it since), and its owner, if
    /// any, has applied no lease renewal after `planned_at` (it was judged
    /// dead on renewals up to then). `lane` must exist.
    pub fn assign_premise_holds(&self, lane: u16, epoch: Epoch, planned_at: u64) -> bool {
        let e = &self.lanes[usize::from(lane)];
        e.epoch.0.checked_add(1) == Some(epoch.0)
            && e.owner.is_none_or(|owner| {
                self.leases
                    .get(&owner)
                    .is_none_or(|r| r.last_index <= planned_at)
            })
    }

    /// Lanes `node` owns in state [`LaneState::Active`], with their epochs.
    pub fn active_lanes(&self, node: NodeId) -> BTreeMap<u16, Epoch> {
        self.lanes
            .iter()
            .enumerate()
            .filter(|(_, e)| e.owner == Some(node) && e.state == LaneState::Active)
            .map(|(l, e)| (l as u16, e.epoch))
            .collect()
    }

    /// Lanes `node` is handing over: lane → (epoch, next owner).
    pub fn releasing_lanes(&self, node: NodeId) -> BTreeMap<u16, Releasing> {
        self.lanes
            .iter()
            .enumerate()
            .filter_map(|(l, e)| match (e.owner, e.state.handover()) {
                (Some(o), Some((to, at))) if o == node => Some((
                    l as u16,
                    Releasing {
                        epoch: e.epoch,
                        to,
                        at,
                    },
                )),
                _ => None,
            })
            .collect()
    }
}

/// A lane this node must hand over: stop claiming, drain (with a bound), then
/// call [`crate::Cluster::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Releasing {
    /// The lane's current epoch (still this node's while it drains).
    pub epoch: Epoch,
    /// The next owner.
    pub to: NodeId,
    /// Log index of the handover, which its release names
    /// ([`Command::ReleaseHandover`]); `None` for a handover an older
    /// version recorded.
    pub at: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn refence_moves_only_lanes_still_owned_at_the_reported_epoch() {
        let mut s = ClusterState::new(4);
        assert!(add(&mut s, 1).ok);
        for (lane, owner) in [(0u16, 1), (1, 1), (2, 2)] {
            s.lanes[usize::from(lane)] = LaneEntry {
                owner: Some(owner),
                epoch: Epoch(3),
                state: LaneState::Active,
            };
        }
        let report = [(0, 3, 3), (1, 2, 9), (2, 3, 5), (3, 0, 4), (99, 1, 1)]
            .map(|(l, e, s)| (l, Epoch(e), Epoch(s)))
            .to_vec();
        let cmd = Command::Refence {
            node: 1,
            lanes: report,
        };
        assert!(s.apply(5, &cmd).ok);
        // Lane 0: store epoch equal to Raft's, one above both.
        assert_eq!(s.lanes[0].epoch, Epoch(4));
        // Lane 1: a stale report (Raft moved on from 2), lane 2 another
        // owner's, lane 3 unassigned, lane 99 unknown: all unchanged.
        assert_eq!(s.lanes[1].epoch, Epoch(3));
        assert_eq!(s.lanes[2].epoch, Epoch(3));
        assert_eq!(s.lanes[3], LaneEntry::UNASSIGNED);
        // The same report again bumps nothing (lane 0 is at 4 now).
        assert!(s.apply(6, &cmd).ok);
        assert_eq!(s.lanes[0].epoch, Epoch(4));
        // Store epoch above Raft's: one above the store's.
        let cmd = Command::Refence {
            node: 1,
            lanes: vec![(1, Epoch(3), Epoch(9))],
        };
        assert!(s.apply(7, &cmd).ok);
        assert_eq!(s.lanes[1].epoch, Epoch(10));
        assert!(
            !s.apply(
                8,
                &Command::Refence {
                    node: 7,
                    lanes: vec![]
                }
            )
            .ok
        );
    }

    fn add(s: &mut ClusterState, node: NodeId) -> CommandResult {
        s.apply(
            1,
            &Command::AddNode {
                node,
                raft_addr: format!("127.0.0.1:{node}"),
                http_addr: format!("127.0.0.1:1{node}"),
            },
        )
    }

    #[test]
    fn add_node_is_idempotent_and_refuses_an_address_change() {
        let mut s = ClusterState::new(4);
        assert!(add(&mut s, 1).ok);
        assert!(add(&mut s, 1).ok);
        let r = s.apply(
            2,
            &Command::AddNode {
                node: 1,
                raft_addr: "127.0.0.1:9".into(),
                http_addr: "127.0.0.1:10".into(),
            },
        );
        assert!(!r.ok);
        assert!(r.reason.unwrap().contains("already a member"));
    }

    #[test]
    fn only_members_renew_and_renewals_are_counted() {
        let mut s = ClusterState::new(4);
        assert!(!s.apply(1, &Command::RenewLease { node: 7 }).ok);
        add(&mut s, 7);
        assert!(s.apply(5, &Command::RenewLease { node: 7 }).ok);
        assert!(s.apply(6, &Command::RenewLease { node: 7 }).ok);
        assert_eq!(
            s.leases[&7],
            LeaseRecord {
                renewals: 2,
                last_index: 6
            }
        );
    }

    #[test]
    fn forget_only_a_leaving_member_without_lanes() {
        let mut s = ClusterState::new(2);
        add(&mut s, 1);
        s.apply(
            2,
            &Command::Apply {
                changes: vec![Change::Assign {
                    lane: 0,
                    to: 1,
                    epoch: Epoch(1),
                }],
            },
        );
        assert!(!s.apply(3, &Command::Forget { node: 1 }).ok);
        s.apply(4, &Command::RemoveNode { node: 1 });
        assert!(
            !s.apply(5, &Command::Forget { node: 1 }).ok,
            "still owns lane 0"
        );
        s.lanes[0] = LaneEntry::UNASSIGNED;
        assert!(s.apply(6, &Command::Forget { node: 1 }).ok);
        assert!(s.members.is_empty());
    }

    #[test]
    fn a_new_incarnation_bumps_the_active_lanes_of_its_node_once() {
        let mut s = ClusterState::new(3);
        add(&mut s, 1);
        add(&mut s, 2);
        let inc = |i: &str| Command::Incarnate {
            node: 1,
            incarnation: i.into(),
        };
        assert!(
            !s.apply(
                1,
                &Command::Incarnate {
                    node: 9,
                    incarnation: "x".into()
                }
            )
            .ok
        );
        assert!(s.apply(2, &inc("a")).ok);
        let changes = vec![
            Change::Assign {
                lane: 0,
                to: 1,
                epoch: Epoch(1),
            },
            Change::Assign {
                lane: 1,
                to: 1,
                epoch: Epoch(1),
            },
            Change::Assign {
                lane: 2,
                to: 2,
                epoch: Epoch(1),
            },
            Change::Handover {
                lane: 1,
                from: 1,
                to: 2,
            },
        ];
        s.apply(3, &Command::Apply { changes });
        // The same process again (a retried proposal): nothing moves.
        assert!(s.apply(4, &inc("a")).ok);
        assert_eq!(s.active_lanes(1), BTreeMap::from([(0, Epoch(1))]));
        // Restarted: its active lane moves on, the releasing one and the
        // other node's lane do not.
        assert!(s.apply(5, &inc("b")).ok);
        assert_eq!(s.active_lanes(1), BTreeMap::from([(0, Epoch(2))]));
        assert_eq!(
            s.releasing_lanes(1)[&1],
            Releasing {
                epoch: Epoch(1),
                to: 2,
                at: Some(3)
            }
        );
        assert_eq!(s.active_lanes(2), BTreeMap::from([(2, Epoch(1))]));
        assert!(s.apply(6, &inc("b")).ok);
        assert_eq!(s.active_lanes(1), BTreeMap::from([(0, Epoch(2))]));
    }

    #[test]
    fn release_gives_the_target_epoch_plus_one() {
        let mut s = ClusterState::new(2);
        let changes = vec![
            Change::Assign {
                lane: 1,
                to: 1,
                epoch: Epoch(1),
            },
            Change::Handover {
                lane: 1,
                from: 1,
                to: 2,
            },
        ];
        s.apply(1, &Command::Apply { changes });
        assert_eq!(
            s.releasing_lanes(1)[&1],
            Releasing {
                epoch: Epoch(1),
                to: 2,
                at: Some(1)
            }
        );
        assert!(!s.apply(2, &Command::Release { lane: 1, from: 2 }).ok);
        assert!(s.apply(3, &Command::Release { lane: 1, from: 1 }).ok);
        assert_eq!(s.active_lanes(2), BTreeMap::from([(1, Epoch(2))]));
        assert!(!s.apply(4, &Command::Release { lane: 9, from: 1 }).ok);
    }

    /// A release sent for a handover that was cancelled meanwhile (its
    /// node's view was behind) must not end a later handover of the same
    /// lane at the same epoch: the node may have run a new owner in
    /// between, which nobody drained.
    #[test]
    fn a_release_of_a_cancelled_handover_does_not_end_the_next_one() {
        let mut s = ClusterState::new(2);
        let planned = |changes| Command::ApplyPlanned {
            changes,
            planned_at: 0,
        };
        let assign = Change::Assign {
            lane: 1,
            to: 1,
            epoch: Epoch(1),
        };
        let handover = Change::Handover {
            lane: 1,
            from: 1,
            to: 2,
        };
        assert!(s.apply(1, &planned(vec![assign])).ok);
        assert!(s.apply(2, &planned(vec![handover])).ok);
        let first = s.releasing_lanes(1)[&1];
        assert!(
            s.apply(3, &planned(vec![Change::CancelHandover { lane: 1 }]))
                .ok
        );
        assert!(s.apply(4, &planned(vec![handover])).ok);
        let second = s.releasing_lanes(1)[&1];
        assert_eq!((first.epoch, second.epoch), (Epoch(1), Epoch(1)));
        assert!(!s.apply(5, &release_of(1, 1, first)).ok);
        assert_eq!(
            s.lanes[1].owner,
            Some(1),
            "the stale release moved the lane"
        );
        assert!(s.apply(6, &release_of(1, 1, second)).ok);
        assert_eq!(s.active_lanes(2), BTreeMap::from([(1, Epoch(2))]));
    }

    fn release_of(lane: u16, from: NodeId, handover: Releasing) -> Command {
        Command::ReleaseHandover {
            lane,
            from,
            at: handover.at,
        }
    }

    /// The Raft log keeps commands in bincode, which numbers variants in
    /// declaration order: the variants of earlier versions keep their
    /// numbers, so entries they wrote still read back as the same command.
    #[test]
    fn command_variants_keep_their_bincode_numbers() {
        let number = |c: &Command| crate::storage::encode(c).expect("encode")[0];
        assert_eq!(number(&Command::Forget { node: 1 }), 2);
        assert_eq!(number(&Command::RenewLease { node: 1 }), 3);
        assert_eq!(number(&Command::Release { lane: 1, from: 2 }), 6);
        assert_eq!(
            number(&Command::Refence {
                node: 1,
                lanes: vec![]
            }),
            7
        );
        assert_eq!(number(&Command::ReleaseLease { node: 1 }), 8);
        assert_eq!(
            number(&Command::ApplyPlanned {
                changes: vec![],
                planned_at: 0
            }),
            9
        );
        assert_eq!(
            number(&Command::ReleaseHandover {
                lane: 1,
                from: 2,
                at: None
            }),
            10
        );
        let back: Command = crate::storage::decode(&[6, 1, 2]).expect("decode");
        assert_eq!(back, Command::Release { lane: 1, from: 2 });
        // Lane states and changes likewise (snapshots keep the lane table).
        let state = |s: LaneState| crate::storage::encode(&s).expect("encode")[0];
        assert_eq!(state(LaneState::Releasing { to: 2 }), 2);
        assert_eq!(state(LaneState::Handover { to: 2, at: 5 }), 3);
        let change = |c: Change| crate::storage::encode(&c).expect("encode")[0];
        let (lane, from, to) = (1, 2, 3);
        assert_eq!(change(Change::LegacyHandover { lane, from, to }), 1);
        assert_eq!(change(Change::CancelHandover { lane }), 2);
        assert_eq!(change(Change::Handover { lane, from, to }), 3);
    }

    /// Entries and snapshots older versions wrote: their `Release` ends
    /// whichever handover is under way; their handover entries are applied
    /// without an index (as they applied them: every node ends with the
    /// same state, whichever version applied the entry), and a handover
    /// without an index is released by a release naming none (and only by
    /// that).
    #[test]
    fn releases_and_handovers_of_older_versions_still_apply() {
        let mut s = ClusterState::new(3);
        for lane in [0, 1, 2] {
            s.lanes[lane] = LaneEntry {
                owner: Some(1),
                epoch: Epoch(3),
                state: LaneState::Active,
            };
        }
        // A handover of `lane` from 1 to 2 as older versions encoded it.
        let legacy =
            |lane: u8| -> Change { crate::storage::decode(&[1, lane, 1, 2]).expect("decode") };
        let changes = vec![legacy(0)];
        s.apply(4, &Command::Apply { changes });
        assert_eq!(s.lanes[0].state, LaneState::Releasing { to: 2 });
        assert!(s.apply(5, &Command::Release { lane: 0, from: 1 }).ok);
        assert_eq!(s.active_lanes(2), BTreeMap::from([(0, Epoch(4))]));

        // A snapshot's handover without an index, and a legacy entry.
        s.lanes[1].state = LaneState::Releasing { to: 2 };
        let planned = Command::ApplyPlanned {
            changes: vec![legacy(2)],
            planned_at: 5,
        };
        s.apply(6, &planned);
        let named = |lane, at| Command::ReleaseHandover { lane, from: 1, at };
        for (lane, index) in [(1, 7), (2, 9)] {
            assert_eq!(s.releasing_lanes(1)[&lane].at, None);
            assert!(!s.apply(index, &named(lane, Some(6))).ok);
            assert!(s.apply(index + 1, &named(lane, None)).ok);
            assert_eq!(s.lanes[usize::from(lane)].owner, Some(2));
        }
    }

    /// The leader judged node 1 dead on the renewals applied up to index 5
    /// and planned its lane away; node 1's renewal (sent before its lease
    /// ran out) was applied at index 6, before the plan: lane 0 stays with
    /// node 1 at its epoch. An unowned lane of the same plan is assigned,
    /// and a plan whose lane moved meanwhile (epoch) changes nothing.
    #[test]
    fn an_assign_planned_before_the_owner_renewed_moves_nothing() {
        let mut s = ClusterState::new(3);
        add(&mut s, 1);
        add(&mut s, 2);
        assert!(s.apply(3, &Command::RenewLease { node: 1 }).ok);
        let first = Command::Apply {
            changes: vec![Change::Assign {
                lane: 0,
                to: 1,
                epoch: Epoch(1),
            }],
        };
        assert!(s.apply(4, &first).ok);
        assert!(s.apply(5, &Command::RenewLease { node: 2 }).ok);
        let plan = assignment::plan(&s.lanes, &BTreeSet::from([2]));
        assert!(
            plan.contains(&Change::Assign {
                lane: 0,
                to: 2,
                epoch: Epoch(2)
            }),
            "{plan:?}"
        );
        assert!(s.apply(6, &Command::RenewLease { node: 1 }).ok);
        let planned = Command::ApplyPlanned {
            changes: plan.clone(),
            planned_at: 5,
        };
        assert!(s.apply(7, &planned).ok);
        assert_eq!(
            s.lanes[0],
            LaneEntry {
                owner: Some(1),
                epoch: Epoch(1),
                state: LaneState::Active
            },
            "the renewed owner keeps its lane and epoch"
        );
        assert_eq!(
            s.active_lanes(2),
            BTreeMap::from([(1, Epoch(1)), (2, Epoch(1))])
        );

        // Planned at or after the renewal: node 1 is dead, the lane moves.
        let moved = Command::ApplyPlanned {
            changes: plan.clone(),
            planned_at: 7,
        };
        assert!(s.apply(8, &moved).ok);
        assert_eq!(
            s.active_lanes(2),
            BTreeMap::from([(0, Epoch(2)), (1, Epoch(1)), (2, Epoch(1))])
        );
        // The same plan again: the lanes are past the planned epochs.
        assert!(s.apply(9, &moved).ok);
        assert_eq!(
            s.active_lanes(2),
            BTreeMap::from([(0, Epoch(2)), (1, Epoch(1)), (2, Epoch(1))])
        );
    }

    #[test]
    fn a_released_lease_counts_as_never_renewed_until_the_next_renewal() {
        let mut s = ClusterState::new(4);
        assert!(add(&mut s, 7).ok);
        assert!(
            !s.apply(2, &Command::ReleaseLease { node: 8 }).ok,
            "members only"
        );
        assert!(s.apply(3, &Command::RenewLease { node: 7 }).ok);
        assert!(s.apply(4, &Command::ReleaseLease { node: 7 }).ok);
        assert_eq!(s.leases[&7].renewals, 0, "not live");
        assert!(s.apply(5, &Command::RenewLease { node: 7 }).ok);
        assert_eq!(s.leases[&7].renewals, 1, "live again after a renewal");
    }
}
