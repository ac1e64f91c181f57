//! Admin paths: dead letters, lanes, cluster, handler summaries.
//!
//! ```text
//! GET  /admin/dead-letters?handler_id=&after=&limit=
//!        200 {"dead_letters": [...], "next_after": id | null}
//! POST /admin/dead-letters/{id}/replay        200 {"replayed": 1} | 404 not_found
//! POST /admin/dead-letters/replay {"handler_id"?, "ids"?} | {"all": true}
//!        | {"handler_id", "since"?, "until"?}   (failed_at in [since, until))
//!        200 {"replayed": n} | 422 invalid_input (no selection, e.g. `{}`)
//! GET  /admin/lanes                           200 {"lanes": [...]}
//! GET  /admin/cluster                         200 ClusterView
//! POST /admin/cluster/join {"id","raft_addr","http_addr"}
//!        200 {"ok": true} | 409 conflict | 503 not_ready
//! POST /admin/cluster/remove {"id"}            200 {"ok": true} | 409 | 503
//! GET  /admin/handlers                        200 {"handlers": [...], "dead_letters_exact": bool}
//!        (each: state, routes, payload filter, dead-letter count)
//! GET  /admin/handlers/{id}/activity          200 HandlerActivity | 404 not_found
//! ```
//!
//! A replayed dead letter becomes a fresh delivery again (attempts reset);
//! a key's replayed deliveries are handed out in sequence order.
//!
//! `GET /admin/handlers` is the operator's view of the catalog (the
//! dashboard polls it every second): each handler's state and dead-letter
//! count, without its secret. The store has no per-handler count, so the
//! count pages through the dead letters, at most
//! [`DEAD_LETTERS_COUNTED_MAX`] of them per call; past that the counts are
//! lower bounds and `dead_letters_exact` is `false`. This bounds the cost of
//! a poll whatever the dead-letter table holds.
//!
//! `GET /admin/handlers/{id}/activity` answers from the node's own counters
//! ([`NodeView::handler_activity`](crate::NodeView::handler_activity)); the
//! store is read only to tell an unknown handler (`404`).

use std::collections::HashMap;

use axum::extract::State;
use chrono::{DateTime, Utc};
use lanebus_store::{DeadLetter, DeadLetterFilter};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::error::{ApiError, ErrorCode};
use crate::extract::{Json, Path, Query};
use crate::handlers::{check_handler_id, not_found, FilterView, HandlerStateView, RateLimitView};
use crate::{
    ApiState, ClusterChangeError, ClusterView, HandlerActivity, JoinRequest, LaneView,
    RemoveRequest, ACTIVITY_INTERVAL_S, ACTIVITY_WINDOW_S,
};

/// Default page size of `GET /admin/dead-letters`.
pub const DEFAULT_PAGE: u32 = 100;
/// Largest page size of `GET /admin/dead-letters`.
pub const MAX_PAGE: u32 = 1_000;
/// Most ids in one bulk replay.
pub const MAX_REPLAY_IDS: usize = 10_000;
/// Most dead letters `GET /admin/handlers` reads to count them per handler.
pub const DEAD_LETTERS_COUNTED_MAX: u32 = 10_000;

/// Query of `GET /admin/dead-letters`. Unknown parameters are refused.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct DeadLetterQuery {
    /// Only this handler's dead letters (the handler must exist).
    #[param(pattern = "^hdl_[0-9a-f]{32}$")]
    handler_id: Option<String>,
    /// Only ids greater than this (`next_after` of the previous page).
    after: Option<i64>,
    /// Page size, 1 to 1,000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<u32>,
}

/// One dead letter: a delivery that exhausted its handler's attempts.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeadLetterView {
    /// Dead-letter id (for replay).
    id: i64,
    /// Handler it was meant for.
    handler_id: String,
    /// Event id.
    event_id: String,
    /// Event type.
    event_type: String,
    /// Ordering key; `null` when unkeyed.
    key: Option<String>,
    /// Position of the event within its key; `null` when unkeyed.
    seq: Option<i64>,
    /// Attempts made.
    attempts: u32,
    /// Error of the last attempt.
    last_error: String,
    /// When it became a dead letter (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    failed_at: DateTime<Utc>,
}

impl From<DeadLetter> for DeadLetterView {
    fn from(d: DeadLetter) -> Self {
        // Destructured so a new store field is a compile error here.
        let DeadLetter {
            id,
            handler_id,
            event_id,
            event_type,
            key,
            seq,
            attempts,
            last_error,
            failed_at,
        } = d;
        DeadLetterView {
            id,
            handler_id,
            event_id,
            event_type,
            key,
            seq,
            attempts,
            last_error,
            failed_at,
        }
    }
}

