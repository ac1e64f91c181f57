//! The OpenAPI 3.1 document of the API, built from the route table and
//! served at `GET /openapi.json`.
//!
//! ```text
//!  ROUTES ──(method, path, Operation)──▶ document()
//!    │          Operation::errors() ──▶ error answers, grouped by status
//!    │          describe(op) ─────────▶ summary, parameters, request body,
//!    │                                  success answer (ToSchema types)
//!    ▼
//!  router() serves the same entries
//! ```
//!
//! The document is generated, not written: every entry of [`ROUTES`] becomes
//! one operation (its `operationId` is [`Operation::id`]), the request and
//! answer schemas come from the `utoipa::ToSchema` derives on the very types
//! the handlers (de)serialize, and the error answers come from
//! [`Operation::errors`], all with the shape `{"error": {"code", "message"}}`
//! (component `Error`). `describe` matches every [`Operation`]
//! exhaustively, so a new route does not compile until it is described.
//!
//! Invariants the tests check: the document's (path, method) pairs are
//! exactly [`ROUTES`]'s; every `$ref` resolves; every operation lists each of
//! its error codes under that code's status; and every status an API test
//! observes on a route is one its operation documents.
//!
//! Built with `utoipa` 5 (minimal features: only its derive macros); no
//! Swagger UI is bundled: point any OpenAPI viewer at `/openapi.json`.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::info::{InfoBuilder, LicenseBuilder};
use utoipa::openapi::path::{
    HttpMethod, OperationBuilder, Parameter, ParameterBuilder, ParameterIn, PathItem,
};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ComponentsBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::tag::TagBuilder;
use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder, Ref, RefOr, Required};
use utoipa::{IntoParams, PartialSchema, ToSchema};

use crate::admin::{
    BulkReplay, ClusterChanged, DeadLetterPage, DeadLetterQuery, HandlerSummaries, LaneList,
    Replayed,
};
use crate::deliveries::{DeliveriesPage, DeliveriesQuery};
use crate::error::ApiError;
use crate::error::{ErrorBody, ErrorCode};
use crate::event_types::{
    CatalogSettingsView, CreateEventType, EventTypeList, EventTypeView, UpdateEventType,
};
use crate::events::{PublishAnswer, PublishRequest};
use crate::handlers::{
    CreateHandler, Deleted, HandlerList, HandlerView, RotateSecret, UpdateHandler,
    HANDLER_ID_PATTERN,
};
use crate::health::Status;
use crate::lookup::EventView;
use crate::recovery::{RecoverRequest, Recovered};
use crate::routes::{Operation, ROUTES};
use crate::ApiState;
use crate::{ClusterView, HandlerActivity, JoinRequest, RemoveRequest};
use axum::extract::State;
use lanebus_store::EventType;

/// Media type of JSON bodies.
const JSON: &str = "application/json";

/// Name of the bearer-token security scheme (`crate::auth`); each operation
/// that needs a token names it with the scope needed (`publish` or `admin`).
const BEARER_SCHEME: &str = "bearerAuth";

/// The OpenAPI 3.1 document of every route in [`ROUTES`] (built once).
pub fn document() -> &'static OpenApi {
    static DOC: OnceLock<OpenApi> = OnceLock::new();
    DOC.get_or_init(build)
}

/// [`document`] as JSON bytes (serialized once).
pub fn document_json() -> &'static [u8] {
    static JSON_BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    JSON_BYTES.get_or_init(|| {
        serde_json::to_vec(document()).unwrap_or_else(|e| {
            // Serializing our own structs cannot fail; if it ever did, say so
            // in a document that still parses.
            serde_json::json!({"openapi": "3.1.0", "x-error": e.to_string()})
                .to_string()
                .into_bytes()
        })
    })
}

/// Handler of `GET /openapi.json`: [`document`] with a `webhooks` section
/// generated from the event-type catalog at request time ([`webhooks`]).
/// `503 store_unavailable` when the catalog cannot be read.
pub(crate) async fn serve(State(state): State<ApiState>) -> Result<Response, ApiError> {
    let store = &state.store;
    let types = crate::health::bounded(store.backend(), store.list_event_types()).await??;
    let mut doc: serde_json::Value = serde_json::from_slice(document_json())
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("openapi document: {e}")))?;
    doc["webhooks"] = webhooks(&types);
    let mut res = axum::Json(doc).into_response();
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(JSON));
    Ok(res)
}

/// The `webhooks` section (OpenAPI 3.1) of a catalog: per type, keyed by
/// its wire name, the `POST` lanebus sends to a handler routed to it, with
/// the Standard Webhooks headers and the body
/// `{"type": <wire name>, "timestamp": <publish time>, "data": <payload>}`,
/// `data` being the type's schema (any JSON without one). Receivers can
/// generate their handlers from it.
///
/// A schema's local references (`"$ref": "#/$defs/money"`, `"#"`) named
/// its own root; embedded, `#` is the OpenAPI document, so they are
/// rewritten to the schema's place in it ([`embed_schema`]).
pub fn webhooks(types: &[EventType]) -> serde_json::Value {
    let header = |name: &str, description: &str| {
        serde_json::json!({
            "name": name, "in": "header", "required": true,
            "description": description, "schema": {"type": "string"}
        })
    };
    let parameters = serde_json::json!([
        header("webhook-id", "the event id; the same on every attempt"),
        header("webhook-timestamp", "unix seconds of this attempt"),
        header(
            "webhook-signature",
            "v1,<base64 HMAC-SHA256 of \"{webhook-id}.{webhook-timestamp}.{body}\">, \
             space-separated when two secrets sign"
        ),
    ]);
    let entries = types.iter().map(|t| {
        let at = format!(
            "/webhooks/{}/post/requestBody/content/{}/schema/properties/data",
            pointer_token(&t.name),
            pointer_token(JSON)
        );
        let data = t
            .schema
            .clone()
            .map_or_else(|| serde_json::json!({}), |s| embed_schema(s, &at));
        let body = serde_json::json!({
            "type": "object",
            "required": ["type", "timestamp", "data"],
            "properties": {
                "type": {"const": t.name, "description": "the wire name"},
                "timestamp": {"type": "string", "format": "date-time",
                              "description": "the event's publish time"},
                "data": data,
            },
        });
        let mut description = t.description.clone();
        if !t.aliases.is_empty() {
            description = format!(
                "{description}\n\nPublishers may also send it as: {}.",
                t.aliases.join(", ")
            )
            .trim_start()
            .to_owned();
        }
        let operation = serde_json::json!({
            "operationId": format!("webhook:{}", t.name),
            "summary": format!("event {}", t.name),
            "description": description,
            "deprecated": t.deprecated,
            "parameters": parameters.clone(),
            "requestBody": {"required": true, "content": {JSON: {"schema": body}}},
            "responses": {
                "2XX": {"description": "delivered; any other answer is retried"},
            },
        });
        (t.name.clone(), serde_json::json!({ "post": operation }))
    });
    serde_json::Value::Object(entries.collect())
}

