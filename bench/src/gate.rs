//! The counter gate: exact database counters per unit (per published event
//! or per delivery) of the candidate against the base, each with its own
//! threshold. Throughput is not gated (noise on shared machines); counters
//! are, because they move when the code changes, not when the machine is
//! busy.
//!
//! | counter | threshold (relative, absolute floor per unit) | why |
//! | --- | --- | --- |
//! | `statements` | 10 %, 0.0005 | exact per call, but batch sizes follow timing |
//! | `wal_bytes` | 10 %, 20 B | includes full-page images after checkpoints |
//! | `wal_records` | 10 %, 0.2 | |
//! | `<table>.ins`, `<table>.del` | 5 %, 0.01 | rows per unit are fixed by the design |
//! | `<table>.upd` | 15 %, 0.02 | lane rows follow the timing of concurrent claims (the reference gated this at 15 %) |
//! | `wal_fpi`, `<table>.hot_upd`, `<table>.dead`, CPU | not gated | checkpoint, autovacuum and scheduler timing |
//!
//! A counter is flagged when `|candidate − base| > max(rel × |base|, abs)`;
//! a counter that was zero on the base side is flagged when the candidate's
//! exceeds the absolute floor ("regressed from zero"). Medians of each
//! side's samples are compared.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// A per-counter threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Threshold {
    /// Relative change allowed (0.10 = 10 %).
    pub rel: f64,
    /// Absolute change per unit always allowed.
    pub abs: f64,
}

/// The threshold of `counter`, or `None` when it is not gated (see the
/// module docs for the table).
pub fn threshold(counter: &str) -> Option<Threshold> {
    let t = |rel, abs| Some(Threshold { rel, abs });
    match counter {
        "statements" => t(0.10, 0.0005),
        "wal_bytes" => t(0.10, 20.0),
        "wal_records" => t(0.10, 0.2),
        c if c.ends_with(".ins") || c.ends_with(".del") => t(0.05, 0.01),
        c if c.ends_with(".upd") && !c.ends_with(".hot_upd") => t(0.15, 0.02),
        _ => None,
    }
}

/// One flagged counter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flag {
    /// Cell name.
    pub cell: String,
    /// Counter name.
    pub counter: String,
    /// Base median per unit.
    pub base: f64,
    /// Candidate median per unit.
    pub candidate: f64,
    /// Candidate / base (infinite when the base was zero).
    pub ratio: f64,
}

/// Flags the gated counters of one cell whose medians moved past their
/// threshold. Counters present on one side only are compared with 0.
pub fn judge(cell: &str, base: &BTreeMap<String, f64>, cand: &BTreeMap<String, f64>) -> Vec<Flag> {
    let names: BTreeSet<&String> = base.keys().chain(cand.keys()).collect();
    let mut flags = Vec::new();
    for name in names {
        let Some(th) = threshold(name) else { continue };
        let b = base.get(name).copied().unwrap_or(0.0);
        let c = cand.get(name).copied().unwrap_or(0.0);
        let allowed = (th.rel * b.abs()).max(th.abs);
        if (c - b).abs() > allowed {
            flags.push(Flag {
                cell: cell.to_owned(),
                counter: name.clone(),
                base: b,
                candidate: c,
                ratio: if b == 0.0 { f64::INFINITY } else { c / b },
            });
        }
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(kv: &[(&str, f64)]) -> BTreeMap<String, f64> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn identical_counters_pass() {
        let a = m(&[
            ("statements", 0.05),
            ("wal_bytes", 600.0),
            ("deliveries.del", 1.0),
        ]);
        assert!(judge("c", &a, &a).is_empty());
    }

    #[test]
    fn each_counter_has_its_own_threshold() {
        let base = m(&[
            ("statements", 0.05),
            ("wal_bytes", 600.0),
            ("lanes.upd", 0.10),
            ("deliveries.del", 1.0),
            ("wal_fpi", 1.0),
        ]);
        // +8 % WAL (under 10 %), +14 % lane updates (under 15 %), FPI x3 (not gated).
        let ok = m(&[
            ("statements", 0.052),
            ("wal_bytes", 648.0),
            ("lanes.upd", 0.114),
            ("deliveries.del", 1.0),
            ("wal_fpi", 3.0),
        ]);
        assert!(
            judge("c", &base, &ok).is_empty(),
            "{:?}",
            judge("c", &base, &ok)
        );
        // One extra statement per completion batch of ~25 deliveries: +0.04 per delivery.
        let bad = m(&[
            ("statements", 0.09),
            ("wal_bytes", 600.0),
            ("lanes.upd", 0.10),
            ("deliveries.del", 1.06),
        ]);
        let flags = judge("c", &base, &bad);
        let names: Vec<&str> = flags.iter().map(|f| f.counter.as_str()).collect();
        assert_eq!(names, vec!["deliveries.del", "statements"]);
        assert!((flags[1].ratio - 1.8).abs() < 1e-9);
        // Moving down is flagged too: a counter that moved is a change to explain.
        let down = m(&[("statements", 0.05), ("wal_bytes", 400.0)]);
        let flags = judge(
            "c",
            &m(&[("statements", 0.05), ("wal_bytes", 600.0)]),
            &down,
        );
        assert_eq!(flags.len(), 1);
        assert_eq!(flags[0].counter, "wal_bytes");
    }

    #[test]
    fn regressed_from_zero_uses_the_absolute_floor() {
        let base = m(&[("completions.upd", 0.0)]);
        assert!(judge("c", &base, &m(&[("completions.upd", 0.01)])).is_empty());
        let f = judge("c", &base, &m(&[("completions.upd", 1.0)]));
        assert_eq!(f.len(), 1);
        assert!(f[0].ratio.is_infinite());
        // Missing on the base side counts as zero.
        assert_eq!(judge("c", &m(&[]), &m(&[("x.ins", 1.0)])).len(), 1);
        // Not gated: hot updates and dead tuples.
        assert!(judge("c", &m(&[]), &m(&[("x.hot_upd", 9.0), ("x.dead", 9.0)])).is_empty());
    }
}
