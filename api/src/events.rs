//! `POST /v1/events`: publish a batch of events.
//!
//! ```text
//! POST /v1/events  {"events": [{"id"?, "type", "key"?, "payload", "deliver_at"?,
//!                               "expected_seq"?}, ...]}
//!   202 {"accepted": n, "duplicates": m, "ids": [...]}
//!   409 {"error": {"code": "conflict", "message", "key", "expected_seq", "current_seq",
//!                   "event_index"}}
//! ```
//!
//! The whole batch is validated before the store is called, and the store
//! publishes it in one transaction (invariant 5), so a batch with one bad
//! event is refused whole and writes nothing (invariant 6). An `id` already
//! stored, or repeated in the batch, counts as a duplicate and is not
//! delivered again (idempotent publish). The payload is any JSON value and is
//! stored byte for byte as sent.

use axum::extract::State;
use axum::http::StatusCode;
use lanebus_store::rules::{self, Rule};
use lanebus_store::{NewEvent, PublishOutcome};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorCode};
use crate::extract::Json;
use crate::{ApiState, Limits};

/// Body of `POST /v1/events`. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublishRequest {
    /// The batch, 1 to [`Limits::max_batch`] events (default 1,000).
    #[schema(min_items = 1)]
    pub events: Vec<EventIn>,
}

/// One event of a publish request. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EventIn {
    /// Client id (1 to 128 printable ASCII characters); a UUIDv7 when absent.
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[!-~]{1,128}$",
        example = "evt_42"
    )]
    pub id: Option<String>,
    /// Dotted event type such as `issues.opened`. Types starting with
    /// `lanebus.` are reserved for lanebus's operational events (`422
    /// invalid_event`).
    #[serde(rename = "type")]
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[A-Za-z0-9._:/-]{1,128}$",
        example = "issues.opened"
    )]
    pub event_type: String,
    /// Ordering key, 1 to 256 bytes without control characters; events
    /// with one key are delivered in publish order. No key, no ordering.
    #[serde(default)]
    #[schema(
        min_length = 1,
        max_length = 256,
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]+$",
        example = "repo-1"
    )]
    pub key: Option<String>,
    /// Any JSON value, kept byte for byte.
    #[schema(value_type = serde_json::Value)]
    pub payload: Box<RawValue>,
    /// Delayed delivery: not delivered before this time (RFC 3339, e.g.
    /// `2026-12-01T09:00:00Z`), at most 7 days ahead (a past time delivers
    /// at once). A keyed event's later events wait behind it.
    #[serde(default)]
    #[schema(format = DateTime, example = "2026-12-01T09:00:00Z")]
    pub deliver_at: Option<String>,
    /// Optimistic concurrency on the key as an event stream: the key's last
    /// sequence number the publisher saw (0: no event yet). The batch is
    /// stored only if the key's sequence just before this event equals it
    /// (counting the batch's earlier events of the key); otherwise nothing
    /// of the batch is stored and the answer is `409 conflict` with the
    /// key's `current_seq` and this event's `event_index`. Needs `key`; 0 or more (`422 invalid_event`).
    /// An event whose id is already stored is a duplicate, not checked.
    #[serde(default)]
    #[schema(minimum = 0, example = 41)]
    pub expected_seq: Option<i64>,
}

/// Answer of `POST /v1/events` (202).
#[derive(Debug, Serialize, ToSchema)]
pub struct PublishAnswer {
    /// Events newly stored.
    pub accepted: usize,
    /// Events whose id was already stored (or repeated in the batch); not
    /// delivered again.
    pub duplicates: usize,
    /// The id of every input event, generated ones included, in input order.
    pub ids: Vec<String>,
}

impl From<PublishOutcome> for PublishAnswer {
    fn from(outcome: PublishOutcome) -> Self {
        // Destructured so a new store field is a compile error here, not a
        // silent gap between the answer and its documented schema.
        let PublishOutcome {
            accepted,
            duplicates,
            ids,
            lanes: _,
        } = outcome;
        PublishAnswer {
            accepted,
            duplicates,
            ids,
        }
    }
}