/// `schema` ready to stand at JSON pointer `at` of a larger document: each
/// `$ref` and `$dynamicRef` of its root resource that is a JSON pointer
/// fragment (`#`, `#/...`) or names an anchor of the root resource
/// (`#name`, by `$anchor` or `$dynamicAnchor`) becomes the pointer of its
/// target prefixed with `at` (percent-encoded as a URI fragment, RFC
/// 3986), and a root `$id` is dropped (it would make those references
/// resolve against it instead). Other references and nested `$id`s that
/// are relative to a dropped absolute `$id` are made absolute against it,
/// so they name what they named. Subschemas with their own `$id` are
/// resources of their own, whose references stay as they are, and so are
/// values that are data, not schemas (`const`, `enum`, `default`,
/// `examples`).
pub fn embed_schema(mut schema: serde_json::Value, at: &str) -> serde_json::Value {
    let base = schema
        .as_object_mut()
        .and_then(|root| root.remove("$id"))
        .and_then(|id| id.as_str().and_then(|id| url::Url::parse(id).ok()));
    let mut anchors = BTreeMap::new();
    collect_anchors(&schema, "", true, &mut anchors);
    let embed = Embed {
        prefix: format!("#{}", fragment(at)),
        base,
        anchors,
    };
    embed.rewrite(&mut schema, true);
    schema
}

/// What [`embed_schema`] rewrites references with.
struct Embed {
    /// `#` and the schema's new place, as a URI fragment.
    prefix: String,
    /// The dropped root `$id`, when it was an absolute URI.
    base: Option<url::Url>,
    /// Anchors of the root resource: name → JSON pointer in the schema.
    anchors: BTreeMap<String, String>,
}

impl Embed {
    /// A reference of the root resource as it must read embedded.
    fn reference(&self, r: &str) -> Option<String> {
        if let Some(rest) = r.strip_prefix('#') {
            if rest.is_empty() || rest.starts_with('/') {
                return Some(format!("{}{rest}", self.prefix));
            }
            return self
                .anchors
                .get(rest)
                .map(|p| format!("{}{}", self.prefix, fragment(p)));
        }
        let base = self.base.as_ref()?;
        let target = base.join(r).ok()?;
        let mut doc = target.clone();
        doc.set_fragment(None);
        let mut root = base.clone();
        root.set_fragment(None);
        if doc == root {
            // The root resource by its URI: a local reference.
            return self.reference(&format!("#{}", target.fragment().unwrap_or("")));
        }
        (target.as_str() != r).then(|| target.to_string())
    }

    fn rewrite(&self, v: &mut serde_json::Value, root: bool) {
        match v {
            serde_json::Value::Object(m) => {
                if !root {
                    if let Some(serde_json::Value::String(id)) = m.get_mut("$id") {
                        // A resource of its own: only its place moves.
                        if let Some(abs) = self.base.as_ref().and_then(|b| b.join(id).ok()) {
                            *id = abs.to_string();
                        }
                        return;
                    }
                }
                for (k, x) in m.iter_mut() {
                    match (k.as_str(), x) {
                        ("const" | "enum" | "default" | "examples", _) => {}
                        ("$ref" | "$dynamicRef", serde_json::Value::String(r)) => {
                            if let Some(new) = self.reference(r) {
                                *r = new;
                            }
                        }
                        // Maps of names to schemas: a property may be named
                        // `const` or `$ref`.
                        (
                            "properties" | "patternProperties" | "$defs" | "definitions"
                            | "dependentSchemas",
                            serde_json::Value::Object(named),
                        ) => {
                            for s in named.values_mut() {
                                self.rewrite(s, false);
                            }
                        }
                        (_, x) => self.rewrite(x, false),
                    }
                }
            }
            serde_json::Value::Array(a) => {
                for x in a {
                    self.rewrite(x, false);
                }
            }
            _ => {}
        }
    }
}

/// The anchors (`$anchor`, `$dynamicAnchor`) of the resource `v` is in,
/// at schema pointer `at`; the first of a name wins.
fn collect_anchors(
    v: &serde_json::Value,
    at: &str,
    root: bool,
    out: &mut BTreeMap<String, String>,
) {
    match v {
        serde_json::Value::Object(m) => {
            if !root && m.contains_key("$id") {
                return;
            }
            for key in ["$anchor", "$dynamicAnchor"] {
                if let Some(serde_json::Value::String(name)) = m.get(key) {
                    out.entry(name.clone()).or_insert_with(|| at.to_owned());
                }
            }
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("const" | "enum" | "default" | "examples", _) => {}
                    (
                        "properties" | "patternProperties" | "$defs" | "definitions"
                        | "dependentSchemas",
                        serde_json::Value::Object(named),
                    ) => {
                        for (name, s) in named {
                            let here = format!("{at}/{}/{}", pointer_token(k), pointer_token(name));
                            collect_anchors(s, &here, false, out);
                        }
                    }
                    (_, x) => collect_anchors(x, &format!("{at}/{}", pointer_token(k)), false, out),
                }
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                collect_anchors(x, &format!("{at}/{i}"), false, out);
            }
        }
        _ => {}
    }
}

