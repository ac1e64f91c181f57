//! PostgreSQL backend: the production store (`postgres://...`).
//!
//! # What we chose and why
//!
//! docs/design.md section 3 ("What the reference design measured") gives the WAL
//! cost of each row; section 10 asks for at most half of graphile-worker's
//! WAL per delivery. The baseline is delete-on-complete in its lean form:
//!
//! - **A delivery row is inserted once and deleted once.** A claim updates
//!   nothing (one fenced owner reads a lane), so there are no lock columns,
//!   no dead index entries from claim updates and no per-claim WAL. A retry is
//!   an in-place update of `attempts`, `due_at` and `last_error`, none of
//!   them indexed, so it is a HOT update. `deliveries` has two full indexes:
//!   the primary key (bulk complete by id) and `(lane, xid)` for the claim
//!   (the partial `deliveries_reopen` has no entry for most rows, see
//!   "Raised rows" below). None on `handler_id`: measured on a bulk insert,
//!   it added 97 B of WAL per delivery (321 to 419 B) for the rare handler
//!   delete, which walks the claim index instead.
//!   `autovacuum_vacuum_scale_factor = 0.02` (and the insert variant) on this
//!   churning table, and on `key_seqs`.
//! - **Plain inserts.** `INSERT ... ON CONFLICT` costs WAL on every row even
//!   without a conflict, so events are inserted plainly after an in-statement
//!   `NOT EXISTS` check of client-supplied ids; a concurrent publisher of the
//!   same id makes the insert fail with a unique violation, and the publish is
//!   retried (up to five times). The only upsert is the per-key
//!   counter (`key_seqs`), which must create a key's row the first time.
//! - **Completions are an append-only log**: no primary key (a b-tree splits
//!   mid-index), no foreign key to `events` (it would lock and dirty the
//!   event's page: a full-page image per completion after each checkpoint);
//!   a BRIN index on `completed_at` serves retention.
//! - **One statement per operation, prepared.** A publish is a single
//!   statement (`sql/publish.sql`: id check, key counters, events,
//!   deliveries, at most one `pg_notify`), run in autocommit once per group of
//!   concurrent publishes, so one round trip and no `BEGIN`/`COMMIT`, on a
//!   connection of its own whose session has the group's lock wait and the
//!   statement's generic plan (`publish.rs`, `GROUP_SETTINGS`). A batched claim of many lanes is one statement
//!   (`sql/claim.sql`, `unnest` + `LATERAL`). A bulk completion is one
//!   statement (`DELETE ... RETURNING` feeding the completion `INSERT`); so
//!   are bulk reschedules, dead letters and replays. Statements are
//!   prepared once per connection (sqlx's statement cache).
//! - **Routes are matched in SQL** inside the publish statement, so a
//!   handler registered through another node is seen at once, with no cache
//!   to invalidate.
//! - **NOTIFY at most once per transaction**, and only when it created
//!   deliveries; [`Store::wakeups`] listens on channel `lanebus`. Never in a
//!   caller's transaction ([`PgStore::publish_in`]): its wake-up is sent
//!   after its commit ([`PgStore::wake_after_commit`], or
//!   [`PgStore::transaction`], which also runs the caller's closure at an
//!   isolation level and retries serialization failures). None at all
//!   for a write whose lanes all run at a node in this process
//!   ([`wake::WakeReceiver::set_runs`]): that node is woken in process.
//! - Migrations are plain idempotent SQL (`store/migrations/postgres/`),
//!   applied in one transaction under an advisory lock and recorded in
//!   `meta.schema_version`.
//!
//! The log-and-cursor design (about 321 B per delivery against 794 B) stays
//! the measured headroom; we would move the happy path to it only with a
//! benchmark showing the need.
//!
//! # Claim cursor: commit order, not id order
//!
//! An id-sequence cursor skips a row whose transaction commits after a later
//! id was read (the late-commit pitfall). Instead each delivery row carries
//! `xid`, a value at least its inserting transaction's id
//! (`pg_current_xact_id()`), and the cursor ([`ClaimCursor`]) is a position
//! plus the transactions that were in progress below it. A claim reads the
//! rows with `xid >= pos` and every row of the cursor's open transactions,
//! and returns its snapshot (`pg_snapshot_xmax`, `pg_snapshot_xip`): every
//! transaction below xmax and not in xip had finished when the claim read,
//! so the next position is xmax and the next open set the transactions of
//! xip that may still write rows the claim has not read (those at or past
//! the old position, and those open before). Rows read twice are
//! de-duplicated by the owner by id.
//!
//! Three refinements:
//! - **Limit cuts.** The `xid >= pos` part is read in `(xid, id)` order, up
//!   to the limit *plus the rest of the last xid's rows* (`FETCH FIRST n
//!   ROWS WITH TIES`); the next position is then just past that xid, and
//!   the in-progress transactions below it stay open. Nothing is skipped,
//!   and a transaction with more rows in a lane than the limit cannot stall
//!   the cursor. So a lane may return more than `limit` rows: one
//!   transaction's rows in that lane, and the rows of open transactions that
//!   committed since the last claim.
//! - **Per-key order.** Transaction ids are assigned at a transaction's first
//!   write, which need not follow the order in which publishers took a key's
//!   row lock (and so their sequence numbers). A keyed delivery therefore
//!   takes as `xid` the larger of its transaction's id and the key's previous
//!   value, kept in `key_seqs.xid` under the same row lock; so a key's
//!   deliveries are claimed in sequence order, also across limit cuts.
//! - **Raised rows.** Such a row records its transaction's id in `txid`
//!   (NULL otherwise, so the partial index `deliveries_reopen` costs nothing
//!   on the common path), and an open transaction's rows are found by `xid`
//!   or by `txid`.
//!
//! A transaction left open anywhere on the server (an idle session, a long
//! report) therefore costs each claim an index probe for its id, not a
//! re-read of everything published since it began; the node exports how
//! long the oldest open transaction has held a cursor
//! (`lanebus_claim_horizon_age_seconds`).
//!
//! # Fencing
//!
//! Every claim, completion, reschedule and dead letter joins `lanes` on
//! `(lane, epoch)` in the same statement, so a stale owner changes nothing.
//! Completions, reschedules and dead letters lock the lane rows they rely on
//! `FOR SHARE` (one lock per lane per batch, not per delivery): a fence is an
//! `UPDATE` of the lane row, so it either waits for the writer's transaction
//! or, having committed first, makes PostgreSQL re-check the locked row
//! (READ COMMITTED's re-evaluation of the newest row version), which then
//! fails the epoch test. So a writer whose statement started before the fence
//! committed changes nothing either. Claims only read and need no lock: rows
//! a deposed owner reads cannot be completed by it. Leases (Raft) keep a
//! deposed owner from running at all; fencing is the last line behind them.
//!
//! # Delayed delivery, recovery, retention
//!
//! - **`deliver_at`** becomes the deliveries' first `due_at` in the same
//!   publish statement (one more array parameter); claims return the rows as
//!   before and the lane owner holds a not-yet-due keyed head, with its
//!   key's later deliveries behind it, until its time.
//! - **Recovery** (`sql/recover.sql`) reads the handler's completions since
//!   a time through the BRIN index on `completed_at`, joins the events still
//!   stored and inserts one delivery per event with `replay = true`, in
//!   `(lane, key, seq)` order. `deliveries.replay` is NULL on every other
//!   row: a NULL in a row that already has a null bitmap costs no byte, so
//!   the dispatch path writes nothing more.
//! - **Retention** (`sql/prune.sql`): one statement per batch deletes up to
//!   n completions completed before the cutoff and up to n events published
//!   two minutes or more before it that have no pending delivery (one hash
//!   anti-join over `deliveries`, built once per batch: the lookup by lane
//!   through the claim index read every delivery of the lane, dead index
//!   entries included, per event, 0.2-0.9 s a batch with a 20,000-delivery
//!   backlog against 20-100 ms now; there is no `event_id` index, which would
//!   cost WAL on every publish), no dead letter (`dead_letters
//!   (event_id)`, a b-tree on a rare table) and no late completion at or
//!   after the cutoff. Retention counts from an event's last completion, not
//!   its publish: a completion more than a minute ([`LATE_COMPLETION`])
//!   after the publish (a backlog, a disabled handler, retries,
//!   `deliver_at`, a replay) also appends a `late_completions` row in the
//!   completion statement. It is told from the delivery row alone (due more
//!   than a minute ago, `held` or `replay`), so a prompt completion, nearly
//!   all of them, reads and writes nothing more. Rows are picked through BRIN indexes (`completed_at`,
//!   `published_at`: heap order is time order for these append-only
//!   tables; a BRIN index costs no WAL per insert, unlike a b-tree) and
//!   deleted by ctid. Only the deleted rows are locked: claims read pending
//!   deliveries' events only, completions append, publishes insert.
//!   Recovery and prune batches take one transaction-level advisory lock, so
//!   a batch never removes an event a recovery is putting back; a
//!   dead-letter replay is one statement, so a batch's snapshot sees either
//!   the dead letter or the delivery.
//!
//! # Handler deletion
//!
//! Deleting a handler removes its row first (nothing is routed to it from
//! then on), then its pending deliveries lane by lane in chunks of a few
//! thousand rows of the claim index `(lane, xid)`, then its dead letters in
//! batches, each chunk or batch its own statement, so completions that meet
//! its rows wait for one chunk at most and the delete reads `deliveries`
//! once (`catalog.rs`, `delete_handler`). A publish that read the
//! handler before the delete and commits after it may still create
//! deliveries for it: the node discards deliveries whose handler no longer
//! exists.
//!
//! # Bounded statements
//!
//! [`PgStore::connect`] sets [`SESSION_DEFAULTS`] on its connections
//! (statement and lock timeouts, an idle-in-transaction timeout, TCP
//! keepalives), each unless the URL sets it, so no statement waits without
//! bound; the node's store actor also runs its claims apart from its writes,
//! so a write that waits does not hold claims behind it.

