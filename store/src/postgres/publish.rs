//! Publish: one statement (`sql/publish.sql`) per batch.
//!
//! The statement checks client-supplied ids against `events`, raises the
//! batch's key counters (row locks taken in key order), inserts the events
//! and one delivery per matching handler (disabled ones too), and sends one
//! NOTIFY when asked. It runs in autocommit once per group of concurrent
//! publishes for [`Store::publish`](crate::Store::publish)
//! ([`crate::group`]: one round trip and at most one NOTIFY per group, on
//! the group writer's connection, [`Writer`]), likewise alone for a batch of a
//! failed group (on the store's pool), or inside the caller's transaction
//! for [`PgStore::publish_in`](super::PgStore::publish_in), without the
//! NOTIFY: a notifying commit takes PostgreSQL's database-wide notify-queue
//! lock (notifying commits are serialized), which the caller's transaction
//! must not take. Its wake-up is a NOTIFY of its own after the caller's
//! commit ([`notify`]). A write whose lanes all run at a node of this
//! process ([`crate::wake::InProcess`]) sends no NOTIFY: that node is woken
//! in process after the commit ([`super::PgStore::wake_committed`]).
//!
//! A batch with expected sequences ([`crate::NewEvent::expected_seq`]) is
//! checked between the statement and the commit: the statement returns the
//! sequence numbers it gave (taken under the key counters' row locks, so
//! they follow the keys' latest committed values), and a broken
//! expectation rolls the writes back. So such a write runs in a transaction
//! (`BEGIN`, the statement, `COMMIT`: two round trips more) rather than in
//! autocommit, and inside a caller's transaction in a savepoint, which a
//! broken expectation rolls back (the caller's transaction stays usable).

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use super::error::map_err;
use super::transaction::TxError;
use super::CHANNEL;
use crate::common::{check_expected, PublishPlan};
use crate::event_types::Cache;
use crate::wake::Woken;
use crate::{Lane, PublishOutcome, Result};

/// Attempts of a publish that lost a race (a concurrent publisher of the same
/// id, or a deadlock between two publishers inserting each other's ids).
pub(super) const PUBLISH_ATTEMPTS: usize = 5;

/// Whether `e` is worth retrying the whole publish for: unique violation
/// (`23505`), deadlock (`40P01`) or serialization failure (`40001`).
pub(super) fn is_retryable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("23505" | "40P01" | "40001"))
        }
        _ => false,
    }
}

/// Whether `e` says the connection was lost rather than that the statement
/// failed: the server ended the session (`57P01` administrator or fast
/// shutdown, `57P02` crash of another server process, `57P03` not
/// accepting connections, `57P05` idle past `idle_session_timeout`) or the
/// socket is closed. Such an error mostly
/// comes from a connection that broke while idle and was handed out
/// without a ping ([`super::PING_IDLE`]), so the statement never ran; if it
/// did commit before the connection was lost, running it again stores
/// nothing twice (a client-supplied id is found stored; a generated id
/// fails the primary key, `23505`), though its caller may then get an
/// error, or a broken expected sequence, for events that were stored.
pub(super) fn connection_lost(e: &sqlx::Error) -> bool {
    use std::io::ErrorKind;
    match e {
        sqlx::Error::Database(db) => {
            matches!(
                db.code().as_deref(),
                Some("57P01" | "57P02" | "57P03" | "57P05")
            )
        }
        sqlx::Error::Io(io) => matches!(
            io.kind(),
            ErrorKind::BrokenPipe
                | ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}

/// Whether `e` is a serialization failure (`40001`).
fn is_serialization_failure(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("40001"))
}

/// The statement's parameters, borrowed from the plan.
pub(super) struct PublishArgs<'a> {
    ids: Vec<&'a str>,
    types: Vec<&'a str>,
    keys: Vec<Option<&'a str>>,
    lanes: Vec<i32>,
    payloads: Vec<&'a [u8]>,
    client: Vec<bool>,
    deliver_at: Vec<Option<chrono::DateTime<chrono::Utc>>>,
    /// Per event, its cataloged type's aliases joined by ' '.
    aliases: Vec<Option<String>>,
    /// The catalog version the plan was checked against (`None`: no check).
    catalog: Option<i64>,
    /// The batch has expected sequences: return the sequence numbers.
    expects: bool,
}