/// `name` as a JSON pointer token (RFC 6901).
fn pointer_token(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

/// A JSON pointer as a URI fragment: bytes outside RFC 3986's `fragment`
/// characters percent-encoded.
fn fragment(pointer: &str) -> String {
    let mut out = String::with_capacity(pointer.len());
    for b in pointer.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Collects component schemas while operations reference them.
#[derive(Default)]
struct Schemas(Vec<(String, RefOr<Schema>)>);

impl Schemas {
    /// Registers `T` (and the schemas it refers to) and returns a `$ref` to it.
    fn of<T: ToSchema>(&mut self) -> RefOr<Schema> {
        self.0.push((T::name().into_owned(), T::schema()));
        T::schemas(&mut self.0);
        Ref::from_schema_name(T::name()).into()
    }
}

/// What [`describe`] says about one operation, beside its errors.
struct Described {
    tag: &'static str,
    summary: &'static str,
    description: &'static str,
    parameters: Vec<Parameter>,
    body: Option<RefOr<Schema>>,
    /// Success status, its description, and (media type, schema) if it has a
    /// body.
    ok: (
        StatusCode,
        &'static str,
        Option<(&'static str, RefOr<Schema>)>,
    ),
}

fn path_id(description: &str, schema: RefOr<Schema>) -> Parameter {
    ParameterBuilder::new()
        .name("id")
        .parameter_in(ParameterIn::Path)
        .required(Required::True)
        .description(Some(description))
        .schema(Some(schema))
        .build()
}

/// The `{name}` of `/v1/event-types/{name}`: a wire name or an alias.
fn type_name() -> Parameter {
    ParameterBuilder::new()
        .name("name")
        .parameter_in(ParameterIn::Path)
        .required(Required::True)
        .description(Some(
            "the type's wire name or one of its aliases; any other value is `404 not_found`",
        ))
        .schema(Some(String::schema()))
        .build()
}

/// A handler id: `hdl_` + 32 hex digits. Any other value is `404 not_found`.
fn handler_id() -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(HANDLER_ID_PATTERN))
        .into()
}

/// An event id: 1 to 128 printable ASCII characters.
fn event_id() -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(lanebus_store::MAX_EVENT_ID_LEN))
        .pattern(Some("^[!-~]{1,128}$"))
        .into()
}

fn text(format_hint: &'static str) -> RefOr<Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(format_hint))
        .into()
}