/// Body of `GET /admin/dead-letters`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DeadLetterPage {
    /// Dead letters, oldest first.
    dead_letters: Vec<DeadLetterView>,
    /// `after` for the next page; `null` when this page is the last.
    next_after: Option<i64>,
}

/// Body of the replay answers.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Replayed {
    /// Dead letters put back as deliveries.
    replayed: u64,
}

/// Body of `POST /admin/dead-letters/replay`: the selection must be
/// explicit: `handler_id`, `ids`, or both (then only those ids of that
/// handler), or `"all": true` alone (every dead letter of every handler).
/// Anything else, `{}` included, replays nothing and is refused. Unknown
/// fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BulkReplay {
    /// Replay this handler's dead letters (all of them when `ids` is absent).
    #[serde(default)]
    #[schema(pattern = "^hdl_[0-9a-f]{32}$")]
    handler_id: Option<String>,
    /// Replay these dead letters, at most 10,000 (ids unknown are skipped
    /// and not counted).
    #[serde(default)]
    #[schema(max_items = 10_000)]
    ids: Option<Vec<i64>>,
    /// `true`: replay every dead letter of every handler (one handler after
    /// the other); not combined with `handler_id` or `ids`.
    #[serde(default)]
    all: bool,
    /// With `handler_id` (and without `ids`): only dead letters that failed
    /// at or after this time (RFC 3339).
    #[serde(default)]
    #[schema(format = DateTime, example = "2026-11-30T12:00:00Z")]
    since: Option<String>,
    /// With `handler_id` (and without `ids`): only dead letters that failed
    /// before this time (RFC 3339).
    #[serde(default)]
    #[schema(format = DateTime, example = "2026-11-30T13:00:00Z")]
    until: Option<String>,
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
        check_handler_id(id)?;
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
        dead_letters: dead_letters.into_iter().map(Into::into).collect(),
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
/// the selection is not explicit (neither `handler_id`, a non-empty `ids`
/// nor `"all": true`; or `all` combined with the others), `404 not_found`
/// for an unknown `handler_id`.
pub(crate) async fn replay_bulk(
    State(state): State<ApiState>,
    Json(req): Json<BulkReplay>,
) -> Result<axum::Json<Replayed>, ApiError> {
    let ids = req.ids.unwrap_or_default();
    if req.since.is_some() || req.until.is_some() {
        return replay_between(&state, req.handler_id, ids, req.all, req.since, req.until)
            .await
            .map(axum::Json);
    }
    if req.all {
        if req.handler_id.is_some() || !ids.is_empty() {
            return Err(ApiError::new(
                ErrorCode::InvalidInput,
                "\"all\": true replays every dead letter and takes no handler_id or ids",
            ));
        }
        return replay_all(&state).await.map(axum::Json);
    }
    if ids.is_empty() && req.handler_id.is_none() {
        return Err(ApiError::new(
            ErrorCode::InvalidInput,
            "choose the dead letters to replay: give handler_id, a non-empty ids, or \"all\": true",
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
        check_handler_id(id)?;
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

/// `{"handler_id", "since"?, "until"?}`: that handler's dead letters that
/// failed in the time range, in one store call.
async fn replay_between(
    state: &ApiState,
    handler_id: Option<String>,
    ids: Vec<i64>,
    all: bool,
    since: Option<String>,
    until: Option<String>,
) -> Result<Replayed, ApiError> {
    let Some(handler_id) = handler_id.filter(|_| ids.is_empty() && !all) else {
        return Err(ApiError::new(
            ErrorCode::InvalidInput,
            "since and until select by time within one handler: give handler_id, without ids or all",
        ));
    };
    let since = since
        .as_deref()
        .map(|t| crate::recovery::parse_time("since", t))
        .transpose()?;
    let until = until
        .as_deref()
        .map(|t| crate::recovery::parse_time("until", t))
        .transpose()?;
    if let (Some(s), Some(u)) = (since, until) {
        if s >= u {
            return Err(ApiError::new(
                ErrorCode::InvalidInput,
                format!("since {s} must be before until {u}"),
            ));
        }
    }
    check_handler_id(&handler_id)?;
    state
        .store
        .get_handler(&handler_id)
        .await
        .map_err(|e| not_found(e, &handler_id))?;
    let replayed = state
        .store
        .replay_dead_letters_between(&handler_id, since, until)
        .await?;
    crate::telemetry::dead_letters_replayed(Some(&handler_id), &[], replayed);
    if replayed > 0 {
        state.node.handlers_changed();
    }
    Ok(Replayed { replayed })
}

/// `"all": true`: every handler's dead letters, one handler at a time (each
/// handler's replay is one store call).
async fn replay_all(state: &ApiState) -> Result<Replayed, ApiError> {
    let mut replayed = 0;
    for h in state.store.list_handlers().await? {
        let n = state.store.replay_dead_letters(&[], Some(&h.id)).await?;
        if n > 0 {
            crate::telemetry::dead_letters_replayed(Some(&h.id), &[], n);
        }
        replayed += n;
    }
    if replayed > 0 {
        state.node.handlers_changed();
    }
    Ok(Replayed { replayed })
}

/// Body of `GET /admin/lanes`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct LaneList {
    /// Every lane, by lane number.
    lanes: Vec<LaneView>,
}

/// Handler of `GET /admin/lanes`, from [`crate::NodeView::lanes`].
pub(crate) async fn lanes(State(state): State<ApiState>) -> Result<axum::Json<LaneList>, ApiError> {
    Ok(axum::Json(LaneList {
        lanes: state.node.lanes().await?,
    }))
}

/// Handler of `GET /admin/cluster`, from [`crate::NodeView::cluster`].
pub(crate) async fn cluster(State(state): State<ApiState>) -> axum::Json<ClusterView> {
    axum::Json(state.node.cluster().await)
}

/// Answer of the cluster changes (`join`, `remove`).
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ClusterChanged {
    /// Always `true`: the change is recorded.
    ok: bool,
}

fn cluster_change_error(e: ClusterChangeError) -> ApiError {
    match e {
        ClusterChangeError::NotClustered => ApiError::new(
            ErrorCode::Conflict,
            "this node runs without a cluster (--single)",
        ),
        ClusterChangeError::Unavailable(m) => ApiError::new(
            ErrorCode::NotReady,
            format!("no raft leader reachable: {m}"),
        ),
        ClusterChangeError::Refused(m) => ApiError::new(ErrorCode::Conflict, m),
    }
}

/// Handler of `POST /admin/cluster/join`, through
/// [`crate::NodeView::join_node`].
pub(crate) async fn join(
    State(state): State<ApiState>,
    Json(req): Json<JoinRequest>,
) -> Result<axum::Json<ClusterChanged>, ApiError> {
    validate_join(&req)?;
    state
        .node
        .join_node(req)
        .await
        .map_err(cluster_change_error)?;
    Ok(axum::Json(ClusterChanged { ok: true }))
}

/// Checks a join request before any cluster round trip: `422
/// invalid_input` for id 0 or an address that is not `IP:PORT`.
fn validate_join(req: &JoinRequest) -> Result<(), ApiError> {
    if req.id == 0 {
        return Err(ApiError::new(
            ErrorCode::InvalidInput,
            "id must be a positive integer, got 0",
        ));
    }
    for (name, a) in [("raft_addr", &req.raft_addr), ("http_addr", &req.http_addr)] {
        match a.parse::<std::net::SocketAddr>() {
            Ok(s) if s.ip().is_unspecified() => {
                return Err(ApiError::new(
                    ErrorCode::InvalidInput,
                    format!("{name} {a:?} is an unspecified address: peers cannot reach it"),
                ))
            }
            Ok(_) => {}
            // A node started with --advertise-addr NAME records NAME:PORT.
            Err(_) if is_dns_host_port(a) => {}
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::InvalidInput,
                    format!("{name} {a:?} must be IP:PORT or HOST:PORT"),
                ))
            }
        }
    }
    Ok(())
}

