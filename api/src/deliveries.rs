//! `GET /v1/handlers/{id}/deliveries`: a handler's deliveries in one
//! state, newest first, a page at a time.
//!
//! ```text
//! GET /v1/handlers/{id}/deliveries?state=pending|dead|completed&key=&after=&limit=
//!   200 {"deliveries": [{"event_id", "type", "key", "seq", "lane", "state",
//!                        "attempts", "next_attempt_at", "last_error",
//!                        "completed_at", "failed_at", "dead_letter_id",
//!                        "attempt_log": [{"attempt", "at", "status", "error",
//!                                         "duration_ms", "body"}]}],
//!        "next_after": cursor | null}
//!   400 invalid_parameter: unknown parameter, bad state or key, limit
//!       outside 1..=1000, an `after` that is no cursor of this state
//!   404 not_found: no such handler
//! ```
//!
//! `key` follows the event key rule (else `400`). `state` defaults to `pending`, `limit` to 100. `after` is the previous
//! page's `next_after`, an opaque cursor (base64url of the last item's
//! position: delivery or dead-letter id, or completion time and event id),
//! `null` on the last page. `completed` reads the completions within the
//! node's retention period (all stored ones when the node does not say).
//! A read of [`Store::handler_deliveries`](lanebus_store::Store::handler_deliveries),
//! whose docs give each state's cost; a store that does not answer within
//! 2 s is `503 store_unavailable`.

use axum::extract::State;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use lanebus_store::{
    DeliveriesCursor, DeliveryListState, HandlerDeliveriesQuery, HandlerDeliveryItem, Lane,
};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::error::{ApiError, ErrorCode};
use crate::extract::{Path, Query};
use crate::handlers::{check_handler_id, not_found};
use crate::lookup::{state_fields, AttemptView, DeliveryStateName};
use crate::ApiState;

/// Default page size.
pub const DEFAULT_PAGE: u32 = 100;
/// Largest page size.
pub const MAX_PAGE: u32 = 1_000;

/// Which deliveries to list.
#[derive(Debug, Clone, Copy, Default, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum StateParam {
    /// Pending deliveries (waiting, due or in flight), by delivery id.
    #[default]
    Pending,
    /// Dead letters, by dead-letter id.
    Dead,
    /// Completions within the retention period, by completion time.
    Completed,
}

/// Query of `GET /v1/handlers/{id}/deliveries`. Unknown parameters are
/// refused.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct DeliveriesQuery {
    /// `pending` (default), `dead` or `completed`.
    #[param(inline)]
    state: Option<StateParam>,
    /// Only events of this ordering key.
    key: Option<String>,
    /// `next_after` of the previous page (same `state`).
    after: Option<String>,
    /// Page size, 1 to 1,000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
}

/// One delivery of the handler. Fields that do not apply are `null`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeliveryItemView {
    /// Event id.
    event_id: String,
    /// Event type; `null` only for a completion whose event was pruned.
    #[serde(rename = "type")]
    event_type: Option<String>,
    /// Ordering key; `null` when unkeyed (or the event was pruned).
    key: Option<String>,
    /// Position of the event within its key; `null` when unkeyed.
    seq: Option<i64>,
    /// Lane of the event; `null` only for a completion whose event was
    /// pruned.
    lane: Option<Lane>,
    /// `pending`, `completed` or `dead_lettered`.
    state: DeliveryStateName,
    /// Failed attempts so far when `pending`, all attempts otherwise.
    attempts: u32,
    /// `pending`: earliest time of the next attempt (RFC 3339).
    #[schema(value_type = Option<String>, format = DateTime)]
    next_attempt_at: Option<DateTime<Utc>>,
    /// Error of the last failed attempt (`pending`, `dead_lettered`).
    last_error: Option<String>,
    /// `completed`: when (RFC 3339).
    #[schema(value_type = Option<String>, format = DateTime)]
    completed_at: Option<DateTime<Utc>>,
    /// `dead_lettered`: when (RFC 3339).
    #[schema(value_type = Option<String>, format = DateTime)]
    failed_at: Option<DateTime<Utc>>,
    /// `dead_lettered`: the dead-letter id (for
    /// `POST /admin/dead-letters/{id}/replay`).
    dead_letter_id: Option<i64>,
    /// The last failed attempts (at most 5), oldest first: `pending` and
    /// `dead_lettered`; empty when none failed, and when `completed`.
    attempt_log: Vec<AttemptView>,
}

impl From<HandlerDeliveryItem> for DeliveryItemView {
    fn from(i: HandlerDeliveryItem) -> Self {
        // Destructured so a new store field is a compile error here.
        let HandlerDeliveryItem {
            event_id,
            event_type,
            key,
            seq,
            lane,
            id,
            state,
        } = i;
        let (state, attempts, next_attempt_at, last_error, completed_at, failed_at, attempt_log) =
            state_fields(state);
        DeliveryItemView {
            event_id,
            event_type,
            key,
            seq,
            lane,
            state,
            attempts,
            next_attempt_at,
            last_error,
            completed_at,
            failed_at,
            dead_letter_id: id.filter(|_| state == DeliveryStateName::DeadLettered),
            attempt_log,
        }
    }
}

