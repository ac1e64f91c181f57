//! Seeded randomness: every random choice of a run (fault schedules, victims,
//! which webhook attempts fail, payload order) comes from here, so that a run
//! printed with `seed = S` repeats its schedule with `--seed S`.
//!
//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
//! generators", OOPSLA 2014) rather than a `rand` generator: its output is
//! fixed by this file, not by a dependency's version, so seeds stay valid
//! across upgrades.

use lanebus_testkit::lane::fnv1a;

/// A SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A generator for one named purpose of a run: independent streams per
    /// purpose, so adding a draw in one place does not shift the others.
    pub fn derive(seed: u64, purpose: &str) -> Rng {
        Rng::new(mix(seed ^ fnv1a(purpose.as_bytes())))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        // Lemire's multiply-shift: unbiased enough for schedules.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u32) -> bool {
        self.below(100) < u64::from(percent)
    }
}

/// The SplitMix64 finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stateless coin: whether the `n`th attempt of `(handler, event)` is one
/// that fails, with probability `percent`. Independent of arrival order, so
/// the same seed fails the same attempts in every rerun.
pub fn coin(seed: u64, handler: &str, event_id: &str, n: u32, percent: u32) -> bool {
    let h = fnv1a(handler.as_bytes()) ^ fnv1a(event_id.as_bytes()).rotate_left(17);
    mix(seed ^ h ^ u64::from(n).wrapping_mul(0x9e37_79b9)) % 100 < u64::from(percent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_purposes_differ() {
        let a: Vec<u64> = (0..5).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut x = Rng::derive(7, "faults");
        let mut y = Rng::derive(7, "faults");
        let mut z = Rng::derive(7, "payloads");
        let (xs, ys, zs): (Vec<_>, Vec<_>, Vec<_>) = (0..8)
            .map(|_| (x.next_u64(), y.next_u64(), z.next_u64()))
            .fold((vec![], vec![], vec![]), |mut acc, (a, b, c)| {
                acc.0.push(a);
                acc.1.push(b);
                acc.2.push(c);
                acc
            });
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    #[test]
    fn below_and_range_stay_in_bounds() {
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            assert!(r.below(3) < 3);
            let v = r.range(5, 9);
            assert!((5..=9).contains(&v));
        }
    }

    #[test]
    fn coin_rate_is_near_its_percent() {
        let hits = (0..10_000)
            .filter(|i| coin(3, "h", &format!("e{i}"), 1, 30))
            .count();
        assert!((2_600..3_400).contains(&hits), "{hits}");
        assert_eq!(coin(3, "h", "e1", 2, 30), coin(3, "h", "e1", 2, 30));
    }
}
