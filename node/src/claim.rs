//! When a lane owner claims, and how much (pure code; the
//! [`LaneOwner`](crate::actors::LaneOwner) carries it out).
//!
//! [`ClaimControl`] holds the control state of one lane's claims and
//! answers each question the owner asks: may a claim start now and for how
//! many rows ([`ClaimControl::start`], [`ClaimControl::limit`]), what follows
//! a claim's answer ([`ClaimControl::go_on`]), how long to back off after a
//! failed claim ([`ClaimControl::failed`]), whether to claim after a
//! delivery settled ([`ClaimControl::after_settled`]). No IO and no clock:
//! the owner passes what it holds and `now`.
//!
//! The rules:
//!
//! - a new owner's first claim waits until no attempt of the lane is under
//!   way on this node (an owner stopped at once leaves its attempts
//!   running; a new owner at the same epoch would claim those rows and send
//!   them a second time);
//! - at most one claim at a time; a wake-up during a claim claims again
//!   right after it, so a publish that committed during the claim is not
//!   left waiting for the poll;
//! - claim only while the buffer has room, except to find out whether the
//!   lane is still ours after the store refused a completion (*suspect*:
//!   dispatch is held until a claim answers);
//! - a lane holding nothing probes with one row; otherwise ask for a full
//!   buffer (the node's payload budget may grant fewer);
//! - after a full batch, claim again at once while it brought something new
//!   (or a rescan moved the cursor);
//! - a failed claim backs off `50 ms * 2^min(failures, 6)` (100 ms to
//!   3.2 s); a successful one resets it;
//! - a drain claims nothing more.

use std::time::{Duration, Instant};

/// First back-off after a failed claim is twice this.
pub const CLAIM_BACKOFF_UNIT: Duration = Duration::from_millis(50);

/// Failures past this many no longer lengthen the back-off (3.2 s).
pub const CLAIM_BACKOFF_MAX_DOUBLINGS: u32 = 6;

/// What a lane may do about claiming now ([`ClaimControl::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimStart {
    /// Claim nothing now (draining, waiting for the previous owner's
    /// attempts, a claim is under way, or the buffer is full).
    Hold,
    /// Reserve up to this many rows of the payload budget, then
    /// [`ClaimControl::limit`].
    Want(usize),
}

/// The claim control state of one lane owner. See the module docs.
#[derive(Debug, Clone)]
pub struct ClaimControl {
    /// A claim is under way.
    claiming: bool,
    /// A wake-up came during the claim: claim again after it.
    claim_again: bool,
    /// Dispatch is held until the next claim confirms ownership.
    suspect: bool,
    /// Claims failed in a row.
    errors: u32,
    /// The last claim was cut by its limit: more may be waiting.
    more_waiting: bool,
    /// Stop once nothing is in flight; claim nothing more.
    draining: bool,
    /// No claim has started yet.
    first_claim: bool,
    /// The oldest transaction holding the claim cursor open, since when,
    /// and when a claim last saw it.
    horizon: Option<(i64, Instant, Instant)>,
}

impl Default for ClaimControl {
    fn default() -> Self {
        ClaimControl::new()
    }
}

impl ClaimControl {
    /// The control of a new owner: nothing claimed yet.
    pub fn new() -> Self {
        ClaimControl {
            claiming: false,
            claim_again: false,
            suspect: false,
            errors: 0,
            more_waiting: false,
            draining: false,
            first_claim: true,
            horizon: None,
        }
    }

    /// Whether a claim may start with `held` deliveries held (queued plus
    /// in flight) of a buffer of `cap`, and for how many rows.
    /// `lane_attempts` counts the lane's attempts under way on this node; it
    /// is asked only before the first claim.
    pub fn start(
        &mut self,
        held: usize,
        cap: usize,
        lane_attempts: impl FnOnce() -> usize,
    ) -> ClaimStart {
        if self.draining {
            return ClaimStart::Hold;
        }
        if self.first_claim {
            if lane_attempts() > 0 {
                // Checked again at the next poll tick or wake-up.
                return ClaimStart::Hold;
            }
            self.first_claim = false;
        }
        if self.claiming {
            self.claim_again = true;
            return ClaimStart::Hold;
        }
        if held >= cap && !self.suspect {
            return ClaimStart::Hold;
        }
        // Ask for a full buffer: rows already held may be returned again (see
        // the store's claim cursor docs) and must not crowd out new ones.
        // A lane holding nothing probes with one row (a full batch follows
        // at once if it comes back full): idle lanes polling must not
        // reserve the whole budget every tick and starve the busy ones.
        ClaimStart::Want(if held == 0 { 1 } else { cap.max(1) })
    }

    /// The budget granted `rows`: the claim's limit, and the claim is under
    /// way; `None` when the budget is spent (make room, claim later), unless
    /// the lane is suspect, which claims at least one row.
    pub fn limit(&mut self, rows: usize) -> Option<u32> {
        if rows == 0 && !self.suspect {
            return None;
        }
        self.claiming = true;
        self.claim_again = false;
        Some(rows.max(1) as u32)
    }

