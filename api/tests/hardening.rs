//! Hardening found by review and by fuzzing (schemathesis, `scripts/fuzz-api`):
//! NUL and control characters in ids, too-long URIs, replay without a
//! selection, credentials and whitespace in handler URLs. Each case answers
//! its status with the JSON error shape and leaves the store as it was, on
//! SQLite and PostgreSQL (PostgreSQL refuses NUL in text: it used to be a 500).

mod common;

use axum::http::{Method, StatusCode};
use common::TestApp;
use lanebus_api::{ErrorCode, MAX_URI_BYTES};
use serde_json::{json, Value};

/// Asserts `res` is the JSON error shape with `status` and `code`, and
/// returns its message.
fn error_of(what: &str, res: &common::Res, status: u16, code: &str) -> String {
    assert_eq!(res.status.as_u16(), status, "{what}: {res:?}");
    assert_eq!(
        res.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/json"),
        "{what}: {res:?}"
    );
    let obj = res.json.as_object().expect("an object");
    assert_eq!(obj.len(), 1, "{what}: {res:?}");
    assert_eq!(res.json["error"]["code"], code, "{what}: {res:?}");
    assert_eq!(
        res.json["error"].as_object().map(|o| o.len()),
        Some(2),
        "{what}: {res:?}"
    );
    let message = res.json["error"]["message"]
        .as_str()
        .expect("message")
        .to_owned();
    assert!(!message.is_empty(), "{what}");
    message
}

