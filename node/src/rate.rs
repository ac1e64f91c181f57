//! Per-handler rate limits: one token bucket per handler on each node.
//!
//! A handler's [`RateLimit`] (`per_second`, `burst`) holds on each node
//! separately: a cluster of N nodes may send up to N times `per_second` to
//! the handler, as its lanes are spread over the nodes (a cluster-wide
//! bucket would need a store or Raft round trip per request).
//!
//! The bucket is kept as a theoretical arrival time (the generic cell rate
//! algorithm, GCRA, ITU-T I.371 / the "virtual scheduling" form; the same
//! as a token bucket of `burst` tokens refilled at `per_second`):
//! [`RateLimiter::reserve`] takes the next token and answers when it may be
//! used, so requests waiting for tokens go in the order they asked. A
//! delivery waiting for its token makes no attempt: its attempt number does
//! not change and nothing is written to the store.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use lanebus_store::RateLimit;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    limit: RateLimit,
    /// Theoretical arrival time of the next request.
    tat: Instant,
}

/// Token buckets by handler id. See the module docs.
#[derive(Debug, Default)]
pub struct RateLimiter {
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl RateLimiter {
    /// Takes a token of `handler_id`'s bucket for `limit` (a changed limit
    /// starts a new, full bucket) and answers how long to wait before using
    /// it: zero while the burst lasts, then `1 / per_second` apart.
    pub fn reserve(&self, handler_id: &str, limit: RateLimit) -> Duration {
        self.reserve_at(handler_id, limit, Instant::now())
    }

    fn reserve_at(&self, handler_id: &str, limit: RateLimit, now: Instant) -> Duration {
        let interval = Duration::from_secs(1) / limit.per_second.max(1);
        let burst = interval * limit.burst.max(1);
        let mut buckets = self.buckets.lock().expect("not poisoned");
        let bucket = buckets
            .entry(handler_id.to_owned())
            .or_insert(Bucket { limit, tat: now });
        if bucket.limit != limit {
            *bucket = Bucket { limit, tat: now };
        }
        let tat = bucket.tat.max(now) + interval;
        bucket.tat = tat;
        // The request may go once the bucket has room: `burst` before its
        // theoretical arrival time.
        tat.checked_sub(burst)
            .map_or(Duration::ZERO, |at| at.saturating_duration_since(now))
    }

    /// Forgets the buckets of handlers `keep` rejects (deleted ones, or
    /// ones without a limit any more).
    pub fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        self.buckets
            .lock()
            .expect("not poisoned")
            .retain(|id, _| keep(id));
    }

    /// Number of buckets (tests).
    pub fn len(&self) -> usize {
        self.buckets.lock().expect("not poisoned").len()
    }

    /// Whether there is no bucket (tests).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_one_per_interval() {
        let r = RateLimiter::default();
        let limit = RateLimit {
            per_second: 5,
            burst: 2,
        };
        let t0 = Instant::now();
        let waits: Vec<_> = (0..6).map(|_| r.reserve_at("h", limit, t0)).collect();
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![0, 0, 200, 400, 600, 800]);
        // After a quiet second the burst is back.
        let t1 = t0 + Duration::from_secs(3);
        assert_eq!(r.reserve_at("h", limit, t1), Duration::ZERO);
        assert_eq!(r.reserve_at("h", limit, t1), Duration::ZERO);
        assert_eq!(r.reserve_at("h", limit, t1).as_millis(), 200);
        // Another handler has its own bucket.
        assert_eq!(r.reserve_at("other", limit, t0), Duration::ZERO);
        // A changed limit starts over.
        let faster = RateLimit {
            per_second: 100,
            burst: 1,
        };
        assert_eq!(r.reserve_at("h", faster, t1), Duration::ZERO);
        assert_eq!(r.reserve_at("h", faster, t1).as_millis(), 10);
        r.retain(|id| id == "h");
        assert_eq!(r.len(), 1);
    }
}
