//! MongoDB backend (`mongodb://...`, official driver 3.x): the same
//! dispatcher for users whose system of record is MongoDB.
//!
//! The store needs a **replica set** (or a sharded cluster): every write
//! that must be atomic is a multi-document transaction, and MongoDB offers
//! transactions only there. [`MongoStore::connect`] checks this and refuses a
//! standalone server with [`StoreError::Invalid`]. The database is the URL's
//! path (`mongodb://h1,h2,h3/lanebus?replicaSet=rs0`), `lanebus` if absent.
//!
//! # Collections
//!
//! ```text
//!  meta         {_id: "store", lanes, schema_version}
//!  lanes        {_id: lane, owner, epoch, writes}          fencing
//!  counters     {_id: "k/<key>", n}  last sequence number of a key
//!               {_id: "l/<lane>", n} last claim position of a lane
//!               {_id: "handlers" | "dead_letters", n}      id sources
//!  handlers     {_id: "hdl_…", seq, name, url, event_types, …, state}
//!  events       {_id: event id, type, key, lane, seq, payload, published_at}
//!  deliveries   {_id: pos << 16 | lane, lane, pos, handler_id, event_id,
//!                key, seq, attempts, due_at, last_error,
//!                attempt_log?}                             index (lane, pos)
//!  completions  {event_id, handler_id, attempts, completed_at}  append-only
//!  dead_letters {_id: n, handler_id, event_id, lane, key, seq, attempts,
//!                last_error, failed_at, attempt_log?}
//! ```
//!
//! `attempt_log`: the last failed attempts of a delivery
//! ([`FailedAttempt`]s, oldest first, at most [`ATTEMPT_LOG_LEN`]), set by
//! the reschedule or dead letter that records a failure (absent until one
//! failed; claims do not read it). A field that may be absent needs no
//! migration: documents written before it read as an empty log.
//!
//! ```text
//! ```
//!
//! Times are Int64 microseconds since the Unix epoch (BSON dates have
//! milliseconds only; `due_at` must round-trip exactly). Payloads are BSON
//! binary (generic subtype), kept byte for byte.
//!
//! # Choices (the same as the SQL backends where MongoDB allows)
//!
//! - **Delete on complete, no update on claim.** A delivery document is
//!   inserted once and deleted once; claims only read (one fenced owner per
//!   lane); completions append to `completions` (no unique index).
//! - **Publish is one transaction** with read concern `snapshot` and write
//!   concern `majority` (`publish.rs`): stored-id check, handlers
//!   (routes are matched in Rust on the snapshot, so a handler registered
//!   through another node is seen at once), the counters, `insertMany` of
//!   events, `insertMany` of deliveries.
//! - **Per-key sequence and per-lane position through counter documents**
//!   updated inside that transaction. MongoDB transactions are snapshot
//!   isolated and a document written by one open transaction makes every
//!   other transaction that writes it fail with `WriteConflict` (label
//!   `TransientTransactionError`), as does a write to a document changed
//!   after the writer's snapshot. So two publishers of one key cannot both
//!   take number n: one aborts and retries from a fresh snapshot.
//! - **Retries** follow the driver specification's documented pattern: the
//!   whole transaction again on `TransientTransactionError` (and on a
//!   duplicate key from a concurrent first insert of the same id or counter,
//!   a bounded number of times), the commit alone again on
//!   `UnknownTransactionCommitResult`; with jittered backoff, for at most
//!   [`TXN_RETRY_LIMIT`].
//! - **Idempotent by event id**: `events._id` is the event id, unique by
//!   construction. Ids already stored are found by the snapshot read and
//!   counted as duplicates; a concurrent publisher of the same id makes the
//!   insert fail (write conflict or duplicate key) and the retry then finds it.
//!
//! # Claim cursor: a per-lane position taken in the publish transaction
//!
//! MongoDB has no transaction id horizon like PostgreSQL's xmin, so the
//! cursor is a **per-lane position**: the publish transaction raises the
//! lane's counter (`counters` `l/<lane>`) by its number of deliveries in the
//! lane and numbers them `pos = old + 1 …`; a claim reads `pos > after` in
//! `(lane, pos)` order and returns the last position read as the next cursor.
//!
//! Why this is commit-ordered: a transaction that wrote the lane's counter
//! holds it until it commits or aborts; any other publisher into that lane
//! write-conflicts and retries, and can only take larger positions after the
//! first one has committed (or aborted, freeing its positions for reuse by
//! the next one, which nobody has read). So a lane's positions become
//! visible in increasing order, and a claim that read position p can never
//! later find a smaller one appearing: the late-commit pitfall cannot happen.
//! The price is that publishers into the same lane are serialized (those
//! into different lanes are not), which the per-key sequence already implies
//! for keyed events. Claims read in a `snapshot` read-concern transaction, so
//! a query yield cannot switch snapshots halfway through a lane and reads are
//! of majority-committed data (a position read can never be rolled back by a
//! failover and handed out again).
//!
//! The alternative, the cluster time of the commit (oplog timestamp), is not
//! known to the transaction while it writes its documents, and reading the
//! oplog needs privileges and a tailing reader; the counter needs neither.
//!
//! A delivery id is `pos << 16 | lane`: unique and never reused (positions
//! only grow), without a global counter that every publisher would contend
//! on. Replays (dead letters put back) take fresh positions the same way, so
//! the owner's cursor sees them.
//!
//! # Fencing
//!
//! `fence` raises `lanes.epoch` with a conditional `updateOne` (write concern
//! majority) and confirms it with a `find` at read concern majority in the
//! same causally consistent session: it reads its own write, and never a
//! lane document a rollback could take back. Claims compare the epoch they
//! read (in the claim's snapshot).
//! Completions, reschedules and dead letters are transactions that read the
//! epochs of their lanes and then **write the lane documents they rely on**
//! (`$inc: {writes: 1}` on the lanes whose epoch matched), before acting
//! only on those lanes. A fence that committed after the transaction's
//! snapshot, or is still open, makes that write conflict, so the
//! transaction retries and reads the new epoch; a fence that arrives while
//! the transaction holds the lane document waits for it (a write outside a
//! transaction waits for the transaction's lock), so it is ordered after it.
//! Either way a deposed owner's batch changes nothing once a fence has
//! committed (invariant 4), and lanes it does not own are not written at
//! all. The `writes` counter costs one small update per lane per batch.
//!
//! # Round trips per call (measured: driver command events, test
//! `round_trips_per_publish_claim_and_complete`)
//!
//! - publish (any batch size): stored-id `find` (only with client-supplied
//!   ids), handlers `find`, counters `find`, counters `insert` (keys or lanes
//!   seen for the first time) and/or one counters `update` (`$inc`, or a
//!   pipeline `updateMany` adding each document's own increment), events
//!   `insert`, deliveries `insert`, `commitTransaction`. Measured for 100
//!   keyed events to 2 handlers: 7 with client ids and new keys, 6 with
//!   generated ids on known keys.
//! - claim of many lanes: lanes `find`, one `aggregate` per 64 lanes
//!   (`$unionWith` one indexed sub-pipeline per lane, `$lookup` of the
//!   events), `commitTransaction` of the read-only transaction: 3 for 10
//!   lanes (cursors ask for the whole result in the first batch, so no
//!   `getMore` below 16 MB).
//! - complete (any batch size): lanes `find`, lanes `update`, deliveries
//!   `find`, deliveries `delete`, completions `insert`, `commitTransaction`:
//!   6 for 200 deliveries. Reschedules replace the documents (`delete` +
//!   `insert`, 6); dead letters also take ids from a counter (8).
//! - fence: one `update` (write concern majority) and one `find` (read
//!   concern majority, same causally consistent session).
//!
//! # Wake-ups
//!
//! [`Store::wakeups`] opens a change stream on `deliveries` (inserts only,
//! projected to the resume token) and coalesces its events into the wake-up
//! channel; where the server refuses change streams it answers
//! [`Wakeups::Poll`]. The choice is logged. A stream that breaks later is
//! reopened after a second, waking the node meanwhile.
//!
//! # Handler deletion
//!
//! As in PostgreSQL: deleting a handler removes it and its deliveries in one
//! transaction; a publish whose snapshot still had the handler may create
//! deliveries for it, which the node discards.
//!
//! # Test server quirks
//!
//! The tests run on SecantusDB 0.7.0b3 (a MongoDB-compatible server; see
//! `scripts/test`). It behaved as MongoDB does for everything used here
//! (write conflicts with `TransientTransactionError`, outside writes waiting
//! for a transaction's lock, pipeline updates, `$unionWith`, `$lookup`,
//! snapshot reads, change streams). Measured there, on a 16,000-document
//! collection: `$in` costs grow with the square of the list (200 ids 35 ms,
//! 5,000 ids 26 s) and `$or` is slow (200 equality branches 7 s), where
//! MongoDB turns both into index bounds; and an aggregation's `$match`
//! fetches every matching document before `$sort` + `$limit` apply (a claim
//! of 10 lanes holding 1,600 deliveries each took about 4 s for 500 rows),
//! where MongoDB pushes both into the index scan. Each `$unionWith`
//! sub-pipeline of a claim costs about a scan of `deliveries` there (with
//! 1,800 deliveries stored: one lane alone 50 ms, 5 lanes through
//! `$unionWith` 1.3 s, a 64-lane chunk 14 s), so a claim's cost grows with
//! the lanes claimed together. The code keeps `$in` (MongoDB's own pattern;
//! the node's batches are a few hundred) and the one-aggregation claim, and
//! uses no `$or` on a hot path; the tests keep batches at the node's size,
//! and the node's integration tests create their MongoDB stores with 16
//! lanes instead of 256 (`node/tests/common`). Nothing else is worked around.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use ::mongodb::bson::{doc, Bson, Document};
use ::mongodb::error::{
    Error as MongoError, ErrorKind, TRANSIENT_TRANSACTION_ERROR, UNKNOWN_TRANSACTION_COMMIT_RESULT,
};
use ::mongodb::options::{
    ClientOptions, IndexOptions, ReadConcern, TransactionOptions, WriteConcern,
};
use ::mongodb::{Client, ClientSession, Collection, Database, IndexModel};
use async_trait::async_trait;