/// Body of `GET /v1/handlers/{id}/deliveries`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeliveriesPage {
    /// The page, newest first.
    deliveries: Vec<DeliveryItemView>,
    /// `after` for the next page; `null` when this page is the last.
    next_after: Option<String>,
}

/// The opaque form of a cursor: base64url of `p.ID`, `d.ID` or
/// `c.MICROS.EVENT_ID`.
fn encode(state: StateParam, c: &DeliveriesCursor) -> String {
    let plain = match (state, c) {
        (StateParam::Dead, DeliveriesCursor::Id(id)) => format!("d.{id}"),
        (_, DeliveriesCursor::Id(id)) => format!("p.{id}"),
        (_, DeliveriesCursor::Completed { at, event_id }) => {
            format!("c.{}.{event_id}", at.timestamp_micros())
        }
    };
    URL_SAFE_NO_PAD.encode(plain)
}

/// The cursor `after` stands for, if it is one of `state`'s.
fn decode(state: StateParam, after: &str) -> Result<DeliveriesCursor, ApiError> {
    let bad = || {
        let shown: String = after.chars().take(64).collect();
        ApiError::new(
            ErrorCode::InvalidParameter,
            format!("after {shown:?} is no cursor of state {state:?}: pass `next_after` of the previous page with the same state"),
        )
    };
    let plain = URL_SAFE_NO_PAD.decode(after).map_err(|_| bad())?;
    let plain = String::from_utf8(plain).map_err(|_| bad())?;
    let (tag, rest) = plain.split_once('.').ok_or_else(bad)?;
    match (state, tag) {
        (StateParam::Pending, "p") | (StateParam::Dead, "d") => {
            rest.parse().map(DeliveriesCursor::Id).map_err(|_| bad())
        }
        (StateParam::Completed, "c") => {
            let (micros, event_id) = rest.split_once('.').ok_or_else(bad)?;
            let at = micros
                .parse()
                .ok()
                .and_then(DateTime::from_timestamp_micros)
                .ok_or_else(bad)?;
            lanebus_store::rules::event::id(event_id).map_err(|_| bad())?;
            Ok(DeliveriesCursor::Completed {
                at,
                event_id: event_id.to_owned(),
            })
        }
        _ => Err(bad()),
    }
}

/// Handler of `GET /v1/handlers/{id}/deliveries` (see the module docs).
pub(crate) async fn list(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<DeliveriesQuery>,
) -> Result<axum::Json<DeliveriesPage>, ApiError> {
    check_handler_id(&id)?;
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::new(
            ErrorCode::InvalidParameter,
            format!("limit {limit} must be 1 to {MAX_PAGE}"),
        ));
    }
    if let Some(key) = &q.key {
        lanebus_store::rules::event::key(key)
            .map_err(|b| ApiError::new(ErrorCode::InvalidParameter, b.message))?;
    }
    let which = q.state.unwrap_or_default();
    let after = q.after.as_deref().map(|a| decode(which, a)).transpose()?;
    let store = &state.store;
    let backend = store.backend();
    crate::health::bounded(backend, store.get_handler(&id))
        .await?
        .map_err(|e| not_found(e, &id))?;
    let mut completed_since = DateTime::UNIX_EPOCH;
    if let (StateParam::Completed, Some(kept)) = (which, state.node.retention()) {
        // On the store's clock, which wrote the completion times.
        let now = crate::health::bounded(backend, store.now()).await??;
        let kept = chrono::TimeDelta::from_std(kept).unwrap_or(chrono::TimeDelta::MAX);
        completed_since = now.checked_sub_signed(kept).unwrap_or(completed_since);
    }
    let query = HandlerDeliveriesQuery {
        handler_id: id,
        state: match which {
            StateParam::Pending => DeliveryListState::Pending,
            StateParam::Dead => DeliveryListState::Dead,
            StateParam::Completed => DeliveryListState::Completed,
        },
        key: q.key,
        after,
        limit,
        completed_since: completed_since.max(DateTime::UNIX_EPOCH),
    };
    let items = crate::health::bounded(backend, store.handler_deliveries(&query)).await??;
    let next_after = match items.last() {
        Some(last) if items.len() >= limit as usize => Some(encode(which, &last.cursor())),
        _ => None,
    };
    Ok(axum::Json(DeliveriesPage {
        deliveries: items.into_iter().map(Into::into).collect(),
        next_after,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_stay_in_their_state() {
        let at = DateTime::from_timestamp_micros(1_764_600_000_123_456).expect("time");
        let cases = [
            (StateParam::Pending, DeliveriesCursor::Id(42)),
            (StateParam::Dead, DeliveriesCursor::Id(7)),
            (
                StateParam::Completed,
                DeliveriesCursor::Completed {
                    at,
                    event_id: "ord.7.x".into(),
                },
            ),
        ];
        for (state, cursor) in &cases {
            let text = encode(*state, cursor);
            assert_eq!(&decode(*state, &text).expect("decodes"), cursor);
            for (other, _) in &cases {
                if other != state {
                    assert!(decode(*other, &text).is_err(), "{state:?} in {other:?}");
                }
            }
        }
        let nul = URL_SAFE_NO_PAD.encode("c.1.a\0b");
        for bad in ["", "!!", "cC5x", &URL_SAFE_NO_PAD.encode("c.1"), &nul] {
            assert!(decode(StateParam::Completed, bad).is_err(), "{bad}");
        }
    }
}
