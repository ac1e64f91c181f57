//! The handler catalog: `POST /v1/handlers`, `GET /v1/handlers`,
//! `GET /v1/handlers/{id}`, `DELETE /v1/handlers/{id}`.
//!
//! ```text
//! POST /v1/handlers {"name", "url", "event_types": [...], "max_attempts"?,
//!                    "timeout_ms"?, "max_in_flight"?, "secret"?,
//!                    "rate_limit"?: {"per_second", "burst"?}, "filter"?}
//!   201 {"id", "name", "url", "event_types", "max_attempts", "timeout_ms",
//!        "max_in_flight", "secret", "state", "created_at", "rate_limit",
//!        "filter", ...}
//! GET /v1/handlers          200 {"handlers": [<handler>, ...]}  (creation order)
//!                           | 503 store_unavailable (no answer within 2 s)
//! GET /v1/handlers/{id}     200 <handler> | 404 not_found | 503 (as above)
//! PATCH /v1/handlers/{id} {"name"?, "url"?, "event_types"?, "max_attempts"?,
//!                          "timeout_ms"?, "max_in_flight"?, "rate_limit"?,
//!                          "filter"?}
//!                           200 <handler> | 404 | 422 invalid_handler
//! DELETE /v1/handlers/{id}  200 {"deleted": id, "discarded_deliveries": n,
//!                               "discarded_dead_letters": m} | 404
//! POST /v1/handlers/{id}/enable  200 <handler> | 404
//! POST /v1/handlers/{id}/secret/rotate {"secret"?, "grace_period_s"?}
//!                           200 <handler> | 404 | 422 invalid_handler
//! ```
//!
//! A webhook answering `410 Gone` disables its handler (`"state":
//! "disabled"`, `"state_reason": "gone"`), and so does a run of failures
//! without a success as long as the node's auto-disable period
//! (`"failing"`): its pending deliveries are kept and not attempted, and so
//! are those of events published meanwhile. `POST /v1/handlers/{id}/enable`
//! enables it again (idempotent); the kept deliveries resume in order per
//! key.
//!
//! `PATCH` is a JSON merge patch of the settings: absent fields stay,
//! `"rate_limit": null` removes the limit, a `rate_limit` object replaces it
//! whole (not merged field by field), and so for `filter`; other fields
//! cannot be null. The result is checked like a registration. Route and
//! filter changes apply to events published after the change.
//!
//! A `filter` is a payload filter (`lanebus_store::filter` has the shape
//! and semantics; docs/api.md): the handler gets a delivery only for events
//! whose payload matches it, decided when the event is published.
//!
//! Secret rotation: the new secret (given, or generated) signs at once;
//! the old one keeps signing next to it for `grace_period_s` (default 24 h),
//! so `webhook-signature` carries `v1,<new> v1,<old>` meanwhile (Standard
//! Webhooks allows several space-separated signatures) and receivers can
//! switch secrets at any moment of that period.
//!
//! A handler's routes (`event_types`) are exact event types or prefixes with
//! one trailing `*`. Deleting a handler discards its pending deliveries; the
//! answer and the log say how many.

use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use lanebus_store::rules::{self, Broken};
use lanebus_store::{
    change_state, generate_secret, handler_defaults, Filter, Handler, HandlerPatch, HandlerState,
    NewHandler, RateLimit,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorCode};
use crate::extract::{Json, OptionalJson, Path};
use crate::ApiState;

pub use rules::handler::{
    is_id as is_handler_id, ID_PATTERN as HANDLER_ID_PATTERN, MAX_ATTEMPTS, MAX_IN_FLIGHT,
    MAX_URL_BYTES, NAME_CHARS, RATE_LIMIT, ROUTES as ROUTES_PER_HANDLER, TIMEOUT_MS,
};
pub use rules::secret::{BYTES as SECRET_BYTES, DEFAULT_GRACE_PERIOD_S, GRACE_PERIOD_S};

/// `id` for a message: at most 64 characters, quoted and escaped.
fn shown(id: &str) -> String {
    match id.char_indices().nth(64) {
        Some((end, _)) => format!("{:?}...", &id[..end]),
        None => format!("{id:?}"),
    }
}

