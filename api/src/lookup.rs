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
//!   410 pruned: no such event stored, and its id (a UUIDv7, as lanebus
//!       generates) dates from before the retention period: pruned
//!   404 not_found: no such event stored, otherwise: never published (a
//!       UUIDv7 from within the retention period), or either (an id that
//!       carries no time, such as one the publisher chose)
//! ```
//!
//! The 410/404 decision is [`missing`], a function of the id, the node's
//! retention period ([`NodeView::retention`](crate::NodeView::retention))
//! and the store's clock (read only for a UUIDv7 id of a node that knows
//! its retention).
//!
//! A read of [`Store::lookup_event`](lanebus_store::Store::lookup_event)
//! (its docs give each backend's cost), bounded like the other reads: a
//! store that does not answer within 2 s is `503 store_unavailable`.

use axum::extract::State;
use chrono::{DateTime, SecondsFormat, Utc};
use lanebus_store::{
    event_id_time, rules, AttemptError, DeliveryState, EventLookup, FailedAttempt, HandlerDelivery,
    Lane,
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
    /// in-process handler's error message; `null` when empty or withheld.
    pub body: Option<String>,
    /// `true` when the body (or the in-process handler's message) was not
    /// kept because the payload sent carried personal fields in clear: a
    /// receiver quoting them would leave them in the store past the
    /// subject's erasure (`DELETE /v1/subjects/{id}`).
    pub body_withheld: bool,
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
            body_withheld,
        } = f;
        AttemptView {
            attempt,
            at,
            status,
            error: error.map(Into::into),
            duration_ms,
            body,
            body_withheld,
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
    if rules::event::id(&id).is_err() {
        return Err(missing(&id, None, None));
    }
    let store = &state.store;
    let backend = store.backend();
    if let Some(e) = crate::health::bounded(backend, store.lookup_event(&id)).await?? {
        return Ok(axum::Json(e.into()));
    }
    let retention = state.node.retention();
    // The store's clock, which wrote the publish times retention compares
    // with; read only when the answer depends on it.
    let now = match (event_id_time(&id), retention) {
        (Some(_), Some(_)) => Some(crate::health::bounded(backend, store.now()).await??),
        _ => None,
    };
    Err(missing(&id, retention, now))
}

/// The answer for an event `id` that is not stored, given the node's
/// retention period (`None`: unknown) and the store's time `now` (`None`:
/// not read). Retention prunes events published before `now - retention`
/// once their deliveries are done ([`Store::prune`](lanebus_store::Store::prune)),
/// and an id that is a UUIDv7 tells when it was made ([`event_id_time`]):
/// - made before the retention period began: `410 pruned` (an id never
///   published but made up as a UUIDv7 of that time looks the same);
/// - made since: `404 not_found`, never published (not yet prunable);
/// - no time in the id (one the publisher chose), or retention or `now`
///   unknown: `404 not_found`, never published or pruned, which cannot be
///   told apart.
pub(crate) fn missing(
    id: &str,
    retention: Option<std::time::Duration>,
    now: Option<DateTime<Utc>>,
) -> ApiError {
    let shown: String = id.chars().take(128).collect();
    let made = event_id_time(id);
    let (Some(made), Some(retention), Some(now)) = (made, retention, now) else {
        let why = if made.is_none() {
            "its id carries no time (a UUIDv7, as lanebus generates, does; one the publisher \
             chose does not)"
        } else {
            "this node does not say its retention period"
        };
        return ApiError::new(
            ErrorCode::NotFound,
            format!(
                "event {shown:?} not found: never published, or pruned past the retention \
                 period; {why}, so the two cannot be told apart"
            ),
        );
    };
    let period = period(retention);
    let kept = chrono::TimeDelta::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
    let start = now
        .checked_sub_signed(kept)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let made_at = made.to_rfc3339_opts(SecondsFormat::Millis, true);
    if made < start {
        ApiError::new(
            ErrorCode::Pruned,
            format!(
                "event {shown:?} was pruned: its id dates from {made_at}, before the retention \
                 period ({period}) began at {}; delivered events are kept for {period} after \
                 their publish",
                start.to_rfc3339_opts(SecondsFormat::Millis, true)
            ),
        )
    } else {
        ApiError::new(
            ErrorCode::NotFound,
            format!(
                "event {shown:?} not found: never published; its id dates from {made_at}, \
                 within the retention period ({period}), so it was not pruned"
            ),
        )
    }
}

