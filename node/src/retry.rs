//! Retry schedule of a delivery: what to do after an attempt (pure code).
//!
//! After every attempt the [`KeyRunner`](crate::actors::KeyRunner) asks
//! [`decide`] what follows: complete, try again after a delay, or
//! dead-letter, and [`due_at`] when the retry is due. No IO and no clock
//! here: the caller passes the attempt number, the outcome, a random source
//! and `now`, so unit tests drive every branch and whole schedules on a
//! [`ManualClock`](crate::clock::ManualClock).
//!
//! # Backoff
//!
//! Exponential backoff with *full jitter*, as in the AWS Architecture Blog,
//! "Exponential Backoff And Jitter" (Marc Brooker, 2015,
//! <https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/>):
//!
//! ```text
//! ceiling(n) = min(cap, base * factor^(n-1))     n = attempts made so far (>= 1)
//! delay(n)   = uniform(0, ceiling(n))
//! ```
//!
//! Full jitter spreads the retries of many failing keys over the whole
//! window, so a recovering endpoint is not hit by synchronized waves.
//!
//! # `Retry-After`
//!
//! A `429 Too Many Requests` or `503 Service Unavailable` answer with a
//! `Retry-After` header (RFC 9110 section 10.2.3: delta-seconds or an
//! HTTP-date) sets the delay instead of the backoff, capped at
//! [`RetryPolicy::max_retry_after`], because the endpoint said when it can
//! take the request again. It is floored at [`RetryPolicy::base`]: a
//! `Retry-After: 0` (or a date in the past) must not turn a 429/503 into a
//! tight loop against an endpoint that is already overloaded.
//!
//! # Bounds
//!
//! No delay is ever longer than [`MAX_DELAY`] (24 hours), whatever the
//! policy says, so `now + delay` cannot overflow a timestamp.
//!
//! # Attempts
//!
//! A handler's `max_attempts` counts every attempt, the first one included:
//! with `max_attempts = 8` the eighth failure dead-letters the delivery.
//!
//! # `410 Gone`
//!
//! [`AttemptOutcome::Gone`] leads to [`Decision::Disable`] at any attempt:
//! the handler is disabled and its deliveries are kept, not dead-lettered.

use std::time::{Duration, SystemTime};

use chrono::{DateTime, Utc};

/// Longest delay [`decide`] ever returns (24 hours), whatever the policy:
/// the node's configuration refuses larger `cap`/`base` values, and this
/// keeps `now + delay` far from the end of any timestamp type.
pub const MAX_DELAY: Duration = Duration::from_secs(24 * 3600);

/// Backoff parameters. The defaults suit webhooks; tests shorten `base`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Ceiling of the first retry's delay (default 500 ms); also the
    /// shortest delay a `Retry-After` answer can ask for.
    pub base: Duration,
    /// Growth of the ceiling per failed attempt (default 2.0).
    pub factor: f64,
    /// Largest ceiling of one delay (default 10 minutes).
    pub cap: Duration,
    /// Largest delay a `Retry-After` header may ask for (default 10 minutes).
    pub max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            base: Duration::from_millis(500),
            factor: 2.0,
            cap: Duration::from_secs(600),
            max_retry_after: Duration::from_secs(600),
        }
    }
}

impl RetryPolicy {
    /// Ceiling of the delay after `attempts` failed attempts (`attempts >= 1`):
    /// `min(cap, base * factor^(attempts-1))`.
    pub fn ceiling(&self, attempts: u32) -> Duration {
        let exp = attempts.saturating_sub(1).min(64) as i32;
        let secs = self.base.as_secs_f64() * self.factor.max(1.0).powi(exp);
        if !secs.is_finite() || secs >= self.cap.as_secs_f64() {
            self.cap
        } else {
            Duration::from_secs_f64(secs)
        }
    }

    /// Full-jitter delay after `attempts` failed attempts; `unit` is a random
    /// number in `[0, 1)`.
    pub fn backoff(&self, attempts: u32, unit: f64) -> Duration {
        self.ceiling(attempts).mul_f64(unit.clamp(0.0, 1.0))
    }
}

/// What an attempt came to, as the sender classified it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The handler took the delivery (webhook: a 2xx answer).
    Delivered,
    /// The attempt failed; `error` is kept as the delivery's `last_error`.
    Failed {
        /// Human-readable reason (`http 500`, `timeout after 10000 ms`, ...).
        error: String,
        /// Delay the endpoint asked for (`Retry-After` on 429/503).
        retry_after: Option<Duration>,
    },
    /// The endpoint answered `410 Gone`: a failed attempt that also disables
    /// the handler (docs/design.md section 5). `error` is kept as `last_error`.
    Gone {
        /// Human-readable reason (`http 410`).
        error: String,
    },
}

/// What to do after an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Record the completion.
    Complete,
    /// Record the failed attempt and try again after `delay`.
    Retry {
        /// Wait before the next attempt.
        delay: Duration,
        /// Error of this attempt.
        error: String,
    },
    /// The retry policy is exhausted: move the delivery to the dead letters.
    DeadLetter {
        /// Error of the last attempt.
        error: String,
    },
    /// The endpoint is gone (`410`): record the failed attempt (due at
    /// once, so it goes first when the handler is enabled again), disable
    /// the handler and keep the delivery without attempting it. Never a
    /// dead letter, whatever the attempt count.
    Disable {
        /// Error of this attempt.
        error: String,
    },
}