/// Checks that `id` can name a handler before any store is asked: an id not
/// of the form `hdl_` + 32 hex digits (control characters, NUL, any length)
/// names no handler, so it is `404 not_found` without a query (PostgreSQL
/// refuses NUL in text; the answer must not depend on the store).
///
/// # Errors
/// `404 not_found` naming the id (cut to 64 characters) and the form.
pub(crate) fn check_handler_id(id: &str) -> Result<(), ApiError> {
    if is_handler_id(id) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::NotFound,
            format!(
                "handler {} not found: handler ids are \"hdl_\" and 32 hex digits",
                shown(id)
            ),
        ))
    }
}

/// Body of `POST /v1/handlers`. Unknown fields are refused.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateHandler {
    /// 1 to 128 characters, no control characters.
    #[schema(min_length = 1, max_length = 128, example = "billing")]
    pub name: String,
    /// Absolute `http` or `https` URL with a host (a webhook), or
    /// `nats://HOST[:PORT]/SUBJECT` (a NATS JetStream subject; `{type}` and
    /// `{key}` in it stand for the event's), or `kafka://HOST[:PORT]/TOPIC`
    /// (a Kafka topic; the record key is the event's key), up to 2,048 bytes, without
    /// whitespace or control characters (percent-encode them) and without
    /// credentials (`user:password@`: URLs are logged and answered).
    #[schema(example = "https://example.com/hooks")]
    pub url: String,
    /// Routes: 1 to 100 event types or prefixes with a trailing `*`.
    #[schema(min_items = 1, max_items = 100, example = json!(["invoice.*", "push"]))]
    pub event_types: Vec<String>,
    /// Attempts before dead letter, 1 to 100 (default 8).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub max_attempts: Option<u32>,
    /// Per-attempt timeout in milliseconds, 100 to 300,000 (default 10,000).
    #[serde(default)]
    #[schema(minimum = 100, maximum = 300_000)]
    pub timeout_ms: Option<u64>,
    /// Concurrent attempts per node, 1 to 10,000 (default 64).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 10_000)]
    pub max_in_flight: Option<u32>,
    /// `whsec_` + standard base64 of 24 to 64 bytes; generated when absent.
    #[serde(default)]
    #[schema(pattern = "^whsec_[A-Za-z0-9+/]+={0,2}$")]
    pub secret: Option<String>,
    /// Requests per second each node sends to the handler, and burst;
    /// absent or `null` for no limit (change it later with `PATCH`).
    #[serde(default)]
    pub rate_limit: Option<RateLimitView>,
    /// Payload filter: the handler gets only the events whose payload
    /// matches (absent or `null`: every event its routes match).
    #[serde(default)]
    pub filter: Option<FilterView>,
}

/// A payload filter, decided when an event is published: a condition
/// `{"path": P, OP: V}` on the payload value at JSON pointer `P` (RFC
/// 6901), with exactly one operator `OP`: `equals` (a string, number,
/// boolean or `null`), `in` (a list of 1 to 100 of those), `exists`
/// (`true`/`false`), `gt`, `gte`, `lt`, `lte` (a number); or a
/// combination `{"and": [...]}`, `{"or": [...]}`, `{"not": {...}}`.
/// Equality is type-strict (`"1"` is not `1`), numbers compare by value
/// (`1` equals `1.0`), comparisons hold only for numbers, a missing value
/// is not `null`. At most 8 levels, 32 conditions, 8,192 bytes; paths up to
/// 256 bytes.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(transparent)]
#[schema(
    as = Filter,
    value_type = Object,
    example = json!({"and": [{"path": "/order/total", "gte": 100},
                             {"path": "/country", "in": ["DE", "FR"]}]})
)]
pub struct FilterView(pub serde_json::Value);

/// Lifecycle of a handler, as answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum HandlerStateView {
    /// Deliveries are attempted.
    Enabled,
    /// Deliveries are kept but not attempted (a `410 Gone` answer disables).
    Disabled,
}

