//! A node's shutdown lets the store calls under way end before its runtime
//! goes. A call cut off half-way has an unknown outcome, and on MongoDB its
//! transaction stays open on the server: the driver aborts a dropped
//! session's transaction in a task of the runtime that is shutting down, so
//! never. The documents it wrote (lane documents, counters) then stay locked
//! until the server reaps the transaction (60 s on MongoDB; on the test
//! server only at its next transaction command, and a `dropDatabase` meeting
//! it deadlocks that server).

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::ensure;
use common::wrapped::Wrapped;
use common::{real_events, samples, test_options, Api, Backend, TestDb};
use lanebus_node::{NodeHandle, StoreSource};
use lanebus_testkit::receiver::Receiver;

/// A node on a wrapped store of `backend` with a drain of 1 s.
async fn wrapped_node(
    backend: Backend,
    name: &str,
) -> anyhow::Result<(TestDb, Arc<Wrapped>, NodeHandle, Api)> {
    let db = TestDb::new(backend, name).await?;
    let store = Arc::new(Wrapped::new(
        lanebus_store::open(&db.url).await?,
        chrono::TimeDelta::zero(),
    ));
    let mut opts = test_options(&db.url);
    opts.drain_timeout = Duration::from_secs(1);
    opts.store = StoreSource::Opened(store.clone());
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    Ok((db, store, node, api))
}

/// Waits until `calls` counts a call begun.
async fn began(calls: &AtomicU64, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while calls.load(SeqCst) == 0 {
        ensure!(Instant::now() < deadline, "no {what} call began");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Publishes 20 events to a handler that takes them all, on a node whose
/// completions each take `delay_ms`, and returns once a completion began.
async fn completing_node(
    backend: Backend,
    name: &str,
    delay_ms: u64,
) -> anyhow::Result<(TestDb, Arc<Wrapped>, NodeHandle)> {
    let (db, store, node, api) = wrapped_node(backend, name).await?;
    store.complete_delay_ms.store(delay_ms, SeqCst);
    let rx = Receiver::start().await?;
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    let (json, _) = real_events(&samples(), 20, 5, name);
    api.publish(&json, 100).await?;
    began(&store.complete_calls, "completion").await?;
    Ok((db, store, node))
}

/// A completion that takes longer than the node's drain is under way when
/// the node is shut down: the shutdown returns only once that call ended.
async fn shutdown_waits_for_store_calls_under_way(backend: Backend) -> anyhow::Result<()> {
    // Twice the drain: the call is still under way when the drain ends.
    let (db, store, node) = completing_node(backend, "shutdown", 2_000).await?;
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

/// A store call that hangs far past the drain (here a completion of 60 s,
/// the store actor's call timeout; in production a statement blocked by a
/// lock) does not hold the stop: the node waits for it until the drain's
/// deadline plus a grace of 5 s, then stops. The deliveries it would have
/// completed stay in the store for the next owner.
async fn shutdown_is_bounded_by_a_hung_store_call(backend: Backend) -> anyhow::Result<()> {
    let (db, store, node) = completing_node(backend, "shutdown_hung", 60_000).await?;
    let stopping = Instant::now();
    node.shutdown().await?;
    let took = stopping.elapsed();
    // Drain 1 s + grace 5 s, with room for a loaded machine; far below the
    // 60 s the call would hold it.
    ensure!(
        took < Duration::from_secs(30),
        "the stop took {took:?}: it waited for the hung store call"
    );
    ensure!(
        store.complete_finished.load(SeqCst) == 0,
        "the hung completion ended"
    );
    db.drop_db().await;
    Ok(())
}

/// A publish under way when the node is told to stop is answered (here
/// `202`, its events stored), not cut off with the connection: the client
/// of a cut-off publish cannot tell whether it was stored.
async fn a_publish_under_way_at_stop_is_answered(backend: Backend) -> anyhow::Result<()> {
    let (db, store, node, api) = wrapped_node(backend, "shutdown_publish").await?;
    store.publish_delay_ms.store(2_000, SeqCst);
    let (json, _) = real_events(&samples(), 5, 5, "shutdown_publish");
    let publish = tokio::spawn(async move { api.publish(&json, 100).await });
    began(&store.publish_calls, "publish").await?;
    node.shutdown().await?;
    let answer = publish.await?;
    ensure!(
        answer.is_ok(),
        "the publish under way at stop was not answered: {answer:?}"
    );
    ensure!(store.publish_finished.load(SeqCst) == 1);
    ensure!(store.inner.counts().await?.events == 5);
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_under_way_at_stop_is_answered_sqlite() {
    a_publish_under_way_at_stop_is_answered(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_by_a_hung_store_call_sqlite() {
    shutdown_is_bounded_by_a_hung_store_call(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_store_calls_under_way_sqlite() {
    shutdown_waits_for_store_calls_under_way(Backend::Sqlite)
        .await
        .unwrap();
}
