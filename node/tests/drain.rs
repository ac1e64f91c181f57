//! Drain rate: the real-input stream published before the node starts, then
//! delivered to the receiver. Not a benchmark (see bench/); it reports
//! deliveries per second and checks exactness. Run with
//! `cargo test -p lanebus-node --test drain -- --ignored --nocapture`.

mod common;

use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{expected, real_events, samples, test_options, Backend, Registered, TestDb};
use lanebus_store::{handler_defaults, NewEvent, NewHandler};
use lanebus_testkit::receiver::Receiver;

async fn drain(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "drain").await?;
    let rx = Receiver::start().await?;
    let store = lanebus_store::open(&db.url).await?;
    let mut handlers = Vec::new();
    for (name, routes) in [("issues", vec!["issues.*"]), ("all", vec!["*"])] {
        let h = store
            .create_handler(NewHandler {
                name: name.into(),
                url: rx.url(name),
                event_types: routes.iter().map(|s| s.to_string()).collect(),
                max_attempts: handler_defaults::MAX_ATTEMPTS,
                timeout_ms: 5_000,
                max_in_flight: handler_defaults::MAX_IN_FLIGHT,
                secret: lanebus_store::generate_secret(),
                rate_limit: None,
                filter: None,
            })
            .await?;
        rx.set_secret(name, &h.secret);
        handlers.push(Registered {
            id: h.id,
            name: name.into(),
            secret: h.secret,
            routes: h.event_types,
        });
    }
    let keys: usize = std::env::var("LANEBUS_DRAIN_KEYS")
        .ok()
        .and_then(|k| k.parse().ok())
        .unwrap_or(20);
    let (_, events) = real_events(&samples(), 3290, keys, "drain");
    for chunk in events.chunks(100) {
        let batch = chunk
            .iter()
            .map(|e| NewEvent {
                id: Some(e.id.clone()),
                event_type: e.event_type.clone(),
                key: e.key.clone(),
                payload: e.payload.clone().into_bytes(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect();
        store.publish(batch).await?;
    }
    let exp = expected(&events, &handlers);
    let t0 = Instant::now();
    let node = lanebus_node::start(test_options(&db.url)).await?;
    let started = t0.elapsed().as_secs_f64();
    ensure!(
        rx.wait_accepted(exp.len(), Duration::from_secs(300)).await,
        "{:?}",
        rx.verdict(&exp)
    );
    let secs = t0.elapsed().as_secs_f64();
    let v = rx.verdict(&exp);
    println!(
        "{backend:?} drain: {} deliveries over {keys} keys in {secs:.2} s = {:.0} deliveries/s \
         (node start-up {started:.2} s; {:.0} deliveries/s after it)",
        exp.len(),
        exp.len() as f64 / secs,
        exp.len() as f64 / (secs - started)
    );
    ensure!(v.exact(), "{v:?}");
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run explicitly"]
async fn drain_sqlite() {
    drain(Backend::Sqlite).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run explicitly"]
async fn drain_postgres() {
    drain(Backend::Postgres).await.unwrap();
}