impl From<HandlerState> for HandlerStateView {
    fn from(state: HandlerState) -> Self {
        match state {
            HandlerState::Enabled => HandlerStateView::Enabled,
            HandlerState::Disabled => HandlerStateView::Disabled,
        }
    }
}

/// A registered handler, as `POST /v1/handlers` and `GET /v1/handlers/{id}`
/// answer it (the store's [`Handler`], secret included).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HandlerView {
    /// Stable id, `hdl_` + 32 lowercase hex digits (a UUIDv7).
    #[schema(
        example = "hdl_0193a5b2c4d87e6f8a9b0c1d2e3f4a5b",
        pattern = "^hdl_[0-9a-f]{32}$"
    )]
    pub id: String,
    /// Human-readable name.
    pub name: String,
    /// Webhook URL.
    pub url: String,
    /// Routes: event types or prefixes with a trailing `*`.
    pub event_types: Vec<String>,
    /// Attempts before dead letter.
    pub max_attempts: u32,
    /// Per-attempt timeout, in milliseconds.
    pub timeout_ms: u64,
    /// Concurrent attempts per node.
    pub max_in_flight: u32,
    /// Signing secret (`whsec_` + base64).
    pub secret: String,
    /// Enabled or disabled.
    pub state: HandlerStateView,
    /// Registration time (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub created_at: DateTime<Utc>,
    /// Requests per second and burst, or `null` when unlimited.
    pub rate_limit: Option<RateLimitView>,
    /// While the secret replaced by the last rotation still signs (next to
    /// `secret`): the end of its grace period (RFC 3339); `null` otherwise.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub previous_secret_until: Option<DateTime<Utc>>,
    /// When `state` last changed (RFC 3339), `null` if never.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub state_changed_at: Option<DateTime<Utc>>,
    /// Why: `gone` (a `410` answer), `failing` (failed without a success
    /// for the node's auto-disable period), `api` (by hand); `null` if never.
    pub state_reason: Option<String>,
    /// Start of the current run of failed attempts without a success (RFC
    /// 3339), `null` when the last outcome was a success.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub failing_since: Option<DateTime<Utc>>,
    /// Payload filter, `null` when the handler has none.
    pub filter: Option<FilterView>,
}

/// A per-handler rate limit: a token bucket per handler on each node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateLimitView {
    /// Requests per second each node sends to the handler, 1 to 100,000.
    #[schema(minimum = 1, maximum = 100_000)]
    pub per_second: u32,
    /// Requests a node may send at once after a quiet period, 1 to 100,000
    /// (default: `per_second`).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100_000)]
    pub burst: Option<u32>,
}

impl From<RateLimit> for RateLimitView {
    fn from(r: RateLimit) -> Self {
        RateLimitView {
            per_second: r.per_second,
            burst: Some(r.burst),
        }
    }
}

impl From<Handler> for HandlerView {
    fn from(h: Handler) -> Self {
        // Destructured so a new store field is a compile error here.
        let Handler {
            id,
            name,
            url,
            event_types,
            max_attempts,
            timeout_ms,
            max_in_flight,
            secret,
            state,
            created_at,
            rate_limit,
            previous_secret: _,
            previous_secret_until,
            state_changed_at,
            state_reason,
            failing_since,
            filter,
        } = h;
        HandlerView {
            id,
            name,
            url,
            event_types,
            max_attempts,
            timeout_ms,
            max_in_flight,
            secret,
            state: state.into(),
            created_at,
            rate_limit: rate_limit.map(Into::into),
            previous_secret_until: previous_secret_until.filter(|until| *until > Utc::now()),
            state_changed_at,
            state_reason,
            failing_since,
            filter: filter.as_ref().map(|f| FilterView(f.to_json())),
        }
    }
}

fn invalid(message: String) -> ApiError {
    ApiError::new(ErrorCode::InvalidHandler, message)
}

/// A broken rule ([`lanebus_store::rules`]) of a handler as `422
/// invalid_handler`, with the rule's message.
fn broken(b: Broken) -> ApiError {
    invalid(b.message)
}

