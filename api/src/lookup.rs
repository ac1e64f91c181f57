//! `GET /v1/events/{id}`: an event and the state of its delivery to each
//! handler ("why didn't my webhook arrive?").
//!
//! ```text
//! GET /v1/events/{id}
//!   200 {"id", "type", "key", "seq", "lane", "published_at", "payload_bytes",
//!        "handlers": [{"handler_id", "handler_name", "state", "attempts",
//!                      "next_attempt_at", "last_error", "completed_at", "failed_at",
//!                      "attempt_log": [{"attempt", "at", "status", "error",
//!                                       "duration_ms", "body"}]}]}
//!   404 not_found: no such event stored (never published, or pruned past
//!       retention with its completions)
//! ```
//!
//! A read of [`Store::lookup_event`](lanebus_store::Store::lookup_event)
//! (its docs give each backend's cost), bounded like the other reads: a
//! store that does not answer within 2 s is `503 store_unavailable`.

use axum::extract::State;
use chrono::{DateTime, Utc};
use lanebus_store::{
    rules, AttemptError, DeliveryState, EventLookup, FailedAttempt, HandlerDelivery, Lane,
};
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorCode};
use crate::extract::Path;
use crate::ApiState;

/// An event and its deliveries, per handler.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventView {
    /// Event id.
    #[schema(example = "evt_42")]
    pub id: String,
    /// Event type.
    #[serde(rename = "type")]
    #[schema(example = "issues.opened")]
    pub event_type: String,
    /// Ordering key; `null` when unkeyed.
    pub key: Option<String>,
    /// Position of the event within its key (1, 2, ...); `null` when unkeyed.
    pub seq: Option<i64>,
    /// Lane of the event.
    pub lane: Lane,
    /// Publish time (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub published_at: DateTime<Utc>,
    /// Payload size, in bytes.
    pub payload_bytes: u64,
    /// One entry per handler with a pending delivery, a completion or a
    /// dead letter of the event, by handler id. A handler the event's type
    /// matched that is missing here had no delivery created (its routes
    /// changed after the publish), or was deleted with its pending
    /// deliveries and dead letters.
    pub handlers: Vec<HandlerDeliveryView>,
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, Serialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStateName {
    /// Waiting for its next attempt, or in flight.
    Pending,
    /// Delivered.
    Completed,
    /// Out of attempts: a dead letter (replayable).
    DeadLettered,
}

/// Transport error class of a failed attempt, as the API names it
/// ([`AttemptError`] has what each means; docs/api.md, "Attempt log").
#[derive(Debug, Clone, Copy, Serialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AttemptErrorName {
    /// `refused`.
    Refused,
    /// `reset`.
    Reset,
    /// `timeout`.
    Timeout,
    /// `dns`.
    Dns,
    /// `tls`.
    Tls,
    /// `ssrf_guard`.
    SsrfGuard,
    /// `handler` (in-process).
    Handler,
    /// `other`.
    Other,
}

impl From<AttemptError> for AttemptErrorName {
    fn from(e: AttemptError) -> Self {
        match e {
            AttemptError::Refused => AttemptErrorName::Refused,
            AttemptError::Reset => AttemptErrorName::Reset,
            AttemptError::Timeout => AttemptErrorName::Timeout,
            AttemptError::Dns => AttemptErrorName::Dns,
            AttemptError::Tls => AttemptErrorName::Tls,
            AttemptError::SsrfGuard => AttemptErrorName::SsrfGuard,
            AttemptError::Handler => AttemptErrorName::Handler,
            AttemptError::Other => AttemptErrorName::Other,
        }
    }
}

/// One failed attempt of a delivery. A delivery keeps its last 5
/// (`lanebus_store::ATTEMPT_LOG_LEN`); nothing is kept of a successful
/// attempt.
#[derive(Debug, Serialize, ToSchema)]
pub struct AttemptView {
    /// Attempt number (1 for the first).
    pub attempt: u32,
    /// When the attempt started (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub at: DateTime<Utc>,
    /// HTTP status of the answer; `null` when none came.
    #[schema(minimum = 100, maximum = 999)]
    pub status: Option<u16>,
    /// Transport error class: when no status came, or the body was cut
    /// after one; `null` otherwise.
    pub error: Option<AttemptErrorName>,
    /// From the start of the attempt to its outcome, in milliseconds.
    pub duration_ms: u64,
    /// The first 1,024 bytes of the response body (cut back to a UTF-8
    /// character boundary, invalid bytes replaced by U+FFFD), or an
    /// in-process handler's error message; `null` when empty.
    pub body: Option<String>,
}

impl From<FailedAttempt> for AttemptView {
    fn from(f: FailedAttempt) -> Self {
        // Destructured so a new store field is a compile error here.
        let FailedAttempt {
            attempt,
            at,
            status,
            error,
            duration_ms,
            body,
        } = f;
        AttemptView {
            attempt,
            at,
            status,
            error: error.map(Into::into),
            duration_ms,
            body,
        }
    }
}

