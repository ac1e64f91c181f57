//! The operator's view: `/openapi.json` (the router and the document agree),
//! the dashboard at `/ui/` (page, assets, content types) and
//! `GET /admin/handlers` (state and dead-letter counts, no secrets) and
//! `GET /admin/handlers/{id}/activity` (the node's samples).

mod common;

use std::collections::BTreeSet;

use axum::http::{Method, StatusCode};
use common::TestApp;
use lanebus_api::{ui, ROUTES};
use serde_json::{json, Value};

fn header<'a>(res: &'a common::Res, name: &str) -> &'a str {
    res.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

/// The served document lists exactly the route table's (method, path,
/// operation id); and the router has no method on a documented path that
/// the document leaves out (each such method answers 405), nor misses one
/// it lists (none answers 404/405).
async fn openapi_document_and_router_agree(app: TestApp) {
    let res = app.get("/openapi.json").await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(header(&res, "content-type"), "application/json");
    let doc = res.json.clone();
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1.")),
        "{}",
        doc["openapi"]
    );

    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("path item") {
            documented.insert((
                method.to_uppercase(),
                path.clone(),
                op["operationId"].as_str().expect("operationId").to_owned(),
            ));
        }
    }
    let routes: BTreeSet<(String, String, String)> = ROUTES
        .iter()
        .map(|r| {
            (
                r.method.to_string(),
                r.path.to_owned(),
                r.operation.id().to_owned(),
            )
        })
        .collect();
    assert_eq!(documented, routes);

    let probe_methods = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::PATCH,
        Method::DELETE,
    ];
    for (path, item) in doc["paths"].as_object().expect("paths") {
        let concrete = path.replace("{id}", "1").replace("{name}", "t");
        for method in &probe_methods {
            let listed = item.get(method.as_str().to_lowercase()).is_some();
            let res = app.call(method.clone(), &concrete, None, Vec::new()).await;
            let code = res.json["error"]["code"].as_str().unwrap_or_default();
            if listed {
                assert!(
                    code != "method_not_allowed" && code != "path_not_found",
                    "{method} {path} is documented but not served: {res:?}"
                );
            } else {
                assert_eq!(
                    res.status,
                    StatusCode::METHOD_NOT_ALLOWED,
                    "{method} {path} is served but not documented: {res:?}"
                );
            }
        }
    }
}

/// `src`/`href` values of an HTML text, in order.
fn references(html: &str) -> Vec<String> {
    let mut out = Vec::new();
    for attr in ["src=\"", "href=\""] {
        for (i, _) in html.match_indices(attr) {
            let rest = &html[i + attr.len()..];
            if let Some(end) = rest.find('"') {
                out.push(rest[..end].to_owned());
            }
        }
    }
    out
}

