//! Signatures checked in a second language: real webhook requests of a node
//! (SQLite store, real receiver) verified with the official JavaScript
//! Standard Webhooks package (npm `standardwebhooks`, pinned by
//! `node/tests/js/package-lock.json`), beside the Python check of
//! `delivery.rs`.
//!
//! `scripts/test` runs `npm ci` in `node/tests/js/` and exports
//! `LANEBUS_TEST_NODEJS` (the `node` executable); without it this test fails
//! and says so.

mod common;

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use common::{real_events, samples, start_node, Api, Backend, TestDb};
use lanebus_testkit::receiver::Receiver;
use serde_json::Value;

const JS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/js");

/// The `node` executable and the folder holding `verify.mjs` with its
/// installed `node_modules`, or a clear error.
fn nodejs() -> anyhow::Result<String> {
    let Ok(node) = std::env::var("LANEBUS_TEST_NODEJS") else {
        bail!(
            "LANEBUS_TEST_NODEJS is not set: run the tests with scripts/test, which runs `npm ci` in \
             node/tests/js and sets it to the node executable (or run `npm ci` there yourself and set \
             LANEBUS_TEST_NODEJS=$(command -v node))"
        );
    };
    let module = Path::new(JS_DIR).join("node_modules/standardwebhooks/package.json");
    ensure!(
        module.exists(),
        "{} is missing: run `npm ci` in {JS_DIR} (scripts/test does)",
        module.display()
    );
    Ok(node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn javascript_standardwebhooks_verifies_real_requests() -> anyhow::Result<()> {
    let node_bin = nodejs()?;
    let db = TestDb::new(Backend::Sqlite, "swh_js").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("js", &rx.url("js"), &["*"], 8).await?;
    rx.set_secret("js", &h.secret);

    // Real payloads (unicode, nesting, big numbers), keyed and unkeyed.
    let samples = samples();
    let (mut events, _) = real_events(&samples, 40, 4, "js");
    let (unkeyed, _) = real_events(&samples[samples.len() / 2..], 10, 0, "js-unkeyed");
    events.extend(unkeyed);
    api.publish(&events, 25).await?;
    ensure!(
        rx.wait_accepted(events.len(), Duration::from_secs(60))
            .await,
        "only {} of {} deliveries arrived",
        rx.accepted_distinct(),
        events.len()
    );

    let reqs: Vec<Value> = rx
        .requests()
        .iter()
        .map(|r| serde_json::json!({"body": r.body, "headers": r.headers}))
        .collect();
    ensure!(reqs.len() >= events.len(), "{} requests", reqs.len());
    let file = std::env::temp_dir().join(format!(
        "lanebus-swh-js-{}.json",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::write(&file, serde_json::to_vec(&reqs)?)?;
    let out = std::process::Command::new(&node_bin)
        .current_dir(JS_DIR)
        .arg("verify.mjs")
        .arg(&file)
        .arg(&h.secret)
        .output()
        .with_context(|| format!("run {node_bin} verify.mjs"));
    let _ = std::fs::remove_file(&file);
    let out = out?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "standardwebhooks (JavaScript) rejected requests: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{}", stdout.trim());

    // And a tampered body must fail, so the check above is not vacuous.
    let mut bad = reqs[0].clone();
    bad["body"] = Value::String(format!("{} ", bad["body"].as_str().unwrap_or_default()));
    std::fs::write(&file, serde_json::to_vec(&[bad])?)?;
    let out = std::process::Command::new(&node_bin)
        .current_dir(JS_DIR)
        .arg("verify.mjs")
        .arg(&file)
        .arg(&h.secret)
        .output()
        .context("run node verify.mjs")?;
    let _ = std::fs::remove_file(&file);
    ensure!(
        !out.status.success(),
        "a tampered body passed: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