/// Decides after attempt number `attempt` (1 for the first) of a handler
/// allowing `max_attempts`; `unit` is a random number in `[0, 1)` for the
/// jitter.
pub fn decide(
    policy: &RetryPolicy,
    attempt: u32,
    max_attempts: u32,
    outcome: &AttemptOutcome,
    unit: f64,
) -> Decision {
    match outcome {
        AttemptOutcome::Delivered => Decision::Complete,
        AttemptOutcome::Gone { error } => Decision::Disable {
            error: error.clone(),
        },
        AttemptOutcome::Failed { error, retry_after } => {
            if attempt >= max_attempts.max(1) {
                return Decision::DeadLetter {
                    error: error.clone(),
                };
            }
            let delay = match retry_after {
                // Floored at `base` (a `Retry-After: 0` must not hammer the
                // endpoint), then capped as asked.
                Some(d) => (*d).max(policy.base).min(policy.max_retry_after),
                None => policy.backoff(attempt, unit),
            }
            .min(MAX_DELAY);
            Decision::Retry {
                delay,
                error: error.clone(),
            }
        }
    }
}

/// When a retry `delay` after `now` is due: `now + delay`, the delay bounded
/// by [`MAX_DELAY`] so the sum cannot overflow (and panic) whatever the
/// policy asked for.
pub fn due_at(now: DateTime<Utc>, delay: Duration) -> DateTime<Utc> {
    let delay =
        chrono::Duration::from_std(delay.min(MAX_DELAY)).unwrap_or(chrono::Duration::zero());
    now.checked_add_signed(delay).unwrap_or(now)
}

