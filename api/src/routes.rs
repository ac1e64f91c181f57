//! The route table: the one list of paths the API serves, and the router
//! built from it.
//!
//! [`ROUTES`] is the single source: [`router`] registers exactly its entries
//! (a test checks every entry answers with something other than 404/405),
//! and [`crate::openapi::document`] describes exactly its entries, keyed by
//! ([`RouteSpec::method`], [`RouteSpec::path`], [`Operation::id`]). Each
//! [`Operation`] also names the error codes it can answer with
//! ([`Operation::errors`]), which the document lists per operation.
//!
//! Adding a route means adding an [`Operation`] variant; the exhaustive
//! matches here and in the `openapi` module then ask for its handler, its
//! errors and its schemas, so the router and the document cannot drift.

use axum::extract::DefaultBodyLimit;
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post, put, MethodRouter};
use axum::Router;

use crate::error::{error_response, ApiError, ErrorCode};
use crate::{
    admin, deliveries, event_types, events, handlers, health, lookup, openapi, recovery, subjects,
    ui, ApiState,
};

/// What a route does; one variant per (method, path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `POST /v1/events`: publish a batch of events (202).
    PublishEvents,
    /// `GET /v1/events/{id}`: an event and its delivery state per handler.
    GetEvent,
    /// `POST /v1/handlers`: register a handler (201).
    CreateHandler,
    /// `GET /v1/handlers`: list handlers.
    ListHandlers,
    /// `GET /v1/handlers/{id}`: one handler.
    GetHandler,
    /// `DELETE /v1/handlers/{id}`: remove a handler, discarding its pending
    /// deliveries.
    DeleteHandler,
    /// `POST /v1/handlers/{id}/enable`: enable a handler (disabled by a
    /// `410 Gone` answer); its kept deliveries resume, in order per key.
    EnableHandler,
    /// `POST /v1/handlers/{id}/disable`: disable a handler by hand; its
    /// deliveries are kept, not attempted, until it is enabled.
    DisableHandler,
    /// `PATCH /v1/handlers/{id}`: change a handler's settings.
    UpdateHandler,
    /// `POST /v1/handlers/{id}/secret/rotate`: a new signing secret, the old
    /// one signing too for a grace period.
    RotateHandlerSecret,
    /// `GET /v1/handlers/{id}/deliveries`: a handler's deliveries in one
    /// state, newest first, paged.
    ListHandlerDeliveries,
    /// `POST /v1/handlers/{id}/recover`: deliver again the events completed
    /// for a handler since a time (marked `lanebus-replay: true`).
    RecoverHandler,
    /// `POST /v1/event-types`: add a type to the event-type catalog (201).
    CreateEventType,
    /// `GET /v1/event-types`: the catalog.
    ListEventTypes,
    /// `GET /v1/event-types/{name}`: one type, by wire name or alias.
    GetEventType,
    /// `PATCH /v1/event-types/{name}`: change (or rename) a type.
    UpdateEventType,
    /// `POST /v1/event-types/{name}/deprecate`: deprecate a type (its
    /// events are still accepted).
    DeprecateEventType,
    /// `GET /v1/catalog/settings`: the store-wide catalog setting.
    GetCatalogSettings,
    /// `PUT /v1/catalog/settings`: set it.
    SetCatalogSettings,
    /// `DELETE /v1/subjects/{id}`: destroy a subject's data key, erasing
    /// its personal fields everywhere (204).
    ForgetSubject,
    /// `GET /admin/dead-letters`: list dead letters.
    ListDeadLetters,
    /// `POST /admin/dead-letters/{id}/replay`: replay one dead letter.
    ReplayDeadLetter,
    /// `POST /admin/dead-letters/replay`: replay dead letters by handler or ids.
    ReplayDeadLetters,
    /// `GET /admin/lanes`: the lane table.
    ListLanes,
    /// `GET /admin/cluster`: the cluster membership.
    GetCluster,
    /// `POST /admin/cluster/join`: add a node (forwarded to the leader).
    JoinCluster,
    /// `POST /admin/cluster/remove`: remove a node on purpose (its lanes are
    /// handed over first).
    RemoveNode,
    /// `GET /admin/handlers`: handlers with their state and dead-letter
    /// counts, without secrets (the dashboard's handler table).
    HandlerSummaries,
    /// `GET /admin/handlers/{id}/activity`: the handler's attempts on this
    /// node over the last 15 minutes (the dashboard's plots).
    HandlerActivity,
    /// `GET /metrics`: Prometheus text.
    Metrics,
    /// `GET /healthz`: liveness.
    Healthz,
    /// `GET /readyz`: readiness.
    Readyz,
    /// `GET /openapi.json`: the OpenAPI 3.1 document of this API.
    OpenApi,
    /// `GET /ui`: redirect to `/ui/`.
    DashboardRedirect,
    /// `GET /ui/`: the dashboard page.
    Dashboard,
    /// `GET /ui/dashboard.js`: the dashboard's script.
    DashboardScript,
    /// `GET /ui/dashboard.css`: the dashboard's style sheet.
    DashboardStyle,
}

