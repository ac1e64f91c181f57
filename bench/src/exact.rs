//! The exactness check after every sample (docs/design.md section 2): lost,
//! duplicated, out of order per (handler, key), dead; and for publish
//! samples, exactly events × matching handlers deliveries.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use lanebus_testkit::invariants::{self, Cause, Causes, Earlier, HandOver, Model, Repeat};
use serde::{Deserialize, Serialize};

/// One hand-over seen by an in-process bench handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled {
    /// Handler index (0..fan-out).
    pub handler: u16,
    /// Event id.
    pub event: Arc<str>,
    /// Ordering key.
    pub key: Option<Arc<str>>,
    /// Position within the key.
    pub seq: Option<i64>,
}

/// What the store holds after the sample (the node stopped).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    /// Completion rows.
    pub completed: i64,
    /// Pending deliveries.
    pub pending: i64,
    /// Dead letters.
    pub dead: i64,
}

/// The verdict of one sample.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Exactness {
    /// Deliveries the accepted events must have created (events × handlers).
    pub expected: i64,
    /// What the store holds.
    pub held: Held,
    /// Hand-overs seen by the handlers.
    pub handled: u64,
    /// Deliveries neither completed, pending nor dead.
    pub lost: i64,
    /// Hand-overs of an (event, handler) already handed over (a single node
    /// never loses its lease, so every repeat is unexplained), plus
    /// deliveries the store holds beyond `expected`.
    pub duplicated: i64,
    /// Repeats explained by a lane that changed owner (cluster cells: see
    /// [`moved_repeats`]); not counted in `duplicated`.
    pub moved_repeats: i64,
    /// Hand-overs out of publish order within their (handler, key): a
    /// first hand-over before every earlier position was handed over (a
    /// gap) or after a later one, or a repeat after a later position
    /// without a change of owner.
    pub out_of_order: i64,
    /// Dead letters (no-op handlers never fail).
    pub dead: i64,
}

impl Exactness {
    /// Why the sample is invalid; empty when it is valid.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        for (n, what) in [
            (self.lost, "lost"),
            (self.duplicated, "duplicated"),
            (self.out_of_order, "out of order"),
            (self.dead, "dead"),
        ] {
            if n != 0 {
                p.push(format!("{n} {what}"));
            }
        }
        p
    }
}

/// Checks what the handlers saw and what the store holds against
/// `expected` deliveries. Keys are numbered from 1 in a fresh store, so the
/// hand-overs of one (handler, key) must be exactly 1, 2, 3, ... in order.
pub fn check(handled: &[Handled], held: Held, expected: i64) -> Exactness {
    check_moved(handled, held, expected, &HashSet::new())
}

/// [`check`] where the hand-overs at the indices in `moved` (from
/// [`moved_repeats`]) are repeats a lane's change of owner explains: they
/// count as `moved_repeats`, not as `duplicated`.
///
/// Judged by the one checker ([`lanebus_testkit::invariants`]): the
/// hand-overs in log order, positions dense from 1 per (handler, key)
/// ([`Earlier::Dense`]: a gap is disorder), a repeat's only cause a change
/// of owner. Loss and extra deliveries come from the store's counters
/// against `expected` (the bench knows how many events were accepted, not
/// which).
pub fn check_moved(
    handled: &[Handled],
    held: Held,
    expected: i64,
    moved: &HashSet<usize>,
) -> Exactness {
    let model = Model {
        expected: Vec::new(),
        observed: handled
            .iter()
            .enumerate()
            .map(|(i, h)| HandOver {
                handler: h.handler.to_string(),
                event: h.event.to_string(),
                key: h.key.as_deref().map(str::to_owned),
                position: h.key.as_ref().and(h.seq),
                attempt: 1,
                sender: None,
                arrived_ms: i as f64,
                accepted_ms: Some(i as f64),
                until_ms: i as f64,
            })
            .collect(),
        earlier: Earlier::Dense,
    };
    let causes = Moved(moved);
    let repeats = invariants::repeats(&model, &causes);
    let order = invariants::order(&model, &causes);
    let total = held.completed + held.pending + held.dead;
    Exactness {
        expected,
        held,
        handled: handled.len() as u64,
        lost: (expected - total).max(0),
        duplicated: repeats.unattributed.len() as i64 + (total - expected).max(0),
        moved_repeats: repeats.with(Cause::OwnerChange) as i64,
        out_of_order: order.disorder.len() as i64,
        dead: held.dead,
    }
}

/// The bench's causes: a repeat (or a rewind) is explained only by a
/// change of its lane's owner, the indices [`moved_repeats`] found; a
/// single node never loses its lease.
struct Moved<'a>(&'a HashSet<usize>);

