//! Statistics of interleaved samples: per-pair ratios, their median, a 95 %
//! interval, a verdict, and the CPU-spin noise rule (the reference's method,
//! seed `000_…`: "a sample that ran more than 1.25 times slower than the
//! quietest one is discarded together with its pair when two clean pairs
//! remain").

use serde::{Deserialize, Serialize};

/// A sample whose CPU spin took more than this times the quietest spin of the
/// run is noisy.
pub const NOISY_SPIN: f64 = 1.25;

/// Median of `xs` (mean of the middle two for an even count); `None` when
/// empty. NaNs are ignored.
pub fn median(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Two-sided 97.5 % quantile of Student's t for `df` degrees of freedom
/// (table values; 1.96 from 31 on).
pub fn t975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => T[df - 1],
        _ => 1.96,
    }
}

/// What an interval says about candidate / base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Fewer than three pairs: the ratio is indicative only.
    Indicative,
    /// The interval lies above 1.
    Higher,
    /// The interval lies below 1.
    Lower,
    /// The interval lies within 0.95 to 1.05.
    NoChange,
    /// The interval spans 1 and is wider than 0.95 to 1.05.
    Inconclusive,
}

/// Ratio summary of one cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RatioSummary {
    /// Median of the per-pair ratios (candidate / base).
    pub ratio: f64,
    /// 95 % interval, from three pairs on: `exp(mean(ln r) ± t·sd/√n)`.
    pub interval: Option<(f64, f64)>,
    /// Pairs used.
    pub pairs: usize,
    /// Verdict from the interval.
    pub verdict: Verdict,
}

/// Summarizes per-pair ratios (candidate / base, each > 0). `None` without
/// any usable ratio.
///
/// The headline is the median ratio; the interval is a t-interval on the
/// log ratios (a geometric-mean interval), the usual choice for ratios of
/// rates, given once there are three pairs.
pub fn summarize(ratios: &[f64]) -> Option<RatioSummary> {
    let r: Vec<f64> = ratios
        .iter()
        .copied()
        .filter(|x| x.is_finite() && *x > 0.0)
        .collect();
    let ratio = median(&r)?;
    let n = r.len();
    if n < 3 {
        return Some(RatioSummary {
            ratio,
            interval: None,
            pairs: n,
            verdict: Verdict::Indicative,
        });
    }
    let logs: Vec<f64> = r.iter().map(|x| x.ln()).collect();
    let mean = logs.iter().sum::<f64>() / n as f64;
    let var = logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let half = t975(n - 1) * (var / n as f64).sqrt();
    let (lo, hi) = ((mean - half).exp(), (mean + half).exp());
    let verdict = if lo >= 0.95 && hi <= 1.05 {
        Verdict::NoChange
    } else if lo > 1.0 {
        Verdict::Higher
    } else if hi < 1.0 {
        Verdict::Lower
    } else {
        Verdict::Inconclusive
    };
    Some(RatioSummary {
        ratio,
        interval: Some((lo, hi)),
        pairs: n,
        verdict,
    })
}

/// Which pairs to keep, given each pair's two spin times (ms): a pair with a
/// spin above [`NOISY_SPIN`] times the quietest spin of all is dropped, but
/// only if at least two clean pairs remain; otherwise every pair is kept.
pub fn clean_pairs(spins: &[(f64, f64)]) -> Vec<bool> {
    let quietest = spins
        .iter()
        .flat_map(|(a, b)| [*a, *b])
        .filter(|x| *x > 0.0)
        .fold(f64::INFINITY, f64::min);
    let keep: Vec<bool> = spins
        .iter()
        .map(|(a, b)| a.max(*b) <= NOISY_SPIN * quietest)
        .collect();
    if keep.iter().filter(|k| **k).count() >= 2 {
        keep
    } else {
        vec![true; spins.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_and_empty() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[f64::NAN, 5.0]), Some(5.0));
    }

    #[test]
    fn fewer_than_three_pairs_are_indicative_without_interval() {
        let s = summarize(&[1.2, 1.4]).unwrap();
        assert_eq!(s.verdict, Verdict::Indicative);
        assert!(s.interval.is_none());
        assert!((s.ratio - 1.3).abs() < 1e-12);
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[0.0, -1.0, f64::NAN]).is_none());
    }

    #[test]
    fn interval_and_verdicts() {
        // Identical ratios: zero-width interval at the ratio.
        let s = summarize(&[2.0, 2.0, 2.0]).unwrap();
        let (lo, hi) = s.interval.unwrap();
        assert!((lo - 2.0).abs() < 1e-9 && (hi - 2.0).abs() < 1e-9);
        assert_eq!(s.verdict, Verdict::Higher);
        assert_eq!(
            summarize(&[0.5, 0.52, 0.49]).unwrap().verdict,
            Verdict::Lower
        );
        assert_eq!(
            summarize(&[1.0, 1.01, 0.99]).unwrap().verdict,
            Verdict::NoChange
        );
        assert_eq!(
            summarize(&[0.7, 1.4, 1.0]).unwrap().verdict,
            Verdict::Inconclusive
        );
        // Hand check: ln ratios of (1, e, e^2) have mean 1, sd 1; t(2) = 4.303.
        let e = std::f64::consts::E;
        let s = summarize(&[1.0, e, e * e]).unwrap();
        let (lo, hi) = s.interval.unwrap();
        let half = 4.303 / 3f64.sqrt();
        assert!((lo.ln() - (1.0 - half)).abs() < 1e-9);
        assert!((hi.ln() - (1.0 + half)).abs() < 1e-9);
        assert!((s.ratio - e).abs() < 1e-12);
    }

    #[test]
    fn noisy_pairs_dropped_only_when_two_clean_remain() {
        // Pair 1 spun 1.5x the quietest: dropped, two clean pairs remain.
        assert_eq!(
            clean_pairs(&[(100.0, 102.0), (150.0, 101.0), (103.0, 100.0)]),
            vec![true, false, true]
        );
        // Only one clean pair would remain: keep all.
        assert_eq!(
            clean_pairs(&[(100.0, 102.0), (150.0, 101.0)]),
            vec![true, true]
        );
        // 1.25x exactly is still clean.
        assert_eq!(
            clean_pairs(&[(100.0, 125.0), (100.0, 100.0)]),
            vec![true, true]
        );
    }
}