/// Codes of every route that reads a JSON body ([`crate::extract::Json`]).
const JSON_BODY: [ErrorCode; 4] = [
    ErrorCode::InvalidJson,
    ErrorCode::UnsupportedMediaType,
    ErrorCode::BodyTooLarge,
    ErrorCode::InvalidBody,
];
/// Codes of every route that calls the store (`From<StoreError>`).
const STORE: [ErrorCode; 2] = [ErrorCode::StoreUnavailable, ErrorCode::Internal];
/// Codes every route can answer with: a URI over [`MAX_URI_BYTES`] is
/// refused before routing ([`limit_uri`]).
const EVERY_ROUTE: [ErrorCode; 1] = [ErrorCode::UriTooLong];

/// Longest request URI (path and query) the router reads, in bytes; longer
/// is `414 uri_too_long` with the JSON error shape, on every path. (Past
/// 65,534 bytes hyper itself refuses the request line, before any router
/// runs, with an empty body: served through [`crate::serve::listener`], as
/// the node does, that answer gets the JSON shape too.)
pub const MAX_URI_BYTES: usize = 8_192;

impl Operation {
    /// Stable operation id (`publishEvents`, ...), as an OpenAPI
    /// `operationId` would name it.
    pub fn id(self) -> &'static str {
        match self {
            Operation::PublishEvents => "publishEvents",
            Operation::GetEvent => "getEvent",
            Operation::CreateHandler => "createHandler",
            Operation::ListHandlers => "listHandlers",
            Operation::GetHandler => "getHandler",
            Operation::DeleteHandler => "deleteHandler",
            Operation::EnableHandler => "enableHandler",
            Operation::DisableHandler => "disableHandler",
            Operation::UpdateHandler => "updateHandler",
            Operation::RotateHandlerSecret => "rotateHandlerSecret",
            Operation::RecoverHandler => "recoverHandler",
            Operation::ListHandlerDeliveries => "listHandlerDeliveries",
            Operation::CreateEventType => "createEventType",
            Operation::ListEventTypes => "listEventTypes",
            Operation::GetEventType => "getEventType",
            Operation::UpdateEventType => "updateEventType",
            Operation::DeprecateEventType => "deprecateEventType",
            Operation::GetCatalogSettings => "getCatalogSettings",
            Operation::SetCatalogSettings => "setCatalogSettings",
            Operation::ForgetSubject => "forgetSubject",
            Operation::ListDeadLetters => "listDeadLetters",
            Operation::ReplayDeadLetter => "replayDeadLetter",
            Operation::ReplayDeadLetters => "replayDeadLetters",
            Operation::ListLanes => "listLanes",
            Operation::GetCluster => "getCluster",
            Operation::JoinCluster => "joinCluster",
            Operation::RemoveNode => "removeNode",
            Operation::HandlerSummaries => "listHandlerSummaries",
            Operation::HandlerActivity => "getHandlerActivity",
            Operation::Metrics => "metrics",
            Operation::Healthz => "healthz",
            Operation::Readyz => "readyz",
            Operation::OpenApi => "openapi",
            Operation::DashboardRedirect => "dashboardRedirect",
            Operation::Dashboard => "dashboard",
            Operation::DashboardScript => "dashboardScript",
            Operation::DashboardStyle => "dashboardStyle",
        }
    }

    /// Every error code this operation can answer with (the status follows
    /// from the code, [`ErrorCode::status`]), `414 uri_too_long` included.
    /// Unknown paths (404 `path_not_found`) and methods (405
    /// `method_not_allowed`) belong to no operation and are not listed.
    pub fn errors(self) -> Vec<ErrorCode> {
        use ErrorCode as E;
        let mut codes: Vec<ErrorCode> = match self {
            Operation::PublishEvents => [
                &JSON_BODY[..],
                &[
                    E::EmptyBatch,
                    E::BatchTooLarge,
                    E::PayloadTooLarge,
                    E::InvalidEvent,
                    E::InvalidInput,
                    E::InvalidParameter,
                    // An `expected_seq` that did not hold.
                    E::Conflict,
                ],
                &STORE,
            ]
            .concat(),
            Operation::CreateHandler => [
                &JSON_BODY[..],
                &[E::InvalidHandler, E::InvalidInput, E::Conflict],
                &STORE,
            ]
            .concat(),
            Operation::ListHandlers
            | Operation::HandlerSummaries
            | Operation::ListEventTypes
            | Operation::GetCatalogSettings
            // The catalog, read for the document's `webhooks`.
            | Operation::OpenApi => STORE.to_vec(),
            // `invalid_input`: a broken catalog rule (a schema that is no
            // valid JSON Schema included); `conflict`: a name or alias
            // already a type's.
            Operation::CreateEventType => [
                &JSON_BODY[..],
                &[E::InvalidInput, E::Conflict],
                &STORE,
            ]
            .concat(),
            Operation::UpdateEventType => [
                &JSON_BODY[..],
                &[E::InvalidParameter, E::NotFound, E::InvalidInput, E::Conflict],
                &STORE,
            ]
            .concat(),
            Operation::GetEventType | Operation::DeprecateEventType => {
                [&[E::InvalidParameter, E::NotFound][..], &STORE].concat()
            }
            Operation::SetCatalogSettings => [&JSON_BODY[..], &STORE].concat(),
            // `invalid_input`: an id that is no subject id (empty, over
            // 256 bytes, a control character).
            Operation::ForgetSubject => {
                [&[E::InvalidParameter, E::InvalidInput][..], &STORE].concat()
            }
            Operation::UpdateHandler | Operation::RotateHandlerSecret => [
                &JSON_BODY[..],
                &[E::InvalidParameter, E::NotFound, E::InvalidHandler],
                &STORE,
            ]
            .concat(),
            // `invalid_parameter`: a path segment that does not decode
            // (`%FF`); `not_found` also for an id that is no handler id
            // (no event id); `pruned`: an event past retention.
            Operation::GetEvent => {
                [&[E::InvalidParameter, E::NotFound, E::Pruned][..], &STORE].concat()
            }
            Operation::GetHandler
            | Operation::DeleteHandler
            | Operation::EnableHandler
            | Operation::DisableHandler
            | Operation::HandlerActivity => {
                [&[E::InvalidParameter, E::NotFound][..], &STORE].concat()
            }
            Operation::RecoverHandler => [
                &JSON_BODY[..],
                &[E::InvalidParameter, E::NotFound, E::InvalidInput],
                &STORE,
            ]
            .concat(),
            Operation::ListHandlerDeliveries
            | Operation::ListDeadLetters
            | Operation::ReplayDeadLetter => {
                [&[E::InvalidParameter, E::NotFound][..], &STORE].concat()
            }
            Operation::ReplayDeadLetters => [
                &JSON_BODY[..],
                &[E::InvalidParameter, E::InvalidInput, E::NotFound],
                &STORE,
            ]
            .concat(),
            Operation::Readyz => vec![E::NotReady, E::StoreUnavailable],
            Operation::JoinCluster => {
                [&JSON_BODY[..], &[E::InvalidInput, E::Conflict, E::NotReady]].concat()
            }
            Operation::RemoveNode => [&JSON_BODY[..], &[E::Conflict, E::NotReady]].concat(),
            Operation::ListLanes => STORE.to_vec(),
            Operation::GetCluster
            | Operation::Metrics
            | Operation::Healthz
            | Operation::DashboardRedirect
            | Operation::Dashboard
            | Operation::DashboardScript
            | Operation::DashboardStyle => Vec::new(),
        };
        codes.extend(EVERY_ROUTE);
        if self.refuses_query() {
            codes.push(E::InvalidParameter);
        }
        // Authentication (`crate::auth`): a path that needs a scope can be
        // `401`; one that needs `admin` also `403` (every valid token has
        // the `publish` scope).
        let path = ROUTES
            .iter()
            .find(|r| r.operation == self)
            .map_or("", |r| r.path);
        match crate::auth::required_scope(path) {
            None => {}
            Some(crate::auth::Scope::Publish) => codes.push(E::Unauthorized),
            Some(crate::auth::Scope::Admin) => codes.extend([E::Unauthorized, E::Forbidden]),
        }
        codes.sort_by_key(|c| (c.status().as_u16(), c.as_str()));
        codes.dedup();
        codes
    }

    /// Whether a query string is refused (`400 invalid_parameter`): every
    /// `/v1` and `/admin` operation but `GET /admin/dead-letters` (whose
    /// own parameters are checked by its extractor) takes none, and a
    /// parameter given anyway (`GET /v1/handlers?limit=10`) would be
    /// silently ignored. Probes, `/metrics` and the dashboard are lenient.
    fn refuses_query(self) -> bool {
        let path = ROUTES
            .iter()
            .find(|r| r.operation == self)
            .map_or("", |r| r.path);
        (path.starts_with("/v1/") || path.starts_with("/admin/"))
            && self != Operation::ListDeadLetters
            && self != Operation::ListHandlerDeliveries
    }

    /// The endpoint (axum method router) serving this operation.
    fn method_router(self) -> MethodRouter<ApiState> {
        match self {
            Operation::PublishEvents => post(events::publish),
            Operation::GetEvent => get(lookup::get),
            Operation::CreateHandler => post(handlers::create),
            Operation::ListHandlers => get(handlers::list),
            Operation::GetHandler => get(handlers::get),
            Operation::DeleteHandler => delete(handlers::delete),
            Operation::EnableHandler => post(handlers::enable),
            Operation::DisableHandler => post(handlers::disable),
            Operation::UpdateHandler => patch(handlers::update),
            Operation::RotateHandlerSecret => post(handlers::rotate_secret),
            Operation::RecoverHandler => post(recovery::recover),
            Operation::ListHandlerDeliveries => get(deliveries::list),
            Operation::CreateEventType => post(event_types::create),
            Operation::ListEventTypes => get(event_types::list),
            Operation::GetEventType => get(event_types::get),
            Operation::UpdateEventType => patch(event_types::update),
            Operation::DeprecateEventType => post(event_types::deprecate),
            Operation::GetCatalogSettings => get(event_types::settings),
            Operation::SetCatalogSettings => put(event_types::set_settings),
            Operation::ForgetSubject => delete(subjects::forget),
            Operation::ListDeadLetters => get(admin::list_dead_letters),
            Operation::ReplayDeadLetter => post(admin::replay_one),
            Operation::ReplayDeadLetters => post(admin::replay_bulk),
            Operation::ListLanes => get(admin::lanes),
            Operation::GetCluster => get(admin::cluster),
            Operation::JoinCluster => post(admin::join),
            Operation::RemoveNode => post(admin::remove),
            Operation::HandlerSummaries => get(admin::handler_summaries),
            Operation::HandlerActivity => get(admin::handler_activity),
            Operation::Metrics => get(health::metrics),
            Operation::Healthz => get(health::healthz),
            Operation::Readyz => get(health::readyz),
            Operation::OpenApi => get(openapi::serve),
            Operation::DashboardRedirect => get(ui::redirect),
            Operation::Dashboard => get(ui::index),
            Operation::DashboardScript => get(ui::script),
            Operation::DashboardStyle => get(ui::style),
        }
    }
}

