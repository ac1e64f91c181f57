//! Each handler's recent attempts on this node, for the dashboard's plots
//! (`GET /admin/handlers/{id}/activity`): a ring of 90 samples of 10 s
//! (15 minutes) per handler, in memory only.
//!
//! ```text
//!  Dispatcher::attempt_checked ── record(handler, now, delivered, duration)
//!        │
//!        ▼  per handler (one mutex for all):
//!  closed: [{index, delivered, failed, p99}; ≤ 89]   current: counts + histogram
//!        │  an attempt of a later interval closes the current one
//!        ▼
//!  samples(handler, now, wall) ─▶ one ActivitySample per interval since
//!                                 the start, at most 90, oldest first
//! ```
//!
//! An interval is `index = (now - origin) / 10 s` on the monotonic clock;
//! its wall time is derived from the `wall` given with `now`. Only the
//! interval under way holds a histogram (hdrhistogram, microseconds, 2
//! significant digits, about 13 KB); a closed one keeps its p99 only, so a
//! handler costs at most 90 small records plus one histogram. Callers pass
//! the time ([`crate::clock`]), so tests drive the ring with a
//! [`ManualClock`](crate::clock::ManualClock).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use hdrhistogram::Histogram;
use lanebus_api::{ActivitySample, ACTIVITY_INTERVAL_S, ACTIVITY_WINDOW_S};

/// Length of one sample.
pub const INTERVAL: Duration = Duration::from_secs(ACTIVITY_INTERVAL_S as u64);
/// Samples kept per handler (15 minutes of [`INTERVAL`]).
pub const POINTS: u64 = (ACTIVITY_WINDOW_S / ACTIVITY_INTERVAL_S) as u64;
/// Longest attempt duration told apart (longer ones count as this).
const MAX_MICROS: u64 = 3_600_000_000;

/// A closed interval.
#[derive(Debug, Clone, Copy)]
struct Point {
    index: u64,
    delivered: u64,
    failed: u64,
    p99_ms: Option<f64>,
}

/// One handler's samples.
#[derive(Debug)]
struct Ring {
    closed: VecDeque<Point>,
    index: u64,
    delivered: u64,
    failed: u64,
    micros: Histogram<u32>,
}

fn p99_ms(h: &Histogram<u32>) -> Option<f64> {
    (!h.is_empty()).then(|| h.value_at_quantile(0.99) as f64 / 1_000.0)
}

impl Ring {
    fn new(index: u64) -> Self {
        Ring {
            closed: VecDeque::new(),
            index,
            delivered: 0,
            failed: 0,
            micros: Histogram::new_with_bounds(1, MAX_MICROS, 2).expect("valid bounds"),
        }
    }

    /// Closes the interval under way if `index` is a later one, and drops
    /// the intervals that fell out of the window.
    fn roll(&mut self, index: u64) {
        if index <= self.index {
            return;
        }
        if self.delivered + self.failed > 0 {
            self.closed.push_back(Point {
                index: self.index,
                delivered: self.delivered,
                failed: self.failed,
                p99_ms: p99_ms(&self.micros),
            });
        }
        self.index = index;
        self.delivered = 0;
        self.failed = 0;
        self.micros.reset();
        while self
            .closed
            .front()
            .is_some_and(|p| p.index + POINTS <= index)
        {
            self.closed.pop_front();
        }
    }

    fn point(&self, index: u64) -> Option<Point> {
        if index == self.index {
            return Some(Point {
                index,
                delivered: self.delivered,
                failed: self.failed,
                p99_ms: p99_ms(&self.micros),
            });
        }
        self.closed.iter().find(|p| p.index == index).copied()
    }
}

/// The rings of every handler with an attempt on this node (see the
/// module docs); shared by the dispatcher and the API.
#[derive(Debug)]
pub struct HandlerActivity {
    origin: Instant,
    rings: Mutex<HashMap<String, Ring>>,
}