mod catalog;
mod dispatch;
mod error;
mod event_types;
mod migrate;
mod publish;
mod subject_keys;
mod transaction;

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

use crate::common::PublishPlan;
use crate::event_types::{Cache, Change};
use crate::group::{GroupWriter, Grouper, Written};
use crate::*;
use error::map_err;
pub use transaction::{Isolation, PgTx, TxError, TRANSACTION_ATTEMPTS};

/// Connections in the pool.
const POOL_SIZE: u32 = 16;

/// How long to wait for a connection from the pool (or a new one).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection of the group writes' and claims' pools may stay
/// unused before the pool checks it with a round trip (sqlx's `ping`: a
/// `Sync` and its `ReadyForQuery`) before handing it out
/// (`side_pool_options`).
pub const PING_IDLE: Duration = Duration::from_secs(1);

/// Options of the side pools of group writes and claims
/// (`publish::side_pool`). A connection left unused for [`PING_IDLE`] or
/// more is pinged before use and replaced if that fails (the server
/// restarted, an administrator ended the session); one used more recently
/// is handed out as it is. sqlx's default (`test_before_acquire`) pings at
/// every acquire: one more round trip before every group write and claim.
/// A connection that broke after its last use, less than [`PING_IDLE`]
/// before, fails its next statement instead: a group write then runs again
/// on another connection (`publish::connection_lost`), a claim fails and
/// its lane owner claims again. The store's own pool keeps sqlx's default,
/// for the application's transactions and the node's other statements. The
/// method is sqlx's own example for `PoolOptions::before_acquire`.
fn side_pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
}

