//! One rulebook: the API and the store cannot disagree.
//!
//! One table of inputs (events, handler registrations, handler changes),
//! each with one expected verdict: accepted, or refused naming a field.
//! Every case is fed through the store's rules directly
//! (`lanebus_store::rules`), through the store as an embedded caller uses
//! it (`Store::publish`, `create_handler`, `update_handler`), and through
//! the HTTP API, and must get the same verdict from all three. The table
//! holds each bound's both sides, the unified ones included (`max_attempts`
//! 1 to 100, `timeout_ms` 100 to 300,000, `max_in_flight` 1 to 10,000, 1
//! to 100 routes, names of 1 to 128 characters, 1,000 events, 1 MiB
//! payloads), where the store used to accept what the API refused.

mod common;

use axum::http::{Method, StatusCode};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use common::{Backend, StubNode, TestApp};
use lanebus_api::Limits;
use lanebus_store::filter::{Condition, Test};
use lanebus_store::rules::{self, Broken, Rule};
use lanebus_store::{
    handler_defaults, Filter, HandlerPatch, NewEvent, NewHandler, RateLimit, StoreError,
};
use serde_json::{json, Value};

/// What a case feeds in.
enum Input {
    /// A publish of these events (`{"events": [...]}`).
    Events(Vec<Value>),
    /// A registration (`POST /v1/handlers`).
    Handler(Value),
    /// A change of a registered handler (`PATCH /v1/handlers/{id}`).
    Patch(Value),
}

struct Case {
    name: String,
    input: Input,
    /// `None`: accepted; `Some(field)`: refused, naming `field` as the
    /// store's rules spell it.
    refused: Option<&'static str>,
}

fn ok(name: &str, input: Input) -> Case {
    Case {
        name: name.into(),
        input,
        refused: None,
    }
}

fn bad(name: &str, input: Input, field: &'static str) -> Case {
    Case {
        name: name.into(),
        input,
        refused: Some(field),
    }
}

const URL: &str = "http://127.0.0.1:9/hook";

fn event(extra: Value) -> Input {
    let mut e = json!({"type": "a.b", "payload": {"n": 1}});
    merge(&mut e, extra);
    Input::Events(vec![e])
}

fn handler(extra: Value) -> Input {
    let mut h = json!({"name": "n", "url": URL, "event_types": ["*"]});
    merge(&mut h, extra);
    Input::Handler(h)
}

fn merge(into: &mut Value, extra: Value) {
    for (k, v) in extra.as_object().expect("object").clone() {
        into[k] = v;
    }
}

fn secret(bytes: usize) -> String {
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(vec![7u8; bytes])
    )
}

/// `[[...[1]...]]`, `depth` arrays deep (built, not parsed: serde_json
/// parses at most 128 levels).
fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |v, _| json!([v]))
}

