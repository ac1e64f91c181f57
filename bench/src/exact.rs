//! The exactness check after every sample (DESIGN.md section 2): lost,
//! duplicated, out of order per (handler, key), dead; and for publish
//! samples, exactly events × matching handlers deliveries.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

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
    /// Hand-overs out of publish order within their (handler, key).
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
    let mut seen: HashSet<(u16, &str)> = HashSet::with_capacity(handled.len());
    let mut next: HashMap<(u16, &str), i64> = HashMap::new();
    let mut duplicated = 0i64;
    let mut out_of_order = 0i64;
    for h in handled {
        if !seen.insert((h.handler, &h.event)) {
            duplicated += 1;
            continue;
        }
        if let (Some(key), Some(seq)) = (&h.key, h.seq) {
            let want = next.entry((h.handler, key)).or_insert(1);
            if seq != *want {
                out_of_order += 1;
            }
            *want = seq.max(*want) + 1;
        }
    }
    let total = held.completed + held.pending + held.dead;
    Exactness {
        expected,
        held,
        handled: handled.len() as u64,
        lost: (expected - total).max(0),
        duplicated: duplicated + (total - expected).max(0),
        out_of_order,
        dead: held.dead,
    }
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
        // Dead letters make a sample invalid even when nothing is lost.
        let e = check(&[], held(1, 0, 1), 2);
        assert_eq!(e.problems(), vec!["1 dead".to_string()]);
    }
}