/// One entry of the route table.
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// HTTP method.
    pub method: Method,
    /// Path in axum 0.8 syntax (`/v1/handlers/{id}`), which is also
    /// OpenAPI's path template syntax.
    pub path: &'static str,
    /// What it does.
    pub operation: Operation,
}

const fn spec(method: Method, path: &'static str, operation: Operation) -> RouteSpec {
    RouteSpec {
        method,
        path,
        operation,
    }
}

/// Every path the API serves (docs/design.md section 4), in one place.
pub const ROUTES: &[RouteSpec] = &[
    spec(Method::POST, "/v1/events", Operation::PublishEvents),
    spec(Method::GET, "/v1/events/{id}", Operation::GetEvent),
    spec(Method::POST, "/v1/handlers", Operation::CreateHandler),
    spec(Method::GET, "/v1/handlers", Operation::ListHandlers),
    spec(Method::GET, "/v1/handlers/{id}", Operation::GetHandler),
    spec(
        Method::DELETE,
        "/v1/handlers/{id}",
        Operation::DeleteHandler,
    ),
    spec(Method::PATCH, "/v1/handlers/{id}", Operation::UpdateHandler),
    spec(
        Method::POST,
        "/v1/handlers/{id}/enable",
        Operation::EnableHandler,
    ),
    spec(
        Method::POST,
        "/v1/handlers/{id}/disable",
        Operation::DisableHandler,
    ),
    spec(
        Method::POST,
        "/v1/handlers/{id}/secret/rotate",
        Operation::RotateHandlerSecret,
    ),
    spec(
        Method::GET,
        "/v1/handlers/{id}/deliveries",
        Operation::ListHandlerDeliveries,
    ),
    spec(
        Method::POST,
        "/v1/handlers/{id}/recover",
        Operation::RecoverHandler,
    ),
    spec(Method::POST, "/v1/event-types", Operation::CreateEventType),
    spec(Method::GET, "/v1/event-types", Operation::ListEventTypes),
    spec(
        Method::GET,
        "/v1/event-types/{name}",
        Operation::GetEventType,
    ),
    spec(
        Method::PATCH,
        "/v1/event-types/{name}",
        Operation::UpdateEventType,
    ),
    spec(
        Method::POST,
        "/v1/event-types/{name}/deprecate",
        Operation::DeprecateEventType,
    ),
    spec(
        Method::GET,
        "/v1/catalog/settings",
        Operation::GetCatalogSettings,
    ),
    spec(
        Method::PUT,
        "/v1/catalog/settings",
        Operation::SetCatalogSettings,
    ),
    spec(
        Method::DELETE,
        "/v1/subjects/{id}",
        Operation::ForgetSubject,
    ),
    spec(
        Method::GET,
        "/admin/dead-letters",
        Operation::ListDeadLetters,
    ),
    spec(
        Method::POST,
        "/admin/dead-letters/{id}/replay",
        Operation::ReplayDeadLetter,
    ),
    spec(
        Method::POST,
        "/admin/dead-letters/replay",
        Operation::ReplayDeadLetters,
    ),
    spec(Method::GET, "/admin/lanes", Operation::ListLanes),
    spec(Method::GET, "/admin/cluster", Operation::GetCluster),
    spec(Method::POST, "/admin/cluster/join", Operation::JoinCluster),
    spec(Method::POST, "/admin/cluster/remove", Operation::RemoveNode),
    spec(Method::GET, "/admin/handlers", Operation::HandlerSummaries),
    spec(
        Method::GET,
        "/admin/handlers/{id}/activity",
        Operation::HandlerActivity,
    ),
    spec(Method::GET, "/metrics", Operation::Metrics),
    spec(Method::GET, "/healthz", Operation::Healthz),
    spec(Method::GET, "/readyz", Operation::Readyz),
    spec(Method::GET, "/openapi.json", Operation::OpenApi),
    spec(Method::GET, "/ui", Operation::DashboardRedirect),
    spec(Method::GET, "/ui/", Operation::Dashboard),
    spec(Method::GET, "/ui/dashboard.js", Operation::DashboardScript),
    spec(Method::GET, "/ui/dashboard.css", Operation::DashboardStyle),
];

