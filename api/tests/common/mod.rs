//! Test harness: the router in-process (`tower::ServiceExt::oneshot`) over a
//! real store (a SQLite temp file, or a fresh PostgreSQL database per test in
//! the server named by `LANEBUS_TEST_POSTGRES_URL`), with a stub node.
//!
//! Every answer to a path of the route table is also checked against the
//! OpenAPI document ([`check_against_document`]): its status must be one the
//! operation documents, its content type the documented one, and a JSON body
//! must fit the documented schema (types, required and unknown properties).
//! So every API test doubles as a conformance test of `/openapi.json`.

#![allow(dead_code)]

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{header, HeaderMap, Method, Request, StatusCode};
use axum::Router;
use lanebus_api::{router, ApiState, LaneView, Limits, NodeView};
use lanebus_store::{
    lane_of_event, DeadLetterRequest, Epoch, Handler, Lane, LaneClaim, NewEvent, Store, StoreCounts,
};
use serde_json::Value;
use tower::ServiceExt as _;

/// Limits small enough to breach cheaply in tests.
pub const TEST_LIMITS: Limits = Limits {
    max_body_bytes: 64 << 10,
    max_payload_bytes: 1 << 10,
    max_batch: 10,
};

/// A node that records what the API tells it.
#[derive(Default)]
pub struct StubNode {
    pub not_ready: AtomicBool,
    pub published: Mutex<Vec<Vec<Lane>>>,
    pub handlers_changed: AtomicUsize,
    pub lanes: Vec<LaneView>,
    /// [`NodeView::lanes`] answers `StoreError::Unavailable` with this
    /// message instead of `lanes`.
    pub lanes_error: Option<String>,
    /// The bound answered by [`NodeView::longest_timeout`] (`None`: no
    /// bound).
    pub longest_timeout: Option<std::time::Duration>,
    /// The period answered by [`NodeView::retention`] (`None`: unknown);
    /// a test may change it.
    pub retention: Mutex<Option<std::time::Duration>>,
}

#[async_trait]
impl NodeView for StubNode {
    fn node_id(&self) -> String {
        "n1".into()
    }
    async fn lanes(&self) -> Result<Vec<LaneView>, lanebus_store::StoreError> {
        match &self.lanes_error {
            Some(m) => Err(lanebus_store::StoreError::Unavailable(m.clone())),
            None => Ok(self.lanes.clone()),
        }
    }
    fn published(&self, lanes: &[Lane]) {
        self.published.lock().expect("lock").push(lanes.to_vec());
    }
    fn handlers_changed(&self) {
        self.handlers_changed.fetch_add(1, Ordering::SeqCst);
    }
    fn longest_timeout(&self) -> Option<std::time::Duration> {
        self.longest_timeout
    }
    fn retention(&self) -> Option<std::time::Duration> {
        *self.retention.lock().expect("lock")
    }
    async fn ready(&self) -> Result<(), String> {
        if self.not_ready.load(Ordering::SeqCst) {
            return Err("the stub says so".into());
        }
        Ok(())
    }
    fn render_metrics(&self) -> String {
        "# TYPE lanebus_up gauge\nlanebus_up 1\n".into()
    }
    /// One sample for any handler: [`stub_activity`].
    fn handler_activity(&self, _handler_id: &str) -> Vec<lanebus_api::ActivitySample> {
        vec![stub_activity()]
    }
}

/// The sample [`StubNode`] answers for every handler.
pub fn stub_activity() -> lanebus_api::ActivitySample {
    lanebus_api::ActivitySample {
        at: "2026-12-01T00:00:00Z".parse().expect("time"),
        seconds: 10.0,
        deliveries: 5,
        failures: 1,
        deliveries_per_s: 0.5,
        failures_per_s: 0.1,
        p99_attempt_ms: Some(12.5),
    }
}

#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// Where a test's store lives, to remove it afterwards.
enum Place {
    File(std::path::PathBuf),
    Database { admin_url: String, name: String },
}

pub struct TestApp {
    pub app: Router,
    pub store: Arc<dyn Store>,
    pub node: Arc<StubNode>,
}

