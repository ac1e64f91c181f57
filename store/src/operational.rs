//! Operational events: what lanebus tells about its own handlers and
//! deliveries, published as ordinary events of the bus
//! ([`Store::publish_operational`]), keyed by the handler's id, so that any
//! handler can subscribe to them with a route that starts with `lanebus.`
//! (`lanebus.*`, `lanebus.handler.*`, an exact type; `*` does not match
//! them, [`crate::route`]). Being events, they are ordered per handler,
//! signed, retried, dead-lettered and recoverable like any other. Nobody
//! else may publish these types ([`crate::rules::event::unreserved`]).
//!
//! | type | when | payload |
//! | --- | --- | --- |
//! | `lanebus.handler.disabled` | a handler was disabled | `handler_id`, `handler_name`, `reason` (`gone`: a `410` answer; `failing`: failed without a success for the auto-disable period; `api`: by hand), `at`, `failing_since` (or `null`) |
//! | `lanebus.handler.enabled` | a handler was enabled | `handler_id`, `handler_name`, `reason` (`api`), `at` |
//! | `lanebus.handler.failing` | the first failed attempt after a success, then at most one per hour of the run of failures | `handler_id`, `handler_name`, `failing_since`, `hour` (0, 1, ...: hours since `failing_since`), `at` |
//! | `lanebus.delivery.dead_lettered` | a delivery became a dead letter | `handler_id`, `event_id`, `event_type`, `key`, `attempts`, `last_error`, `at` |
//!
//! Times are RFC 3339 strings in UTC.
//!
//! # One event per transition
//!
//! Each event has an id derived from its transition, so publishing it
//! again (a retried call, several nodes seeing the same hour of failures)
//! stores nothing new (idempotent publish, within the retention period):
//! - state changes: `lbop_<handler>_<state>_<µs of state_changed_at>`;
//! - failing: `lbop_<handler>_failing_<µs of failing_since>_<hour>`;
//! - dead letters: `lbop_<handler>_dead_<delivery id>` (delivery ids are
//!   never reused; a replayed dead letter is a new delivery).
//!
//! Where it is published, per transition and backend:
//! - state changes, by [`Store::change_handler_state`] itself: SQLite and
//!   PostgreSQL in the state change's own transaction, so the change and
//!   its event commit together; MongoDB right after its single-document
//!   `findOneAndUpdate` (no transaction to share). [`crate::change_state`]
//!   publishes it again after (a duplicate; the event where MongoDB's
//!   publish failed);
//! - failing and dead letters, every backend: by the node after the store
//!   recorded the failing mark or the dead letter.
//!
//! Published after its transition, an event is lost if the process stops
//! between the two (the transition itself is kept: the handler's state,
//! its dead letters). A state change asked again within
//! [`REPUBLISH_WITHIN`] of the transition (a retried API call) publishes
//! it again under the same id, which closes that gap for callers that
//! retry.
//!
//! # No feedback
//!
//! Failed attempts and dead letters of deliveries *of* operational events
//! create no operational event: a subscriber of `lanebus.*` that fails
//! does not create events about itself. (They still count for its failing
//! mark and its auto-disable, whose state change is one event, and a
//! disabled handler makes no attempts.)

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::json;

use crate::rules::event::{is_reserved, MAX_ID_LEN};
use crate::{Delivery, Handler, HandlerState, NewEvent, Store, StoreError};

/// Type of the event published when a handler is disabled.
pub const HANDLER_DISABLED: &str = "lanebus.handler.disabled";
/// Type of the event published when a handler is enabled.
pub const HANDLER_ENABLED: &str = "lanebus.handler.enabled";
/// Type of the event published when a handler starts failing, and once an
/// hour while it goes on.
pub const HANDLER_FAILING: &str = "lanebus.handler.failing";
/// Type of the event published when a delivery becomes a dead letter.
pub const DELIVERY_DEAD_LETTERED: &str = "lanebus.delivery.dead_lettered";

