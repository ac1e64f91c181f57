//! The API's one error type and its JSON shape.
//!
//! Every 4xx/5xx answer has the body
//!
//! ```json
//! {"error": {"code": "invalid_handler", "message": "max_attempts 0 must be 1 to 100"}}
//! ```
//!
//! `code` is one of [`ErrorCode`] (stable, snake_case, for programs); the
//! status is a function of the code ([`ErrorCode::status`]); `message` is
//! lowercase, for people, and names the value that was wrong. Store errors
//! are mapped by kind in one place (`From<StoreError> for ApiError`).
//!
//! A publish whose expected sequence did not hold (`409 conflict`) also
//! says where the key stands, for programs:
//!
//! ```json
//! {"error": {"code": "conflict", "message": "...", "key": "order-7",
//!            "expected_seq": 3, "current_seq": 5}}
//! ```

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use lanebus_store::StoreError;
use serde::Serialize;

/// Machine-readable error codes, each with a fixed HTTP status.
///
/// This is the whole documented set: every error answer of the API, the
/// router's safety net included (`crate::routes`), carries one of these
/// codes, and the OpenAPI document's `Error.error.code` is this enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: the body is not well-formed JSON.
    InvalidJson,
    /// 422: the body is JSON of the wrong shape: unknown field, missing
    /// field, wrong type (the message gives the path, e.g. `events[2].foo`).
    InvalidBody,
    /// 400: a path or query parameter does not parse, or is unknown; or a
    /// time in the body (`deliver_at`, `since`, `until`) is not an RFC 3339
    /// date-time.
    InvalidParameter,
    /// 415: the body's `content-type` is not `application/json`.
    UnsupportedMediaType,
    /// 413: the request body exceeds [`crate::Limits::max_body_bytes`].
    BodyTooLarge,
    /// 413: one event's payload exceeds [`crate::Limits::max_payload_bytes`].
    PayloadTooLarge,
    /// 422: a publish call with no events.
    EmptyBatch,
    /// 422: a publish call with more than [`crate::Limits::max_batch`] events.
    BatchTooLarge,
    /// 422: an event breaks the id, type or key rules.
    InvalidEvent,
    /// 422: a handler field breaks its rule (name, url, routes, policy, secret).
    InvalidHandler,
    /// 422: any other rule broken (also [`StoreError::Invalid`]).
    InvalidInput,
    /// 404: the handler or dead letter named does not exist
    /// ([`StoreError::NotFound`]).
    NotFound,
    /// 404: no such path.
    PathNotFound,
    /// 410: the event looked up is not stored and its id, a UUIDv7, dates
    /// from before the retention period: pruned (`GET /v1/events/{id}`).
    Pruned,
    /// 405: the path exists, the method does not.
    MethodNotAllowed,
    /// 414: the request URI (path and query) exceeds
    /// [`crate::MAX_URI_BYTES`]; on every path.
    UriTooLong,
    /// 400: the HTTP server could not parse the request (before any route
    /// is known, [`crate::serve`]), or a lower layer refused it with a 4xx
    /// status no other code names (the safety net's answer).
    BadRequest,
    /// 409: a unique constraint the operation does not absorb
    /// ([`StoreError::Conflict`]), or a publish's expected sequence that did
    /// not hold ([`StoreError::SeqConflict`]; the body names the key and its
    /// current sequence).
    Conflict,
    /// 401: the path needs a bearer token and none, or one that matches no
    /// configured token, was sent ([`crate::auth`]).
    Unauthorized,
    /// 403: the bearer token is valid but lacks the scope the path needs
    /// ([`crate::auth`]).
    Forbidden,
    /// 503: the node is not ready (`GET /readyz`).
    NotReady,
    /// 503: the store cannot be reached or did not answer in time
    /// ([`StoreError::Unavailable`], [`StoreError::Timeout`]).
    StoreUnavailable,
    /// 500: any other fault ([`StoreError::Database`]).
    Internal,
}