/// A handler, pending deliveries and dead letters to protect.
async fn seed(app: &TestApp) -> String {
    let id = app.create_handler("seed", &["*"]).await;
    let res = app
        .post(
            "/v1/events",
            json!({"events": [{"type": "a.b", "key": "k", "payload": 1}]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(app.make_dead_letters("dl.x", "dl-key", 3).await, 3);
    id
}

async fn nul_and_control_characters_in_ids_are_not_found_not_500(app: TestApp) {
    seed(&app).await;
    let before = app.snapshot().await;
    let long = "h".repeat(300);
    for (method, path) in [
        (Method::GET, "/v1/handlers/a%00b".to_owned()),
        (Method::DELETE, "/v1/handlers/a%00b".to_owned()),
        (Method::GET, "/v1/handlers/hdl_%0001".to_owned()),
        (Method::GET, "/v1/handlers/a%01b".to_owned()),
        (Method::DELETE, "/v1/handlers/a%1Fb%7F".to_owned()),
        (Method::GET, format!("/v1/handlers/{long}")),
        (
            Method::GET,
            "/admin/dead-letters?handler_id=a%00b".to_owned(),
        ),
        (Method::GET, "/admin/dead-letters?handler_id=%00".to_owned()),
        (
            Method::GET,
            format!("/admin/dead-letters?handler_id={long}"),
        ),
    ] {
        let res = app.call(method.clone(), &path, None, Vec::new()).await;
        let message = error_of(&format!("{method} {path}"), &res, 404, "not_found");
        assert!(message.contains("hdl_"), "{path}: {message}");
        assert!(
            message.len() < 200,
            "{path}: message of {} bytes",
            message.len()
        );
    }
    for body in [
        json!({"handler_id": "a\u{0}b"}),
        json!({"handler_id": "\u{0}", "ids": [1]}),
        json!({"handler_id": "a\u{1}b"}),
        json!({"handler_id": long}),
    ] {
        let res = app.post("/admin/dead-letters/replay", body.clone()).await;
        error_of(&body.to_string(), &res, 404, "not_found");
    }
    // A path segment that is not UTF-8 once decoded.
    let res = app.get("/v1/handlers/%FF").await;
    error_of("%FF", &res, 400, "invalid_parameter");
    assert_eq!(app.snapshot().await, before);
}

async fn too_long_uris_are_414_json_on_every_path(app: TestApp) {
    seed(&app).await;
    let before = app.snapshot().await;
    let long = "x".repeat(MAX_URI_BYTES + 1);
    for (method, path) in [
        (Method::GET, format!("/v1/handlers/{long}")),
        (Method::DELETE, format!("/v1/handlers/{long}")),
        (
            Method::GET,
            format!("/admin/dead-letters?handler_id={long}"),
        ),
        (Method::GET, format!("/healthz?{long}")),
        (Method::POST, format!("/v1/events?{long}")),
        (Method::GET, format!("/no/such/path/{long}")),
    ] {
        let res = app.call(method.clone(), &path, None, Vec::new()).await;
        let message = error_of(
            &format!("{method} {}", &path[..30]),
            &res,
            414,
            "uri_too_long",
        );
        assert!(message.contains(&MAX_URI_BYTES.to_string()), "{message}");
    }
    // Just under the limit is read (and is an unknown handler).
    let path = format!(
        "/v1/handlers/{}",
        "y".repeat(MAX_URI_BYTES - "/v1/handlers/".len())
    );
    assert_eq!(path.len(), MAX_URI_BYTES);
    let res = app.get(&path).await;
    error_of("at the limit", &res, 404, "not_found");
    assert_eq!(app.snapshot().await, before);
}

async fn bulk_replay_needs_an_explicit_selection(app: TestApp) {
    let handler = seed(&app).await;
    let before = app.snapshot().await;
    for body in [
        json!({}),
        json!({"ids": []}),
        json!({"all": false}),
        json!({"ids": [], "all": false}),
        json!({"all": true, "handler_id": handler}),
        json!({"all": true, "ids": [1]}),
    ] {
        let res = app.post("/admin/dead-letters/replay", body.clone()).await;
        let message = error_of(&body.to_string(), &res, 422, "invalid_input");
        assert!(message.contains("all"), "{body}: {message}");
    }
    for body in [json!({"all": "yes"}), json!({"all": null, "x": 1})] {
        let res = app.post("/admin/dead-letters/replay", body.clone()).await;
        error_of(&body.to_string(), &res, 422, "invalid_body");
    }
    assert_eq!(app.snapshot().await, before);
    assert_eq!(before.0.dead_letters, 3);

    // The explicit form replays every dead letter.
    let res = app
        .post("/admin/dead-letters/replay", json!({"all": true}))
        .await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json, json!({"replayed": 3}));
    let after = app.snapshot().await;
    assert_eq!(after.0.dead_letters, 0);
    assert_eq!(after.0.deliveries, before.0.deliveries + 3);
    let res = app
        .post("/admin/dead-letters/replay", json!({"all": true}))
        .await;
    assert_eq!(res.json, json!({"replayed": 0}), "{res:?}");
}

async fn handler_urls_with_credentials_or_whitespace_are_invalid_handler(app: TestApp) {
    seed(&app).await;
    let before = app.snapshot().await;
    for url in [
        "https://user:s3cret@example.com/hook",
        "https://token@example.com/hook",
        "http://:s3cret@127.0.0.1:9000/x",
    ] {
        let res = app
            .post(
                "/v1/handlers",
                json!({"name": "n", "url": url, "event_types": ["*"]}),
            )
            .await;
        let message = error_of(url, &res, 422, "invalid_handler");
        assert!(message.contains("credentials"), "{message}");
        assert!(message.contains("logs"), "{message}");
        assert!(
            !message.contains("s3cret") && !message.contains("token"),
            "the refusal repeats the credentials: {message}"
        );
    }
    for url in [
        "http://example.com/a b",
        "http://example.com/a\tb",
        "http://example.com/a\u{0}b",
        "http://example.com/\u{7f}",
        "http://example.com/\n",
    ] {
        let res = app
            .post(
                "/v1/handlers",
                json!({"name": "n", "url": url, "event_types": ["*"]}),
            )
            .await;
        let message = error_of(&format!("{url:?}"), &res, 422, "invalid_handler");
        assert!(message.contains("url"), "{message}");
    }
    assert_eq!(app.snapshot().await, before);
    // Percent-encoded, the same URLs are fine.
    let res = app
        .post(
            "/v1/handlers",
            json!({"name": "n", "url": "http://example.com/a%20b?at=x@y", "event_types": ["*"]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
}

/// Every error code the API can answer with is in the document's `code`
/// enum, and nothing else is.
async fn documented_codes_are_exactly_the_error_codes(app: TestApp) {
    let res = app.get("/openapi.json").await;
    let doc = &res.json;
    let code_schema = &doc["components"]["schemas"]["Error"]["properties"]["error"];
    let detail = match code_schema.get("$ref").and_then(Value::as_str) {
        Some(r) => &doc["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
        None => code_schema,
    };
    let code = &detail["properties"]["code"];
    let code = match code.get("$ref").and_then(Value::as_str) {
        Some(r) => &doc["components"]["schemas"][r.trim_start_matches("#/components/schemas/")],
        None => code,
    };
    let mut listed: Vec<&str> = code["enum"]
        .as_array()
        .unwrap_or_else(|| panic!("code is not an enum: {code}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    listed.sort_unstable();
    let mut all: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    all.sort_unstable();
    assert_eq!(listed, all);
}

/// Sends `request` (raw bytes) to `addr` and reads the answer until the
/// server closes: (status, headers in lowercase, body).
async fn raw_call(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(request).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tcp.read_to_end(&mut out),
    )
    .await
    .expect("answer within 10 s")
    .ok();
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_owned())
}

/// Served through `lanebus_api::serve::listener` (as the node serves it),
/// even the answers hyper writes itself, before any router runs, have the
/// JSON error shape: a request line over hyper's 65,534-byte URI limit, and
/// a request that does not parse. Ordinary traffic passes unchanged.
async fn answers_of_the_http_server_itself_are_json_too(app: TestApp) {
    seed(&app).await;
    let before = app.snapshot().await;
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = tcp.local_addr().expect("addr");
    let app_router = app.app.clone();
    let server = tokio::spawn(async move {
        let _ = axum::serve(lanebus_api::serve::listener(tcp), app_router).await;
    });

    let huge = format!(
        "GET /v1/handlers/{} HTTP/1.1\r\nhost: x\r\n\r\n",
        "z".repeat(70_000)
    );
    let (status, head, body) = raw_call(addr, huge.as_bytes()).await;
    assert_eq!(status, 414, "{head}");
    assert!(head.contains("content-type: application/json"), "{head}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    assert_eq!(v["error"]["code"], "uri_too_long", "{body}");

    let (status, head, body) = raw_call(
        addr,
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",
    )
    .await;
    assert_eq!(status, 400, "{head}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    assert_eq!(v["error"]["code"], "bad_request", "{body}");

    // Keep-alive traffic, an error answer of the router included, unchanged.
    let (status, head, body) = raw_call(
        addr,
        b"GET /v1/handlers/hdl_x HTTP/1.1\r\nhost: x\r\n\r\nGET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 404, "{head}");
    assert!(body.contains(r#""code":"not_found""#), "{body}");
    assert!(body.contains("HTTP/1.1 200 OK"), "{body}");
    assert!(body.ends_with(r#"{"status":"ok"}"#), "{body}");
    server.abort();
    assert_eq!(app.snapshot().await, before);
}

on_every_backend!(
    answers_of_the_http_server_itself_are_json_too,
    nul_and_control_characters_in_ids_are_not_found_not_500,
    too_long_uris_are_414_json_on_every_path,
    bulk_replay_needs_an_explicit_selection,
    handler_urls_with_credentials_or_whitespace_are_invalid_handler,
    documented_codes_are_exactly_the_error_codes,
);
