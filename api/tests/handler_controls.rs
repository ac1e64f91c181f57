//! Handler controls through the API (issue #4): `PATCH /v1/handlers/{id}`
//! and `POST /v1/handlers/{id}/secret/rotate`, their answers and their
//! refusals (which change nothing stored).

mod common;

use std::sync::atomic::Ordering;

use axum::http::{Method, StatusCode};
use chrono::{DateTime, Utc};
use common::TestApp;
use serde_json::{json, Value};

async fn patch(app: &TestApp, id: &str, body: Value) -> common::Res {
    app.call(
        Method::PATCH,
        &format!("/v1/handlers/{id}"),
        Some("application/json"),
        body.to_string().into_bytes(),
    )
    .await
}

async fn patch_changes_only_the_fields_given(app: TestApp) {
    let id = app.create_handler("billing", &["invoice.*"]).await;
    let before = app.get(&format!("/v1/handlers/{id}")).await.json;
    assert_eq!(before["rate_limit"], Value::Null);
    let changed = app.node.handlers_changed.load(Ordering::SeqCst);
    let res = patch(
        &app,
        &id,
        json!({"url": "https://example.com/v2", "event_types": ["push", "release.*"],
               "timeout_ms": 2500, "max_in_flight": 3, "max_attempts": 4,
               "rate_limit": {"per_second": 5, "burst": 2}}),
    )
    .await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["name"], "billing", "absent fields stay");
    assert_eq!(res.json["url"], "https://example.com/v2");
    assert_eq!(res.json["event_types"], json!(["push", "release.*"]));
    assert_eq!(
        (
            res.json["timeout_ms"].clone(),
            res.json["max_in_flight"].clone(),
            res.json["max_attempts"].clone()
        ),
        (json!(2500), json!(3), json!(4))
    );
    assert_eq!(res.json["rate_limit"], json!({"per_second": 5, "burst": 2}));
    assert_eq!(res.json["secret"], before["secret"]);
    assert_eq!(
        app.node.handlers_changed.load(Ordering::SeqCst),
        changed + 1,
        "the node is told"
    );
    let got = app.get(&format!("/v1/handlers/{id}")).await;
    assert_eq!(got.json, res.json);

    // Burst defaults to per_second; null removes the limit.
    let res = patch(&app, &id, json!({"rate_limit": {"per_second": 7}})).await;
    assert_eq!(
        res.json["rate_limit"],
        json!({"per_second": 7, "burst": 7}),
        "{res:?}"
    );
    let res = patch(&app, &id, json!({"rate_limit": null})).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["rate_limit"], Value::Null);
    // An empty patch changes nothing.
    let res = patch(&app, &id, json!({})).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["url"], "https://example.com/v2");
}

