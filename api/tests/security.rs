//! Authentication and the SSRF guard at the API (issue #4, items 6 and 7):
//! every route of the table with no token, a wrong one, a publish token and
//! an admin token; handler URLs to internal addresses refused at
//! registration unless allowed. The answers are checked against the OpenAPI
//! document too (the harness does), so the 401/403 of each operation are
//! documented.

mod common;

use axum::http::{Method, StatusCode};
use common::{run_configured, Backend, StubNode, TestApp, TEST_LIMITS};
use lanebus_api::auth::{hash_token, required_scope, Auth, Scope};
use lanebus_api::egress::EgressPolicy;
use lanebus_api::ROUTES;
use serde_json::json;

const PUBLISH: &str = "publish-token-000000001";
const ADMIN: &str = "admin-token-00000000001";

fn tokens(state: &mut lanebus_api::ApiState) {
    state.auth = Auth::new(vec![
        (Scope::Publish, hash_token(PUBLISH)),
        (Scope::Admin, hash_token(ADMIN)),
    ]);
}

/// A concrete path for a route template.
fn concrete(path: &str) -> String {
    path.replace("{id}", "hdl_00000000000000000000000000000000")
}

async fn send(app: &TestApp, method: &Method, path: &str, token: Option<&str>) -> common::Res {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let (ct, body) = if *method == Method::POST {
        (Some("application/json"), b"{}".to_vec())
    } else {
        (None, Vec::new())
    };
    app.call_with(method.clone(), path, ct, &headers, body)
        .await
}

async fn every_route_asks_for_its_scope(app: TestApp) {
    for route in ROUTES {
        let path = concrete(route.path);
        let what = format!("{} {}", route.method, route.path);
        let need = required_scope(route.path);
        let none = send(&app, &route.method, &path, None).await;
        let wrong = send(&app, &route.method, &path, Some("not-a-token-at-all-0000")).await;
        let publish = send(&app, &route.method, &path, Some(PUBLISH)).await;
        let admin = send(&app, &route.method, &path, Some(ADMIN)).await;
        match need {
            None => {
                for r in [&none, &wrong, &publish, &admin] {
                    assert!(
                        r.status != StatusCode::UNAUTHORIZED && r.status != StatusCode::FORBIDDEN,
                        "{what} is open: {r:?}"
                    );
                }
            }
            Some(scope) => {
                for (r, challenge) in [
                    (&none, r#"Bearer realm="lanebus""#),
                    (&wrong, r#"Bearer realm="lanebus", error="invalid_token""#),
                ] {
                    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{what}: {r:?}");
                    assert_eq!(r.json["error"]["code"], "unauthorized", "{what}");
                    assert_eq!(
                        r.headers
                            .get("www-authenticate")
                            .and_then(|v| v.to_str().ok()),
                        Some(challenge),
                        "{what}"
                    );
                }
                if scope == Scope::Admin {
                    assert_eq!(publish.status, StatusCode::FORBIDDEN, "{what}: {publish:?}");
                    assert_eq!(publish.json["error"]["code"], "forbidden");
                    assert!(publish
                        .headers
                        .get("www-authenticate")
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|v| v.contains(r#"scope="admin""#)));
                } else {
                    assert!(
                        publish.status != StatusCode::UNAUTHORIZED
                            && publish.status != StatusCode::FORBIDDEN,
                        "{what}: {publish:?}"
                    );
                }
                assert!(
                    admin.status != StatusCode::UNAUTHORIZED
                        && admin.status != StatusCode::FORBIDDEN,
                    "{what} with the admin token: {admin:?}"
                );
            }
        }
    }
    // The scopes of the contract.
    assert_eq!(required_scope("/v1/events"), Some(Scope::Publish));
    for admin in [
        "/v1/handlers",
        "/admin/lanes",
        "/admin/cluster/join",
        "/metrics",
    ] {
        assert_eq!(required_scope(admin), Some(Scope::Admin), "{admin}");
    }
    // A publish with the publish token is stored.
    let body = json!({"events": [{"id": "e1", "type": "t.x", "payload": {}}]}).to_string();
    let auth = format!("Bearer {PUBLISH}");
    let r = app
        .call_with(
            Method::POST,
            "/v1/events",
            Some("application/json"),
            &[("authorization", &auth)],
            body.into_bytes(),
        )
        .await;
    assert_eq!(r.status, StatusCode::ACCEPTED, "{r:?}");
}

async fn internal_handler_urls_are_refused_at_registration(app: TestApp) {
    let before = app.snapshot().await;
    for url in [
        "http://127.0.0.1/",
        "http://10.0.0.1/",
        "http://[::1]/",
        "http://169.254.169.254/",
        "http://[::ffff:127.0.0.1]/",
        "http://100.64.0.1/",
        "http://[fd00::1]/",
        "http://localhost:9/hook",
        "file:///etc/passwd",
    ] {
        let r = app
            .post(
                "/v1/handlers",
                json!({"name": "n", "url": url, "event_types": ["*"]}),
            )
            .await;
        assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{url}: {r:?}");
        assert_eq!(r.json["error"]["code"], "invalid_handler", "{url}");
        let message = r.json["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("webhook_allow_cidrs") || message.contains("scheme"),
            "{url}: {message}"
        );
    }
    let r = app
        .post(
            "/v1/handlers",
            json!({"name": "n", "url": "http://localhost:9/hook", "event_types": ["*"]}),
        )
        .await;
    let message = r.json["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("\"localhost\" resolves to") && message.contains("loopback"),
        "{message}"
    );
    assert_eq!(app.snapshot().await, before, "a refused handler was stored");
}

async fn the_allowlist_lets_loopback_through(app: TestApp) {
    for url in [
        "http://127.0.0.1:9/hook",
        "http://[::1]:9/hook",
        "http://localhost:9/hook",
    ] {
        let r = app
            .post(
                "/v1/handlers",
                json!({"name": "n", "url": url, "event_types": ["*"]}),
            )
            .await;
        assert_eq!(r.status, StatusCode::CREATED, "{url}: {r:?}");
    }
    // Private ranges stay refused.
    let r = app
        .post(
            "/v1/handlers",
            json!({"name": "n", "url": "http://10.0.0.1/", "event_types": ["*"]}),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_every_route_asks_for_its_scope() {
    run_configured(
        Backend::Sqlite,
        TEST_LIMITS,
        StubNode::default(),
        tokens,
        every_route_asks_for_its_scope,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_internal_handler_urls_are_refused_at_registration() {
    run_configured(
        Backend::Sqlite,
        TEST_LIMITS,
        StubNode::default(),
        |s| s.egress = EgressPolicy::default(),
        internal_handler_urls_are_refused_at_registration,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_allowlist_lets_loopback_through() {
    run_configured(
        Backend::Sqlite,
        TEST_LIMITS,
        StubNode::default(),
        |s| s.egress = EgressPolicy::allow_loopback(),
        the_allowlist_lets_loopback_through,
    )
    .await
}
