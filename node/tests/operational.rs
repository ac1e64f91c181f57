//! Operational events (issue #14): lanebus publishes its own events about
//! handlers and deliveries on the bus, keyed by handler id, and a real
//! webhook subscribed with `lanebus.*` receives them signed, in order, for
//! each transition: disabled by hand, enabled, failing, dead-lettered,
//! auto-disabled. A catch-all `*` handler does not receive them. A failing
//! subscriber of `lanebus.*` creates no events about itself (the count of
//! events stays put), and publishing a `lanebus.` type through the API is
//! refused with `422`.

mod common;

use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use common::{fail_always, test_options, Api, Backend, TestDb};
use lanebus_node::NodeHandle;
use lanebus_testkit::receiver::{Received, Receiver};
use serde_json::{json, Value};

/// The accepted requests to `handler` of events keyed `key`, by arrival,
/// as (sequence, type, data).
fn told(log: &[Received], handler: &str, key: &str) -> Vec<(i64, String, Value)> {
    log.iter()
        .filter(|r| r.handler == handler && r.accepted() && r.key.as_deref() == Some(key))
        .map(|r| {
            let body: Value = serde_json::from_str(&r.body).unwrap_or(Value::Null);
            (
                r.sequence.unwrap_or(0),
                body["type"].as_str().unwrap_or_default().to_owned(),
                body["data"].clone(),
            )
        })
        .collect()
}

/// A fresh database, a receiver, and a node on them with [`test_options`]
/// and an auto-disable period of `auto_disable_after`.
async fn setup(
    backend: Backend,
    name: &str,
    auto_disable_after: Duration,
) -> anyhow::Result<(TestDb, Receiver, NodeHandle, Api)> {
    let db = TestDb::new(backend, name).await?;
    let rx = Receiver::start().await?;
    let mut opts = test_options(&db.url);
    opts.auto_disable_after = auto_disable_after;
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    Ok((db, rx, node, api))
}

fn orders(prefix: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            json!({"id": format!("{prefix}-{i}"), "type": "orders.placed",
                   "key": format!("o{i}"), "payload": {"n": i}})
        })
        .collect()
}