fn cases() -> Vec<Case> {
    let in_days = |d: i64| (Utc::now() + chrono::TimeDelta::days(d)).to_rfc3339();
    // A JSON string payload of exactly `n` bytes, quotes included.
    let payload_of = |n: usize| Value::String("x".repeat(n - 2));
    let routes = |n: usize| Value::from((0..n).map(|i| format!("t{i}")).collect::<Vec<_>>());
    let url_of = |n: usize| format!("{URL}?{}", "q".repeat(n - URL.len() - 1));
    let mut v = vec![
        // Events.
        ok("plain event", event(json!({}))),
        ok("id of 128", event(json!({"id": "i".repeat(128)}))),
        bad(
            "id of 129",
            event(json!({"id": "i".repeat(129)})),
            "events[0].id",
        ),
        bad("empty id", event(json!({"id": ""})), "events[0].id"),
        bad(
            "id with a space",
            event(json!({"id": "a b"})),
            "events[0].id",
        ),
        ok("type of 128", event(json!({"type": "t".repeat(128)}))),
        bad(
            "type of 129",
            event(json!({"type": "t".repeat(129)})),
            "events[0].type",
        ),
        bad(
            "type with a star",
            event(json!({"type": "a*"})),
            "events[0].type",
        ),
        bad("empty type", event(json!({"type": ""})), "events[0].type"),
        bad(
            "type reserved for operational events",
            event(json!({"type": "lanebus.handler.disabled"})),
            "events[0].type",
        ),
        ok(
            "type near the reserved prefix",
            event(json!({"type": "lanebusx.a"})),
        ),
        ok("key of 256", event(json!({"key": "k".repeat(256)}))),
        bad(
            "key of 257",
            event(json!({"key": "k".repeat(257)})),
            "events[0].key",
        ),
        bad("empty key", event(json!({"key": ""})), "events[0].key"),
        bad(
            "key with a newline",
            event(json!({"key": "a\nb"})),
            "events[0].key",
        ),
        ok("payload nested 128", event(json!({"payload": nested(128)}))),
        bad(
            "payload nested 129",
            event(json!({"payload": nested(129)})),
            "events[0].payload",
        ),
        ok(
            "payload of 1 MiB",
            event(json!({"payload": payload_of(1 << 20)})),
        ),
        bad(
            "payload of 1 MiB + 1",
            event(json!({"payload": payload_of((1 << 20) + 1)})),
            "events[0].payload",
        ),
        ok(
            "deliver_at in 6 days",
            event(json!({"deliver_at": in_days(6)})),
        ),
        bad(
            "deliver_at in 8 days",
            event(json!({"deliver_at": in_days(8)})),
            "events[0].deliver_at",
        ),
        // Accepted ones would conflict when the same case is published a
        // second time (store, then HTTP): the store's conformance suite and
        // the happy path test them.
        bad(
            "expected_seq without a key",
            event(json!({"expected_seq": 0})),
            "events[0].expected_seq",
        ),
        bad(
            "expected_seq -1",
            event(json!({"key": "k", "expected_seq": -1})),
            "events[0].expected_seq",
        ),
        ok(
            "1,000 events",
            Input::Events(vec![json!({"type": "a", "payload": 1}); 1_000]),
        ),
        bad(
            "1,001 events",
            Input::Events(vec![json!({"type": "a", "payload": 1}); 1_001]),
            "events",
        ),
        bad(
            "second event bad",
            Input::Events(vec![
                json!({"type": "a", "payload": 1}),
                json!({"type": "a", "key": "", "payload": 1}),
            ]),
            "events[1].key",
        ),
        // Handler registrations.
        ok("plain handler", handler(json!({}))),
        ok(
            "name of 128 characters",
            handler(json!({"name": "é".repeat(128)})),
        ),
        bad(
            "name of 129 characters",
            handler(json!({"name": "é".repeat(129)})),
            "name",
        ),
        bad("empty name", handler(json!({"name": ""})), "name"),
        bad("blank name", handler(json!({"name": "   "})), "name"),
        bad(
            "name with a bell",
            handler(json!({"name": "a\u{7}"})),
            "name",
        ),
        ok("url of 2,048 bytes", handler(json!({"url": url_of(2_048)}))),
        bad(
            "url of 2,049 bytes",
            handler(json!({"url": url_of(2_049)})),
            "url",
        ),
        bad(
            "ftp url",
            handler(json!({"url": "ftp://127.0.0.1/x"})),
            "url",
        ),
        bad(
            "uppercase scheme",
            handler(json!({"url": "HTTP://127.0.0.1/x"})),
            "url",
        ),
        bad(
            "url without slashes",
            handler(json!({"url": "http:127.0.0.1/x"})),
            "url",
        ),
        bad(
            "url with credentials",
            handler(json!({"url": "http://u:p@127.0.0.1/x"})),
            "url",
        ),
        bad(
            "url with a space",
            handler(json!({"url": "http://127.0.0.1/a b"})),
            "url",
        ),
        bad(
            "no routes",
            handler(json!({"event_types": []})),
            "event_types",
        ),
        ok("100 routes", handler(json!({"event_types": routes(100)}))),
        bad(
            "101 routes",
            handler(json!({"event_types": routes(101)})),
            "event_types",
        ),
        bad(
            "bad route",
            handler(json!({"event_types": ["*", "a*b"]})),
            "event_types[1]",
        ),
        bad(
            "max_attempts 0",
            handler(json!({"max_attempts": 0})),
            "max_attempts",
        ),
        ok("max_attempts 1", handler(json!({"max_attempts": 1}))),
        ok("max_attempts 100", handler(json!({"max_attempts": 100}))),
        bad(
            "max_attempts 101",
            handler(json!({"max_attempts": 101})),
            "max_attempts",
        ),
        bad(
            "max_attempts 1,000",
            handler(json!({"max_attempts": 1_000})),
            "max_attempts",
        ),
        bad(
            "timeout_ms 1",
            handler(json!({"timeout_ms": 1})),
            "timeout_ms",
        ),
        bad(
            "timeout_ms 99",
            handler(json!({"timeout_ms": 99})),
            "timeout_ms",
        ),
        ok("timeout_ms 100", handler(json!({"timeout_ms": 100}))),
        ok(
            "timeout_ms 300,000",
            handler(json!({"timeout_ms": 300_000})),
        ),
        bad(
            "timeout_ms 300,001",
            handler(json!({"timeout_ms": 300_001})),
            "timeout_ms",
        ),
        bad(
            "timeout_ms 1 hour",
            handler(json!({"timeout_ms": 3_600_000})),
            "timeout_ms",
        ),
        bad(
            "max_in_flight 0",
            handler(json!({"max_in_flight": 0})),
            "max_in_flight",
        ),
        ok(
            "max_in_flight 10,000",
            handler(json!({"max_in_flight": 10_000})),
        ),
        bad(
            "max_in_flight 10,001",
            handler(json!({"max_in_flight": 10_001})),
            "max_in_flight",
        ),
        ok("secret of 24 bytes", handler(json!({"secret": secret(24)}))),
        ok("secret of 64 bytes", handler(json!({"secret": secret(64)}))),
        bad(
            "secret of 23 bytes",
            handler(json!({"secret": secret(23)})),
            "secret",
        ),
        bad(
            "secret of 65 bytes",
            handler(json!({"secret": secret(65)})),
            "secret",
        ),
        bad(
            "secret without prefix",
            handler(json!({"secret": "abcd"})),
            "secret",
        ),
        bad(
            "secret not base64",
            handler(json!({"secret": "whsec_!!!"})),
            "secret",
        ),
        ok(
            "rate limit at its bounds",
            handler(json!({"rate_limit": {"per_second": 1, "burst": 100_000}})),
        ),
        bad(
            "rate per_second 0",
            handler(json!({"rate_limit": {"per_second": 0}})),
            "rate_limit.per_second",
        ),
        bad(
            "rate burst 100,001",
            handler(json!({"rate_limit": {"per_second": 5, "burst": 100_001}})),
            "rate_limit.burst",
        ),
        // Handler changes.
        ok("rename", Input::Patch(json!({"name": "other"}))),
        ok(
            "remove the rate limit",
            Input::Patch(json!({"rate_limit": null})),
        ),
        bad(
            "patch max_attempts 101",
            Input::Patch(json!({"max_attempts": 101})),
            "max_attempts",
        ),
        ok(
            "patch max_attempts 100",
            Input::Patch(json!({"max_attempts": 100})),
        ),
        bad(
            "patch timeout_ms 99",
            Input::Patch(json!({"timeout_ms": 99})),
            "timeout_ms",
        ),
        bad(
            "patch max_in_flight 10,001",
            Input::Patch(json!({"max_in_flight": 10_001})),
            "max_in_flight",
        ),
        bad(
            "patch ftp url",
            Input::Patch(json!({"url": "ftp://127.0.0.1/"})),
            "url",
        ),
        bad(
            "patch blank name",
            Input::Patch(json!({"name": " "})),
            "name",
        ),
        bad(
            "patch bad route",
            Input::Patch(json!({"event_types": ["a*b"]})),
            "event_types[0]",
        ),
        bad(
            "patch 101 routes",
            Input::Patch(json!({"event_types": routes(101)})),
            "event_types",
        ),
        bad(
            "patch rate burst 0",
            Input::Patch(json!({"rate_limit": {"per_second": 1, "burst": 0}})),
            "rate_limit.burst",
        ),
        // Payload filters (their shape errors never reach an embedded
        // store, which takes a typed filter: api tests handler_controls).
        ok(
            "filter at its bounds",
            handler(json!({"filter": {"or": [
                {"path": "/c", "in": values(100)},
                {"path": format!("/{}", "p".repeat(255)), "exists": true},
                nested_filter(8)
            ]}})),
        ),
        bad(
            "filter 9 levels deep",
            handler(json!({"filter": nested_filter(10)})),
            "filter.not.not.not.not.not.not.not.not.not",
        ),
        bad(
            "filter in of 101",
            handler(json!({"filter": {"path": "/c", "in": values(101)}})),
            "filter.in",
        ),
        bad(
            "filter in of 0",
            handler(json!({"filter": {"path": "/c", "in": []}})),
            "filter.in",
        ),
        bad(
            "filter empty and",
            handler(json!({"filter": {"and": []}})),
            "filter.and",
        ),
        bad(
            "filter 33 conditions",
            handler(json!({"filter": {"or": (0..33)
                .map(|i| json!({"path": format!("/{i}"), "exists": true}))
                .collect::<Vec<_>>()}})),
            "filter",
        ),
        bad(
            "filter of 8,193 bytes",
            handler(json!({"filter": {"path": "/c", "equals": "x".repeat(8_170)}})),
            "filter",
        ),
        bad(
            "filter path of 257",
            handler(json!({"filter": {"path": format!("/{}", "p".repeat(256)), "exists": true}})),
            "filter.path",
        ),
        bad(
            "filter path without a slash",
            handler(json!({"filter": {"path": "c", "exists": true}})),
            "filter.path",
        ),
        bad(
            "filter equals an object",
            handler(json!({"filter": {"path": "/c", "equals": {"a": 1}}})),
            "filter.equals",
        ),
        ok(
            "patch filter",
            Input::Patch(json!({"filter": {"path": "/c", "gte": 1.5}})),
        ),
        ok("remove the filter", Input::Patch(json!({"filter": null}))),
        bad(
            "patch filter in of 101",
            Input::Patch(json!({"filter": {"not": {"path": "/c", "in": values(101)}}})),
            "filter.not.in",
        ),
    ];
    // Names must be unique: failures are reported by name.
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v.dedup_by(|a, b| a.name == b.name);
    v
}