    /// A claim answered (any way): no claim is under way any more.
    pub fn answered(&mut self) {
        self.claiming = false;
    }

    /// The claim answered with `returned` rows for a `limit`, while the lane
    /// is still ours: the lane is no longer suspect, failures are forgotten.
    pub fn claimed(&mut self, returned: usize, limit: u32) {
        self.errors = 0;
        self.suspect = false;
        self.more_waiting = returned >= limit as usize;
    }

    /// After a claim's rows were taken in (`new` of them new, `moved`: the
    /// cursor moved; `rescan`: a rescan is under way or keys are trimmed,
    /// asked only when nothing was new): whether to claim again at once.
    /// A rescan re-reads rows already held, and rows of trimmed keys are
    /// passed over: keep going after a full batch even when nothing was
    /// new, as long as the cursor moves.
    pub fn go_on(
        &self,
        returned: usize,
        limit: u32,
        new: usize,
        moved: bool,
        rescan: impl FnOnce() -> bool,
    ) -> bool {
        let go_on = new > 0 || (moved && rescan());
        (go_on && returned >= limit as usize) || self.claim_again
    }

    /// A claim failed: how long to wait before the next.
    pub fn failed(&mut self) -> Duration {
        self.errors += 1;
        CLAIM_BACKOFF_UNIT * 2u32.pow(self.errors.min(CLAIM_BACKOFF_MAX_DOUBLINGS))
    }

    /// The store refused a completion (fenced out, or the row is gone):
    /// hold dispatch until a claim tells whether the lane is still ours.
    pub fn refused(&mut self) {
        self.suspect = true;
    }

    /// Whether dispatch is held until the next claim answers.
    pub fn suspect(&self) -> bool {
        self.suspect
    }

    /// A delivery settled, leaving `held()` of a buffer of `cap`: whether
    /// to claim now (suspect, or more was waiting and the buffer is below
    /// half). `held` is asked only when more was waiting.
    pub fn after_settled(&self, held: impl FnOnce() -> usize, cap: usize) -> bool {
        self.suspect || (self.more_waiting && held() < cap / 2)
    }

    /// A drain started: claim nothing more.
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// Whether a drain is under way.
    pub fn draining(&self) -> bool {
        self.draining
    }

    /// Notes the oldest open transaction holding the claim cursor (`None`:
    /// none) at `now`: a new oldest one restarts the count.
    pub fn note_horizon(&mut self, oldest_open: Option<i64>, now: Instant) {
        self.horizon = match (oldest_open, self.horizon) {
            (None, _) => None,
            (Some(x), Some((y, since, _))) if x == y => Some((y, since, now)),
            (Some(x), _) => Some((x, now, now)),
        };
    }