/// Disabled by hand, enabled, failing, dead letters, auto-disabled (after
/// 2 s): each transition reaches the `lanebus.*` subscriber once, signed,
/// in the order of the handler's key, with the payload it promises.
async fn operational_events_reach_a_subscriber_in_order(backend: Backend) -> anyhow::Result<()> {
    let (db, rx, node, api) = setup(backend, "opevents", Duration::from_secs(2)).await?;
    let ops = api
        .create_handler("ops", &rx.url("ops"), &["lanebus.*"], 5)
        .await?;
    rx.set_secret("ops", &ops.secret);
    let all = api.create_handler("all", &rx.url("all"), &["*"], 5).await?;
    rx.set_secret("all", &all.secret);
    let target = api
        .create_handler("orders", &rx.url("orders"), &["orders.*"], 2)
        .await?;
    rx.set_secret("orders", &target.secret);
    let id = target.id.as_str();

    for step in ["disable", "enable"] {
        let (status, body) = api
            .post(&format!("/v1/handlers/{id}/{step}"), json!({}))
            .await?;
        ensure!(status == 200, "{step}: {status} {body}");
    }
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| told(log, "ops", id).len()
            >= 2)
            .await,
        "disabled and enabled not told: {:?}",
        told(&rx.requests(), "ops", id)
    );

    // Failing from now on: every order dead-letters after 2 attempts, and
    // the handler is disabled after failing for 2 s.
    fail_always(&rx, "orders");
    let started = Instant::now();
    let mut published = 0;
    loop {
        let (status, body) = api.get(&format!("/v1/handlers/{id}")).await?;
        ensure!(status == 200, "{body}");
        if body["state"] == "disabled" {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "not auto-disabled: {body}"
        );
        api.publish(&orders(&format!("e{published}"), 1), 1).await?;
        published += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let dead = api.dead_letters(id).await?.len();
    ensure!(dead >= 1, "no dead letter after {published} orders");
    // Told: 2 + failing + one per dead letter + the auto-disable.
    let want = 2 + 1 + dead + 1;
    let done = rx
        .wait_until(Duration::from_secs(30), |log| {
            told(log, "ops", id).len() >= want
        })
        .await;
    // Late ones (a dead letter recorded as the handler was disabled).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let got = told(&rx.requests(), "ops", id);
    let dead = api.dead_letters(id).await?.len();
    let types: Vec<&str> = got.iter().map(|(_, t, _)| t.as_str()).collect();
    ensure!(done, "told {types:?}, want {want}");
    println!("told after {published} orders: {types:?}");

    // Each once, in the key's order, gapless.
    let seqs: Vec<i64> = got.iter().map(|(s, _, _)| *s).collect();
    ensure!(
        seqs == (1..=got.len() as i64).collect::<Vec<_>>(),
        "sequences {seqs:?} of {types:?}"
    );
    ensure!(
        types[..2] == ["lanebus.handler.disabled", "lanebus.handler.enabled"],
        "{types:?}"
    );
    ensure!(
        got[0].2["reason"] == "api" && got[1].2["reason"] == "api",
        "{got:?}"
    );
    let count = |t: &str| types.iter().filter(|x| **x == t).count();
    ensure!(count("lanebus.handler.failing") == 1, "{types:?}");
    ensure!(
        count("lanebus.delivery.dead_lettered") == dead,
        "{dead} dead letters: {types:?}"
    );
    let pos = |pred: &dyn Fn(&(i64, String, Value)) -> bool| got.iter().position(pred);
    let failing = pos(&|(_, t, _)| t == "lanebus.handler.failing").context("failing")?;
    let auto = pos(&|(_, t, d)| t == "lanebus.handler.disabled" && d["reason"] == "failing")
        .with_context(|| format!("no auto-disable told: {got:?}"))?;
    ensure!(2 <= failing && failing < auto, "{types:?}");
    let f = &got[failing].2;
    ensure!(
        f["hour"] == 0 && f["handler_id"] == id && f["failing_since"].is_string(),
        "{f}"
    );
    let a = &got[auto].2;
    ensure!(
        a["handler_name"] == "orders" && a["failing_since"].is_string(),
        "{a}"
    );
    let d = &got
        .iter()
        .find(|(_, t, _)| t == "lanebus.delivery.dead_lettered")
        .context("a dead letter")?
        .2;
    ensure!(
        d["handler_id"] == id
            && d["attempts"] == 2
            && d["event_type"] == "orders.placed"
            && d["event_id"].as_str().is_some_and(|e| e.starts_with('e'))
            && d["last_error"].as_str().is_some_and(|e| e.contains("500")),
        "{d}"
    );

    // Signed like any event, once each; the catch-all got none of them.
    let log = rx.requests();
    ensure!(
        log.iter()
            .filter(|r| r.handler == "ops")
            .all(|r| r.signature_ok == Some(true)),
        "a bad signature"
    );
    ensure!(
        log.iter().all(|r| r.handler != "ops" || r.attempt == 1),
        "an operational event was repeated"
    );
    let leaked: Vec<&str> = log
        .iter()
        .filter(|r| r.handler == "all" && r.body.contains("\"type\":\"lanebus."))
        .map(|r| r.event_id.as_str())
        .collect();
    ensure!(leaked.is_empty(), "'*' received {leaked:?}");
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// A subscriber of `lanebus.*` that fails every request (and dead-letters
/// at once) creates no operational event about itself: only the failing
/// handler's events are stored, and their count stays put. Publishing a
/// `lanebus.` type through the API is refused.
async fn a_failing_subscriber_does_not_loop(backend: Backend) -> anyhow::Result<()> {
    let day = Duration::from_secs(24 * 3600);
    let (db, rx, node, api) = setup(backend, "opevents_loop", day).await?;
    let flaky = api
        .create_handler("flaky", &rx.url("flaky"), &["lanebus.*"], 1)
        .await?;
    let ops = api
        .create_handler("ops", &rx.url("ops"), &["lanebus.*"], 5)
        .await?;
    rx.set_secret("ops", &ops.secret);
    let target = api
        .create_handler("orders", &rx.url("orders"), &["orders.*"], 1)
        .await?;
    fail_always(&rx, "flaky");
    fail_always(&rx, "orders");

    let store = node.store();
    let (status, body) = api
        .post(
            "/v1/events",
            json!({"events": [{"type": "lanebus.handler.failing", "key": target.id, "payload": {}}]}),
        )
        .await?;
    ensure!(
        status == 422 && body["error"]["code"] == "invalid_event",
        "{status} {body}"
    );
    ensure!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("reserved")),
        "{body}"
    );
    ensure!(store.counts().await?.events == 0, "stored a refused event");

    let n = 5;
    api.publish(&orders("o", n), n).await?;
    // Told about orders: its failing (once) and its n dead letters; each
    // reaches ops, and dead-letters at flaky without a word about flaky.
    let want = 1 + n;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| {
            told(log, "ops", &target.id).len() >= want
        })
        .await,
        "told {:?}",
        told(&rx.requests(), "ops", &target.id)
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while api.dead_letters(&flaky.id).await?.len() < want {
        ensure!(Instant::now() < deadline, "flaky did not dead-letter all");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let settled = store.counts().await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let later = store.counts().await?;
    ensure!(
        later.events == settled.events && later.events == (n + want) as i64,
        "events {} then {}, want {}",
        settled.events,
        later.events,
        n + want
    );
    ensure!(later.dead_letters == (n + want) as i64, "{later:?}");
    let log = rx.requests();
    ensure!(
        told(&log, "ops", &flaky.id).is_empty(),
        "told about flaky: {:?}",
        told(&log, "ops", &flaky.id)
    );
    ensure!(
        told(&log, "ops", &target.id).len() == want,
        "{:?}",
        told(&log, "ops", &target.id)
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operational_events_reach_a_subscriber_in_order_sqlite() {
    operational_events_reach_a_subscriber_in_order(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operational_events_reach_a_subscriber_in_order_postgres() {
    operational_events_reach_a_subscriber_in_order(Backend::Postgres)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_subscriber_does_not_loop_sqlite() {
    a_failing_subscriber_does_not_loop(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_subscriber_does_not_loop_postgres() {
    a_failing_subscriber_does_not_loop(Backend::Postgres)
        .await
        .unwrap();
}