/// The API router: every entry of [`ROUTES`] behind the bearer-token check
/// of [`crate::auth`] (`401`/`403`), a JSON 404 for unknown paths,
/// a JSON 405 for unknown methods (with `allow`), the body limit of
/// [`crate::Limits::max_body_bytes`] (413 JSON), the URI limit of
/// [`MAX_URI_BYTES`] (414 JSON), and a safety net that turns any other
/// non-JSON error answer into the JSON error shape.
///
/// Serve it with `axum::serve(lanebus_api::serve::listener(tcp), router(state))`
/// ([`crate::serve`]: hyper's own refusals get the JSON shape too).
pub fn router(state: ApiState) -> Router {
    let max_body = state.limits.max_body_bytes;
    let auth = state.auth.clone();
    ROUTES
        .iter()
        .fold(Router::new(), |r, spec| {
            let m = spec.operation.method_router();
            let m = if spec.operation.refuses_query() {
                m.route_layer(axum::middleware::from_fn(refuse_query))
            } else {
                m
            };
            r.route(spec.path, m)
        })
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(path_not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(
            auth,
            crate::auth::authorize,
        ))
        .layer(axum::middleware::from_fn(limit_uri))
        .layer(axum::middleware::map_response(ensure_json_errors))
        .with_state(state)
}

