//! Enabling and disabling a handler, counted, logged and told once (its
//! operational event, [`crate::operational`]): the one step of every enable
//! and disable (the API's, a `410 Gone` answer's, the node's auto-disable).
//!
//! | metric | type | labels | incremented by |
//! | --- | --- | --- | --- |
//! | `lanebus_handlers_disabled_total` | counter | `handler`, `reason` | enabled handlers disabled by [`change_state`] |
//! | `lanebus_handlers_enabled_total` | counter | | disabled handlers enabled by [`change_state`] |

use chrono::Utc;

use crate::{operational, HandlerState, StateChange, Store, StoreError};

/// Sets handler `id` to `to`, recording `reason` in its `state_reason`
/// (`api`: an operator; `gone`: a `410` answer; `failing`: the node's
/// auto-disable). The store reads the state before and writes the new one
/// atomically ([`Store::change_handler_state`]), so of concurrent calls
/// setting the same state, on this node or any other, exactly one changed
/// it: that one is counted, in `lanebus_handlers_disabled_total{handler,
/// reason}` or `lanebus_handlers_enabled_total`, and logged. Setting the
/// state a handler already has counts and logs nothing. Then publishes the
/// change's operational event (`lanebus.handler.disabled` or `.enabled`,
/// [`operational::state_changed`]; again, same id, when the change was
/// made less than an hour ago; the store's call published it already, so
/// this is a duplicate unless that publish failed) before answering, so
/// changes made one after the other are told in their order.
///
/// # Errors
/// The store's: [`StoreError::NotFound`] if there is no such handler.
pub async fn change_state(
    store: &dyn Store,
    id: &str,
    to: HandlerState,
    reason: &'static str,
) -> Result<StateChange, StoreError> {
    let change = store.change_handler_state(id, to, reason).await?;
    if change.changed() {
        match to {
            HandlerState::Enabled => handler_enabled(id, change.was),
            HandlerState::Disabled => handler_disabled(id, reason),
        }
    }
    tell_state_change(store, &change).await;
    Ok(change)
}

/// Publishes the operational event of `change` (see [`change_state`]).
async fn tell_state_change(store: &dyn Store, change: &StateChange) {
    if let Some(e) = operational::state_changed(&change.handler, change.changed(), Utc::now()) {
        operational::publish(store, e).await;
    }
}

/// A handler was enabled (`was` is its state before).
fn handler_enabled(handler_id: &str, was: HandlerState) {
    metrics::counter!("lanebus_handlers_enabled_total").increment(1);
    tracing::info!(handler_id, was = was.as_str(), "handler enabled");
}

/// A handler was disabled, for `reason`: `api` (through the API), `gone`
/// (a `410` answer) or `failing` (the node's auto-disable).
fn handler_disabled(handler_id: &str, reason: &'static str) {
    metrics::counter!("lanebus_handlers_disabled_total", "handler" => handler_id.to_owned(), "reason" => reason)
        .increment(1);
    match reason {
        "api" => tracing::info!(handler_id, reason, "handler disabled through the API"),
        _ => tracing::warn!(
            handler_id,
            reason,
            "handler disabled; its deliveries are kept, not attempted, until it is enabled"
        ),
    }
}
