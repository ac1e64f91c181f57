//! The lane assignment policy: which node should own which lane.
//!
//! The leader calls [`plan`] with the replicated lane table and the set of
//! live nodes (those whose lease has not expired by the leader's clock, see
//! [`crate::lease`]) and proposes the returned changes through Raft. The
//! policy is:
//!
//! - **balanced**: every live node ends with `L / n` or `L / n + 1` lanes;
//! - **sticky**: a lane moves only if its owner is gone or owns more than its
//!   quota; nodes that already own more lanes keep the `+ 1` slots, so a
//!   change of membership moves the fewest lanes it can;
//! - **graceful for planned moves**: a lane owned by a live node is not taken
//!   from it but handed over ([`Change::Handover`]: the owner stops claiming,
//!   drains with a bound, releases; then [`apply_release`] gives the new owner
//!   `epoch + 1`); a lane without a live owner is assigned at once
//!   ([`Change::Assign`], `epoch + 1`).
//!
//! Deterministic: the same table and live set give the same plan on any node.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::{Epoch, NodeId};

/// Where a lane is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LaneState {
    /// No owner.
    Unassigned,
    /// Owned and worked by `owner`.
    Active,
    /// A handover without the log index it was applied at: recorded by an
    /// older version, or from a [`Change::LegacyHandover`] an older version
    /// wrote. Handled as [`LaneState::Handover`] with no index
    /// ([`LaneState::handover`]); its release names no index.
    Releasing {
        /// The next owner.
        to: NodeId,
    },
    /// `owner` is handing the lane over to `to` (stops claiming, drains).
    /// `at` (the log index the handover was applied at) names this
    /// handover: a release names the handover it ends
    /// ([`apply_release`]), so a release meant for a cancelled handover
    /// cannot end a later one of the same lane at the same epoch.
    Handover {
        /// The next owner.
        to: NodeId,
        /// Log index the handover was applied at.
        at: u64,
    },
}

impl LaneState {
    /// The handover under way, if any: the next owner and the log index
    /// the handover was applied at (`None` for one an older version
    /// recorded).
    pub fn handover(self) -> Option<(NodeId, Option<u64>)> {
        match self {
            LaneState::Releasing { to } => Some((to, None)),
            LaneState::Handover { to, at } => Some((to, Some(at))),
            LaneState::Unassigned | LaneState::Active => None,
        }
    }
}

/// One row of the replicated lane table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneEntry {
    /// Current owner, if any.
    pub owner: Option<NodeId>,
    /// Fencing token: grows at every change of owner.
    pub epoch: Epoch,
    /// Lifecycle state.
    pub state: LaneState,
}

impl LaneEntry {
    /// A lane nobody owns yet, at epoch 0.
    pub const UNASSIGNED: LaneEntry = LaneEntry {
        owner: None,
        epoch: Epoch::ZERO,
        state: LaneState::Unassigned,
    };
}

/// A change the leader proposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// The lane has no live owner: `to` owns it now, at `epoch`.
    Assign {
        /// Lane number.
        lane: u16,
        /// New owner.
        to: NodeId,
        /// New epoch (previous + 1).
        epoch: Epoch,
    },
    /// [`Change::Handover`] as older versions wrote it: applied as a
    /// handover without its log index ([`LaneState::Releasing`]), on every
    /// node whatever its version, so that every node applies the same
    /// entry to the same state.
    LegacyHandover {
        /// Lane number.
        lane: u16,
        /// Current owner.
        from: NodeId,
        /// Next owner.
        to: NodeId,
    },
    /// The target of a handover is gone: the lane stays with its owner.
    CancelHandover {
        /// Lane number.
        lane: u16,
    },
    /// The live owner `from` is asked to hand the lane over to `to`;
    /// recorded with the log index it is applied at
    /// ([`LaneState::Handover`]). Only this version writes it, so only this
    /// version applies it: the index never depends on which version applied
    /// the entry.
    Handover {
        /// Lane number.
        lane: u16,
        /// Current owner.
        from: NodeId,
        /// Next owner.
        to: NodeId,
    },
}

impl Change {
    /// The lane the change is about.
    pub fn lane(self) -> u16 {
        match self {
            Change::Assign { lane, .. }
            | Change::LegacyHandover { lane, .. }
            | Change::CancelHandover { lane }
            | Change::Handover { lane, .. } => lane,
        }
    }
}

