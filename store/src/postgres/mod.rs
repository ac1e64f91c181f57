//! PostgreSQL backend (being written; this stub only keeps the workspace compiling).

use async_trait::async_trait;

use crate::*;

/// The PostgreSQL store (stub: every call fails with [`StoreError::Unavailable`]).
#[derive(Debug)]
pub struct PgStore {
    lanes: u16,
}

fn todo_err() -> StoreError {
    StoreError::Unavailable("the postgres backend is not implemented yet".into())
}

impl PgStore {
    /// Connects and migrates (stub: always fails).
    ///
    /// # Errors
    /// Always [`StoreError::Unavailable`] for now.
    pub async fn connect(_url: &str) -> Result<Self> {
        Err(todo_err())
    }
}

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }
    fn lanes(&self) -> u16 {
        self.lanes
    }
    async fn publish(&self, _events: Vec<NewEvent>) -> Result<PublishOutcome> {
        Err(todo_err())
    }
    async fn fence(&self, _lane: Lane, _owner: &str, _epoch: Epoch) -> Result<bool> {
        Err(todo_err())
    }
    async fn claim(&self, _lanes: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
        Err(todo_err())
    }
    async fn complete(&self, _done: &[DeliveryRef]) -> Result<Vec<i64>> {
        Err(todo_err())
    }
    async fn reschedule(&self, _items: &[Reschedule]) -> Result<Vec<i64>> {
        Err(todo_err())
    }
    async fn dead_letter(&self, _items: &[DeadLetterRequest]) -> Result<Vec<i64>> {
        Err(todo_err())
    }
    async fn create_handler(&self, _handler: NewHandler) -> Result<Handler> {
        Err(todo_err())
    }
    async fn list_handlers(&self) -> Result<Vec<Handler>> {
        Err(todo_err())
    }
    async fn get_handler(&self, _id: &str) -> Result<Handler> {
        Err(todo_err())
    }
    async fn delete_handler(&self, _id: &str) -> Result<u64> {
        Err(todo_err())
    }
    async fn list_dead_letters(&self, _filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>> {
        Err(todo_err())
    }
    async fn replay_dead_letters(&self, _ids: &[i64], _handler_id: Option<&str>) -> Result<u64> {
        Err(todo_err())
    }
    async fn lane_rows(&self) -> Result<Vec<LaneRow>> {
        Err(todo_err())
    }
    async fn counts(&self) -> Result<StoreCounts> {
        Err(todo_err())
    }
    async fn ping(&self) -> Result<()> {
        Err(todo_err())
    }
    async fn wakeups(&self) -> Result<Wakeups> {
        Err(todo_err())
    }
}
