//! A key whose head delivery keeps failing, or a disabled handler, must not
//! hold up the other keys of its lane, even when its own backlog is much
//! larger than the lane's buffer (issue 2: "a key waits while its head
//! delivery is retried, other keys keep flowing"). SQLite and PostgreSQL.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Context as _};
use common::{test_options, Api, Backend, TestDb};
use lanebus_store::{lane_of_key, HandlerState, NewEvent, NewHandler, DEFAULT_LANES};
use lanebus_testkit::receiver::{Action, Expected, Receiver, Rule};
use serde_json::Value;

const BUFFER: usize = 16;
const FAILING_EVENTS: usize = 120;
const OTHER_KEYS: usize = 6;
const OTHER_EVENTS_PER_KEY: usize = 8;

/// Keys sharing one lane: the failing key first, then `n` others.
fn keys_in_one_lane(n: usize) -> (String, Vec<String>) {
    let failing = "stuck-0".to_string();
    let lane = lane_of_key(&failing, DEFAULT_LANES);
    let others: Vec<String> = (1..)
        .map(|i| format!("flow-{i}"))
        .filter(|k| lane_of_key(k, DEFAULT_LANES) == lane)
        .take(n)
        .collect();
    (failing, others)
}

fn event(id: String, key: &str, i: usize) -> Value {
    serde_json::json!({"id": id, "type": "push", "key": key, "payload": {"n": i}})
}

