//! `report.md`: tables like the reference's (base, candidate, ratio,
//! samples), latency of the mixed cells, the exact counters per unit next
//! to the reference's published values, the counter gate, and the peers.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::cells::{Cell, Kind};
use crate::gate::{self, Flag};
use crate::peers::PeerResult;
use crate::run::{Record, Side};
use crate::stats::{self, RatioSummary};

/// The written report and the gate's verdict.
#[derive(Debug)]
pub struct Report {
    /// report.md.
    pub markdown: String,
    /// No flagged counter and every sample valid.
    pub gate_passed: bool,
}

/// Aggregates of one cell.
#[derive(Debug, Default)]
pub struct CellSummary {
    /// Median rate per side (base, candidate).
    pub rate: [Option<f64>; 2],
    /// Samples per side.
    pub samples: [usize; 2],
    /// Ratio summary over kept pairs.
    pub ratio: Option<RatioSummary>,
    /// Pairs dropped as noisy.
    pub noisy_pairs: usize,
    /// Counter medians per side.
    pub counters: [BTreeMap<String, f64>; 2],
    /// Gate flags.
    pub flags: Vec<Flag>,
}

fn side_idx(r: &Record) -> usize {
    usize::from(r.side != "base")
}

/// Medians over one side's samples of a mixed cell: accepted events/s and
/// the commit-to-handler p50, p99 and max (ms).
fn mixed_medians(records: &[Record], cell: &str, side: usize) -> [Option<f64>; 4] {
    let rs: Vec<&Record> = records
        .iter()
        .filter(|r| r.cell == cell && side_idx(r) == side)
        .collect();
    let m = |f: &dyn Fn(&Record) -> Option<f64>| {
        stats::median(&rs.iter().filter_map(|r| f(r)).collect::<Vec<_>>())
    };
    [
        m(&|r| Some(r.out.accepted_rate)),
        m(&|r| r.out.latency.as_ref().map(|l| l.p50)),
        m(&|r| r.out.latency.as_ref().map(|l| l.p99)),
        m(&|r| r.out.latency.as_ref().map(|l| l.max)),
    ]
}

/// Summarizes one cell's records.
pub fn summarize_cell(cell: &str, records: &[Record]) -> CellSummary {
    let recs: Vec<&Record> = records.iter().filter(|r| r.cell == cell).collect();
    let mut s = CellSummary::default();
    for i in 0..2 {
        let rates: Vec<f64> = recs
            .iter()
            .filter(|r| side_idx(r) == i)
            .map(|r| r.out.rate)
            .collect();
        s.samples[i] = rates.len();
        s.rate[i] = stats::median(&rates);
        let mut names: Vec<&String> = recs
            .iter()
            .filter(|r| side_idx(r) == i)
            .flat_map(|r| r.out.counters.keys())
            .collect();
        names.sort();
        names.dedup();
        for n in names {
            let v: Vec<f64> = recs
                .iter()
                .filter(|r| side_idx(r) == i)
                // Database counters of a sample whose statistics never
                // agreed with its rows are left out (CPU is kept).
                .filter(|r| !r.out.stats_incomplete || n.starts_with("cpu_"))
                .filter_map(|r| r.out.counters.get(n).copied())
                .collect();
            if let Some(m) = stats::median(&v) {
                s.counters[i].insert(n.clone(), m);
            }
        }
    }
    let mut pairs: BTreeMap<usize, [Option<&Record>; 2]> = BTreeMap::new();
    for r in &recs {
        pairs.entry(r.pair).or_default()[side_idx(r)] = Some(r);
    }
    let complete: Vec<(&Record, &Record)> = pairs
        .values()
        .filter_map(|p| Some((p[0]?, p[1]?)))
        .collect();
    let spins: Vec<(f64, f64)> = complete
        .iter()
        .map(|(b, c)| (b.spin_ms, c.spin_ms))
        .collect();
    let keep = stats::clean_pairs(&spins);
    s.noisy_pairs = keep.iter().filter(|k| !**k).count();
    let ratios: Vec<f64> = complete
        .iter()
        .zip(&keep)
        .filter(|(_, k)| **k)
        .map(|((b, c), _)| c.out.rate / b.out.rate)
        .collect();
    s.ratio = stats::summarize(&ratios);
    if !s.counters[0].is_empty() || !s.counters[1].is_empty() {
        s.flags = gate::judge(cell, &s.counters[0], &s.counters[1]);
    }
    s
}