/// Checks a webhook URL ([`rules::handler::url`]).
///
/// # Errors
/// `422 invalid_handler` naming the URL (with any credentials masked).
pub fn validate_url(raw: &str) -> Result<(), ApiError> {
    rules::handler::url(raw).map_err(broken)
}

/// Checks a signing secret ([`rules::secret::check`]).
///
/// # Errors
/// `422 invalid_handler`; the message does not repeat the secret.
pub fn validate_secret(secret: &str) -> Result<(), ApiError> {
    rules::secret::check(secret).map_err(broken)
}

/// Checks a registration request and fills in defaults (policy, secret).
///
/// # Errors
/// `422 invalid_handler` naming the field and the value that was wrong.
pub fn validate_handler(req: CreateHandler) -> Result<NewHandler, ApiError> {
    // A secret given is checked even when empty: the store reads an empty
    // one as "generate one".
    if let Some(secret) = &req.secret {
        validate_secret(secret)?;
    }
    let new = NewHandler {
        name: req.name,
        url: req.url,
        event_types: req.event_types,
        max_attempts: req.max_attempts.unwrap_or(handler_defaults::MAX_ATTEMPTS),
        timeout_ms: req.timeout_ms.unwrap_or(handler_defaults::TIMEOUT_MS),
        max_in_flight: req.max_in_flight.unwrap_or(handler_defaults::MAX_IN_FLIGHT),
        secret: req.secret.unwrap_or_else(generate_secret),
        rate_limit: req.rate_limit.map(rate_limit),
        filter: req
            .filter
            .map(|f| Filter::parse(&f.0))
            .transpose()
            .map_err(broken)?,
    };
    rules::handler::check(&new).map_err(broken)?;
    Ok(new)
}

/// `Some(value)` for a field that is present (`null` included), so that
/// `Option<Option<T>>` tells absent (`None`) from `null` (`Some(None)`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// Body of `PATCH /v1/handlers/{id}`: a JSON merge patch of the settings.
/// Absent fields stay as they are; only `rate_limit` may be `null`
/// (removes the limit). Unknown fields (`secret`, `state`: see their own
/// endpoints) are refused.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateHandler {
    /// 1 to 128 characters, no control characters.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    pub name: Option<Option<String>>,
    /// As at registration.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    pub url: Option<Option<String>>,
    /// Routes, as at registration; they apply to events published after
    /// the change.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Vec<String>>)]
    pub event_types: Option<Option<Vec<String>>>,
    /// 1 to 100.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 100)]
    pub max_attempts: Option<Option<u32>>,
    /// 100 to 300,000 ms.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u64>, minimum = 100, maximum = 300_000)]
    pub timeout_ms: Option<Option<u64>>,
    /// 1 to 10,000.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<u32>, minimum = 1, maximum = 10_000)]
    pub max_in_flight: Option<Option<u32>>,
    /// A rate limit, or `null` to remove it.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<RateLimitView>)]
    pub rate_limit: Option<Option<RateLimitView>>,
    /// A payload filter (replaces the one set), or `null` to remove it;
    /// applies to events published after the change.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<FilterView>)]
    pub filter: Option<Option<FilterView>>,
}

/// A rate limit with its burst filled in (default: `per_second`).
fn rate_limit(r: RateLimitView) -> RateLimit {
    RateLimit {
        per_second: r.per_second,
        burst: r.burst.unwrap_or(r.per_second),
    }
}

/// Checks a rate limit ([`rules::handler::rate_limit`]) and fills in the
/// burst (default: `per_second`).
///
/// # Errors
/// `422 invalid_handler` naming the field.
pub fn validate_rate_limit(r: RateLimitView) -> Result<RateLimit, ApiError> {
    let r = rate_limit(r);
    rules::handler::rate_limit(&r).map_err(broken)?;
    Ok(r)
}

