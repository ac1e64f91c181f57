//! SQLite backend: the embedded default (`sqlite://PATH`, created if missing).
//!
//! # Choices
//!
//! - **One file, several processes.** The database runs in WAL mode with
//!   `synchronous=FULL` by default: an acknowledged publish is on disk (the
//!   WAL is synced at every commit) and survives a power loss, not only a
//!   process crash. `?synchronous=normal` in the URL trades that for speed
//!   (no sync at commit; a power loss may lose the last commits, a process
//!   crash loses nothing, as SQLite's WAL documentation says). A busy
//!   timeout ([`BUSY_TIMEOUT`]) and foreign keys off. Readers never block the
//!   writer. Every write transaction starts with `BEGIN IMMEDIATE`, so it
//!   takes the file's write lock up front and waits for it through the busy
//!   timeout; a deferred transaction that upgrades from read to write could
//!   instead fail at once with `SQLITE_BUSY_SNAPSHOT`. Within one process the
//!   writers also queue on an async mutex first, so they wait without
//!   SQLite's sleep-and-retry busy handler. A write that still cannot get the
//!   lock after the busy timeout fails with [`StoreError::Timeout`].
//! - **Claim cursor = delivery id.** SQLite has one writer at a time, and a
//!   writer holds the lock from its first write to its commit, so
//!   `AUTOINCREMENT` ids are handed out in commit order: a claim reads
//!   `id > after ORDER BY id` per lane (index `(lane, id)`) and returns the
//!   last id read as the next cursor. A late-committing transaction cannot
//!   exist here: it would hold the write lock, and nobody else could insert.
//! - **Claims write nothing**: all requested lanes are read in one read
//!   transaction (one `UNION ALL` statement per 64 lanes plus one epoch read).
//! - **Delete on complete**, an append-only `completions` table without key or
//!   foreign key, dead letters in their own table; as in PostgreSQL, so both
//!   backends behave alike.
//! - **Routes are matched in SQL** at publish (`json_each` over the handler's
//!   `event_types`), so handlers registered by another process are seen.
//! - Times are stored as INTEGER microseconds since the Unix epoch.
//! - Migrations are plain idempotent SQL files (`store/migrations/sqlite/`),
//!   applied in one `BEGIN IMMEDIATE` transaction and recorded in
//!   `meta.schema_version`, so several processes opening one new file at once
//!   are safe.

mod catalog;
mod dispatch;
mod error;
mod event_types;
mod migrate;
mod publish;
mod subject_keys;

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, Transaction};
use tokio::sync::{Mutex, MutexGuard};

use crate::common::PublishPlan;
use crate::event_types::Change;
use crate::group::{GroupWriter, Grouper};
use crate::*;
use error::{is_busy, map_err};

/// How long a write waits for another process's write lock before failing.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections in the pool (readers run in parallel; writers queue).
const POOL_SIZE: u32 = 8;

/// The SQLite store. Cheap to clone: clones share the pool.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    lanes: u16,
    write_lock: Arc<Mutex<()>>,
    group: Arc<Grouper>,
    catalog: Arc<crate::event_types::Cache>,
    /// The master key and cached data keys ([`crate::personal`]), shared by
    /// clones.
    keyring: std::sync::Arc<crate::personal::Keyring>,
}