/// A retention period for people: `24 h`, `90 min`, `45 s`.
fn period(d: std::time::Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 && s.is_multiple_of(3600) {
        format!("{} h", s / 3600)
    } else if s >= 60 && s.is_multiple_of(60) {
        format!("{} min", s / 60)
    } else {
        format!("{} s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The UUIDv7 of 2022-02-22T19:22:22Z (RFC 9562, appendix A.6).
    const V7: &str = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().expect("time")
    }

    #[test]
    fn a_uuidv7_from_before_the_retention_period_was_pruned() {
        let day = Duration::from_secs(86_400);
        let e = missing(V7, Some(day), Some(at("2022-02-23T19:22:22.001Z")));
        assert_eq!(e.code, ErrorCode::Pruned);
        assert_eq!(e.status().as_u16(), 410);
        assert_eq!(
            e.message,
            "event \"017f22e2-79b0-7cc3-98c4-dc0c0c07398f\" was pruned: its id dates from \
             2022-02-22T19:22:22.000Z, before the retention period (24 h) began at \
             2022-02-22T19:22:22.001Z; delivered events are kept for 24 h after their publish"
        );
        let e = missing(
            V7,
            Some(Duration::from_secs(60)),
            Some(at("2026-12-03T00:00:00Z")),
        );
        assert_eq!(e.code, ErrorCode::Pruned);
        assert!(e.message.contains("(1 min)"), "{}", e.message);
    }

    #[test]
    fn a_uuidv7_from_within_the_retention_period_was_never_published() {
        let day = Duration::from_secs(86_400);
        // The period's first instant, and an id from the future.
        for now in ["2022-02-23T19:22:22Z", "2022-02-22T19:00:00Z"] {
            let e = missing(V7, Some(day), Some(at(now)));
            assert_eq!(e.code, ErrorCode::NotFound, "{now}");
            assert_eq!(
                e.message,
                "event \"017f22e2-79b0-7cc3-98c4-dc0c0c07398f\" not found: never published; its \
                 id dates from 2022-02-22T19:22:22.000Z, within the retention period (24 h), so \
                 it was not pruned"
            );
        }
    }

    #[test]
    fn without_a_time_or_a_retention_the_two_cannot_be_told_apart() {
        let now = Some(at("2030-01-01T00:00:00Z"));
        let day = Some(Duration::from_secs(86_400));
        let e = missing("ord-7", day, now);
        assert_eq!(e.code, ErrorCode::NotFound);
        assert_eq!(
            e.message,
            "event \"ord-7\" not found: never published, or pruned past the retention period; \
             its id carries no time (a UUIDv7, as lanebus generates, does; one the publisher \
             chose does not), so the two cannot be told apart"
        );
        // A UUID of another version carries no event time either.
        let v4 = "919108f7-52d1-4320-9bac-f847db4148a8";
        assert!(missing(v4, day, now).message.contains("carries no time"));
        for (retention, now) in [(None, now), (day, None)] {
            let e = missing(V7, retention, now);
            assert_eq!(e.code, ErrorCode::NotFound);
            assert!(e.message.contains("cannot be told apart"), "{}", e.message);
        }
        // A long id is shown cut to 128 characters.
        let long = "x".repeat(300);
        assert!(!missing(&long, day, now).message.contains(&"x".repeat(129)));
    }

    #[test]
    fn periods_read_in_the_largest_whole_unit() {
        for (secs, want) in [
            (86_400, "24 h"),
            (3_600, "1 h"),
            (5_400, "90 min"),
            (60, "1 min"),
            (45, "45 s"),
            (31_536_000, "8760 h"),
        ] {
            assert_eq!(period(Duration::from_secs(secs)), want);
        }
        assert_eq!(period(Duration::from_millis(1_500)), "1.5 s");
    }
}