impl ErrorCode {
    /// The HTTP status this code is answered with.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorCode::InvalidJson | ErrorCode::InvalidParameter | ErrorCode::BadRequest => {
                StatusCode::BAD_REQUEST
            }
            ErrorCode::InvalidBody
            | ErrorCode::EmptyBatch
            | ErrorCode::BatchTooLarge
            | ErrorCode::InvalidEvent
            | ErrorCode::InvalidHandler
            | ErrorCode::InvalidInput => StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::BodyTooLarge | ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::NotFound | ErrorCode::PathNotFound => StatusCode::NOT_FOUND,
            ErrorCode::Pruned => StatusCode::GONE,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::UriTooLong => StatusCode::URI_TOO_LONG,
            ErrorCode::Conflict => StatusCode::CONFLICT,
            ErrorCode::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorCode::Forbidden => StatusCode::FORBIDDEN,
            ErrorCode::NotReady | ErrorCode::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 23] = [
        ErrorCode::InvalidJson,
        ErrorCode::InvalidBody,
        ErrorCode::InvalidParameter,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::BodyTooLarge,
        ErrorCode::PayloadTooLarge,
        ErrorCode::EmptyBatch,
        ErrorCode::BatchTooLarge,
        ErrorCode::InvalidEvent,
        ErrorCode::InvalidHandler,
        ErrorCode::InvalidInput,
        ErrorCode::NotFound,
        ErrorCode::PathNotFound,
        ErrorCode::Pruned,
        ErrorCode::MethodNotAllowed,
        ErrorCode::UriTooLong,
        ErrorCode::BadRequest,
        ErrorCode::Conflict,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotReady,
        ErrorCode::StoreUnavailable,
        ErrorCode::Internal,
    ];

    /// One line saying when the code is answered (for the OpenAPI
    /// document; the same text as the variant's doc).
    pub fn meaning(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "the body is not well-formed JSON",
            ErrorCode::InvalidBody => {
                "the body is JSON of the wrong shape: unknown field, missing field, wrong type"
            }
            ErrorCode::InvalidParameter => {
                "a path or query parameter does not parse, or is unknown; or a time in the body \
                 (deliver_at, since, until) is not an RFC 3339 date-time"
            }
            ErrorCode::UnsupportedMediaType => "the body's content-type is not application/json",
            ErrorCode::BodyTooLarge => "the request body exceeds the node's body limit",
            ErrorCode::PayloadTooLarge => "one event's payload exceeds the node's payload limit",
            ErrorCode::EmptyBatch => "a publish call with no events",
            ErrorCode::BatchTooLarge => {
                "a publish call with more events than the node's batch limit"
            }
            ErrorCode::InvalidEvent => "an event breaks the id, type or key rules",
            ErrorCode::InvalidHandler => {
                "a handler field breaks its rule (name, url, routes, policy, secret)"
            }
            ErrorCode::InvalidInput => "any other rule broken",
            ErrorCode::NotFound => "the handler or dead letter named does not exist",
            ErrorCode::PathNotFound => "no such path",
            ErrorCode::Pruned => {
                "the event looked up is not stored and its id (a uuidv7) dates from before the \
                 retention period: pruned"
            }
            ErrorCode::MethodNotAllowed => "the path exists, the method does not",
            ErrorCode::UriTooLong => "the request uri (path and query) exceeds 8192 bytes",
            ErrorCode::BadRequest => {
                "the request does not parse as http, or a lower layer refused it"
            }
            ErrorCode::Conflict => {
                "a unique constraint the operation does not absorb, or a publish's expected_seq \
                 that did not hold (the body's key, expected_seq and current_seq say where the \
                 key stands)"
            }
            ErrorCode::Unauthorized => {
                "no bearer token, or one that matches no configured token, on a path that needs one"
            }
            ErrorCode::Forbidden => "the bearer token lacks the scope the path needs",
            ErrorCode::NotReady => "the node is not ready",
            ErrorCode::StoreUnavailable => "the store cannot be reached",
            ErrorCode::Internal => "any other fault",
        }
    }

    /// The code as it appears in the body (`"invalid_json"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::InvalidBody => "invalid_body",
            ErrorCode::InvalidParameter => "invalid_parameter",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::EmptyBatch => "empty_batch",
            ErrorCode::BatchTooLarge => "batch_too_large",
            ErrorCode::InvalidEvent => "invalid_event",
            ErrorCode::InvalidHandler => "invalid_handler",
            ErrorCode::InvalidInput => "invalid_input",
            ErrorCode::NotFound => "not_found",
            ErrorCode::PathNotFound => "path_not_found",
            ErrorCode::Pruned => "pruned",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::UriTooLong => "uri_too_long",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotReady => "not_ready",
            ErrorCode::StoreUnavailable => "store_unavailable",
            ErrorCode::Internal => "internal",
        }
    }
}

/// An error answer: a code (which fixes the status) and a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ApiError {
    /// What went wrong, for programs.
    pub code: ErrorCode,
    /// What went wrong, for people: lowercase, naming the wrong value.
    pub message: String,
    /// For a publish's expected sequence that did not hold: where the key
    /// stands (added to the body's `error` object).
    pub seq: Option<SeqConflict>,
}