/// `n` distinct values of an `in` list.
fn values(n: usize) -> Vec<Value> {
    (0..n).map(|i| json!(i)).collect()
}

/// A condition inside `n - 1` nots (`n - 1` levels of and/or/not).
fn nested_filter(n: usize) -> Value {
    (1..n).fold(
        json!({"path": "/c", "exists": false}),
        |f, _| json!({"not": f}),
    )
}

// --- The store's side: the JSON as an embedded caller would build it. ---

/// A typed filter from its JSON as an embedded caller would build it: the
/// shape only, no bound checked (that is the store's part).
fn typed_filter(v: &Value) -> Filter {
    let list = |v: &Value| {
        v.as_array()
            .expect("list")
            .iter()
            .map(typed_filter)
            .collect()
    };
    if let Some(fs) = v.get("and") {
        return Filter::And(list(fs));
    }
    if let Some(fs) = v.get("or") {
        return Filter::Or(list(fs));
    }
    if let Some(f) = v.get("not") {
        return Filter::Not(Box::new(typed_filter(f)));
    }
    let m = v.as_object().expect("condition");
    let (op, x) = m.iter().find(|(k, _)| *k != "path").expect("operator");
    let number = || x.as_number().expect("number").clone();
    let test = match op.as_str() {
        "equals" => Test::Equals(x.clone()),
        "in" => Test::In(x.as_array().expect("in").clone()),
        "exists" => Test::Exists(x.as_bool().expect("exists")),
        "gt" => Test::Gt(number()),
        "gte" => Test::Gte(number()),
        "lt" => Test::Lt(number()),
        "lte" => Test::Lte(number()),
        other => panic!("operator {other}"),
    };
    Filter::Field(Condition {
        path: m["path"].as_str().expect("path").to_owned(),
        test,
    })
}