/// Takes lanebus's own `synchronous=full|normal` parameter (default `full`)
/// out of a SQLite URL, leaving the rest for sqlx.
///
/// # Errors
/// [`StoreError::Invalid`] for another value.
fn split_synchronous(url: &str) -> Result<(String, SqliteSynchronous)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), SqliteSynchronous::Full));
    };
    let mut synchronous = SqliteSynchronous::Full;
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((k, v)) if k.eq_ignore_ascii_case("synchronous") => {
                synchronous = match v.to_ascii_lowercase().as_str() {
                    "full" => SqliteSynchronous::Full,
                    "normal" => SqliteSynchronous::Normal,
                    _ => {
                        return Err(StoreError::Invalid(format!(
                            "sqlite url {url:?}: synchronous must be full or normal, not {v:?}"
                        )))
                    }
                };
            }
            _ => rest.push(pair),
        }
    }
    let sqlx_url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((sqlx_url, synchronous))
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` (`sqlite://PATH` or
    /// `sqlite:PATH`, optionally `?synchronous=normal`: see the module
    /// documentation), applies migrations and, for a new file, creates
    /// [`DEFAULT_LANES`] lanes. `sqlite::memory:` gives a private in-memory
    /// store on a single connection (tests only: operations queue on it, and a
    /// caller holding a [`SqliteStore::publish_in`] transaction blocks the rest).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a malformed URL; [`StoreError::Unavailable`]
    /// when the file cannot be opened or stays locked; [`StoreError::Database`]
    /// for a failed migration.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with_lanes(url, DEFAULT_LANES).await
    }

    /// As [`SqliteStore::connect`], creating `lanes` lanes if the store is new.
    /// An existing store keeps the lane count it was created with.
    ///
    /// # Errors
    /// As [`SqliteStore::connect`]; [`StoreError::Invalid`] if `lanes` is 0.
    pub async fn connect_with_lanes(url: &str, lanes: u16) -> Result<Self> {
        if lanes == 0 {
            return Err(StoreError::Invalid(
                "a store needs at least one lane".into(),
            ));
        }
        let (sqlx_url, synchronous) = split_synchronous(url)?;
        let options = SqliteConnectOptions::from_str(&sqlx_url)
            .map_err(|e| StoreError::Invalid(format!("sqlite url {url:?}: {e}")))?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(synchronous)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(false);
        // An in-memory database lives as long as its one connection: keep
        // exactly one, forever (for tests; nothing survives the process).
        let in_memory = url.contains(":memory:") || url.contains("mode=memory");
        let pool = if in_memory {
            SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
        } else {
            SqlitePoolOptions::new()
                .max_connections(POOL_SIZE)
                .min_connections(1)
        };
        // Switching a new file to WAL mode needs an exclusive lock that the
        // busy timeout does not wait for: when several processes open a new
        // file at once, the losers retry until the file is in WAL mode.
        let started = std::time::Instant::now();
        let mut attempt: u32 = 0;
        let pool = loop {
            match pool.clone().connect_with(options.clone()).await {
                Ok(pool) => break pool,
                Err(e) if is_busy(&e) && started.elapsed() < BUSY_TIMEOUT => {
                    attempt += 1;
                    let jitter = u64::from(rand::random::<u8>() % 20);
                    let wait = Duration::from_millis(10 * u64::from(attempt.min(10)) + jitter);
                    tracing::debug!(attempt, error = %e, "sqlite database locked while opening; retrying");
                    tokio::time::sleep(wait).await;
                }
                Err(e) => {
                    return Err(StoreError::Unavailable(format!(
                        "cannot open sqlite database {url:?}: {e}"
                    )))
                }
            }
        };
        let mut store = SqliteStore {
            pool,
            lanes,
            write_lock: Arc::new(Mutex::new(())),
            group: Arc::default(),
            catalog: Arc::default(),
            keyring: Arc::default(),
        };
        store.lanes = migrate::migrate(&store, lanes).await?;
        // The catalog as it is now, so the first publish need not load it.
        store.catalog.replace(&event_types::read(&store).await?)?;
        Ok(store)
    }

    /// Applies pending migrations (idempotent; safe while other processes use
    /// the file). Returns nothing; the lane count is never changed.
    ///
    /// # Errors
    /// [`StoreError::Timeout`] if the write lock cannot be had;
    /// [`StoreError::Database`] for a failing migration (nothing is applied).
    pub async fn migrate(&self) -> Result<()> {
        migrate::migrate(self, self.lanes).await.map(|_| ())
    }

    /// Publishes and their writes so far, on this store and its clones
    /// (concurrent publishes are written in groups: [`GroupStats`]).
    pub fn publish_stats(&self) -> GroupStats {
        self.group.stats()
    }

    /// The connection pool, for callers that publish inside their own
    /// transaction ([`SqliteStore::publish_in`]).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Publishes `events` inside the caller's transaction: the same writes as
    /// [`Store::publish`], which exist if and only if the caller commits.
    /// Lane owners find them at their next poll (SQLite has no push
    /// wake-ups; 100 ms by default).
    ///
    /// Begin the transaction with `pool.begin_with("BEGIN IMMEDIATE")`: a
    /// deferred transaction that read before it writes may fail with
    /// `SQLITE_BUSY_SNAPSHOT` when another process wrote in between. While the
    /// transaction is open it holds the file's write lock, so other publishers
    /// (and completions) wait: keep it short, and do not call the store's own
    /// writing methods from the task holding it (they would wait for it, up
    /// to [`BUSY_TIMEOUT`], and fail).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for an event breaking [`NewEvent::validate`]
    /// (nothing is written and the transaction stays usable);
    /// [`StoreError::Timeout`] when the write lock cannot be had;
    /// [`StoreError::Database`] otherwise (roll the transaction back).
    pub async fn publish_in(
        &self,
        tx: &mut Transaction<'_, Sqlite>,
        events: Vec<NewEvent>,
    ) -> Result<PublishOutcome> {
        let plan = PublishPlan::new(events, self.lanes)?;
        publish::publish_in(tx, &self.catalog, plan).await
    }

    /// Starts a write transaction: the in-process write queue, then
    /// `BEGIN IMMEDIATE` (which waits up to [`BUSY_TIMEOUT`] for other
    /// processes).
    async fn begin_write(&self) -> Result<(MutexGuard<'_, ()>, Transaction<'static, Sqlite>)> {
        let guard = self.write_lock.lock().await;
        let tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(map_err)?;
        Ok((guard, tx))
    }
}

