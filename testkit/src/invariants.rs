//! The one invariant checker (docs/design.md section 2) that the receiver's
//! verdict, the chaos oracle and the benchmark's exactness check share.
//! Each caller translates what it saw into one [`Model`] and applies the
//! rules it needs; the causes that excuse a repeat or a rewind come from the
//! caller through [`Causes`] (chaos: the lanes' owners and epochs over time;
//! bench: the lanes' changes of owner; the receiver: failed attempts).
//!
//! ```text
//! expected: Delivery {handler, event, key, position}   ─┐
//! observed: HandOver {arrival, answer, attempt, sender} ─┼─▶ lost(), unexpected(),
//! earlier positions: Listed | Dense | Observed          ─┤   repeats(), order(),
//! causes (caller's)                                     ─┘   overlaps()
//! ```
//!
//! The rules, each a function over the model:
//! - [`lost`]: every expected delivery was accepted, or dead-lettered where
//!   the caller allows it (invariant 1);
//! - [`unexpected`]: nothing accepted that nobody expected;
//! - [`repeats`]: every hand-over of a delivery after its first has a
//!   cause (invariant 3);
//! - [`order`]: per (handler, key), the first hand-over at position p comes
//!   after every earlier position was done (accepted, or dead-lettered) and,
//!   unless p was done (a dead letter), after no later position; a repeat
//!   after a later position is a rewind, allowed only with a cause
//!   (invariant 2);
//! - [`overlaps`]: per (handler, key), or per unkeyed delivery, no
//!   hand-over arrives while an earlier one is in flight (invariant 2).
//!
//! Hand-overs are judged in arrival order (ties keep the caller's order).

use std::collections::{BTreeSet, HashMap, HashSet};

/// One expected delivery: an event for one handler its route matches.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delivery {
    /// Handler name.
    pub handler: String,
    /// Event id.
    pub event: String,
    /// Event key (`None`: unordered).
    pub key: Option<String>,
    /// Position of the event within its (handler, key), used by
    /// [`Earlier::Listed`]: the publish position.
    pub position: Option<i64>,
    /// The store holds the delivery as a dead letter: it ended without an
    /// accepted hand-over, which ends it for the key's order.
    pub dead_lettered: bool,
    /// A dead letter counts as an outcome, not a loss.
    pub dead_letter_allowed: bool,
}

/// One hand-over of a delivery to its handler (a webhook request, or an
/// in-process handler call), as observed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HandOver {
    /// Handler name.
    pub handler: String,
    /// Event id.
    pub event: String,
    /// Event key.
    pub key: Option<String>,
    /// Position within its (handler, key): the publish position
    /// ([`Earlier::Listed`]) or the `lanebus-sequence` header (the
    /// others); `None`: not ordered.
    pub position: Option<i64>,
    /// `lanebus-attempt` (0 when unknown).
    pub attempt: u32,
    /// The node that handed it over, when known.
    pub sender: Option<String>,
    /// Arrival, milliseconds on the caller's clock (or a log index).
    pub arrived_ms: f64,
    /// When it was accepted (answered 2xx), same clock; `None`: not
    /// accepted.
    pub accepted_ms: Option<f64>,
    /// End of its time in flight, same clock (`f64::INFINITY`: unknown).
    pub until_ms: f64,
}

/// Which positions of a (handler, key) must be done before the first
/// hand-over at position p.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Earlier {
    /// The expected deliveries' positions below p (the caller knows every
    /// event and its publish position).
    Listed,
    /// Every position 1 ..= p - 1 (positions are the key's sequence in a
    /// fresh store, and every event of the key matches the handler): a gap
    /// is disorder.
    Dense,
    /// The positions below p observed before the hand-over (the caller
    /// knows the sequence headers only).
    Observed,
}

/// What was expected and what was observed.
#[derive(Debug, Clone)]
pub struct Model {
    /// Expected deliveries.
    pub expected: Vec<Delivery>,
    /// Hand-overs, in any order; the indices given to [`Causes`] and found
    /// in the rules' results are into this list.
    pub observed: Vec<HandOver>,
    /// See [`Earlier`].
    pub earlier: Earlier,
}

/// Why a hand-over repeated an earlier one of the same delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Cause {
    /// The previous hand-over failed (as the receiver saw it).
    Failed,
    /// The node saw the previous hand-over fail (its attempt number grew).
    NodeSawFailure,
    /// The delivery's lane changed owner in between.
    OwnerChange,
}