/// A response: status, headers, raw body, and the body as JSON when it is.
pub struct Res {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub bytes: Vec<u8>,
    pub json: Value,
}

impl std::fmt::Debug for Res {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}",
            self.status,
            String::from_utf8_lossy(&self.bytes)
        )
    }
}

impl TestApp {
    /// Sends one request through the router.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> Res {
        self.call_with(method, path, content_type, &[], body).await
    }

    /// [`call`](Self::call) with extra request headers.
    pub async fn call_with(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Res {
        let method_name = method.to_string();
        let mut req = Request::builder().method(method).uri(path);
        if let Some(ct) = content_type {
            req = req.header(header::CONTENT_TYPE, ct);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Body::from(body)).expect("request builds");
        let res = self
            .app
            .clone()
            .oneshot(req)
            .await
            .expect("router is infallible");
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .expect("body reads")
            .to_vec();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let res = Res {
            status,
            headers,
            bytes,
            json,
        };
        check_against_document(&method_name, path, &res);
        res
    }

    pub async fn get(&self, path: &str) -> Res {
        self.call(Method::GET, path, None, Vec::new()).await
    }

    pub async fn delete(&self, path: &str) -> Res {
        self.call(Method::DELETE, path, None, Vec::new()).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Res {
        self.call(
            Method::POST,
            path,
            Some("application/json"),
            body.to_string().into_bytes(),
        )
        .await
    }

    /// What invariant 6 protects: the store's totals and the handler catalog.
    pub async fn snapshot(&self) -> (StoreCounts, Vec<Handler>) {
        (
            self.store.counts().await.expect("counts"),
            self.store.list_handlers().await.expect("list handlers"),
        )
    }

    /// Registers a handler through the API; returns its id.
    pub async fn create_handler(&self, name: &str, routes: &[&str]) -> String {
        let res = self
            .post("/v1/handlers", serde_json::json!({"name": name, "url": "http://127.0.0.1:9/hook", "event_types": routes}))
            .await;
        assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
        res.json["id"].as_str().expect("id").to_owned()
    }

    /// Publishes `n` events of `event_type` with `key` straight to the store
    /// and turns their deliveries into dead letters; returns the dead-letter
    /// count afterwards.
    pub async fn make_dead_letters(&self, event_type: &str, key: &str, n: usize) -> i64 {
        let events = (0..n)
            .map(|i| NewEvent {
                id: Some(format!("dl-{key}-{i}")),
                event_type: event_type.into(),
                key: Some(key.into()),
                payload: b"{}".to_vec(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect();
        self.store.publish(events).await.expect("publish");
        let lane = lane_of_event(Some(key), "", self.store.lanes());
        assert!(
            self.store
                .fence(lane, "test", Epoch(1))
                .await
                .expect("fence"),
            "fence lane {lane}"
        );
        let batches = self
            .store
            .claim(&[LaneClaim {
                lane,
                epoch: Epoch(1),
                after: Default::default(),
                limit: 1000,
            }])
            .await
            .expect("claim");
        // Only these events' deliveries: an unkeyed event of the caller's
        // (its lane follows its random id) can share the lane.
        let ids: Vec<String> = (0..n).map(|i| format!("dl-{key}-{i}")).collect();
        let dead: Vec<DeadLetterRequest> = batches
            .iter()
            .flat_map(|b| &b.deliveries)
            .filter(|d| ids.contains(&d.event_id))
            .map(|d| DeadLetterRequest {
                id: d.id,
                lane,
                epoch: Epoch(1),
                attempts: 3,
                last_error: "boom".into(),
                failure: None,
            })
            .collect();
        self.store.dead_letter(&dead).await.expect("dead letter");
        self.store.counts().await.expect("counts").dead_letters
    }
}

fn postgres_admin_url() -> String {
    match std::env::var("LANEBUS_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => panic!(
            "LANEBUS_TEST_POSTGRES_URL is not set: run the tests with scripts/test, which starts a throwaway \
             PostgreSQL (or set it to a server you run, e.g. postgres://postgres@127.0.0.1:55432/postgres)"
        ),
    }
}

/// Makes room for a fresh store: a temp file name, or a new database.
async fn place(backend: Backend) -> Place {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    match backend {
        Backend::Sqlite => Place::File(std::env::temp_dir().join(format!("lanebus-api-{tag}.db"))),
        Backend::Postgres => {
            use sqlx::Connection as _;
            let admin_url = postgres_admin_url();
            let name = format!("lanebus_t_{tag}");
            let mut conn = sqlx::PgConnection::connect(&admin_url)
                .await
                .expect("connect to LANEBUS_TEST_POSTGRES_URL");
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut conn)
                .await
                .expect("create database");
            Place::Database { admin_url, name }
        }
    }
}

/// Opens the store at `place` through `lanebus_store::open`, as the node does.
async fn open(place: &Place) -> Arc<dyn Store> {
    let url = match place {
        Place::File(path) => format!("sqlite://{}", path.display()),
        Place::Database { admin_url, name } => {
            let mut url = url::Url::parse(admin_url).expect("postgres url parses");
            url.set_path(&format!("/{name}"));
            url.to_string()
        }
    };
    lanebus_store::open(&url)
        .await
        .unwrap_or_else(|e| panic!("open store {url}: {e}"))
}

async fn remove(place: Place) {
    match place {
        Place::File(path) => {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        }
        Place::Database { admin_url, name } => {
            use sqlx::Connection as _;
            if let Ok(mut conn) = sqlx::PgConnection::connect(&admin_url).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut conn)
                    .await;
            }
        }
    }
}

