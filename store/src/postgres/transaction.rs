//! [`PgStore::transaction`]: the caller's closure in a transaction at an
//! isolation level, run again in a fresh transaction after a serialization
//! failure or deadlock, and the lane owners woken after the commit.

use std::collections::BTreeSet;

use futures::future::BoxFuture;
use sqlx::{PgConnection, Postgres, Transaction};

use super::error::map_err;
use super::{publish, PgStore};
use crate::common::PublishPlan;
use crate::wake::Woken;
use crate::{Lane, NewEvent, PublishOutcome, StoreError};

/// Isolation level of a [`PgStore::transaction`] (PostgreSQL documentation,
/// section 13.2 "Transaction Isolation").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// `READ COMMITTED`, PostgreSQL's default: each statement sees what was
    /// committed before it began.
    ReadCommitted,
    /// `REPEATABLE READ`: one snapshot for the whole transaction; a write to
    /// a row another transaction changed since fails with `40001`.
    RepeatableRead,
    /// `SERIALIZABLE`: as `REPEATABLE READ`, and a set of transactions that
    /// no serial order explains fails one of them with `40001`.
    Serializable,
}

impl Isolation {
    fn begin(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Isolation::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Isolation::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// Transactions [`PgStore::transaction`] runs at most for one call: the
/// first and four more after serialization failures or deadlocks.
pub const TRANSACTION_ATTEMPTS: u32 = 5;

/// Why a [`PgStore::transaction`] failed (its transaction rolled back).
#[derive(Debug, thiserror::Error)]
pub enum TxError {
    /// A statement failed: the closure's own, a publish's, `BEGIN` or
    /// `COMMIT`. A serialization failure or deadlock
    /// ([`TxError::is_serialization_failure`]) is retried; this is the last
    /// one when [`TRANSACTION_ATTEMPTS`] ran out.
    #[error("{0}")]
    Sql(#[from] sqlx::Error),
    /// A store call refused (an event breaking [`NewEvent::validate`]) or
    /// failed; not retried.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The closure's own error; not retried.
    #[error("{0}")]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl TxError {
    /// Whether this is PostgreSQL's `serialization_failure` (`40001`) or
    /// `deadlock_detected` (`40P01`): the transaction may succeed if run
    /// again from its start (PostgreSQL documentation, section 13.5
    /// "Serialization Failure Handling").
    pub fn is_serialization_failure(&self) -> bool {
        match self {
            TxError::Sql(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("40001" | "40P01"))
            }
            _ => false,
        }
    }
}

impl From<TxError> for StoreError {
    /// [`TxError::Sql`] by SQLSTATE as the store's own errors,
    /// [`TxError::Other`] as [`StoreError::Database`].
    fn from(e: TxError) -> Self {
        match e {
            TxError::Sql(e) => map_err(e),
            TxError::Store(e) => e,
            TxError::Other(e) => StoreError::Database(e.to_string()),
        }
    }
}

/// The transaction of one [`PgStore::transaction`] attempt: the closure's
/// statements run on [`PgTx::conn`], its events go through
/// [`PgTx::publish`] (so the lane owners are woken after the commit).
pub struct PgTx {
    tx: Transaction<'static, Postgres>,
    lanes: u16,
    catalog: std::sync::Arc<crate::event_types::Cache>,
    /// The lanes [`PgTx::publish`] wrote deliveries into in this attempt.
    woken: BTreeSet<Lane>,
}

impl PgTx {
    /// The connection, in the transaction: an executor for the caller's
    /// statements (`query.execute(t.conn())`; savepoints with
    /// `t.conn().begin()`).
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// [`PgStore::publish_in`] in this transaction; its wake-up is sent
    /// after the commit.
    ///
    /// # Errors
    /// [`TxError::Store`] for an event breaking [`NewEvent::validate`] or a
    /// broken expected sequence ([`StoreError::SeqConflict`]; nothing
    /// written, the transaction usable); [`TxError::Sql`] when the
    /// statement failed (the transaction aborted; a serialization failure or
    /// deadlock is retried by [`PgStore::transaction`] if the closure
    /// returns it).
    pub async fn publish(&mut self, events: Vec<NewEvent>) -> Result<PublishOutcome, TxError> {
        let plan = PublishPlan::new(events, self.lanes)?;
        let (outcome, deliveries) =
            publish::publish_in(&mut self.tx, Some(&self.catalog), plan).await?;
        if deliveries > 0 {
            self.woken.extend(&outcome.lanes);
        }
        Ok(outcome)
    }
}

impl PgStore {
    /// Runs `f` in a transaction at `isolation` and commits it if `f`
    /// returns `Ok` (rolls it back otherwise). A serialization failure or
    /// deadlock (`40001`, `40P01`; [`TxError::is_serialization_failure`]),
    /// from `f` or from the `COMMIT`, rolls the attempt back and runs `f`
    /// again in a fresh transaction, up to [`TRANSACTION_ATTEMPTS`] in all,
    /// as PostgreSQL's documentation asks of applications using
    /// `REPEATABLE READ` or `SERIALIZABLE` (section 13.5 "Serialization
    /// Failure Handling"). So `f` may run more than once: it must do all its
    /// work through the [`PgTx`] it is given, and return the error of a
    /// failed statement (with `?`) for the retry to see it.
    ///
    /// Events published with [`PgTx::publish`] exist if and only if the
    /// transaction commits; after the commit the lane owners are woken as
    /// by [`PgStore::wake_after_commit`] (in process, or one coalesced
    /// NOTIFY in a transaction of its own; nothing when no delivery was
    /// written), so
    /// the events are claimed at once rather than within the poll interval.
    /// A failed NOTIFY is logged: the events are then claimed within the
    /// poll interval.
    ///
    /// ```no_run
    /// # async fn f(store: lanebus_store::postgres::PgStore, event: lanebus_store::NewEvent)
    /// # -> Result<(), lanebus_store::postgres::TxError> {
    /// use lanebus_store::postgres::Isolation;
    /// store
    ///     .transaction(Isolation::Serializable, |t| {
    ///         let event = event.clone();
    ///         Box::pin(async move {
    ///             sqlx::query("UPDATE orders SET paid = true WHERE id = 7")
    ///                 .execute(t.conn())
    ///                 .await?;
    ///             t.publish(vec![event]).await?;
    ///             Ok(())
    ///         })
    ///     })
    ///     .await
    /// # }
    /// ```
    ///
    /// # Errors
    /// `f`'s error, or [`TxError::Sql`] for a failed `BEGIN` or `COMMIT`;
    /// the last serialization failure when [`TRANSACTION_ATTEMPTS`] ran
    /// out. Nothing of a failed attempt is stored.
    pub async fn transaction<T, F>(&self, isolation: Isolation, mut f: F) -> Result<T, TxError>
    where
        T: Send,
        F: for<'t> FnMut(&'t mut PgTx) -> BoxFuture<'t, Result<T, TxError>> + Send,
    {
        let mut attempt = 1;
        loop {
            let mut t = PgTx {
                tx: self.pool.begin_with(isolation.begin()).await?,
                lanes: self.lanes,
                catalog: std::sync::Arc::clone(&self.catalog),
                woken: BTreeSet::new(),
            };
            let ran = match f(&mut t).await {
                Ok(value) => t.tx.commit().await.map(|()| value).map_err(TxError::from),
                Err(e) => {
                    // A failed rollback leaves the connection to the pool,
                    // which rolls it back before reuse.
                    let _ = t.tx.rollback().await;
                    Err(e)
                }
            };
            match ran {
                Ok(value) => {
                    if !t.woken.is_empty() {
                        // A failure is logged by the wake-up's task.
                        let _ = self.wake_committed(Woken::Lanes(t.woken)).await;
                    }
                    return Ok(value);
                }
                Err(e) if attempt < TRANSACTION_ATTEMPTS && e.is_serialization_failure() => {
                    tracing::debug!(attempt, error = %e, "transaction not serializable; retrying");
                    // Transactions that failed together would otherwise run
                    // again together and may conflict again: a random pause
                    // of up to 5 ms times the attempt sets them apart.
                    let pause = rand::random_range(0..=5 * u64::from(attempt));
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