use crate::common::PublishPlan;
use crate::group::{GroupWriter, Grouper};
use crate::*;
use error::{error_code, is_duplicate_key, map_err, TxnError, TxnResult, DUPLICATE_KEY};

/// How long a transaction is retried on transient errors before the error
/// is returned (the driver specification's convenient API uses 120 s; lane
/// owners retry themselves, so we give up sooner).
pub const TXN_RETRY_LIMIT: Duration = Duration::from_secs(60);

/// Retries after a duplicate key error (a concurrent first insert of the same
/// event id or counter) before it is returned as [`StoreError::Conflict`].
const DUPLICATE_RETRIES: u32 = 5;

/// Default database when the URL names none.
pub const DEFAULT_DATABASE: &str = "lanebus";

/// Cursor batch size asked for: the whole result in the first batch (the
/// server still cuts a batch at 16 MB), so a read is one round trip without
/// `getMore`.
pub(crate) const FULL_BATCH: u32 = 1_000_000;

/// The MongoDB store. Cheap to clone: clones share the client's pool.
#[derive(Debug, Clone)]
pub struct MongoStore {
    client: Client,
    db: Database,
    lanes: u16,
    /// Where the next retention batch goes on reading events (see
    /// `dispatch::prune`), shared by clones.
    prune_resume: std::sync::Arc<std::sync::Mutex<Option<dispatch::PruneResume>>>,
    /// Concurrent publishes, written in groups; shared by clones.
    group: std::sync::Arc<Grouper>,
    /// The event-type catalog, compiled ([`crate::event_types`]).
    catalog: std::sync::Arc<crate::event_types::Cache>,
    /// The master key and cached data keys ([`crate::personal`]), shared by
    /// clones.
    keyring: std::sync::Arc<crate::personal::Keyring>,
}