/// Summary, parameters, request body and success answer of `op`.
fn describe(op: Operation, s: &mut Schemas) -> Described {
    let json = |schema| Some((JSON, schema));
    let d = |tag, summary, description, ok| Described {
        tag,
        summary,
        description,
        parameters: Vec::new(),
        body: None,
        ok,
    };
    match op {
        Operation::PublishEvents => Described {
            body: Some(s.of::<PublishRequest>()),
            ..d(
                "events",
                "Publish a batch of events",
                "Stores the batch in one transaction (all or nothing) with one delivery per \
                 matching handler. An id already stored, or repeated in the batch, counts as a \
                 duplicate and is not delivered again (idempotent publish). The whole batch is \
                 validated first: one bad event refuses the batch and writes nothing. An event \
                 with `expected_seq` is stored only if its key's last sequence number just \
                 before it equals that value (optimistic concurrency on the key as an event \
                 stream); otherwise nothing of the batch is stored and the answer is `409 \
                 conflict`, whose `error` names the `key`, the `expected_seq`, the key's \
                 `current_seq` and the `event_index` of the event whose expectation broke.",
                (
                    StatusCode::ACCEPTED,
                    "the batch is stored",
                    json(s.of::<PublishAnswer>()),
                ),
            )
        },
        Operation::GetEvent => Described {
            parameters: vec![path_id(
                "event id (1 to 128 printable ASCII characters); any other value is \
                 `404 not_found`, except a path that is not UTF-8 once percent-decoded \
                 (`400 invalid_parameter`, as on every path)",
                event_id(),
            )],
            ..d(
                "events",
                "Look up an event and its deliveries",
                "The event (type, key, sequence, lane, publish time, payload size) and, per \
                 handler with a pending delivery, a completion or a dead letter of it, where the \
                 delivery stands: `pending` (failed attempts so far, next attempt time, last \
                 error, attempt log), `completed` (when, after how many attempts) or \
                 `dead_lettered` (when, attempts, last error, attempt log), with the handler's \
                 name while it exists. The attempt log holds the last 5 failed attempts: HTTP \
                 status or transport error class, duration, the first 1 KiB of the body. \
                 When the event is not stored: `410 pruned` if its id is a UUIDv7 (as lanebus \
                 generates) from before the retention period (default 24 h; retention removes \
                 an event published before it once no delivery of it is pending or \
                 dead-lettered, with its completions); `404 not_found` otherwise: never \
                 published, or, for an id that carries no time (one the publisher chose), \
                 either. A read only: pending deliveries are found among the event's \
                 lane's rows, completions in the log since its publish, dead letters by event.",
                (
                    StatusCode::OK,
                    "the event and its deliveries",
                    json(s.of::<EventView>()),
                ),
            )
        },
        Operation::CreateHandler => Described {
            body: Some(s.of::<CreateHandler>()),
            ..d(
                "handlers",
                "Register a webhook handler",
                "Policy fields take their defaults when absent; a signing secret is generated \
                 when absent. The answer includes the id and the secret.",
                (
                    StatusCode::CREATED,
                    "the handler is registered",
                    json(s.of::<HandlerView>()),
                ),
            )
        },
        Operation::ListHandlers => d(
            "handlers",
            "List handlers",
            "Every handler, in creation order, secrets included.",
            (StatusCode::OK, "the handlers", json(s.of::<HandlerList>())),
        ),
        Operation::GetHandler => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            ..d(
                "handlers",
                "Get one handler",
                "",
                (StatusCode::OK, "the handler", json(s.of::<HandlerView>())),
            )
        },
        Operation::DeleteHandler => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            ..d(
                "handlers",
                "Remove a handler",
                "Its pending deliveries and its dead letters are discarded; the answer counts them.",
                (
                    StatusCode::OK,
                    "the handler is removed",
                    json(s.of::<Deleted>()),
                ),
            )
        },
        Operation::EnableHandler => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            ..d(
                "handlers",
                "Enable a handler",
                "A webhook answering `410 Gone` disables its handler: its pending deliveries \
                 are kept, not attempted. Enabling resumes them, in order per key (this node at \
                 once, the others at their next catalog reload). Idempotent.",
                (
                    StatusCode::OK,
                    "the handler, enabled",
                    json(s.of::<HandlerView>()),
                ),
            )
        },
        Operation::DisableHandler => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            ..d(
                "handlers",
                "Disable a handler",
                "Stops attempts to the handler (as a `410 Gone` answer does; `state_reason` \
                 `api`): its pending deliveries, and those of events published meanwhile, are \
                 kept, not attempted, until `POST /v1/handlers/{id}/enable`. An attempt already \
                 in flight finishes. This node stops at once, the others at their next catalog \
                 reload. Idempotent.",
                (
                    StatusCode::OK,
                    "the handler, disabled",
                    json(s.of::<HandlerView>()),
                ),
            )
        },
        Operation::UpdateHandler => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            body: Some(s.of::<UpdateHandler>()),
            ..d(
                "handlers",
                "Change a handler's settings",
                "A JSON merge patch: absent fields stay as they are, `\"rate_limit\": null` \
                 removes the rate limit, a `rate_limit` object replaces it whole (`per_second` \
                 required, `burst` defaults to it), other fields cannot be null. The result is checked \
                 like a registration. Route changes apply to events published after the \
                 change; the other settings to the next attempt (this node at once, the others \
                 at their next catalog reload).",
                (
                    StatusCode::OK,
                    "the handler, changed",
                    json(s.of::<HandlerView>()),
                ),
            )
        },
        Operation::RotateHandlerSecret => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            body: Some(s.of::<RotateSecret>()),
            ..d(
                "handlers",
                "Rotate a handler's signing secret",
                "The new secret (given, or generated) signs from now on. The old one keeps \
                 signing for the grace period (default 24 h): `webhook-signature` then carries \
                 both signatures, space-separated (`v1,<new> v1,<old>`), so a receiver knowing \
                 either secret verifies every request (this node at once, the other nodes from \
                 their next catalog reload, within 5 s: switch receivers after that). A secret \
                 still in an earlier grace period stops signing. The answer shows the new `secret` and \
                 `previous_secret_until`. A given `secret` equal to the current one is refused \
                 (`422 invalid_handler`): it would end the previous secret's grace period.",
                (
                    StatusCode::OK,
                    "the handler with its new secret",
                    json(s.of::<HandlerView>()),
                ),
            )
        },
        Operation::RecoverHandler => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            body: Some(s.of::<RecoverRequest>()),
            ..d(
                "handlers",
                "Deliver completed events again",
                "Every event whose delivery to the handler completed at or after `since` is \
                 delivered again, once, with the same event id and the header \
                 `lanebus-replay: true`; a key's events in sequence order. Completed events are \
                 kept for the node's retention period (default 24 h): an older `since` is \
                 `422 invalid_input`. Events already pending for the handler are not doubled \
                 (`already_pending`); completions whose event was pruned are counted as \
                 `pruned`.",
                (StatusCode::OK, "recovered", json(s.of::<Recovered>())),
            )
        },
        Operation::ListHandlerDeliveries => Described {
            parameters: [
                vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
                DeliveriesQuery::into_params(|| Some(ParameterIn::Query)),
            ]
            .concat(),
            ..d(
                "handlers",
                "List a handler's deliveries",
                "One state at a time (`pending`, the default; `dead`; `completed`), newest first, \
                 a page at a time: pass `next_after` as `after` for the next page (`null` on the \
                 last). `key` keeps one ordering key's events. Pending deliveries come by \
                 delivery id, dead letters by dead-letter id, completions by completion time \
                 within the node's retention period. Pending deliveries and dead letters show \
                 their attempt log (the last 5 failed attempts). A read only, without an index \
                 of its own: \
                 pending deliveries walk the delivery ids backward past other handlers' rows \
                 (the whole table when the handler has fewer than `limit`); dead letters use \
                 their handler index; completions are read by time (on PostgreSQL every \
                 handler's completions since the page's last item). Unknown query parameters, \
                 a bad `state`, `limit` or `after` are `400 invalid_parameter`; an unknown \
                 handler `404 not_found`.",
                (
                    StatusCode::OK,
                    "one page of deliveries",
                    json(s.of::<DeliveriesPage>()),
                ),
            )
        },
        Operation::CreateEventType => Described {
            body: Some(s.of::<CreateEventType>()),
            ..d(
                "event types",
                "Add a type to the event-type catalog",
                "A type has one wire name (the `type` its events are stored and sent under), \
                 aliases publishers may still send (stored as the wire name; routes naming an \
                 alias keep matching), and an optional JSON Schema (draft 2020-12): every \
                 published payload of the type must satisfy it, or the publish is refused \
                 whole (`422 invalid_input` naming `events[i]`, the JSON pointer in the payload \
                 and the failed keyword). A schema that is no valid draft 2020-12 schema, or \
                 refers to an external `$ref`, is `422 invalid_input`; a name or alias already \
                 a type's is `409 conflict`. Every node honours the change at its next \
                 publish.",
                (
                    StatusCode::CREATED,
                    "the type is cataloged",
                    json(s.of::<EventTypeView>()),
                ),
            )
        },
        Operation::ListEventTypes => d(
            "event types",
            "List the event-type catalog",
            "Every type, by wire name.",
            (StatusCode::OK, "the catalog", json(s.of::<EventTypeList>())),
        ),
        Operation::GetEventType => Described {
            parameters: vec![type_name()],
            ..d(
                "event types",
                "Get one event type",
                "By wire name or alias.",
                (StatusCode::OK, "the type", json(s.of::<EventTypeView>())),
            )
        },
        Operation::UpdateEventType => Described {
            parameters: vec![type_name()],
            body: Some(s.of::<UpdateEventType>()),
            ..d(
                "event types",
                "Change or rename an event type",
                "Absent fields stay as they are; `\"schema\": null` removes the schema; \
                 `aliases` replaces them whole. A new `name` renames the type: the old wire \
                 name becomes an alias, so publishers still sending it and routes naming it \
                 keep working, and events published from then on are stored and sent under \
                 the new name. `\"deprecated\": false` undoes a deprecation.",
                (
                    StatusCode::OK,
                    "the type, changed",
                    json(s.of::<EventTypeView>()),
                ),
            )
        },
        Operation::DeprecateEventType => Described {
            parameters: vec![type_name()],
            ..d(
                "event types",
                "Deprecate an event type",
                "As in Svix: its events are still accepted, and it is shown deprecated.",
                (
                    StatusCode::OK,
                    "the type, deprecated",
                    json(s.of::<EventTypeView>()),
                ),
            )
        },
        Operation::ForgetSubject => Described {
            parameters: vec![path_id(
                "subject id: the value at the type's `x-lanebus-subject` pointer \
                 (a string, or a number's JSON text), 1 to 256 bytes",
                String::schema(),
            )],
            ..d(
                "subjects",
                "Erase a subject's personal fields",
                "Destroys the subject's data key (crypto-shredding): from the answer on, no \
                 node can decrypt the fields marked `x-lanebus-personal` of the subject's \
                 events; pending deliveries, recovers and dead-letter replays send them as \
                 `null` with header `lanebus-redacted` naming their JSON pointers. Events are \
                 not rewritten, and copies receivers already hold are not reached. `204` also \
                 for a subject without a key (already erased, or never seen): erasure is \
                 idempotent. A later event of the subject gets a new key.",
                (StatusCode::NO_CONTENT, "the subject's key is destroyed", None),
            )
        },
        Operation::GetCatalogSettings => d(
            "event types",
            "The store-wide catalog setting",
            "",
            (
                StatusCode::OK,
                "the setting",
                json(s.of::<CatalogSettingsView>()),
            ),
        ),
        Operation::SetCatalogSettings => Described {
            body: Some(s.of::<CatalogSettingsView>()),
            ..d(
                "event types",
                "Set the store-wide catalog setting",
                "With `strict`, a publish of a type that is neither a wire name nor an alias \
                 in the catalog is refused (`422 invalid_input`); lanebus's own `lanebus.` \
                 types are exempt. Stored, so every node honours it at its next publish.",
                (
                    StatusCode::OK,
                    "the setting",
                    json(s.of::<CatalogSettingsView>()),
                ),
            )
        },
        Operation::ListDeadLetters => Described {
            parameters: DeadLetterQuery::into_params(|| Some(ParameterIn::Query)),
            ..d(
                "dead letters",
                "List dead letters",
                "Oldest first, a page at a time: pass `next_after` as `after` for the next \
                 page. Unknown query parameters are refused.",
                (
                    StatusCode::OK,
                    "one page of dead letters",
                    json(s.of::<DeadLetterPage>()),
                ),
            )
        },
        Operation::ReplayDeadLetter => Described {
            parameters: vec![path_id("dead-letter id", i64::schema())],
            ..d(
                "dead letters",
                "Replay one dead letter",
                "The dead letter becomes a fresh delivery again (attempts reset).",
                (StatusCode::OK, "replayed", json(s.of::<Replayed>())),
            )
        },
        Operation::ReplayDeadLetters => Described {
            body: Some(s.of::<BulkReplay>()),
            ..d(
                "dead letters",
                "Replay dead letters by handler, by ids, or all",
                "The selection must be explicit: `handler_id`, `ids`, or both (those ids of \
                 that handler), or `\"all\": true` alone (every dead letter of every handler, \
                 one handler after the other). With `handler_id` alone, `since` and/or `until` \
                 (RFC 3339) select the dead letters that failed in `[since, until)`. Anything \
                 else, `{}` included, replays nothing and is `422 invalid_input`. Unknown ids are skipped and not counted; an \
                 unknown `handler_id` is `404 not_found`.",
                (StatusCode::OK, "replayed", json(s.of::<Replayed>())),
            )
        },
        Operation::ListLanes => d(
            "cluster",
            "The lane table",
            "Every lane with its owner, epoch, state, lease, backlog and in-flight count, as \
             the answering node sees it.",
            (StatusCode::OK, "the lanes", json(s.of::<LaneList>())),
        ),
        Operation::GetCluster => d(
            "cluster",
            "The cluster membership",
            "Members with addresses, voter or learner, liveness and lane counts; the leader \
             and term.",
            (StatusCode::OK, "the cluster", json(s.of::<ClusterView>())),
        ),
        Operation::JoinCluster => Described {
            body: Some(s.of::<JoinRequest>()),
            ..d(
                "cluster",
                "Add a node to the cluster",
                "Records the node as a member (forwarded to the Raft leader); the leader then \
                 makes it a learner, and a voter while there are fewer voters than configured. \
                 Idempotent for the same id and addresses. `422 invalid_input`: id 0, or an \
                 address that is not `IP:PORT`; `409 conflict`: the id is a member \
                 with other addresses, or this node runs without a cluster; `503 not_ready`: \
                 no leader reachable now, retry.",
                (
                    StatusCode::OK,
                    "the node is a member",
                    json(s.of::<ClusterChanged>()),
                ),
            )
        },
        Operation::RemoveNode => Described {
            body: Some(s.of::<RemoveRequest>()),
            ..d(
                "cluster",
                "Remove a node on purpose",
                "Marks the node leaving: its lanes are handed over gracefully (it drains and \
                 releases them; it must keep running meanwhile), then the leader removes it from \
                 Raft. `409 conflict`: unknown id, or no cluster; `503 not_ready`: no leader \
                 reachable now, retry.",
                (
                    StatusCode::OK,
                    "the node is leaving",
                    json(s.of::<ClusterChanged>()),
                ),
            )
        },
        Operation::HandlerSummaries => d(
            "handlers",
            "Handlers with state and dead-letter counts",
            "The operator's view of the catalog, without secrets. Counting reads at most \
             10,000 dead letters; past that the counts are lower bounds and \
             `dead_letters_exact` is false.",
            (
                StatusCode::OK,
                "the handlers",
                json(s.of::<HandlerSummaries>()),
            ),
        ),
        Operation::HandlerActivity => Described {
            parameters: vec![path_id("handler id (`hdl_` + 32 hex digits)", handler_id())],
            ..d(
                "handlers",
                "A handler's attempts on this node, last 15 minutes",
                "One sample per 10 s since the node started, at most 90 (15 minutes), oldest \
                 first, the last being the interval under way: attempts delivered and failed, \
                 their rates per second, and the 99th percentile of attempt durations. From \
                 the answering node's own counters, kept in memory (lost on restart): each \
                 member counts the attempts of the lanes it owns, so a cluster's total is the \
                 sum over its members. The store is read only to tell an unknown handler \
                 (`404 not_found`).",
                (
                    StatusCode::OK,
                    "the handler's samples",
                    json(s.of::<HandlerActivity>()),
                ),
            )
        },
        Operation::Metrics => d(
            "operations",
            "Prometheus metrics",
            "Text exposition format 0.0.4 (`text/plain; version=0.0.4`).",
            (
                StatusCode::OK,
                "the metrics",
                Some((
                    "text/plain",
                    text("Prometheus text exposition format 0.0.4"),
                )),
            ),
        ),
        Operation::Healthz => d(
            "operations",
            "Liveness",
            "Answers while the process serves.",
            (StatusCode::OK, "alive", json(s.of::<Status>())),
        ),
        Operation::Readyz => d(
            "operations",
            "Readiness",
            "Ready when the node has joined with a valid lease, its lanes are started and its \
             actor thread runs (else `503 not_ready`, whose message says which is missing), and \
             the store answers within 2 s (else `503 store_unavailable`).",
            (StatusCode::OK, "ready", json(s.of::<Status>())),
        ),
        Operation::OpenApi => d(
            "operations",
            "This OpenAPI document",
            "With a `webhooks` section generated from the event-type catalog at request \
             time: per type, keyed by its wire name, the POST lanebus sends (Standard \
             Webhooks headers, body `{\"type\", \"timestamp\", \"data\"}` with `data` \
             the type's schema), from which receivers can generate their handlers.",
            (
                StatusCode::OK,
                "the OpenAPI 3.1 document",
                json(ObjectBuilder::new().schema_type(Type::Object).into()),
            ),
        ),
        Operation::DashboardRedirect => d(
            "dashboard",
            "Redirect to the dashboard",
            "",
            (StatusCode::PERMANENT_REDIRECT, "to `/ui/`", None),
        ),
        Operation::Dashboard => d(
            "dashboard",
            "The dashboard page",
            "Lanes coloured by owner, nodes, handlers; polls the admin paths every second. \
             Served from assets embedded in the binary.",
            (
                StatusCode::OK,
                "the page",
                Some(("text/html", text("HTML document"))),
            ),
        ),
        Operation::DashboardScript => d(
            "dashboard",
            "The dashboard's script",
            "",
            (
                StatusCode::OK,
                "the script",
                Some(("text/javascript", text("JavaScript"))),
            ),
        ),
        Operation::DashboardStyle => d(
            "dashboard",
            "The dashboard's style sheet",
            "",
            (
                StatusCode::OK,
                "the style sheet",
                Some(("text/css", text("CSS"))),
            ),
        ),
    }
}

