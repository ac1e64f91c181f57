//! Invariant 6: bad input gets a clear error and loses nothing.
//!
//! Every case is sent to a store that already holds a handler, events,
//! pending deliveries and dead letters; each must answer with its status and
//! the JSON error shape with its code and a message naming the wrong value,
//! and leave `store.counts()` and the handler list as they were.

mod common;

use axum::http::{Method, StatusCode};
use base64::Engine as _;
use common::TestApp;
use serde_json::{json, Value};

struct Case {
    name: &'static str,
    method: Method,
    path: String,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
    /// Text the message must contain (the wrong value or its place).
    mentions: String,
}

fn case(
    name: &'static str,
    method: Method,
    path: &str,
    body: Value,
    status: u16,
    code: &'static str,
    mentions: &str,
) -> Case {
    let body = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    let content_type = if body.is_empty() {
        None
    } else {
        Some("application/json")
    };
    Case {
        name,
        method,
        path: path.into(),
        content_type,
        body,
        status,
        code,
        mentions: mentions.into(),
    }
}

fn publish(
    name: &'static str,
    body: Value,
    status: u16,
    code: &'static str,
    mentions: &str,
) -> Case {
    case(
        name,
        Method::POST,
        "/v1/events",
        body,
        status,
        code,
        mentions,
    )
}

fn raw(
    name: &'static str,
    path: &str,
    content_type: Option<&'static str>,
    body: &[u8],
    status: u16,
    code: &'static str,
    mentions: &str,
) -> Case {
    Case {
        name,
        method: Method::POST,
        path: path.into(),
        content_type,
        body: body.to_vec(),
        status,
        code,
        mentions: mentions.into(),
    }
}

fn handler(
    name: &'static str,
    patch: Value,
    status: u16,
    code: &'static str,
    mentions: &str,
) -> Case {
    let mut body =
        json!({"name": "hooks", "url": "https://example.com/hook", "event_types": ["issues.*"]});
    for (k, v) in patch.as_object().expect("patch is an object") {
        if v.is_null() {
            body.as_object_mut().expect("object").remove(k);
        } else {
            body[k] = v.clone();
        }
    }
    case(
        name,
        Method::POST,
        "/v1/handlers",
        body,
        status,
        code,
        mentions,
    )
}

fn ev(t: &str) -> Value {
    json!({"type": t, "payload": {"n": 1}})
}

fn secret_of(n: usize) -> String {
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(vec![1u8; n])
    )
}

