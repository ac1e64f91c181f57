//! Security of a running node (issue #4, items 6 and 7): bearer tokens on
//! the API as wired into a node, the refusal to serve an open API or Raft
//! off loopback, and the SSRF guard at send time (a URL that passed
//! registration, or was written to the store directly, is refused when the
//! node connects), redirects not followed.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{test_options, Api, Backend, TestDb};
use lanebus_api::auth::{Auth, Scope};
use lanebus_api::egress::EgressPolicy;
use lanebus_api::NodeView as _;
use lanebus_store::{handler_defaults, NewHandler};
use lanebus_testkit::receiver::Receiver;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PUBLISH_TOKEN: &str = "publish-token-for-tests-0001";
const ADMIN_TOKEN: &str = "admin-token-for-tests-0000001";

fn lanebus() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lanebus"));
    for (k, _) in std::env::vars() {
        if k.starts_with("LANEBUS_") {
            c.env_remove(k);
        }
    }
    c
}

/// `lanebus node ARGS` must exit non-zero at once, saying `want`.
fn refuses(args: &[&str], want: &str) {
    let dir = std::env::temp_dir().join(format!("lanebus-sec-{}", uuid::Uuid::now_v7().simple()));
    let out = lanebus()
        .args(["node", "--id", "1", "--data-dir"])
        .arg(&dir)
        .args(args)
        .output()
        .expect("lanebus runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success(), "{args:?} started: {stderr}");
    assert!(stderr.contains(want), "{args:?}: {stderr}");
}

#[test]
fn a_node_refuses_an_open_api_or_raft_off_loopback() {
    refuses(
        &[
            "--single",
            "--http-addr",
            "0.0.0.0:0",
            "--raft-addr",
            "127.0.0.1:0",
        ],
        "refusing to serve the API on 0.0.0.0:0 without tokens",
    );
    // With tokens the API may leave loopback, but Raft may not without the
    // cluster secret.
    refuses(
        &[
            "--bootstrap",
            "--http-addr",
            "127.0.0.1:0",
            "--raft-addr",
            "0.0.0.0:0",
            "--admin-tokens",
            ADMIN_TOKEN,
        ],
        "refusing to serve raft on 0.0.0.0:0 without a cluster secret",
    );
    refuses(
        &["--single", "--admin-tokens", "short"],
        "admin_tokens entry 1: a token must have at least 16 characters",
    );
    refuses(
        &["--webhook-allow-cidrs", "127.0.0.0/8,nope"],
        "webhook_allow_cidrs entry \"nope\"",
    );
}

/// An embedded node (the library's [`lanebus_node::start`], no CLI) makes
/// the same start checks as `lanebus node`: a webhook source address that
/// is not on this host, and a cluster member with no Raft state that
/// neither bootstraps nor joins, are refused before the store is opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_node_refuses_a_foreign_source_ip_or_no_cluster_state() -> anyhow::Result<()> {
    use lanebus_node::node::{ClusterOptions, NodeError};

    // 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this host.
    let ip: std::net::IpAddr = "192.0.2.1".parse()?;
    let mut opts = test_options("sqlite::memory:");
    opts.webhook_source_ip = Some(ip);
    match lanebus_node::start(opts).await {
        Err(e @ NodeError::WebhookSourceIp { .. }) => {
            let msg = e.to_string();
            ensure!(
                msg.contains("webhook_source_ip 192.0.2.1 is not an address of this host"),
                "{msg}"
            );
        }
        Err(e) => anyhow::bail!("refused for another reason: {e}"),
        Ok(node) => {
            node.shutdown().await?;
            anyhow::bail!("started with a source IP not on this host");
        }
    }

    // A loopback source address is on every host: accepted.
    let mut opts = test_options("sqlite::memory:");
    opts.webhook_source_ip = Some("127.0.0.1".parse()?);
    lanebus_node::start(opts).await?.shutdown().await?;

    let dir = std::env::temp_dir().join(format!("lanebus-emb-{}", uuid::Uuid::now_v7().simple()));
    let mut opts = test_options("sqlite::memory:");
    opts.cluster = Some(ClusterOptions::new(1, "127.0.0.1:0", &dir));
    let res = lanebus_node::start(opts).await;
    let raft_files = dir.join("raft.redb").exists();
    let _ = std::fs::remove_dir_all(&dir);
    match res {
        Err(e @ NodeError::NoClusterState { .. }) => {
            let msg = e.to_string();
            ensure!(msg.contains("holds no cluster state"), "{msg}");
        }
        Err(e) => anyhow::bail!("refused for another reason: {e}"),
        Ok(node) => {
            node.shutdown().await?;
            anyhow::bail!("a cluster member started with no way to get cluster state");
        }
    }
    ensure!(!raft_files, "the refused node created its Raft state");
    Ok(())
}