/// A repeat: hand-over `q` of a delivery handed over before. Indices are
/// into [`Model::observed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repeat {
    /// The delivery's previous hand-over.
    pub prev: usize,
    /// The repeat.
    pub q: usize,
    /// The highest attempt number of the delivery before `q`.
    pub max_attempt: u32,
    /// Whether an earlier hand-over of the delivery was accepted.
    pub accepted_before: bool,
    /// For a rewind: the hand-over at the highest position of the
    /// (handler, key) so far (the latest one there).
    pub latest: Option<usize>,
}

/// The caller's causes.
pub trait Causes {
    /// The cause of a repeat, `None`: unattributed.
    fn repeat(&self, m: &Model, r: &Repeat) -> Option<Cause>;
    /// Whether a repeat that arrived after a later position of its key has
    /// a cause (a rewind); `false`: disorder.
    fn rewind(&self, m: &Model, r: &Repeat) -> bool;
}

impl Model {
    /// Indices of [`Model::observed`] in arrival order (stable).
    pub fn by_arrival(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.observed.len()).collect();
        v.sort_by(|&a, &b| {
            self.observed[a]
                .arrived_ms
                .total_cmp(&self.observed[b].arrived_ms)
        });
        v
    }

    fn expected_set(&self) -> HashSet<(&str, &str)> {
        self.expected
            .iter()
            .map(|d| (d.handler.as_str(), d.event.as_str()))
            .collect()
    }

    fn accepted_set(&self) -> HashSet<(&str, &str)> {
        self.observed
            .iter()
            .filter(|h| h.accepted_ms.is_some())
            .map(|h| (h.handler.as_str(), h.event.as_str()))
            .collect()
    }
}

/// Rule: no loss. Indices of the expected deliveries that were never
/// accepted and are not an allowed dead letter.
pub fn lost(m: &Model) -> Vec<usize> {
    let accepted = m.accepted_set();
    m.expected
        .iter()
        .enumerate()
        .filter(|(_, d)| {
            let allowed_dead = d.dead_lettered && d.dead_letter_allowed;
            !allowed_dead && !accepted.contains(&(d.handler.as_str(), d.event.as_str()))
        })
        .map(|(i, _)| i)
        .collect()
}

/// Rule: nothing unexpected. The first accepted hand-over (in arrival
/// order) of each delivery nobody expected.
pub fn unexpected(m: &Model) -> Vec<usize> {
    let want = m.expected_set();
    let mut seen = HashSet::new();
    m.by_arrival()
        .into_iter()
        .filter(|&i| {
            let h = &m.observed[i];
            h.accepted_ms.is_some()
                && !want.contains(&(h.handler.as_str(), h.event.as_str()))
                && seen.insert((h.handler.as_str(), h.event.as_str()))
        })
        .collect()
}

/// What [`repeats`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Repeats {
    /// Repeats per cause.
    pub by_cause: HashMap<Cause, usize>,
    /// Repeats without a cause: a violation.
    pub unattributed: Vec<Repeat>,
}

impl Repeats {
    /// Repeats with `cause`.
    pub fn with(&self, cause: Cause) -> usize {
        self.by_cause.get(&cause).copied().unwrap_or(0)
    }
}

/// Rule: no repeat without a cause. Every hand-over of a (handler, event)
/// after its first, with the cause `causes` gives it.
pub fn repeats(m: &Model, causes: &dyn Causes) -> Repeats {
    let mut out = Repeats::default();
    let mut last: HashMap<(&str, &str), (usize, u32, bool)> = HashMap::new();
    for i in m.by_arrival() {
        let h = &m.observed[i];
        let pair = (h.handler.as_str(), h.event.as_str());
        let entry = last.entry(pair).or_insert((i, h.attempt, false));
        if entry.0 != i {
            let r = Repeat {
                prev: entry.0,
                q: i,
                max_attempt: entry.1,
                accepted_before: entry.2,
                latest: None,
            };
            match causes.repeat(m, &r) {
                Some(c) => *out.by_cause.entry(c).or_default() += 1,
                None => out.unattributed.push(r),
            }
        }
        *entry = (
            i,
            entry.1.max(h.attempt),
            entry.2 || h.accepted_ms.is_some(),
        );
    }
    out
}

/// One breach of [`order`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disorder {
    /// The first hand-over at its position while an earlier position was
    /// not done (`missing`).
    Early {
        /// The hand-over.
        q: usize,
        /// The earlier position not done.
        missing: i64,
    },
    /// The first hand-over at its position after a later position
    /// (`later`) was handed over (unless its position was dead-lettered
    /// before it arrived).
    AfterLater {
        /// The hand-over.
        q: usize,
        /// The highest position handed over before.
        later: i64,
    },
    /// A repeat after a later position, without a cause.
    Rewind(Repeat),
}