fn new_event(v: &Value) -> NewEvent {
    NewEvent {
        id: v["id"].as_str().map(str::to_owned),
        event_type: v["type"].as_str().expect("type").to_owned(),
        key: v["key"].as_str().map(str::to_owned),
        payload: serde_json::to_vec(&v["payload"]).expect("payload"),
        deliver_at: v["deliver_at"]
            .as_str()
            .map(|t| DateTime::parse_from_rfc3339(t).expect("time").to_utc()),
        expected_seq: v["expected_seq"].as_i64(),
    }
}

fn rate_limit(v: &Value) -> RateLimit {
    let per_second = u32::try_from(v["per_second"].as_u64().expect("per_second")).expect("u32");
    RateLimit {
        per_second,
        burst: v["burst"]
            .as_u64()
            .map_or(per_second, |b| u32::try_from(b).expect("u32")),
    }
}

fn u32_of(v: &Value) -> Option<u32> {
    v.as_u64().map(|n| u32::try_from(n).expect("u32"))
}

fn strings(v: &Value) -> Option<Vec<String>> {
    v.as_array().map(|a| {
        a.iter()
            .map(|s| s.as_str().expect("string").to_owned())
            .collect()
    })
}

fn new_handler(v: &Value) -> NewHandler {
    NewHandler {
        name: v["name"].as_str().expect("name").to_owned(),
        url: v["url"].as_str().expect("url").to_owned(),
        event_types: strings(&v["event_types"]).expect("event_types"),
        max_attempts: u32_of(&v["max_attempts"]).unwrap_or(handler_defaults::MAX_ATTEMPTS),
        timeout_ms: v["timeout_ms"]
            .as_u64()
            .unwrap_or(handler_defaults::TIMEOUT_MS),
        max_in_flight: u32_of(&v["max_in_flight"]).unwrap_or(handler_defaults::MAX_IN_FLIGHT),
        secret: v["secret"].as_str().unwrap_or_default().to_owned(),
        rate_limit: v.get("rate_limit").filter(|r| !r.is_null()).map(rate_limit),
        filter: v.get("filter").filter(|f| !f.is_null()).map(typed_filter),
    }
}

