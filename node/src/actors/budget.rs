//! The node-wide budget of buffered payload bytes (`--buffer-bytes`).
//!
//! Every lane owner holds up to [`LaneConfig::buffer_cap`] deliveries in
//! memory, payloads included; 256 lanes of 1 MiB payloads would hold far
//! more than a node can afford. So the lanes of a node share one budget of
//! payload bytes ([`LaneConfig::buffer_bytes`], default 256 MiB): before a
//! claim a lane reserves room for the rows it asks for, and asks for fewer
//! rows when the budget is short ([`claim_rows`]).
//!
//! A claim cannot know the payload sizes it will read, so the reservation
//! uses an estimate of bytes per delivery ([`next_estimate`]): it starts at
//! [`INITIAL_ESTIMATE`] (1 MiB, the API's default payload limit, so a cold
//! node never overshoots by much), rises at once to a larger batch average
//! and comes down by halves toward a smaller one. After the claim the
//! reservation is released and the bytes actually accepted are counted as
//! held until their deliveries settle or are dropped from memory.
//!
//! While the budget is spent, lanes drop from memory what they hold but
//! cannot attempt (a disabled handler's deliveries, the followers of a key
//! being retried; they stay in the store, see [`crate::ordering`]), so such
//! deliveries cannot pin the budget and stop the claims of every lane.
//!
//! A lane that holds nothing may always claim one delivery, even when the
//! budget is spent, so no lane starves: the bound is therefore the budget
//! plus one payload per lane (plus, on PostgreSQL, the rest of a publishing
//! transaction a claim returns whole; see `lanebus_store::LaneClaim`).
//!
//! [`LaneConfig::buffer_cap`]: super::LaneConfig::buffer_cap
//! [`LaneConfig::buffer_bytes`]: super::LaneConfig::buffer_bytes

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::metrics;

/// Estimate of bytes per delivery before any claim returned one: 1 MiB.
pub const INITIAL_ESTIMATE: usize = 1 << 20;
/// Smallest estimate of bytes per delivery (rows carry more than payloads).
pub const MIN_ESTIMATE: usize = 256;

/// How many rows a lane may claim: up to `want`, as many as fit in the
/// budget's free bytes (`limit - used`) at `estimate` bytes each; at least
/// one if the lane holds nothing (`lane_rows == 0`), so no lane starves.
/// Zero means: do not claim now.
pub fn claim_rows(
    want: usize,
    lane_rows: usize,
    limit: usize,
    used: usize,
    estimate: usize,
) -> usize {
    let free = limit.saturating_sub(used);
    let fit = free / estimate.max(1);
    let rows = fit.min(want);
    if rows == 0 && lane_rows == 0 && want > 0 {
        1
    } else {
        rows
    }
}

/// The next estimate of bytes per delivery after a claim accepted `rows`
/// new deliveries of `bytes` payload bytes in all: up at once to a larger
/// average, down by half the difference toward a smaller one, never below
/// [`MIN_ESTIMATE`]. Unchanged when nothing was accepted.
pub fn next_estimate(current: usize, bytes: usize, rows: usize) -> usize {
    if rows == 0 {
        return current;
    }
    let avg = (bytes / rows).max(MIN_ESTIMATE);
    if avg >= current {
        avg
    } else {
        (current - (current - avg) / 2).max(MIN_ESTIMATE)
    }
}

/// Room reserved for one claim; give it back with [`BufferBudget::claimed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Rows the claim may ask for.
    pub rows: usize,
    /// Bytes reserved for them.
    pub bytes: usize,
}

/// The shared budget's state (one per node, in the lane board). The lane
/// owners of a node run on one thread, so reserving is not raced in
/// practice; the counters are atomic anyway.
#[derive(Debug)]
pub struct BufferBudget {
    /// Payload bytes of the deliveries the lanes hold.
    held: AtomicUsize,
    /// Bytes reserved by claims under way.
    reserved: AtomicUsize,
    /// Estimate of bytes per delivery.
    estimate: AtomicUsize,
}

impl Default for BufferBudget {
    fn default() -> Self {
        BufferBudget {
            held: AtomicUsize::new(0),
            reserved: AtomicUsize::new(0),
            estimate: AtomicUsize::new(INITIAL_ESTIMATE),
        }
    }
}

impl BufferBudget {
    /// Payload bytes held by the node's lanes now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Bytes reserved by claims under way now.
    pub fn reserved(&self) -> usize {
        self.reserved.load(Ordering::SeqCst)
    }

    /// The current estimate of bytes per delivery.
    pub fn estimate(&self) -> usize {
        self.estimate.load(Ordering::SeqCst)
    }