/// Where a key stands after a publish's expected sequence did not hold
/// ([`StoreError::SeqConflict`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqConflict {
    /// The event key.
    pub key: String,
    /// The `expected_seq` that did not hold.
    pub expected_seq: i64,
    /// The key's last sequence number (0: no event yet).
    pub current_seq: i64,
    /// The position (0-based) in the batch of the event whose expectation
    /// did not hold.
    pub event_index: usize,
}

impl ApiError {
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            seq: None,
        }
    }

    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        self.code.status()
    }
}

/// The one mapping from store error kind to API error (and so to status):
///
/// | [`StoreError`] | code | status |
/// | --- | --- | --- |
/// | `Invalid` | `invalid_input` | 422 |
/// | `NotFound` | `not_found` | 404 |
/// | `Conflict` | `conflict` | 409 |
/// | `SeqConflict` | `conflict` (with `key`, `expected_seq`, `current_seq`, `event_index`) | 409 |
/// | `Unavailable` | `store_unavailable` | 503 |
/// | `Timeout` | `store_unavailable` | 503 |
/// | `Database` | `internal` | 500 |
impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        let code = match &e {
            StoreError::Invalid(_) => ErrorCode::InvalidInput,
            StoreError::NotFound(_) => ErrorCode::NotFound,
            StoreError::Conflict(_) => ErrorCode::Conflict,
            StoreError::SeqConflict {
                key,
                expected,
                current,
                index,
                ..
            } => {
                let seq = SeqConflict {
                    key: key.clone(),
                    expected_seq: *expected,
                    current_seq: *current,
                    event_index: *index,
                };
                return ApiError {
                    seq: Some(seq),
                    ..ApiError::new(ErrorCode::Conflict, e.to_string())
                };
            }
            StoreError::Unavailable(_) | StoreError::Timeout(_) => ErrorCode::StoreUnavailable,
            StoreError::Database(_) => ErrorCode::Internal,
        };
        ApiError::new(code, e.to_string())
    }
}

/// A message from another library in our style: first letter lowercase, no
/// final period.
pub(crate) fn tidy(message: &str) -> String {
    let trimmed = message.trim().trim_end_matches('.');
    let mut chars = trimmed.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// The body of every error answer: `{"error": {"code", "message"}}`.
#[derive(Serialize, utoipa::ToSchema)]
#[schema(as = Error)]
pub(crate) struct ErrorBody<'a> {
    /// What went wrong.
    error: ErrorDetail<'a>,
}

/// What went wrong: a stable code for programs, a message for people.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorDetail<'a> {
    /// Stable snake_case code, one of `ErrorCode` (`invalid_json`,
    /// `not_found`, ...); each operation lists the codes it answers with, by
    /// status. Clients should treat a code added later by its status.
    #[schema(value_type = ErrorCode, example = "invalid_handler")]
    code: &'a str,
    /// Lowercase text naming the value that was wrong.
    #[schema(example = "max_attempts 0 must be 1 to 100")]
    message: &'a str,
    /// `conflict` of a publish whose `expected_seq` did not hold: the key.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, example = "order-7")]
    key: Option<&'a str>,
    /// `conflict` of a publish: the `expected_seq` that did not hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 3)]
    expected_seq: Option<i64>,
    /// `conflict` of a publish: the key's last sequence number (0: no
    /// event yet); publish with it as `expected_seq` after reading the
    /// key's events again.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 5)]
    current_seq: Option<i64>,
    /// `conflict` of a publish: the position (0-based) in `events` of the
    /// event whose `expected_seq` did not hold; for a later event of the
    /// key, the expectation had to be `current_seq` plus the batch's earlier
    /// new events of the key.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false, minimum = 0, example = 0)]
    event_index: Option<usize>,
}

/// The bytes of the error body `{"error": {"code", "message"}}`, with where
/// the key stands for a broken expected sequence (`seq`).
pub(crate) fn error_body_with(
    code: ErrorCode,
    message: &str,
    seq: Option<&SeqConflict>,
) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody {
        error: ErrorDetail {
            code: code.as_str(),
            message,
            key: seq.map(|s| s.key.as_str()),
            expected_seq: seq.map(|s| s.expected_seq),
            current_seq: seq.map(|s| s.current_seq),
            event_index: seq.map(|s| s.event_index),
        },
    })
    .unwrap_or_else(|_| br#"{"error":{"code":"internal","message":"error body"}}"#.to_vec())
}

/// The bytes of the error body `{"error": {"code", "message"}}`.
pub(crate) fn error_body(code: ErrorCode, message: &str) -> Vec<u8> {
    error_body_with(code, message, None)
}

