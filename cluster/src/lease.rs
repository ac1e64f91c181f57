//! Lease arithmetic, on monotonic milliseconds supplied by the caller (so
//! tests control time).
//!
//! ```text
//! holder:  sent renewal ──────── committed ─── ... ─── sent + lease: stop lanes
//! leader:        applied renewal ───────────── ... ─── applied + lease + margin: reassign
//! ```
//!
//! The holder counts from when it *sent* the renewal that was committed, the
//! leader from when it *applied* it, which is later; the margin absorbs clock
//! rate differences between the two machines. So the holder has stopped its
//! lanes before the leader gives them away, even without any message between
//! them (docs/design.md section 3, "Leases").
//!
//! An attempt must end before its holder's lease does: it starts only when
//! the remaining lease covers its handler's timeout plus
//! [`ATTEMPT_SLACK_MS`] (the node's `attempt_may_start`), so an attempt
//! never runs past the holder's lease end, let alone past the leader's
//! reassignment at `applied + lease + margin`. Renewals keep room for that
//! only if the lease is at least the longest handler timeout plus one
//! renewal interval plus the slack ([`LeaseConfig::validate`]).

use std::fmt;

/// Milliseconds an attempt's start leaves on top of its handler's timeout
/// before the end of its owner's lease (or of a drain): for the time
/// between the check and the send, and the timer's own lateness.
pub const ATTEMPT_SLACK_MS: u64 = 100;

/// Lease settings, all in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long a committed renewal keeps a node's lanes.
    pub lease_ms: u64,
    /// How often a node sends a renewal.
    pub renew_interval_ms: u64,
    /// Extra wait of the leader past a lease before reassigning.
    pub margin_ms: u64,
}

impl Default for LeaseConfig {
    /// 15 s lease renewed every 2 s, 3 s margin: room for handler timeouts
    /// up to 12.9 s, above the default of 10 s (see
    /// [`LeaseConfig::validate`]).
    fn default() -> Self {
        LeaseConfig {
            lease_ms: 15_000,
            renew_interval_ms: 2_000,
            margin_ms: 3_000,
        }
    }
}

/// Why a lease configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseConfigError {
    /// The lease is shorter than the longest handler timeout plus one
    /// renewal interval plus [`ATTEMPT_SLACK_MS`].
    TimeoutNotCovered {
        /// Configured lease.
        lease_ms: u64,
        /// Configured renewal interval.
        renew_interval_ms: u64,
        /// Longest handler timeout.
        timeout_ms: u64,
    },
    /// Fewer than three renewals fit in one lease.
    RenewTooSlow {
        /// Configured lease.
        lease_ms: u64,
        /// Configured renewal interval.
        renew_interval_ms: u64,
    },
    /// A zero value.
    Zero(&'static str),
}

impl fmt::Display for LeaseConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseConfigError::TimeoutNotCovered {
                lease_ms,
                renew_interval_ms,
                timeout_ms,
            } => write!(
                f,
                "lease_ms {lease_ms} must be at least the longest handler timeout ({timeout_ms} ms) \
                 plus renew_interval_ms ({renew_interval_ms}) plus {ATTEMPT_SLACK_MS} ms: an attempt \
                 starts only while the remaining lease covers its timeout plus {ATTEMPT_SLACK_MS} ms \
                 (so that it ends before the lease does and cannot overlap the new owner's next \
                 delivery of the same key), and the lease left just before a renewal is the lease \
                 less one renewal interval; handler timeouts up to {} ms fit",
                LeaseConfig {
                    lease_ms: *lease_ms,
                    renew_interval_ms: *renew_interval_ms,
                    margin_ms: 0
                }
                .longest_timeout_ms()
            ),
            LeaseConfigError::RenewTooSlow { lease_ms, renew_interval_ms } => write!(
                f,
                "renew_interval_ms {renew_interval_ms} must be at most a third of lease_ms {lease_ms}, \
                 so that one lost renewal does not cost the lease"
            ),
            LeaseConfigError::Zero(name) => write!(f, "{name} must be greater than 0"),
        }
    }
}

impl std::error::Error for LeaseConfigError {}