fn num(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(x) if x.abs() >= 1000.0 => {
            let s = format!("{:.0}", x);
            let (sign, digits) = s.strip_prefix('-').map_or(("", s.as_str()), |d| ("-", d));
            let mut out = String::new();
            for (i, ch) in digits.chars().enumerate() {
                if i > 0 && (digits.len() - i) % 3 == 0 {
                    out.push(',');
                }
                out.push(ch);
            }
            format!("{sign}{out}")
        }
        Some(x) if x.abs() >= 100.0 => format!("{x:.0}"),
        Some(x) if x.abs() >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.3}"),
    }
}

/// Rows of the table against the reference (seed `000_…`, 0.2.0 on
/// PostgreSQL): cell, its scenario in the reference's terms, and the
/// reference's published WAL bytes, WAL records and statements per unit
/// where it gives them.
const REFERENCE: &[(&str, &str, [Option<f64>; 3])] = &[
    (
        "pg-dispatch-1n-tuned",
        "per delivery, 1 process, tuned",
        [Some(1325.0), None, None],
    ),
    (
        "pg-count-drain",
        "per delivery, 1 process (fixed work, store only)",
        [Some(1325.0), None, None],
    ),
    (
        "pg-dispatch-1n-tuned-fan5",
        "per delivery, fan-out 5",
        [Some(576.0), None, None],
    ),
    (
        "pg-count-drain-fan5",
        "per delivery, fan-out 5 (fixed work, store only)",
        [Some(576.0), None, None],
    ),
    (
        "pg-dispatch-1n-defaults",
        "per delivery, 1 process, defaults",
        [Some(3129.0), None, None],
    ),
    (
        "pg-dispatch-1n-tuned-http",
        "per delivery, 1 process, tuned, webhooks",
        [Some(1325.0), None, None],
    ),
    (
        "pg-publish-p8-b1",
        "per published event, single-event publish",
        [Some(1490.0), Some(11.2), Some(4.1)],
    ),
    (
        "pg-count-publish-b1",
        "per published event, single-event publish (fixed work)",
        [Some(1490.0), Some(11.2), Some(4.1)],
    ),
    (
        "pg-publish-p8-b100",
        "per published event, 100 per call",
        [None, None, None],
    ),
    (
        "pg-count-publish-b100",
        "per published event, 100 per call (fixed work)",
        [None, None, None],
    ),
];

/// The counters a cell's database server did not report (MongoDB cells on
/// the test server), as a line under its counter table: named, not
/// estimated.
fn unavailable_note(md: &mut String, cell: &str, records: &[Record]) {
    let mut names: Vec<&str> = records
        .iter()
        .filter(|r| r.cell == cell)
        .flat_map(|r| r.out.unavailable.iter().map(String::as_str))
        .collect();
    names.sort_unstable();
    names.dedup();
    if !names.is_empty() {
        let list: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
        let _ = writeln!(md, "\nNot available on this server: {}.", list.join(", "));
    }
}

