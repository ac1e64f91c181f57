//! `/v1/event-types`: the event-type catalog (`lanebus_store::event_types`),
//! and `/v1/catalog/settings`, its store-wide setting.
//!
//! ```text
//! POST  /v1/event-types                  {"name", "description"?, "schema"?, "aliases"?} → 201 EventType
//! GET   /v1/event-types                  → {"event_types": [EventType]}
//! GET   /v1/event-types/{name}           wire name or alias → EventType
//! PATCH /v1/event-types/{name}           {"name"?, "description"?, "schema"?, "aliases"?, "deprecated"?}
//! POST  /v1/event-types/{name}/deprecate → EventType (deprecated)
//! GET   /v1/catalog/settings             → {"strict"}
//! PUT   /v1/catalog/settings             {"strict"} → {"strict"}
//! ```
//!
//! Reads answer `503 store_unavailable` when the store does not answer
//! within 2 s, as handler reads do.
//!
//! As in Svix, deprecating keeps a type's events accepted; `PATCH` with
//! `"deprecated": false` undoes it. A `PATCH` with a new `name` renames the
//! type: the old wire name becomes an alias, so publishers still sending it
//! and routes naming it keep working.

use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use lanebus_store::rules::{self, Broken};
use lanebus_store::{CatalogSettings, EventType, EventTypePatch, NewEventType, StoreError};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorCode};
use crate::extract::{Json, Path};
use crate::ApiState;

/// A cataloged event type.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventTypeView {
    /// The wire name: the `type` its events are stored and sent under.
    pub name: String,
    /// For people (may be empty).
    pub description: String,
    /// JSON Schema (draft 2020-12) of the payload, or `null`: any payload.
    #[schema(value_type = Option<Object>)]
    pub schema: Option<serde_json::Value>,
    /// Other names publishers may send (old names), stored as `name`.
    pub aliases: Vec<String>,
    /// Deprecated: still accepted.
    pub deprecated: bool,
    /// Creation time (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub created_at: DateTime<Utc>,
    /// Last change (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: DateTime<Utc>,
}

impl From<EventType> for EventTypeView {
    fn from(t: EventType) -> Self {
        EventTypeView {
            name: t.name,
            description: t.description,
            schema: t.schema,
            aliases: t.aliases,
            deprecated: t.deprecated,
            created_at: t.created_at,
            updated_at: t.updated_at,
        }
    }
}

/// Answer of `GET /v1/event-types`.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventTypeList {
    /// Every cataloged type, by wire name.
    pub event_types: Vec<EventTypeView>,
}

/// Body of `POST /v1/event-types`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateEventType {
    /// The wire name: an event type (1 to 128 characters of
    /// `[A-Za-z0-9._:/-]`, not starting with `lanebus.`).
    pub name: String,
    /// Up to 1,024 characters.
    #[serde(default)]
    pub description: String,
    /// A JSON Schema (draft 2020-12, at most 64 KiB, no external `$ref`)
    /// every payload of the type must satisfy.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<serde_json::Value>,
    /// Up to 20 other names (event types) publishers may send.
    #[serde(default)]
    pub aliases: Vec<String>,
}

/// Absent → `None`; present (`null` included) → `Some`.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// Body of `PATCH /v1/event-types/{name}`: absent fields stay as they are.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateEventType {
    /// A new wire name (a rename): the old one becomes an alias.
    pub name: Option<String>,
    /// A new description.
    pub description: Option<String>,
    /// A new schema, or `null` to remove it.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<Object>)]
    pub schema: Option<Option<serde_json::Value>>,
    /// The aliases, replaced whole.
    pub aliases: Option<Vec<String>>,
    /// Deprecate (`true`) or undeprecate (`false`).
    pub deprecated: Option<bool>,
}

/// Body and answer of `/v1/catalog/settings`.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CatalogSettingsView {
    /// Refuse publishes of types not in the catalog (`422 invalid_input`);
    /// lanebus's own `lanebus.` types are exempt. Off by default.
    pub strict: bool,
}