/// Session settings of the store's connections, each applied unless the
/// URL's `options` set it (`?options=-c%20statement_timeout%3D5s`).
///
/// - `jit = off`: the claim statement's estimated cost grows with the
///   backlog the statistics show, and once it passes `jit_above_cost`
///   PostgreSQL compiles it at every execution. Measured
///   (pg-dispatch-1n-tuned-hot10, 100,000 events on 10 keys, PostgreSQL 15
///   with LLVM): 200-600 ms of JIT per claim, 15 ms of database CPU per
///   delivery and 32-50 deliveries/s in 2 of 4 samples; with JIT off
///   833-1,876/s and 0.07-0.10 ms in 6 of 6.
/// - `statement_timeout = 30s`: no statement stalls a node without bound;
///   dispatch statements take milliseconds, so 30 s only ends one that waits
///   or runs far too long (it fails with [`StoreError::Timeout`], and the
///   node retries). Migrations and
///   recoveries, which may rightly run longer, lift it for their
///   transaction.
/// - `lock_timeout = 10s`: a statement waiting for a row or table lock that
///   long gives up instead of holding the node's other writes behind it.
/// - `idle_in_transaction_session_timeout = 60s`: a transaction left open
///   by a stuck client (it holds row locks and the claim horizon) is ended.
/// - `tcp_keepalives_idle = 30`, `tcp_keepalives_interval = 10`,
///   `tcp_keepalives_count = 3` (seconds, probes): the server finds a node
///   that vanished without closing its connections within about a minute
///   and releases what its sessions held (the default follows the
///   operating system's, two hours on Linux).
pub const SESSION_DEFAULTS: &[(&str, &str)] = &[
    ("jit", "off"),
    ("statement_timeout", "30s"),
    ("lock_timeout", "10s"),
    ("idle_in_transaction_session_timeout", "60s"),
    ("tcp_keepalives_idle", "30"),
    ("tcp_keepalives_interval", "10"),
    ("tcp_keepalives_count", "3"),
];