async fn path_not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::PathNotFound,
        format!("no path {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("method {method} is not allowed on {}", uri.path()),
    )
}

/// Refuses a request with a query string, naming its parameters (see
/// [`Operation::refuses_query`]).
async fn refuse_query(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match req.uri().query() {
        None => next.run(req).await,
        Some(q) => {
            let names: Vec<String> = q
                .split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let name = p.split('=').next().unwrap_or_default();
                    name.chars().take(64).collect()
                })
                .collect();
            ApiError::new(
                ErrorCode::InvalidParameter,
                format!(
                    "query parameters {names:?} given, but {} {} takes none",
                    req.method(),
                    req.uri().path()
                ),
            )
            .into_response()
        }
    }
}

/// Refuses a request whose URI is longer than [`MAX_URI_BYTES`] with
/// `414 uri_too_long`, before routing (so on every path, known or not).
async fn limit_uri(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let uri = req.uri();
    let len = uri.path_and_query().map_or(0, |pq| pq.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len());
    if len > MAX_URI_BYTES {
        return ApiError::new(
            ErrorCode::UriTooLong,
            format!("request uri of {len} bytes exceeds the limit of {MAX_URI_BYTES} bytes"),
        )
        .into_response();
    }
    next.run(req).await
}

/// The safety net: an error answer that is not JSON (from a layer or an
/// axum default we did not wrap) gets the JSON error shape, keeping its
/// headers such as `allow`. The code is always one of [`ErrorCode`]: the
/// statuses that have a code keep it; any other 4xx becomes
/// `400 bad_request`, any 5xx `internal` (keeping its status).
async fn ensure_json_errors(res: Response) -> Response {
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return res;
    }
    let (code, message) = match status {
        StatusCode::NOT_FOUND => (ErrorCode::PathNotFound, "no such path"),
        StatusCode::METHOD_NOT_ALLOWED => (
            ErrorCode::MethodNotAllowed,
            "method not allowed on this path",
        ),
        StatusCode::PAYLOAD_TOO_LARGE => (ErrorCode::BodyTooLarge, "request body too large"),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => (
            ErrorCode::UnsupportedMediaType,
            "content-type must be application/json",
        ),
        StatusCode::URI_TOO_LONG => (ErrorCode::UriTooLong, "request uri too long"),
        s if s.is_server_error() => (ErrorCode::Internal, "internal error"),
        _ => (ErrorCode::BadRequest, "request refused"),
    };
    crate::telemetry::api_error(code.as_str());
    let (mut parts, _) = res.into_parts();
    let status = if status.is_server_error() {
        status
    } else {
        code.status()
    };
    parts.status = status;
    let fresh = error_response(status, code, message);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let (_, body) = fresh.into_parts();
    Response::from_parts(parts, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body_json(res: Response) -> serde_json::Value {
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        serde_json::from_slice(&bytes).unwrap_or_default()
    }

    #[tokio::test]
    async fn safety_net_turns_plain_errors_into_json_and_keeps_headers() {
        let mut plain = (StatusCode::METHOD_NOT_ALLOWED, "nope").into_response();
        plain
            .headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static("GET,HEAD"));
        let res = ensure_json_errors(plain).await;
        assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(
            res.headers()
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok()),
            Some("GET,HEAD")
        );
        assert_eq!(
            res.headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
            Some("application/json")
        );
        let body = body_json(res).await;
        assert_eq!(body["error"]["code"], "method_not_allowed");

        let res =
            ensure_json_errors((StatusCode::PAYLOAD_TOO_LARGE, "too big").into_response()).await;
        assert_eq!(body_json(res).await["error"]["code"], "body_too_large");
        let res = ensure_json_errors((StatusCode::BAD_GATEWAY, "x").into_response()).await;
        assert_eq!(body_json(res).await["error"]["code"], "internal");
        let res = ensure_json_errors((StatusCode::URI_TOO_LONG, "").into_response()).await;
        assert_eq!(res.status(), StatusCode::URI_TOO_LONG);
        assert_eq!(body_json(res).await["error"]["code"], "uri_too_long");
    }

    #[tokio::test]
    async fn safety_net_emits_only_documented_codes_with_their_status() {
        let documented: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        for n in 400u16..600 {
            let Ok(status) = StatusCode::from_u16(n) else {
                continue;
            };
            let res = ensure_json_errors((status, "plain").into_response()).await;
            let answered = res.status();
            let body = body_json(res).await;
            let code = body["error"]["code"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(documented.contains(&code.as_str()), "{n}: code {code:?}");
            let code = ErrorCode::ALL
                .into_iter()
                .find(|c| c.as_str() == code)
                .expect("documented");
            if n < 500 {
                assert_eq!(answered, code.status(), "{n}: {code:?}");
            } else {
                assert_eq!((answered, code), (status, ErrorCode::Internal));
            }
        }
    }

    #[tokio::test]
    async fn safety_net_leaves_successes_and_json_errors_alone() {
        let ok = ensure_json_errors((StatusCode::OK, "fine").into_response()).await;
        let bytes = axum::body::to_bytes(ok.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        assert_eq!(&bytes[..], b"fine");
        let api = ensure_json_errors(
            ApiError::new(ErrorCode::NotFound, "handler \"x\" not found").into_response(),
        )
        .await;
        assert_eq!(
            body_json(api).await["error"]["message"],
            "handler \"x\" not found"
        );
    }

    #[test]
    fn route_table_has_unique_method_path_pairs_and_operations() {
        for (i, a) in ROUTES.iter().enumerate() {
            for b in &ROUTES[i + 1..] {
                assert!(
                    !(a.method == b.method && a.path == b.path),
                    "{} {} twice",
                    a.method,
                    a.path
                );
                assert_ne!(a.operation, b.operation, "{} used twice", a.operation.id());
            }
        }
    }
}