async fn bad_patches_are_refused_and_change_nothing(app: TestApp) {
    let id = app.create_handler("billing", &["invoice.*"]).await;
    let before = app.snapshot().await;
    let changed = app.node.handlers_changed.load(Ordering::SeqCst);
    let cases: Vec<(Value, u16, &str, &str)> = vec![
        (
            json!({"url": "ftp://example.com/x"}),
            422,
            "invalid_handler",
            "scheme",
        ),
        (
            json!({"url": "https://u:p@example.com/"}),
            422,
            "invalid_handler",
            "credentials",
        ),
        (
            json!({"url": null}),
            422,
            "invalid_handler",
            "url must not be null",
        ),
        (json!({"name": ""}), 422, "invalid_handler", "name"),
        (
            json!({"event_types": []}),
            422,
            "invalid_handler",
            "event_types",
        ),
        (
            json!({"event_types": ["a*b"]}),
            422,
            "invalid_handler",
            "event_types[0]",
        ),
        (
            json!({"max_attempts": 0}),
            422,
            "invalid_handler",
            "max_attempts 0",
        ),
        (
            json!({"timeout_ms": 99}),
            422,
            "invalid_handler",
            "timeout_ms 99",
        ),
        (
            json!({"max_in_flight": 10_001}),
            422,
            "invalid_handler",
            "max_in_flight 10001",
        ),
        (
            json!({"rate_limit": {"per_second": 0}}),
            422,
            "invalid_handler",
            "rate_limit.per_second 0",
        ),
        (
            json!({"rate_limit": {"per_second": 5, "burst": 0}}),
            422,
            "invalid_handler",
            "rate_limit.burst 0",
        ),
        (
            json!({"rate_limit": {"burst": 5}}),
            422,
            "invalid_body",
            "per_second",
        ),
        (json!({"secret": "whsec_x"}), 422, "invalid_body", "secret"),
        (json!({"state": "enabled"}), 422, "invalid_body", "state"),
        (
            json!({"max_attempts": "3"}),
            422,
            "invalid_body",
            "max_attempts",
        ),
        (json!([1]), 422, "invalid_body", ""),
    ];
    let mut failures = Vec::new();
    for (body, status, code, mentions) in cases {
        let res = patch(&app, &id, body.clone()).await;
        let message = res.json["error"]["message"].as_str().unwrap_or_default();
        if res.status.as_u16() != status
            || res.json["error"]["code"] != code
            || !message.contains(mentions)
        {
            failures.push(format!(
                "{body}: expected {status} {code} {mentions:?}, got {res:?}"
            ));
        }
    }
    let res = app
        .call(
            Method::PATCH,
            &format!("/v1/handlers/{id}"),
            Some("application/json"),
            b"{\"url\": ".to_vec(),
        )
        .await;
    assert_eq!(
        (res.status, res.json["error"]["code"].clone()),
        (StatusCode::BAD_REQUEST, json!("invalid_json")),
        "{res:?}"
    );
    for unknown in ["hdl_0193a5b2c4d87e6f8a9b0c1d2e3f4a5b", "hdl_nope"] {
        let res = patch(&app, unknown, json!({"name": "x"})).await;
        assert_eq!(res.status, StatusCode::NOT_FOUND, "{res:?}");
        assert_eq!(res.json["error"]["code"], "not_found");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(app.snapshot().await, before, "nothing changed");
    assert_eq!(app.node.handlers_changed.load(Ordering::SeqCst), changed);
}

fn time(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .expect("a time")
        .parse()
        .expect("an RFC 3339 time")
}

async fn rotation_answers_the_new_secret_and_the_grace_period(app: TestApp) {
    let id = app.create_handler("billing", &["invoice.*"]).await;
    let old = app.get(&format!("/v1/handlers/{id}")).await.json["secret"].clone();
    let res = app
        .post(&format!("/v1/handlers/{id}/secret/rotate"), json!({}))
        .await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_ne!(res.json["secret"], old);
    assert!(res.json["secret"]
        .as_str()
        .expect("secret")
        .starts_with("whsec_"));
    let until = time(&res.json["previous_secret_until"]);
    let want = Utc::now() + chrono::Duration::hours(24);
    assert!(
        (until - want).num_seconds().abs() < 60,
        "default 24 h: {until}"
    );
    let stored = app.store.get_handler(&id).await.expect("get");
    assert_eq!(stored.previous_secret.as_deref(), old.as_str());
    assert_eq!(json!(stored.secret), res.json["secret"]);

    // A given secret; grace 0 drops the old one at once.
    let given = format!(
        "whsec_{}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [9u8; 32])
    );
    let res = app
        .post(
            &format!("/v1/handlers/{id}/secret/rotate"),
            json!({"secret": given, "grace_period_s": 0}),
        )
        .await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["secret"], given.as_str());
    assert_eq!(res.json["previous_secret_until"], Value::Null);

    let before = app.snapshot().await;
    for (body, code, mentions) in [
        (json!({"secret": "whsec_!!"}), "invalid_handler", "base64"),
        (json!({"secret": "nope"}), "invalid_handler", "whsec_"),
        (
            json!({"grace_period_s": 2_592_001}),
            "invalid_handler",
            "grace_period_s 2592001",
        ),
        (json!({"grace": 1}), "invalid_body", "grace"),
        (
            json!({"secret": given, "grace_period_s": 60}),
            "invalid_handler",
            "current secret",
        ),
        // serde would take an array as the struct's fields by position.
        (json!([null, null]), "invalid_body", "JSON object"),
        (json!([]), "invalid_body", "JSON object"),
    ] {
        let res = app
            .post(&format!("/v1/handlers/{id}/secret/rotate"), body.clone())
            .await;
        assert_eq!(
            res.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {res:?}"
        );
        assert_eq!(res.json["error"]["code"], code, "{body}: {res:?}");
        let message = res.json["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(mentions), "{body}: {message}");
        assert!(
            !message.contains("!!"),
            "the secret is not repeated: {message}"
        );
    }
    let res = app
        .post(
            "/v1/handlers/hdl_0193a5b2c4d87e6f8a9b0c1d2e3f4a5b/secret/rotate",
            json!({}),
        )
        .await;
    assert_eq!(res.status, StatusCode::NOT_FOUND, "{res:?}");
    assert_eq!(app.snapshot().await, before, "nothing changed");
}

async fn a_rate_limit_can_be_given_at_registration(app: TestApp) {
    let res = app
        .post(
            "/v1/handlers",
            json!({"name": "limited", "url": "https://example.com/hooks",
                   "event_types": ["*"], "rate_limit": {"per_second": 20}}),
        )
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
    assert_eq!(
        res.json["rate_limit"],
        json!({"per_second": 20, "burst": 20}),
        "burst defaults to per_second"
    );
    let id = res.json["id"].as_str().expect("id").to_owned();
    let read = app.get(&format!("/v1/handlers/{id}")).await;
    assert_eq!(read.json["rate_limit"], res.json["rate_limit"], "stored");

    let before = app.snapshot().await;
    for (body, mentions) in [
        (json!({"per_second": 0}), "rate_limit.per_second 0"),
        (
            json!({"per_second": 5, "burst": 100_001}),
            "rate_limit.burst",
        ),
    ] {
        let res = app
            .post(
                "/v1/handlers",
                json!({"name": "bad", "url": "https://example.com/hooks",
                       "event_types": ["*"], "rate_limit": body}),
            )
            .await;
        assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY, "{res:?}");
        assert_eq!(res.json["error"]["code"], "invalid_handler", "{res:?}");
        let message = res.json["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(mentions), "{body}: {message}");
    }
    assert_eq!(app.snapshot().await, before, "refusals store nothing");
}

/// A handler timeout must fit in what the lane lease leaves room for (a
/// node refuses to start otherwise): refused at registration and in a
/// patch; without `timeout_ms`, a bound below the default lowers the
/// default.
async fn timeouts_must_be_shorter_than_the_lease(backend: common::Backend) {
    let node = common::StubNode {
        longest_timeout: Some(std::time::Duration::from_millis(2_900)),
        ..common::StubNode::default()
    };
    common::run_with(backend, common::TEST_LIMITS, node, |app| async move {
        let register = |timeout: Option<u64>| {
            let mut body =
                json!({"name": "t", "url": "https://example.com/hooks", "event_types": ["*"]});
            if let Some(t) = timeout {
                body["timeout_ms"] = json!(t);
            }
            body
        };
        let before = app.snapshot().await;
        let res = app.post("/v1/handlers", register(Some(3_000))).await;
        assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY, "{res:?}");
        assert_eq!(res.json["error"]["code"], "invalid_handler");
        let message = res.json["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("timeout_ms 3000") && message.contains("at most 2900 ms"),
            "{message}"
        );
        assert_eq!(app.snapshot().await, before, "nothing stored");

        let res = app.post("/v1/handlers", register(None)).await;
        assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
        assert_eq!(
            res.json["timeout_ms"], 2_900,
            "the default, lowered to the bound"
        );
        let id = res.json["id"].as_str().expect("id").to_owned();
        let res = app.post("/v1/handlers", register(Some(2_000))).await;
        assert_eq!(res.status, StatusCode::CREATED, "{res:?}");

        let res = patch(&app, &id, json!({"timeout_ms": 60_000})).await;
        assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY, "{res:?}");
        assert_eq!(res.json["error"]["code"], "invalid_handler");
        let res = patch(&app, &id, json!({"timeout_ms": 1_000})).await;
        assert_eq!(res.status, StatusCode::OK, "{res:?}");
        assert_eq!(res.json["timeout_ms"], 1_000);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_must_be_shorter_than_the_lease_sqlite() {
    timeouts_must_be_shorter_than_the_lease(common::Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_must_be_shorter_than_the_lease_postgres() {
    timeouts_must_be_shorter_than_the_lease(common::Backend::Postgres).await;
}

/// Every field of a rotation is optional, so is its body; a body that is
/// JSON but not an object says so (not the name of a Rust type).
async fn rotation_without_a_body_and_non_object_bodies(app: TestApp) {
    let id = app.create_handler("rot", &["*"]).await;
    let before = app.get(&format!("/v1/handlers/{id}")).await.json;
    let res = app
        .call(
            Method::POST,
            &format!("/v1/handlers/{id}/secret/rotate"),
            None,
            Vec::new(),
        )
        .await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_ne!(res.json["secret"], before["secret"], "a new secret");
    assert!(res.json["previous_secret_until"].is_string(), "{res:?}");
    for body in ["null", "[1]", "3", "\"x\""] {
        let res = app
            .call(
                Method::PATCH,
                &format!("/v1/handlers/{id}"),
                Some("application/json"),
                body.as_bytes().to_vec(),
            )
            .await;
        assert_eq!(
            res.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{body}: {res:?}"
        );
        assert_eq!(
            res.json["error"]["message"], "request body must be a JSON object",
            "{body}"
        );
    }
    let res = app
        .call(
            Method::PATCH,
            &format!("/v1/handlers/{id}"),
            Some("application/json"),
            b"nul".to_vec(),
        )
        .await;
    assert_eq!(res.status, StatusCode::BAD_REQUEST, "not JSON: {res:?}");
}

/// A payload filter given at registration is answered and read back as
/// given, decides at publish which events get a delivery, and `PATCH`
/// replaces it or (with `null`) removes it.
async fn a_filter_is_answered_applied_changed_and_removed(app: TestApp) {
    let filter = json!({"and": [{"path": "/order/total", "gte": 100},
                                {"path": "/country", "in": ["DE", "FR"]}]});
    let res = app
        .post(
            "/v1/handlers",
            json!({"name": "big", "url": "https://example.com/big", "event_types": ["order.*"],
                   "filter": filter}),
        )
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
    assert_eq!(res.json["filter"], filter);
    let id = res.json["id"].as_str().expect("id").to_owned();
    let got = app.get(&format!("/v1/handlers/{id}")).await;
    assert_eq!(got.json, res.json, "read back as answered");
    let plain = app.create_handler("plain", &["order.*"]).await;
    assert_eq!(
        app.get(&format!("/v1/handlers/{plain}")).await.json["filter"],
        Value::Null
    );
    let res = app
        .post(
            "/v1/events",
            json!({"events": [
                {"type": "order.placed", "payload": {"order": {"total": 150}, "country": "DE"}},
                {"type": "order.placed", "payload": {"order": {"total": "150"}, "country": "DE"}},
                {"type": "order.placed", "payload": {"order": {"total": 99}, "country": "FR"}},
            ]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(app.store.counts().await.expect("counts").deliveries, 3 + 1);

    let other = json!({"path": "/country", "equals": "IT"});
    let res = patch(&app, &id, json!({"filter": other})).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["filter"], other);
    let res = patch(&app, &id, json!({"name": "renamed"})).await;
    assert_eq!(res.json["filter"], other, "absent: kept");
    let res = patch(&app, &id, json!({"filter": null})).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["filter"], Value::Null);
    assert_eq!(
        app.get(&format!("/v1/handlers/{id}")).await.json["filter"],
        Value::Null
    );
}

/// A filter that breaks a rule is `422 invalid_handler` naming the field
/// and the rule, at registration and in a `PATCH`; nothing is stored.
async fn bad_filters_are_refused_naming_the_field(app: TestApp) {
    let id = app.create_handler("billing", &["invoice.*"]).await;
    let before = app.snapshot().await;
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"and": [{"path": "/n", "gt": "5"}]}),
            "filter.and[0].gt: gt takes a number",
        ),
        (
            json!({"path": "n", "equals": 1}),
            "filter.path: path \"n\" must be a JSON pointer",
        ),
        (
            json!({"path": "/n", "equals": "a\u{0}"}),
            "filter.equals: must not hold the characters U+0000 or U+FFFF",
        ),
        (
            json!({"path": "/n\u{0}", "exists": true}),
            "filter.path: must not hold the characters U+0000 or U+FFFF",
        ),
        (
            json!({"path": "/n", "like": "x"}),
            "filter: unknown operator \"like\"",
        ),
        (
            json!({"path": "/n", "equals": 1, "in": [1]}),
            "filter: a condition takes exactly one operator",
        ),
        (
            json!({"or": []}),
            "filter.or: must hold at least one filter",
        ),
        (
            json!({"path": "/n", "in": [{"a": 1}]}),
            "filter.in[0]: takes a string, number, boolean or null",
        ),
        (json!([]), "filter: a filter must be a JSON object"),
    ];
    for (filter, message) in cases {
        let res = app
            .post(
                "/v1/handlers",
                json!({"name": "f", "url": "https://example.com/f", "event_types": ["*"],
                       "filter": filter}),
            )
            .await;
        assert_eq!(
            res.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{filter}: {res:?}"
        );
        assert_eq!(res.json["error"]["code"], "invalid_handler", "{res:?}");
        let got = res.json["error"]["message"].as_str().expect("message");
        assert!(got.starts_with(message), "{filter}: {got}");
        let res = patch(&app, &id, json!({"filter": filter})).await;
        assert_eq!(
            res.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{filter}: {res:?}"
        );
        let got = res.json["error"]["message"].as_str().expect("message");
        assert!(got.starts_with(message), "{filter}: {got}");
    }
    assert_eq!(app.snapshot().await, before, "nothing stored");
}

on_every_backend!(
    a_filter_is_answered_applied_changed_and_removed,
    bad_filters_are_refused_naming_the_field,
    rotation_without_a_body_and_non_object_bodies,
    a_rate_limit_can_be_given_at_registration,
    patch_changes_only_the_fields_given,
    bad_patches_are_refused_and_change_nothing,
    rotation_answers_the_new_secret_and_the_grace_period
);
