//! `GET /metrics`, `GET /healthz`, `GET /readyz`.
//!
//! - `/metrics`: 200, Prometheus text (`text/plain; version=0.0.4`) from
//!   [`crate::NodeView::render_metrics`].
//! - `/healthz`: liveness, 200 `{"status": "ok"}` while the process serves.
//! - `/readyz`: readiness, 200 `{"status": "ready"}` when the node says it is
//!   ready and the store answers a ping; else `503 not_ready` (its message
//!   says why) or `503 store_unavailable`.

use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::error::{ApiError, ErrorCode};
use crate::ApiState;

/// Content type of the Prometheus text exposition format 0.0.4.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4";

/// Body of `/healthz` (`ok`) and `/readyz` (`ready`) when they succeed.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Status {
    /// `ok` (liveness) or `ready` (readiness).
    #[schema(value_type = String, example = "ok")]
    status: &'static str,
}

/// Handler of `GET /metrics`.
pub(crate) async fn metrics(State(state): State<ApiState>) -> Response {
    let mut res = state.node.render_metrics().into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROMETHEUS_CONTENT_TYPE),
    );
    res
}

/// Handler of `GET /healthz`.
pub(crate) async fn healthz() -> axum::Json<Status> {
    axum::Json(Status { status: "ok" })
}

/// How long `/readyz` waits for the store's ping, and the API for a
/// catalog read (`GET /v1/handlers`, `GET /v1/handlers/{id}`, the handler
/// list of `GET /admin/handlers`): a probe or an operator must hear "store
/// unavailable" sooner than the store pool's own timeout (10 s).
pub(crate) const STORE_READ_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

/// Awaits the store call `read` for at most [`STORE_READ_BOUND`].
///
/// # Errors
/// `503 store_unavailable` ("`{backend}` store does not answer within 2000
/// ms") when it did not finish in time; the call's own result otherwise,
/// for the caller to map.
pub(crate) async fn bounded<T>(
    backend: &str,
    read: impl std::future::Future<Output = Result<T, lanebus_store::StoreError>>,
) -> Result<Result<T, lanebus_store::StoreError>, ApiError> {
    tokio::time::timeout(STORE_READ_BOUND, read)
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorCode::StoreUnavailable,
                format!(
                    "{backend} store does not answer within {} ms",
                    STORE_READ_BOUND.as_millis()
                ),
            )
        })
}

/// Handler of `GET /readyz`.
pub(crate) async fn readyz(State(state): State<ApiState>) -> Result<axum::Json<Status>, ApiError> {
    if let Err(why) = state.node.ready().await {
        return Err(ApiError::new(
            ErrorCode::NotReady,
            format!("node {} is not ready: {why}", state.node.node_id()),
        ));
    }
    let backend = state.store.backend();
    match bounded(backend, state.store.ping()).await? {
        Ok(()) => Ok(axum::Json(Status { status: "ready" })),
        Err(e) => Err(ApiError::new(
            ErrorCode::StoreUnavailable,
            format!("{backend} store does not answer: {e}"),
        )),
    }
}