async fn failing_key_does_not_hold_up_its_lane(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "blocked_key").await?;
    let rx = Receiver::start().await?;
    let mut opts = test_options(&db.url);
    opts.lane.buffer_cap = BUFFER;
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let h = api
        .create_handler("all", &rx.url("all"), &["*"], 100)
        .await?;
    rx.set_secret("all", &h.secret);

    let (failing, others) = keys_in_one_lane(OTHER_KEYS);
    rx.add_rule(Rule {
        handler: None,
        key: Some(failing.clone()),
        action: Action::Status {
            status: 500,
            retry_after: None,
        },
    });

    // The failing key's backlog first (many times the buffer, in small
    // transactions so no single claim returns all of it), then the others.
    let mut expected = Vec::new();
    let failing_events: Vec<Value> = (0..FAILING_EVENTS)
        .map(|i| {
            let id = format!("stuck-{i}");
            expected.push(Expected {
                handler: "all".into(),
                event_id: id.clone(),
                key: Some(failing.clone()),
            });
            event(id, &failing, i)
        })
        .collect();
    api.publish(&failing_events, 4).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .filter(|r| r.key.as_deref() == Some(failing.as_str()))
            .count()
            >= 2)
            .await,
        "the failing key was never attempted twice"
    );
    let mut other_events = Vec::new();
    let mut other_expected = Vec::new();
    for i in 0..OTHER_EVENTS_PER_KEY {
        for k in &others {
            let id = format!("{k}-{i}");
            other_expected.push(Expected {
                handler: "all".into(),
                event_id: id.clone(),
                key: Some(k.clone()),
            });
            other_events.push(event(id, k, i));
        }
    }
    api.publish(&other_events, 4).await?;

    // Every other key arrives while the failing key still fails.
    let others_done = rx
        .wait_until(Duration::from_secs(30), |log| {
            let accepted = log
                .iter()
                .filter(|r| r.accepted() && r.key.as_deref() != Some(failing.as_str()))
                .count();
            accepted >= other_expected.len()
        })
        .await;
    let held = node.state.board().held();
    ensure!(
        others_done,
        "other keys of the lane were held up behind the failing key: {:?} (node holds {held})",
        rx.verdict(&other_expected)
    );
    let reqs = rx.requests();
    ensure!(
        !reqs
            .iter()
            .any(|r| r.accepted() && r.key.as_deref() == Some(failing.as_str())),
        "the failing key was accepted while its receiver failed"
    );
    let attempts_while_failing = reqs
        .iter()
        .filter(|r| r.key.as_deref() == Some(failing.as_str()))
        .count();
    ensure!(
        attempts_while_failing >= 2,
        "the failing key was attempted {attempts_while_failing} times"
    );
    // Memory stays bounded while the key fails: at most twice the buffer
    // (plus the rest of one publish transaction on PostgreSQL).
    ensure!(held <= 2 * BUFFER + 4, "the node holds {held} deliveries");

    // The key recovers: everything arrives, in order, nothing lost or repeated.
    rx.clear_rules();
    expected.extend(other_expected);
    ensure!(
        rx.wait_accepted(expected.len(), Duration::from_secs(60))
            .await,
        "after recovery: {:?}",
        rx.verdict(&expected)
    );
    let v = rx.verdict(&expected);
    ensure!(v.exact(), "{v:?}");

    // No repeat without a failed attempt.
    let reqs = rx.requests();
    common::ensure_no_repeat_without_failure(&reqs)?;
    // Per key, requests in sequence order (a repeat only of the same head).
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for r in &reqs {
        let k = r.key.clone().context("key")?;
        let seq = r.sequence.context("lanebus-sequence")?;
        ensure!(
            last.get(&k).is_none_or(|&p| p <= seq),
            "key {k}: sequence {seq} after {:?}",
            last.get(&k)
        );
        last.insert(k, seq);
    }
    // The last completions may still be on their way to the store.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let counts = node.store().counts().await?;
        if counts.deliveries == 0 && counts.completions == expected.len() as i64 {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "store counts {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// A disabled handler's pending deliveries (many times the buffer) do not
/// hold up another handler in the same lane; enabled again, they all arrive
/// (those of events published while it was disabled too), in order.
async fn disabled_handler_does_not_hold_up_its_lane(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "disabled_handler").await?;
    let rx = Receiver::start().await?;
    let (first, others) = keys_in_one_lane(OTHER_KEYS);
    // Before the node starts: a handler with a backlog, then disabled.
    let store = lanebus_store::open(&db.url).await?;
    let paused = store
        .create_handler(NewHandler {
            name: "paused".into(),
            url: rx.url("paused"),
            event_types: vec!["*".into()],
            max_attempts: 8,
            timeout_ms: 5000,
            max_in_flight: 64,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    rx.set_secret("paused", &paused.secret);
    let mut expected = Vec::new();
    let keys: Vec<&String> = std::iter::once(&first)
        .chain(others.iter().take(2))
        .collect();
    for chunk in (0..FAILING_EVENTS).collect::<Vec<_>>().chunks(4) {
        let mut batch = Vec::new();
        for &i in chunk {
            let key = keys[i % keys.len()];
            let id = format!("paused-{i}");
            expected.push(Expected {
                handler: "paused".into(),
                event_id: id.clone(),
                key: Some(key.clone()),
            });
            batch.push(NewEvent {
                id: Some(id),
                event_type: "push".into(),
                key: Some(key.clone()),
                payload: format!("{{\"n\":{i}}}").into_bytes(),
                deliver_at: None,
                expected_seq: None,
            });
        }
        store.publish(batch).await?;
    }
    store
        .set_handler_state(&paused.id, HandlerState::Disabled)
        .await?;
    drop(store);

    let mut opts = test_options(&db.url);
    opts.lane.buffer_cap = BUFFER;
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let live = api
        .create_handler("live", &rx.url("live"), &["*"], 8)
        .await?;
    rx.set_secret("live", &live.secret);
    let mut live_events = Vec::new();
    let mut live_expected = Vec::new();
    for i in 0..OTHER_EVENTS_PER_KEY {
        for k in std::iter::once(&first).chain(others.iter()) {
            let id = format!("live-{k}-{i}");
            live_expected.push(Expected {
                handler: "live".into(),
                event_id: id.clone(),
                key: Some(k.clone()),
            });
            live_events.push(event(id, k, i));
        }
    }
    api.publish(&live_events, 4).await?;
    let live_done = rx
        .wait_accepted(live_expected.len(), Duration::from_secs(30))
        .await;
    ensure!(
        live_done,
        "the live handler was held up behind the disabled one: {:?} (node holds {})",
        rx.verdict(&live_expected),
        node.state.board().held()
    );
    ensure!(
        rx.requests().iter().all(|r| r.handler == "live"),
        "a disabled handler was attempted"
    );
    ensure!(node.state.board().held() <= 2 * BUFFER + 4);

    node.store()
        .set_handler_state(&paused.id, HandlerState::Enabled)
        .await?;
    // The live events published while it was disabled are kept for the
    // paused handler too (its routes match), after its earlier ones.
    expected.extend(live_expected.iter().map(|e| Expected {
        handler: "paused".into(),
        ..e.clone()
    }));
    expected.extend(live_expected);
    ensure!(
        rx.wait_accepted(expected.len(), Duration::from_secs(60))
            .await,
        "after enabling: {:?}",
        rx.verdict(&expected)
    );
    let v = rx.verdict(&expected);
    ensure!(v.exact(), "{v:?}");
    let reqs = rx.requests();
    ensure!(
        reqs.len() == expected.len(),
        "{} requests for {} deliveries: repeats without a cause",
        reqs.len(),
        expected.len()
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_handler_does_not_hold_up_its_lane_sqlite() {
    disabled_handler_does_not_hold_up_its_lane(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_handler_does_not_hold_up_its_lane_postgres() {
    disabled_handler_does_not_hold_up_its_lane(Backend::Postgres)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_key_does_not_hold_up_its_lane_sqlite() {
    failing_key_does_not_hold_up_its_lane(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_key_does_not_hold_up_its_lane_postgres() {
    failing_key_does_not_hold_up_its_lane(Backend::Postgres)
        .await
        .unwrap();
}