/// Session settings of the connections claims run on (two, opened at the
/// first claim), on top of the pool's own:
/// - `plan_cache_mode = force_generic_plan`: under the default `auto`,
///   PostgreSQL planned the claim anew on almost every call (the custom
///   plan of a claim of a few lanes is estimated far cheaper than the
///   generic one). A claim woken by a single-event publish spent 0.39 ms
///   planning and 0.21 ms executing. The generic plan has the same shape
///   (index range scans per lane, the `events` probe per row): on a
///   backlog of 200,000 deliveries a 256-lane claim of 200 rows each read
///   the same 261,721 buffers with either plan (docs/benchmarks.md, other
///   measurements, 2026-12-04).
pub const CLAIM_SETTINGS: &[(&str, &str)] = &[("plan_cache_mode", "force_generic_plan")];

/// The NOTIFY channel publishes wake lane owners on.
pub const CHANNEL: &str = "lanebus";

/// A completion later than this after its event's publish is recorded in
/// `late_completions` (the interval literal of `sql/complete.sql`; the
/// SQLite backend's `sql/late_insert.sql` uses the same). Retention keeps
/// events twice as long past the cutoff (`sql/prune.sql`), for clock reads.
pub const LATE_COMPLETION: Duration = Duration::from_secs(60);

/// The PostgreSQL store. Cheap to clone: clones share the pool.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    /// The group writer's connection.
    writer: publish::Writer,
    /// Claims' connections ([`CLAIM_SETTINGS`]).
    claimer: PgPool,
    lanes: u16,
    group: Arc<Grouper>,
    wakes: Arc<publish::Wakes>,
    /// The lanes nodes in this process run ([`wake::InProcess`]).
    in_process: Arc<wake::InProcess>,
    /// The event-type catalog, compiled ([`crate::event_types`]).
    catalog: Arc<Cache>,
    /// The master key and cached data keys ([`crate::personal`]), shared by
    /// clones.
    keyring: std::sync::Arc<crate::personal::Keyring>,
}

