//! In-process handlers (docs/design.md section 7) go through the same path as
//! webhooks: per-key order, retries with the attempt count, completion.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::ensure;
use async_trait::async_trait;
use common::{test_options, Api, Backend, TestDb};
use lanebus_node::{Handler, HandlerError};
use lanebus_store::{Delivery, NewHandler};

/// (event id, key, sequence, attempts made before this one).
type Call = (String, Option<String>, Option<i64>, u32);

/// Records every hand-over; fails the first attempt of keys in `fail_keys`.
#[derive(Default)]
struct Recorder {
    log: Mutex<Vec<Call>>,
    fail_keys: Vec<String>,
}

#[async_trait]
impl Handler for Recorder {
    async fn handle(&self, d: &Delivery) -> Result<(), HandlerError> {
        self.log
            .lock()
            .unwrap()
            .push((d.event_id.clone(), d.key.clone(), d.seq, d.attempts));
        if d.attempts == 0 && d.key.as_ref().is_some_and(|k| self.fail_keys.contains(k)) {
            return Err(HandlerError::new("first attempt fails on purpose"));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_handlers_keep_order_and_retry_sqlite() {
    run().await.unwrap();
}

async fn run() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "inproc").await?;
    let recorder = Arc::new(Recorder {
        fail_keys: vec!["k-0".into()],
        ..Recorder::default()
    });
    let mut opts = test_options(&db.url);
    opts.in_process
        .insert("recorder".into(), recorder.clone() as Arc<dyn Handler>);
    let node = lanebus_node::start(opts).await?;
    // In-process handlers are registered from Rust, through the store.
    node.store()
        .create_handler(NewHandler {
            name: "recorder".into(),
            url: "http://inproc.invalid/recorder".into(),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms: 1_000,
            max_in_flight: 16,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    lanebus_api::NodeView::handlers_changed(&*node.state);
    let api = Api::new(&node.base_url());
    let events: Vec<serde_json::Value> = (0..100)
        .map(|i| serde_json::json!({"id": format!("ip-{i}"), "type": "order.placed", "key": format!("k-{}", i % 5), "payload": {"i": i}}))
        .collect();
    api.publish(&events, 50).await?;

    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while node.store().counts().await?.completions < 100 {
        ensure!(
            std::time::Instant::now() < deadline,
            "in-process deliveries did not complete"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = recorder.log.lock().unwrap().clone();
    let mut per_key: HashMap<String, Vec<(i64, u32)>> = HashMap::new();
    for (_, key, seq, attempts) in &log {
        per_key
            .entry(key.clone().unwrap_or_default())
            .or_default()
            .push((seq.unwrap_or(0), *attempts));
    }
    for (k, v) in &per_key {
        ensure!(
            v.windows(2).all(|w| w[0].0 <= w[1].0),
            "key {k} out of order: {v:?}"
        );
        let expected_calls = if k == "k-0" { 40 } else { 20 };
        ensure!(
            v.len() == expected_calls,
            "key {k}: {} calls, expected {expected_calls}",
            v.len()
        );
        if k == "k-0" {
            ensure!(
                v.chunks(2)
                    .all(|c| c[0].1 == 0 && c[1].1 == 1 && c[0].0 == c[1].0),
                "k-0 retries: {v:?}"
            );
        }
    }
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// Counts concurrent hand-overs.
#[derive(Default)]
struct Gauge {
    now: std::sync::atomic::AtomicUsize,
    max: std::sync::atomic::AtomicUsize,
    done: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Handler for Gauge {
    async fn handle(&self, _: &Delivery) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering::SeqCst;
        let n = self.now.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(n, SeqCst);
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.now.fetch_sub(1, SeqCst);
        self.done.fetch_add(1, SeqCst);
        Ok(())
    }
}

/// `max_in_flight` bounds a handler's concurrent attempts on the node, across
/// lanes and keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_in_flight_bounds_concurrency_across_lanes_sqlite() {
    max_in_flight().await.unwrap();
}

async fn max_in_flight() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "inflight").await?;
    let gauge = Arc::new(Gauge::default());
    let mut opts = test_options(&db.url);
    opts.in_process
        .insert("gauge".into(), gauge.clone() as Arc<dyn Handler>);
    let node = lanebus_node::start(opts).await?;
    node.store()
        .create_handler(NewHandler {
            name: "gauge".into(),
            url: "http://inproc.invalid/gauge".into(),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms: 1_000,
            max_in_flight: 3,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    lanebus_api::NodeView::handlers_changed(&*node.state);
    // Unkeyed events spread over the lanes, plus many keys.
    let events: Vec<serde_json::Value> = (0..200)
        .map(|i| {
            let mut e = serde_json::json!({"id": format!("mf-{i}"), "type": "t.x", "payload": {}});
            if i % 2 == 0 {
                e["key"] = serde_json::json!(format!("k-{i}"));
            }
            e
        })
        .collect();
    Api::new(&node.base_url()).publish(&events, 100).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while gauge.done.load(std::sync::atomic::Ordering::SeqCst) < 200 {
        ensure!(
            std::time::Instant::now() < deadline,
            "deliveries did not complete"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let max = gauge.max.load(std::sync::atomic::Ordering::SeqCst);
    ensure!((1..=3).contains(&max), "{max} concurrent attempts, limit 3");
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// Counts hand-overs per event; each takes `hold` (so a shutdown finds
/// them in flight).
struct Slow {
    calls: Mutex<HashMap<String, u32>>,
    hold: Duration,
}

#[async_trait]
impl Handler for Slow {
    async fn handle(&self, d: &Delivery) -> Result<(), HandlerError> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(d.event_id.clone())
            .or_default() += 1;
        tokio::time::sleep(self.hold).await;
        Ok(())
    }
}

/// A shutdown whose drain lasts longer than lane control's one-second
/// re-apply starts no second owner of a lane: deliveries still in flight
/// are handed over once (invariant "no repeat without a cause"). Before the
/// fix the emptied owner map read as "start every lane", and the new owners
/// (same epoch, fresh queues) claimed and handed over the in-flight rows
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drain_hands_nothing_over_twice_sqlite() {
    shutdown_drain().await.unwrap();
}

async fn shutdown_drain() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "drainonce").await?;
    let slow = Arc::new(Slow {
        calls: Mutex::default(),
        hold: Duration::from_millis(2_500),
    });
    let mut opts = test_options(&db.url);
    opts.drain_timeout = Duration::from_secs(6);
    opts.in_process
        .insert("slow".into(), slow.clone() as Arc<dyn Handler>);
    let node = lanebus_node::start(opts).await?;
    node.store()
        .create_handler(NewHandler {
            name: "slow".into(),
            url: "http://inproc.invalid/slow".into(),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms: 10_000,
            max_in_flight: 100,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    lanebus_api::NodeView::handlers_changed(&*node.state);
    let events: Vec<serde_json::Value> = (0..20)
        .map(|i| serde_json::json!({"id": format!("dr-{i}"), "type": "t.x", "payload": {}}))
        .collect();
    Api::new(&node.base_url()).publish(&events, 20).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while slow.calls.lock().unwrap().len() < 20 {
        ensure!(
            std::time::Instant::now() < deadline,
            "deliveries were not handed over"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // All 20 are in flight (each holds 2.5 s): the drain outlasts a re-apply.
    node.shutdown().await?;
    let calls = slow.calls.lock().unwrap().clone();
    let repeated: Vec<_> = calls.iter().filter(|(_, &n)| n > 1).collect();
    ensure!(
        repeated.is_empty(),
        "handed over more than once during the drain: {repeated:?}"
    );
    // A fresh store: the node's pooled connections died with its runtime.
    let counts = lanebus_store::open(&db.url).await?.counts().await?;
    ensure!(
        counts.completions == 20 && counts.deliveries == 0,
        "after the drain: {counts:?}"
    );
    db.drop_db().await;
    Ok(())
}