impl<'a> PublishArgs<'a> {
    pub(super) fn new(plan: &'a PublishPlan) -> Self {
        let n = plan.fresh.len();
        let mut a = PublishArgs {
            ids: Vec::with_capacity(n),
            types: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            lanes: Vec::with_capacity(n),
            payloads: Vec::with_capacity(n),
            client: Vec::with_capacity(n),
            deliver_at: Vec::with_capacity(n),
            aliases: Vec::with_capacity(n),
            catalog: plan.catalog_version,
            expects: plan.expects(),
        };
        for e in &plan.fresh {
            a.ids.push(&e.id);
            a.types.push(&e.event_type);
            a.keys.push(e.key.as_deref());
            a.lanes.push(i32::from(e.lane));
            a.payloads.push(e.stored_payload());
            a.client.push(e.client_id);
            a.deliver_at.push(e.deliver_at);
            a.aliases.push(e.aliases.as_ref().map(|a| a.join(" ")));
        }
        a
    }
}

/// What one run of the publish statement did.
pub(super) struct Ran {
    /// Events written.
    pub accepted: usize,
    /// Deliveries written.
    pub deliveries: usize,
    /// Client-supplied ids that were already stored (not written).
    pub stored: Vec<String>,
    /// With [`PublishArgs::expects`], the sequence number of each event
    /// written (`None` when unkeyed), in batch order.
    pub seqs: Vec<Option<i64>>,
    /// The lanes that got deliveries, ascending.
    pub lanes: Vec<Lane>,
    /// The stored catalog version differed from the plan's: nothing was
    /// written (check the plan again and rerun).
    pub stale: bool,
}

/// Checks the expected sequences of `plan`'s events that `ran` wrote
/// ([`check_expected`]).
///
/// # Errors
/// [`crate::StoreError::SeqConflict`]: the caller rolls the writes back.
fn expectations(plan: &PublishPlan, ran: &Ran) -> Result<()> {
    let written = plan.fresh.iter().filter(|e| !ran.stored.contains(&e.id));
    check_expected(written.zip(ran.seqs.iter().copied()))
}

/// Runs the publish statement once on `conn`, with its NOTIFY if `notify`
/// (and deliveries were written). Errors are raw sqlx errors so the caller
/// can decide to retry.
pub(super) async fn run(
    conn: &mut PgConnection,
    args: &PublishArgs<'_>,
    notify: bool,
) -> Result<Ran, sqlx::Error> {
    if args.ids.is_empty() {
        return Ok(Ran {
            accepted: 0,
            deliveries: 0,
            stored: Vec::new(),
            seqs: Vec::new(),
            lanes: Vec::new(),
            stale: false,
        });
    }
    #[allow(clippy::type_complexity)]
    let (accepted, deliveries, _notified, stored, seqs, lanes, catalog): (
        i64,
        i64,
        i64,
        Option<Vec<String>>,
        Option<Vec<Option<i64>>>,
        Option<Vec<i32>>,
        i64,
    ) = sqlx::query_as(include_str!("sql/publish.sql"))
        .bind(&args.ids)
        .bind(&args.types)
        .bind(&args.keys)
        .bind(&args.lanes)
        .bind(&args.payloads)
        .bind(&args.client)
        .bind(&args.deliver_at)
        .bind(notify)
        .bind(args.expects)
        .bind(args.catalog)
        .bind(&args.aliases)
        .fetch_one(conn)
        .await?;
    Ok(Ran {
        accepted: usize::try_from(accepted).unwrap_or_default(),
        deliveries: usize::try_from(deliveries).unwrap_or_default(),
        stored: stored.unwrap_or_default(),
        seqs: seqs.unwrap_or_default(),
        lanes: lanes
            .unwrap_or_default()
            .into_iter()
            .filter_map(|l| Lane::try_from(l).ok())
            .collect(),
        stale: args.catalog.is_some_and(|v| v != catalog),
    })
}

/// Most reruns of a publish after a catalog change (each reloads the
/// catalog); past them the publish fails with
/// [`crate::StoreError::Conflict`].
const CATALOG_RERUNS: usize = 8;

