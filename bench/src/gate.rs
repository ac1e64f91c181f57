//! The gate. Two kinds of cell, two rules:
//!
//! **Exact counters of the fixed-work cells** (`pg-count-*`: a fixed number
//! of publish calls, or a fixed backlog drained to the end by the store's
//! claim and complete calls with fixed sizes). The same work every time, so
//! the counters per unit are exact or nearly so, and a code change that
//! adds a statement, a row or WAL moves them by more than the thresholds
//! below. Medians of each side's samples are compared.
//!
//! | counter | rel | abs floor per unit | why |
//! | --- | --- | --- | --- |
//! | `statements` | 1 % | 0.0001 | exact: the same calls every time (A/A: identical) |
//! | `<table>.ins`, `<table>.del` | 1 % | 0.001 | exact: rows per unit are fixed by the design |
//! | `<table>.upd` | 2 % | 0.001 | exact for the fixed claims (lane rows: one update per claimed lane) |
//! | `wal_bytes` | 3 % | 5 B | nearly exact: the CHECKPOINT before the reset fixes the full-page images, and autovacuum is off on these cells' tables |
//! | `wal_records` | 3 % | 0.05 | as `wal_bytes` |
//! | `wal_fpi`, `<table>.hot_upd`, `<table>.dead`, CPU | not gated | | checkpoint, autovacuum and scheduler timing |
//!
//! A counter is flagged when `|candidate − base| > max(rel × |base|, abs)`;
//! a counter that was zero on the base side is flagged when the candidate's
//! exceeds the absolute floor ("regressed from zero").
//!
//! **Throughput of the time-windowed publish and dispatch cells.** Their
//! counters are reported, not gated: batch sizes follow timing (how many
//! deliveries a claim or a completion carries depends on how fast the
//! handlers and the database answer), so statements per delivery of a
//! dispatch cell moved 15 % between A/A samples. Their throughput is gated
//! on the median of the per-pair ratios with its 95 % interval: flagged
//! when the whole interval lies below [`THROUGHPUT_FLOOR`] (slower by more
//! than 10 % with 95 % confidence). Without an interval (fewer than three
//! kept pairs, such as the quick set's two) throughput is indicative and
//! not gated: on this shared 2-core machine two pairs of the same code gave
//! median ratios from 0.84 to 2.27 (the A/A quick runs of bench/results/). Mixed cells are not gated (they publish what
//! the machine accepts at the offered rate).

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
        "statements" => t(0.01, 0.0001),
        "wal_bytes" => t(0.03, 5.0),
        "wal_records" => t(0.03, 0.05),
        c if c.ends_with(".ins") || c.ends_with(".del") => t(0.01, 0.001),
        c if c.ends_with(".upd") && !c.ends_with(".hot_upd") => t(0.02, 0.001),
        _ => None,
    }
}

/// Throughput of a time-windowed cell is flagged when the 95 % interval of
/// candidate / base lies entirely below this.
pub const THROUGHPUT_FLOOR: f64 = 0.90;

