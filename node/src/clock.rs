//! The time the node's engines decide by.
//!
//! Engines ([`crate::claim`], [`crate::retry`], [`crate::auto_disable`],
//! [`crate::assignment`]'s lease and fencing decisions) never read the
//! clock: they take `now` as an argument. Their callers read it from a
//! [`Clock`]: [`SystemClock`] in a running node, a [`ManualClock`] that a
//! test advances by hand, so schedules of seconds or days are tested in
//! microseconds and deterministically.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

/// A source of time: monotonic for intervals and deadlines, wall for
/// timestamps stored or compared with stored ones.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Wall-clock now (UTC).
    fn wall(&self) -> DateTime<Utc>;
}

/// The system's clocks ([`Instant::now`], [`Utc::now`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told ([`ManualClock::advance`]): both its
/// monotonic and its wall time move by the same amount.
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    start_wall: DateTime<Utc>,
    elapsed: Mutex<Duration>,
}

impl ManualClock {
    /// A clock standing at the system's time of its creation.
    pub fn new() -> Self {
        ManualClock::at(Utc::now())
    }

    /// A clock standing at `wall` (its monotonic time starts at
    /// [`Instant::now`]: only differences of instants mean anything).
    pub fn at(wall: DateTime<Utc>) -> Self {
        ManualClock {
            start: Instant::now(),
            start_wall: wall,
            elapsed: Mutex::new(Duration::ZERO),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.elapsed.lock().expect("not poisoned") += by;
    }

    /// Moves the clock forward to `to`, if it is later than now.
    pub fn advance_to(&self, to: Instant) {
        let mut e = self.elapsed.lock().expect("not poisoned");
        *e = (*e).max(to.saturating_duration_since(self.start));
    }

    /// How far the clock has been moved since its creation.
    pub fn elapsed(&self) -> Duration {
        *self.elapsed.lock().expect("not poisoned")
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + self.elapsed()
    }

    fn wall(&self) -> DateTime<Utc> {
        let e = chrono::Duration::from_std(self.elapsed()).unwrap_or(chrono::Duration::MAX);
        self.start_wall
            .checked_add_signed(e)
            .unwrap_or(DateTime::<Utc>::MAX_UTC)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_both_times_together() {
        let c = ManualClock::new();
        let (t0, w0) = (c.now(), c.wall());
        assert_eq!((c.now(), c.wall()), (t0, w0));
        c.advance(Duration::from_millis(1_500));
        assert_eq!(c.now() - t0, Duration::from_millis(1_500));
        assert_eq!((c.wall() - w0).num_milliseconds(), 1_500);
        c.advance_to(t0 + Duration::from_secs(1));
        assert_eq!(c.now() - t0, Duration::from_millis(1_500), "never back");
        c.advance_to(t0 + Duration::from_secs(5 * 24 * 3600));
        assert_eq!((c.wall() - w0).num_days(), 5);
    }

    #[test]
    fn the_system_clock_moves_on_its_own() {
        let t0 = SystemClock.now();
        assert!(SystemClock.now() >= t0);
        assert!(SystemClock.wall() <= Utc::now());
    }
}