impl Causes for Moved<'_> {
    fn repeat(&self, _: &Model, r: &Repeat) -> Option<Cause> {
        self.0.contains(&r.q).then_some(Cause::OwnerChange)
    }

    fn rewind(&self, _: &Model, r: &Repeat) -> bool {
        self.0.contains(&r.q)
    }
}

/// Where a hand-over of a cluster sample came from: the node (cluster id)
/// that handed it over and the delivery's lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// Cluster id of the node.
    pub node: u64,
    /// The delivery's lane.
    pub lane: u16,
}

/// The hand-overs (indices into `handled`, `origins` alongside) that repeat
/// an (event, handler) because its lane changed owner in between: the
/// repeat comes from another node, on the same lane, and that lane's owners
/// (`owners`: each lane's owners in the order they were seen, one entry per
/// change) show the earlier hand-over's node before the repeat's node. Each
/// repeat needs its own change of owner. Every other repeat is unexplained:
/// docs/design.md invariant 3 allows a repeat only across a lease loss or a
/// handover, and neither happens without a change of owner.
pub fn moved_repeats(
    handled: &[Handled],
    origins: &[Origin],
    owners: &HashMap<u16, Vec<u64>>,
) -> HashSet<usize> {
    let mut by: HashMap<(u16, &str), Vec<usize>> = HashMap::new();
    for (i, h) in handled.iter().enumerate() {
        by.entry((h.handler, &h.event)).or_default().push(i);
    }
    let mut out = HashSet::new();
    for idx in by.values().filter(|v| v.len() > 1) {
        let Some(first) = origins.get(idx[0]) else {
            continue;
        };
        let Some(history) = owners.get(&first.lane) else {
            continue;
        };
        // Position in the lane's history of the owner that handed over last.
        let Some(mut at) = history.iter().position(|&o| o == first.node) else {
            continue;
        };
        let mut prev = *first;
        for &i in &idx[1..] {
            let Some(o) = origins.get(i) else { break };
            if o.lane != prev.lane || o.node == prev.node {
                continue;
            }
            if let Some(p) = history[at + 1..].iter().position(|&n| n == o.node) {
                out.insert(i);
                at += 1 + p;
                prev = *o;
            }
        }
    }
    out
}