/// The node a lane counts for when balancing: the target of a handover in
/// progress (its owner still alive to release it), else the alive owner;
/// `None` for an orphan. A handover whose owner died counts as an orphan: it
/// will never be released, and the owner has stopped by its own lease.
fn effective_owner(
    entry: &LaneEntry,
    live: &BTreeSet<NodeId>,
    draining: &BTreeSet<NodeId>,
) -> Option<NodeId> {
    let alive = |n: &NodeId| live.contains(n) || draining.contains(n);
    let owner = entry.owner.filter(alive)?;
    match entry.state.handover() {
        Some((to, _)) if live.contains(&to) => Some(to),
        Some(_) => Some(owner),
        None => (entry.state == LaneState::Active).then_some(owner),
    }
}

/// Plans the changes that balance `lanes` over `live` nodes (see the module
/// docs). Returns nothing when `live` is empty or the table is balanced.
/// Lanes in a handover whose target is live are left alone.
pub fn plan(lanes: &[LaneEntry], live: &BTreeSet<NodeId>) -> Vec<Change> {
    plan_draining(lanes, live, &BTreeSet::new())
}

/// [`plan`] with nodes being removed on purpose: `draining` nodes are alive
/// (their lanes are not orphans, so they are handed over gracefully rather
/// than assigned at once) but their quota is zero, and no lane is handed to
/// them. A node in both sets counts as draining.
pub fn plan_draining(
    lanes: &[LaneEntry],
    live: &BTreeSet<NodeId>,
    draining: &BTreeSet<NodeId>,
) -> Vec<Change> {
    let live: BTreeSet<NodeId> = live.difference(draining).copied().collect();
    let live = &live;
    if live.is_empty() || lanes.is_empty() {
        return Vec::new();
    }
    let mut owned: BTreeMap<NodeId, Vec<u16>> = live
        .iter()
        .chain(draining)
        .map(|&n| (n, Vec::new()))
        .collect();
    let mut orphans = Vec::new();
    for (lane, entry) in lanes.iter().enumerate() {
        match effective_owner(entry, live, draining) {
            Some(node) => owned.get_mut(&node).expect("alive node").push(lane as u16),
            None => orphans.push(lane as u16),
        }
    }

    // Quotas: the nodes owning most keep the `+ 1` slots (stickiness).
    let n = live.len();
    let (base, extra) = (lanes.len() / n, lanes.len() % n);
    let mut by_count: Vec<NodeId> = live.iter().copied().collect();
    by_count.sort_by_key(|node| (std::cmp::Reverse(owned[node].len()), *node));
    let quota: BTreeMap<NodeId, usize> = by_count
        .iter()
        .enumerate()
        .map(|(i, &node)| (node, base + usize::from(i < extra)))
        .chain(draining.iter().map(|&node| (node, 0)))
        .collect();

    // Surplus of over-quota nodes: only active lanes move, highest first.
    let mut surplus: Vec<(u16, NodeId)> = Vec::new();
    for (&node, node_lanes) in &owned {
        let over = node_lanes.len().saturating_sub(quota[&node]);
        let movable = node_lanes.iter().rev().filter(|&&l| {
            lanes[l as usize].state == LaneState::Active && lanes[l as usize].owner == Some(node)
        });
        surplus.extend(movable.take(over).map(|&l| (l, node)));
    }
    surplus.sort_unstable();

    // Receivers in order of need (fewest lanes first, then id).
    let mut counts: BTreeMap<NodeId, usize> =
        owned.iter().map(|(&node, l)| (node, l.len())).collect();
    let next_receiver = |counts: &mut BTreeMap<NodeId, usize>| -> Option<NodeId> {
        let node = counts
            .iter()
            .filter(|(node, &c)| c < quota[*node] && live.contains(*node))
            .min_by_key(|(node, &c)| (c, **node))
            .map(|(&node, _)| node)?;
        *counts.get_mut(&node).expect("known node") += 1;
        Some(node)
    };

    let mut changes: Vec<Change> = lanes
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            e.state
                .handover()
                .is_some_and(|(to, _)| !live.contains(&to))
                && e.owner
                    .is_some_and(|o| live.contains(&o) || draining.contains(&o))
        })
        .map(|(lane, _)| Change::CancelHandover { lane: lane as u16 })
        .collect();
    for lane in orphans {
        let Some(to) = next_receiver(&mut counts) else {
            break;
        };
        changes.push(Change::Assign {
            lane,
            to,
            epoch: lanes[lane as usize].epoch.next(),
        });
    }
    for (lane, from) in surplus {
        let Some(to) = next_receiver(&mut counts) else {
            break;
        };
        *counts.get_mut(&from).expect("known node") -= 1;
        changes.push(Change::Handover { lane, from, to });
    }
    changes
}