/// `plan` checked against the stored catalog read on `conn`, the cache
/// reloaded (after a run found its version stale, or for a plan not
/// checked yet).
///
/// # Errors
/// As [`crate::event_types::Snapshot::apply`];
/// [`crate::StoreError::Conflict`] after [`CATALOG_RERUNS`].
async fn recheck<'p>(
    conn: &mut PgConnection,
    catalog: &Cache,
    plan: Cow<'p, PublishPlan>,
    reruns: &mut usize,
) -> Result<Cow<'p, PublishPlan>> {
    *reruns += 1;
    if *reruns > CATALOG_RERUNS {
        return Err(crate::StoreError::Conflict(
            "the event-type catalog kept changing during the publish; retry".into(),
        ));
    }
    let snapshot = catalog.replace(&super::event_types::load(conn).await?)?;
    let mut plan = plan.into_owned();
    snapshot.apply(&mut plan)?;
    Ok(Cow::Owned(plan))
}

/// One NOTIFY on [`CHANNEL`] in autocommit on `pool`, naming what `woken`
/// names ([`Woken::payload`]).
async fn notify(pool: &PgPool, woken: &Woken) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(woken.payload())
        .execute(pool)
        .await
        .map_err(map_err)?;
    Ok(())
}

/// The wake-ups of publishes that ran without one (inside a caller's
/// transaction, or left to a node of this process that no longer ran a
/// lane when the write committed), each asked for after the commit, shared
/// by a store and its clones. Coalesced: one NOTIFY in flight at a time
/// (notifying commits are serialized by PostgreSQL anyway); a wake-up asked
/// for meanwhile is served by one more NOTIFY, begun when the current one
/// ends, so after the asker's commit, naming the lanes of every such ask.
#[derive(Debug, Default)]
pub(super) struct Wakes {
    state: std::sync::Mutex<WakeState>,
}

#[derive(Debug, Default)]
struct WakeState {
    /// A NOTIFY is in flight.
    sending: bool,
    /// What was asked for while it was.
    pending: Option<Woken>,
}

impl Wakes {
    /// Sends a NOTIFY naming `woken` and returns its result, or, while one
    /// is in flight, adds `woken` to the next one, sent after it, and
    /// returns `Ok` at once. The NOTIFYs run in a task of their own, so
    /// dropping this future loses none.
    pub(super) async fn wake(self: &Arc<Self>, pool: &PgPool, woken: Woken) -> Result<()> {
        {
            let mut s = self.state.lock().expect("not poisoned");
            if s.sending {
                match &mut s.pending {
                    Some(p) => p.merge(woken),
                    None => s.pending = Some(woken),
                }
                return Ok(());
            }
            s.sending = true;
        }
        let (answer, first) = tokio::sync::oneshot::channel();
        let (wakes, pool) = (Arc::clone(self), pool.clone());
        tokio::spawn(async move {
            let mut answer = Some(answer);
            let mut woken = woken;
            loop {
                let sent = notify(&pool, &woken).await;
                if let Err(e) = &sent {
                    tracing::warn!(error = %e, "wake-up after a commit failed; lanes poll");
                }
                if let Some(a) = answer.take() {
                    let _ = a.send(sent);
                }
                let mut s = wakes.state.lock().expect("not poisoned");
                match s.pending.take() {
                    Some(next) => woken = next,
                    None => {
                        s.sending = false;
                        return;
                    }
                }
            }
        });
        first.await.unwrap_or(Ok(()))
    }
}

/// The outcome of a plan whose statement accepted `accepted` events.
pub(super) fn outcome(plan: PublishPlan, accepted: usize) -> PublishOutcome {
    let stored_duplicates = plan.fresh.len().saturating_sub(accepted);
    PublishOutcome {
        accepted,
        duplicates: plan.duplicates + stored_duplicates,
        lanes: plan.lanes(),
        ids: plan.ids,
    }
}

/// The statement (with its NOTIFY if `notify`) in a transaction of its own
/// on `conn`, committed only if `plan`'s expected sequences hold (rolled
/// back otherwise, answering [`crate::StoreError::SeqConflict`]).
async fn run_checked(
    conn: &mut PgConnection,
    plan: &PublishPlan,
    args: &PublishArgs<'_>,
    notify: bool,
) -> Result<Ran, TxError> {
    let mut tx = conn.begin().await?;
    let ran = run(&mut tx, args, notify).await?;
    if ran.stale {
        tx.rollback().await?;
        return Ok(ran);
    }
    if let Err(e) = expectations(plan, &ran) {
        tx.rollback().await?;
        return Err(e.into());
    }
    tx.commit().await?;
    Ok(ran)
}