/// Whether the backlog of a dispatch sample had drained by `end`, the end
/// of the steady window: every one of the `expected` (event, handler)
/// deliveries had been handed over to its handler by then (repeats counted
/// once), so the handlers ran out of work inside the window and its rate
/// understates the dispatcher (the sample is invalid: preload more).
///
/// Judged on the hand-overs and their times, not on what the store holds
/// after the node stopped: a graceful shutdown completes every buffered
/// delivery (up to 256 lanes × the lane buffer), so a backlog still
/// non-empty at the end of the window could read as drained there.
pub fn drained_by(handled: &[(Handled, Instant)], end: Instant, expected: i64) -> bool {
    let seen: HashSet<(u16, &str)> = handled
        .iter()
        .filter(|(_, at)| *at <= end)
        .map(|(h, _)| (h.handler, &*h.event))
        .collect();
    seen.len() as i64 >= expected
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(handler: u16, event: &str, key: Option<&str>, seq: Option<i64>) -> Handled {
        Handled {
            handler,
            event: event.into(),
            key: key.map(Into::into),
            seq,
        }
    }

    fn held(completed: i64, pending: i64, dead: i64) -> Held {
        Held {
            completed,
            pending,
            dead,
        }
    }

    #[test]
    fn a_clean_sample_is_valid() {
        let log = [
            h(0, "a", Some("k"), Some(1)),
            h(1, "a", Some("k"), Some(1)),
            h(0, "b", Some("k"), Some(2)),
            h(0, "c", None, None),
        ];
        let e = check(&log, held(4, 2, 0), 6);
        assert!(e.problems().is_empty(), "{e:?}");
        assert_eq!(e.handled, 4);
    }

    #[test]
    fn loss_repeats_order_and_dead_are_each_reported() {
        // Store holds one delivery fewer than expected: lost.
        assert_eq!(check(&[], held(2, 0, 0), 3).lost, 1);
        // Same (event, handler) twice: duplicated; another handler is not a repeat.
        let log = [
            h(0, "a", None, None),
            h(1, "a", None, None),
            h(0, "a", None, None),
        ];
        assert_eq!(check(&log, held(2, 0, 0), 2).duplicated, 1);
        // Store holds more than expected (a publish created extra rows).
        assert_eq!(check(&[], held(0, 5, 0), 4).duplicated, 1);
        // Key order: 2 before 1, and a gap (1, 3) are both out of order.
        let log = [h(0, "b", Some("k"), Some(2)), h(0, "a", Some("k"), Some(1))];
        assert_eq!(check(&log, held(2, 0, 0), 2).out_of_order, 2);
        let log = [h(0, "a", Some("k"), Some(1)), h(0, "c", Some("k"), Some(3))];
        let e = check(&log, held(2, 1, 0), 3);
        assert_eq!(e.out_of_order, 1);
        // Order is per (handler, key): interleaving keys and handlers is fine.
        let log = [
            h(0, "a", Some("k"), Some(1)),
            h(0, "x", Some("j"), Some(1)),
            h(1, "a", Some("k"), Some(1)),
            h(0, "b", Some("k"), Some(2)),
        ];
        assert_eq!(check(&log, held(4, 0, 0), 4).out_of_order, 0);
        // A repeat after a later position of its key is a duplicate and
        // out of order, unless a change of owner explains it (a rewind).
        let log = [
            h(0, "a", Some("k"), Some(1)),
            h(0, "b", Some("k"), Some(2)),
            h(0, "a", Some("k"), Some(1)),
        ];
        let e = check(&log, held(2, 0, 0), 2);
        assert_eq!((e.duplicated, e.out_of_order), (1, 1), "{e:?}");
        let e = check_moved(&log, held(2, 0, 0), 2, &HashSet::from([2]));
        assert_eq!((e.duplicated, e.moved_repeats, e.out_of_order), (0, 1, 0));
        // Dead letters make a sample invalid even when nothing is lost.
        let e = check(&[], held(1, 0, 1), 2);
        assert_eq!(e.problems(), vec!["1 dead".to_string()]);
    }

    #[test]
    fn drained_is_judged_at_the_end_of_the_window() {
        use std::time::Duration;
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let end = at(1_000);
        // Three deliveries expected; two handed over in the window, the
        // third only after it (the shutdown's drain): not drained, even
        // though nothing is pending once the node has stopped.
        let log = vec![
            (h(0, "a", None, None), at(100)),
            (h(0, "b", None, None), at(900)),
            (h(0, "c", None, None), at(1_200)),
        ];
        assert!(!drained_by(&log, end, 3));
        // All three inside the window: drained.
        let mut early = log.clone();
        early[2].1 = at(950);
        assert!(drained_by(&early, end, 3));
        // A hand-over exactly at the end counts as inside.
        early[2].1 = end;
        assert!(drained_by(&early, end, 3));
        // A repeat counts once: a, a, b seen for three expected is not drained.
        let repeat = vec![
            (h(0, "a", None, None), at(100)),
            (h(0, "a", None, None), at(200)),
            (h(0, "b", None, None), at(300)),
        ];
        assert!(!drained_by(&repeat, end, 3));
        // The same event to two handlers is two deliveries.
        let fan = vec![
            (h(0, "a", None, None), at(100)),
            (h(1, "a", None, None), at(200)),
        ];
        assert!(drained_by(&fan, end, 2));
        assert!(!drained_by(&fan, end, 3));
    }

    #[test]
    fn repeats_are_explained_only_by_a_change_of_owner() {
        let log = [
            h(0, "a", None, None),
            h(0, "b", None, None),
            h(0, "a", None, None),
            h(0, "b", None, None),
            h(0, "c", None, None),
            h(0, "c", None, None),
        ];
        let o = |node: u64, lane: u16| Origin { node, lane };
        let origins = [o(1, 7), o(1, 8), o(2, 7), o(1, 8), o(1, 9), o(3, 9)];
        // Lane 7 went from node 1 to node 2; lane 8 stayed with node 1;
        // lane 9 went from 3 to 1 (the wrong way for c's repeat).
        let owners: HashMap<u16, Vec<u64>> =
            [(7, vec![1, 2]), (8, vec![1]), (9, vec![3, 1])].into();
        let moved = moved_repeats(&log, &origins, &owners);
        assert_eq!(moved, HashSet::from([2]));
        let e = check_moved(&log, held(3, 0, 0), 3, &moved);
        assert_eq!((e.moved_repeats, e.duplicated), (1, 2), "{e:?}");
        assert_eq!(e.problems(), vec!["2 duplicated".to_string()]);
        // One change of owner explains one repeat: 1 -> 2 -> 1 -> 2 on the
        // same lane needs the history 1, 2, 1, 2.
        let log = [
            h(0, "a", None, None),
            h(0, "a", None, None),
            h(0, "a", None, None),
        ];
        let origins = [o(1, 7), o(2, 7), o(1, 7)];
        let one: HashMap<u16, Vec<u64>> = [(7, vec![1, 2])].into();
        assert_eq!(moved_repeats(&log, &origins, &one), HashSet::from([1]));
        let back: HashMap<u16, Vec<u64>> = [(7, vec![1, 2, 1])].into();
        assert_eq!(moved_repeats(&log, &origins, &back), HashSet::from([1, 2]));
        // Without origins (one node) nothing is explained.
        assert!(moved_repeats(&log, &[], &back).is_empty());
    }
}
