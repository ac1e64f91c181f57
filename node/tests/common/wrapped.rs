//! A store wrapper for node tests that watch or skew what a real store does.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

use async_trait::async_trait;
use lanebus_store::*;

/// Delegates to a real store, counting batched calls and their items, and
/// shows a clock `ahead` of the real store's (its [`Store::now`], and
/// retention cutoffs shifted back by as much), standing for a database
/// server whose clock differs from the node's.
pub struct Wrapped {
    pub inner: Arc<dyn Store>,
    /// How far the store's clock runs ahead of the real one.
    pub ahead: chrono::TimeDelta,
    pub claim_calls: AtomicU64,
    pub claim_lanes: AtomicU64,
    pub complete_calls: AtomicU64,
    pub complete_items: AtomicU64,
    /// Completion calls that returned (began: `complete_calls`).
    pub complete_finished: AtomicU64,
    /// How long each completion call waits before it reaches the store
    /// (milliseconds; 0 by default), standing for a slow database.
    pub complete_delay_ms: AtomicU64,
    /// Publish calls that began, and that returned.
    pub publish_calls: AtomicU64,
    pub publish_finished: AtomicU64,
    /// How long each publish waits before it reaches the store
    /// (milliseconds; 0 by default).
    pub publish_delay_ms: AtomicU64,
}

impl Wrapped {
    /// `inner`, with a clock `ahead` of its own.
    pub fn new(inner: Arc<dyn Store>, ahead: chrono::TimeDelta) -> Self {
        Wrapped {
            inner,
            ahead,
            claim_calls: AtomicU64::new(0),
            claim_lanes: AtomicU64::new(0),
            complete_calls: AtomicU64::new(0),
            complete_items: AtomicU64::new(0),
            complete_finished: AtomicU64::new(0),
            complete_delay_ms: AtomicU64::new(0),
            publish_calls: AtomicU64::new(0),
            publish_finished: AtomicU64::new(0),
            publish_delay_ms: AtomicU64::new(0),
        }
    }
}

/// Sleeps for the milliseconds in `delay_ms` (none for 0).
async fn pause(delay_ms: &AtomicU64) {
    let delay = delay_ms.load(SeqCst);
    if delay > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
    }
}

#[async_trait]
impl Store for Wrapped {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn lanes(&self) -> u16 {
        self.inner.lanes()
    }
    fn keyring(&self) -> &personal::Keyring {
        self.inner.keyring()
    }

    async fn subject_keys(&self, subjects: &[String]) -> Result<Vec<personal::WrappedKey>> {
        self.inner.subject_keys(subjects).await
    }

    async fn insert_subject_keys(&self, keys: &[personal::WrappedKey]) -> Result<()> {
        self.inner.insert_subject_keys(keys).await
    }

    async fn delete_subject_key(&self, subject: &str) -> Result<bool> {
        self.inner.delete_subject_key(subject).await
    }

    async fn all_subject_keys(&self) -> Result<Vec<personal::WrappedKey>> {
        self.inner.all_subject_keys().await
    }

    async fn replace_subject_key(
        &self,
        old: &personal::WrappedKey,
        new: &personal::WrappedKey,
    ) -> Result<bool> {
        self.inner.replace_subject_key(old, new).await
    }

    async fn publish(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        self.publish_calls.fetch_add(1, SeqCst);
        pause(&self.publish_delay_ms).await;
        let out = self.inner.publish(events).await;
        self.publish_finished.fetch_add(1, SeqCst);
        out
    }
    async fn publish_operational(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        self.inner.publish_operational(events).await
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
        pause(&self.complete_delay_ms).await;
        let out = self.inner.complete(done).await;
        self.complete_finished.fetch_add(1, SeqCst);
        out
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
    async fn create_event_type(&self, new: NewEventType) -> Result<EventType> {
        self.inner.create_event_type(new).await
    }
    async fn list_event_types(&self) -> Result<Vec<EventType>> {
        self.inner.list_event_types().await
    }
    async fn update_event_type(&self, name: &str, patch: &EventTypePatch) -> Result<EventType> {
        self.inner.update_event_type(name, patch).await
    }
    async fn catalog_settings(&self) -> Result<CatalogSettings> {
        self.inner.catalog_settings().await
    }
    async fn set_catalog_settings(&self, settings: CatalogSettings) -> Result<CatalogSettings> {
        self.inner.set_catalog_settings(settings).await
    }
    async fn replay_dead_letters(&self, ids: &[i64], handler_id: Option<&str>) -> Result<u64> {
        self.inner.replay_dead_letters(ids, handler_id).await
    }
    async fn discard(&self, refs: &[DeliveryRef]) -> Result<Vec<i64>> {
        self.inner.discard(refs).await
    }
    async fn change_handler_state(
        &self,
        id: &str,
        state: HandlerState,
        reason: &str,
    ) -> Result<StateChange> {
        self.inner.change_handler_state(id, state, reason).await
    }
    async fn update_handler(&self, id: &str, patch: &HandlerPatch) -> Result<Handler> {
        self.inner.update_handler(id, patch).await
    }
    async fn rotate_handler_secret(
        &self,
        id: &str,
        secret: &str,
        previous_until: chrono::DateTime<chrono::Utc>,
    ) -> Result<Handler> {
        self.inner
            .rotate_handler_secret(id, secret, previous_until)
            .await
    }
    async fn mark_handler_failing(
        &self,
        id: &str,
        failing: bool,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<()> {
        self.inner.mark_handler_failing(id, failing, at).await
    }
    async fn replay_dead_letters_between(
        &self,
        handler_id: &str,
        failed_since: Option<chrono::DateTime<chrono::Utc>>,
        failed_until: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<u64> {
        self.inner
            .replay_dead_letters_between(handler_id, failed_since, failed_until)
            .await
    }
    async fn recover(
        &self,
        handler_id: &str,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<RecoverOutcome> {
        self.inner.recover(handler_id, since).await
    }
    async fn prune(&self, before: chrono::DateTime<chrono::Utc>, limit: u32) -> Result<Pruned> {
        // Its rows carry its own clock: shift the cutoff back to the real one.
        self.inner.prune(before - self.ahead, limit).await
    }
    async fn lane_rows(&self) -> Result<Vec<LaneRow>> {
        self.inner.lane_rows().await
    }
    async fn counts(&self) -> Result<StoreCounts> {
        self.inner.counts().await
    }
    async fn lookup_event(&self, id: &str) -> Result<Option<EventLookup>> {
        self.inner.lookup_event(id).await
    }
    async fn handler_deliveries(
        &self,
        q: &HandlerDeliveriesQuery,
    ) -> Result<Vec<HandlerDeliveryItem>> {
        self.inner.handler_deliveries(q).await
    }
    async fn ping(&self) -> Result<()> {
        self.inner.ping().await
    }
    async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        Ok(self.inner.now().await? + self.ahead)
    }
    async fn wakeups(&self) -> Result<Wakeups> {
        self.inner.wakeups().await
    }
}
