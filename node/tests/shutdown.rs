//! A node's shutdown lets the store calls under way end before its runtime
//! goes. A call cut off half-way has an unknown outcome, and on MongoDB its
//! transaction stays open on the server: the driver aborts a dropped
//! session's transaction in a task of the runtime that is shutting down, so
//! never. The documents it wrote (lane documents, counters) then stay locked
//! until the server reaps the transaction (60 s on MongoDB; on the test
//! server only at its next transaction command, and a `dropDatabase` meeting
//! it deadlocks that server).

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use common::wrapped::Wrapped;
use common::{real_events, samples, test_options, Api, Backend, TestDb};
use lanebus_node::StoreSource;
use lanebus_testkit::receiver::Receiver;

/// A completion that takes longer than the node's drain is under way when
/// the node is shut down: the shutdown returns only once that call ended.
async fn shutdown_waits_for_store_calls_under_way(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "shutdown").await?;
    let store = Arc::new(Wrapped::new(
        lanebus_store::open(&db.url).await?,
        chrono::TimeDelta::zero(),
    ));
    let mut opts = test_options(&db.url);
    opts.drain_timeout = Duration::from_secs(1);
    // Twice the drain: the call is still under way when the drain ends.
    store.complete_delay_ms.store(2_000, SeqCst);
    opts.store = StoreSource::Opened(store.clone());
    let rx = Receiver::start().await?;
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    let (json, _) = real_events(&samples(), 20, 5, "shutdown");
    api.publish(&json, 100).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while store.complete_calls.load(SeqCst) == 0 {
        ensure!(Instant::now() < deadline, "no completion call began");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    node.shutdown().await?;
    let begun = store.complete_calls.load(SeqCst);
    let finished = store.complete_finished.load(SeqCst);
    ensure!(
        begun == finished,
        "{begun} completion calls began, {finished} ended: the shutdown cut calls off"
    );
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_store_calls_under_way_sqlite() {
    shutdown_waits_for_store_calls_under_way(Backend::Sqlite)
        .await
        .unwrap();
}