/// The collections, by name.
pub(crate) mod names {
    pub const META: &str = "meta";
    pub const LANES: &str = "lanes";
    pub const COUNTERS: &str = "counters";
    pub const HANDLERS: &str = "handlers";
    pub const EVENTS: &str = "events";
    pub const DELIVERIES: &str = "deliveries";
    pub const COMPLETIONS: &str = "completions";
    pub const DEAD_LETTERS: &str = "dead_letters";
    pub const EVENT_TYPES: &str = "event_types";
    pub const SUBJECT_KEYS: &str = "subject_keys";
    pub const ALL: [&str; 10] = [
        META,
        LANES,
        COUNTERS,
        HANDLERS,
        EVENTS,
        DELIVERIES,
        COMPLETIONS,
        DEAD_LETTERS,
        EVENT_TYPES,
        SUBJECT_KEYS,
    ];
}

/// Options of every transaction: snapshot reads, majority writes.
fn txn_options() -> TransactionOptions {
    TransactionOptions::builder()
        .read_concern(ReadConcern::snapshot())
        .write_concern(WriteConcern::majority())
        .build()
}

/// Retry bookkeeping for one transaction (the documented retry loop).
struct Retry {
    started: Instant,
    attempts: u32,
    duplicates: u32,
}

impl Retry {
    fn new() -> Self {
        Retry {
            started: Instant::now(),
            attempts: 0,
            duplicates: 0,
        }
    }