impl HandlerActivity {
    /// Empty rings whose intervals start at `origin` (the node's start).
    pub fn new(origin: Instant) -> Self {
        HandlerActivity {
            origin,
            rings: Mutex::default(),
        }
    }

    fn index(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin).as_secs() / INTERVAL.as_secs()
    }

    /// Counts one attempt of `handler_id` that ended at `now` after
    /// `duration`: delivered, or failed.
    pub fn record(&self, handler_id: &str, now: Instant, delivered: bool, duration: Duration) {
        let index = self.index(now);
        let mut rings = self.rings.lock().expect("not poisoned");
        let ring = match rings.get_mut(handler_id) {
            Some(r) => r,
            None => rings
                .entry(handler_id.to_owned())
                .or_insert_with(|| Ring::new(index)),
        };
        ring.roll(index);
        if delivered {
            ring.delivered += 1;
        } else {
            ring.failed += 1;
        }
        let micros = u64::try_from(duration.as_micros()).unwrap_or(MAX_MICROS);
        ring.micros.saturating_record(micros.clamp(1, MAX_MICROS));
    }

    /// The samples of `handler_id` as of `now` (monotonic) and `wall` (the
    /// same instant on the wall clock): one per interval since the origin,
    /// at most [`POINTS`], oldest first, the last the interval under way
    /// (its rates over the time elapsed in it, at least 1 s).
    pub fn samples(
        &self,
        handler_id: &str,
        now: Instant,
        wall: DateTime<Utc>,
    ) -> Vec<ActivitySample> {
        let last = self.index(now);
        let first = (last + 1).saturating_sub(POINTS);
        let mut rings = self.rings.lock().expect("not poisoned");
        let ring = rings.get_mut(handler_id);
        let ring = ring.map(|r| {
            r.roll(last);
            &*r
        });
        (first..=last)
            .map(|index| {
                let start = self.origin + INTERVAL * (index as u32);
                let seconds = if index == last {
                    now.saturating_duration_since(start).as_secs_f64().max(1.0)
                } else {
                    INTERVAL.as_secs_f64()
                };
                let p = ring.and_then(|r| r.point(index)).unwrap_or(Point {
                    index,
                    delivered: 0,
                    failed: 0,
                    p99_ms: None,
                });
                let back = chrono::Duration::from_std(now.saturating_duration_since(start))
                    .unwrap_or(chrono::Duration::MAX);
                ActivitySample {
                    at: wall.checked_sub_signed(back).unwrap_or(wall),
                    seconds,
                    deliveries: p.delivered,
                    failures: p.failed,
                    deliveries_per_s: p.delivered as f64 / seconds,
                    failures_per_s: p.failed as f64 / seconds,
                    p99_attempt_ms: p.p99_ms,
                }
            })
            .collect()
    }

    /// Forgets the handlers for which `keep` is false (deleted ones).
    pub fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        self.rings
            .lock()
            .expect("not poisoned")
            .retain(|id, _| keep(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn counts_land_in_their_interval_with_rates_per_second() {
        let clock = ManualClock::new();
        let a = HandlerActivity::new(clock.now());
        for i in 0..20 {
            a.record("h", clock.now(), i % 4 != 0, MS * (i + 1));
        }
        clock.advance(INTERVAL);
        a.record("h", clock.now(), false, 300 * MS);
        clock.advance(Duration::from_secs(4));

        let s = a.samples("h", clock.now(), clock.wall());
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].deliveries, s[0].failures), (15, 5));
        assert_eq!(s[0].seconds, 10.0);
        assert_eq!((s[0].deliveries_per_s, s[0].failures_per_s), (1.5, 0.5));
        // The interval under way: 4 s elapsed in it.
        assert_eq!((s[1].deliveries, s[1].failures, s[1].seconds), (0, 1, 4.0));
        assert_eq!(s[1].failures_per_s, 0.25);
        // Wall times: interval starts, 10 s apart, the last 4 s ago.
        assert_eq!((clock.wall() - s[1].at).num_milliseconds(), 4_000);
        assert_eq!((s[1].at - s[0].at).num_milliseconds(), 10_000);
        assert!(a.samples("other", clock.now(), clock.wall())[0]
            .p99_attempt_ms
            .is_none());
    }

    #[test]
    fn p99_is_of_the_interval_alone() {
        let clock = ManualClock::new();
        let a = HandlerActivity::new(clock.now());
        // 100 attempts of 1..=100 ms: p99 is 99 ms (2 significant digits).
        for ms in 1..=100u32 {
            a.record("h", clock.now(), true, MS * ms);
        }
        clock.advance(INTERVAL);
        a.record("h", clock.now(), true, Duration::from_micros(2_500));
        let s = a.samples("h", clock.now(), clock.wall());
        let p0 = s[0].p99_attempt_ms.expect("attempts");
        assert!((98.5..=99.5).contains(&p0), "{p0}");
        let p1 = s[1].p99_attempt_ms.expect("attempts");
        assert!((2.49..=2.52).contains(&p1), "{p1}");
        // A sub-millisecond attempt is told apart from 0.
        clock.advance(INTERVAL);
        a.record("h", clock.now(), true, Duration::from_micros(40));
        let s = a.samples("h", clock.now(), clock.wall());
        assert_eq!(s[2].p99_attempt_ms, Some(0.04));
    }

    #[test]
    fn the_window_keeps_fifteen_minutes_and_gaps_are_zeros() {
        let clock = ManualClock::new();
        let a = HandlerActivity::new(clock.now());
        a.record("h", clock.now(), true, MS);
        clock.advance(INTERVAL * 3);
        a.record("h", clock.now(), true, MS);
        let s = a.samples("h", clock.now(), clock.wall());
        assert_eq!(s.len(), 4);
        assert_eq!(
            s.iter().map(|x| x.deliveries).collect::<Vec<_>>(),
            [1, 0, 0, 1]
        );
        assert_eq!(s[1].p99_attempt_ms, None);

        // 15 minutes on: 90 samples, the first attempt has left the window,
        // the second is the oldest sample.
        clock.advance(INTERVAL * 89);
        let s = a.samples("h", clock.now(), clock.wall());
        assert_eq!(s.len(), POINTS as usize);
        assert_eq!(s[0].deliveries, 1);
        assert_eq!(s.iter().map(|x| x.deliveries).sum::<u64>(), 1);
        clock.advance(INTERVAL);
        let s = a.samples("h", clock.now(), clock.wall());
        assert_eq!(s.len(), POINTS as usize);
        assert_eq!(s.iter().map(|x| x.deliveries).sum::<u64>(), 0);
        assert!(
            a.rings.lock().unwrap()["h"].closed.is_empty(),
            "nothing old kept"
        );
    }

    #[test]
    fn an_interval_under_way_reads_at_least_one_second() {
        let clock = ManualClock::new();
        let a = HandlerActivity::new(clock.now());
        clock.advance(INTERVAL + 100 * MS);
        a.record("h", clock.now(), true, MS);
        let s = a.samples("h", clock.now(), clock.wall());
        assert_eq!((s[1].seconds, s[1].deliveries_per_s), (1.0, 1.0));
    }

    #[test]
    fn retain_forgets_deleted_handlers() {
        let clock = ManualClock::new();
        let a = HandlerActivity::new(clock.now());
        a.record("gone", clock.now(), true, MS);
        a.record("kept", clock.now(), false, MS);
        a.retain(|id| id == "kept");
        assert_eq!(
            a.samples("gone", clock.now(), clock.wall())[0].deliveries,
            0
        );
        assert_eq!(a.samples("kept", clock.now(), clock.wall())[0].failures, 1);
    }
}