/// Builds an app on `backend` with `limits` and `node`, runs `test`, then
/// removes the store, whether the test passed or not.
pub async fn run_with<F, Fut>(backend: Backend, limits: Limits, node: StubNode, test: F)
where
    F: FnOnce(TestApp) -> Fut,
    Fut: Future<Output = ()>,
{
    run_configured(backend, limits, node, |_| {}, test).await
}

/// [`run_with`], with `configure` changing the router's state before the
/// router is built. The state starts with the SSRF guard allowing loopback
/// (the tests register `http://127.0.0.1:9/hook`).
pub async fn run_configured<C, F, Fut>(
    backend: Backend,
    limits: Limits,
    node: StubNode,
    configure: C,
    test: F,
) where
    C: FnOnce(&mut ApiState),
    F: FnOnce(TestApp) -> Fut,
    Fut: Future<Output = ()>,
{
    use futures::FutureExt as _;
    let place = place(backend).await;
    let outcome = std::panic::AssertUnwindSafe(async {
        let store = open(&place).await;
        let node = Arc::new(node);
        let mut state = ApiState {
            store: store.clone(),
            node: node.clone(),
            limits,
            egress: lanebus_api::egress::EgressPolicy::allow_loopback(),
            auth: lanebus_api::auth::Auth::open(),
        };
        configure(&mut state);
        let app = router(state);
        test(TestApp { app, store, node }).await;
    })
    .catch_unwind()
    .await;
    remove(place).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// [`run_with`] with [`TEST_LIMITS`] and a default stub node.
pub async fn run<F, Fut>(backend: Backend, test: F)
where
    F: FnOnce(TestApp) -> Fut,
    Fut: Future<Output = ()>,
{
    run_with(backend, TEST_LIMITS, StubNode::default(), test).await
}

/// Generates each listed `async fn name(app: TestApp)` as a test on both
/// backends: `sqlite::name` and `postgres::name`.
#[macro_export]
macro_rules! on_every_backend {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::common::run($crate::common::Backend::Sqlite, super::$name).await
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    $crate::common::run($crate::common::Backend::Postgres, super::$name).await
                }
            )*
        }
    };
}

/// The OpenAPI document, parsed once per test binary.
pub fn document() -> &'static Value {
    static DOC: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    DOC.get_or_init(|| {
        serde_json::from_slice(lanebus_api::openapi::document_json()).expect("document is JSON")
    })
}

/// Whether `path` (no query) matches the template `template` (`{x}`
/// segments match any one segment).
pub fn matches_template(template: &str, path: &str) -> bool {
    let (t, p): (Vec<&str>, Vec<&str>) = (template.split('/').collect(), path.split('/').collect());
    t.len() == p.len()
        && t.iter()
            .zip(&p)
            .all(|(t, p)| t == p || (t.starts_with('{') && t.ends_with('}') && !p.is_empty()))
}