impl PgStore {
    /// Connects to `url` (`postgres://...` or `postgresql://...`), applies
    /// migrations and, for a new database, creates [`DEFAULT_LANES`] lanes.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a malformed URL; [`StoreError::Unavailable`]
    /// when the server cannot be reached; [`StoreError::Database`] for a
    /// failed migration.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with_lanes(url, DEFAULT_LANES).await
    }

    /// As [`PgStore::connect`], creating `lanes` lanes if the database is new.
    /// An existing store keeps the lane count it was created with.
    ///
    /// # Errors
    /// As [`PgStore::connect`]; [`StoreError::Invalid`] if `lanes` is 0.
    pub async fn connect_with_lanes(url: &str, lanes: u16) -> Result<Self> {
        if lanes == 0 {
            return Err(StoreError::Invalid(
                "a store needs at least one lane".into(),
            ));
        }
        let mut options = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::Invalid(format!("postgres url: {e}")))?
            .application_name("lanebus");
        let lower = url.to_ascii_lowercase();
        let set_by_url = |name: &str| {
            lower.contains(&format!("{name}=")) || lower.contains(&format!("{name}%3d"))
        };
        let defaults: Vec<(&str, &str)> = SESSION_DEFAULTS
            .iter()
            .copied()
            .filter(|(name, _)| !set_by_url(name))
            .collect();
        if !defaults.is_empty() {
            options = options.options(defaults);
        }
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(|e| StoreError::Unavailable(format!("cannot connect to postgres: {e}")))?;
        Self::from_pool(pool, lanes).await
    }

    /// Uses an existing pool (for applications that share theirs), applying
    /// migrations; `lanes` as in [`PgStore::connect_with_lanes`]. The pool's
    /// connections keep their settings: give them [`SESSION_DEFAULTS`]
    /// (`options` of `PgConnectOptions`) as [`PgStore::connect`] does, or
    /// claims may spend hundreds of milliseconds compiling on a large backlog
    /// and a statement may wait without bound. Group writes of
    /// [`Store::publish`] and claims each use up to two connections of
    /// their own, opened with the pool's connect options (URL, `options`,
    /// TLS) but not its `after_connect` hook: a setting the store's tables
    /// depend on (such as `search_path`) belongs in the connect options.
    /// Those connections are pinged only after [`PING_IDLE`] unused
    /// (`side_pool_options`); `pool` keeps its own acquire checks.
    ///
    /// # Errors
    /// As [`PgStore::connect`].
    pub async fn from_pool(pool: PgPool, lanes: u16) -> Result<Self> {
        let mut store = PgStore {
            writer: publish::Writer::new(&pool),
            claimer: publish::side_pool(&pool, CLAIM_SETTINGS, 2),
            pool,
            lanes,
            group: Arc::default(),
            wakes: Arc::default(),
            in_process: Arc::default(),
            catalog: Arc::default(),
            keyring: Arc::default(),
        };
        store.lanes = migrate::migrate(&store.pool, lanes).await?;
        // The catalog as it is now, so the first publish need not load it.
        store
            .catalog
            .replace(&event_types::read(&store.pool).await?)?;
        Ok(store)
    }

    /// Applies pending migrations (idempotent; safe while other nodes run).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Database`]; a failing
    /// migration applies nothing.
    pub async fn migrate(&self) -> Result<()> {
        migrate::migrate(&self.pool, self.lanes).await.map(|_| ())
    }

    /// Publishes and their writes so far, on this store and its clones
    /// (concurrent publishes are written in groups: [`GroupStats`]).
    pub fn publish_stats(&self) -> GroupStats {
        self.group.stats()
    }

    /// The connection pool, for callers that publish inside their own
    /// transaction ([`PgStore::publish_in`]).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Publishes `events` inside the caller's transaction (the transactional
    /// outbox): the same writes as [`Store::publish`], which exist if and only
    /// if the caller commits.
    ///
    /// No wake-up is sent from the caller's transaction: a NOTIFY there would
    /// make its commit take PostgreSQL's database-wide notify-queue lock, which
    /// serializes notifying commits. After the commit, pass the outcome to
    /// [`PgStore::wake_after_commit`] so lane owners claim at once; without it
    /// the events are claimed within the nodes' poll interval (1 s by
    /// default on PostgreSQL). [`PgStore::transaction`] does both for you,
    /// at an isolation level, with retries of serialization failures.
    ///
    /// Ids already stored count as duplicates without disturbing the
    /// caller's transaction. When the batch has client-supplied ids, the
    /// writes run inside a savepoint: if a concurrent publisher commits the
    /// same id between the check and the insert, the savepoint is rolled back
    /// and the batch retried, so the caller's transaction stays usable (in a
    /// `REPEATABLE READ` transaction the retry cannot see the other commit and
    /// ends in [`StoreError::Conflict`], the transaction still usable).
    ///
    /// The key counters of the batch stay locked until the caller commits:
    /// other publishers of the same keys wait for it (under `REPEATABLE READ`
    /// or `SERIALIZABLE` the later one then fails with a serialization
    /// failure, `40001`, to be retried as a whole). Keep the transaction short.
    ///
    /// A batch with expected sequences ([`NewEvent::expected_seq`]) runs in
    /// a savepoint too: a broken expectation rolls back the batch's writes
    /// and answers [`StoreError::SeqConflict`], the caller's transaction
    /// still usable (under `REPEATABLE READ` or `SERIALIZABLE`, a key
    /// another transaction published into since the snapshot fails with
    /// `40001` instead, as any write of its counter would).
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for an event breaking [`NewEvent::validate`]
    /// (nothing is written); [`StoreError::SeqConflict`] for a broken
    /// expectation (nothing is written); [`StoreError::Conflict`] after repeated id races;
    /// [`StoreError::Unavailable`]/[`StoreError::Database`] otherwise (after
    /// which, without client ids, the caller's transaction is aborted).
    pub async fn publish_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        events: Vec<NewEvent>,
    ) -> Result<PublishOutcome> {
        let plan = PublishPlan::new(events, self.lanes)?;
        let (outcome, _) = publish::publish_in(tx, Some(&self.catalog), plan).await?;
        Ok(outcome)
    }

    /// Wakes the lane owners for what a [`PgStore::publish_in`] returned,
    /// once its transaction has committed: the owners of its
    /// [`PublishOutcome::lanes`] (of every lane when it names none). Those
    /// that run at a node started on this store value (or a clone) in this
    /// process are woken in process; unless that covers every lane, every
    /// node's are woken through one NOTIFY on [`CHANNEL`] in a transaction
    /// of its own.
    /// Sends nothing when `published` accepted no event. Called before the
    /// commit it wakes owners too early: they find nothing and the events
    /// wait for the poll interval.
    ///
    /// Wake-ups are coalesced per store (and its clones): while one NOTIFY
    /// is in flight, this asks for one more after it and returns at once.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`]
    /// when the NOTIFY this call sent failed (a coalesced one's failure is
    /// logged); the events are stored all the same and are claimed within
    /// the poll interval.
    pub async fn wake_after_commit(&self, published: &PublishOutcome) -> Result<()> {
        if published.accepted == 0 {
            return Ok(());
        }
        self.wake_committed(wake::Woken::of_lanes(&published.lanes))
            .await
    }

    /// Wakes the owners of `woken` after a commit: in process those that
    /// run at a node of this process ([`wake::InProcess`]), and, unless
    /// that covered every lane it names, every owner through
    /// [`publish::Wakes`] (one coalesced NOTIFY).
    pub(super) async fn wake_committed(&self, woken: wake::Woken) -> Result<()> {
        if let wake::Woken::Lanes(lanes) = &woken {
            let lanes: Vec<Lane> = lanes.iter().copied().collect();
            if self.in_process.wake(&lanes) {
                return Ok(());
            }
        }
        self.wakes.wake(&self.pool, woken).await
    }

    /// [`publish::write`] on `conns`, without its NOTIFY when a node in this
    /// process runs every lane of `plan`. Returns the ids found already
    /// stored, and the lanes to wake after the commit ([`PgStore::woken`]).
    async fn write_on(
        &self,
        conns: publish::Conns<'_>,
        plan: &PublishPlan,
    ) -> Result<(HashSet<String>, Committed)> {
        let in_process = self.in_process.runs_all(&plan.lanes());
        let (stored, lanes) = publish::write(conns, &self.catalog, plan, !in_process).await?;
        let notified = !in_process;
        Ok((stored, Committed { notified, lanes }))
    }

    /// Wakes the lanes of a committed write ([`PgStore::write_on`]): those
    /// that got deliveries and run here are woken in process; a lane that
    /// stopped running here since the first look (handed over meanwhile)
    /// then gets one NOTIFY, sent after the commit, so its next owner
    /// cannot have claimed before it.
    async fn woken(&self, committed: Committed) {
        let Committed { notified, lanes } = committed;
        if notified {
            // The statement's NOTIFY went out with the commit.
            self.in_process.wake(&lanes);
        } else if !lanes.is_empty() {
            let woken = wake::Woken::Lanes(lanes.into_iter().collect());
            if let Err(e) = self.wake_committed(woken).await {
                tracing::warn!(error = %e, "wake-up after a publish failed; lanes poll");
            }
        }
    }
}