fn cases() -> Vec<Case> {
    let big = "x".repeat(70 << 10);
    let over_payload = "y".repeat(2 << 10);
    vec![
        // publish: body-level
        raw(
            "syntax error",
            "/v1/events",
            Some("application/json"),
            br#"{"events":["#,
            400,
            "invalid_json",
            "invalid json",
        ),
        raw(
            "array instead of object",
            "/v1/events",
            Some("application/json"),
            br#"[[{"type":"a","payload":{}}]]"#,
            422,
            "invalid_body",
            "JSON object",
        ),
        raw(
            "no content type",
            "/v1/events",
            None,
            br#"{"events":[]}"#,
            415,
            "unsupported_media_type",
            "missing",
        ),
        raw(
            "text content type",
            "/v1/events",
            Some("text/plain"),
            br#"{"events":[]}"#,
            415,
            "unsupported_media_type",
            "text/plain",
        ),
        publish(
            "body over max_body_bytes",
            json!({"events": [{"type": "a", "payload": big}]}),
            413,
            "body_too_large",
            "65536",
        ),
        publish(
            "payload over max_payload_bytes",
            json!({"events": [ev("a"), {"type": "a", "payload": over_payload}]}),
            413,
            "payload_too_large",
            "events[1]",
        ),
        publish(
            "batch over max_batch",
            json!({"events": vec![ev("a"); 11]}),
            422,
            "batch_too_large",
            "11",
        ),
        publish(
            "empty batch",
            json!({"events": []}),
            422,
            "empty_batch",
            "events",
        ),
        publish(
            "unknown top-level field",
            json!({"events": [ev("a")], "colour": 1}),
            422,
            "invalid_body",
            "colour",
        ),
        publish(
            "unknown event field",
            json!({"events": [{"type": "a", "payload": 1, "colour": 2}]}),
            422,
            "invalid_body",
            "events[0]",
        ),
        publish(
            "unknown event field named",
            json!({"events": [{"type": "a", "payload": 1, "colour": 2}]}),
            422,
            "invalid_body",
            "colour",
        ),
        publish(
            "missing type",
            json!({"events": [{"payload": 1}]}),
            422,
            "invalid_body",
            "type",
        ),
        publish(
            "missing payload",
            json!({"events": [{"type": "a"}]}),
            422,
            "invalid_body",
            "payload",
        ),
        publish(
            "events not an array",
            json!({"events": {"type": "a"}}),
            422,
            "invalid_body",
            "events",
        ),
        publish(
            "body not an object",
            json!([ev("a")]),
            422,
            "invalid_body",
            "must be a JSON object",
        ),
        publish(
            "id with a space",
            json!({"events": [{"id": "has space", "type": "a", "payload": 1}]}),
            422,
            "invalid_event",
            "has space",
        ),
        publish(
            "id too long",
            json!({"events": [{"id": "i".repeat(129), "type": "a", "payload": 1}]}),
            422,
            "invalid_event",
            "events[0]",
        ),
        publish(
            "empty id",
            json!({"events": [{"id": "", "type": "a", "payload": 1}]}),
            422,
            "invalid_event",
            "events[0]",
        ),
        publish(
            "bad type",
            json!({"events": [ev("a b")]}),
            422,
            "invalid_event",
            "a b",
        ),
        publish(
            "empty key",
            json!({"events": [{"type": "a", "key": "", "payload": 1}]}),
            422,
            "invalid_event",
            "key",
        ),
        publish(
            "key too long",
            json!({"events": [{"type": "a", "key": "k".repeat(257), "payload": 1}]}),
            422,
            "invalid_event",
            "257",
        ),
        publish(
            "one bad event among good ones",
            json!({"events": [ev("a.b"), {"id": "fresh-1", "type": "a", "payload": 1}, ev("bad*type")]}),
            422,
            "invalid_event",
            "events[2]",
        ),
        // handlers
        handler(
            "url does not parse",
            json!({"url": "not a url"}),
            422,
            "invalid_handler",
            "not a url",
        ),
        handler(
            "ftp url",
            json!({"url": "ftp://example.com/x"}),
            422,
            "invalid_handler",
            "ftp",
        ),
        handler(
            "file url",
            json!({"url": "file:///etc/passwd"}),
            422,
            "invalid_handler",
            "file",
        ),
        handler(
            "url without host",
            json!({"url": "http://"}),
            422,
            "invalid_handler",
            "http://",
        ),
        handler(
            "mailto url",
            json!({"url": "mailto:a@example.com"}),
            422,
            "invalid_handler",
            "mailto",
        ),
        handler(
            "bad route",
            json!({"event_types": ["issues.*", "a*b"]}),
            422,
            "invalid_handler",
            "a*b",
        ),
        handler(
            "no routes",
            json!({"event_types": []}),
            422,
            "invalid_handler",
            "event_types",
        ),
        handler(
            "max_attempts 0",
            json!({"max_attempts": 0}),
            422,
            "invalid_handler",
            "max_attempts 0",
        ),
        handler(
            "max_attempts 101",
            json!({"max_attempts": 101}),
            422,
            "invalid_handler",
            "max_attempts 101",
        ),
        handler(
            "max_attempts negative",
            json!({"max_attempts": -1}),
            422,
            "invalid_body",
            "max_attempts",
        ),
        handler(
            "timeout_ms 99",
            json!({"timeout_ms": 99}),
            422,
            "invalid_handler",
            "timeout_ms 99",
        ),
        handler(
            "timeout_ms 300001",
            json!({"timeout_ms": 300_001}),
            422,
            "invalid_handler",
            "timeout_ms 300001",
        ),
        handler(
            "max_in_flight 0",
            json!({"max_in_flight": 0}),
            422,
            "invalid_handler",
            "max_in_flight 0",
        ),
        handler(
            "max_in_flight 10001",
            json!({"max_in_flight": 10_001}),
            422,
            "invalid_handler",
            "max_in_flight 10001",
        ),
        handler(
            "empty name",
            json!({"name": ""}),
            422,
            "invalid_handler",
            "name",
        ),
        handler(
            "name of 129 characters",
            json!({"name": "é".repeat(129)}),
            422,
            "invalid_handler",
            "129",
        ),
        handler(
            "name with a newline",
            json!({"name": "a\nb"}),
            422,
            "invalid_handler",
            "control",
        ),
        handler(
            "secret without prefix",
            json!({"secret": "abc"}),
            422,
            "invalid_handler",
            "whsec_",
        ),
        handler(
            "secret not base64",
            json!({"secret": "whsec_!!!!"}),
            422,
            "invalid_handler",
            "base64",
        ),
        handler(
            "secret of 23 bytes",
            json!({"secret": secret_of(23)}),
            422,
            "invalid_handler",
            "23 bytes",
        ),
        handler(
            "secret of 65 bytes",
            json!({"secret": secret_of(65)}),
            422,
            "invalid_handler",
            "65 bytes",
        ),
        handler(
            "unknown handler field",
            json!({"retries": 3}),
            422,
            "invalid_body",
            "retries",
        ),
        handler(
            "missing url",
            json!({"url": null}),
            422,
            "invalid_body",
            "url",
        ),
        raw(
            "handler syntax error",
            "/v1/handlers",
            Some("application/json"),
            b"{name",
            400,
            "invalid_json",
            "invalid json",
        ),
        case(
            "get unknown handler",
            Method::GET,
            "/v1/handlers/hdl_nope",
            Value::Null,
            404,
            "not_found",
            "hdl_nope",
        ),
        case(
            "delete unknown handler",
            Method::DELETE,
            "/v1/handlers/hdl_nope",
            Value::Null,
            404,
            "not_found",
            "hdl_nope",
        ),
        // dead letters
        case(
            "replay unknown dead letter",
            Method::POST,
            "/admin/dead-letters/999999/replay",
            Value::Null,
            404,
            "not_found",
            "999999",
        ),
        case(
            "replay non-numeric id",
            Method::POST,
            "/admin/dead-letters/abc/replay",
            Value::Null,
            400,
            "invalid_parameter",
            "abc",
        ),
        case(
            "list with bad limit",
            Method::GET,
            "/admin/dead-letters?limit=abc",
            Value::Null,
            400,
            "invalid_parameter",
            "limit",
        ),
        case(
            "list with limit 0",
            Method::GET,
            "/admin/dead-letters?limit=0",
            Value::Null,
            400,
            "invalid_parameter",
            "limit 0",
        ),
        case(
            "list with unknown parameter",
            Method::GET,
            "/admin/dead-letters?colour=red",
            Value::Null,
            400,
            "invalid_parameter",
            "colour",
        ),
        case(
            "list for unknown handler",
            Method::GET,
            "/admin/dead-letters?handler_id=hdl_nope",
            Value::Null,
            404,
            "not_found",
            "hdl_nope",
        ),
        case(
            "bulk replay of nothing",
            Method::POST,
            "/admin/dead-letters/replay",
            json!({}),
            422,
            "invalid_input",
            "handler_id",
        ),
        case(
            "bulk replay for unknown handler",
            Method::POST,
            "/admin/dead-letters/replay",
            json!({"handler_id": "hdl_nope"}),
            404,
            "not_found",
            "hdl_nope",
        ),
        case(
            "bulk replay unknown field",
            Method::POST,
            "/admin/dead-letters/replay",
            json!({"idz": [1]}),
            422,
            "invalid_body",
            "idz",
        ),
        case(
            "join with id 0",
            Method::POST,
            "/admin/cluster/join",
            json!({"id": 0, "raft_addr": "127.0.0.1:7001", "http_addr": "127.0.0.1:8001"}),
            422,
            "invalid_input",
            "got 0",
        ),
        case(
            "join with a host name that is not a DNS name as raft address",
            Method::POST,
            "/admin/cluster/join",
            json!({"id": 4, "raft_addr": "node_4:7001", "http_addr": "127.0.0.1:8001"}),
            422,
            "invalid_input",
            "raft_addr \"node_4:7001\"",
        ),
        case(
            "query parameter on handlers",
            Method::GET,
            "/v1/handlers?limit=10",
            Value::Null,
            400,
            "invalid_parameter",
            "\"limit\"",
        ),
        case(
            "query parameter on a publish",
            Method::POST,
            "/v1/events?wait=true",
            json!({"events": [ev("a.b")]}),
            400,
            "invalid_parameter",
            "\"wait\"",
        ),
        case(
            "join with an unspecified address",
            Method::POST,
            "/admin/cluster/join",
            json!({"id": 4, "raft_addr": "127.0.0.1:7001", "http_addr": "0.0.0.0:8001"}),
            422,
            "invalid_input",
            "http_addr \"0.0.0.0:8001\" is an unspecified address",
        ),
        case(
            "join with an address that is neither IP:PORT nor HOST:PORT",
            Method::POST,
            "/admin/cluster/join",
            json!({"id": 4, "raft_addr": "http://node-4:7001", "http_addr": "node-4:8001"}),
            422,
            "invalid_input",
            "raft_addr \"http://node-4:7001\" must be IP:PORT or HOST:PORT",
        ),
        // routing
        case(
            "unknown path",
            Method::GET,
            "/v2/nothing",
            Value::Null,
            404,
            "path_not_found",
            "/v2/nothing",
        ),
        case(
            "wrong method on events",
            Method::PUT,
            "/v1/events",
            Value::Null,
            405,
            "method_not_allowed",
            "PUT",
        ),
        case(
            "wrong method on handlers",
            Method::DELETE,
            "/v1/handlers",
            Value::Null,
            405,
            "method_not_allowed",
            "/v1/handlers",
        ),
    ]
}

