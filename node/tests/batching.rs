//! The store actor turns many small requests into few statements: one claim
//! per tick for every lane that asked, one bulk completion per tick.
//! Checked by counting the calls that reach a real store.

mod common;

use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use common::wrapped::Wrapped;
use common::{expected, real_events, samples, test_options, Api, Backend, TestDb};
use lanebus_node::StoreSource;
use lanebus_testkit::receiver::Receiver;

async fn batched(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "batching").await?;
    let counting = Arc::new(Wrapped::new(
        lanebus_store::open(&db.url).await?,
        chrono::TimeDelta::zero(),
    ));
    let rx = Receiver::start().await?;
    let mut opts = test_options(&db.url);
    opts.store = StoreSource::Opened(counting.clone());
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    let (json, events) = real_events(&samples(), 2_000, 500, "batch");
    let exp = expected(&events, std::slice::from_ref(&h));
    api.publish(&json, 200).await?;
    ensure!(
        rx.wait_accepted(exp.len(), Duration::from_secs(60)).await,
        "{:?}",
        rx.verdict(&exp)
    );
    node.shutdown().await?;
    let (cc, cl) = (
        counting.claim_calls.load(SeqCst),
        counting.claim_lanes.load(SeqCst),
    );
    let (kc, ki) = (
        counting.complete_calls.load(SeqCst),
        counting.complete_items.load(SeqCst),
    );
    println!(
        "{backend:?}: {cc} claim calls for {cl} lane claims ({:.1} lanes per call); \
         {kc} complete calls for {ki} completions ({:.1} per call)",
        cl as f64 / cc as f64,
        ki as f64 / kc as f64
    );
    ensure!(
        ki >= exp.len() as u64,
        "{ki} completions for {} deliveries",
        exp.len()
    );
    ensure!(
        cl as f64 / cc as f64 > 2.0,
        "claims are not batched: {cc} calls for {cl} lane claims"
    );
    ensure!(
        ki as f64 / kc as f64 > 2.0,
        "completions are not batched: {kc} calls for {ki} items"
    );
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_calls_are_batched_sqlite() {
    batched(Backend::Sqlite).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_calls_are_batched_postgres() {
    batched(Backend::Postgres).await.unwrap();
}
