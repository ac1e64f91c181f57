//! Admin paths: dead letters, lanes, cluster.
//!
//! ```text
//! GET  /admin/dead-letters?handler_id=&after=&limit=
//!        200 {"dead_letters": [...], "next_after": id | null}
//! POST /admin/dead-letters/{id}/replay        200 {"replayed": 1} | 404 not_found
//! POST /admin/dead-letters/replay {"handler_id"?, "ids"?}   200 {"replayed": n}
//! GET  /admin/lanes                           200 {"lanes": [...]}
//! GET  /admin/cluster                         200 ClusterView
//! ```
//!
//! A replayed dead letter becomes a fresh delivery again (attempts reset).

use axum::extract::State;
use lanebus_store::{DeadLetter, DeadLetterFilter};
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorCode};
use crate::extract::{Json, Path, Query};
use crate::handlers::not_found;
use crate::{ApiState, ClusterView, LaneView};

/// Default page size of `GET /admin/dead-letters`.
pub const DEFAULT_PAGE: u32 = 100;
/// Largest page size of `GET /admin/dead-letters`.
pub const MAX_PAGE: u32 = 1_000;
/// Most ids in one bulk replay.
pub const MAX_REPLAY_IDS: usize = 10_000;

/// Query of `GET /admin/dead-letters`. Unknown parameters are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeadLetterQuery {
    /// Only this handler's dead letters (the handler must exist).
    handler_id: Option<String>,
    /// Only ids greater than this (`next_after` of the previous page).
    after: Option<i64>,
    /// Page size, 1 to 1,000 (default 100).
    limit: Option<u32>,
}

/// Body of `GET /admin/dead-letters`.
#[derive(Debug, Serialize)]
pub(crate) struct DeadLetterPage {
    /// Dead letters, oldest first.
    dead_letters: Vec<DeadLetter>,
    /// `after` for the next page; `null` when this page is the last.
    next_after: Option<i64>,
}

/// Body of the replay answers.
#[derive(Debug, Serialize)]
pub(crate) struct Replayed {
    /// Dead letters put back as deliveries.
    replayed: u64,
}

/// Body of `POST /admin/dead-letters/replay`. Unknown fields are refused.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BulkReplay {
    /// Replay this handler's dead letters (all of them when `ids` is absent).
    #[serde(default)]
    handler_id: Option<String>,
    /// Replay these dead letters (ids unknown are skipped and not counted).
    #[serde(default)]
    ids: Option<Vec<i64>>,
}

/// Handler of `GET /admin/dead-letters`: `400 invalid_parameter` for a bad
/// or unknown parameter, `404 not_found` for an unknown `handler_id`.
pub(crate) async fn list_dead_letters(
    State(state): State<ApiState>,
    Query(q): Query<DeadLetterQuery>,
) -> Result<axum::Json<DeadLetterPage>, ApiError> {
    let limit = q.limit.unwrap_or(DEFAULT_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::new(
            ErrorCode::InvalidParameter,
            format!("limit {limit} must be 1 to {MAX_PAGE}"),
        ));
    }
    if let Some(id) = &q.handler_id {
        state
            .store
            .get_handler(id)
            .await
            .map_err(|e| not_found(e, id))?;
    }
    let filter = DeadLetterFilter {
        handler_id: q.handler_id,
        after_id: q.after,
        limit,
    };
    let dead_letters = state.store.list_dead_letters(&filter).await?;
    let next_after = if dead_letters.len() as u32 >= limit {
        dead_letters.last().map(|d| d.id)
    } else {
        None
    };
    Ok(axum::Json(DeadLetterPage {
        dead_letters,
        next_after,
    }))
}

/// Handler of `POST /admin/dead-letters/{id}/replay`: `404 not_found` when
/// no dead letter has that id.
pub(crate) async fn replay_one(
    State(state): State<ApiState>,
    Path(id): Path<i64>,
) -> Result<axum::Json<Replayed>, ApiError> {
    let replayed = state.store.replay_dead_letters(&[id], None).await?;
    if replayed == 0 {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("dead letter {id} not found"),
        ));
    }
    crate::telemetry::dead_letters_replayed(None, &[id], replayed);
    state.node.handlers_changed();
    Ok(axum::Json(Replayed { replayed }))
}

/// Handler of `POST /admin/dead-letters/replay`: `422 invalid_input` when
/// neither `handler_id` nor `ids` is given, `404 not_found` for an unknown
/// `handler_id`.
pub(crate) async fn replay_bulk(
    State(state): State<ApiState>,
    Json(req): Json<BulkReplay>,
) -> Result<axum::Json<Replayed>, ApiError> {
    let ids = req.ids.unwrap_or_default();
    if ids.is_empty() && req.handler_id.is_none() {
        return Err(ApiError::new(
            ErrorCode::InvalidInput,
            "give handler_id or a non-empty ids, got neither",
        ));
    }
    if ids.len() > MAX_REPLAY_IDS {
        return Err(ApiError::new(
            ErrorCode::InvalidInput,
            format!(
                "ids holds {} dead letters, the limit is {MAX_REPLAY_IDS}",
                ids.len()
            ),
        ));
    }
    if let Some(id) = &req.handler_id {
        state
            .store
            .get_handler(id)
            .await
            .map_err(|e| not_found(e, id))?;
    }
    let replayed = state
        .store
        .replay_dead_letters(&ids, req.handler_id.as_deref())
        .await?;
    crate::telemetry::dead_letters_replayed(req.handler_id.as_deref(), &ids, replayed);
    if replayed > 0 {
        state.node.handlers_changed();
    }
    Ok(axum::Json(Replayed { replayed }))
}

/// Body of `GET /admin/lanes`.
#[derive(Debug, Serialize)]
pub(crate) struct LaneList {
    lanes: Vec<LaneView>,
}

/// Handler of `GET /admin/lanes`, from [`crate::NodeView::lanes`].
pub(crate) async fn lanes(State(state): State<ApiState>) -> axum::Json<LaneList> {
    axum::Json(LaneList {
        lanes: state.node.lanes().await,
    })
}

/// Handler of `GET /admin/cluster`, from [`crate::NodeView::cluster`].
pub(crate) async fn cluster(State(state): State<ApiState>) -> axum::Json<ClusterView> {
    axum::Json(state.node.cluster().await)
}