fn patch(v: &Value) -> HandlerPatch {
    HandlerPatch {
        name: v["name"].as_str().map(str::to_owned),
        url: v["url"].as_str().map(str::to_owned),
        event_types: strings(&v["event_types"]),
        max_attempts: u32_of(&v["max_attempts"]),
        timeout_ms: v["timeout_ms"].as_u64(),
        max_in_flight: u32_of(&v["max_in_flight"]),
        rate_limit: v
            .get("rate_limit")
            .map(|r| (!r.is_null()).then(|| rate_limit(r))),
        filter: v
            .get("filter")
            .map(|f| (!f.is_null()).then(|| typed_filter(f))),
    }
}

/// The verdict of the store's rules, as the field refused.
fn rules_verdict(input: &Input) -> Result<(), Broken> {
    match input {
        Input::Events(events) => {
            let events: Vec<NewEvent> = events.iter().map(new_event).collect();
            rules::event::batch(&events, Utc::now())
        }
        Input::Handler(v) => rules::handler::check(&new_handler(v)),
        Input::Patch(v) => rules::handler::check_patch(&patch(v)),
    }
}

/// The verdict of the store as an embedded caller meets it: `Ok`, or the
/// message of its `Invalid` error.
async fn store_verdict(app: &TestApp, target: &str, input: &Input) -> Result<(), String> {
    let outcome = match input {
        Input::Events(events) => app
            .store
            .publish(events.iter().map(new_event).collect())
            .await
            .map(drop),
        Input::Handler(v) => app.store.create_handler(new_handler(v)).await.map(drop),
        Input::Patch(v) => app.store.update_handler(target, &patch(v)).await.map(drop),
    };
    match outcome {
        Ok(()) => Ok(()),
        Err(StoreError::Invalid(m)) => Err(m),
        Err(other) => panic!("the store failed otherwise: {other}"),
    }
}