    /// Reserves room for a claim of up to `want` rows by a lane holding
    /// `lane_rows` deliveries, within `limit` bytes ([`claim_rows`]).
    pub fn reserve(&self, want: usize, lane_rows: usize, limit: usize) -> Reservation {
        let estimate = self.estimate();
        let used = self.held() + self.reserved.load(Ordering::SeqCst);
        let rows = claim_rows(want, lane_rows, limit, used, estimate);
        let bytes = rows.saturating_mul(estimate);
        let total = self.reserved.fetch_add(bytes, Ordering::SeqCst) + bytes;
        metrics::claim_reserved_bytes(total);
        Reservation { rows, bytes }
    }

    /// Gives a reservation back once its claim answered (or failed), and
    /// learns from the `rows` new deliveries of `bytes` bytes it accepted.
    pub fn claimed(&self, r: Reservation, bytes: usize, rows: usize) {
        let prev = self
            .reserved
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                Some(v.saturating_sub(r.bytes))
            })
            .unwrap_or(0);
        metrics::claim_reserved_bytes(prev.saturating_sub(r.bytes));
        let _ = self
            .estimate
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |e| {
                Some(next_estimate(e, bytes, rows))
            });
    }

    /// A lane's held bytes went from `before` to `after`.
    pub fn moved(&self, before: usize, after: usize) {
        let total = if after >= before {
            self.held.fetch_add(after - before, Ordering::SeqCst) + (after - before)
        } else {
            let d = before - after;
            let prev = self
                .held
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                    Some(v.saturating_sub(d))
                })
                .unwrap_or(0);
            prev.saturating_sub(d)
        };
        metrics::buffered_bytes(total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn rows_fit_the_free_bytes_up_to_the_wanted_rows() {
        // 256 MiB free at 1 MiB each: 256 rows, but only 100 wanted.
        assert_eq!(claim_rows(100, 5, 256 * MIB, 0, MIB), 100);
        // 10 MiB left: 10 rows.
        assert_eq!(claim_rows(256, 5, 256 * MIB, 246 * MIB, MIB), 10);
        // Small payloads: the row cap binds.
        assert_eq!(claim_rows(256, 0, 256 * MIB, 255 * MIB, 2048), 256);
    }

    #[test]
    fn a_spent_budget_stops_claims_but_an_empty_lane_gets_one() {
        assert_eq!(claim_rows(256, 3, 256 * MIB, 256 * MIB, MIB), 0);
        assert_eq!(claim_rows(256, 3, 256 * MIB, 300 * MIB, MIB), 0);
        assert_eq!(claim_rows(256, 0, 256 * MIB, 300 * MIB, MIB), 1);
        // Less than one estimate free counts as spent.
        assert_eq!(claim_rows(256, 1, 256 * MIB, 256 * MIB - 10, MIB), 0);
        assert_eq!(claim_rows(0, 0, 256 * MIB, 0, MIB), 0);
        // A zero estimate cannot divide by zero.
        assert_eq!(claim_rows(7, 0, 10, 0, 0), 7);
    }

    #[test]
    fn the_estimate_rises_at_once_and_falls_by_halves() {
        assert_eq!(next_estimate(MIB, 0, 0), MIB);
        assert_eq!(next_estimate(1000, 8 * 5000, 8), 5000);
        assert_eq!(next_estimate(MIB, 2048 * 10, 10), MIB - (MIB - 2048) / 2);
        let mut e = MIB;
        for _ in 0..40 {
            e = next_estimate(e, 2048 * 100, 100);
        }
        assert!((2048..2100).contains(&e), "{e}");
        // Tiny payloads: never below the floor.
        let mut e = 300;
        for _ in 0..20 {
            e = next_estimate(e, 10, 10);
            assert!(e >= MIN_ESTIMATE, "{e}");
        }
        assert!(e <= MIN_ESTIMATE + 1, "{e}");
    }

    #[test]
    fn reservations_and_held_bytes_bound_the_next_claims() {
        let b = BufferBudget::default();
        let limit = 8 * MIB;
        // Cold: 1 MiB per row is assumed.
        let r1 = b.reserve(256, 0, limit);
        assert_eq!(
            r1,
            Reservation {
                rows: 8,
                bytes: 8 * MIB
            }
        );
        // Spent by the reservation: another lane holding nothing gets one.
        assert_eq!(b.reserve(256, 0, limit).rows, 1);
        assert_eq!(b.reserve(256, 2, limit).rows, 0);
        // The first claim read 8 rows of 512 KiB: 4 MiB held.
        b.claimed(r1, 4 * MIB, 8);
        b.moved(0, 4 * MIB);
        assert_eq!(b.held(), 4 * MIB);
        assert_eq!(b.estimate(), MIB - (MIB - MIB / 2) / 2);
        // Settled deliveries free room.
        b.moved(4 * MIB, MIB);
        assert_eq!(b.held(), MIB);
        b.moved(MIB, 0);
        assert_eq!(b.held(), 0);
    }
}