/// Whether `a` is `NAME:PORT` with a DNS name (letters, digits, hyphens and
/// dots, as the `url` crate parses a domain) and a port above 0.
fn is_dns_host_port(a: &str) -> bool {
    let Some((host, port)) = a.rsplit_once(':') else {
        return false;
    };
    let plain = |b: u8| b.is_ascii_alphanumeric() || b == b'-' || b == b'.';
    !host.is_empty()
        && host.bytes().all(plain)
        && port.parse::<u16>().is_ok_and(|p| p > 0)
        && matches!(url::Host::parse(host), Ok(url::Host::Domain(_)))
}

/// Handler of `POST /admin/cluster/remove`, through
/// [`crate::NodeView::remove_node`].
pub(crate) async fn remove(
    State(state): State<ApiState>,
    Json(req): Json<RemoveRequest>,
) -> Result<axum::Json<ClusterChanged>, ApiError> {
    state
        .node
        .remove_node(req.id)
        .await
        .map_err(cluster_change_error)?;
    Ok(axum::Json(ClusterChanged { ok: true }))
}

/// One handler in `GET /admin/handlers`: what an operator looks at, without
/// the signing secret.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HandlerSummary {
    /// Handler id.
    id: String,
    /// Human-readable name.
    name: String,
    /// Webhook URL.
    url: String,
    /// Routes.
    event_types: Vec<String>,
    /// Enabled or disabled.
    state: HandlerStateView,
    /// Why `state` last changed: `gone`, `failing`, `api`; `null` if never.
    state_reason: Option<String>,
    /// Start of the current run of failed attempts without a success (RFC
    /// 3339), `null` when the last outcome was a success.
    #[schema(value_type = Option<String>, format = DateTime)]
    failing_since: Option<DateTime<Utc>>,
    /// Requests per second per node and burst, `null` when unlimited.
    rate_limit: Option<RateLimitView>,
    /// Payload filter (as in `GET /v1/handlers/{id}`), `null` when the
    /// handler has none.
    filter: Option<FilterView>,
    /// Dead letters of this handler (a lower bound when
    /// `dead_letters_exact` is `false`).
    dead_letters: u64,
}