/// The verdict of the HTTP API: `Ok` for 2xx, else status, code, message.
async fn http_verdict(
    app: &TestApp,
    target: &str,
    input: &Input,
) -> Result<(), (StatusCode, String, String)> {
    let res = match input {
        Input::Events(events) => app.post("/v1/events", json!({"events": events})).await,
        Input::Handler(v) => app.post("/v1/handlers", v.clone()).await,
        Input::Patch(v) => {
            app.call(
                Method::PATCH,
                &format!("/v1/handlers/{target}"),
                Some("application/json"),
                v.to_string().into_bytes(),
            )
            .await
        }
    };
    if res.status.is_success() {
        return Ok(());
    }
    let err = &res.json["error"];
    Err((
        res.status,
        err["code"].as_str().unwrap_or_default().to_owned(),
        err["message"].as_str().unwrap_or_default().to_owned(),
    ))
}

/// The status and code the API answers a refusal of `field` with (its
/// contract, unchanged by the rulebook).
fn http_refusal(field: &str, rule: Rule) -> (StatusCode, &'static str) {
    if field == "events" {
        (StatusCode::UNPROCESSABLE_ENTITY, "batch_too_large")
    } else if field.starts_with("events[") && rule == Rule::Size {
        (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large")
    } else if field.starts_with("events[") {
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid_event")
    } else {
        (StatusCode::UNPROCESSABLE_ENTITY, "invalid_handler")
    }
}

/// A message without what depends on the moment it was made (the latest
/// allowed `deliver_at`).
fn core(message: &str) -> &str {
    message.split(" (latest ").next().unwrap_or(message)
}

async fn the_api_and_the_store_judge_alike(app: TestApp) {
    let target = app.create_handler("target", &["*"]).await;
    let mut failures = Vec::new();
    let cases = cases();
    for c in &cases {
        let mut fail = |m: String| failures.push(format!("{}: {m}", c.name));
        let rules = rules_verdict(&c.input);
        match (&rules, c.refused) {
            (Ok(()), None) => {}
            (Err(b), Some(field)) if b.field == field => {}
            (got, want) => fail(format!("rules: expected refusal of {want:?}, got {got:?}")),
        }
        let store = store_verdict(&app, &target, &c.input).await;
        match (&store, &rules) {
            (Ok(()), Ok(())) => {}
            (Err(m), Err(b)) if core(m) == core(&b.message) => {}
            (got, want) => fail(format!("embedded store: {got:?}, the rules: {want:?}")),
        }
        let http = http_verdict(&app, &target, &c.input).await;
        match (&http, &rules) {
            (Ok(()), Ok(())) => {}
            (Err((status, code, message)), Err(b))
                if (*status, code.as_str()) == http_refusal(&b.field, b.rule)
                    && core(message) == core(&b.message) => {}
            (got, want) => fail(format!("http: {got:?}, the rules: {want:?}")),
        }
    }
    assert!(cases.len() > 60, "the table lost cases: {}", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases disagree:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// The node's limits as they ship (the harness's own are smaller), so the
/// table meets the rulebook's bounds, not tighter test limits.
async fn run(backend: Backend) {
    common::run_with(
        backend,
        Limits::default(),
        StubNode::default(),
        the_api_and_the_store_judge_alike,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    run(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres() {
    run(Backend::Postgres).await;
}