/// One write of [`Store::publish`](crate::Store::publish) (a group of
/// batches, see [`crate::group`], on the [`Writer`]'s connection; or a
/// batch of a failed group alone, on the store's pool): the statement in
/// autocommit, so one round trip and, if `notify`, one NOTIFY, again after
/// a lost race (up to [`PUBLISH_ATTEMPTS`]). On the writer's connection a
/// lock wait past its `lock_timeout` (`55P03`) ends it as
/// [`crate::StoreError::Timeout`]. A plan with expected sequences runs in a
/// transaction ([`run_checked`]). Returns the ids found already stored, and
/// the lanes that got deliveries (ascending).
pub(super) async fn write(
    conns: Conns<'_>,
    catalog: &Cache,
    plan: &PublishPlan,
    notify: bool,
) -> Result<(HashSet<String>, Vec<Lane>)> {
    let mut plan = Cow::Borrowed(plan);
    let mut reruns = 0;
    if plan.catalog_version.is_none() {
        // A group of batches checked against different catalogs.
        let mut conn = conns.take().await?;
        plan = recheck(&mut conn, catalog, plan, &mut reruns).await?;
        conns.keep(conn);
    }
    let mut attempt = 1;
    loop {
        let args = PublishArgs::new(&plan);
        let mut conn = conns.take().await?;
        let ran = if args.expects {
            run_checked(&mut conn, &plan, &args, notify).await
        } else {
            run(&mut conn, &args, notify).await.map_err(TxError::from)
        };
        match ran {
            Ok(ran) if ran.stale => {
                drop(args);
                plan = recheck(&mut conn, catalog, plan, &mut reruns).await?;
                conns.keep(conn);
            }
            Ok(ran) => {
                conns.keep(conn);
                return Ok((ran.stored.into_iter().collect(), ran.lanes));
            }
            Err(TxError::Sql(e)) if attempt < PUBLISH_ATTEMPTS && is_retryable(&e) => {
                tracing::debug!(attempt, error = %e, "publish raced another publisher; retrying");
                attempt += 1;
            }
            Err(TxError::Sql(e)) if attempt < PUBLISH_ATTEMPTS && connection_lost(&e) => {
                tracing::debug!(attempt, error = %e, "publish connection lost; retrying");
                attempt += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Session settings of the group writer's connection ([`Writer`]),
/// after the pool's own:
///
/// - `lock_timeout` 100 ms: how long a group's write waits for a row lock
///   (a key counter held by an open transaction elsewhere, e.g. a
///   `publish_in` not yet committed) before it gives up and its batches are
///   written one by one on the store's pool, each with the session's own
///   `lock_timeout` ([`super::SESSION_DEFAULTS`]): a key held elsewhere
///   then holds back only its own publishers.
/// - `plan_cache_mode = force_generic_plan`: under the default `auto`,
///   PostgreSQL planned the statement anew on every call (a one-event
///   batch's custom plan is estimated far cheaper than the generic plan,
///   which assumes 10 events and, on an unanalyzed `handlers`, 230
///   handlers); planning was 0.28 of the statement's 0.36 ms per call
///   (`bench/results/stmt.md`). The generic plan suits every batch size:
///   hash joins over the batch's rows, index probes into `events`. The
///   writer runs no other statement.
///
/// As session settings they cost no round trip: a group's write is the
/// statement alone in autocommit (one round trip; a `BEGIN` with `SET
/// LOCAL` and a `COMMIT` took two more).
pub(super) const GROUP_SETTINGS: &[(&str, &str)] = &[
    ("lock_timeout", "100ms"),
    ("plan_cache_mode", "force_generic_plan"),
];

/// How long a connection of a [`side_pool`] stays open unused.
const SIDE_IDLE: Duration = Duration::from_secs(60);

/// Where a [`write`] takes its connection.
#[derive(Clone, Copy)]
pub(super) enum Conns<'a> {
    /// A pooled connection, returned to the pool after the write.
    Pool(&'a PgPool),
    /// The group writer's connection, kept between writes.
    Writer(&'a Writer),
}

impl Conns<'_> {
    async fn take(self) -> Result<PoolConnection<Postgres>> {
        match self {
            Conns::Pool(pool) => pool.acquire().await.map_err(map_err),
            Conns::Writer(w) => w.take().await,
        }
    }

    /// After a write that succeeded: the writer's connection is kept for
    /// the next one. (After a failure it goes back to its pool, whose test
    /// closes it if its session is broken.)
    fn keep(self, conn: PoolConnection<Postgres>) {
        if let Conns::Writer(w) = self {
            w.keep(conn);
        }
    }
}

/// The group writer's connection ([`crate::group`] writes one group at a
/// time), with [`GROUP_SETTINGS`], from a [`side_pool`] of one, kept
/// checked out between groups: sqlx 0.8 tests every connection returned to
/// a pool with a round trip (`return_to_pool` in sqlx-core's
/// `pool/connection.rs`: a `Sync` and its `ReadyForQuery`, in a task it
/// spawns), which per group cost PostgreSQL and the node a second wake-up
/// while the group's callers were being answered. It goes back to the pool
/// after a failed write, and once the writer has had nothing to write for
/// [`super::PING_IDLE`] ([`Writer::idle`]), so a quiet store's connection
/// gets the pool's checks (that test on its return, closing after
/// [`SIDE_IDLE`] unused) as before; and when the store's pool closes.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    pool: PgPool,
    held: Arc<std::sync::Mutex<Held>>,
}

#[derive(Debug, Default)]
struct Held {
    /// The connection and when its last write ended.
    conn: Option<(PoolConnection<Postgres>, tokio::time::Instant)>,
    /// The store's pool closed: nothing is kept any more.
    closed: bool,
    /// A task will give the connection back once it is unused for
    /// [`super::PING_IDLE`].
    reaping: bool,
}

impl Writer {
    /// The writer of the store whose pool is `pool`. Must be called inside
    /// a Tokio runtime.
    pub(super) fn new(pool: &PgPool) -> Self {
        let w = Writer {
            pool: side_pool(pool, GROUP_SETTINGS, 1),
            held: Arc::default(),
        };
        let closed = pool.close_event();
        let held = w.held.clone();
        tokio::spawn(async move {
            closed.await;
            let conn = {
                let mut h = held.lock().unwrap_or_else(PoisonError::into_inner);
                h.closed = true;
                h.conn.take()
            };
            if let Some((mut c, _)) = conn {
                // Closed, not returned: the side pool may be closing too.
                c.close_on_drop();
            }
        });
        w
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn take(&self) -> Result<PoolConnection<Postgres>> {
        let held = self.held().conn.take();
        match held {
            Some((c, used)) if used.elapsed() < super::PING_IDLE => Ok(c),
            // Unused too long: back to the pool, which tests it.
            stale => {
                drop(stale);
                self.pool.acquire().await.map_err(map_err)
            }
        }
    }

    fn keep(&self, mut conn: PoolConnection<Postgres>) {
        let mut held = self.held();
        if held.closed {
            conn.close_on_drop();
        } else if held.conn.is_none() {
            held.conn = Some((conn, tokio::time::Instant::now()));
        }
    }

    /// The group writer has nothing left to write: unless a later write
    /// uses it, its connection goes back to the pool after
    /// [`super::PING_IDLE`].
    pub(super) fn idle(&self) {
        let mut held = self.held();
        if held.reaping || held.conn.is_none() {
            return;
        }
        held.reaping = true;
        let held = Arc::clone(&self.held);
        tokio::spawn(async move {
            // Cleared however the task ends (its runtime may drop it).
            let mut reaping = Reaping(Some(Arc::clone(&held)));
            loop {
                let due = {
                    let mut h = held.lock().unwrap_or_else(PoisonError::into_inner);
                    match &h.conn {
                        Some((_, used)) if used.elapsed() < super::PING_IDLE => {
                            Some(*used + super::PING_IDLE)
                        }
                        _ => {
                            let conn = h.conn.take();
                            h.reaping = false;
                            drop(h);
                            drop(conn);
                            None
                        }
                    }
                };
                match due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => {
                        reaping.0 = None;
                        return;
                    }
                }
            }
        });
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // A pooled connection dropped goes back to its pool through a task
        // it spawns, which needs a runtime: without one (a store dropped
        // after its runtime), it is just closed.
        if tokio::runtime::Handle::try_current().is_err() {
            if let Some((c, _)) = self.conn.take() {
                drop(c.detach());
            }
        }
    }
}

/// Clears [`Held::reaping`] if the reaper task is dropped before it ends.
struct Reaping(Option<Arc<std::sync::Mutex<Held>>>);

impl Drop for Reaping {
    fn drop(&mut self) {
        if let Some(held) = self.0.take() {
            held.lock().unwrap_or_else(PoisonError::into_inner).reaping = false;
        }
    }
}

/// A pool of at most `size` connections with `pool`'s connect options and
/// `settings`, opened at first use, closed after [`SIDE_IDLE`] unused, and
/// closed when `pool` is closed (so closing the store's pool still closes
/// every connection of the store). Must be called inside a Tokio runtime.
pub(super) fn side_pool(pool: &PgPool, settings: &[(&str, &str)], size: u32) -> PgPool {
    let options = (*pool.connect_options())
        .clone()
        .options(settings.iter().copied());
    let side = super::side_pool_options()
        .max_connections(size)
        .idle_timeout(SIDE_IDLE)
        .acquire_timeout(super::ACQUIRE_TIMEOUT)
        .connect_lazy_with(options);
    let closed = pool.close_event();
    let s = side.clone();
    tokio::spawn(async move {
        closed.await;
        s.close().await;
    });
    side
}

/// [`PgStore::publish_in`](super::PgStore::publish_in): the statement,
/// without its NOTIFY, in the caller's transaction `conn`, inside a
/// savepoint when the batch has client-supplied ids (retried after a lost
/// race) or expected sequences (rolled back when one breaks). Returns the
/// outcome and the deliveries written; errors are raw sqlx errors (the
/// transaction helper retries serialization failures) or
/// [`crate::StoreError::SeqConflict`].
pub(super) async fn publish_in(
    conn: &mut PgConnection,
    catalog: Option<&Cache>,
    mut plan: PublishPlan,
) -> Result<(PublishOutcome, usize), TxError> {
    let mut reruns = 0;
    if let Some(catalog) = catalog {
        if catalog.get().apply(&mut plan).is_err() {
            // The cache may be older than the caller's snapshot.
            plan = recheck(conn, catalog, Cow::Owned(plan), &mut reruns)
                .await?
                .into_owned();
        }
    }
    let mut attempt = 1;
    loop {
        let args = PublishArgs::new(&plan);
        if !args.expects && !plan.fresh.iter().any(|e| e.client_id) {
            let ran = run(conn, &args, false).await?;
            if let (true, Some(catalog)) = (ran.stale, catalog) {
                drop(args);
                plan = recheck(conn, catalog, Cow::Owned(plan), &mut reruns)
                    .await?
                    .into_owned();
                continue;
            }
            return Ok((outcome(plan, ran.accepted), ran.deliveries));
        }
        let mut savepoint = conn.begin().await?;
        match run(&mut savepoint, &args, false).await {
            Ok(ran) if ran.stale => {
                savepoint.rollback().await?;
                let catalog = catalog.ok_or_else(|| {
                    crate::StoreError::Database("a plan without catalog came back stale".into())
                })?;
                drop(args);
                plan = recheck(conn, catalog, Cow::Owned(plan), &mut reruns)
                    .await?
                    .into_owned();
            }
            Ok(ran) => {
                if let Err(e) = expectations(&plan, &ran) {
                    savepoint.rollback().await?;
                    return Err(e.into());
                }
                savepoint.commit().await?;
                return Ok((outcome(plan, ran.accepted), ran.deliveries));
            }
            Err(e) => {
                savepoint.rollback().await?;
                // A serialization failure dooms the caller's transaction
                // (REPEATABLE READ, SERIALIZABLE): only running it again
                // from its start helps, so it goes to the caller.
                if attempt >= PUBLISH_ATTEMPTS || !is_retryable(&e) || is_serialization_failure(&e)
                {
                    return Err(e.into());
                }
                tracing::debug!(attempt, error = %e, "publish_in raced another publisher; retrying");
                attempt += 1;
            }
        }
    }
}