/// Parses a `Retry-After` header value: delta-seconds (`120`) or an
/// HTTP-date (`Wed, 21 Oct 2015 07:28:00 GMT`), relative to `now`. A date in
/// the past gives zero; anything unparsable gives `None`.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    fn failed(retry_after: Option<Duration>) -> AttemptOutcome {
        AttemptOutcome::Failed {
            error: "http 500".into(),
            retry_after,
        }
    }

    #[test]
    fn ceiling_grows_by_factor_and_stops_at_cap() {
        let p = RetryPolicy::default();
        assert_eq!(p.ceiling(1), Duration::from_millis(500));
        assert_eq!(p.ceiling(2), Duration::from_millis(1000));
        assert_eq!(p.ceiling(5), Duration::from_millis(8000));
        assert_eq!(p.ceiling(20), Duration::from_secs(600));
        assert_eq!(p.ceiling(u32::MAX), Duration::from_secs(600));
    }

    #[test]
    fn full_jitter_stays_within_zero_and_ceiling() {
        let p = RetryPolicy::default();
        assert_eq!(p.backoff(3, 0.0), Duration::ZERO);
        assert_eq!(p.backoff(3, 0.5), Duration::from_millis(1000));
        assert!(p.backoff(3, 0.999_999) <= p.ceiling(3));
        // Out-of-range randomness is clamped rather than trusted.
        assert_eq!(p.backoff(3, 7.0), p.ceiling(3));
    }

    #[test]
    fn success_completes_whatever_the_attempt() {
        let p = RetryPolicy::default();
        assert_eq!(
            decide(&p, 8, 8, &AttemptOutcome::Delivered, 0.3),
            Decision::Complete
        );
    }

    #[test]
    fn failures_retry_until_max_attempts_then_dead_letter() {
        let p = RetryPolicy::default();
        for attempt in 1..8 {
            match decide(&p, attempt, 8, &failed(None), 0.5) {
                Decision::Retry { delay, error } => {
                    assert_eq!(delay, p.ceiling(attempt) / 2);
                    assert_eq!(error, "http 500");
                }
                other => panic!("attempt {attempt}: {other:?}"),
            }
        }
        assert_eq!(
            decide(&p, 8, 8, &failed(None), 0.5),
            Decision::DeadLetter {
                error: "http 500".into()
            }
        );
        // max_attempts = 1: the first failure is final; 0 is read as 1.
        assert!(matches!(
            decide(&p, 1, 1, &failed(None), 0.5),
            Decision::DeadLetter { .. }
        ));
        assert!(matches!(
            decide(&p, 1, 0, &failed(None), 0.5),
            Decision::DeadLetter { .. }
        ));
    }

    #[test]
    fn retry_after_overrides_backoff_and_is_capped() {
        let p = RetryPolicy::default();
        let d = decide(&p, 1, 8, &failed(Some(Duration::from_secs(30))), 0.0);
        assert_eq!(
            d,
            Decision::Retry {
                delay: Duration::from_secs(30),
                error: "http 500".into()
            }
        );
        let d = decide(&p, 1, 8, &failed(Some(Duration::from_secs(86_400))), 0.0);
        assert_eq!(
            d,
            Decision::Retry {
                delay: Duration::from_secs(600),
                error: "http 500".into()
            }
        );
    }

    #[test]
    fn gone_disables_instead_of_retrying_or_dead_lettering() {
        let p = RetryPolicy::default();
        let gone = AttemptOutcome::Gone {
            error: "http 410".into(),
        };
        for attempt in [1, 7, 8, 100] {
            assert_eq!(
                decide(&p, attempt, 8, &gone, 0.5),
                Decision::Disable {
                    error: "http 410".into()
                },
                "attempt {attempt}"
            );
        }
    }

    #[test]
    fn retry_after_zero_or_tiny_is_floored_at_base() {
        let p = RetryPolicy::default();
        for asked in [Duration::ZERO, Duration::from_millis(1), p.base / 2] {
            assert_eq!(
                decide(&p, 1, 8, &failed(Some(asked)), 0.0),
                Decision::Retry {
                    delay: p.base,
                    error: "http 500".into()
                },
                "Retry-After of {asked:?}"
            );
        }
        // Longer than base: taken as asked.
        let d = decide(&p, 1, 8, &failed(Some(p.base * 3)), 0.0);
        assert!(matches!(d, Decision::Retry { delay, .. } if delay == p.base * 3));
    }

    #[test]
    fn no_delay_exceeds_a_day_whatever_the_policy() {
        let huge = RetryPolicy {
            base: Duration::from_secs(u64::MAX / 4),
            factor: 1e300,
            cap: Duration::MAX,
            max_retry_after: Duration::MAX,
        };
        for outcome in [failed(None), failed(Some(Duration::MAX))] {
            let Decision::Retry { delay, .. } = decide(&huge, 5, 8, &outcome, 0.99) else {
                panic!("expected a retry");
            };
            assert!(delay <= MAX_DELAY, "{delay:?}");
            // The key runner adds it to the clock: that must not panic.
            let now = ManualClock::new().wall();
            assert_eq!((due_at(now, delay) - now).to_std().unwrap(), delay);
        }
        // Nor at the end of time, or with a longer delay than decided.
        let end = DateTime::<Utc>::MAX_UTC;
        assert_eq!(due_at(end, Duration::from_secs(1)), end);
        let now = ManualClock::new().wall();
        assert_eq!(
            (due_at(now, Duration::MAX) - now).to_std().unwrap(),
            MAX_DELAY
        );
    }

    /// One delivery failing every attempt, on a manual clock: each retry is
    /// due at the decided delay after the previous attempt, and the eighth
    /// failure of `max_attempts = 8` dead-letters it, 63.5 s after the
    /// first attempt with the ceilings as delays.
    #[test]
    fn a_failing_delivery_is_retried_on_schedule_then_dead_lettered() {
        let clock = ManualClock::new();
        let p = RetryPolicy::default();
        let first = clock.wall();
        let mut dues = Vec::new();
        let mut attempt = 1;
        let dead = loop {
            match decide(&p, attempt, 8, &failed(None), 1.0) {
                Decision::Retry { delay, .. } => {
                    let due = due_at(clock.wall(), delay);
                    dues.push((due - first).num_milliseconds());
                    clock.advance((due - clock.wall()).to_std().unwrap());
                    attempt += 1;
                }
                other => break other,
            }
        };
        assert_eq!(
            dues,
            [500, 1_500, 3_500, 7_500, 15_500, 31_500, 63_500],
            "ms after the first attempt"
        );
        assert_eq!(attempt, 8);
        assert!(matches!(dead, Decision::DeadLetter { .. }), "{dead:?}");
        assert_eq!(clock.elapsed(), Duration::from_millis(63_500));
    }

    /// A 503 with an HTTP-date `Retry-After` two minutes ahead of the
    /// (manual) clock: the retry is due then, not at the backoff.
    #[test]
    fn a_retry_after_date_sets_the_due_time() {
        let clock = ManualClock::at(DateTime::from_timestamp(1_445_412_480, 0).unwrap());
        let now = SystemTime::from(clock.wall());
        let asked = parse_retry_after("Wed, 21 Oct 2015 07:30:00 GMT", now);
        assert_eq!(asked, Some(Duration::from_secs(120)));
        let Decision::Retry { delay, .. } = decide(&p(), 1, 8, &failed(asked), 0.5) else {
            panic!("a retry");
        };
        let due = due_at(clock.wall(), delay);
        assert_eq!(due.to_rfc3339(), "2015-10-21T07:30:00+00:00");
        // Past the cap: ten minutes after the clock.
        let far = parse_retry_after("Thu, 22 Oct 2015 07:30:00 GMT", now);
        let Decision::Retry { delay, .. } = decide(&p(), 1, 8, &failed(far), 0.5) else {
            panic!("a retry");
        };
        assert_eq!(
            due_at(clock.wall(), delay).to_rfc3339(),
            "2015-10-21T07:38:00+00:00"
        );
    }

    fn p() -> RetryPolicy {
        RetryPolicy::default()
    }

    #[test]
    fn retry_after_parses_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Wed, 21 Oct 2015 07:28:00 GMT").unwrap();
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:29:30 GMT", now),
            Some(Duration::from_secs(90))
        );
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-5", now), None);
    }
}
