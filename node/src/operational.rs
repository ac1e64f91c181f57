//! When this node publishes operational events
//! ([`lanebus_store::operational`]): `lanebus.handler.failing` (decided
//! here, pure: [`FailingTold`]) and `lanebus.delivery.dead_lettered`
//! ([`tell_dead_letter`]). State changes are told by
//! [`lanebus_store::change_state`], the one step of every enable and
//! disable.
//!
//! A failed attempt of a delivery of an ordinary event tells
//! `lanebus.handler.failing` for the hour of the handler's run of failures
//! it falls in (counted from the run's start, the handler's failing mark,
//! [`lanebus_store::Handler::failing_since`]), once per hour per node; the
//! event's id is derived from (mark, hour), so several nodes publishing it
//! store it once. Deliveries of operational events tell nothing (no
//! feedback: a failing subscriber of `lanebus.*` creates no events about
//! itself).

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use lanebus_store::operational::{self, failing_hour};
use lanebus_store::{DeadLetterRequest, Delivery, Store};

/// Per handler, the run of failures and hour whose `failing` event this
/// node told last.
#[derive(Debug, Default)]
pub struct FailingTold(HashMap<String, (DateTime<Utc>, u64)>);

impl FailingTold {
    /// The hour of `handler_id`'s run of failures (started at `since`)
    /// whose event a failure at `now` is to tell, or `None` when this node
    /// told it already. Records it as told.
    pub fn due(
        &mut self,
        handler_id: &str,
        since: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> Option<u64> {
        let hour = failing_hour(since, now);
        if self.0.get(handler_id) == Some(&(since, hour)) {
            return None;
        }
        self.0.insert(handler_id.to_owned(), (since, hour));
        Some(hour)
    }
}

/// Publishes (in a spawned task) the `lanebus.delivery.dead_lettered` event
/// of delivery `d`, whose dead letter `r` the store has just recorded;
/// nothing for a delivery of an operational event.
pub fn tell_dead_letter(store: &Arc<dyn Store>, d: &Delivery, r: &DeadLetterRequest) {
    let Some(event) = operational::dead_lettered(d, r.attempts, &r.last_error, Utc::now()) else {
        return;
    };
    let store = store.clone();
    tokio::spawn(async move { operational::publish(store.as_ref(), event).await });
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::{Clock, ManualClock};

    /// The first failure of a run tells hour 0; failures in the same hour
    /// tell nothing more; the next hour's first failure tells hour 1; a new
    /// run (after a success cleared the mark) starts again at hour 0.
    #[test]
    fn failing_is_told_once_per_hour_of_the_run() {
        let clock = ManualClock::new();
        let mut told = FailingTold::default();
        let since = clock.wall();
        assert_eq!(told.due("h", since, clock.wall()), Some(0));
        assert_eq!(told.due("other", since, clock.wall()), Some(0));
        for _ in 0..59 {
            clock.advance(Duration::from_secs(60));
            assert_eq!(told.due("h", since, clock.wall()), None);
        }
        clock.advance(Duration::from_secs(59));
        assert_eq!(told.due("h", since, clock.wall()), None, "59:59 in");
        clock.advance(Duration::from_secs(1));
        assert_eq!(told.due("h", since, clock.wall()), Some(1));
        assert_eq!(told.due("h", since, clock.wall()), None);
        // Quiet for a day, then failing again within the same run.
        clock.advance(Duration::from_secs(24 * 3600));
        assert_eq!(told.due("h", since, clock.wall()), Some(25));
        // A new run.
        let again = clock.wall();
        assert_eq!(told.due("h", again, clock.wall()), Some(0));
        assert_eq!(told.due("h", again, clock.wall()), None);
    }
}