/// What [`order`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Order {
    /// Breaches.
    pub disorder: Vec<Disorder>,
    /// Rewinds with a cause (allowed, counted).
    pub rewinds: usize,
}

/// Rule: per (handler, key) order. See the module doc; hand-overs without a
/// key or position are not ordered.
pub fn order(m: &Model, causes: &dyn Causes) -> Order {
    type Stream<'a> = (&'a str, &'a str);
    struct S {
        /// Positions that must be done before a later first hand-over and
        /// were not yet seen done.
        pending: BTreeSet<i64>,
        /// Highest position handed over, and the latest hand-over there.
        max: Option<(i64, usize)>,
    }
    // When each position was first accepted, or dead-lettered (done from
    // the start).
    let mut done_at: HashMap<(Stream, i64), f64> = HashMap::new();
    for h in &m.observed {
        if let (Some(k), Some(p), Some(t)) = (h.key.as_deref(), h.position, h.accepted_ms) {
            let e = done_at
                .entry(((h.handler.as_str(), k), p))
                .or_insert(f64::INFINITY);
            *e = e.min(t);
        }
    }
    let mut streams: HashMap<Stream, S> = HashMap::new();
    let new = || S {
        pending: BTreeSet::new(),
        max: None,
    };
    match m.earlier {
        Earlier::Listed => {
            for d in &m.expected {
                if let (Some(k), Some(p)) = (d.key.as_deref(), d.position) {
                    let s = (d.handler.as_str(), k);
                    streams.entry(s).or_insert_with(new).pending.insert(p);
                    if d.dead_lettered {
                        done_at.insert((s, p), f64::NEG_INFINITY);
                    }
                }
            }
        }
        Earlier::Dense => {
            for h in &m.observed {
                if let (Some(k), Some(p)) = (h.key.as_deref(), h.position) {
                    let s = streams.entry((h.handler.as_str(), k)).or_insert_with(new);
                    let top = s.pending.last().copied().unwrap_or(0);
                    s.pending.extend(top + 1..=p);
                }
            }
        }
        Earlier::Observed => {}
    }

    let mut out = Order::default();
    // Per delivery: previous hand-over, highest attempt, accepted before.
    let mut last: HashMap<(&str, &str), (usize, u32, bool)> = HashMap::new();
    for i in m.by_arrival() {
        let h = &m.observed[i];
        let (Some(key), Some(p)) = (h.key.as_deref(), h.position) else {
            continue;
        };
        let sk = (h.handler.as_str(), key);
        let s = streams.entry(sk).or_insert_with(new);
        let pair = (h.handler.as_str(), h.event.as_str());
        match last.get(&pair).copied() {
            None => {
                let done = |x: i64| done_at.get(&(sk, x)).is_some_and(|t| *t <= h.arrived_ms);
                // A position done before its first hand-over is a dead
                // letter (a deposed owner's stale send follows it).
                let dead = done_at.get(&(sk, p)).is_some_and(|t| *t < h.arrived_ms);
                if let Some((later, _)) = s.max.filter(|(mp, _)| *mp > p && !dead) {
                    out.disorder.push(Disorder::AfterLater { q: i, later });
                } else {
                    // Earlier positions must be done by this arrival; once
                    // done they stay done (arrivals only grow).
                    let below: Vec<i64> = s.pending.range(..p).copied().collect();
                    for x in below {
                        if done(x) {
                            s.pending.remove(&x);
                        } else {
                            out.disorder.push(Disorder::Early { q: i, missing: x });
                            break;
                        }
                    }
                }
                if m.earlier == Earlier::Observed {
                    s.pending.insert(p);
                }
            }
            Some((prev, max_attempt, accepted_before)) => {
                if let Some((_, latest)) = s.max.filter(|(mp, _)| *mp > p) {
                    let r = Repeat {
                        prev,
                        q: i,
                        max_attempt,
                        accepted_before,
                        latest: Some(latest),
                    };
                    if causes.rewind(m, &r) {
                        out.rewinds += 1;
                    } else {
                        out.disorder.push(Disorder::Rewind(r));
                    }
                }
            }
        }
        if s.max.is_none_or(|(mp, _)| p >= mp) {
            s.max = Some((p, i));
        }
        let e = last.entry(pair).or_insert((i, h.attempt, false));
        *e = (i, e.1.max(h.attempt), e.2 || h.accepted_ms.is_some());
    }
    out
}

/// One breach of [`overlaps`]: `q` arrived while `prev` was in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlap {
    /// The earlier hand-over, the one in flight the longest.
    pub prev: usize,
    /// The hand-over that arrived meanwhile.
    pub q: usize,
}

