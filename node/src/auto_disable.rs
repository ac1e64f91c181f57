//! Auto-disable of a handler that keeps failing (pure code; the
//! [`HandlerCatalog`](crate::catalog::HandlerCatalog) carries it out).
//!
//! The start of a handler's run of failures is its *failing mark*
//! ([`Handler::failing_since`](lanebus_store::Handler::failing_since)), kept
//! in the store so that all nodes share it and a restart does not reset it.
//! After each attempt [`step`] says what the outcome changes, from the
//! handler as the catalog last loaded it:
//!
//! - a failure while it shows no mark sets one ([`Step::Mark`]);
//! - a success while it shows one clears it;
//! - a failure of an enabled handler whose mark is at least the
//!   auto-disable period old ([`crate::catalog::DEFAULT_AUTO_DISABLE_AFTER`]
//!   by default) disables it, with reason `failing` ([`Step::Disable`]);
//! - anything else changes nothing.
//!
//! [`Written`] keeps each change to one write per catalog entry: until a
//! reload brings the changed handler, every outcome would ask for it again.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use lanebus_store::HandlerState;

/// What an attempt's outcome asks of the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing changes.
    Nothing,
    /// Set (`true`: a run of failures starts now) or clear (`false`) the
    /// handler's failing mark.
    Mark {
        /// Whether the handler is failing from now on.
        failing: bool,
    },
    /// Disable the handler (reason `failing`): it has failed without a
    /// success since `since`, for the auto-disable period or longer.
    Disable {
        /// The start of the run of failures.
        since: DateTime<Utc>,
    },
}

/// What an attempt that `succeeded` (or not) at `now` asks of the store,
/// for a handler in `state` whose failing mark is `failing_since` as last
/// loaded. `after` gives the auto-disable period; it is asked only when a
/// failure meets a mark.
pub fn step(
    state: HandlerState,
    failing_since: Option<DateTime<Utc>>,
    succeeded: bool,
    now: DateTime<Utc>,
    after: impl FnOnce() -> Duration,
) -> Step {
    match (succeeded, failing_since) {
        (true, None) => Step::Nothing,
        (true, Some(_)) => Step::Mark { failing: false },
        (false, None) => Step::Mark { failing: true },
        (false, Some(since)) => {
            let after = chrono::Duration::from_std(after()).unwrap_or(chrono::Duration::MAX);
            if state == HandlerState::Enabled && now - since >= after {
                Step::Disable { since }
            } else {
                Step::Nothing
            }
        }
    }
}

/// The changes already asked for, per handler, against the catalog entry
/// they were asked for (any token that changes when a reload brings a new
/// entry, such as the entry's address).
#[derive(Debug, Default)]
pub struct Written(HashMap<String, (Step, usize)>);

impl Written {
    /// Whether `step` for handler `id` (catalog entry `entry`) is still to
    /// be carried out: `false` if it already was against this entry.
    /// [`Step::Nothing`] never is.
    pub fn first(&mut self, id: &str, step: Step, entry: usize) -> bool {
        if step == Step::Nothing || self.0.get(id) == Some(&(step, entry)) {
            return false;
        }
        self.0.insert(id.to_owned(), (step, entry));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::DEFAULT_AUTO_DISABLE_AFTER;
    use crate::clock::{Clock, ManualClock};

    const ENABLED: HandlerState = HandlerState::Enabled;

    fn period() -> Duration {
        DEFAULT_AUTO_DISABLE_AFTER
    }

    /// A handler failing for days, as the catalog shows it at each reload,
    /// on a manual clock: marked at its first failure, disabled by the first
    /// failure at or after the period, not before.
    #[test]
    fn a_handler_failing_for_the_period_is_disabled_and_not_before() {
        let clock = ManualClock::new();
        let mut since = None;
        let s = step(ENABLED, since, false, clock.wall(), period);
        assert_eq!(s, Step::Mark { failing: true });
        since = Some(clock.wall());
        let hour = Duration::from_secs(3600);
        for _ in 0..(5 * 24 - 1) {
            clock.advance(hour);
            assert_eq!(
                step(ENABLED, since, false, clock.wall(), period),
                Step::Nothing
            );
        }
        clock.advance(hour - Duration::from_millis(1));
        assert_eq!(
            step(ENABLED, since, false, clock.wall(), period),
            Step::Nothing,
            "a millisecond before the period"
        );
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            step(ENABLED, since, false, clock.wall(), period),
            Step::Disable {
                since: since.unwrap()
            }
        );
        // Already disabled (by this or by hand): nothing more.
        assert_eq!(
            step(HandlerState::Disabled, since, false, clock.wall(), period),
            Step::Nothing
        );
    }

    #[test]
    fn a_success_clears_the_mark_and_restarts_the_count() {
        let clock = ManualClock::new();
        let since = Some(clock.wall());
        clock.advance(Duration::from_secs(4 * 24 * 3600));
        assert_eq!(
            step(ENABLED, since, true, clock.wall(), || panic!("not asked")),
            Step::Mark { failing: false }
        );
        assert_eq!(
            step(ENABLED, None, true, clock.wall(), period),
            Step::Nothing
        );
        // The next failure starts a new run: 4 days more do not disable.
        assert_eq!(
            step(ENABLED, None, false, clock.wall(), period),
            Step::Mark { failing: true }
        );
        let since = Some(clock.wall());
        clock.advance(Duration::from_secs(4 * 24 * 3600));
        assert_eq!(
            step(ENABLED, since, false, clock.wall(), period),
            Step::Nothing
        );
    }

    #[test]
    fn the_period_is_the_nodes_setting() {
        let clock = ManualClock::new();
        let since = Some(clock.wall());
        clock.advance(Duration::from_secs(2));
        let two_s = || Duration::from_secs(2);
        assert!(matches!(
            step(ENABLED, since, false, clock.wall(), two_s),
            Step::Disable { .. }
        ));
        // An unrepresentable period never disables.
        assert_eq!(
            step(ENABLED, since, false, clock.wall(), || Duration::MAX),
            Step::Nothing
        );
    }

    #[test]
    fn each_change_is_written_once_per_catalog_entry() {
        let mut w = Written::default();
        let mark = Step::Mark { failing: true };
        assert!(w.first("h", mark, 1));
        assert!(!w.first("h", mark, 1), "the same entry: already written");
        assert!(w.first("other", mark, 1));
        assert!(w.first("h", mark, 2), "a reload brought a new entry");
        let clear = Step::Mark { failing: false };
        assert!(w.first("h", clear, 2));
        assert!(w.first("h", mark, 2), "marked again after a clear");
        let off = Step::Disable {
            since: DateTime::<Utc>::UNIX_EPOCH,
        };
        assert!(w.first("h", off, 2));
        assert!(!w.first("h", off, 2));
        assert!(!w.first("h", Step::Nothing, 3));
    }
}