/// Checks one answer against the document: see the module docs. Answers to
/// paths outside the route table (404/405 of the router) are not checked.
pub fn check_against_document(method: &str, uri: &str, res: &Res) {
    let path = uri.split('?').next().unwrap_or(uri);
    let Some(spec) = lanebus_api::ROUTES
        .iter()
        .filter(|r| r.method.as_str() == method && matches_template(r.path, path))
        // A literal segment beats a template (`/replay` vs `/{id}`).
        .min_by_key(|r| r.path.matches('{').count())
    else {
        return;
    };
    let doc = document();
    let op = &doc["paths"][spec.path][method.to_lowercase()];
    let status = res.status.as_u16().to_string();
    let Some(response) = op["responses"].get(&status) else {
        panic!(
            "{method} {uri} answered {status}, which {} does not document: {res:?}",
            spec.operation.id()
        );
    };
    let Some(content) = response.get("content").and_then(Value::as_object) else {
        return;
    };
    let content_type = res
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let media = content_type.split(';').next().unwrap_or_default().trim();
    let Some(media_doc) = content.get(media) else {
        panic!("{method} {uri} {status}: content-type {content_type:?} is not documented");
    };
    if media == "application/json" {
        let mut errors = Vec::new();
        conforms(doc, &media_doc["schema"], &res.json, "$", &mut errors);
        assert!(
            errors.is_empty(),
            "{method} {uri} {status} does not fit its schema: {errors:?}\n{res:?}"
        );
    }
}

fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let name = r.trim_start_matches("#/components/schemas/");
            &doc["components"]["schemas"][name]
        }
        None => schema,
    }
}

fn type_ok(ty: &str, v: &Value) -> bool {
    match ty {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "string" => v.is_string(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        _ => true,
    }
}

/// A small JSON-schema check: `$ref`, `type` (one or a list), `enum`,
/// `properties`, `required`, `additionalProperties: false`, `items`,
/// `oneOf` (enums of strings). Enough for the shapes the API answers with.
fn conforms(doc: &Value, schema: &Value, v: &Value, at: &str, errors: &mut Vec<String>) {
    let schema = resolve(doc, schema);
    if let Some(one_of) = schema.get("oneOf").and_then(Value::as_array) {
        let fits = one_of.iter().any(|s| {
            let mut e = Vec::new();
            conforms(doc, s, v, at, &mut e);
            e.is_empty()
        });
        if !fits {
            errors.push(format!("{at}: fits no oneOf branch: {v}"));
        }
        return;
    }
    match schema.get("type") {
        Some(Value::String(t)) if !type_ok(t, v) => {
            errors.push(format!("{at}: {v} is not {t}"));
            return;
        }
        Some(Value::Array(ts)) if !ts.iter().any(|t| type_ok(t.as_str().unwrap_or(""), v)) => {
            errors.push(format!("{at}: {v} is none of {ts:?}"));
            return;
        }
        _ => {}
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        if !values.contains(v) {
            errors.push(format!("{at}: {v} is not one of {values:?}"));
        }
    }
    if let (Some(obj), Some(props)) = (
        v.as_object(),
        schema.get("properties").and_then(Value::as_object),
    ) {
        for name in schema["required"].as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or_default();
            if !obj.contains_key(name) {
                errors.push(format!("{at}: required {name:?} is missing"));
            }
        }
        for (k, val) in obj {
            match props.get(k) {
                Some(s) => conforms(doc, s, val, &format!("{at}.{k}"), errors),
                None if schema.get("additionalProperties") == Some(&Value::Bool(false))
                    || !props.is_empty() =>
                {
                    // Our answers document every property they have.
                    errors.push(format!("{at}: undocumented property {k:?}"));
                }
                None => {}
            }
        }
    }
    if let (Some(items), Some(arr)) = (schema.get("items"), v.as_array()) {
        for (i, item) in arr.iter().enumerate() {
            conforms(doc, items, item, &format!("{at}[{i}]"), errors);
        }
    }
}