/// What a committed write left to wake: the lanes that got deliveries, and
/// whether its statement sent their NOTIFY.
struct Committed {
    notified: bool,
    lanes: Vec<Lane>,
}

#[async_trait]
impl GroupWriter for PgStore {
    async fn write_plan(&self, plan: &PublishPlan) -> Result<HashSet<String>> {
        let (stored, committed) = self
            .write_on(publish::Conns::Pool(&self.pool), plan)
            .await?;
        self.woken(committed).await;
        Ok(stored)
    }

    /// Wakes the lanes after the group's callers are answered.
    async fn write_group(&self, plan: &PublishPlan) -> Result<Written> {
        let (stored, committed) = self
            .write_on(publish::Conns::Writer(&self.writer), plan)
            .await?;
        let store = self.clone();
        let then = async move { store.woken(committed).await };
        Ok(Written {
            stored,
            then: Some(Box::pin(then)),
        })
    }

    fn idle(&self) {
        self.writer.idle();
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

    async fn publish(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        let plan = PublishPlan::new(events, self.lanes)?;
        crate::personal::publish(
            self,
            &self.group,
            &self.catalog,
            || event_types::read(&self.pool),
            plan,
        )
        .await
    }

    async fn publish_operational(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        let mut plan = PublishPlan::operational(events, self.lanes)?;
        self.catalog
            .check(&mut plan, event_types::read(&self.pool))
            .await?;
        crate::personal::seal_plan(self, &mut plan).await?;
        self.group.publish(self, plan).await
    }

    async fn fence(&self, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool> {
        dispatch::fence(&self.pool, lane, owner, epoch).await
    }

    async fn claim(&self, lanes: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        dispatch::claim(&self.claimer, lanes).await
    }

    async fn complete(&self, done: &[DeliveryRef]) -> Result<Vec<i64>> {
        if done.is_empty() {
            return Ok(Vec::new());
        }
        dispatch::complete(&self.pool, done).await
    }

    async fn discard(&self, refs: &[DeliveryRef]) -> Result<Vec<i64>> {
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        dispatch::discard(&self.pool, refs).await
    }

    async fn reschedule(&self, items: &[Reschedule]) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        dispatch::reschedule(&self.pool, items).await
    }

    async fn dead_letter(&self, items: &[DeadLetterRequest]) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        dispatch::dead_letter(&self.pool, items).await
    }