    /// Whether to run the whole transaction again after `e`; sleeps a
    /// jittered backoff first: up to 2^attempts ms, at most about 1 s (a
    /// 64 ms cap let one of eight publishers of the same hot keys lose every
    /// round for the whole [`TXN_RETRY_LIMIT`] on a loaded test server).
    async fn again(&mut self, e: &MongoError) -> bool {
        let transient = e.contains_label(TRANSIENT_TRANSACTION_ERROR);
        let duplicate = is_duplicate_key(e) && self.duplicates < DUPLICATE_RETRIES;
        if !(transient || duplicate) || self.started.elapsed() >= TXN_RETRY_LIMIT {
            return false;
        }
        if duplicate {
            self.duplicates += 1;
        }
        self.attempts += 1;
        let cap_ms = 1u64 << self.attempts.min(10);
        let wait = Duration::from_micros(rand::random::<u64>() % (cap_ms * 1000) + 100);
        tracing::debug!(attempt = self.attempts, error = %e, "mongodb transaction retried");
        tokio::time::sleep(wait).await;
        true
    }
}

/// Commits, retrying the commit alone on `UnknownTransactionCommitResult`.
async fn commit(session: &mut ClientSession, retry: &Retry) -> std::result::Result<(), MongoError> {
    loop {
        match session.commit_transaction().await {
            Ok(()) => return Ok(()),
            Err(e)
                if e.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT)
                    && retry.started.elapsed() < TXN_RETRY_LIMIT =>
            {
                tracing::debug!(error = %e, "mongodb commit result unknown; committing again");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs `$body` (an expression of type `impl Future<Output = TxnResult<T>>`
/// using `$sess: &mut ClientSession`) in a transaction of `$store`, with the
/// documented retries. Evaluates to `crate::Result<T>`.
macro_rules! in_transaction {
    ($store:expr, |$sess:ident| $body:expr) => {{
        let mut session = $store
            .client
            .start_session()
            .await
            .map_err($crate::mongodb::error::map_err)?;
        let mut retry = $crate::mongodb::Retry::new();
        loop {
            session
                .start_transaction()
                .with_options($crate::mongodb::txn_options())
                .await
                .map_err($crate::mongodb::error::map_err)?;
            let outcome = {
                let $sess = &mut session;
                $body.await
            };
            let failed = match outcome {
                Ok(v) => match $crate::mongodb::commit(&mut session, &retry).await {
                    Ok(()) => break Ok(v),
                    Err(e) => e,
                },
                Err(e) => {
                    // Errors of an abort are ignored, as the specification says.
                    let _ = session.abort_transaction().await;
                    match e {
                        $crate::mongodb::error::TxnError::Mongo(e) => e,
                        $crate::mongodb::error::TxnError::Store(e) => break Err(e),
                    }
                }
            };
            if !retry.again(&failed).await {
                break Err($crate::mongodb::error::map_err(failed));
            }
        }
    }};
}

// Declared after `in_transaction!`, so that they can use it.
mod catalog;
mod dispatch;
mod error;
mod event_types;
mod migrate;
mod publish;
mod subject_keys;

impl MongoStore {
    /// The stored event-type catalog, read in a transaction of its own.
    async fn stored_catalog(&self) -> Result<crate::event_types::Stored> {
        in_transaction!(self, |sess| event_types::load(self, sess))
    }

    /// Connects to `url` (`mongodb://...`), checks that the server offers
    /// transactions, creates collections and indexes ([`MongoStore::migrate`])
    /// and, for a new store, [`DEFAULT_LANES`] lanes.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a malformed URL or a standalone server
    /// (no replica set: no transactions); [`StoreError::Unavailable`] when
    /// no server answers; [`StoreError::Database`] otherwise.
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with_lanes(url, DEFAULT_LANES).await
    }

    /// As [`MongoStore::connect`], creating `lanes` lanes if the store is
    /// new. An existing store keeps the lane count it was created with.
    ///
    /// # Errors
    /// As [`MongoStore::connect`]; [`StoreError::Invalid`] if `lanes` is 0.
    pub async fn connect_with_lanes(url: &str, lanes: u16) -> Result<Self> {
        if lanes == 0 {
            return Err(StoreError::Invalid(
                "a store needs at least one lane".into(),
            ));
        }
        let options = ClientOptions::parse(url)
            .await
            .map_err(|e| match e.kind.as_ref() {
                ErrorKind::InvalidArgument { .. } => {
                    StoreError::Invalid(format!("mongodb url {url:?}: {e}"))
                }
                _ => map_err(e),
            })?;
        let database = options
            .default_database
            .clone()
            .unwrap_or_else(|| DEFAULT_DATABASE.to_string());
        let client = Client::with_options(options).map_err(map_err)?;
        Self::with_client(client, &database, lanes).await
    }

    /// Opens the store in `database` through an existing `client` (for
    /// applications that already hold one: a [`MongoStore::publish_in`]
    /// session must come from the store's own client). Checks for a replica
    /// set, migrates, and creates `lanes` lanes if the store is new.
    ///
    /// # Errors
    /// As [`MongoStore::connect_with_lanes`].
    pub async fn with_client(client: Client, database: &str, lanes: u16) -> Result<Self> {
        if lanes == 0 {
            return Err(StoreError::Invalid(
                "a store needs at least one lane".into(),
            ));
        }
        let db = client.database(database);
        let hello = db.run_command(doc! { "hello": 1 }).await.map_err(map_err)?;
        let replica_set = hello.get_str("setName").is_ok();
        let mongos = hello.get_str("msg") == Ok("isdbgrid");
        if !replica_set && !mongos {
            return Err(StoreError::Invalid(format!(
                "the mongodb store needs a replica set or a sharded cluster (it uses transactions); \
                 the server of database {database:?} is a standalone"
            )));
        }
        let mut store = MongoStore {
            client,
            db,
            lanes,
            prune_resume: std::sync::Arc::default(),
            group: std::sync::Arc::default(),
            catalog: std::sync::Arc::default(),
            keyring: std::sync::Arc::default(),
        };
        store.lanes = migrate::migrate(&store, lanes).await?;
        // The catalog as it is now, so the first publish need not load it.
        store.catalog.replace(&store.stored_catalog().await?)?;
        Ok(store)
    }

    /// Creates the collections and indexes (idempotent; safe while other
    /// nodes use the store) and records the schema version. `lanebus
    /// migrate` and every start call it.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when the server cannot be reached;
    /// [`StoreError::Database`] when an index cannot be built.
    pub async fn migrate(&self) -> Result<()> {
        migrate::migrate(self, self.lanes).await.map(|_| ())
    }

    /// The driver client, for callers that publish inside their own
    /// transaction ([`MongoStore::publish_in`]).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Publishes and their writes so far, on this store and its clones
    /// (concurrent publishes are written in groups: [`GroupStats`]).
    pub fn publish_stats(&self) -> GroupStats {
        self.group.stats()
    }

    /// The database the store lives in.
    pub fn database(&self) -> &Database {
        &self.db
    }

    pub(crate) fn coll(&self, name: &str) -> Collection<Document> {
        self.db.collection(name)
    }

    /// Publishes `events` inside the caller's transaction on `session`: the
    /// same writes as [`Store::publish`], which exist if and only if the
    /// caller commits. The session must come from the store's client
    /// ([`MongoStore::client`], or open the store on the application's own
    /// client with [`MongoStore::with_client`]), in a transaction the
    /// caller started (`session.start_transaction()`; read concern
    /// `snapshot` and write concern `majority` are recommended). A session
    /// without a transaction in progress (never started, or already
    /// committed or aborted) is refused before anything is written: its
    /// writes would not be atomic, and events could be stored without their
    /// deliveries and never be delivered. Nothing needs sending after the
    /// commit: lane owners learn of the deliveries from their change stream
    /// ([`Store::wakeups`]).
    ///
    /// While the transaction is open it holds the counters of the keys and
    /// lanes it published into, so other publishers into those lanes retry
    /// until it ends (that is what keeps the claim cursor commit-ordered):
    /// keep it short.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for an event breaking [`NewEvent::validate`]
    /// (nothing is written and the transaction stays usable), or for a
    /// session without a transaction in progress (nothing is written);
    /// [`StoreError::Conflict`] for a write conflict with another publisher
    /// (the transaction is aborted: run the whole transaction again, as
    /// MongoDB's `TransientTransactionError` label asks);
    /// [`StoreError::SeqConflict`] for a broken expected sequence
    /// ([`NewEvent::expected_seq`]): the key counters were raised in the
    /// transaction (MongoDB has no savepoints), so it aborts the
    /// transaction, whose commit would leave a gap in the keys' sequences:
    /// run the whole transaction again after reading the key's state;
    /// [`StoreError::Unavailable`]/[`StoreError::Database`] otherwise.
    pub async fn publish_in(
        &self,
        session: &mut ClientSession,
        events: Vec<NewEvent>,
    ) -> Result<PublishOutcome> {
        let plan = PublishPlan::new(events, self.lanes)?;
        require_transaction(session).await?;
        match publish::publish_in(self, session, plan).await {
            Ok(out) => Ok(out),
            Err(TxnError::Store(e @ StoreError::SeqConflict { .. })) => {
                // Errors of an abort are ignored, as the specification says.
                let _ = session.abort_transaction().await;
                Err(e)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// `Ok` if a transaction is in progress on `session`. The driver does not
/// say so publicly, but starting one tells: it fails with "transaction
/// already in progress" exactly then. A transaction this starts (the session
/// had none) is aborted at once; neither step sends a command.
async fn require_transaction(session: &mut ClientSession) -> Result<()> {
    const REFUSED: &str = "publish_in needs a session with a transaction in progress \
                           (session.start_transaction() first); nothing was written";
    match session.start_transaction().await {
        Ok(()) => {
            let _ = session.abort_transaction().await;
            Err(StoreError::Invalid(REFUSED.into()))
        }
        Err(e) => match e.kind.as_ref() {
            ErrorKind::Transaction { message, .. } if message.contains("already in progress") => {
                Ok(())
            }
            _ => Err(StoreError::Invalid(format!("{REFUSED}: {e}"))),
        },
    }
}

/// Reads an integer field stored as Int32, Int64 or Double.
pub(crate) fn get_int(d: &Document, key: &str) -> Result<i64> {
    match d.get(key) {
        Some(Bson::Int32(v)) => Ok(i64::from(*v)),
        Some(Bson::Int64(v)) => Ok(*v),
        Some(Bson::Double(v)) if v.fract() == 0.0 => Ok(*v as i64),
        other => Err(StoreError::Database(format!(
            "field {key:?} is not an integer: {other:?}"
        ))),
    }
}

/// Reads an optional integer field (absent or null → `None`).
pub(crate) fn get_opt_int(d: &Document, key: &str) -> Result<Option<i64>> {
    match d.get(key) {
        None | Some(Bson::Null) => Ok(None),
        Some(_) => get_int(d, key).map(Some),
    }
}

/// Reads a string field.
pub(crate) fn get_string(d: &Document, key: &str) -> Result<String> {
    d.get_str(key)
        .map(str::to_owned)
        .map_err(|e| StoreError::Database(format!("field {key:?}: {e}")))
}

/// Reads an optional string field (absent or null → `None`).
pub(crate) fn get_opt_string(d: &Document, key: &str) -> Result<Option<String>> {
    match d.get(key) {
        None | Some(Bson::Null) => Ok(None),
        Some(Bson::String(s)) => Ok(Some(s.clone())),
        other => Err(StoreError::Database(format!(
            "field {key:?} is not a string: {other:?}"
        ))),
    }
}

/// Reads a lane number.
pub(crate) fn get_lane(d: &Document, key: &str) -> Result<Lane> {
    let v = get_int(d, key)?;
    Lane::try_from(v).map_err(|_| StoreError::Database(format!("lane {v} out of range")))
}

/// Optional string as BSON (`null` when absent).
pub(crate) fn opt_str(v: Option<&str>) -> Bson {
    v.map_or(Bson::Null, |s| Bson::String(s.to_owned()))
}

/// Optional integer as BSON (`null` when absent).
pub(crate) fn opt_i64(v: Option<i64>) -> Bson {
    v.map_or(Bson::Null, Bson::Int64)
}

/// Reads a document's attempt log (field `attempt_log`: absent or null is
/// empty).
pub(crate) fn get_attempt_log(d: &Document) -> Result<Vec<FailedAttempt>> {
    match d.get("attempt_log") {
        None | Some(Bson::Null) => Ok(Vec::new()),
        Some(v) => ::mongodb::bson::from_bson(v.clone()).map_err(|e| {
            StoreError::Database(format!(
                "field \"attempt_log\" is not a list of attempts: {e}"
            ))
        }),
    }
}

/// A delivery document's attempt log with `failure` appended (the last
/// [`ATTEMPT_LOG_LEN`] kept), as BSON; the log as it is for `None`.
pub(crate) fn appended_log(d: &Document, failure: Option<&FailedAttempt>) -> Result<Bson> {
    let Some(f) = failure else {
        return Ok(d.get("attempt_log").cloned().unwrap_or(Bson::Null));
    };
    let mut log = get_attempt_log(d)?;
    f.clone().push_onto(&mut log);
    ::mongodb::bson::to_bson(&log)
        .map_err(|e| StoreError::Database(format!("attempt log to BSON: {e}")))
}

/// Delivery id of position `pos` in `lane`: unique, never reused.
pub(crate) fn delivery_id(lane: Lane, pos: i64) -> i64 {
    (pos << 16) | i64::from(lane)
}

#[async_trait]
impl GroupWriter for MongoStore {
    async fn write_plan(&self, plan: &PublishPlan) -> Result<HashSet<String>> {
        publish::write(self, plan).await
    }
}

#[async_trait]
impl Store for MongoStore {
    fn backend(&self) -> &'static str {
        "mongodb"
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
            || self.stored_catalog(),
            plan,
        )
        .await
    }

    async fn publish_operational(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        let mut plan = PublishPlan::operational(events, self.lanes)?;
        self.catalog.check(&mut plan, self.stored_catalog()).await?;
        crate::personal::seal_plan(self, &mut plan).await?;
        self.group.publish(self, plan).await
    }

    async fn fence(&self, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool> {
        dispatch::fence(self, lane, owner, epoch).await
    }

    async fn claim(&self, lanes: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        in_transaction!(self, |sess| dispatch::claim(self, sess, lanes))
    }

    async fn complete(&self, done: &[DeliveryRef]) -> Result<Vec<i64>> {
        if done.is_empty() {
            return Ok(Vec::new());
        }
        in_transaction!(self, |sess| dispatch::complete(self, sess, done))
    }

    async fn discard(&self, refs: &[DeliveryRef]) -> Result<Vec<i64>> {
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        in_transaction!(self, |sess| dispatch::discard(self, sess, refs))
    }

    async fn reschedule(&self, items: &[Reschedule]) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        in_transaction!(self, |sess| dispatch::reschedule(self, sess, items))
    }

    async fn dead_letter(&self, items: &[DeadLetterRequest]) -> Result<Vec<i64>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        in_transaction!(self, |sess| dispatch::dead_letter(self, sess, items))
    }

    async fn create_handler(&self, handler: NewHandler) -> Result<Handler> {
        let handler = handler.normalized()?;
        catalog::create_handler(self, handler).await
    }

    async fn list_handlers(&self) -> Result<Vec<Handler>> {
        catalog::list_handlers(self).await
    }

    async fn get_handler(&self, id: &str) -> Result<Handler> {
        catalog::get_handler(self, id).await
    }

    async fn change_handler_state(
        &self,
        id: &str,
        state: HandlerState,
        reason: &str,
    ) -> Result<StateChange> {
        let was = catalog::change_handler_state(self, id, state, reason).await?;
        let handler = catalog::get_handler(self, id).await?;
        // The change's operational event, right after the single-document
        // update (no transaction to share; a failure is logged by publish).
        if let Some(e) = (was != handler.state)
            .then(|| crate::operational::state_changed(&handler, true, chrono::Utc::now()))
            .flatten()
        {
            crate::operational::publish(self, e).await;
        }
        Ok(StateChange { handler, was })
    }

    async fn update_handler(&self, id: &str, patch: &HandlerPatch) -> Result<Handler> {
        catalog::update_handler(self, id, patch).await
    }

    async fn rotate_handler_secret(
        &self,
        id: &str,
        secret: &str,
        previous_until: chrono::DateTime<chrono::Utc>,
    ) -> Result<Handler> {
        crate::common::validate_secret(secret)?;
        catalog::rotate_handler_secret(self, id, secret, previous_until).await
    }

    async fn mark_handler_failing(
        &self,
        id: &str,
        failing: bool,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<()> {
        catalog::mark_handler_failing(self, id, failing, at).await
    }

    async fn delete_handler(&self, id: &str) -> Result<DeletedHandler> {
        let (removed, discarded) =
            in_transaction!(self, |sess| catalog::delete_handler(self, sess, id))?;
        if removed == 0 {
            return Err(StoreError::NotFound(format!("handler {id}")));
        }
        Ok(discarded)
    }

    async fn create_event_type(&self, new: NewEventType) -> Result<EventType> {
        let change = crate::event_types::Change::Create(new);
        in_transaction!(self, |sess| event_types::change_in(
            self,
            sess,
            change.clone()
        ))?
        .into_type()
    }

    async fn list_event_types(&self) -> Result<Vec<EventType>> {
        Ok(self.stored_catalog().await?.types)
    }

    async fn update_event_type(&self, name: &str, patch: &EventTypePatch) -> Result<EventType> {
        let change = crate::event_types::Change::Update(name.to_owned(), patch.clone());
        in_transaction!(self, |sess| event_types::change_in(
            self,
            sess,
            change.clone()
        ))?
        .into_type()
    }

    async fn catalog_settings(&self) -> Result<CatalogSettings> {
        Ok(self.stored_catalog().await?.settings)
    }

    async fn set_catalog_settings(&self, settings: CatalogSettings) -> Result<CatalogSettings> {
        let change = crate::event_types::Change::Settings(settings);
        in_transaction!(self, |sess| event_types::change_in(
            self,
            sess,
            change.clone()
        ))?;
        Ok(settings)
    }

    fn keyring(&self) -> &crate::personal::Keyring {
        &self.keyring
    }

    async fn subject_keys(&self, subjects: &[String]) -> Result<Vec<crate::personal::WrappedKey>> {
        subject_keys::get(self, subjects).await
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
        catalog::list_dead_letters(self, filter).await
    }

    async fn replay_dead_letters(&self, ids: &[i64], handler_id: Option<&str>) -> Result<u64> {
        if ids.is_empty() && handler_id.is_none() {
            return Ok(0);
        }
        in_transaction!(self, |sess| dispatch::replay_dead_letters(
            self, sess, ids, handler_id, None, None
        ))
    }

    async fn replay_dead_letters_between(
        &self,
        handler_id: &str,
        failed_since: Option<chrono::DateTime<chrono::Utc>>,
        failed_until: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<u64> {
        in_transaction!(self, |sess| dispatch::replay_dead_letters(
            self,
            sess,
            &[],
            Some(handler_id),
            failed_since,
            failed_until
        ))
    }

    async fn recover(
        &self,
        handler_id: &str,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<RecoverOutcome> {
        catalog::get_handler(self, handler_id).await?;
        in_transaction!(self, |sess| dispatch::recover(
            self, sess, handler_id, since
        ))
    }

    async fn prune(&self, before: chrono::DateTime<chrono::Utc>, limit: u32) -> Result<Pruned> {
        if limit == 0 {
            return Ok(Pruned::default());
        }
        let from = self.prune_resume.lock().expect("not poisoned").clone();
        let (pruned, next) = in_transaction!(self, |sess| dispatch::prune(
            self,
            sess,
            before,
            limit,
            from.clone()
        ))?;
        *self.prune_resume.lock().expect("not poisoned") = next;
        Ok(pruned)
    }

    async fn lane_rows(&self) -> Result<Vec<LaneRow>> {
        catalog::lane_rows(self).await
    }

    async fn counts(&self) -> Result<StoreCounts> {
        catalog::counts(self).await
    }

    async fn lookup_event(&self, id: &str) -> Result<Option<EventLookup>> {
        in_transaction!(self, |sess| catalog::lookup_event(self, sess, id))
    }

    async fn handler_deliveries(
        &self,
        q: &HandlerDeliveriesQuery,
    ) -> Result<Vec<HandlerDeliveryItem>> {
        catalog::handler_deliveries(self, q).await
    }

    async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
        Ok(chrono::Utc::now())
    }

    async fn ping(&self) -> Result<()> {
        self.db
            .run_command(doc! { "ping": 1 })
            .await
            .map_err(map_err)?;
        Ok(())
    }

    async fn wakeups(&self) -> Result<Wakeups> {
        dispatch::wakeups(self).await
    }
}