/// Checks a batch against `limits` and the event rules, and turns it into
/// store events.
///
/// # Errors
/// `422 empty_batch`, `422 batch_too_large`, `413 payload_too_large`,
/// `400 invalid_parameter` (a `deliver_at` that is no RFC 3339 date-time) or
/// `422 invalid_event` (also a `deliver_at` more than 7 days ahead, a
/// payload nested deeper than
/// [`lanebus_store::MAX_PAYLOAD_DEPTH`], an `expected_seq` below 0 or
/// without a `key`), naming the event's index
/// (`events[3]`). The rules are the store's ([`rules::event`]); `limits`
/// may only tighten the batch and payload bounds.
pub fn validate_batch(req: PublishRequest, limits: &Limits) -> Result<Vec<NewEvent>, ApiError> {
    if req.events.is_empty() {
        return Err(ApiError::new(
            ErrorCode::EmptyBatch,
            "events must hold at least one event, got 0",
        ));
    }
    rules::event::batch_len(req.events.len())
        .map_err(|b| ApiError::new(ErrorCode::BatchTooLarge, b.message))?;
    if req.events.len() > limits.max_batch {
        return Err(ApiError::new(
            ErrorCode::BatchTooLarge,
            format!(
                "batch of {} events exceeds the limit of {} events",
                req.events.len(),
                limits.max_batch
            ),
        ));
    }
    let now = chrono::Utc::now();
    req.events
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let payload = e.payload.get();
            if payload.len() > limits.max_payload_bytes {
                return Err(ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!(
                        "events[{i}]: payload of {} bytes exceeds the limit of {} bytes",
                        payload.len(),
                        limits.max_payload_bytes
                    ),
                ));
            }
            let deliver_at = e
                .deliver_at
                .as_deref()
                .map(|t| crate::recovery::parse_time(&format!("events[{i}].deliver_at"), t))
                .transpose()?;
            let event = NewEvent {
                id: e.id,
                event_type: e.event_type,
                key: e.key,
                payload: payload.as_bytes().to_vec(),
                deliver_at,
                expected_seq: e.expected_seq,
            };
            rules::event::check(&event, now).map_err(|b| {
                let code = match b.rule {
                    Rule::Size => ErrorCode::PayloadTooLarge,
                    _ => ErrorCode::InvalidEvent,
                };
                ApiError::new(code, b.within(&format!("events[{i}]")).message)
            })?;
            Ok(event)
        })
        .collect()
}

/// Handler of `POST /v1/events`.
pub(crate) async fn publish(
    State(state): State<ApiState>,
    Json(req): Json<PublishRequest>,
) -> Result<(StatusCode, axum::Json<PublishAnswer>), ApiError> {
    let events = validate_batch(req, &state.limits)?;
    let outcome = state.store.publish(events).await?;

    crate::telemetry::events_published(outcome.accepted, outcome.duplicates);
    if outcome.accepted > 0 {
        state.node.published(&outcome.lanes);
    }
    Ok((StatusCode::ACCEPTED, axum::Json(outcome.into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(json: &str) -> PublishRequest {
        serde_json::from_str(json).expect("test batch parses")
    }

    #[test]
    fn payloads_nested_too_deep_are_refused() {
        let limits = Limits {
            max_payload_bytes: 1 << 20,
            ..Limits::default()
        };
        let nested = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
        let body = |p: &str| batch(&format!(r#"{{"events":[{{"type":"a","payload":{p}}}]}}"#));
        assert!(validate_batch(body(&nested(lanebus_store::MAX_PAYLOAD_DEPTH)), &limits).is_ok());
        let e = validate_batch(body(&nested(lanebus_store::MAX_PAYLOAD_DEPTH + 1)), &limits)
            .expect_err("deep");
        assert_eq!(e.code, ErrorCode::InvalidEvent);
        assert!(
            e.message.contains("events[0]: payload nests 129"),
            "{}",
            e.message
        );
        // Brackets in strings (escaped quotes too) are text, not nesting.
        let text = format!(r#"{{"s":"\"{}"}}"#, "[".repeat(500));
        assert!(validate_batch(body(&text), &limits).is_ok());
    }

    #[test]
    fn payload_is_kept_byte_for_byte() {
        let events = validate_batch(
            batch(r#"{"events":[{"type":"a.b","payload":{"z" : 1,"a":[1, 2.50]}}]}"#),
            &Limits::default(),
        )
        .expect("valid");
        assert_eq!(events[0].payload, br#"{"z" : 1,"a":[1, 2.50]}"#);
    }

    #[test]
    fn limits_and_rules_name_the_event_index() {
        let limits = Limits {
            max_body_bytes: 1 << 20,
            max_payload_bytes: 8,
            max_batch: 2,
        };
        let e = validate_batch(batch(r#"{"events":[]}"#), &limits).unwrap_err();
        assert_eq!(e.code, ErrorCode::EmptyBatch);
        let e = validate_batch(
            batch(r#"{"events":[{"type":"a","payload":1},{"type":"a","payload":1},{"type":"a","payload":1}]}"#),
            &limits,
        )
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::BatchTooLarge);
        let e = validate_batch(
            batch(r#"{"events":[{"type":"a","payload":1},{"type":"a","payload":"123456789"}]}"#),
            &limits,
        )
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::PayloadTooLarge);
        assert!(e.message.starts_with("events[1]:"), "{}", e.message);
        let e = validate_batch(batch(r#"{"events":[{"type":"a b","payload":1}]}"#), &limits)
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidEvent);
        assert!(e.message.contains("\"a b\""), "{}", e.message);
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = serde_json::from_str::<PublishRequest>(
            r#"{"events":[{"type":"a","payload":1,"extra":2}]}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
    }
}