/// Period of `lanebus.handler.failing` events while a run of failures
/// lasts: one per hour since its start, at most.
pub const FAILING_EVERY: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// How long after a state change a repeated call to make the same change
/// publishes its event again (same id: stored once).
pub const REPUBLISH_WITHIN: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// Whether `event_type` is an operational event type (the reserved
/// `lanebus.` prefix).
pub fn is_operational(event_type: &str) -> bool {
    is_reserved(event_type)
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// An operational event about handler `handler_id` (its key), with the id
/// `lbop_<handler>_<what>` when that fits the id rules (otherwise a
/// generated one: not idempotent, but published).
fn event(handler_id: &str, what: String, event_type: &str, payload: serde_json::Value) -> NewEvent {
    let id = format!("lbop_{handler_id}_{what}");
    NewEvent {
        id: (id.len() <= MAX_ID_LEN).then_some(id),
        event_type: event_type.to_owned(),
        key: Some(handler_id.to_owned()),
        payload: payload.to_string().into_bytes(),
        deliver_at: None,
        expected_seq: None,
    }
}

/// The event of `h`'s last state change, from what is stored (state,
/// `state_reason`, `state_changed_at`): when `changed` (the caller made the
/// change), or when the change was made less than [`REPUBLISH_WITHIN`]
/// before `now` (a repeated call). `None` for a handler whose state never
/// changed.
pub fn state_changed(h: &Handler, changed: bool, now: DateTime<Utc>) -> Option<NewEvent> {
    let at = h.state_changed_at?;
    if !changed && now - at >= REPUBLISH_WITHIN {
        return None;
    }
    let reason = h.state_reason.as_deref().unwrap_or("api");
    let (event_type, payload) = match h.state {
        HandlerState::Disabled => (
            HANDLER_DISABLED,
            json!({"handler_id": h.id, "handler_name": h.name, "reason": reason,
                   "at": time(at), "failing_since": h.failing_since.map(time)}),
        ),
        HandlerState::Enabled => (
            HANDLER_ENABLED,
            json!({"handler_id": h.id, "handler_name": h.name, "reason": reason, "at": time(at)}),
        ),
    };
    let what = format!("{}_{}", h.state.as_str(), at.timestamp_micros());
    Some(event(&h.id, what, event_type, payload))
}

/// The hour of a run of failures that started at `since` that `now` falls
/// in (0 for the first hour; 0 for a `now` before `since`, another
/// node's clock).
pub fn failing_hour(since: DateTime<Utc>, now: DateTime<Utc>) -> u64 {
    let hours = (now - since).num_seconds() / FAILING_EVERY.num_seconds();
    u64::try_from(hours).unwrap_or(0)
}

/// The `lanebus.handler.failing` event of hour `hour` of `h`'s run of
/// failures that started at `since`, for a failure at `now`.
pub fn failing(h: &Handler, since: DateTime<Utc>, hour: u64, now: DateTime<Utc>) -> NewEvent {
    let payload = json!({"handler_id": h.id, "handler_name": h.name,
                         "failing_since": time(since), "hour": hour, "at": time(now)});
    let what = format!("failing_{}_{hour}", since.timestamp_micros());
    event(&h.id, what, HANDLER_FAILING, payload)
}

/// The `lanebus.delivery.dead_lettered` event of delivery `d`, dead-lettered
/// at `at` after `attempts` attempts, the last failing with `last_error`.
/// `None` for a delivery of an operational event (no feedback, module docs).
pub fn dead_lettered(
    d: &Delivery,
    attempts: u32,
    last_error: &str,
    at: DateTime<Utc>,
) -> Option<NewEvent> {
    if is_operational(&d.event_type) {
        return None;
    }
    let payload = json!({"handler_id": d.handler_id, "event_id": d.event_id,
                         "event_type": d.event_type, "key": d.key, "attempts": attempts,
                         "last_error": last_error, "at": time(at)});
    Some(event(
        &d.handler_id,
        format!("dead_{}", d.id),
        DELIVERY_DEAD_LETTERED,
        payload,
    ))
}

/// Publishes one operational event, trying again (same id) after a store
/// that is unavailable or timed out, up to 4 tries over about 1.5 s. A
/// failure is logged (warn), not returned: the transition it tells of is
/// stored already and stands.
pub async fn publish(store: &dyn Store, event: NewEvent) {
    let mut wait = std::time::Duration::from_millis(100);
    for left in (0..4).rev() {
        match store.publish_operational(vec![event.clone()]).await {
            Ok(_) => return,
            Err(StoreError::Unavailable(_) | StoreError::Timeout(_)) if left > 0 => {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
            Err(e) => {
                tracing::warn!(event_type = %event.event_type, id = ?event.id, error = %e,
                    "could not publish an operational event; the change it tells of stands");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Epoch, NewHandler};

    fn handler() -> Handler {
        Handler::registered(
            crate::generate_handler_id(),
            NewHandler {
                name: "orders".into(),
                url: "http://h/".into(),
                event_types: vec!["orders.*".into()],
                max_attempts: 3,
                timeout_ms: 1000,
                max_in_flight: 1,
                secret: crate::generate_secret(),
                rate_limit: None,
                filter: None,
            },
            Utc::now(),
        )
    }

    fn payload(e: &NewEvent) -> serde_json::Value {
        serde_json::from_slice(&e.payload).expect("JSON")
    }

    #[test]
    fn a_state_change_has_one_id_and_says_why() {
        let mut h = handler();
        let now = Utc::now();
        assert_eq!(state_changed(&h, true, now), None, "never changed");
        h.state = HandlerState::Disabled;
        h.state_reason = Some("gone".into());
        h.state_changed_at = Some(now);
        let e = state_changed(&h, true, now).expect("changed");
        assert_eq!(e.event_type, HANDLER_DISABLED);
        assert_eq!(e.key.as_deref(), Some(h.id.as_str()));
        let id = e.id.clone().expect("derived id");
        assert_eq!(
            id,
            format!("lbop_{}_disabled_{}", h.id, now.timestamp_micros())
        );
        assert!(id.len() <= MAX_ID_LEN);
        assert_eq!(payload(&e)["reason"], "gone");
        assert_eq!(payload(&e)["handler_name"], "orders");
        e.validate().expect_err("reserved for everyone else");
        crate::rules::event::check_operational(&e, now).expect("valid");
        // Asked again soon: the same event; later: none.
        let later = now + chrono::TimeDelta::minutes(59);
        assert_eq!(state_changed(&h, false, later), Some(e));
        assert_eq!(state_changed(&h, false, now + REPUBLISH_WITHIN), None);
        // Enabled again: another id.
        h.state = HandlerState::Enabled;
        h.state_reason = Some("api".into());
        h.state_changed_at = Some(later);
        let e = state_changed(&h, true, later).expect("changed");
        assert_eq!(e.event_type, HANDLER_ENABLED);
        assert_ne!(e.id, Some(id));
    }

    #[test]
    fn failing_events_are_per_hour_of_the_run() {
        let h = handler();
        let since = Utc::now();
        let hour = chrono::TimeDelta::hours(1);
        let ms = chrono::TimeDelta::milliseconds(1);
        assert_eq!(failing_hour(since, since), 0);
        assert_eq!(failing_hour(since, since + hour - ms), 0);
        assert_eq!(failing_hour(since, since + hour), 1);
        assert_eq!(failing_hour(since, since - hour), 0, "a clock behind");
        let a = failing(&h, since, 0, since);
        let b = failing(&h, since, 0, since + ms);
        assert_eq!(a.id, b.id, "one id per hour, whichever failure");
        assert_ne!(a.id, failing(&h, since, 1, since + hour).id);
        assert_eq!(payload(&a)["hour"], 0);
        assert_eq!(a.event_type, HANDLER_FAILING);
    }

    #[test]
    fn dead_letters_of_operational_events_tell_nothing() {
        let d = Delivery {
            id: 42,
            lane: 0,
            epoch: Epoch(1),
            handler_id: "hdl_x".into(),
            event_id: "e1".into(),
            event_type: "orders.placed".into(),
            key: Some("k".into()),
            seq: Some(1),
            attempts: 2,
            due_at: Utc::now(),
            last_error: None,
            payload: bytes::Bytes::from_static(b"{}"),
            published_at: Utc::now(),
            replay: false,
        };
        let e = dead_lettered(&d, 3, "HTTP 500", Utc::now()).expect("an event");
        assert_eq!(e.id.as_deref(), Some("lbop_hdl_x_dead_42"));
        assert_eq!(e.key.as_deref(), Some("hdl_x"));
        let p = payload(&e);
        assert_eq!(
            (p["event_id"].as_str(), p["attempts"].as_u64()),
            (Some("e1"), Some(3))
        );
        assert_eq!(p["last_error"], "HTTP 500");
        let op = Delivery {
            event_type: DELIVERY_DEAD_LETTERED.into(),
            ..d
        };
        assert_eq!(dead_lettered(&op, 3, "HTTP 500", Utc::now()), None);
    }
}