    /// How long the same oldest transaction had held the claim cursor open
    /// when a claim last saw it (`None`: none was open then). Not counted
    /// on while the lane claims nothing (a full buffer): that transaction
    /// may have ended since.
    pub fn horizon_held(&self) -> Option<Duration> {
        self.horizon
            .map(|(_, since, seen)| seen.saturating_duration_since(since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    const CAP: usize = 256;

    fn none() -> usize {
        0
    }

    /// Starts a claim with `held` rows and a budget granting `grant`.
    fn begin(c: &mut ClaimControl, held: usize, grant: usize) -> Option<u32> {
        match c.start(held, CAP, none) {
            ClaimStart::Want(w) => c.limit(w.min(grant)),
            ClaimStart::Hold => None,
        }
    }

    #[test]
    fn the_first_claim_waits_for_the_previous_owners_attempts() {
        let mut c = ClaimControl::new();
        assert_eq!(c.start(0, CAP, || 2), ClaimStart::Hold);
        assert_eq!(c.start(0, CAP, || 1), ClaimStart::Hold);
        assert_eq!(c.start(0, CAP, || 0), ClaimStart::Want(1));
        // Asked only before the first claim.
        assert_eq!(
            c.start(5, CAP, || panic!("asked after the first claim")),
            ClaimStart::Want(CAP)
        );
    }

    #[test]
    fn one_claim_at_a_time_and_a_wake_up_during_it_claims_again() {
        let mut c = ClaimControl::new();
        assert_eq!(begin(&mut c, 0, CAP), Some(1));
        // A wake-up while the claim is under way.
        assert_eq!(c.start(0, CAP, none), ClaimStart::Hold);
        c.answered();
        c.claimed(0, 1);
        assert!(c.go_on(0, 1, 0, false, || false), "claims again after it");
        assert_eq!(begin(&mut c, 0, CAP), Some(1));
        c.answered();
        c.claimed(0, 1);
        assert!(!c.go_on(0, 1, 0, false, || false), "no wake-up: done");
    }

    #[test]
    fn an_idle_lane_probes_with_one_row_and_a_busy_one_asks_for_the_buffer() {
        let mut c = ClaimControl::new();
        assert_eq!(c.start(0, CAP, none), ClaimStart::Want(1));
        assert_eq!(c.start(1, CAP, none), ClaimStart::Want(CAP));
        let mut c = ClaimControl::new();
        assert_eq!(c.start(10, CAP, none), ClaimStart::Want(CAP));
        assert_eq!(
            ClaimControl::new().start(3, 0, none),
            ClaimStart::Hold,
            "a zero buffer is full"
        );
        // A full batch with new rows goes on at once; a short one stops.
        assert!(c.go_on(CAP, CAP as u32, 7, true, || false));
        assert!(!c.go_on(CAP - 1, CAP as u32, 7, true, || false));
        // Nothing new: goes on only while the cursor moves over a rescan.
        assert!(c.go_on(CAP, CAP as u32, 0, true, || true));
        assert!(!c.go_on(CAP, CAP as u32, 0, true, || false));
        assert!(!c.go_on(CAP, CAP as u32, 0, false, || panic!("not asked")));
    }

    #[test]
    fn a_full_buffer_holds_unless_the_lane_is_suspect() {
        let mut c = ClaimControl::new();
        assert_eq!(begin(&mut c, 0, CAP), Some(1));
        c.answered();
        c.claimed(1, 1);
        assert_eq!(c.start(CAP, CAP, none), ClaimStart::Hold);
        assert_eq!(c.start(CAP + 9, CAP, none), ClaimStart::Hold);
        // A completion refused: dispatch held, a claim goes out anyway, with
        // a row even when the budget is spent.
        c.refused();
        assert!(c.suspect());
        assert!(c.after_settled(|| panic!("not asked"), CAP));
        assert_eq!(c.start(CAP, CAP, none), ClaimStart::Want(CAP));
        assert_eq!(c.limit(0), Some(1));
        c.answered();
        c.claimed(0, 1);
        assert!(!c.suspect(), "the claim confirmed the lane");
        assert_eq!(c.start(CAP, CAP, none), ClaimStart::Hold);
    }

    #[test]
    fn a_spent_budget_claims_nothing() {
        let mut c = ClaimControl::new();
        assert_eq!(begin(&mut c, 3, 0), None);
        // Not under way: the next tick may claim.
        assert_eq!(begin(&mut c, 3, 17), Some(17));
    }

    #[test]
    fn more_waiting_claims_again_once_the_buffer_is_below_half() {
        let mut c = ClaimControl::new();
        let limit = begin(&mut c, 0, CAP).unwrap();
        c.answered();
        c.claimed(limit as usize, limit);
        assert!(c.after_settled(|| CAP / 2 - 1, CAP));
        assert!(!c.after_settled(|| CAP / 2, CAP));
        let limit = begin(&mut c, 5, CAP).unwrap();
        c.answered();
        c.claimed(3, limit);
        assert!(
            !c.after_settled(|| panic!("not asked"), CAP),
            "the last claim was not cut"
        );
    }

    #[test]
    fn failed_claims_back_off_exponentially_to_a_cap_and_reset() {
        let mut c = ClaimControl::new();
        let waits: Vec<u64> = (0..9).map(|_| c.failed().as_millis() as u64).collect();
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1_600, 3_200, 3_200, 3_200, 3_200]
        );
        c.claimed(0, 1);
        assert_eq!(c.failed(), Duration::from_millis(100));
    }

    #[test]
    fn a_drain_claims_nothing_more() {
        let mut c = ClaimControl::new();
        assert!(!c.draining());
        c.drain();
        assert!(c.draining());
        assert_eq!(c.start(0, CAP, none), ClaimStart::Hold);
        c.refused();
        assert_eq!(c.start(0, CAP, none), ClaimStart::Hold);
    }

    #[test]
    fn the_horizon_counts_from_when_the_oldest_transaction_was_first_seen() {
        let clock = ManualClock::new();
        let mut c = ClaimControl::new();
        let t0 = clock.now();
        c.note_horizon(Some(41), t0);
        clock.advance(Duration::from_secs(30));
        c.note_horizon(Some(41), clock.now());
        let secs = |s| Some(Duration::from_secs(s));
        assert_eq!(c.horizon_held(), secs(30), "the same transaction");
        c.note_horizon(Some(57), clock.now());
        assert_eq!(c.horizon_held(), secs(0), "a new oldest one");
        clock.advance(Duration::from_secs(1));
        c.note_horizon(Some(57), clock.now());
        assert_eq!(c.horizon_held(), secs(1));
        c.note_horizon(None, clock.now());
        assert_eq!(c.horizon_held(), None);
        c.note_horizon(Some(57), clock.now());
        assert_eq!(c.horizon_held(), secs(0));
    }
}