/// Applies a planned change to the table (what the Raft state machine does)
/// at log index `index` (which names a handover it starts).
pub fn apply(lanes: &mut [LaneEntry], change: Change, index: u64) {
    match change {
        Change::Assign { lane, to, epoch } => {
            let e = &mut lanes[lane as usize];
            *e = LaneEntry {
                owner: Some(to),
                epoch: epoch.max(e.epoch.next()),
                state: LaneState::Active,
            };
        }
        Change::Handover { lane, from, to } => {
            let e = &mut lanes[lane as usize];
            if e.owner == Some(from) && e.state == LaneState::Active {
                e.state = LaneState::Handover { to, at: index };
            }
        }
        Change::LegacyHandover { lane, from, to } => {
            let e = &mut lanes[lane as usize];
            if e.owner == Some(from) && e.state == LaneState::Active {
                e.state = LaneState::Releasing { to };
            }
        }
        Change::CancelHandover { lane } => {
            let e = &mut lanes[lane as usize];
            if e.state.handover().is_some() {
                e.state = LaneState::Active;
            }
        }
    }
}

/// The old owner has drained `lane` and releases the handover applied at
/// log index `at` (`None`: one an older version recorded, see
/// [`LaneState::handover`]): the handover target owns it at `epoch + 1`.
/// Returns `false` (and changes nothing) if the lane is not being released
/// by `from` in that handover.
pub fn apply_release(lanes: &mut [LaneEntry], lane: u16, from: NodeId, at: Option<u64>) -> bool {
    let e = &mut lanes[lane as usize];
    match (e.owner, e.state.handover()) {
        (Some(owner), Some((to, this))) if owner == from && this == at => {
            *e = LaneEntry {
                owner: Some(to),
                epoch: e.epoch.next(),
                state: LaneState::Active,
            };
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    /// Applies a plan completely (handovers released at once).
    fn settle(lanes: &mut [LaneEntry], alive: &BTreeSet<NodeId>) -> Vec<Change> {
        let changes = plan(lanes, alive);
        for &c in &changes {
            apply(lanes, c, 7);
            if let Change::Handover { lane, from, .. } = c {
                assert!(apply_release(lanes, lane, from, Some(7)));
            }
        }
        changes
    }

    fn counts(lanes: &[LaneEntry]) -> BTreeMap<NodeId, usize> {
        let mut m = BTreeMap::new();
        for e in lanes {
            *m.entry(e.owner.expect("owned")).or_default() += 1;
        }
        m
    }

    #[test]
    fn first_node_gets_every_lane_then_three_nodes_balance() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 256];
        settle(&mut lanes, &live(&[1]));
        assert_eq!(counts(&lanes)[&1], 256);
        assert!(lanes.iter().all(|e| e.epoch == Epoch(1)));

        let changes = settle(&mut lanes, &live(&[1, 2, 3]));
        let c = counts(&lanes);
        assert_eq!(c.values().sum::<usize>(), 256);
        assert!(
            c.values().max().unwrap() - c.values().min().unwrap() <= 1,
            "{c:?}"
        );
        // Only what node 1 must give away moves, and gracefully.
        assert_eq!(changes.len(), 256 - c[&1]);
        assert!(changes
            .iter()
            .all(|c| matches!(c, Change::Handover { from: 1, .. })));
        assert!(
            plan(&lanes, &live(&[1, 2, 3])).is_empty(),
            "balanced table plans nothing"
        );
    }

    #[test]
    fn dead_node_lanes_are_assigned_at_once_and_nothing_else_moves() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 256];
        settle(&mut lanes, &live(&[1, 2, 3]));
        let before = lanes.clone();
        let changes = settle(&mut lanes, &live(&[1, 3]));
        for c in &changes {
            match *c {
                Change::Assign { lane, epoch, .. } => {
                    assert_eq!(before[lane as usize].owner, Some(2));
                    assert_eq!(epoch, before[lane as usize].epoch.next());
                }
                _ => panic!("no live owner should lose a lane: {c:?}"),
            }
        }
        for (b, a) in before.iter().zip(&lanes) {
            if b.owner != Some(2) {
                assert_eq!(b, a, "a lane of a live node moved");
            }
        }
        assert_eq!(counts(&lanes), BTreeMap::from([(1, 128), (3, 128)]));
    }

    #[test]
    fn fourth_node_takes_about_a_quarter_by_handover() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 256];
        settle(&mut lanes, &live(&[1, 2, 3]));
        let changes = settle(&mut lanes, &live(&[1, 2, 3, 4]));
        assert_eq!(changes.len(), 64);
        assert!(changes
            .iter()
            .all(|c| matches!(c, Change::Handover { to: 4, .. })));
        assert_eq!(counts(&lanes)[&4], 64);
    }

    #[test]
    fn lanes_in_handover_are_left_alone_and_release_bumps_epoch() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 4];
        settle(&mut lanes, &live(&[1]));
        let changes = plan(&lanes, &live(&[1, 2]));
        assert_eq!(changes.len(), 2);
        for &c in &changes {
            apply(&mut lanes, c, 7);
        }
        // While the handovers are in progress, nothing more is planned.
        assert!(plan(&lanes, &live(&[1, 2])).is_empty());
        let Change::Handover { lane, from, to } = changes[0] else {
            panic!()
        };
        assert!(
            !apply_release(&mut lanes, lane, to, Some(7)),
            "only the releasing owner can release"
        );
        assert!(
            !apply_release(&mut lanes, lane, from, Some(6)),
            "a release names its handover"
        );
        assert!(apply_release(&mut lanes, lane, from, Some(7)));
        assert_eq!(
            lanes[lane as usize],
            LaneEntry {
                owner: Some(to),
                epoch: Epoch(2),
                state: LaneState::Active
            }
        );
    }

    #[test]
    fn handover_to_a_dead_target_is_replanned() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 4];
        settle(&mut lanes, &live(&[1]));
        for c in plan(&lanes, &live(&[1, 2])) {
            apply(&mut lanes, c, 7);
        }
        // Node 2 died before the release: the handovers are cancelled and
        // node 1 keeps its lanes.
        let changes = plan(&lanes, &live(&[1]));
        assert_eq!(
            changes,
            vec![
                Change::CancelHandover { lane: 2 },
                Change::CancelHandover { lane: 3 }
            ]
        );
        for c in changes {
            apply(&mut lanes, c, 7);
        }
        assert!(lanes
            .iter()
            .all(|e| e.state == LaneState::Active && e.owner == Some(1)));
        assert!(plan(&lanes, &live(&[1])).is_empty());
    }

    #[test]
    fn handover_whose_owner_died_is_assigned_at_once() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 4];
        settle(&mut lanes, &live(&[1]));
        for c in plan(&lanes, &live(&[1, 2])) {
            apply(&mut lanes, c, 7);
        }
        // Node 1 died while handing lanes 2 and 3 over: it will never
        // release them, so they are assigned (epoch + 1) without waiting.
        let changes = plan(&lanes, &live(&[2]));
        let assigned: Vec<_> = changes
            .iter()
            .filter_map(|c| match *c {
                Change::Assign { lane, to: 2, epoch } => Some((lane, epoch.0)),
                _ => None,
            })
            .collect();
        assert_eq!(
            assigned,
            vec![(0, 2), (1, 2), (2, 2), (3, 2)],
            "{changes:?}"
        );
    }

    #[test]
    fn draining_node_hands_everything_over_and_receives_nothing() {
        let mut lanes = vec![LaneEntry::UNASSIGNED; 9];
        settle(&mut lanes, &live(&[1, 2, 3]));
        let draining = live(&[2]);
        let changes = plan_draining(&lanes, &live(&[1, 2, 3]), &draining);
        assert_eq!(changes.len(), 3, "{changes:?}");
        assert!(changes
            .iter()
            .all(|c| matches!(c, Change::Handover { from: 2, to, .. } if *to != 2)));
        for &c in &changes {
            apply(&mut lanes, c, 7);
        }
        assert!(plan_draining(&lanes, &live(&[1, 3]), &draining).is_empty());
        for c in changes {
            if let Change::Handover { lane, from, .. } = c {
                assert!(apply_release(&mut lanes, lane, from, Some(7)));
            }
        }
        let c = counts(&lanes);
        assert_eq!(c.get(&2), None);
        assert!(plan_draining(&lanes, &live(&[1, 3]), &draining).is_empty());
    }

    #[test]
    fn no_live_nodes_plans_nothing() {
        assert!(plan(&[LaneEntry::UNASSIGNED; 8], &BTreeSet::new()).is_empty());
    }
}