impl LeaseConfig {
    /// The longest handler timeout these settings leave room for, in
    /// milliseconds: `lease_ms - renew_interval_ms - ATTEMPT_SLACK_MS`
    /// (0 when that is negative). Just before a renewal is committed the
    /// holder has about `lease_ms - renew_interval_ms` left, and an attempt
    /// starts only when the remaining lease covers its timeout plus
    /// [`ATTEMPT_SLACK_MS`].
    pub fn longest_timeout_ms(&self) -> u64 {
        self.lease_ms
            .saturating_sub(self.renew_interval_ms)
            .saturating_sub(ATTEMPT_SLACK_MS)
    }

    /// Checks the settings against the longest handler timeout: the lease
    /// must be at least that timeout plus one renewal interval plus
    /// [`ATTEMPT_SLACK_MS`] ([`longest_timeout_ms`](Self::longest_timeout_ms)),
    /// and a renewal interval at most a third of the lease.
    ///
    /// # Errors
    /// [`LeaseConfigError`] saying which rule is broken and why it matters.
    pub fn validate(&self, longest_handler_timeout_ms: u64) -> Result<(), LeaseConfigError> {
        if self.lease_ms == 0 {
            return Err(LeaseConfigError::Zero("lease_ms"));
        }
        if self.renew_interval_ms == 0 {
            return Err(LeaseConfigError::Zero("renew_interval_ms"));
        }
        if longest_handler_timeout_ms > self.longest_timeout_ms() {
            return Err(LeaseConfigError::TimeoutNotCovered {
                lease_ms: self.lease_ms,
                renew_interval_ms: self.renew_interval_ms,
                timeout_ms: longest_handler_timeout_ms,
            });
        }
        if self.renew_interval_ms.saturating_mul(3) > self.lease_ms {
            return Err(LeaseConfigError::RenewTooSlow {
                lease_ms: self.lease_ms,
                renew_interval_ms: self.renew_interval_ms,
            });
        }
        Ok(())
    }

    /// Leader side: whether a node whose last renewal was applied at
    /// `applied_at_ms` has lost its lanes at `now_ms`.
    pub fn expired_for_leader(&self, applied_at_ms: u64, now_ms: u64) -> bool {
        now_ms
            >= applied_at_ms
                .saturating_add(self.lease_ms)
                .saturating_add(self.margin_ms)
    }
}

/// Holder side: the node's own view of its lease.
///
/// After a lapse (the process was frozen, or cut off) the node's applied
/// state may be stale: the leader may have given its lanes away meanwhile.
/// The renewal that ends a lapse therefore also asks the node to apply the
/// log up to that renewal's index before it works lanes again
/// ([`HolderLease::may_work`]): everything the leader decided before the
/// renewal is then known here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HolderLease {
    /// Send time of the newest renewal known to be committed.
    sent_at_ms: Option<u64>,
    /// Log index to apply before working lanes again (after a lapse).
    resume_index: u64,
}

impl HolderLease {
    /// A renewal sent at `sent_at_ms` was committed (at log `index`, when
    /// known). Older acknowledgements arriving late never shorten the lease.
    /// A renewal sent after the lease had lapsed (or the first one) sets
    /// the index to catch up to.
    pub fn committed(&mut self, cfg: &LeaseConfig, sent_at_ms: u64, index: Option<u64>) {
        let lapsed = self
            .sent_at_ms
            .is_none_or(|s| s.saturating_add(cfg.lease_ms) <= sent_at_ms);
        if lapsed {
            if let Some(i) = index {
                self.resume_index = self.resume_index.max(i);
            }
        }
        self.sent_at_ms = Some(self.sent_at_ms.map_or(sent_at_ms, |s| s.max(sent_at_ms)));
    }

    /// Whether the node may work its lanes at `now_ms` with its state
    /// machine applied up to `applied_index`: the lease is valid and, after
    /// a lapse, the log is applied up to the renewal that ended it.
    pub fn may_work(&self, cfg: &LeaseConfig, now_ms: u64, applied_index: u64) -> bool {
        self.valid(cfg, now_ms) && applied_index >= self.resume_index
    }