#[async_trait]
impl GroupWriter for SqliteStore {
    async fn write_plan(&self, plan: &PublishPlan) -> Result<HashSet<String>> {
        publish::write(self, plan).await
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn lanes(&self) -> u16 {
        self.lanes
    }

    async fn publish(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        let plan = PublishPlan::new(events, self.lanes)?;
        crate::personal::publish(
            self,
            &self.group,
            &self.catalog,
            || event_types::read(self),
            plan,
        )
        .await
    }

    async fn publish_operational(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        let mut plan = PublishPlan::operational(events, self.lanes)?;
        self.catalog
            .check(&mut plan, event_types::read(self))
            .await?;
        crate::personal::seal_plan(self, &mut plan).await?;
        self.group.publish(self, plan).await
    }

    async fn fence(&self, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool> {
        let (_guard, mut tx) = self.begin_write().await?;
        let held = dispatch::fence(&mut tx, lane, owner, epoch).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(held)
    }

    async fn claim(&self, lanes: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await.map_err(map_err)?;
        let batches = dispatch::claim(&mut tx, lanes).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(batches)
    }

    async fn complete(&self, done: &[DeliveryRef]) -> Result<Vec<i64>> {
        if done.is_empty() {
            return Ok(Vec::new());
        }
        let (_guard, mut tx) = self.begin_write().await?;
        let ids = dispatch::complete(&mut tx, done).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(ids)
    }

    async fn discard(&self, refs: &[DeliveryRef]) -> Result<Vec<i64>> {
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        let (_guard, mut tx) = self.begin_write().await?;
        let ids = dispatch::discard(&mut tx, refs).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(ids)
    }

    async fn reschedule(&self, items: &[Reschedule]) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let (_guard, mut tx) = self.begin_write().await?;
        let ids = dispatch::reschedule(&mut tx, items).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(ids)
    }

    async fn dead_letter(&self, items: &[DeadLetterRequest]) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let (_guard, mut tx) = self.begin_write().await?;
        let ids = dispatch::dead_letter(&mut tx, items).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(ids)
    }