/// Seeds a handler, events with pending deliveries, and dead letters.
async fn seed(app: &TestApp) {
    app.create_handler("seed", &["*"]).await;
    let res = app
        .post("/v1/events", json!({"events": [{"id": "seed-1", "type": "a.b", "key": "k", "payload": 1}, ev("a.c")]}))
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(app.make_dead_letters("dl.x", "dl-key", 2).await, 2);
}

async fn every_bad_input_is_refused_and_harms_nothing(app: TestApp) {
    seed(&app).await;
    let before = app.snapshot().await;
    let changed_before = app
        .node
        .handlers_changed
        .load(std::sync::atomic::Ordering::SeqCst);
    let published_before = app.node.published.lock().expect("lock").len();
    let mut failures = Vec::new();
    for c in cases() {
        let res = app
            .call(c.method.clone(), &c.path, c.content_type, c.body)
            .await;
        let err = &res.json["error"];
        let ok_shape = res
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            == Some("application/json")
            && err["code"].is_string()
            && err["message"].is_string()
            && res.json.as_object().map(|o| o.len()) == Some(1);
        let message = err["message"].as_str().unwrap_or_default();
        if std::env::var_os("SHOW_ERRORS").is_some() {
            eprintln!("{:<34} {res:?}", c.name);
        }
        if res.status.as_u16() != c.status
            || err["code"] != c.code
            || !ok_shape
            || !message.contains(&c.mentions)
        {
            failures.push(format!(
                "{}: expected {} {} mentioning {:?}, got {res:?}",
                c.name, c.status, c.code, c.mentions
            ));
        }
        if message.chars().next().is_some_and(char::is_uppercase) {
            failures.push(format!("{}: message is not lowercase: {message}", c.name));
        }
        let after = app.snapshot().await;
        if after != before {
            failures.push(format!(
                "{}: store changed: {before:?} -> {after:?}",
                c.name
            ));
        }
    }
    assert_eq!(
        app.node
            .handlers_changed
            .load(std::sync::atomic::Ordering::SeqCst),
        changed_before
    );
    assert_eq!(
        app.node.published.lock().expect("lock").len(),
        published_before
    );
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

async fn method_not_allowed_names_the_allowed_methods(app: TestApp) {
    let res = app
        .call(Method::PUT, "/v1/handlers/hdl_x", None, Vec::new())
        .await;
    assert_eq!(res.status, StatusCode::METHOD_NOT_ALLOWED, "{res:?}");
    let allow = res
        .headers
        .get("allow")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        allow.contains("GET") && allow.contains("DELETE") && allow.contains("PATCH"),
        "allow: {allow:?}"
    );
}

on_every_backend!(
    every_bad_input_is_refused_and_harms_nothing,
    method_not_allowed_names_the_allowed_methods
);