    async fn create_handler(&self, handler: NewHandler) -> Result<Handler> {
        catalog::create_handler(&self.pool, handler.normalized()?).await
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
        let (change, told) =
            catalog::change_handler_state(&self.pool, id, state, reason, self.lanes).await?;
        if let Some(told) = told {
            if let Err(e) = self.wake_after_commit(&told).await {
                tracing::debug!(error = %e, "no wake-up for an operational event; claimed at the next poll");
            }
        }
        Ok(change)
    }

    async fn update_handler(&self, id: &str, patch: &HandlerPatch) -> Result<Handler> {
        catalog::update_handler(&self.pool, id, patch).await
    }

    async fn rotate_handler_secret(
        &self,
        id: &str,
        secret: &str,
        previous_until: DateTime<Utc>,
    ) -> Result<Handler> {
        crate::common::validate_secret(secret)?;
        catalog::rotate_handler_secret(&self.pool, id, secret, previous_until).await
    }

    async fn mark_handler_failing(&self, id: &str, failing: bool, at: DateTime<Utc>) -> Result<()> {
        catalog::mark_handler_failing(&self.pool, id, failing, at).await
    }

    async fn delete_handler(&self, id: &str) -> Result<DeletedHandler> {
        catalog::delete_handler(&self.pool, id).await
    }