/// Body of `GET /admin/handlers`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct HandlerSummaries {
    /// Every handler, by creation order.
    handlers: Vec<HandlerSummary>,
    /// `false` when counting stopped at its bound of 10,000 dead letters:
    /// the counts are then lower bounds.
    dead_letters_exact: bool,
}

/// Handler of `GET /admin/handlers`: the catalog with dead-letter counts
/// (see the module docs for the bound on counting); a catalog read the
/// store does not answer within 2 s is `503 store_unavailable`
/// ([`crate::health::bounded`]).
pub(crate) async fn handler_summaries(
    State(state): State<ApiState>,
) -> Result<axum::Json<HandlerSummaries>, ApiError> {
    let handlers =
        crate::health::bounded(state.store.backend(), state.store.list_handlers()).await??;
    let mut counts: HashMap<String, u64> = HashMap::new();
    let mut after = None;
    let mut read = 0u32;
    let exact = loop {
        let limit = MAX_PAGE.min(DEAD_LETTERS_COUNTED_MAX - read);
        if limit == 0 {
            break false;
        }
        let page = state
            .store
            .list_dead_letters(&DeadLetterFilter {
                handler_id: None,
                after_id: after,
                limit,
            })
            .await?;
        read += page.len() as u32;
        for d in &page {
            *counts.entry(d.handler_id.clone()).or_default() += 1;
        }
        if (page.len() as u32) < limit {
            break true;
        }
        after = page.last().map(|d| d.id);
    };
    Ok(axum::Json(HandlerSummaries {
        handlers: handlers
            .into_iter()
            .map(|h| HandlerSummary {
                dead_letters: counts.get(&h.id).copied().unwrap_or(0),
                id: h.id,
                name: h.name,
                url: h.url,
                event_types: h.event_types,
                state: h.state.into(),
                state_reason: h.state_reason,
                failing_since: h.failing_since,
                rate_limit: h.rate_limit.map(Into::into),
                filter: h.filter.as_ref().map(|f| FilterView(f.to_json())),
            })
            .collect(),
        dead_letters_exact: exact,
    }))
}

/// Handler of `GET /admin/handlers/{id}/activity`: `404 not_found` for an
/// unknown handler (a read of the handler by id, bounded to 2 s like the
/// catalog read of `GET /admin/handlers`), else this node's samples.
pub(crate) async fn handler_activity(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<HandlerActivity>, ApiError> {
    crate::handlers::existing(&state, &id).await?;
    Ok(axum::Json(HandlerActivity {
        node_id: state.node.node_id(),
        samples: state.node.handler_activity(&id),
        handler_id: id,
        interval_s: ACTIVITY_INTERVAL_S,
        window_s: ACTIVITY_WINDOW_S,
    }))
}

#[cfg(test)]
mod tests {
    use super::is_dns_host_port;

    #[test]
    fn dns_host_and_port_is_told_from_the_rest() {
        for ok in [
            "lanebus-1:9080",
            "node-2.internal.example:8080",
            "localhost:1",
        ] {
            assert!(is_dns_host_port(ok), "{ok}");
        }
        for bad in [
            "lanebus-1",
            "lanebus-1:0",
            "lanebus-1:99999",
            ":9080",
            "node_1:9080",
            "http://node:9080",
            "a b:9080",
            "user@node:9080",
        ] {
            assert!(!is_dns_host_port(bad), "{bad}");
        }
    }
}