async fn call(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<&str>,
    body: Option<Value>,
) -> anyhow::Result<(u16, reqwest::header::HeaderMap, Value)> {
    let mut req = http.request(method, url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let res = req.send().await?;
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let v = serde_json::from_str(&res.text().await?).unwrap_or(Value::Null);
    Ok((status, headers, v))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_tokens_checks_them_on_every_protected_path() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "auth").await?;
    let mut opts = test_options(&db.url);
    opts.auth = Auth::new(vec![
        (Scope::Publish, lanebus_api::auth::hash_token(PUBLISH_TOKEN)),
        (Scope::Admin, lanebus_api::auth::hash_token(ADMIN_TOKEN)),
    ]);
    let node = lanebus_node::start(opts).await?;
    let base = node.base_url();
    let http = reqwest::Client::new();
    let events = json!({"events": [{"id": "e1", "type": "t.x", "payload": {}}]});
    let handler = json!({"name": "h", "url": "https://example.com/hook", "event_types": ["*"]});
    use reqwest::Method as M;

    // Open paths need nothing.
    for path in ["/healthz", "/readyz", "/openapi.json", "/ui/"] {
        let (status, _, _) = call(&http, M::GET, format!("{base}{path}"), None, None).await?;
        ensure!(status == 200, "{path}: {status}");
    }
    // No token, a wrong token: 401 with the challenge and the JSON error.
    for token in [None, Some("wrong-token-0000000000")] {
        for (method, path, body) in [
            (M::POST, "/v1/events", Some(events.clone())),
            (M::GET, "/admin/lanes", None),
            (M::GET, "/metrics", None),
        ] {
            let (status, headers, v) =
                call(&http, method, format!("{base}{path}"), token, body).await?;
            ensure!(status == 401, "{path} with {token:?}: {status} {v}");
            ensure!(v["error"]["code"] == "unauthorized", "{v}");
            let challenge = headers
                .get("www-authenticate")
                .and_then(|h| h.to_str().ok())
                .unwrap_or_default();
            ensure!(challenge.starts_with("Bearer"), "{challenge:?}");
        }
    }
    // A publish token publishes, and is refused on admin paths with 403.
    let (status, _, v) = call(
        &http,
        M::POST,
        format!("{base}/v1/events"),
        Some(PUBLISH_TOKEN),
        Some(events.clone()),
    )
    .await?;
    ensure!(
        status == 202,
        "publish with the publish token: {status} {v}"
    );
    for (method, path, body) in [
        (M::POST, "/v1/handlers", Some(handler.clone())),
        (M::GET, "/v1/handlers", None),
        (M::GET, "/admin/cluster", None),
        (
            M::POST,
            "/admin/cluster/join",
            Some(json!({"id": 9, "raft_addr": "127.0.0.1:1", "http_addr": "127.0.0.1:2"})),
        ),
    ] {
        let (status, headers, v) = call(
            &http,
            method,
            format!("{base}{path}"),
            Some(PUBLISH_TOKEN),
            body,
        )
        .await?;
        ensure!(status == 403, "{path} with the publish token: {status} {v}");
        ensure!(v["error"]["code"] == "forbidden", "{v}");
        ensure!(
            headers
                .get("www-authenticate")
                .and_then(|h| h.to_str().ok())
                .is_some_and(|c| c.contains("insufficient_scope")),
            "{headers:?}"
        );
    }
    // The admin token does everything, publishing included.
    let (status, _, v) = call(
        &http,
        M::POST,
        format!("{base}/v1/handlers"),
        Some(ADMIN_TOKEN),
        Some(handler),
    )
    .await?;
    ensure!(status == 201, "{status} {v}");
    for (method, path, body) in [
        (M::GET, "/admin/lanes", None),
        (M::GET, "/metrics", None),
        (
            M::POST,
            "/v1/events",
            Some(json!({"events": [{"id": "e2", "type": "t.x", "payload": {}}]})),
        ),
    ] {
        let (status, _, v) = call(
            &http,
            method,
            format!("{base}{path}"),
            Some(ADMIN_TOKEN),
            body,
        )
        .await?;
        ensure!((200..300).contains(&status), "{path}: {status} {v}");
    }

    // `lanebus admin` sends its token (LANEBUS_TOKEN or --token).
    let bin = env!("CARGO_BIN_EXE_lanebus");
    let out = tokio::process::Command::new(bin)
        .args(["admin", "--node", &base, "--output", "json", "handlers"])
        .env_remove("LANEBUS_TOKEN")
        .output()
        .await?;
    ensure!(!out.status.success(), "admin without a token: {out:?}");
    let out = tokio::process::Command::new(bin)
        .args(["admin", "--node", &base, "--output", "json", "handlers"])
        .env("LANEBUS_TOKEN", ADMIN_TOKEN)
        .output()
        .await?;
    ensure!(out.status.success(), "admin with LANEBUS_TOKEN: {out:?}");

    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// Registers `url` in the store directly (past the API's check), with one
/// attempt, publishes one event for it and returns the dead letter's
/// `last_error`.
async fn last_error_of(
    node: &lanebus_node::NodeHandle,
    name: &str,
    url: &str,
) -> anyhow::Result<String> {
    let h = node
        .store()
        .create_handler(NewHandler {
            name: name.into(),
            url: url.into(),
            event_types: vec![format!("{name}.*")],
            max_attempts: 1,
            timeout_ms: 2_000,
            max_in_flight: handler_defaults::MAX_IN_FLIGHT,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    let api = Api::new(&node.base_url());
    let deadline = Instant::now() + Duration::from_secs(30);
    // The node's catalog reloads every second in tests.
    node.state.handlers_changed();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    api.publish(
        &[json!({"id": format!("{name}-1"), "type": format!("{name}.x"), "payload": {}})],
        1,
    )
    .await?;
    loop {
        let letters = api.dead_letters(&h.id).await?;
        if let Some(l) = letters.first() {
            return Ok(l["last_error"].as_str().unwrap_or_default().to_owned());
        }
        ensure!(Instant::now() < deadline, "no dead letter for {url}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ssrf_guard_refuses_at_send_time_and_redirects_are_not_followed() -> anyhow::Result<()>
{
    let rx = Receiver::start().await?;
    // A target answering every request with a redirect to the receiver.
    let redirector = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let redirect_url = format!("http://{}/hook/redirect", redirector.local_addr()?);
    let location = rx.url("followed");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = redirector.accept().await {
            let location = location.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = s.read(&mut buf).await;
                let answer = format!(
                    "HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });

    // A node with the default policy: loopback refused, by address and by
    // name, although the URL never went through registration.
    let db = TestDb::new(Backend::Sqlite, "ssrf").await?;
    let mut opts = test_options(&db.url);
    opts.egress = EgressPolicy::default();
    let node = lanebus_node::start(opts).await?;
    let err = last_error_of(&node, "literal", &rx.url("literal")).await?;
    ensure!(
        err.starts_with("refused by the ssrf guard")
            && err.contains("127.0.0.1, which is loopback"),
        "{err}"
    );
    let by_name = rx.url("named").replace("127.0.0.1", "localhost");
    let err = last_error_of(&node, "named", &by_name).await?;
    ensure!(
        err.starts_with("refused by the ssrf guard")
            && err.contains("host \"localhost\" resolves to"),
        "{err}"
    );
    // And the API refuses both at registration.
    let api = Api::new(&node.base_url());
    for url in [rx.url("x"), by_name.clone()] {
        let (status, v) = api
            .post(
                "/v1/handlers",
                json!({"name": "x", "url": url, "event_types": ["*"]}),
            )
            .await?;
        ensure!(
            status == 422 && v["error"]["code"] == "invalid_handler",
            "{url}: {status} {v}"
        );
    }
    ensure!(rx.requests().is_empty(), "the receiver was reached");
    node.shutdown().await?;

    // With loopback allowed: the redirect is a failed attempt, not followed.
    let node = lanebus_node::start(test_options(&db.url)).await?;
    let err = last_error_of(&node, "redirect", &redirect_url).await?;
    ensure!(err == "http 302", "{err}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        rx.requests().iter().all(|r| r.handler != "followed"),
        "the redirect was followed"
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