/// The delivery of the event to one handler. A pending delivery after a
/// completion or dead letter (a replay, a recovery) is shown as pending;
/// otherwise the latest completion or dead letter.
#[derive(Debug, Serialize, ToSchema)]
pub struct HandlerDeliveryView {
    /// Handler id.
    #[schema(pattern = "^hdl_[0-9a-f]{32}$")]
    pub handler_id: String,
    /// The handler's name; `null` when the handler no longer exists.
    pub handler_name: Option<String>,
    /// Where the delivery stands.
    pub state: DeliveryStateName,
    /// Attempts made: failed ones so far when `pending`, all (the
    /// successful one included) when `completed`.
    pub attempts: u32,
    /// `pending`: earliest time of the next attempt (RFC 3339); `null`
    /// otherwise.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub next_attempt_at: Option<DateTime<Utc>>,
    /// Error of the last failed attempt (`pending`, `dead_lettered`);
    /// `null` when none failed or `completed`.
    pub last_error: Option<String>,
    /// `completed`: when (RFC 3339); `null` otherwise.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub completed_at: Option<DateTime<Utc>>,
    /// `dead_lettered`: when (RFC 3339); `null` otherwise.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub failed_at: Option<DateTime<Utc>>,
    /// The last failed attempts (at most 5), oldest first: `pending` and
    /// `dead_lettered`; empty when none failed, and when `completed`
    /// (`attempts` says how many were made).
    pub attempt_log: Vec<AttemptView>,
}

/// The state fields of a delivery record as the API shows them: `(state,
/// attempts, next_attempt_at, last_error, completed_at, failed_at,
/// attempt_log)`, the fields that do not apply `None` (or empty).
pub(crate) type StateFields = (
    DeliveryStateName,
    u32,
    Option<DateTime<Utc>>,
    Option<String>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    Vec<AttemptView>,
);

fn views(log: Vec<FailedAttempt>) -> Vec<AttemptView> {
    log.into_iter().map(Into::into).collect()
}

/// The [`StateFields`] of a record.
pub(crate) fn state_fields(state: DeliveryState) -> StateFields {
    match state {
        DeliveryState::Pending {
            attempts,
            due_at,
            last_error,
            attempt_log,
        } => (
            DeliveryStateName::Pending,
            attempts,
            Some(due_at),
            last_error,
            None,
            None,
            views(attempt_log),
        ),
        DeliveryState::Completed {
            completed_at,
            attempts,
        } => (
            DeliveryStateName::Completed,
            attempts,
            None,
            None,
            Some(completed_at),
            None,
            Vec::new(),
        ),
        DeliveryState::DeadLettered {
            failed_at,
            attempts,
            last_error,
            attempt_log,
        } => (
            DeliveryStateName::DeadLettered,
            attempts,
            None,
            Some(last_error),
            None,
            Some(failed_at),
            views(attempt_log),
        ),
    }
}

impl From<HandlerDelivery> for HandlerDeliveryView {
    fn from(h: HandlerDelivery) -> Self {
        let HandlerDelivery {
            handler_id,
            handler_name,
            state,
        } = h;
        let (state, attempts, next_attempt_at, last_error, completed_at, failed_at, attempt_log) =
            state_fields(state);
        HandlerDeliveryView {
            handler_id,
            handler_name,
            state,
            attempts,
            next_attempt_at,
            last_error,
            completed_at,
            failed_at,
            attempt_log,
        }
    }
}

impl From<EventLookup> for EventView {
    fn from(e: EventLookup) -> Self {
        // Destructured so a new store field is a compile error here.
        let EventLookup {
            id,
            event_type,
            key,
            seq,
            lane,
            published_at,
            payload_bytes,
            handlers,
        } = e;
        EventView {
            id,
            event_type,
            key,
            seq,
            lane,
            published_at,
            payload_bytes,
            handlers: handlers.into_iter().map(Into::into).collect(),
        }
    }
}

/// Handler of `GET /v1/events/{id}`. An id that breaks the event id rule
/// ([`rules::event::id`]) names no event: `404 not_found` without a store
/// call, as for an unknown one.
pub(crate) async fn get(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<EventView>, ApiError> {
    let not_found = || {
        let shown: String = id.chars().take(128).collect();
        ApiError::new(
            ErrorCode::NotFound,
            format!(
                "event {shown:?} not found: never published, or pruned past the retention period"
            ),
        )
    };
    if rules::event::id(&id).is_err() {
        return Err(not_found());
    }
    let store = &state.store;
    let found = crate::health::bounded(store.backend(), store.lookup_event(&id)).await??;
    found.map(|e| axum::Json(e.into())).ok_or_else(not_found)
}