/// Checks a `PATCH` body field by field, with the rules of
/// [`validate_handler`], and turns it into a store patch.
///
/// # Errors
/// `422 invalid_handler` naming the field and the value that was wrong
/// (`null` for a field other than `rate_limit` included).
pub fn validate_patch(req: UpdateHandler) -> Result<HandlerPatch, ApiError> {
    fn required<T>(field: &str, v: Option<Option<T>>) -> Result<Option<T>, ApiError> {
        match v {
            None => Ok(None),
            Some(None) => Err(invalid(format!(
                "{field} must not be null (leave it out to keep it)"
            ))),
            Some(Some(v)) => Ok(Some(v)),
        }
    }
    let patch = HandlerPatch {
        name: required("name", req.name)?,
        url: required("url", req.url)?,
        event_types: required("event_types", req.event_types)?,
        max_attempts: required("max_attempts", req.max_attempts)?,
        timeout_ms: required("timeout_ms", req.timeout_ms)?,
        max_in_flight: required("max_in_flight", req.max_in_flight)?,
        rate_limit: req.rate_limit.map(|r| r.map(rate_limit)),
        filter: req
            .filter
            .map(|f| f.map(|f| Filter::parse(&f.0)).transpose())
            .transpose()
            .map_err(broken)?,
    };
    rules::handler::check_patch(&patch).map_err(broken)?;
    Ok(patch)
}

/// Body of `POST /v1/handlers/{id}/secret/rotate` (`{}` for the defaults).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RotateSecret {
    /// The new secret, `whsec_` + standard base64 of 24 to 64 bytes;
    /// generated when absent.
    #[serde(default)]
    #[schema(pattern = "^whsec_[A-Za-z0-9+/]+={0,2}$")]
    pub secret: Option<String>,
    /// How long the old secret keeps signing next to the new one, in
    /// seconds, 0 to 2,592,000 (30 days); default 86,400 (24 h). 0 drops it
    /// at once.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 2_592_000)]
    pub grace_period_s: Option<u64>,
}

/// Body of `GET /v1/handlers`.
#[derive(Debug, Serialize, ToSchema)]
pub struct HandlerList {
    /// Every handler, by creation order.
    pub handlers: Vec<HandlerView>,
}

/// Body of `DELETE /v1/handlers/{id}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct Deleted {
    /// Id of the removed handler.
    pub deleted: String,
    /// Pending deliveries of the handler that were discarded.
    pub discarded_deliveries: u64,
    /// Dead letters of the handler that were discarded (with the handler,
    /// in the same store transaction: nothing could replay them any more).
    pub discarded_dead_letters: u64,
}

/// Refuses a `timeout_ms` longer than the cluster's lane lease leaves room
/// for (see [`crate::NodeView::longest_timeout`]); a node would also refuse
/// to start with such a handler stored. This rule depends on the node's
/// lease settings, so it is the API's, not the store's
/// ([`rules::handler::TIMEOUT_MS`] is checked first).
///
/// # Errors
/// `422 invalid_handler` naming both numbers (and saying so when the lease
/// leaves room for less than the least allowed `timeout_ms`).
fn check_timeout_fits_lease(
    timeout_ms: u64,
    bound: Option<std::time::Duration>,
) -> Result<(), ApiError> {
    match bound {
        Some(bound) if u128::from(timeout_ms) > bound.as_millis() => {
            let least = *TIMEOUT_MS.start();
            let none_fits = if bound.as_millis() < u128::from(least) {
                format!(
                    "; that is less than the least timeout_ms ({least} ms), so no handler fits \
                     until the cluster's lease_ms is raised"
                )
            } else {
                String::new()
            };
            Err(invalid(format!(
                "timeout_ms {timeout_ms} must be at most {} ms, what the cluster's lane lease leaves \
                 room for (the lease less one renewal interval less 100 ms): an attempt starts only \
                 while the remaining lease covers its timeout plus 100 ms, so that it ends before the \
                 lease does and cannot overlap the next owner's delivery of the same key{none_fits}",
                bound.as_millis()
            )))
        }
        _ => Ok(()),
    }
}