async fn dashboard_page_references_its_assets_with_their_types(app: TestApp) {
    let res = app.get("/ui/").await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(header(&res, "content-type"), "text/html; charset=utf-8");
    assert!(header(&res, "content-security-policy").contains("default-src 'none'"));
    let html = String::from_utf8(res.bytes.clone()).expect("utf-8");
    assert!(html.starts_with("<!doctype html>"), "{html}");
    assert!(html.contains("<html lang=\"en\">"));

    let refs = references(&html);
    // Nothing is fetched from another host: every reference is relative
    // (or an inline data: URL).
    for r in &refs {
        assert!(
            !r.contains("://") && !r.starts_with("//"),
            "{r} points off the node"
        );
    }
    let assets: Vec<&String> = refs
        .iter()
        .filter(|r| !r.starts_with("..") && !r.starts_with("data:") && !r.starts_with('#'))
        .collect();
    let expected: BTreeSet<&str> = ["dashboard.css", "dashboard.js"].into();
    assert_eq!(
        assets.iter().map(|s| s.as_str()).collect::<BTreeSet<_>>(),
        expected
    );
    for asset in assets {
        let path = format!("/ui/{asset}");
        let res = app.get(&path).await;
        assert_eq!(res.status, StatusCode::OK, "{path}: {res:?}");
        let want = if asset.ends_with(".css") {
            "text/css; charset=utf-8"
        } else {
            "text/javascript; charset=utf-8"
        };
        assert_eq!(header(&res, "content-type"), want, "{path}");
        assert_eq!(header(&res, "x-content-type-options"), "nosniff");
        let embedded = ui::ASSETS
            .iter()
            .find(|a| a.path == path)
            .expect("embedded asset");
        assert_eq!(res.bytes, embedded.body.as_bytes(), "{path}");
    }

    // Links to the node's own JSON stay on the node (relative paths).
    for r in refs.iter().filter(|r| r.starts_with("..")) {
        let path = r.trim_start_matches("..");
        let res = app.get(path).await;
        assert_eq!(res.status, StatusCode::OK, "{r}: {res:?}");
    }

    let res = app.get("/ui").await;
    assert_eq!(res.status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(header(&res, "location"), "ui/");
}

/// The ids the script looks up exist in the page, and the script fetches
/// only this node's paths, which are in the route table (a template's
/// `${...}` stands for a path parameter; its query is left out).
#[test]
fn dashboard_script_and_page_fit_together() {
    let html = ui::INDEX.body;
    let js = ui::SCRIPT.body;
    let mut ids = 0;
    for (i, _) in js.match_indices("$(\"") {
        let rest = &js[i + 3..];
        let id = &rest[..rest.find('"').expect("closing quote")];
        assert!(
            html.contains(&format!("id=\"{id}\"")),
            "#{id} is not in the page"
        );
        ids += 1;
    }
    assert!(ids >= 8, "{ids}");
    let mut fetched = 0;
    for quote in ['"', '`'] {
        for (i, _) in js.match_indices(&format!("get({quote}")) {
            let rest = &js[i + 5..];
            let target = &rest[..rest.find(quote).expect("closing quote")];
            let target = target.split('?').next().unwrap_or_default();
            let mut path = String::new();
            let mut parts = target.split("${");
            path.push_str(parts.next().unwrap_or_default());
            for part in parts {
                let (_, after) = part.split_once('}').expect("end of ${...}");
                path.push_str("{id}");
                path.push_str(after);
            }
            let path = path.strip_prefix("..").expect("relative to /ui/");
            assert!(
                ROUTES
                    .iter()
                    .any(|r| r.method == Method::GET && r.path == path),
                "{path} is not a GET route"
            );
            fetched += 1;
        }
    }
    // The three polled paths, the event, the deliveries, the activity,
    // the event-type catalog.
    assert_eq!(fetched, 7);
    // The grid cells carry what a browser test asserts on; a handler's row
    // and page show its payload filter (issue 15).
    for attr in [
        "data-lane",
        "`lane-${i}`",
        "dataset.owner",
        "dataset.epoch",
        "\"data-filter\"",
        "filterText(h.filter)",
    ] {
        assert!(js.contains(attr), "{attr}");
    }
}

/// The filter `GET /v1/handlers/{id}` answers for handler `id`.
async fn res_filter(app: &TestApp, id: &str) -> Value {
    app.get(&format!("/v1/handlers/{id}")).await.json["filter"].clone()
}

async fn handler_summaries_count_dead_letters_without_secrets(app: TestApp) {
    let empty = app.get("/admin/handlers").await;
    assert_eq!(
        (empty.status, empty.json.clone()),
        (
            StatusCode::OK,
            json!({"handlers": [], "dead_letters_exact": true})
        )
    );
    let failing = app.create_handler("failing", &["dl.*"]).await;
    let quiet = app.create_handler("quiet", &["zz.*"]).await;
    let filter = json!({"and": [{"path": "/total", "gte": 100}, {"path": "/cc", "in": ["DE"]}]});
    let res = app
        .post(
            "/v1/handlers",
            json!({"name": "filtered", "url": "http://127.0.0.1:9/hook",
                   "event_types": ["zz.*"], "filter": filter}),
        )
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
    assert_eq!(app.make_dead_letters("dl.x", "k", 3).await, 3);

    let res = app.get("/admin/handlers").await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(res.json["dead_letters_exact"], true);
    let handlers = res.json["handlers"].as_array().expect("handlers");
    let ids: Vec<&str> = handlers.iter().filter_map(|h| h["id"].as_str()).collect();
    assert_eq!(&ids[..2], [failing.as_str(), quiet.as_str()]);
    assert_eq!(
        handlers[0],
        json!({"id": failing, "name": "failing", "url": "http://127.0.0.1:9/hook",
               "event_types": ["dl.*"], "state": "enabled", "state_reason": null,
               "failing_since": null, "rate_limit": null, "filter": null, "dead_letters": 3})
    );
    assert_eq!(handlers[1]["dead_letters"], 0);
    // The operator sees what a handler lets through (issue 15).
    assert_eq!(handlers[2]["filter"], res_filter(&app, &ids[2]).await);
    assert_eq!(handlers[2]["filter"], filter);
    assert!(handlers.iter().all(|h| h.get("secret").is_none()));
    assert!(!String::from_utf8_lossy(&res.bytes).contains("whsec_"));

    let listed = app
        .get(&format!("/admin/dead-letters?handler_id={failing}"))
        .await;
    assert_eq!(
        listed.json["dead_letters"].as_array().map(Vec::len),
        Some(3)
    );
}

/// The node's samples for an existing handler, with the window's shape;
/// `404` for an unknown or malformed id, `400` for a query parameter.
async fn handler_activity_answers_the_nodes_samples(app: TestApp) {
    let id = app.create_handler("plotted", &["a.*"]).await;
    let res = app.get(&format!("/admin/handlers/{id}/activity")).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    assert_eq!(
        res.json,
        json!({"node_id": "n1", "handler_id": id, "interval_s": 10, "window_s": 900,
               "samples": [{"at": "2026-12-01T00:00:00Z", "seconds": 10.0, "deliveries": 5,
                            "failures": 1, "deliveries_per_s": 0.5, "failures_per_s": 0.1,
                            "p99_attempt_ms": 12.5}]})
    );
    assert_eq!(
        serde_json::to_value(common::stub_activity()).expect("json"),
        res.json["samples"][0]
    );
    for path in [
        "/admin/handlers/hdl_00000000000000000000000000000000/activity".to_owned(),
        "/admin/handlers/nope/activity".to_owned(),
    ] {
        let res = app.get(&path).await;
        assert_eq!(res.status, StatusCode::NOT_FOUND, "{path}: {res:?}");
        assert_eq!(res.json["error"]["code"], "not_found");
    }
    let res = app
        .get(&format!("/admin/handlers/{id}/activity?window=60"))
        .await;
    assert_eq!(res.status, StatusCode::BAD_REQUEST, "{res:?}");
    assert_eq!(res.json["error"]["code"], "invalid_parameter");
}

on_every_backend!(
    handler_activity_answers_the_nodes_samples,
    openapi_document_and_router_agree,
    dashboard_page_references_its_assets_with_their_types,
    handler_summaries_count_dead_letters_without_secrets,
);

/// The harness's document check (run on every answer of every API test)
/// does catch an undocumented status, content type or body shape.
#[test]
fn harness_check_rejects_answers_the_document_does_not_allow() {
    use axum::http::{HeaderMap, HeaderValue};
    let answer = |status: u16, content_type: &str, body: Value| {
        let mut headers = HeaderMap::new();
        headers.insert(
            "content-type",
            HeaderValue::from_str(content_type).expect("header"),
        );
        common::Res {
            status: StatusCode::from_u16(status).expect("status"),
            headers,
            bytes: body.to_string().into_bytes(),
            json: body,
        }
    };
    let fails = |method: &str, path: &str, res: common::Res| {
        let method = method.to_owned();
        let path = path.to_owned();
        std::panic::catch_unwind(move || common::check_against_document(&method, &path, &res))
            .is_err()
    };
    let ok = json!({"status": "ok"});
    assert!(!fails(
        "GET",
        "/healthz",
        answer(200, "application/json", ok.clone())
    ));
    assert!(fails(
        "GET",
        "/healthz",
        answer(418, "application/json", ok.clone())
    ));
    assert!(fails("GET", "/healthz", answer(200, "text/plain", ok)));
    assert!(fails(
        "GET",
        "/healthz",
        answer(200, "application/json", json!({"status": 1}))
    ));
    assert!(fails(
        "GET",
        "/v1/handlers",
        answer(200, "application/json", json!({"handlers": [{"id": "x"}]}))
    ));
    let error = json!({"error": {"code": "not_found", "message": "handler \"x\" not found"}});
    assert!(!fails(
        "GET",
        "/v1/handlers/x",
        answer(404, "application/json", error.clone())
    ));
    assert!(fails(
        "GET",
        "/v1/handlers",
        answer(404, "application/json", error)
    ));
    // Paths outside the route table are the router's 404/405, not checked.
    assert!(!fails(
        "GET",
        "/nope",
        answer(404, "application/json", json!({}))
    ));
}