/// The JSON error body for `code` and `message` with `status` (the safety net
/// of `crate::routes` keeps a 5xx status other than 500 with `internal`).
pub(crate) fn error_response(status: StatusCode, code: ErrorCode, message: &str) -> Response {
    json_error(status, error_body(code, message))
}

/// `body` as a JSON answer with `status`.
fn json_error(status: StatusCode, body: Vec<u8>) -> Response {
    let mut res = (status, body).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if self.code == ErrorCode::NotReady {
            // Probes ask often during an outage; the node logs the cause.
            tracing::debug!(code = self.code.as_str(), message = %self.message, "not ready");
        } else if status.is_server_error() {
            tracing::error!(code = self.code.as_str(), message = %self.message, "request failed");
        } else {
            tracing::debug!(code = self.code.as_str(), message = %self.message, "request refused");
        }
        crate::telemetry::api_error(self.code.as_str());
        json_error(
            status,
            error_body_with(self.code, &self.message, self.seq.as_ref()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_map_by_kind() {
        let cases = [
            (StoreError::Invalid("x".into()), 422, "invalid_input"),
            (StoreError::NotFound("x".into()), 404, "not_found"),
            (StoreError::Conflict("x".into()), 409, "conflict"),
            (
                StoreError::Unavailable("x".into()),
                503,
                "store_unavailable",
            ),
            (StoreError::Timeout("x".into()), 503, "store_unavailable"),
            (StoreError::Database("x".into()), 500, "internal"),
        ];
        for (e, status, code) in cases {
            let a = ApiError::from(e);
            assert_eq!(a.status().as_u16(), status);
            assert_eq!(a.code.as_str(), code);
            assert_eq!(a.seq, None);
        }
    }

    #[tokio::test]
    async fn a_broken_expectation_answers_where_the_key_stands() {
        let e = StoreError::SeqConflict {
            key: "order-7".into(),
            expected: 3,
            current: 5,
            index: 1,
            at: 6,
        };
        let res = ApiError::from(e).into_response();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        let body = axum::body::to_bytes(res.into_body(), 1 << 16)
            .await
            .expect("body");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        let err = &v["error"];
        assert_eq!(err["code"], "conflict");
        assert_eq!(
            (&err["key"], &err["expected_seq"], &err["current_seq"]),
            (
                &serde_json::json!("order-7"),
                &serde_json::json!(3),
                &serde_json::json!(5)
            )
        );
        assert_eq!(err["event_index"], 1);
        let message = err["message"].as_str().expect("message");
        assert!(
            message.contains("\"order-7\"")
                && message.contains("sequence 5")
                && message.contains("events[1] expected 3")
                && message.contains("put the key at 6"),
            "{message}"
        );
        // Other errors keep the two fields only.
        let res = ApiError::new(ErrorCode::NotFound, "x").into_response();
        let body = axum::body::to_bytes(res.into_body(), 1 << 16)
            .await
            .expect("body");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["error"].as_object().map(|o| o.len()), Some(2));
    }

    #[test]
    fn all_lists_every_code_once() {
        let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorCode::ALL.len());
        for code in ErrorCode::ALL {
            // An exhaustive match: a new variant must be added to ALL too.
            match code {
                ErrorCode::InvalidJson
                | ErrorCode::InvalidBody
                | ErrorCode::InvalidParameter
                | ErrorCode::UnsupportedMediaType
                | ErrorCode::BodyTooLarge
                | ErrorCode::PayloadTooLarge
                | ErrorCode::EmptyBatch
                | ErrorCode::BatchTooLarge
                | ErrorCode::InvalidEvent
                | ErrorCode::InvalidHandler
                | ErrorCode::InvalidInput
                | ErrorCode::NotFound
                | ErrorCode::PathNotFound
                | ErrorCode::Pruned
                | ErrorCode::MethodNotAllowed
                | ErrorCode::UriTooLong
                | ErrorCode::BadRequest
                | ErrorCode::Conflict
                | ErrorCode::Unauthorized
                | ErrorCode::Forbidden
                | ErrorCode::NotReady
                | ErrorCode::StoreUnavailable
                | ErrorCode::Internal => {}
            }
        }
    }

    #[test]
    fn uri_limit_is_named_in_its_meaning() {
        assert!(ErrorCode::UriTooLong
            .meaning()
            .contains(&crate::MAX_URI_BYTES.to_string()));
    }

    #[test]
    fn serde_name_matches_as_str() {
        for code in [
            ErrorCode::InvalidJson,
            ErrorCode::PathNotFound,
            ErrorCode::StoreUnavailable,
        ] {
            assert_eq!(
                serde_json::to_value(code).ok(),
                Some(serde_json::Value::from(code.as_str()))
            );
        }
    }
}