/// Handler of `POST /v1/handlers`.
pub(crate) async fn create(
    State(state): State<ApiState>,
    Json(mut req): Json<CreateHandler>,
) -> Result<(StatusCode, axum::Json<HandlerView>), ApiError> {
    let bound = state.node.longest_timeout();
    if let (None, Some(bound)) = (req.timeout_ms, bound) {
        // The default, or the lease's bound when lower (but never below the
        // rulebook's least: then the lease check below says why).
        let bound = u64::try_from(bound.as_millis()).unwrap_or(u64::MAX);
        req.timeout_ms = Some(
            handler_defaults::TIMEOUT_MS
                .min(bound)
                .max(*TIMEOUT_MS.start()),
        );
    }
    let new = validate_handler(req)?;
    check_timeout_fits_lease(new.timeout_ms, bound)?;
    // The SSRF guard (`lanebus_store::egress`): refused targets are `422 invalid_handler`.
    state
        .egress
        .check_url(&new.url)
        .await
        .map_err(|e| invalid(e.0))?;
    let handler = state.store.create_handler(new).await.map_err(|e| match e {
        lanebus_store::StoreError::Invalid(m) => invalid(m),
        other => other.into(),
    })?;
    tracing::info!(handler_id = %handler.id, name = %handler.name, url = %handler.url, "handler created");
    state.node.handlers_changed();
    Ok((StatusCode::CREATED, axum::Json(handler.into())))
}

/// Handler of `GET /v1/handlers`; a store that does not answer within
/// 2 s is `503 store_unavailable` ([`crate::health::bounded`]).
pub(crate) async fn list(
    State(state): State<ApiState>,
) -> Result<axum::Json<HandlerList>, ApiError> {
    let store = &state.store;
    Ok(axum::Json(HandlerList {
        handlers: crate::health::bounded(store.backend(), store.list_handlers())
            .await??
            .into_iter()
            .map(HandlerView::from)
            .collect(),
    }))
}