/// The throughput flag of a time-windowed publish or dispatch cell, from
/// its ratio summary and the medians of each side's rate: flagged when the
/// interval (three kept pairs or more) lies below [`THROUGHPUT_FLOOR`].
pub fn judge_throughput(
    cell: &str,
    summary: Option<&crate::stats::RatioSummary>,
    base_rate: Option<f64>,
    cand_rate: Option<f64>,
) -> Option<Flag> {
    let s = summary?;
    let (_, hi) = s.interval?;
    (hi < THROUGHPUT_FLOOR).then(|| Flag {
        cell: cell.to_owned(),
        counter: "throughput".into(),
        base: base_rate.unwrap_or(f64::NAN),
        candidate: cand_rate.unwrap_or(f64::NAN),
        ratio: s.ratio,
    })
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
    use crate::stats::summarize;

    fn m(kv: &[(&str, f64)]) -> BTreeMap<String, f64> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    /// Counters of `pg-count-drain` as measured on main (20,000 deliveries:
    /// 1 claim and 100 completions of 200).
    fn drain() -> BTreeMap<String, f64> {
        m(&[
            ("statements", 101.0 / 20_000.0),
            ("wal_bytes", 420.0),
            ("wal_records", 3.0),
            ("completions.ins", 1.0),
            ("deliveries.del", 1.0),
            ("lanes.upd", 256.0 / 20_000.0),
            ("wal_fpi", 0.02),
        ])
    }

    #[test]
    fn identical_counters_pass() {
        assert!(judge("c", &drain(), &drain()).is_empty());
    }

    #[test]
    fn a_b_jitter_inside_the_thresholds_passes() {
        // WAL +2 %, records -2 %, FPI x3 (not gated), dead tuples (not gated).
        let mut c = drain();
        c.insert("wal_bytes".into(), 420.0 * 1.02);
        c.insert("wal_records".into(), 3.0 * 0.98);
        c.insert("wal_fpi".into(), 0.06);
        c.insert("deliveries.dead".into(), 0.7);
        assert!(
            judge("c", &drain(), &c).is_empty(),
            "{:?}",
            judge("c", &drain(), &c)
        );
    }

    #[test]
    fn one_extra_statement_per_completion_batch_is_flagged_by_name() {
        // The deliberate regression of bench/patches/: 100 completion calls,
        // one more statement each.
        let mut bad = drain();
        bad.insert("statements".into(), 201.0 / 20_000.0);
        let flags = judge("pg-count-drain", &drain(), &bad);
        assert_eq!(flags.len(), 1, "{flags:?}");
        assert_eq!(flags[0].counter, "statements");
        assert!((flags[0].ratio - 201.0 / 101.0).abs() < 1e-9);
        // One extra statement in the whole sample is below the floor.
        let mut one = drain();
        one.insert("statements".into(), 102.0 / 20_000.0);
        assert!(judge("c", &drain(), &one).is_empty());
    }

    #[test]
    fn rows_and_wal_moving_either_way_are_flagged() {
        let mut c = drain();
        c.insert("deliveries.del".into(), 1.05);
        c.insert("wal_bytes".into(), 380.0);
        let names: Vec<String> = judge("c", &drain(), &c)
            .into_iter()
            .map(|f| f.counter)
            .collect();
        assert_eq!(names, vec!["deliveries.del", "wal_bytes"]);
    }

    #[test]
    fn regressed_from_zero_uses_the_absolute_floor() {
        let base = m(&[("completions.upd", 0.0)]);
        assert!(judge("c", &base, &m(&[("completions.upd", 0.0005)])).is_empty());
        let f = judge("c", &base, &m(&[("completions.upd", 1.0)]));
        assert_eq!(f.len(), 1);
        assert!(f[0].ratio.is_infinite());
        // Missing on the base side counts as zero.
        assert_eq!(judge("c", &m(&[]), &m(&[("x.ins", 1.0)])).len(), 1);
        // Not gated: hot updates and dead tuples.
        assert!(judge("c", &m(&[]), &m(&[("x.hot_upd", 9.0), ("x.dead", 9.0)])).is_empty());
    }

    #[test]
    fn throughput_needs_an_interval_below_the_floor() {
        // Two pairs: no interval, never flagged however low.
        let two = summarize(&[0.5, 0.6]).unwrap();
        assert!(judge_throughput("c", Some(&two), Some(100.0), Some(55.0)).is_none());
        // A/A noise: interval spans 1.
        let aa = summarize(&[0.8, 1.2, 1.0]).unwrap();
        assert!(judge_throughput("c", Some(&aa), None, None).is_none());
        // Consistently 20 % slower: flagged.
        let slow = summarize(&[0.79, 0.81, 0.80]).unwrap();
        let f = judge_throughput("c", Some(&slow), Some(100.0), Some(80.0)).unwrap();
        assert_eq!(f.counter, "throughput");
        assert!((f.ratio - 0.80).abs() < 1e-9);
        // 5 % slower, tight: inside the floor.
        let near = summarize(&[0.95, 0.95, 0.96]).unwrap();
        assert!(judge_throughput("c", Some(&near), None, None).is_none());
    }
}