fn http_method(method: &Method) -> HttpMethod {
    match *method {
        Method::POST => HttpMethod::Post,
        Method::PUT => HttpMethod::Put,
        Method::DELETE => HttpMethod::Delete,
        Method::PATCH => HttpMethod::Patch,
        Method::HEAD => HttpMethod::Head,
        Method::OPTIONS => HttpMethod::Options,
        Method::TRACE => HttpMethod::Trace,
        _ => HttpMethod::Get,
    }
}

/// The error answers of `op`: one per status, listing its codes, each code
/// with an example body.
fn error_responses(
    op: Operation,
    error: &RefOr<Schema>,
) -> BTreeMap<u16, utoipa::openapi::Response> {
    let mut by_status: BTreeMap<u16, Vec<ErrorCode>> = BTreeMap::new();
    for code in op.errors() {
        by_status
            .entry(code.status().as_u16())
            .or_default()
            .push(code);
    }
    by_status
        .into_iter()
        .map(|(status, codes)| {
            let description = codes
                .iter()
                .map(|c| format!("`{}`: {}", c.as_str(), c.meaning()))
                .collect::<Vec<_>>()
                .join("; ");
            let examples = codes.iter().map(|c| {
                let value = if (op, *c) == (Operation::PublishEvents, ErrorCode::Conflict) {
                    seq_conflict_example()
                } else {
                    serde_json::json!({
                        "error": {"code": c.as_str(), "message": c.meaning()}
                    })
                };
                (
                    c.as_str(),
                    ExampleBuilder::new()
                        .summary(c.meaning())
                        .value(Some(value))
                        .build(),
                )
            });
            let content = ContentBuilder::new()
                .schema(Some(error.clone()))
                .examples_from_iter(examples)
                .build();
            (
                status,
                ResponseBuilder::new()
                    .description(description)
                    .content(JSON, content)
                    .build(),
            )
        })
        .collect()
}