    async fn create_handler(&self, handler: NewHandler) -> Result<Handler> {
        let handler = handler.normalized()?;
        let (_guard, mut tx) = self.begin_write().await?;
        let created = catalog::create_handler(&mut tx, handler).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(created)
    }

    async fn list_handlers(&self) -> Result<Vec<Handler>> {
        catalog::list_handlers(&self.pool).await
    }

    async fn get_handler(&self, id: &str) -> Result<Handler> {
        catalog::get_handler(&self.pool, id).await
    }

    async fn change_handler_state(
        &self,
        id: &str,
        state: HandlerState,
        reason: &str,
    ) -> Result<StateChange> {
        // One writer at a time: the state read here is the one replaced.
        let (_guard, mut tx) = self.begin_write().await?;
        let was = catalog::get_handler(&mut *tx, id).await?.state;
        catalog::change_handler_state(&mut tx, id, state, reason).await?;
        let handler = catalog::get_handler(&mut *tx, id).await?;
        // The change's operational event, in its transaction.
        if let Some(e) = (was != handler.state)
            .then(|| crate::operational::state_changed(&handler, true, chrono::Utc::now()))
            .flatten()
        {
            let plan = PublishPlan::operational(vec![e], self.lanes)?;
            publish::publish_in(&mut tx, &self.catalog, plan).await?;
        }
        tx.commit().await.map_err(map_err)?;
        Ok(StateChange { handler, was })
    }

    async fn update_handler(&self, id: &str, patch: &HandlerPatch) -> Result<Handler> {
        let (_guard, mut tx) = self.begin_write().await?;
        let h = catalog::update_handler(&mut tx, id, patch).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(h)
    }

    async fn rotate_handler_secret(
        &self,
        id: &str,
        secret: &str,
        previous_until: chrono::DateTime<chrono::Utc>,
    ) -> Result<Handler> {
        crate::common::validate_secret(secret)?;
        let (_guard, mut tx) = self.begin_write().await?;
        catalog::rotate_handler_secret(&mut tx, id, secret, previous_until).await?;
        let h = catalog::get_handler(&mut *tx, id).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(h)
    }

