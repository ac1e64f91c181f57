//! The node-wide budget of buffered payload bytes (`--buffer-bytes`): with
//! a backlog of large payloads the lanes hold at most the budget plus one
//! payload per lane, and everything still arrives, in order per key, also
//! with a disabled handler's backlog in the same lanes.

mod common;

use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{test_options, Backend, TestDb};
use lanebus_store::{NewEvent, NewHandler};
use lanebus_testkit::receiver::{Action, Expected, Receiver, Rule};

const PAYLOAD: usize = 256 << 10;
const EVENTS: usize = 160;
const KEYS: usize = 8;
const BUDGET: usize = 4 << 20;

async fn large_backlog_stays_within_the_budget(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "buffer_budget").await?;
    let rx = Receiver::start().await?;
    rx.add_rule(Rule {
        handler: Some("big".into()),
        key: None,
        action: Action::Delay(Duration::from_millis(20)),
    });
    // The backlog is stored before the node starts: 40 MiB of payloads, for
    // "big" and for "off" (disabled once its deliveries exist).
    let store = lanebus_store::open(&db.url).await?;
    let h = store
        .create_handler(NewHandler {
            name: "big".into(),
            url: rx.url("big"),
            event_types: vec!["*".into()],
            max_attempts: 8,
            timeout_ms: 10_000,
            max_in_flight: 64,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    rx.set_secret("big", &h.secret);
    // A disabled handler's backlog (same events, "push" only): kept in the store, it must
    // not pin the budget (stalled deliveries are trimmed when it is spent).
    let off = store
        .create_handler(NewHandler {
            name: "off".into(),
            url: rx.url("off"),
            event_types: vec!["push".into()],
            max_attempts: 8,
            timeout_ms: 10_000,
            max_in_flight: 64,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    let filler = "x".repeat(PAYLOAD - 20);
    let mut expected = Vec::new();
    // One event per transaction (a PostgreSQL claim returns the rest of a
    // publishing transaction whole, past its limit).
    for i in 0..EVENTS {
        let key = format!("big-{}", i % KEYS);
        let id = format!("big-{i}");
        expected.push(Expected {
            handler: "big".into(),
            event_id: id.clone(),
            key: Some(key.clone()),
        });
        store
            .publish(vec![NewEvent {
                id: Some(id),
                event_type: "push".into(),
                key: Some(key),
                payload: format!("{{\"n\":{i},\"f\":\"{filler}\"}}").into_bytes(),
                deliver_at: None,
                expected_seq: None,
            }])
            .await?;
    }
    store
        .set_handler_state(&off.id, lanebus_store::HandlerState::Disabled)
        .await?;
    drop(store);

    let mut opts = test_options(&db.url);
    opts.lane.buffer_bytes = BUDGET;
    let node = lanebus_node::start(opts).await?;
    let budget = node.state.board().budget();
    // At most one payload over per lane holding something (8 keys: at most
    // 8 lanes).
    let bound = BUDGET + KEYS * PAYLOAD;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut max_held = 0;
    while rx.accepted_distinct() < EVENTS {
        max_held = max_held.max(budget.held());
        ensure!(
            Instant::now() < deadline,
            "not delivered: {:?}",
            rx.verdict(&expected)
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    ensure!(
        max_held <= bound,
        "held {max_held} payload bytes, over the budget of {BUDGET} (+ one payload per lane)"
    );
    ensure!(max_held >= PAYLOAD, "the budget gauge never moved");
    let v = rx.verdict(&expected);
    ensure!(v.exact(), "{v:?}");
    ensure!(
        rx.requests().iter().all(|r| r.handler == "big"),
        "the disabled handler was attempted"
    );
    // What stays held (the disabled handler's kept backlog) stays within
    // the budget.
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(
        budget.held() <= bound,
        "{} bytes held after the run",
        budget.held()
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_backlog_stays_within_the_budget_sqlite() {
    large_backlog_stays_within_the_budget(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_backlog_stays_within_the_budget_postgres() {
    large_backlog_stays_within_the_budget(Backend::Postgres)
        .await
        .unwrap();
}