    async fn create_event_type(&self, new: NewEventType) -> Result<EventType> {
        let write = event_types::change(&self.pool, Change::Create(new)).await?;
        write.into_type()
    }

    async fn list_event_types(&self) -> Result<Vec<EventType>> {
        Ok(event_types::read(&self.pool).await?.types)
    }

    async fn update_event_type(&self, name: &str, patch: &EventTypePatch) -> Result<EventType> {
        let change = Change::Update(name.to_owned(), patch.clone());
        event_types::change(&self.pool, change).await?.into_type()
    }

    async fn catalog_settings(&self) -> Result<CatalogSettings> {
        Ok(event_types::read(&self.pool).await?.settings)
    }

    async fn set_catalog_settings(&self, settings: CatalogSettings) -> Result<CatalogSettings> {
        event_types::change(&self.pool, Change::Settings(settings)).await?;
        Ok(settings)
    }

    fn keyring(&self) -> &crate::personal::Keyring {
        &self.keyring
    }

    async fn subject_keys(&self, subjects: &[String]) -> Result<Vec<crate::personal::WrappedKey>> {
        subject_keys::get(&self.pool, Some(subjects)).await
    }

    async fn insert_subject_keys(&self, keys: &[crate::personal::WrappedKey]) -> Result<()> {
        subject_keys::insert(&self.pool, keys).await
    }

    async fn delete_subject_key(&self, subject: &str) -> Result<bool> {
        subject_keys::delete(&self.pool, subject).await
    }

    async fn all_subject_keys(&self) -> Result<Vec<crate::personal::WrappedKey>> {
        subject_keys::all(&self.pool).await
    }

    async fn replace_subject_key(
        &self,
        old: &crate::personal::WrappedKey,
        new: &crate::personal::WrappedKey,
    ) -> Result<bool> {
        subject_keys::replace(&self.pool, old, new).await
    }

    async fn list_dead_letters(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>> {
        catalog::list_dead_letters(&self.pool, filter).await
    }

    async fn replay_dead_letters(&self, ids: &[i64], handler_id: Option<&str>) -> Result<u64> {
        if ids.is_empty() && handler_id.is_none() {
            return Ok(0);
        }
        dispatch::replay_dead_letters(&self.pool, ids, handler_id, None, None).await
    }

    async fn replay_dead_letters_between(
        &self,
        handler_id: &str,
        failed_since: Option<DateTime<Utc>>,
        failed_until: Option<DateTime<Utc>>,
    ) -> Result<u64> {
        dispatch::replay_dead_letters(
            &self.pool,
            &[],
            Some(handler_id),
            failed_since,
            failed_until,
        )
        .await
    }

    async fn recover(&self, handler_id: &str, since: DateTime<Utc>) -> Result<RecoverOutcome> {
        catalog::get_handler(&self.pool, handler_id).await?;
        dispatch::recover(&self.pool, handler_id, since).await
    }

    async fn prune(&self, before: DateTime<Utc>, limit: u32) -> Result<Pruned> {
        if limit == 0 {
            return Ok(Pruned::default());
        }
        dispatch::prune(&self.pool, before, limit).await
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
        sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await
            .map_err(map_err)
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn wakeups(&self) -> Result<Wakeups> {
        dispatch::wakeups(&self.pool, &self.in_process).await
    }
}