    async fn mark_handler_failing(
        &self,
        id: &str,
        failing: bool,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<()> {
        let (_guard, mut tx) = self.begin_write().await?;
        catalog::mark_handler_failing(&mut tx, id, failing, at).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(())
    }

    async fn delete_handler(&self, id: &str) -> Result<DeletedHandler> {
        let (_guard, mut tx) = self.begin_write().await?;
        let discarded = catalog::delete_handler(&mut tx, id).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(discarded)
    }

    async fn create_event_type(&self, new: NewEventType) -> Result<EventType> {
        let write = event_types::change(self, Change::Create(new)).await?;
        write.into_type()
    }

    async fn list_event_types(&self) -> Result<Vec<EventType>> {
        Ok(event_types::read(self).await?.types)
    }

    async fn update_event_type(&self, name: &str, patch: &EventTypePatch) -> Result<EventType> {
        let change = Change::Update(name.to_owned(), patch.clone());
        event_types::change(self, change).await?.into_type()
    }

    async fn catalog_settings(&self) -> Result<CatalogSettings> {
        Ok(event_types::read(self).await?.settings)
    }

    async fn set_catalog_settings(&self, settings: CatalogSettings) -> Result<CatalogSettings> {
        event_types::change(self, Change::Settings(settings)).await?;
        Ok(settings)
    }

    fn keyring(&self) -> &crate::personal::Keyring {
        &self.keyring
    }

    async fn subject_keys(&self, subjects: &[String]) -> Result<Vec<crate::personal::WrappedKey>> {
        subject_keys::get(self, Some(subjects)).await
    }

    async fn insert_subject_keys(&self, keys: &[crate::personal::WrappedKey]) -> Result<()> {
        subject_keys::insert(self, keys).await
    }

    async fn delete_subject_key(&self, subject: &str) -> Result<bool> {
        subject_keys::delete(self, subject).await
    }

    async fn all_subject_keys(&self) -> Result<Vec<crate::personal::WrappedKey>> {
        subject_keys::all(self).await
    }

    async fn replace_subject_key(
        &self,
        old: &crate::personal::WrappedKey,
        new: &crate::personal::WrappedKey,
    ) -> Result<bool> {
        subject_keys::replace(self, old, new).await
    }

    async fn list_dead_letters(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>> {
        catalog::list_dead_letters(&self.pool, filter).await
    }

    async fn replay_dead_letters(&self, ids: &[i64], handler_id: Option<&str>) -> Result<u64> {
        if ids.is_empty() && handler_id.is_none() {
            return Ok(0);
        }
        let (_guard, mut tx) = self.begin_write().await?;
        let n = dispatch::replay_dead_letters(&mut tx, ids, handler_id, None, None).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(n)
    }

    async fn replay_dead_letters_between(
        &self,
        handler_id: &str,
        failed_since: Option<chrono::DateTime<chrono::Utc>>,
        failed_until: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<u64> {
        let (_guard, mut tx) = self.begin_write().await?;
        let n = dispatch::replay_dead_letters(
            &mut tx,
            &[],
            Some(handler_id),
            failed_since,
            failed_until,
        )
        .await?;
        tx.commit().await.map_err(map_err)?;
        Ok(n)
    }

    async fn recover(
        &self,
        handler_id: &str,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<RecoverOutcome> {
        self.get_handler(handler_id).await?;
        let (_guard, mut tx) = self.begin_write().await?;
        let out = dispatch::recover(&mut tx, handler_id, since).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(out)
    }

    async fn prune(&self, before: chrono::DateTime<chrono::Utc>, limit: u32) -> Result<Pruned> {
        if limit == 0 {
            return Ok(Pruned::default());
        }
        let (_guard, mut tx) = self.begin_write().await?;
        let out = dispatch::prune(&mut tx, before, limit).await?;
        tx.commit().await.map_err(map_err)?;
        Ok(out)
    }

    async fn lane_rows(&self) -> Result<Vec<LaneRow>> {
        catalog::lane_rows(&self.pool).await
    }

    async fn counts(&self) -> Result<StoreCounts> {
        catalog::counts(&self.pool).await
    }

    async fn lookup_event(&self, id: &str) -> Result<Option<EventLookup>> {
        catalog::lookup_event(&self.pool, id).await
    }

    async fn handler_deliveries(
        &self,
        q: &HandlerDeliveriesQuery,
    ) -> Result<Vec<HandlerDeliveryItem>> {
        catalog::handler_deliveries(&self.pool, q).await
    }

    async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        Ok(chrono::Utc::now())
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn wakeups(&self) -> Result<Wakeups> {
        dispatch::wakeups()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synchronous_is_full_unless_the_url_says_normal() {
        let full = |u: &str| split_synchronous(u).map(|(u, s)| (u, format!("{s:?}")));
        assert_eq!(
            full("sqlite://a.db").expect("plain"),
            ("sqlite://a.db".into(), "Full".into())
        );
        assert_eq!(
            full("sqlite://a.db?synchronous=normal").expect("normal"),
            ("sqlite://a.db".into(), "Normal".into())
        );
        assert_eq!(
            full("sqlite://a.db?mode=rwc&synchronous=FULL").expect("kept"),
            ("sqlite://a.db?mode=rwc".into(), "Full".into()),
            "other parameters go on to sqlx"
        );
        let err = split_synchronous("sqlite://a.db?synchronous=off").expect_err("off");
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.contains("full or normal")),
            "{err:?}"
        );
    }
}
