//! The transactional outbox: the application writes its own row and
//! publishes the event in one database transaction, so the event exists if
//! and only if the row does (docs/design.md invariant 5). No second write, no
//! dual-write gap, no polling table of the application's own.
//!
//! ```text
//! BEGIN
//!   INSERT INTO orders ...                  the application's write
//!   store.publish_in(&mut tx, [order.placed])   lanebus's rows, same tx
//! COMMIT                                    both, or (ROLLBACK) neither
//! ```
//!
//! PostgreSQL ([`PgStore::publish_in`], then [`PgStore::wake_after_commit`]
//! after the commit) and SQLite ([`SqliteStore::publish_in`]) take the
//! caller's sqlx transaction;
//! MongoDB takes a session with a started transaction
//! (`MongoStore::publish_in`, see `docs/operations.md`) and refuses one without a
//! transaction in progress, writing nothing.

use anyhow::Context;
use lanebus_store::postgres::PgStore;
use lanebus_store::sqlite::SqliteStore;
use lanebus_store::NewEvent;

/// An order the application stores, and the event it publishes for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// The order's id: also the event id, so a retried request publishes
    /// nothing twice (an id already stored is a duplicate).
    pub id: String,
    /// The customer: the event's key, so one customer's events are
    /// delivered in order.
    pub customer: String,
    /// Amount in cents.
    pub amount_cents: i64,
}

impl Order {
    /// The `order.placed` event of this order.
    pub fn event(&self) -> NewEvent {
        NewEvent {
            id: Some(format!("order-{}", self.id)),
            event_type: "order.placed".into(),
            key: Some(self.customer.clone()),
            payload: crate::order_payload(&self.id, &self.customer, self.amount_cents),
            deliver_at: None,
            expected_seq: None,
        }
    }
}

/// One of the two stores whose transactions an application can publish in.
pub enum OutboxStore {
    /// PostgreSQL.
    Postgres(PgStore),
    /// SQLite.
    Sqlite(SqliteStore),
}

impl OutboxStore {
    /// Opens (and migrates) the store at `url` (`postgres://...` or
    /// `sqlite://PATH`) and creates the application's `orders` table.
    ///
    /// # Errors
    /// Another scheme, or the store's or the database's error.
    pub async fn open(url: &str) -> anyhow::Result<Self> {
        const ORDERS: &str = "CREATE TABLE IF NOT EXISTS orders \
             (id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)";
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let s = PgStore::connect(url).await?;
            sqlx::query(ORDERS).execute(s.pool()).await?;
            Ok(OutboxStore::Postgres(s))
        } else if url.starts_with("sqlite:") {
            let s = SqliteStore::connect(url).await?;
            sqlx::query(ORDERS).execute(s.pool()).await?;
            Ok(OutboxStore::Sqlite(s))
        } else {
            anyhow::bail!("the outbox example needs a postgres:// or sqlite:// URL, got {url:?}")
        }
    }

    /// Stores `order` and publishes its event in one transaction. With
    /// `fail_before_commit` the application fails after both writes and
    /// rolls back: neither the row nor the event is stored.
    ///
    /// # Errors
    /// The database's error (nothing is stored then either).
    pub async fn place(&self, order: &Order, fail_before_commit: bool) -> anyhow::Result<()> {
        const INSERT: &str = "INSERT INTO orders (id, customer, amount_cents) VALUES ($1, $2, $3)";
        // The same steps on either backend's transaction type.
        macro_rules! place_in {
            ($store:expr, $begin:expr) => {{
                let mut tx = $begin.await?;
                sqlx::query(INSERT)
                    .bind(&order.id)
                    .bind(&order.customer)
                    .bind(order.amount_cents)
                    .execute(&mut *tx)
                    .await?;
                let published = $store.publish_in(&mut tx, vec![order.event()]).await?;
                if fail_before_commit {
                    tx.rollback().await?;
                    None
                } else {
                    tx.commit().await?;
                    Some(published)
                }
            }};
        }
        match self {
            OutboxStore::Postgres(s) => {
                // The lane owners claim at once (else within the poll
                // interval): the wake-up is not part of the transaction.
                if let Some(published) = place_in!(s, s.pool().begin()) {
                    s.wake_after_commit(&published).await?;
                }
            }
            // SQLite: a write transaction from the start (`BEGIN IMMEDIATE`,
            // as SqliteStore::publish_in asks), so a read before the writes
            // cannot end in SQLITE_BUSY_SNAPSHOT when another writer commits.
            OutboxStore::Sqlite(s) => {
                place_in!(s, s.pool().begin_with("BEGIN IMMEDIATE"));
            }
        }
        Ok(())
    }

    /// Whether the order row and its event are stored: `(row, event)`.
    ///
    /// # Errors
    /// The database's error.
    pub async fn stored(&self, order: &Order) -> anyhow::Result<(bool, bool)> {
        const ROW: &str = "SELECT count(*) FROM orders WHERE id = $1";
        const EVENT: &str = "SELECT count(*) FROM events WHERE id = $1";
        let event_id = order.event().id.context("the example's events carry ids")?;
        // `events` is the store's own table, read here only to show the
        // outcome.
        macro_rules! count {
            ($pool:expr) => {
                (
                    sqlx::query_scalar(ROW)
                        .bind(&order.id)
                        .fetch_one($pool)
                        .await?,
                    sqlx::query_scalar(EVENT)
                        .bind(&event_id)
                        .fetch_one($pool)
                        .await?,
                )
            };
        }
        let (row, event): (i64, i64) = match self {
            OutboxStore::Postgres(s) => count!(s.pool()),
            OutboxStore::Sqlite(s) => count!(s.pool()),
        };
        Ok((row == 1, event == 1))
    }
}