/// A broken catalog rule as `422 invalid_input`.
fn broken(b: Broken) -> ApiError {
    ApiError::new(ErrorCode::InvalidInput, b.message)
}

/// A store error of a catalog call; `NotFound` names the type.
fn refused(e: StoreError) -> ApiError {
    match e {
        StoreError::NotFound(m) => ApiError::new(ErrorCode::NotFound, format!("{m} not found")),
        other => other.into(),
    }
}

/// Handler of `POST /v1/event-types`.
pub(crate) async fn create(
    State(state): State<ApiState>,
    Json(req): Json<CreateEventType>,
) -> Result<(StatusCode, axum::Json<EventTypeView>), ApiError> {
    let new = NewEventType {
        name: req.name,
        description: req.description,
        schema: req.schema,
        aliases: req.aliases,
    };
    rules::event_type::check(&new).map_err(broken)?;
    let t = state.store.create_event_type(new).await.map_err(refused)?;
    tracing::info!(event_type = %t.name, aliases = ?t.aliases, "event type created");
    Ok((StatusCode::CREATED, axum::Json(t.into())))
}

/// Handler of `GET /v1/event-types`.
pub(crate) async fn list(
    State(state): State<ApiState>,
) -> Result<axum::Json<EventTypeList>, ApiError> {
    let store = &state.store;
    let types = crate::health::bounded(store.backend(), store.list_event_types()).await??;
    Ok(axum::Json(EventTypeList {
        event_types: types.into_iter().map(Into::into).collect(),
    }))
}

/// Handler of `GET /v1/event-types/{name}` (wire name or alias).
pub(crate) async fn get(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<axum::Json<EventTypeView>, ApiError> {
    let store = &state.store;
    let t = crate::health::bounded(store.backend(), store.get_event_type(&name))
        .await?
        .map_err(refused)?;
    Ok(axum::Json(t.into()))
}

/// Handler of `PATCH /v1/event-types/{name}`.
pub(crate) async fn update(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    Json(req): Json<UpdateEventType>,
) -> Result<axum::Json<EventTypeView>, ApiError> {
    let patch = EventTypePatch {
        name: req.name,
        description: req.description,
        schema: req.schema,
        aliases: req.aliases,
        deprecated: req.deprecated,
    };
    rules::event_type::check_patch(&patch).map_err(broken)?;
    let t = state
        .store
        .update_event_type(&name, &patch)
        .await
        .map_err(refused)?;
    tracing::info!(event_type = %t.name, aliases = ?t.aliases, deprecated = t.deprecated, "event type updated");
    Ok(axum::Json(t.into()))
}

/// Handler of `POST /v1/event-types/{name}/deprecate`.
pub(crate) async fn deprecate(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<axum::Json<EventTypeView>, ApiError> {
    let t = state
        .store
        .deprecate_event_type(&name)
        .await
        .map_err(refused)?;
    tracing::info!(event_type = %t.name, "event type deprecated");
    Ok(axum::Json(t.into()))
}

/// Handler of `GET /v1/catalog/settings`.
pub(crate) async fn settings(
    State(state): State<ApiState>,
) -> Result<axum::Json<CatalogSettingsView>, ApiError> {
    let store = &state.store;
    let s = crate::health::bounded(store.backend(), store.catalog_settings()).await??;
    Ok(axum::Json(CatalogSettingsView { strict: s.strict }))
}

/// Handler of `PUT /v1/catalog/settings`.
pub(crate) async fn set_settings(
    State(state): State<ApiState>,
    Json(req): Json<CatalogSettingsView>,
) -> Result<axum::Json<CatalogSettingsView>, ApiError> {
    let s = state
        .store
        .set_catalog_settings(CatalogSettings { strict: req.strict })
        .await?;
    tracing::info!(strict = s.strict, "catalog settings changed");
    Ok(axum::Json(CatalogSettingsView { strict: s.strict }))
}