/// Rule: one hand-over of a (handler, key), or of an unkeyed delivery, in
/// flight at a time. `q` overlaps when it arrives more than `tolerance_ms`
/// before the end of an earlier one's time in flight
/// ([`HandOver::until_ms`]).
pub fn overlaps(m: &Model, tolerance_ms: f64) -> Vec<Overlap> {
    let mut out = Vec::new();
    let mut in_flight: HashMap<(&str, &str), (usize, f64)> = HashMap::new();
    for i in m.by_arrival() {
        let h = &m.observed[i];
        let stream = h.key.as_deref().unwrap_or(h.event.as_str());
        let k = (h.handler.as_str(), stream);
        let Some(&(prev, prev_until)) = in_flight.get(&k) else {
            in_flight.insert(k, (i, h.until_ms));
            continue;
        };
        if h.arrived_ms + tolerance_ms < prev_until {
            out.push(Overlap { prev, q: i });
        }
        if h.until_ms > prev_until {
            in_flight.insert(k, (i, h.until_ms));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Causes for the table: a repeat after a failed hand-over is
    /// `Failed`, one from another sender `OwnerChange`; a rewind needs
    /// another sender than the latest one.
    struct Senders;

    impl Causes for Senders {
        fn repeat(&self, m: &Model, r: &Repeat) -> Option<Cause> {
            let (p, q) = (&m.observed[r.prev], &m.observed[r.q]);
            if p.accepted_ms.is_none() {
                Some(Cause::Failed)
            } else if q.attempt > p.attempt {
                Some(Cause::NodeSawFailure)
            } else if p.sender != q.sender {
                Some(Cause::OwnerChange)
            } else {
                None
            }
        }
        fn rewind(&self, m: &Model, r: &Repeat) -> bool {
            let latest = &m.observed[r.latest.expect("a rewind has a latest")];
            r.accepted_before && latest.sender != m.observed[r.q].sender
        }
    }

    fn d(event: &str, position: i64) -> Delivery {
        Delivery {
            handler: "h".into(),
            event: event.into(),
            key: Some("k".into()),
            position: Some(position),
            ..Delivery::default()
        }
    }

    /// A hand-over of `event` at `position` arriving at `at` ms, answered
    /// 1 ms later: accepted when `ok`.
    fn o(event: &str, position: i64, at: f64, ok: bool) -> HandOver {
        HandOver {
            handler: "h".into(),
            event: event.into(),
            key: Some("k".into()),
            position: Some(position),
            attempt: 1,
            sender: Some("1".into()),
            arrived_ms: at,
            accepted_ms: ok.then_some(at + 1.0),
            until_ms: at + 1.0,
        }
    }

    fn from(mut h: HandOver, sender: &str) -> HandOver {
        h.sender = Some(sender.into());
        h
    }

    fn model(earlier: Earlier, observed: Vec<HandOver>) -> Model {
        Model {
            expected: vec![d("a", 1), d("b", 2), d("c", 3)],
            observed,
            earlier,
        }
    }

    /// What every rule found, as counts: (lost, unexpected, unattributed
    /// repeats, disorder, rewinds, overlaps).
    fn counts(m: &Model) -> [usize; 6] {
        let o = order(m, &Senders);
        [
            lost(m).len(),
            unexpected(m).len(),
            repeats(m, &Senders).unattributed.len(),
            o.disorder.len(),
            o.rewinds,
            overlaps(m, 0.0).len(),
        ]
    }

    #[test]
    fn each_rule_has_a_case_that_fails_it() {
        use Earlier::{Dense, Listed, Observed};
        let exact = vec![
            o("a", 1, 10.0, false),
            o("a", 1, 20.0, true),
            o("b", 2, 30.0, true),
            o("c", 3, 40.0, true),
        ];
        let mut dead_c = exact.clone();
        dead_c.pop();
        let with = |extra: Vec<HandOver>| {
            let mut v = exact.clone();
            v.extend(extra);
            v
        };
        let table: Vec<(&str, Earlier, Vec<HandOver>, [usize; 6])> = vec![
            ("exact", Listed, exact.clone(), [0; 6]),
            ("exact, dense", Dense, exact.clone(), [0; 6]),
            ("exact, observed", Observed, exact.clone(), [0; 6]),
            ("c lost", Listed, dead_c.clone(), [1, 0, 0, 0, 0, 0]),
            (
                "z unexpected",
                Listed,
                with(vec![o("z", 9, 50.0, true)]),
                [0, 1, 0, 0, 0, 0],
            ),
            (
                "c again from the same node",
                Listed,
                with(vec![o("c", 3, 50.0, true)]),
                [0, 0, 1, 0, 0, 0],
            ),
            (
                "c again from another node",
                Listed,
                with(vec![from(o("c", 3, 50.0, true), "2")]),
                [0; 6],
            ),
            (
                "b before a was accepted",
                Listed,
                vec![
                    o("a", 1, 10.0, false),
                    o("b", 2, 15.0, true),
                    o("a", 1, 20.0, true),
                    o("c", 3, 40.0, true),
                ],
                // b early; a's repeat after b has no cause (not accepted
                // before).
                [0, 0, 0, 2, 0, 0],
            ),
            (
                "a gap: c before b, dense",
                Dense,
                vec![o("a", 1, 10.0, true), o("c", 3, 40.0, true)],
                [1, 0, 0, 1, 0, 0],
            ),
            (
                "a gap is not seen when only observed positions count",
                Observed,
                vec![o("a", 1, 10.0, true), o("c", 3, 40.0, true)],
                [1, 0, 0, 0, 0, 0],
            ),
            (
                "a first after b, observed",
                Observed,
                vec![o("b", 2, 10.0, true), o("a", 1, 20.0, true)],
                [1, 0, 0, 1, 0, 0],
            ),
            (
                "b rewound by another node",
                Listed,
                with(vec![from(o("b", 2, 50.0, true), "2")]),
                [0, 0, 0, 0, 1, 0],
            ),
            (
                "b rewound by the node that sent c",
                Listed,
                with(vec![o("b", 2, 50.0, true)]),
                [0, 0, 1, 1, 0, 0],
            ),
            (
                "c while b is in flight",
                Listed,
                vec![
                    o("a", 1, 10.0, true),
                    HandOver {
                        until_ms: 100.0,
                        ..o("b", 2, 20.0, true)
                    },
                    o("c", 3, 40.0, true),
                ],
                [0, 0, 0, 0, 0, 1],
            ),
        ];
        for (name, earlier, observed, want) in table {
            let m = model(earlier, observed);
            assert_eq!(counts(&m), want, "{name}");
        }
    }

    #[test]
    fn a_dead_letter_is_an_outcome_only_where_allowed_and_ends_the_delivery() {
        let mut m = model(
            Earlier::Listed,
            vec![o("a", 1, 10.0, true), o("c", 3, 40.0, true)],
        );
        m.expected[1].dead_lettered = true;
        assert_eq!(counts(&m), [1, 0, 0, 0, 0, 0], "b dead, not allowed");
        m.expected[1].dead_letter_allowed = true;
        assert_eq!(counts(&m), [0; 6]);
    }

    #[test]
    fn repeats_get_the_callers_cause_in_arrival_order() {
        // Logged in answer order: a's first attempt answered last.
        let mut m = model(
            Earlier::Listed,
            vec![
                HandOver {
                    attempt: 2,
                    ..o("a", 1, 20.0, true)
                },
                o("a", 1, 10.0, false),
                o("b", 2, 30.0, true),
                o("c", 3, 40.0, true),
                HandOver {
                    attempt: 2,
                    ..o("c", 3, 50.0, true)
                },
            ],
        );
        let r = repeats(&m, &Senders);
        assert_eq!(
            (r.with(Cause::Failed), r.with(Cause::NodeSawFailure)),
            (1, 1)
        );
        assert_eq!(r.unattributed, vec![]);
        // The repeat's context: previous hand-over and highest attempt.
        m.observed.push(o("c", 3, 60.0, true));
        let r = repeats(&m, &Senders);
        assert_eq!(
            r.unattributed,
            vec![Repeat {
                prev: 4,
                q: 5,
                max_attempt: 2,
                accepted_before: true,
                latest: None
            }]
        );
    }

    #[test]
    fn an_overlap_is_judged_against_the_longest_in_flight_with_tolerance() {
        let long = HandOver {
            until_ms: 1_000.0,
            ..o("a", 1, 10.0, true)
        };
        let m = model(
            Earlier::Listed,
            vec![
                long,
                o("b", 2, 500.0, true),
                o("c", 3, 900.0, true),
                // Unkeyed deliveries overlap only with themselves.
                HandOver {
                    key: None,
                    position: None,
                    ..o("u", 0, 600.0, true)
                },
            ],
        );
        let found = overlaps(&m, 0.0);
        assert_eq!(
            found,
            vec![Overlap { prev: 0, q: 1 }, Overlap { prev: 0, q: 2 }]
        );
        assert_eq!(overlaps(&m, 200.0), vec![Overlap { prev: 0, q: 1 }]);
    }
}