/// Builds the report.
pub fn build(
    cells: &[Cell],
    sides: &[Side; 2],
    records: &[Record],
    peers: &[PeerResult],
    env: &serde_json::Value,
    error: Option<String>,
) -> Report {
    let mut md = String::new();
    let sums: Vec<(&Cell, CellSummary)> = cells
        .iter()
        .filter(|c| records.iter().any(|r| r.cell == c.name))
        .map(|c| {
            let mut s = summarize_cell(&c.name, records);
            // Exact counters are gated on the fixed-work cells only; the
            // time-windowed publish and dispatch cells are gated on
            // throughput (see gate.rs); mixed cells are not gated.
            if !c.kind.fixed_work() {
                s.flags.clear();
            }
            if matches!(c.kind, Kind::Publish | Kind::Dispatch) {
                s.flags.extend(gate::judge_throughput(
                    &c.name,
                    s.ratio.as_ref(),
                    s.rate[0],
                    s.rate[1],
                ));
            }
            (c, s)
        })
        .collect();
    let invalid: Vec<&Record> = records
        .iter()
        .filter(|r| !r.out.problems.is_empty())
        .collect();
    let flags: Vec<&Flag> = sums.iter().flat_map(|(_, s)| &s.flags).collect();
    let gate_passed = error.is_none() && invalid.is_empty() && flags.is_empty();

    let _ = writeln!(
        md,
        "# lanebus benchmark: {} vs {}\n",
        sides[1].rev, sides[0].rev
    );
    let _ = writeln!(
        md,
        "Base `{}`, candidate `{}`, set `{}`, {} pair(s) per cell{}, interleaved (pair 0 base first, pair 1 candidate first, ...). \
         Machine {} ({} cores, {}), load average {} at the start and {} at the end: other work shared the machine, so read \
         throughput as ratios and the counters as exact. Started {}.\n",
        sides[0].rev,
        sides[1].rev,
        env["set"].as_str().unwrap_or(""),
        env["pairs"],
        match env.get("rest_pairs") {
            Some(r) if *r != env["pairs"] => format!(" of the quick set and {r} per other cell"),
            _ => String::new(),
        },
        env["fingerprint"].as_str().unwrap_or(""),
        env["cores"],
        env["cpu"].as_str().unwrap_or(""),
        env["load_average_start"],
        env["load_average_end"],
        env["started_at"].as_str().unwrap_or(""),
    );
    let _ = writeln!(
        md,
        "**Gate: {}.** {} sample(s), {} invalid, {} counter(s) flagged.\n",
        if gate_passed { "PASS" } else { "FAIL" },
        records.len(),
        invalid.len(),
        flags.len()
    );
    if let Some(e) = &error {
        let _ = writeln!(md, "**The run stopped:** {e}\n");
    }

    let _ = writeln!(md, "## Throughput\n");
    let _ = writeln!(md, "Rates are per second in the steady window (events for publish cells, deliveries otherwise); the ratio is the median of the per-pair ratios candidate / base, with a 95 % interval from three pairs on.\n");
    let _ = writeln!(md, "| Cell | Scenario | base /s | candidate /s | ratio | interval (95 %) | verdict | samples |");
    let _ = writeln!(md, "| --- | --- | ---: | ---: | ---: | --- | --- | --- |");
    for (c, s) in &sums {
        let (ratio, interval, verdict) = match &s.ratio {
            Some(r) => (
                format!("{:.3}", r.ratio),
                r.interval
                    .map_or("–".into(), |(lo, hi)| format!("{lo:.2} to {hi:.2}")),
                format!("{:?}", r.verdict).to_lowercase(),
            ),
            None => ("–".into(), "–".into(), "–".into()),
        };
        let _ = writeln!(
            md,
            "| `{}` | {} | {} | {} | {} | {} | {} | {} / {}{} |",
            c.name,
            c.title,
            num(s.rate[0]),
            num(s.rate[1]),
            ratio,
            interval,
            verdict,
            s.samples[0],
            s.samples[1],
            if s.noisy_pairs > 0 {
                format!(" ({} noisy pair(s) dropped)", s.noisy_pairs)
            } else {
                String::new()
            }
        );
    }

    let mixed: Vec<&(&Cell, CellSummary)> =
        sums.iter().filter(|(c, _)| c.kind == Kind::Mixed).collect();
    if !mixed.is_empty() {
        let _ = writeln!(md, "\n## Mixed load: commit-to-handler latency\n");
        let _ = writeln!(md, "Median over samples of each sample's p50 / p99 / max (ms), from the publish call's return to the in-process handler (hdrhistogram).\n");
        let _ = writeln!(md, "| Cell | accepted events/s base / candidate | base p50 / p99 / max | candidate p50 / p99 / max |");
        let _ = writeln!(md, "| --- | --- | --- | --- |");
        for (c, _) in mixed {
            let lat = |i: usize| {
                let [acc, p50, p99, max] = mixed_medians(records, &c.name, i);
                (acc, format!("{} / {} / {}", num(p50), num(p99), num(max)))
            };
            let (a0, l0) = lat(0);
            let (a1, l1) = lat(1);
            let _ = writeln!(
                md,
                "| `{}` | {} / {} | {} | {} |",
                c.name,
                num(a0),
                num(a1),
                l0,
                l1
            );
        }
    }

    let _ = writeln!(md, "\n## Against the reference's published values\n");
    let _ = writeln!(md, "Reference: seed `000_…`, version 0.2.0 on PostgreSQL 17 (Apple M4, Docker), which publishes WAL bytes per delivery for three dispatch cells and WAL bytes, WAL records and statements per event for a single-event publish; `–` where it gives no value. Ours: PostgreSQL 15 of this machine, medians of the candidate's samples (base in brackets). Fixed-work cells (`pg-count-*`) drain through the store's claim and complete calls without a node; the others run a node for a fixed time.\n");
    let _ = writeln!(
        md,
        "| Cell | what | WAL B ours (ref) | WAL records ours (ref) | statements ours (ref) | WAL bytes ours / ref |"
    );
    let _ = writeln!(md, "| --- | --- | ---: | ---: | ---: | ---: |");
    for (cell, what, refs) in REFERENCE {
        let Some((_, s)) = sums.iter().find(|(c, _)| c.name == *cell) else {
            continue;
        };
        let cell_of = |i: usize, k: &str| {
            let ours = s.counters[1].get(k).copied();
            let base = s.counters[0].get(k).copied();
            format!("{} [{}] ({})", num(ours), num(base), num(refs[i]))
        };
        let ratio = match (s.counters[1].get("wal_bytes"), refs[0]) {
            (Some(o), Some(r)) => format!("{:.2}", o / r),
            _ => "–".into(),
        };
        let _ = writeln!(
            md,
            "| `{cell}` | {what} | {} | {} | {} | {ratio} |",
            cell_of(0, "wal_bytes"),
            cell_of(1, "wal_records"),
            cell_of(2, "statements"),
        );
    }
    let _ = writeln!(md, "\n## Exact counters per unit\n");
    let _ = writeln!(md, "Per published event (publish cells) or per delivery (dispatch and mixed cells), steady window only; `cpu_app_ms` and `cpu_db_ms` are CPU milliseconds of the sample process (node and publishers) and of all PostgreSQL processes per unit, which is the same number as CPU seconds per 1,000 units. Database counters cover the whole sample: statistics are reset after the setup (and preload), and read again after every connection of the sample has closed (so every backend has flushed its statistics); they are divided by the events stored or the deliveries completed, as the database counts them. CPU covers the steady window. MongoDB cells (`mongo-*`, on the SecantusDB test server, not MongoDB) give the server's `serverStatus` operation counters and requests (`mongo.op.*`, `mongo.requests`, the harness's own probe commands taken off) and the oplog entries written (`mongo.oplog_bytes`, `mongo.oplog_entries`), differenced over the whole sample, and `cpu_db_ms` of the SecantusDB process. Counters are gated on the fixed-work cells (`pg-count-*`, thresholds in the last column and in `bench/README.md`); on the time-windowed cells they are reported, not gated (batch sizes follow timing), and those cells are gated on throughput instead.\n");
    for (c, s) in &sums {
        if s.counters[1].is_empty() && s.counters[0].is_empty() {
            continue;
        }
        let _ = writeln!(md, "### `{}` ({} per {})\n", c.name, c.title, c.unit());
        let _ = writeln!(md, "| counter | base | candidate | ratio | gated at |");
        let _ = writeln!(md, "| --- | ---: | ---: | ---: | --- |");
        let mut names: Vec<&String> = s.counters[0].keys().chain(s.counters[1].keys()).collect();
        names.sort();
        names.dedup();
        for n in names {
            let b = s.counters[0].get(n).copied();
            let cv = s.counters[1].get(n).copied();
            if b.unwrap_or(0.0) == 0.0 && cv.unwrap_or(0.0) == 0.0 {
                continue;
            }
            let ratio = match (b, cv) {
                (Some(b), Some(c)) if b != 0.0 => format!("{:.3}", c / b),
                _ => "–".into(),
            };
            let th = match gate::threshold(n) {
                Some(t) if c.kind.fixed_work() => format!("{} %", t.rel * 100.0),
                _ => "–".into(),
            };
            let flag = if s.flags.iter().any(|f| &f.counter == n) {
                " **flagged**"
            } else {
                ""
            };
            let _ = writeln!(
                md,
                "| `{n}` | {} | {} | {ratio}{flag} | {th} |",
                num(b),
                num(cv)
            );
        }
        unavailable_note(&mut md, &c.name, records);
        let _ = writeln!(md);
    }

    let _ = writeln!(md, "## Gate\n");
    if flags.is_empty() && invalid.is_empty() {
        let _ = writeln!(md, "No counter of a fixed-work cell moved past its threshold, no time-windowed cell was slower beyond its interval, and every sample was valid (0 lost, 0 duplicated, 0 out of order, 0 dead).\n");
    }
    let _ = writeln!(md, "Rules: exact counters of the fixed-work cells against per-counter thresholds; throughput of the time-windowed publish and dispatch cells flagged when the 95 % interval of candidate / base lies below {:.2} (needs three kept pairs; with fewer the ratio is indicative and not gated). See `bench/README.md`.\n", gate::THROUGHPUT_FLOOR);
    for f in &flags {
        let _ = writeln!(
            md,
            "- `{}` `{}`{}: {} → {} ({})",
            f.cell,
            f.counter,
            if f.counter == "throughput" {
                " (/s, interval below the floor)"
            } else {
                " (per unit)"
            },
            num(Some(f.base)),
            num(Some(f.candidate)),
            if f.ratio.is_finite() {
                format!("{:.3}x", f.ratio)
            } else {
                "regressed from zero".into()
            }
        );
    }
    for r in &invalid {
        let _ = writeln!(
            md,
            "- INVALID `{}` {} pair {}: {}",
            r.cell,
            r.side,
            r.pair,
            r.out.problems.join("; ")
        );
    }
    // Cluster cells: repeats are allowed only across a lane's change of
    // owner, which should not happen once the window starts.
    for r in records
        .iter()
        .filter(|r| r.out.exact.moved_repeats > 0 || r.out.lane_moves_in_window > 0)
    {
        let _ = writeln!(
            md,
            "- `{}` {} pair {}: {} repeat(s) explained by a lane's change of owner (before the window), {} lane(s) changed owner inside the steady window",
            r.cell, r.side, r.pair, r.out.exact.moved_repeats, r.out.lane_moves_in_window
        );
    }

    if !peers.is_empty() {
        let _ = writeln!(md, "\n## Peers (same PostgreSQL, same run)\n");
        let ours = sums
            .iter()
            .find(|(c, _)| c.name == "pg-dispatch-1n-tuned")
            .and_then(|(_, s)| s.rate[1]);
        let ours_pub = sums
            .iter()
            .find(|(c, _)| c.name == "pg-publish-p8-b100")
            .and_then(|(_, s)| s.rate[1]);
        let ours_one = sums
            .iter()
            .find(|(c, _)| c.name == "pg-publish-p8-b1")
            .and_then(|(_, s)| s.rate[1]);
        let _ = writeln!(md, "Jobs of about 200 bytes, enqueued 100 per call, then drained by no-op handlers; counters per job over the drain. Before that, 2,000 jobs enqueued one per call by 8 concurrent callers (pgbench floors: single-row commit transactions per second, 10 s, counters per transaction). Our dispatch is `pg-dispatch-1n-tuned` (candidate median, {}/s); our publish is `pg-publish-p8-b100` ({}/s); our one-event publish is `pg-publish-p8-b1` ({}/s).\n", num(ours), num(ours_pub), num(ours_one));
        let _ = writeln!(md, "| Peer | jobs | enqueue jobs/s | one per call jobs/s | drain jobs/s | our dispatch / its drain | our publish / its enqueue | our one-event publish / its one per call | WAL B/job | WAL records/job | statements/job | CPU ms/job app + db | note |");
        let _ = writeln!(
            md,
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
        );
        for p in peers {
            let c = |k: &str| p.counters.get(k).copied();
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} + {} | {} |",
                p.name,
                num(Some(p.jobs as f64)),
                num(p.enqueue_rate),
                num(p.enqueue_one_rate),
                num(p.drain_rate),
                match (ours, p.drain_rate) {
                    (Some(o), Some(d)) if d > 0.0 => format!("{:.2}", o / d),
                    _ => "–".into(),
                },
                match (ours_pub, p.enqueue_rate) {
                    (Some(o), Some(d)) if d > 0.0 => format!("{:.2}", o / d),
                    _ => "–".into(),
                },
                match (ours_one, p.enqueue_one_rate) {
                    (Some(o), Some(d)) if d > 0.0 => format!("{:.2}", o / d),
                    _ => "–".into(),
                },
                num(c("wal_bytes")),
                num(c("wal_records")),
                num(c("statements")),
                num(c("cpu_app_ms")),
                num(c("cpu_db_ms")),
                p.note
            );
        }
        if peers.iter().any(|p| !p.mixed.is_empty()) {
            let _ = writeln!(md, "\n### Peers under the mixed load\n");
            let _ = writeln!(md, "Each peer's workers running while 32 callers enqueue one job per call at the offered rate (2 s warm-up, 8 s window); latency from an enqueue call's return to its handler's start (ms; our side: `pg-mixed-<rate>`, candidate medians, from the publish call's return to the handler).\n");
            let _ = writeln!(md, "| Peer | offered/s | its accepted/s | its p50 / p99 / max | our accepted/s | our p50 / p99 / max | our p99 / its p99 |");
            let _ = writeln!(md, "| --- | ---: | ---: | --- | ---: | --- | ---: |");
            for p in peers {
                for m in &p.mixed {
                    let [acc, p50, p99, max] =
                        mixed_medians(records, &format!("pg-mixed-{}", m.offered), 1);
                    let l = &m.latency;
                    let _ = writeln!(
                        md,
                        "| {} | {} | {} | {} / {} / {} | {} | {} / {} / {} | {} |",
                        p.name,
                        num(Some(m.offered as f64)),
                        num(Some(m.accepted_rate)),
                        num(Some(l.p50)),
                        num(Some(l.p99)),
                        num(Some(l.max)),
                        num(acc),
                        num(p50),
                        num(p99),
                        num(max),
                        match p99 {
                            Some(o) if l.p99 > 0.0 => format!("{:.2}", o / l.p99),
                            _ => "–".into(),
                        },
                    );
                }
            }
        }
    }
    let _ = writeln!(md, "\n## Files\n\n`samples.jsonl` (one line per sample: cell, side, pair, spin, counters, exactness), `env.json` (machine, versions, PostgreSQL settings), `peers.json`. Method and thresholds: `bench/README.md`.");
    Report {
        markdown: md,
        gate_passed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::SampleOut;

    fn rec(side: &str, pair: usize, rate: f64, stmts: f64) -> Record {
        Record {
            cell: "c".into(),
            side: side.into(),
            rev: "x".into(),
            pair,
            position: 0,
            spin_ms: 100.0,
            load1: 1.0,
            started_at: String::new(),
            out: SampleOut {
                rate,
                counters: [("statements".to_string(), stmts)].into_iter().collect(),
                ..SampleOut::default()
            },
        }
    }

    #[test]
    fn pairs_give_ratios_and_counters_gate() {
        let recs = vec![
            rec("base", 0, 100.0, 0.05),
            rec("candidate", 0, 110.0, 0.05),
            rec("candidate", 1, 120.0, 0.05),
            rec("base", 1, 100.0, 0.05),
            rec("base", 2, 100.0, 0.05),
            rec("candidate", 2, 130.0, 0.05),
        ];
        let s = summarize_cell("c", &recs);
        let r = s.ratio.unwrap();
        assert_eq!(r.pairs, 3);
        assert!((r.ratio - 1.2).abs() < 1e-9);
        assert!(r.interval.is_some());
        assert!(s.flags.is_empty());
        let mut bad = recs.clone();
        for r in bad.iter_mut().filter(|r| r.side == "candidate") {
            r.out.counters.insert("statements".into(), 0.09);
        }
        assert_eq!(summarize_cell("c", &bad).flags.len(), 1);
    }

    #[test]
    fn counters_the_server_lacks_are_named_once() {
        let mut recs = vec![rec("base", 0, 1.0, 0.0), rec("candidate", 0, 1.0, 0.0)];
        for r in &mut recs {
            r.out.unavailable = vec!["mongo.requests".into(), "mongo.op.getmore".into()];
        }
        let mut md = String::new();
        unavailable_note(&mut md, "c", &recs);
        assert_eq!(
            md.trim(),
            "Not available on this server: `mongo.op.getmore`, `mongo.requests`."
        );
        let mut md = String::new();
        unavailable_note(&mut md, "other", &recs);
        assert!(md.is_empty());
    }

    #[test]
    fn numbers_are_grouped() {
        assert_eq!(num(Some(1234567.0)), "1,234,567");
        assert_eq!(num(Some(1325.4)), "1,325");
        assert_eq!(num(Some(4.07)), "4.070");
        assert_eq!(num(None), "–");
    }
}
