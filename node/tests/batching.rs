//! The store actor turns many small requests into few statements: one claim
//! per tick for every lane that asked, one bulk completion per tick.
//! Checked by counting the calls that reach a real store.

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use anyhow::ensure;
use async_trait::async_trait;
use common::{expected, real_events, samples, test_options, Api, Backend, TestDb};
use lanebus_testkit::receiver::Receiver;
use lanebus_node::StoreSource;
use lanebus_store::*;

/// Delegates to a real store and counts batched calls and their items.
struct Counting {
    inner: Arc<dyn Store>,
    claim_calls: AtomicU64,
    claim_lanes: AtomicU64,
    complete_calls: AtomicU64,
    complete_items: AtomicU64,
}

#[async_trait]
impl Store for Counting {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn lanes(&self) -> u16 {
        self.inner.lanes()
    }
    async fn publish(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        self.inner.publish(events).await
    }
    async fn fence(&self, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool> {
        self.inner.fence(lane, owner, epoch).await
    }
    async fn claim(&self, lanes: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
        self.claim_calls.fetch_add(1, SeqCst);
        self.claim_lanes.fetch_add(lanes.len() as u64, SeqCst);
        self.inner.claim(lanes).await
    }
    async fn complete(&self, done: &[DeliveryRef]) -> Result<Vec<i64>> {
        self.complete_calls.fetch_add(1, SeqCst);
        self.complete_items.fetch_add(done.len() as u64, SeqCst);
        self.inner.complete(done).await
    }
    async fn reschedule(&self, items: &[Reschedule]) -> Result<Vec<i64>> {
        self.inner.reschedule(items).await
    }
    async fn dead_letter(&self, items: &[DeadLetterRequest]) -> Result<Vec<i64>> {
        self.inner.dead_letter(items).await
    }
    async fn create_handler(&self, handler: NewHandler) -> Result<Handler> {
        self.inner.create_handler(handler).await
    }
    async fn list_handlers(&self) -> Result<Vec<Handler>> {
        self.inner.list_handlers().await
    }
    async fn get_handler(&self, id: &str) -> Result<Handler> {
        self.inner.get_handler(id).await
    }
    async fn delete_handler(&self, id: &str) -> Result<DeletedHandler> {
        self.inner.delete_handler(id).await
    }
    async fn list_dead_letters(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>> {
        self.inner.list_dead_letters(filter).await
    }
    async fn replay_dead_letters(&self, ids: &[i64], handler_id: Option<&str>) -> Result<u64> {
        self.inner.replay_dead_letters(ids, handler_id).await
    }
    async fn lane_rows(&self) -> Result<Vec<LaneRow>> {
        self.inner.lane_rows().await
    }
    async fn counts(&self) -> Result<StoreCounts> {
        self.inner.counts().await
    }
    async fn ping(&self) -> Result<()> {
        self.inner.ping().await
    }
    async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        self.inner.now().await
    }
    async fn wakeups(&self) -> Result<Wakeups> {
        self.inner.wakeups().await
    }
}

async fn batched(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "batching").await?;
    let counting = Arc::new(Counting {
        inner: lanebus_store::open(&db.url).await?,
        claim_calls: AtomicU64::new(0),
        claim_lanes: AtomicU64::new(0),
        complete_calls: AtomicU64::new(0),
        complete_items: AtomicU64::new(0),
    });
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
