//! Recovery: `POST /v1/handlers/{id}/recover`, and the parsing of the
//! API's time fields.
//!
//! ```text
//! POST /v1/handlers/{id}/recover {"since": "2026-11-30T12:00:00Z"}
//!   200 {"recovered": n, "already_pending": m, "pruned": k}
//!   400 invalid_parameter (since is no RFC 3339 date-time)
//!   404 not_found (no such handler)
//!   422 invalid_input (since lies before the retention window)
//! ```
//!
//! Every event whose delivery to the handler completed at or after `since`
//! is delivered again, once, with its own event id (`webhook-id`), key and
//! sequence, and the header `lanebus-replay: true`; a key's recovered events
//! arrive in sequence order. Completed events are kept for the node's
//! retention period (`--retention-secs`, default 24 h): a `since` older than
//! that is refused with `422 invalid_input` naming the earliest time that
//! can be asked for, rather than answered with a silent part. Retention
//! counts from an event's last completion, so an event delivered long after
//! its publish is still there; completions in the window whose event is gone
//! all the same (completed before the store kept late completions, i.e. before
//! schema version 4) are counted as `pruned`.

use axum::extract::State;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorCode};
use crate::extract::{Json, Path};
use crate::handlers::{check_handler_id, not_found};
use crate::ApiState;

/// Parses an RFC 3339 date-time with offset (`2026-11-30T12:00:00Z`,
/// `2026-11-30T13:00:00.5+01:00`) from the body field `field`.
///
/// # Errors
/// `400 invalid_parameter` naming the field and the value.
pub(crate) fn parse_time(field: &str, value: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(value)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            ApiError::new(
                ErrorCode::InvalidParameter,
                format!(
                    "{field} {value:?} is not an RFC 3339 date-time such as 2026-11-30T12:00:00Z: {e}"
                ),
            )
        })
}

/// Body of `POST /v1/handlers/{id}/recover`. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RecoverRequest {
    /// Deliver again the events completed at or after this time (RFC 3339),
    /// at most the node's retention period ago.
    #[schema(format = DateTime, example = "2026-11-30T12:00:00Z")]
    since: String,
}

/// Answer of `POST /v1/handlers/{id}/recover`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Recovered {
    /// Events put back as deliveries (`lanebus-replay: true`).
    recovered: u64,
    /// Events completed since then that already had a pending delivery to
    /// the handler (not doubled).
    already_pending: u64,
    /// Completions since then whose event is no longer stored (pruned).
    pruned: u64,
}

/// Handler of `POST /v1/handlers/{id}/recover` (module docs).
pub(crate) async fn recover(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Json(req): Json<RecoverRequest>,
) -> Result<axum::Json<Recovered>, ApiError> {
    check_handler_id(&id)?;
    let since = parse_time("since", &req.since)?;
    if let Some(retention) = state.node.retention() {
        let kept = chrono::TimeDelta::from_std(retention).unwrap_or(chrono::TimeDelta::MAX);
        // On the store's clock, which wrote the completion times.
        let now = state.store.now().await.map_err(ApiError::from)?;
        if let Some(earliest) = now.checked_sub_signed(kept) {
            if since < earliest {
                return Err(ApiError::new(
                    ErrorCode::InvalidInput,
                    format!(
                        "since {} lies before the retention window: completed events are kept \
                         for {} s, so the earliest since is {}",
                        since.to_rfc3339_opts(SecondsFormat::Secs, true),
                        retention.as_secs(),
                        earliest.to_rfc3339_opts(SecondsFormat::Secs, true)
                    ),
                ));
            }
        }
    }
    let out = state
        .store
        .recover(&id, since)
        .await
        .map_err(|e| not_found(e, &id))?;
    tracing::info!(
        handler = %id,
        since = %since,
        recovered = out.recovered,
        already_pending = out.already_pending,
        pruned = out.pruned,
        "recovery: completed events put back"
    );
    if out.recovered > 0 {
        state.node.handlers_changed();
    }
    Ok(axum::Json(Recovered {
        recovered: out.recovered,
        already_pending: out.already_pending,
        pruned: out.pruned,
    }))
}