    /// Milliseconds the lanes may still be worked at `now_ms` (0 when lost or
    /// never held).
    pub fn remaining_ms(&self, cfg: &LeaseConfig, now_ms: u64) -> u64 {
        self.sent_at_ms
            .map_or(0, |s| s.saturating_add(cfg.lease_ms).saturating_sub(now_ms))
    }

    /// When the lease ends, in the caller's milliseconds (`None`: never
    /// held). A node may work its lanes until then; an attempt started at
    /// `now_ms` must end by then.
    pub fn ends_at_ms(&self, cfg: &LeaseConfig) -> Option<u64> {
        self.sent_at_ms.map(|s| s.saturating_add(cfg.lease_ms))
    }

    /// Whether the node may keep working its lanes at `now_ms`.
    pub fn valid(&self, cfg: &LeaseConfig, now_ms: u64) -> bool {
        self.remaining_ms(cfg, now_ms) > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: LeaseConfig = LeaseConfig {
        lease_ms: 3_000,
        renew_interval_ms: 500,
        margin_ms: 1_000,
    };

    #[test]
    fn lease_shorter_than_handler_timeout_is_refused_with_the_reason() {
        let err = CFG.validate(5_000).unwrap_err();
        assert!(
            err.to_string().contains("next delivery of the same key"),
            "{err}"
        );
        // 3,000 ms lease, 500 ms renewals: up to 2,400 ms.
        assert_eq!(CFG.longest_timeout_ms(), 2_400);
        assert!(CFG.validate(2_400).is_ok());
        let err = CFG.validate(2_401).unwrap_err();
        assert!(
            err.to_string()
                .contains("handler timeouts up to 2400 ms fit"),
            "{err}"
        );
        assert_eq!(LeaseConfig::default().longest_timeout_ms(), 12_900);
        assert!(matches!(
            LeaseConfig {
                renew_interval_ms: 1_500,
                ..CFG
            }
            .validate(10),
            Err(LeaseConfigError::RenewTooSlow { .. })
        ));
        assert!(LeaseConfig { lease_ms: 0, ..CFG }.validate(0).is_err());
    }

    #[test]
    fn holder_stops_before_leader_reassigns() {
        let mut h = HolderLease::default();
        assert!(!h.valid(&CFG, 0), "no lease before the first renewal");
        h.committed(&CFG, 1_000, None); // sent at 1,000; the leader applies it later, at 1,200.
        assert_eq!(h.remaining_ms(&CFG, 2_000), 2_000);
        assert_eq!(h.ends_at_ms(&CFG), Some(4_000));
        assert!(h.valid(&CFG, 3_999));
        assert!(!h.valid(&CFG, 4_000));
        assert!(!CFG.expired_for_leader(1_200, 4_000));
        assert!(!CFG.expired_for_leader(1_200, 5_199));
        assert!(CFG.expired_for_leader(1_200, 5_200));
    }

    #[test]
    fn after_a_lapse_the_log_must_be_applied_up_to_the_renewal() {
        let mut h = HolderLease::default();
        h.committed(&CFG, 1_000, Some(10));
        assert!(!h.may_work(&CFG, 1_500, 9), "first renewal: catch up first");
        assert!(h.may_work(&CFG, 1_500, 10));
        h.committed(&CFG, 1_500, Some(20)); // within the lease: no catch-up
        assert!(h.may_work(&CFG, 2_000, 10));
        // Frozen from 2,000 to 9,000: the lease lapsed at 4,500.
        assert!(!h.may_work(&CFG, 9_000, 10));
        h.committed(&CFG, 9_000, Some(50));
        assert!(h.valid(&CFG, 9_100));
        assert!(
            !h.may_work(&CFG, 9_100, 49),
            "the leader may have moved its lanes"
        );
        assert!(h.may_work(&CFG, 9_100, 50));
    }

    #[test]
    fn late_acknowledgement_of_an_older_renewal_does_not_shorten_the_lease() {
        let mut h = HolderLease::default();
        h.committed(&CFG, 2_000, None);
        h.committed(&CFG, 1_000, None);
        assert!(h.valid(&CFG, 4_500));
    }
}