/// Handler of `GET /v1/handlers/{id}`; a store that does not answer
/// within 2 s is `503 store_unavailable` ([`crate::health::bounded`]).
pub(crate) async fn get(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<HandlerView>, ApiError> {
    Ok(axum::Json(existing(&state, &id).await?.into()))
}

/// The handler `id`, read within 2 s ([`crate::health::bounded`]): `404
/// not_found` for an id that is no handler id or no handler's, `503` when
/// the store does not answer in time.
pub(crate) async fn existing(state: &ApiState, id: &str) -> Result<Handler, ApiError> {
    check_handler_id(id)?;
    let store = &state.store;
    crate::health::bounded(store.backend(), store.get_handler(id))
        .await?
        .map_err(|e| not_found(e, id))
}

/// Handler of `DELETE /v1/handlers/{id}`.
pub(crate) async fn delete(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<Deleted>, ApiError> {
    check_handler_id(&id)?;
    let discarded = state
        .store
        .delete_handler(&id)
        .await
        .map_err(|e| not_found(e, &id))?;
    crate::telemetry::handler_deleted(&id, discarded);
    state.node.handlers_changed();
    Ok(axum::Json(Deleted {
        deleted: id,
        discarded_deliveries: discarded.deliveries,
        discarded_dead_letters: discarded.dead_letters,
    }))
}

/// Handler of `POST /v1/handlers/{id}/enable`: sets the handler `enabled`
/// (a no-op if it is) and tells the node, whose lanes resume its kept
/// deliveries, in order per key; other nodes follow at their next catalog
/// reload. Answers the handler.
pub(crate) async fn enable(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<HandlerView>, ApiError> {
    set_state(&state, &id, HandlerState::Enabled).await
}

/// Handler of `POST /v1/handlers/{id}/disable`: the handler's deliveries
/// are kept, not attempted, until it is enabled (reason `api`).
pub(crate) async fn disable(
    State(state): State<ApiState>,
    Path(id): Path<String>,
) -> Result<axum::Json<HandlerView>, ApiError> {
    set_state(&state, &id, HandlerState::Disabled).await
}

/// Enable or disable by hand (reason `api`): [`change_state`] (counted
/// and logged there), then the
/// node reloads its catalog.
async fn set_state(
    state: &ApiState,
    id: &str,
    to: HandlerState,
) -> Result<axum::Json<HandlerView>, ApiError> {
    check_handler_id(id)?;
    let change = change_state(state.store.as_ref(), id, to, "api")
        .await
        .map_err(|e| not_found(e, id))?;
    state.node.handlers_changed();
    Ok(axum::Json(change.handler.into()))
}

pub use lanebus_store::StateChange;

/// Handler of `PATCH /v1/handlers/{id}`: changes the settings given (see
/// [`UpdateHandler`]) and tells the node, whose lanes use them from the
/// next attempt; other nodes follow at their next catalog reload.
pub(crate) async fn update(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Json(req): Json<UpdateHandler>,
) -> Result<axum::Json<HandlerView>, ApiError> {
    check_handler_id(&id)?;
    let patch = validate_patch(req)?;
    if let Some(t) = patch.timeout_ms {
        check_timeout_fits_lease(t, state.node.longest_timeout())?;
    }
    // The SSRF guard (`lanebus_store::egress`) on a new URL, as at registration.
    if let Some(url) = &patch.url {
        state
            .egress
            .check_url(url)
            .await
            .map_err(|e| invalid(e.0))?;
    }
    let handler = state
        .store
        .update_handler(&id, &patch)
        .await
        .map_err(|e| refused(e, &id))?;
    tracing::info!(handler_id = %id, url = %handler.url, routes = ?handler.event_types, rate_limit = ?handler.rate_limit, "handler updated");
    state.node.handlers_changed();
    Ok(axum::Json(handler.into()))
}

/// Handler of `POST /v1/handlers/{id}/secret/rotate`: the new secret (given
/// or generated) signs from now on; the old one too until the grace period
/// ends. Answers the handler with its new secret.
pub(crate) async fn rotate_secret(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    OptionalJson(req): OptionalJson<RotateSecret>,
) -> Result<axum::Json<HandlerView>, ApiError> {
    check_handler_id(&id)?;
    let secret = match req.secret {
        Some(s) => {
            validate_secret(&s)?;
            // The previous secret (perhaps still in its grace period) would
            // be replaced by the current one: receivers on it would fail.
            let current = state
                .store
                .get_handler(&id)
                .await
                .map_err(|e| refused(e, &id))?;
            if current.secret == s {
                return Err(invalid(
                    "secret is the handler's current secret; a rotation needs a new one".into(),
                ));
            }
            s
        }
        None => generate_secret(),
    };
    let grace = req.grace_period_s.unwrap_or(DEFAULT_GRACE_PERIOD_S);
    if !GRACE_PERIOD_S.contains(&grace) {
        return Err(invalid(format!(
            "grace_period_s {grace} must be {} to {}",
            GRACE_PERIOD_S.start(),
            GRACE_PERIOD_S.end()
        )));
    }
    let until = Utc::now() + chrono::Duration::seconds(i64::try_from(grace).unwrap_or(i64::MAX));
    let handler = state
        .store
        .rotate_handler_secret(&id, &secret, until)
        .await
        .map_err(|e| refused(e, &id))?;
    tracing::info!(handler_id = %id, previous_secret_until = %until, "handler secret rotated");
    state.node.handlers_changed();
    Ok(axum::Json(handler.into()))
}

/// A store error of a change to handler `id`: `Invalid` as `422
/// invalid_handler`, `NotFound` naming the id, others as usual.
fn refused(e: lanebus_store::StoreError, id: &str) -> ApiError {
    match e {
        lanebus_store::StoreError::Invalid(m) => invalid(m),
        other => not_found(other, id),
    }
}

/// A store `NotFound` for handler `id` as a message naming the id.
pub(crate) fn not_found(e: lanebus_store::StoreError, id: &str) -> ApiError {
    match e {
        lanebus_store::StoreError::NotFound(_) => {
            ApiError::new(ErrorCode::NotFound, format!("handler {id:?} not found"))
        }
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::*;

    fn req(json: serde_json::Value) -> CreateHandler {
        serde_json::from_value(json).expect("test request parses")
    }

    #[test]
    fn defaults_and_generated_secret() {
        let h = validate_handler(req(serde_json::json!({
            "name": "n", "url": "https://example.com/hook", "event_types": ["issues.*"]
        })))
        .expect("valid");
        assert_eq!(h.max_attempts, handler_defaults::MAX_ATTEMPTS);
        assert_eq!(h.timeout_ms, handler_defaults::TIMEOUT_MS);
        assert!(validate_secret(&h.secret).is_ok(), "{}", h.secret);
    }

    #[test]
    fn bad_urls_are_refused() {
        for url in [
            "not a url",
            "ftp://example.com/x",
            "file:///etc/passwd",
            "mailto:a@b.c",
            "http://",
            "/relative",
        ] {
            assert!(validate_url(url).is_err(), "{url} was accepted");
        }
        assert!(validate_url("http://127.0.0.1:9000/x").is_ok());
    }

    #[test]
    fn urls_with_credentials_whitespace_or_controls_are_refused() {
        for url in [
            "https://user:pass@example.com/hook",
            "https://user@example.com/hook",
            "https://:pass@example.com/hook",
            "http://u:p@127.0.0.1:9000/x?y=1",
        ] {
            let e = validate_url(url).unwrap_err();
            assert_eq!(e.code, ErrorCode::InvalidHandler);
            assert!(e.message.contains("credentials"), "{}", e.message);
            assert!(e.message.contains("***@"), "{}", e.message);
            for secret in ["user:pass", ":pass@", "user@", "u:p@"] {
                assert!(!e.message.contains(secret), "{}", e.message);
            }
        }
        for url in [
            "http://h/a b",
            "http://h/a\tb",
            "http://h/a\u{0}b",
            " http://h/",
            "http://h/\u{85}",
        ] {
            let e = validate_url(url).unwrap_err();
            assert!(e.message.contains("whitespace"), "{url:?}: {}", e.message);
        }
        assert!(validate_url("http://h/a%20b?q=a@b").is_ok());
    }

    #[test]
    fn handler_ids_have_one_form() {
        let id = lanebus_store::generate_handler_id();
        assert!(is_handler_id(&id), "{id}");
        for bad in [
            "",
            "hdl_",
            "hdl_nope",
            "a\0b",
            "hdl_0193A5B2C4D87E6F8A9B0C1D2E3F4A5B",
            "hdl_0193a5b2c4d87e6f8a9b0c1d2e3f4a5b0",
            "hdl_0193a5b2c4d87e6f8a9b0c1d2e3f4a5\0",
        ] {
            assert!(!is_handler_id(bad), "{bad:?}");
            assert_eq!(check_handler_id(bad).unwrap_err().code, ErrorCode::NotFound);
        }
        let long = "x".repeat(1000);
        let e = check_handler_id(&long).unwrap_err();
        assert!(e.message.len() < 200, "{}", e.message);
    }

    #[test]
    fn secrets_need_prefix_base64_and_length() {
        let b64 = |n: usize| base64::engine::general_purpose::STANDARD.encode(vec![7u8; n]);
        assert!(validate_secret(&format!("whsec_{}", b64(24))).is_ok());
        assert!(validate_secret(&format!("whsec_{}", b64(64))).is_ok());
        assert!(validate_secret(&format!("whsec_{}", b64(23))).is_err());
        assert!(validate_secret(&format!("whsec_{}", b64(65))).is_err());
        assert!(validate_secret(&b64(32)).is_err());
        assert!(validate_secret("whsec_!!!").is_err());
    }

    #[test]
    fn policy_ranges() {
        let base = serde_json::json!({"name": "n", "url": "http://h/", "event_types": ["*"]});
        for (field, bad) in [
            ("max_attempts", 0),
            ("max_attempts", 101),
            ("timeout_ms", 99),
            ("timeout_ms", 300_001),
            ("max_in_flight", 0),
            ("max_in_flight", 10_001),
        ] {
            let mut v = base.clone();
            v[field] = serde_json::json!(bad);
            let e = validate_handler(req(v)).unwrap_err();
            assert!(
                e.message.contains(field) && e.message.contains(&bad.to_string()),
                "{}",
                e.message
            );
        }
    }
}