/// The body of a publish's broken `expected_seq`, as the API answers it.
fn seq_conflict_example() -> serde_json::Value {
    let e = crate::ApiError::from(lanebus_store::StoreError::SeqConflict {
        key: "order-7".into(),
        expected: 1,
        current: 2,
        index: 0,
        at: 2,
    });
    let body = crate::error::error_body_with(e.code, &e.message, e.seq.as_ref());
    serde_json::from_slice(&body).unwrap_or_default()
}

fn build() -> OpenApi {
    let mut schemas = Schemas::default();
    let error = schemas.of::<ErrorBody<'static>>();
    let mut paths = PathsBuilder::new();
    for spec in ROUTES {
        let op = spec.operation;
        let described = describe(op, &mut schemas);
        let (status, ok_description, ok_body) = described.ok;
        let mut ok = ResponseBuilder::new().description(ok_description);
        if let Some((media, schema)) = ok_body {
            ok = ok.content(media, ContentBuilder::new().schema(Some(schema)).build());
        }
        if status.is_redirection() {
            ok = ok.header(
                "location",
                HeaderBuilder::new()
                    .schema(String::schema())
                    .description(Some("where the dashboard is"))
                    .build(),
            );
        }
        let mut operation = OperationBuilder::new()
            .operation_id(Some(op.id()))
            .tag(described.tag)
            .summary(Some(described.summary))
            .response(status.as_u16().to_string(), ok.build());
        if !described.description.is_empty() {
            operation = operation.description(Some(described.description));
        }
        for parameter in described.parameters {
            operation = operation.parameter(parameter);
        }
        if let Some(body) = described.body {
            // Every field of a rotation is optional, and so is its body.
            let required = if matches!(op, Operation::RotateHandlerSecret) {
                Required::False
            } else {
                Required::True
            };
            operation = operation.request_body(Some(
                RequestBodyBuilder::new()
                    .required(Some(required))
                    .content(JSON, ContentBuilder::new().schema(Some(body)).build())
                    .build(),
            ));
        }
        if let Some(scope) = crate::auth::required_scope(spec.path) {
            operation =
                operation.security(SecurityRequirement::new(BEARER_SCHEME, [scope.as_str()]));
        }
        for (status, response) in error_responses(op, &error) {
            operation = operation.response(status.to_string(), response);
        }
        paths = paths.path(
            spec.path,
            PathItem::new(http_method(&spec.method), operation.build()),
        );
    }
    let components = schemas
        .0
        .into_iter()
        .collect::<BTreeMap<_, _>>()
        .into_iter()
        .fold(ComponentsBuilder::new(), |c, (name, schema)| {
            c.schema(name, schema)
        })
        .security_scheme(
            BEARER_SCHEME,
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "`authorization: Bearer TOKEN`. Scopes: `publish` (POST /v1/events) and \
                         `admin` (everything else but /healthz, /readyz, /openapi.json and the \
                         dashboard's files; implies publish). A node without configured tokens \
                         serves only on loopback and needs none.",
                    ))
                    .build(),
            ),
        )
        .build();
    let tags = [
        ("events", "Publish events"),
        ("handlers", "The handler catalog"),
        (
            "event types",
            "The event-type catalog: wire names, aliases, payload schemas",
        ),
        (
            "subjects",
            "Personal fields encrypted per subject: erasing a subject (crypto-shredding)",
        ),
        ("dead letters", "Deliveries that exhausted their attempts"),
        (
            "cluster",
            "Lanes and members, as the answering node sees them",
        ),
        ("operations", "Metrics, health, this document"),
        ("dashboard", "The operator's dashboard (HTML, embedded)"),
    ]
    .map(|(name, description)| {
        TagBuilder::new()
            .name(name)
            .description(Some(description))
            .build()
    });
    OpenApiBuilder::new()
        .info(
            InfoBuilder::new()
                .title("lanebus")
                .version(env!("CARGO_PKG_VERSION"))
                .description(Some(
                    "HTTP API of a lanebus node: publish events, manage webhook handlers and \
                     dead letters, look at lanes and the cluster. Every node answers every \
                     path. Every 4xx/5xx answer has the body \
                     `{\"error\": {\"code\", \"message\"}}`, `code` one of the `ErrorCode` \
                     enum; each operation lists its codes by status. On every path, a request \
                     URI (path and query) over 8,192 bytes is `414 uri_too_long`.",
                ))
                .license(Some(
                    LicenseBuilder::new()
                        .name("Apache-2.0")
                        .identifier(Some("Apache-2.0"))
                        .build(),
                ))
                .build(),
        )
        .paths(paths.build())
        .components(Some(components))
        .tags(Some(tags))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn doc() -> serde_json::Value {
        serde_json::from_slice(document_json()).expect("the document is JSON")
    }

    #[test]
    fn embedded_schemas_point_their_local_refs_at_their_new_place() {
        let schema = serde_json::json!({
            "$id": "https://example.org/s.json",
            "properties": {
                "const": {"$ref": "#/$defs/a"},
                "b": {"$ref": "#"},
                "c": {"$ref": "other.json#/x"},
                "d": {"$ref": "#anchor"},
                "e": {"const": {"$ref": "#/$defs/a"}},
                "f": {"$id": "https://example.org/f.json", "$ref": "#/$defs/g"}
            },
            "$defs": {"a": {"items": [{"$dynamicRef": "#/$defs/a"}]}}
        });
        let got = embed_schema(schema, "/webhooks/a b/x~1y");
        let p = "#/webhooks/a%20b/x~1y";
        assert_eq!(got.get("$id"), None);
        let props = &got["properties"];
        assert_eq!(props["const"]["$ref"], format!("{p}/$defs/a"));
        assert_eq!(props["b"]["$ref"], p);
        // Relative to the dropped `$id`: made absolute against it.
        assert_eq!(props["c"]["$ref"], "https://example.org/other.json#/x");
        assert_eq!(props["d"]["$ref"], "#anchor");
        assert_eq!(props["e"]["const"]["$ref"], "#/$defs/a");
        assert_eq!(props["f"]["$ref"], "#/$defs/g");
        assert_eq!(
            got["$defs"]["a"]["items"][0]["$dynamicRef"],
            format!("{p}/$defs/a")
        );
    }

    fn pairs_of_doc(doc: &serde_json::Value) -> BTreeSet<(String, String, String)> {
        let mut pairs = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("path item") {
                let id = op["operationId"].as_str().expect("operationId").to_owned();
                pairs.insert((method.to_uppercase(), path.clone(), id));
            }
        }
        pairs
    }

    #[test]
    fn document_describes_exactly_the_route_table() {
        let from_routes: BTreeSet<(String, String, String)> = ROUTES
            .iter()
            .map(|r| {
                (
                    r.method.to_string(),
                    r.path.to_owned(),
                    r.operation.id().to_owned(),
                )
            })
            .collect();
        assert_eq!(from_routes.len(), ROUTES.len());
        assert_eq!(pairs_of_doc(&doc()), from_routes);
    }

    #[test]
    fn document_is_openapi_3_1_with_info() {
        let doc = doc();
        let version = doc["openapi"].as_str().expect("openapi");
        assert!(version.starts_with("3.1."), "{version}");
        assert_eq!(doc["info"]["title"], "lanebus");
        assert!(doc["info"]["version"].is_string());
    }

    #[test]
    fn every_operation_lists_exactly_its_error_codes_by_status() {
        let doc = doc();
        for spec in ROUTES {
            let op = &doc["paths"][spec.path][spec.method.as_str().to_lowercase()];
            let responses = op["responses"].as_object().expect("responses");
            let mut documented: BTreeSet<String> = BTreeSet::new();
            for (status, response) in responses {
                let n: u16 = status.parse().expect("numeric status");
                if n < 400 {
                    continue;
                }
                let content = &response["content"]["application/json"];
                assert_eq!(
                    content["schema"]["$ref"], "#/components/schemas/Error",
                    "{} {} {status}",
                    spec.method, spec.path
                );
                for code in content["examples"].as_object().expect("examples").keys() {
                    documented.insert(format!("{status} {code}"));
                }
            }
            let expected: BTreeSet<String> = spec
                .operation
                .errors()
                .iter()
                .map(|c| format!("{} {}", c.status().as_u16(), c.as_str()))
                .collect();
            assert_eq!(documented, expected, "{} {}", spec.method, spec.path);
            let successes = responses
                .keys()
                .filter(|s| s.starts_with('2') || s.starts_with('3'))
                .count();
            assert_eq!(successes, 1, "{} {}", spec.method, spec.path);
        }
    }

    #[test]
    fn a_publish_conflict_example_names_where_the_key_stands() {
        let doc = doc();
        let example = &doc["paths"]["/v1/events"]["post"]["responses"]["409"]["content"]
            ["application/json"]["examples"]["conflict"]["value"]["error"];
        assert_eq!(example["code"], "conflict", "{example}");
        for field in ["key", "expected_seq", "current_seq", "event_index"] {
            assert!(example.get(field).is_some(), "{field} missing: {example}");
        }
    }

    #[test]
    fn operations_that_read_json_bodies_document_them_and_their_errors() {
        let doc = doc();
        for spec in ROUTES {
            let op = &doc["paths"][spec.path][spec.method.as_str().to_lowercase()];
            let has_body = op.get("requestBody").is_some();
            let reads_json = spec.operation.errors().contains(&ErrorCode::InvalidJson);
            assert_eq!(has_body, reads_json, "{} {}", spec.method, spec.path);
            if has_body {
                assert!(op["requestBody"]["content"][JSON]["schema"]["$ref"].is_string());
            }
            for param in op["parameters"].as_array().into_iter().flatten() {
                if param["in"] == "path" {
                    let name = param["name"].as_str().expect("name");
                    assert!(spec.path.contains(&format!("{{{name}}}")), "{name}");
                }
            }
            let templated = spec.path.matches('{').count();
            let path_params = op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "path")
                .count();
            assert_eq!(templated, path_params, "{} {}", spec.method, spec.path);
        }
    }

    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("$ref", serde_json::Value::String(r)) => out.push(r.clone()),
                        _ => refs(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn every_ref_resolves_to_a_component() {
        let doc = doc();
        let mut all = Vec::new();
        refs(&doc, &mut all);
        assert!(!all.is_empty());
        for r in all {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("unexpected $ref {r}"));
            assert!(
                doc["components"]["schemas"].get(name).is_some(),
                "{r} does not resolve"
            );
        }
    }

    #[test]
    fn dump_for_inspection() {
        if let Ok(path) = std::env::var("LANEBUS_OPENAPI_DUMP") {
            std::fs::write(path, serde_json::to_vec_pretty(&doc()).unwrap_or_default())
                .expect("write dump");
        }
    }
}
