//! The store conformance suite: the same tests against every backend.
//!
//! - SQLite: a fresh file in a temporary directory per test.
//! - PostgreSQL: a fresh database (`lanebus_t_<random>`) per test in the
//!   server named by `LANEBUS_TEST_POSTGRES_URL` (a superuser URL), so tests
//!   run in parallel. Without that variable the PostgreSQL tests FAIL: run
//!   `scripts/test`, or start a server with `scripts/pg-start DIR` and export
//!   the URL it prints.
//!
//! - MongoDB (feature `mongodb`, which the store's tests turn on with the
//!   others): a fresh database (`lanebus_t_<random>`) per test in the
//!   replica set named by `LANEBUS_TEST_MONGODB_URI`; without that variable
//!   the MongoDB tests FAIL.
//!   `scripts/test` starts a MongoDB-compatible test server and sets it.
//!
//! Each test is an async fn taking a [`Harness`]; the `conformance!` macro
//! instantiates it once per backend (`sqlite::name`, `postgres::name`,
//! `mongodb::name`).

mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use common::{new_handler, with_database};
use lanebus_store::postgres::PgStore;
use lanebus_store::sqlite::SqliteStore;
use lanebus_store::*;

// ---------------------------------------------------------------------------
// Harnesses
// ---------------------------------------------------------------------------

/// One backend instance under test.
/// A sqlx error of a harness's own transaction, as the store's error.
fn sql_error(e: sqlx::Error) -> StoreError {
    StoreError::Database(e.to_string())
}

#[async_trait]
trait Harness: Send + Sync {
    /// The store.
    fn store(&self) -> Arc<dyn Store>;
    /// A second, independent connection to the same store (another "process").
    async fn reopen(&self) -> Arc<dyn Store>;
    /// Runs `publish_in` once per batch inside one caller transaction, then
    /// commits (`commit`) or rolls back.
    async fn publish_in_many(
        &self,
        batches: Vec<Vec<NewEvent>>,
        commit: bool,
    ) -> Result<Vec<PublishOutcome>>;
    /// Runs `publish_in` once per batch inside one caller transaction,
    /// going on after a refused batch, then commits: each batch's result
    /// and the commit's.
    async fn publish_in_each(
        &self,
        batches: Vec<Vec<NewEvent>>,
    ) -> (Vec<Result<PublishOutcome>>, Result<()>);
    /// Moves every stored event's publish time, completion's completion time
    /// and delivery's due time `by` into the past (tests of retention, which
    /// counts in hours).
    async fn age(&self, by: chrono::TimeDelta);
    /// The store's publish counts ([`GroupStats`]).
    fn publish_stats(&self) -> GroupStats;
    /// Every stored event's and subject key's raw bytes, read past the
    /// store's API (payload column/field; subject, key id and wrapped key).
    async fn raw_rows(&self) -> Vec<Vec<u8>>;
    /// Removes what the harness created.
    async fn cleanup(&self);
}

struct SqliteHarness {
    dir: PathBuf,
    url: String,
    store: Arc<SqliteStore>,
}

impl SqliteHarness {
    async fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "lanebus-conformance-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        let url = format!("sqlite://{}", dir.join("store.db").display());
        let store = Arc::new(SqliteStore::connect(&url).await.expect("open sqlite store"));
        SqliteHarness { dir, url, store }
    }
}

#[async_trait]
impl Harness for SqliteHarness {
    fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }
    async fn reopen(&self) -> Arc<dyn Store> {
        Arc::new(
            SqliteStore::connect_with_lanes(&self.url, 8)
                .await
                .expect("reopen sqlite store"),
        )
    }
    async fn publish_in_many(
        &self,
        batches: Vec<Vec<NewEvent>>,
        commit: bool,
    ) -> Result<Vec<PublishOutcome>> {
        let mut tx = self
            .store
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(sql_error)?;
        let mut out = Vec::new();
        for b in batches {
            out.push(self.store.publish_in(&mut tx, b).await?);
        }
        if commit {
            tx.commit().await.map_err(sql_error)?;
        } else {
            tx.rollback().await.map_err(sql_error)?;
        }
        Ok(out)
    }
    async fn publish_in_each(
        &self,
        batches: Vec<Vec<NewEvent>>,
    ) -> (Vec<Result<PublishOutcome>>, Result<()>) {
        let mut tx = self
            .store
            .pool()
            .begin_with("BEGIN IMMEDIATE")
            .await
            .expect("begin");
        let mut out = Vec::new();
        for b in batches {
            out.push(self.store.publish_in(&mut tx, b).await);
        }
        (out, tx.commit().await.map_err(sql_error))
    }
    async fn age(&self, by: chrono::TimeDelta) {
        let us = by.num_microseconds().expect("age in µs");
        for sql in [
            "UPDATE events SET published_at = published_at - ?1",
            "UPDATE completions SET completed_at = completed_at - ?1",
            "UPDATE deliveries SET due_at = due_at - ?1",
        ] {
            sqlx::query(sql)
                .bind(us)
                .execute(self.store.pool())
                .await
                .expect("age sqlite rows");
        }
    }
    fn publish_stats(&self) -> GroupStats {
        self.store.publish_stats()
    }
    async fn raw_rows(&self) -> Vec<Vec<u8>> {
        sqlx::query_scalar(
            "SELECT payload FROM events UNION ALL \
             SELECT CAST(subject || key_id AS BLOB) || wrapped FROM subject_keys",
        )
        .fetch_all(self.store.pool())
        .await
        .expect("raw sqlite rows")
    }
    async fn cleanup(&self) {
        self.store.pool().close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const PG_URL_VAR: &str = "LANEBUS_TEST_POSTGRES_URL";

fn pg_admin_url() -> String {
    std::env::var(PG_URL_VAR).unwrap_or_else(|_| {
        panic!(
            "{PG_URL_VAR} is not set: the PostgreSQL conformance tests need a server. Run `scripts/test` \
             (it starts a throwaway PostgreSQL), or start one with `scripts/pg-start DIR` and export \
             {PG_URL_VAR}=<the URL it prints>"
        )
    })
}

struct PgHarness {
    admin_url: String,
    db: String,
    url: String,
    store: Arc<PgStore>,
}

impl PgHarness {
    async fn new() -> Self {
        use sqlx::Connection as _;
        let admin_url = pg_admin_url();
        let db = format!("lanebus_t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(&admin_url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {PG_URL_VAR}={admin_url}: {e}"));
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&mut admin)
            .await
            .expect("create test database");
        let _ = admin.close().await;
        let url = with_database(&admin_url, &db);
        let store = Arc::new(PgStore::connect(&url).await.expect("open postgres store"));
        PgHarness {
            admin_url,
            db,
            url,
            store,
        }
    }
}

#[async_trait]
impl Harness for PgHarness {
    fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }
    async fn reopen(&self) -> Arc<dyn Store> {
        Arc::new(
            PgStore::connect_with_lanes(&self.url, 8)
                .await
                .expect("reopen postgres store"),
        )
    }
    async fn publish_in_many(
        &self,
        batches: Vec<Vec<NewEvent>>,
        commit: bool,
    ) -> Result<Vec<PublishOutcome>> {
        let mut tx = self.store.pool().begin().await.map_err(sql_error)?;
        let mut out = Vec::new();
        for b in batches {
            out.push(self.store.publish_in(&mut tx, b).await?);
        }
        if commit {
            tx.commit().await.map_err(sql_error)?;
        } else {
            tx.rollback().await.map_err(sql_error)?;
        }
        Ok(out)
    }
    async fn publish_in_each(
        &self,
        batches: Vec<Vec<NewEvent>>,
    ) -> (Vec<Result<PublishOutcome>>, Result<()>) {
        let mut tx = self.store.pool().begin().await.expect("begin");
        let mut out = Vec::new();
        for b in batches {
            out.push(self.store.publish_in(&mut tx, b).await);
        }
        (out, tx.commit().await.map_err(sql_error))
    }
    async fn age(&self, by: chrono::TimeDelta) {
        let us = by.num_microseconds().expect("age in µs");
        for sql in [
            "UPDATE events SET published_at = published_at - make_interval(secs => $1 / 1e6)",
            "UPDATE completions SET completed_at = completed_at - make_interval(secs => $1 / 1e6)",
            "UPDATE deliveries SET due_at = due_at - make_interval(secs => $1 / 1e6)",
        ] {
            sqlx::query(sql)
                .bind(us)
                .execute(self.store.pool())
                .await
                .expect("age postgres rows");
        }
    }
    async fn raw_rows(&self) -> Vec<Vec<u8>> {
        sqlx::query_scalar(
            "SELECT payload FROM events UNION ALL \
             SELECT convert_to(subject || key_id, 'UTF8') || wrapped FROM subject_keys",
        )
        .fetch_all(self.store.pool())
        .await
        .expect("raw postgres rows")
    }
    fn publish_stats(&self) -> GroupStats {
        self.store.publish_stats()
    }
    async fn cleanup(&self) {
        use sqlx::Connection as _;
        self.store.pool().close().await;
        if let Ok(mut admin) = sqlx::PgConnection::connect(&self.admin_url).await {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.db))
                .execute(&mut admin)
                .await;
            let _ = admin.close().await;
        }
    }
}

#[cfg(feature = "mongodb")]
const MONGO_URL_VAR: &str = "LANEBUS_TEST_MONGODB_URI";

#[cfg(feature = "mongodb")]
fn mongo_base_url() -> String {
    std::env::var(MONGO_URL_VAR).unwrap_or_else(|_| {
        panic!(
            "{MONGO_URL_VAR} is not set: the MongoDB tests need a replica set. Run `scripts/test` \
             (it starts a MongoDB-compatible test server), or export \
             {MONGO_URL_VAR}=mongodb://HOST:PORT/?replicaSet=NAME for a MongoDB you run"
        )
    })
}

#[cfg(feature = "mongodb")]
struct MongoHarness {
    url: String,
    store: Arc<lanebus_store::mongodb::MongoStore>,
}

#[cfg(feature = "mongodb")]
impl MongoHarness {
    async fn new() -> Self {
        let db = format!("lanebus_t_{}", uuid::Uuid::new_v4().simple());
        let url = with_database(&mongo_base_url(), &db);
        let store = Arc::new(
            lanebus_store::mongodb::MongoStore::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("open mongodb store at {url}: {e}")),
        );
        MongoHarness { url, store }
    }
}

#[cfg(feature = "mongodb")]
#[async_trait]
impl Harness for MongoHarness {
    fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }
    async fn reopen(&self) -> Arc<dyn Store> {
        Arc::new(
            lanebus_store::mongodb::MongoStore::connect_with_lanes(&self.url, 8)
                .await
                .expect("reopen mongodb store"),
        )
    }
    async fn publish_in_many(
        &self,
        batches: Vec<Vec<NewEvent>>,
        commit: bool,
    ) -> Result<Vec<PublishOutcome>> {
        let mut session = self
            .store
            .client()
            .start_session()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        session
            .start_transaction()
            .await
            .map_err(|e| StoreError::Database(e.to_string()))?;
        let mut out = Vec::new();
        for b in batches {
            out.push(self.store.publish_in(&mut session, b).await?);
        }
        if commit {
            session.commit_transaction().await
        } else {
            session.abort_transaction().await
        }
        .map_err(|e| StoreError::Database(e.to_string()))?;
        Ok(out)
    }
    async fn publish_in_each(
        &self,
        batches: Vec<Vec<NewEvent>>,
    ) -> (Vec<Result<PublishOutcome>>, Result<()>) {
        let mut session = self.store.client().start_session().await.expect("session");
        session.start_transaction().await.expect("start");
        let mut out = Vec::new();
        for b in batches {
            out.push(self.store.publish_in(&mut session, b).await);
        }
        let committed = session
            .commit_transaction()
            .await
            .map_err(|e| StoreError::Database(e.to_string()));
        (out, committed)
    }
    async fn age(&self, by: chrono::TimeDelta) {
        use ::mongodb::bson::doc;
        let us = by.num_microseconds().expect("age in µs");
        let db = self.store.database();
        for (coll, field) in [
            ("events", "published_at"),
            ("completions", "completed_at"),
            ("deliveries", "due_at"),
        ] {
            db.collection::<::mongodb::bson::Document>(coll)
                .update_many(doc! {}, doc! { "$inc": { field: -us } })
                .await
                .expect("age mongodb documents");
        }
    }
    async fn raw_rows(&self) -> Vec<Vec<u8>> {
        use ::mongodb::bson::{doc, Document};
        use futures::TryStreamExt as _;
        let db = self.store.database();
        let mut out = Vec::new();
        for coll in ["events", "subject_keys"] {
            let docs: Vec<Document> = db
                .collection::<Document>(coll)
                .find(doc! {})
                .await
                .expect("find raw documents")
                .try_collect()
                .await
                .expect("read raw documents");
            for d in docs {
                let mut bytes = Vec::new();
                d.to_writer(&mut bytes).expect("raw BSON");
                out.push(bytes);
            }
        }
        out
    }
    fn publish_stats(&self) -> GroupStats {
        self.store.publish_stats()
    }
    async fn cleanup(&self) {
        let _ = self.store.database().drop().await;
    }
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let h = super::SqliteHarness::new().await;
                    super::$name(&h).await;
                    super::Harness::cleanup(&h).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let h = super::PgHarness::new().await;
                    super::$name(&h).await;
                    super::Harness::cleanup(&h).await;
                }
            )*
        }
        #[cfg(feature = "mongodb")]
        mod mongodb {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let h = super::MongoHarness::new().await;
                    super::$name(&h).await;
                    super::Harness::cleanup(&h).await;
                }
            )*
        }
    };
}

conformance!(
    publish_delivers_once_per_matching_handler,
    handler_patch_changes_settings_and_checks_them,
    secret_rotation_keeps_the_previous_secret_until_its_end,
    handler_state_changes_record_time_and_reason,
    concurrent_state_changes_are_seen_changed_once,
    failing_since_is_set_once_and_cleared,
    duplicates_are_counted_and_not_delivered,
    key_sequences_are_gapless_and_in_publish_order,
    concurrent_publishers_get_distinct_sequence_numbers,
    an_invalid_event_fails_the_whole_batch,
    publish_in_exists_only_if_the_caller_commits,
    fencing_makes_a_stale_owner_change_nothing,
    an_epoch_no_store_can_hold_is_refused,
    complete_deletes_and_records_completions,
    discard_deletes_without_completions_and_is_fenced,
    reschedule_records_the_failed_attempt,
    dead_letters_are_listed_and_replayed,
    delete_handler_discards_its_deliveries,
    delete_handler_discards_its_dead_letters,
    lane_rows_report_owner_epoch_and_backlog,
    payload_bytes_round_trip_exactly,
    claim_cursor_and_limit_read_everything_once_in_order,
    handler_catalog_validates_and_round_trips,
    reopening_keeps_lanes_and_data,
    concurrent_publishes_of_one_id_store_it_once,
    concurrent_publishes_are_grouped_and_each_answered,
    a_group_of_several_thousand_events_is_written,
    deliver_at_sets_the_first_due_time,
    dead_letters_are_replayed_by_time_range_in_key_order,
    recover_puts_completed_events_back_as_replays,
    prune_removes_old_completed_events_and_keeps_pending_and_dead,
    retention_counts_from_the_last_completion,
    prune_passes_over_many_kept_events,
    lookup_event_shows_each_handlers_delivery_state,
    lookup_of_a_pruned_event_finds_none,
    handler_deliveries_page_newest_first_per_state,
    handler_deliveries_page_over_ten_thousand_rows,
    attempt_log_keeps_the_last_failed_attempts,
    operational_types_are_reserved_and_routed_apart,
    state_changes_tell_their_operational_event_once,
    expected_seq_lets_exactly_one_writer_win_each_sequence,
    a_broken_expectation_stores_nothing_of_the_batch,
    a_broken_expectation_fails_only_its_caller,
    a_broken_expectation_in_a_caller_transaction,
    filters_decide_deliveries_at_publish,
    a_filter_that_matches_nothing_creates_no_delivery_row,
    filters_hold_for_publish_in,
    handler_filter_round_trips_and_patch_sets_and_removes_it,
    invalid_filters_are_refused_and_store_nothing,
    recover_puts_back_only_what_the_filter_let_through,
    event_type_schemas_validate_payloads_and_refuse_whole_batches,
    an_alias_is_stored_and_routed_under_the_wire_name,
    filters_hold_for_a_route_on_an_alias,
    the_strict_setting_refuses_types_not_in_the_catalog,
    a_catalog_change_is_honoured_by_the_next_publish_elsewhere,
    event_type_names_and_aliases_are_unique,
    personal_fields_are_sealed_at_rest_and_shredded_with_their_key,
    master_key_rotation_keeps_personal_fields_readable,
    filters_see_personal_fields_sealed,
    a_copied_envelope_does_not_open_in_another_event,
    personal_payloads_are_delivered_as_the_published_bytes,
    a_string_reading_as_an_envelope_is_refused_at_publish,
    a_personal_key_given_many_times_does_not_multiply_the_stored_payload,
);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn ev(id: Option<&str>, ty: &str, key: Option<&str>) -> NewEvent {
    NewEvent {
        id: id.map(Into::into),
        event_type: ty.into(),
        key: key.map(Into::into),
        payload: br#"{"n":1}"#.to_vec(),
        deliver_at: None,
        expected_seq: None,
    }
}

/// An event of `key` with id `id` expecting the key at `expected`
/// ([`NewEvent::expected_seq`]).
fn at(id: &str, key: &str, expected: Option<i64>) -> NewEvent {
    NewEvent {
        expected_seq: expected,
        ..ev(Some(id), "stream.appended", Some(key))
    }
}

async fn handler(s: &dyn Store, name: &str, types: &[&str]) -> Handler {
    s.create_handler(new_handler(name, types))
        .await
        .expect("create handler")
}

/// Claims every lane at its current epoch from the start; deliveries in lane
/// order, each lane in claim order.
async fn claim_all(s: &dyn Store) -> Vec<Delivery> {
    let claims: Vec<LaneClaim> = s
        .lane_rows()
        .await
        .expect("lane rows")
        .iter()
        .map(|r| LaneClaim {
            lane: r.lane,
            epoch: r.epoch,
            after: Default::default(),
            limit: 100_000,
        })
        .collect();
    let batches = s.claim(&claims).await.expect("claim");
    assert_eq!(batches.len(), claims.len(), "one batch per claimed lane");
    batches.into_iter().flat_map(|b| b.deliveries).collect()
}

async fn counts(s: &dyn Store) -> StoreCounts {
    s.counts().await.expect("counts")
}

fn seqs_of_key(ds: &[Delivery], key: &str) -> Vec<i64> {
    ds.iter()
        .filter(|d| d.key.as_deref() == Some(key))
        .map(|d| d.seq.expect("keyed delivery has a seq"))
        .collect()
}

fn one_lane_claim(
    lane: Lane,
    epoch: Epoch,
    after: impl Into<ClaimCursor>,
    limit: u32,
) -> [LaneClaim; 1] {
    [LaneClaim {
        lane,
        epoch,
        after: after.into(),
        limit,
    }]
}

fn dref(d: &Delivery, epoch: Epoch, attempts: u32) -> DeliveryRef {
    DeliveryRef {
        id: d.id,
        lane: d.lane,
        epoch,
        attempts,
    }
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

async fn publish_delivers_once_per_matching_handler(h: &dyn Harness) {
    let s = h.store();
    let exact = handler(&*s, "exact", &["issues.opened"]).await;
    let prefix = handler(&*s, "prefix", &["issues.*"]).await;
    let all = handler(&*s, "all", &["*"]).await;
    let push = handler(&*s, "push", &["push", "release.published"]).await;
    let disabled = handler(&*s, "disabled", &["*"]).await;
    let off = s
        .set_handler_state(&disabled.id, HandlerState::Disabled)
        .await
        .expect("disable");
    assert_eq!(off.state, HandlerState::Disabled);

    let out = s
        .publish(vec![
            ev(Some("e1"), "issues.opened", Some("repo-1")),
            ev(Some("e2"), "issues.closed", None),
            ev(Some("e3"), "push", Some("repo-1")),
            ev(Some("e4"), "issues", None),
        ])
        .await
        .expect("publish");
    assert_eq!(out.accepted, 4);
    assert_eq!(out.duplicates, 0);
    assert_eq!(out.ids, vec!["e1", "e2", "e3", "e4"]);

    let ds = claim_all(&*s).await;
    let got: HashSet<(String, String)> = ds
        .iter()
        .map(|d| (d.event_id.clone(), d.handler_id.clone()))
        .collect();
    // The disabled handler gets its deliveries too: kept, not attempted,
    // until it is enabled (issue #4, decided).
    let want: HashSet<(String, String)> = [
        ("e1", &exact),
        ("e1", &prefix),
        ("e1", &all),
        ("e2", &prefix),
        ("e2", &all),
        ("e3", &all),
        ("e3", &push),
        ("e4", &all),
        ("e1", &disabled),
        ("e2", &disabled),
        ("e3", &disabled),
        ("e4", &disabled),
    ]
    .into_iter()
    .map(|(e, h)| (e.to_string(), h.id.clone()))
    .collect();
    assert_eq!(
        ds.len(),
        12,
        "one delivery per (event, matching handler): {ds:?}"
    );
    assert_eq!(got, want);

    let e1 = ds
        .iter()
        .find(|d| d.event_id == "e1")
        .expect("e1 delivered");
    assert_eq!(e1.event_type, "issues.opened");
    assert_eq!(e1.key.as_deref(), Some("repo-1"));
    assert_eq!(e1.seq, Some(1));
    assert_eq!(e1.attempts, 0);
    assert_eq!(e1.last_error, None);
    assert_eq!(e1.lane, lane_of_key("repo-1", s.lanes()));
    assert_eq!(&e1.payload[..], br#"{"n":1}"#);
    let e3 = ds
        .iter()
        .find(|d| d.event_id == "e3")
        .expect("e3 delivered");
    assert_eq!(e3.seq, Some(2), "second event of key repo-1");
    let e2 = ds
        .iter()
        .find(|d| d.event_id == "e2")
        .expect("e2 delivered");
    assert_eq!(e2.seq, None);
    assert_eq!(e2.lane, lane_of_event(None, "e2", s.lanes()));

    let c = counts(&*s).await;
    assert_eq!(
        (c.events, c.deliveries),
        (5, 12),
        "4 published, 1 operational event of the disable (no handler routes to it)"
    );

    // Re-enabled, the handler keeps what it got while disabled, and gets
    // later events.
    s.set_handler_state(&disabled.id, HandlerState::Enabled)
        .await
        .expect("enable");
    s.publish(vec![ev(Some("e5"), "push", None)])
        .await
        .expect("publish");
    let ds = claim_all(&*s).await;
    let to_disabled: Vec<&str> = ds
        .iter()
        .filter(|d| d.handler_id == disabled.id)
        .map(|d| d.event_id.as_str())
        .collect();
    let to_disabled: HashSet<&str> = to_disabled.into_iter().collect();
    assert_eq!(to_disabled, HashSet::from(["e1", "e2", "e3", "e4", "e5"]));
}

async fn duplicates_are_counted_and_not_delivered(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let out = s
        .publish(vec![
            ev(Some("a"), "t.x", Some("k")),
            ev(Some("b"), "t.x", Some("k")),
            ev(Some("a"), "t.x", Some("k")),
        ])
        .await
        .expect("publish");
    assert_eq!((out.accepted, out.duplicates), (2, 1));
    assert_eq!(out.ids, vec!["a", "b", "a"]);

    let out = s
        .publish(vec![
            ev(Some("b"), "t.x", Some("k")),
            ev(Some("c"), "t.x", Some("k")),
            ev(None, "t.x", None),
        ])
        .await
        .expect("publish");
    assert_eq!((out.accepted, out.duplicates), (2, 1));
    assert_eq!(&out.ids[..2], &["b", "c"]);
    uuid::Uuid::parse_str(&out.ids[2]).expect("generated ids are UUIDs");
    assert_eq!(
        uuid::Uuid::parse_str(&out.ids[2])
            .map(|u| u.get_version_num())
            .ok(),
        Some(7),
        "generated ids are UUIDv7"
    );
    let out_generated = out.ids[2].clone();

    // An all-duplicate batch writes nothing.
    let out = s
        .publish(vec![ev(Some("a"), "t.x", Some("k"))])
        .await
        .expect("publish");
    assert_eq!((out.accepted, out.duplicates), (0, 1));

    let ds = claim_all(&*s).await;
    let mut ids: Vec<&str> = ds.iter().map(|d| d.event_id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids.len(), 4);
    assert!(ids.contains(&out_generated.as_str()));
    ids.retain(|i| i.len() == 1);
    assert_eq!(ids, vec!["a", "b", "c"]);
    // Duplicates did not take sequence numbers.
    assert_eq!(seqs_of_key(&ds, "k"), vec![1, 2, 3]);
    let c = counts(&*s).await;
    assert_eq!((c.events, c.deliveries), (4, 4));
}

async fn key_sequences_are_gapless_and_in_publish_order(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    handler(&*s, "issues", &["issues.*"]).await;
    s.publish(vec![
        ev(Some("1"), "issues.a", Some("k1")),
        ev(Some("2"), "issues.a", Some("k2")),
        ev(Some("3"), "issues.a", Some("k1")),
    ])
    .await
    .expect("publish");
    s.publish(vec![ev(Some("4"), "push", Some("k1"))])
        .await
        .expect("publish");
    s.publish(vec![
        ev(Some("5"), "issues.b", None),
        ev(Some("6"), "issues.b", Some("k2")),
        ev(Some("7"), "issues.b", Some("k1")),
        ev(Some("7"), "issues.b", Some("k1")),
    ])
    .await
    .expect("publish");

    let ds = claim_all(&*s).await;
    for hid in ds
        .iter()
        .map(|d| d.handler_id.clone())
        .collect::<HashSet<_>>()
    {
        let mine: Vec<Delivery> = ds.iter().filter(|d| d.handler_id == hid).cloned().collect();
        let k1 = seqs_of_key(&mine, "k1");
        let k2 = seqs_of_key(&mine, "k2");
        if k1.len() == 4 {
            assert_eq!(k1, vec![1, 2, 3, 4], "k1 in claim order");
        } else {
            assert_eq!(
                k1,
                vec![1, 2, 4],
                "issues.* does not get the push event (seq 3)"
            );
        }
        assert_eq!(k2, vec![1, 2]);
        let by_event: HashMap<&str, i64> = mine
            .iter()
            .filter_map(|d| d.seq.map(|q| (d.event_id.as_str(), q)))
            .collect();
        assert_eq!(by_event.get("1"), Some(&1));
        assert_eq!(by_event.get("3"), Some(&2));
        assert_eq!(by_event.get("7"), Some(&4));
        assert_eq!(by_event.get("6"), Some(&2));
    }
}

async fn concurrent_publishers_get_distinct_sequence_numbers(h: &dyn Harness) {
    const PUBLISHERS: usize = 8;
    const BATCHES: usize = 10;
    const KEYS: [&str; 3] = ["hot-0", "hot-1", "hot-2"];
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let other = h.reopen().await;
    let mut tasks = Vec::new();
    for p in 0..PUBLISHERS {
        // Half of the publishers use a second, independent connection pool.
        let st = if p % 2 == 0 { s.clone() } else { other.clone() };
        tasks.push(tokio::spawn(async move {
            for b in 0..BATCHES {
                let batch: Vec<NewEvent> = (0..6)
                    .map(|i| {
                        let id = format!("p{p}-b{b}-{i}");
                        ev(Some(&id), "load.test", Some(KEYS[(p + i) % KEYS.len()]))
                    })
                    .collect();
                let out = st.publish(batch).await.expect("concurrent publish");
                assert_eq!(out.accepted, 6);
            }
        }));
    }
    for t in tasks {
        t.await.expect("publisher task");
    }
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), PUBLISHERS * BATCHES * 6);
    for key in KEYS {
        let seqs = seqs_of_key(&ds, key);
        let n = seqs.len() as i64;
        assert!(n > 0);
        assert_eq!(
            seqs,
            (1..=n).collect::<Vec<_>>(),
            "{key}: gapless, no repeats, in claim order"
        );
    }
    // Within one publisher's batch, a key's events got increasing numbers.
    let by_id: HashMap<&str, i64> = ds
        .iter()
        .map(|d| (d.event_id.as_str(), d.seq.unwrap_or(0)))
        .collect();
    for p in 0..PUBLISHERS {
        for b in 0..BATCHES {
            for i in 0..3 {
                let first = by_id[format!("p{p}-b{b}-{i}").as_str()];
                let second = by_id[format!("p{p}-b{b}-{}", i + 3).as_str()];
                assert!(first < second, "batch order within a key");
            }
        }
    }
}

async fn an_invalid_event_fails_the_whole_batch(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let bad_batches = vec![
        vec![
            ev(Some("ok-1"), "t.x", Some("k")),
            ev(Some("has space"), "t.x", Some("k")),
        ],
        vec![
            ev(Some("ok-2"), "t.x", Some("k")),
            ev(None, "bad type", Some("k")),
        ],
        vec![
            ev(Some("ok-3"), "t.x", Some("k")),
            ev(None, "t.x", Some("")),
        ],
        vec![
            ev(Some("ok-4"), "t.x", Some("k")),
            ev(Some(&"x".repeat(129)), "t.x", None),
        ],
    ];
    for batch in bad_batches {
        let err = s.publish(batch).await.expect_err("invalid batch must fail");
        assert!(matches!(err, StoreError::Invalid(_)), "got {err:?}");
        let err = h
            .publish_in_many(
                vec![vec![
                    ev(Some("ok-5"), "t.x", None),
                    ev(Some("bad id"), "t.x", None),
                ]],
                true,
            )
            .await
            .expect_err("invalid batch must fail in a caller transaction too");
        assert!(matches!(err, StoreError::Invalid(_)), "got {err:?}");
    }
    assert_eq!(
        counts(&*s).await,
        StoreCounts::default(),
        "nothing was written"
    );
    // No sequence number was taken either.
    s.publish(vec![ev(Some("ok-1"), "t.x", Some("k"))])
        .await
        .expect("publish");
    assert_eq!(seqs_of_key(&claim_all(&*s).await, "k"), vec![1]);
}

async fn publish_in_exists_only_if_the_caller_commits(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let out = h
        .publish_in_many(vec![vec![ev(Some("rolled-back"), "t.x", Some("k"))]], false)
        .await
        .expect("publish_in then rollback");
    assert_eq!(out[0].accepted, 1);
    assert_eq!(
        counts(&*s).await,
        StoreCounts::default(),
        "rolled back: nothing stored"
    );

    s.publish(vec![ev(Some("stored"), "t.x", Some("k"))])
        .await
        .expect("publish");
    // A duplicate of a stored id does not abort the caller's transaction: the
    // next batch in the same transaction still commits.
    let out = h
        .publish_in_many(
            vec![
                vec![
                    ev(Some("stored"), "t.x", Some("k")),
                    ev(Some("c1"), "t.x", Some("k")),
                ],
                vec![
                    ev(Some("c2"), "t.x", Some("k")),
                    ev(Some("c1"), "t.x", Some("k")),
                ],
            ],
            true,
        )
        .await
        .expect("publish_in then commit");
    assert_eq!((out[0].accepted, out[0].duplicates), (1, 1));
    assert_eq!(
        (out[1].accepted, out[1].duplicates),
        (1, 1),
        "c1 was written earlier in the same tx"
    );

    let ds = claim_all(&*s).await;
    let order: Vec<(&str, i64)> = ds
        .iter()
        .map(|d| (d.event_id.as_str(), d.seq.unwrap_or(0)))
        .collect();
    assert_eq!(
        order,
        vec![("stored", 1), ("c1", 2), ("c2", 3)],
        "the rollback gave its sequence number back"
    );
    let c = counts(&*s).await;
    assert_eq!((c.events, c.deliveries), (3, 3));
}

async fn fencing_makes_a_stale_owner_change_nothing(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let lane = lane_of_key("fenced", s.lanes());
    assert!(
        s.fence(lane, "n1", Epoch(1)).await.expect("fence"),
        "n1 takes epoch 1"
    );
    s.publish(
        (0..4)
            .map(|i| ev(Some(&format!("f{i}")), "t.x", Some("fenced")))
            .collect(),
    )
    .await
    .expect("publish");
    let b = s
        .claim(&one_lane_claim(lane, Epoch(1), 0, 100))
        .await
        .expect("claim");
    assert!(b[0].owned);
    let ds = b[0].deliveries.clone();
    assert_eq!(ds.len(), 4);
    assert!(
        ds.iter().all(|d| d.epoch == Epoch(1)),
        "a delivery carries the epoch it was claimed at"
    );

    assert!(
        s.fence(lane, "n2", Epoch(2)).await.expect("fence"),
        "n2 takes epoch 2"
    );
    assert!(
        !s.fence(lane, "n1", Epoch(2)).await.expect("fence"),
        "same epoch, other owner: refused"
    );
    assert!(
        !s.fence(lane, "n1", Epoch(1)).await.expect("fence"),
        "lower epoch: refused"
    );
    assert!(
        s.fence(lane, "n2", Epoch(2)).await.expect("fence"),
        "re-fencing at the held epoch is a no-op"
    );
    let before = counts(&*s).await;

    // n1, at epoch 1, is fenced out of everything.
    let b = s
        .claim(&one_lane_claim(lane, Epoch(1), 0, 100))
        .await
        .expect("claim");
    assert!(!b[0].owned, "stale epoch must report owned: false");
    assert!(b[0].deliveries.is_empty());
    assert!(s
        .complete(&[dref(&ds[0], Epoch(1), 1)])
        .await
        .expect("complete")
        .is_empty());
    let resched = Reschedule {
        id: ds[1].id,
        lane,
        epoch: Epoch(1),
        attempts: 5,
        due_at: Utc::now() + chrono::Duration::hours(1),
        last_error: "stale".into(),
        failure: None,
    };
    assert!(s
        .reschedule(&[resched])
        .await
        .expect("reschedule")
        .is_empty());
    let dead = DeadLetterRequest {
        id: ds[2].id,
        lane,
        epoch: Epoch(1),
        attempts: 8,
        last_error: "stale".into(),
        failure: None,
    };
    assert!(s
        .dead_letter(&[dead])
        .await
        .expect("dead letter")
        .is_empty());
    // A ref naming the wrong lane changes nothing either.
    let wrong_lane = DeliveryRef {
        id: ds[3].id,
        lane: (lane + 1) % s.lanes(),
        epoch: Epoch(2),
        attempts: 1,
    };
    assert!(s
        .complete(&[wrong_lane])
        .await
        .expect("complete")
        .is_empty());

    assert_eq!(counts(&*s).await, before, "nothing changed");
    let b = s
        .claim(&one_lane_claim(lane, Epoch(2), 0, 100))
        .await
        .expect("claim");
    assert!(b[0].owned);
    assert!(
        b[0].deliveries.iter().all(|d| d.epoch == Epoch(2)),
        "the new owner's claim carries its epoch"
    );
    let at_one: Vec<Delivery> = b[0]
        .deliveries
        .iter()
        .map(|d| Delivery {
            epoch: Epoch(1),
            ..d.clone()
        })
        .collect();
    assert_eq!(at_one, ds, "rows unchanged (attempts, due, last error)");

    // n2 can.
    let done = s
        .complete(&[dref(&ds[0], Epoch(2), 1)])
        .await
        .expect("complete");
    assert_eq!(done, vec![ds[0].id]);
    let rows = s.lane_rows().await.expect("lane rows");
    assert_eq!(rows[lane as usize].owner.as_deref(), Some("n2"));
    assert_eq!(rows[lane as usize].epoch, Epoch(2));
}

/// Stores keep epochs as signed 64-bit integers: `i64::MAX` fences; one
/// above is refused as invalid input (not wrapped to a negative epoch) and
/// changes nothing.
async fn an_epoch_no_store_can_hold_is_refused(h: &dyn Harness) {
    let s = h.store();
    let lane = lane_of_key("big", s.lanes());
    assert!(s.fence(lane, "n1", Epoch(5)).await.expect("fence"));
    let err = s
        .fence(lane, "n2", Epoch::MAX_STORED.next())
        .await
        .expect_err("an epoch above i64::MAX");
    assert!(matches!(err, StoreError::Invalid(_)), "{err}");
    let row = &s.lane_rows().await.expect("lane rows")[usize::from(lane)];
    assert_eq!((row.owner.as_deref(), row.epoch), (Some("n1"), Epoch(5)));

    assert!(s.fence(lane, "n2", Epoch::MAX_STORED).await.expect("fence"));
    let row = &s.lane_rows().await.expect("lane rows")[usize::from(lane)];
    assert_eq!(
        (row.owner.as_deref(), row.epoch),
        (Some("n2"), Epoch::MAX_STORED)
    );
}

async fn complete_deletes_and_records_completions(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["*"]).await;
    handler(&*s, "b", &["t.*"]).await;
    s.publish(vec![
        ev(Some("x"), "t.x", Some("k")),
        ev(Some("y"), "t.y", None),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 4);
    let refs: Vec<DeliveryRef> = ds[..3].iter().map(|d| dref(d, Epoch(0), 2)).collect();
    let mut done = s.complete(&refs).await.expect("complete");
    done.sort_unstable();
    let mut want: Vec<i64> = ds[..3].iter().map(|d| d.id).collect();
    want.sort_unstable();
    assert_eq!(done, want);
    let c = counts(&*s).await;
    assert_eq!((c.events, c.deliveries, c.completions), (2, 1, 3));
    // Completing again (a retried completion) changes nothing.
    assert!(s.complete(&refs).await.expect("complete").is_empty());
    assert_eq!(counts(&*s).await.completions, 3);
    // A repeated ref in one call completes once.
    let last = dref(&ds[3], Epoch(0), 1);
    assert_eq!(
        s.complete(&[last, last]).await.expect("complete"),
        vec![ds[3].id]
    );
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.completions), (0, 4));
    assert!(claim_all(&*s).await.is_empty());
}

async fn discard_deletes_without_completions_and_is_fenced(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    s.publish(vec![
        ev(Some("x"), "t.x", Some("k")),
        ev(Some("y"), "t.y", None),
        ev(Some("z"), "t.z", Some("k")),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 3);
    assert!(s.discard(&[]).await.expect("discard nothing").is_empty());
    // A repeated ref in one call is discarded once; no completion row.
    let refs = [
        dref(&ds[0], Epoch(0), 0),
        dref(&ds[1], Epoch(0), 0),
        dref(&ds[0], Epoch(0), 0),
    ];
    let mut gone = s.discard(&refs).await.expect("discard");
    gone.sort_unstable();
    let mut want = vec![ds[0].id, ds[1].id];
    want.sort_unstable();
    assert_eq!(gone, want);
    let c = counts(&*s).await;
    assert_eq!(
        (c.events, c.deliveries, c.completions, c.dead_letters),
        (3, 1, 0, 0)
    );
    // Discarding again changes nothing.
    assert!(s.discard(&refs).await.expect("discard").is_empty());
    // Fenced: a stale owner discards nothing.
    let last = &ds[2];
    assert!(s.fence(last.lane, "n2", Epoch(7)).await.expect("fence"));
    assert!(s
        .discard(&[dref(last, Epoch(0), 0)])
        .await
        .expect("discard")
        .is_empty());
    assert_eq!(counts(&*s).await.deliveries, 1);
    // The current owner does; the handler is untouched.
    assert_eq!(
        s.discard(&[dref(last, Epoch(7), 0)])
            .await
            .expect("discard"),
        vec![last.id]
    );
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.completions), (0, 0));
    assert_eq!(s.get_handler(&a.id).await.expect("handler").id, a.id);
}

async fn reschedule_records_the_failed_attempt(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["*"]).await;
    s.publish(vec![
        ev(Some("r1"), "t.x", Some("k")),
        ev(Some("r2"), "t.x", Some("k")),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let due: DateTime<Utc> = DateTime::from_timestamp_micros(
        (Utc::now() + chrono::Duration::seconds(90)).timestamp_micros(),
    )
    .expect("time");
    let r = Reschedule {
        id: ds[0].id,
        lane: ds[0].lane,
        epoch: Epoch(0),
        attempts: 3,
        due_at: due,
        last_error: "HTTP 500 from endpoint".into(),
        failure: None,
    };
    assert_eq!(
        s.reschedule(&[r]).await.expect("reschedule"),
        vec![ds[0].id]
    );
    let after = claim_all(&*s).await;
    assert_eq!(after.len(), 2, "a rescheduled delivery stays pending");
    let d = after
        .iter()
        .find(|d| d.id == ds[0].id)
        .expect("still there");
    assert_eq!(d.attempts, 3);
    assert_eq!(d.due_at, due);
    assert_eq!(d.last_error.as_deref(), Some("HTTP 500 from endpoint"));
    let untouched = after
        .iter()
        .find(|d| d.id == ds[1].id)
        .expect("still there");
    assert_eq!(untouched, &ds[1]);
    assert_eq!(counts(&*s).await.deliveries, 2);
}

async fn dead_letters_are_listed_and_replayed(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    let b = handler(&*s, "b", &["*"]).await;
    s.publish(vec![
        ev(Some("d1"), "t.dead", Some("k")),
        ev(Some("d2"), "t.dead", None),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 4);
    let lanes_before: Vec<LaneClaim> = s
        .lane_rows()
        .await
        .expect("lane rows")
        .iter()
        .map(|r| LaneClaim {
            lane: r.lane,
            epoch: r.epoch,
            after: Default::default(),
            limit: 1000,
        })
        .collect();
    let cursors = s.claim(&lanes_before).await.expect("claim");

    let reqs: Vec<DeadLetterRequest> = ds
        .iter()
        .map(|d| DeadLetterRequest {
            id: d.id,
            lane: d.lane,
            epoch: Epoch(0),
            attempts: 8,
            last_error: format!("boom {}", d.event_id),
            failure: None,
        })
        .collect();
    let mut moved = s.dead_letter(&reqs).await.expect("dead letter");
    moved.sort_unstable();
    let mut want: Vec<i64> = ds.iter().map(|d| d.id).collect();
    want.sort_unstable();
    assert_eq!(moved, want);
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.dead_letters, c.completions), (0, 4, 0));

    let all = s
        .list_dead_letters(&DeadLetterFilter::default())
        .await
        .expect("list");
    assert_eq!(all.len(), 4);
    assert!(all.windows(2).all(|w| w[0].id < w[1].id), "oldest first");
    let of_a = s
        .list_dead_letters(&DeadLetterFilter {
            handler_id: Some(a.id.clone()),
            after_id: None,
            limit: 10,
        })
        .await
        .expect("list");
    assert_eq!(of_a.len(), 2);
    let d1 = of_a.iter().find(|d| d.event_id == "d1").expect("d1 dead");
    assert_eq!(d1.event_type, "t.dead");
    assert_eq!(d1.key.as_deref(), Some("k"));
    assert_eq!(d1.seq, Some(1));
    assert_eq!(d1.attempts, 8);
    assert_eq!(d1.last_error, "boom d1");
    let page = s
        .list_dead_letters(&DeadLetterFilter {
            handler_id: None,
            after_id: Some(all[1].id),
            limit: 1,
        })
        .await
        .expect("list");
    assert_eq!(
        page.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![all[2].id],
        "keyset page"
    );

    // Replay one by id.
    assert_eq!(
        s.replay_dead_letters(&[d1.id], None).await.expect("replay"),
        1
    );
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.dead_letters), (1, 3));
    // The owner's cursor from before sees the replayed delivery (new id).
    let claims: Vec<LaneClaim> = cursors
        .iter()
        .zip(&lanes_before)
        .map(|(b, c)| LaneClaim {
            after: b.next_after.clone(),
            ..c.clone()
        })
        .collect();
    let seen: Vec<Delivery> = s
        .claim(&claims)
        .await
        .expect("claim")
        .into_iter()
        .flat_map(|b| b.deliveries)
        .collect();
    let replayed = seen
        .iter()
        .find(|d| d.event_id == "d1")
        .expect("cursor sees the replay");
    assert_eq!(replayed.handler_id, a.id);
    assert_eq!(replayed.attempts, 0);
    assert_eq!(replayed.last_error, None);
    assert_eq!(replayed.seq, Some(1));
    assert!(!ds.iter().any(|d| d.id == replayed.id), "a new delivery id");

    // Replay all of b's.
    assert_eq!(
        s.replay_dead_letters(&[], Some(&b.id))
            .await
            .expect("replay"),
        2
    );
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.dead_letters), (3, 1));
    // Nothing to replay: no ids and no handler, or ids already replayed.
    assert_eq!(s.replay_dead_letters(&[], None).await.expect("replay"), 0);
    assert_eq!(
        s.replay_dead_letters(&[d1.id], None).await.expect("replay"),
        0
    );
}

async fn delete_handler_discards_its_deliveries(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    let b = handler(&*s, "b", &["*"]).await;
    s.publish(
        (0..3)
            .map(|i| ev(Some(&format!("e{i}")), "t.x", Some("k")))
            .collect(),
    )
    .await
    .expect("publish");
    assert_eq!(counts(&*s).await.deliveries, 6);
    assert_eq!(
        s.delete_handler(&a.id).await.expect("delete"),
        DeletedHandler {
            deliveries: 3,
            dead_letters: 0
        }
    );
    assert_eq!(counts(&*s).await.deliveries, 3);
    assert!(matches!(
        s.get_handler(&a.id).await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        s.delete_handler(&a.id).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(counts(&*s).await.deliveries, 3);
    s.publish(vec![ev(Some("later"), "t.x", None)])
        .await
        .expect("publish");
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 4);
    assert!(ds.iter().all(|d| d.handler_id == b.id));
    let hs = s.list_handlers().await.expect("list");
    assert_eq!(
        hs.iter().map(|h| h.id.clone()).collect::<Vec<_>>(),
        vec![b.id.clone()]
    );
}

/// Deleting a handler discards its dead letters in the same call (they
/// could be neither replayed nor discarded afterwards), leaves the other
/// handler's alone, and lets retention prune their events.
async fn delete_handler_discards_its_dead_letters(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    let b = handler(&*s, "b", &["*"]).await;
    s.publish(vec![
        ev(Some("dead1"), "t.x", Some("k")),
        ev(Some("dead2"), "t.x", None),
        ev(Some("pending"), "t.x", Some("k")),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let of = |handler: &Handler, id: &str| {
        ds.iter()
            .find(|d| d.handler_id == handler.id && d.event_id == id)
            .expect("claimed")
    };
    // a: two dead letters and one pending delivery; b: one dead letter,
    // the other two completed.
    dead_letter_each(&*s, &[of(&a, "dead1"), of(&a, "dead2"), of(&b, "dead1")]).await;
    let done = [
        dref(of(&b, "dead2"), Epoch(0), 1),
        dref(of(&b, "pending"), Epoch(0), 1),
    ];
    assert_eq!(s.complete(&done).await.expect("complete").len(), 2);
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.dead_letters), (1, 3));

    assert_eq!(
        s.delete_handler(&a.id).await.expect("delete"),
        DeletedHandler {
            deliveries: 1,
            dead_letters: 2
        }
    );
    let c = counts(&*s).await;
    assert_eq!((c.deliveries, c.dead_letters), (0, 1));
    let listed = |handler_id: Option<String>| {
        let s = s.clone();
        async move {
            s.list_dead_letters(&DeadLetterFilter {
                handler_id,
                after_id: None,
                limit: 10,
            })
            .await
            .expect("list")
        }
    };
    assert!(listed(Some(a.id.clone())).await.is_empty());
    let left = listed(None).await;
    assert_eq!(left.len(), 1);
    assert_eq!(
        (left[0].handler_id.as_str(), left[0].event_id.as_str()),
        (b.id.as_str(), "dead1")
    );
    // A second delete finds nothing and removes nothing.
    assert!(matches!(
        s.delete_handler(&a.id).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(counts(&*s).await.dead_letters, 1);

    // Retention prunes the events the deleted handler's dead letters held
    // (dead2, pending); b's dead letter still holds dead1.
    let cutoff = Utc::now() + chrono::TimeDelta::minutes(5);
    let mut pruned = Pruned::default();
    loop {
        let p = s.prune(cutoff, 100).await.expect("prune");
        if p == Pruned::default() {
            break;
        }
        pruned.completions += p.completions;
        pruned.events += p.events;
    }
    assert_eq!(pruned.events, 2);
    let c = counts(&*s).await;
    assert_eq!((c.events, c.dead_letters), (1, 1));
    // Deleting b as well frees the last event.
    assert_eq!(
        s.delete_handler(&b.id).await.expect("delete"),
        DeletedHandler {
            deliveries: 0,
            dead_letters: 1
        }
    );
    assert_eq!(s.prune(cutoff, 100).await.expect("prune").events, 1);
    assert_eq!(counts(&*s).await.events, 0);
}

async fn lane_rows_report_owner_epoch_and_backlog(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["*"]).await;
    let rows = s.lane_rows().await.expect("lane rows");
    assert_eq!(rows.len(), usize::from(s.lanes()));
    assert_eq!(s.lanes(), DEFAULT_LANES);
    assert!(rows
        .iter()
        .enumerate()
        .all(|(i, r)| usize::from(r.lane) == i && r.backlog == 0 && r.epoch == Epoch(0)));
    let (ka, kb) = ("alpha", "beta");
    let (la, lb) = (lane_of_key(ka, s.lanes()), lane_of_key(kb, s.lanes()));
    assert_ne!(la, lb);
    s.publish(vec![
        ev(None, "t.x", Some(ka)),
        ev(None, "t.x", Some(ka)),
        ev(None, "t.x", Some(kb)),
    ])
    .await
    .expect("publish");
    assert!(s.fence(lb, "node-7", Epoch(3)).await.expect("fence"));
    let rows = s.lane_rows().await.expect("lane rows");
    assert_eq!(rows[la as usize].backlog, 2);
    assert_eq!(rows[lb as usize].backlog, 1);
    assert_eq!(rows[lb as usize].owner.as_deref(), Some("node-7"));
    assert_eq!(rows[lb as usize].epoch, Epoch(3));
    assert_eq!(
        rows.iter().map(|r| r.backlog).sum::<i64>(),
        counts(&*s).await.deliveries
    );
    s.ping().await.expect("ping");
}

fn github_payloads() -> Vec<(String, Option<String>, Vec<u8>)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/github-webhook-examples.json"
    );
    let raw = std::fs::read(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let all: Vec<serde_json::Value> =
        serde_json::from_slice(&raw).expect("examples file is a JSON array");
    let mut out = Vec::new();
    for entry in all.iter().take(12) {
        let name = entry["name"].as_str().expect("name").to_string();
        for ex in entry["examples"].as_array().into_iter().flatten().take(2) {
            let ty = match ex["action"].as_str() {
                Some(a) => format!("{name}.{a}"),
                None => name.clone(),
            };
            let key = ex["repository"]["full_name"].as_str().map(str::to_string);
            // Pretty-printed, so whitespace must survive byte for byte too.
            out.push((ty, key, serde_json::to_vec_pretty(ex).expect("encode")));
        }
    }
    assert!(out.len() >= 10, "expected real payloads");
    out
}

async fn payload_bytes_round_trip_exactly(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["*"]).await;
    let mut events: Vec<NewEvent> = github_payloads()
        .into_iter()
        .enumerate()
        .map(|(i, (ty, key, payload))| NewEvent {
            id: Some(format!("gh-{i}")),
            event_type: ty,
            key,
            payload,
            deliver_at: None,
            expected_seq: None,
        })
        .collect();
    // Bytes that are not even UTF-8 are kept as given.
    events.push(NewEvent {
        id: Some("raw".into()),
        event_type: "raw.bytes".into(),
        key: None,
        payload: (0..=255u8).chain([0, 0, 255]).collect(),
        deliver_at: None,
        expected_seq: None,
    });
    let want: HashMap<String, (String, Vec<u8>)> = events
        .iter()
        .map(|e| {
            (
                e.id.clone().expect("id"),
                (e.event_type.clone(), e.payload.clone()),
            )
        })
        .collect();
    let t0 = Utc::now() - chrono::Duration::seconds(5);
    s.publish(events).await.expect("publish");
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), want.len());
    for d in &ds {
        let (ty, bytes) = &want[&d.event_id];
        assert_eq!(&d.event_type, ty);
        assert!(
            d.payload[..] == bytes[..],
            "payload of {} differs",
            d.event_id
        );
        assert!(
            d.published_at >= t0 && d.published_at <= Utc::now() + chrono::Duration::seconds(5)
        );
    }
}

async fn claim_cursor_and_limit_read_everything_once_in_order(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["*"]).await;
    let key = "cursor";
    let lane = lane_of_key(key, s.lanes());
    for i in 0..10 {
        s.publish(vec![ev(Some(&format!("c{i}")), "t.x", Some(key))])
            .await
            .expect("publish");
    }
    // A zero-limit claim reads nothing and keeps the cursor.
    let b = s
        .claim(&one_lane_claim(lane, Epoch(0), 0, 0))
        .await
        .expect("claim");
    assert!(b[0].owned && b[0].deliveries.is_empty());

    // Claim 3 at a time, completing what was read (as an owner does).
    let mut after = ClaimCursor::default();
    let mut seen: Vec<i64> = Vec::new();
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds <= 20, "the cursor must make progress");
        let b = s
            .claim(&one_lane_claim(lane, Epoch(0), after.clone(), 3))
            .await
            .expect("claim");
        assert!(b[0].owned);
        assert!(
            b[0].next_after.pos >= after.pos,
            "the cursor never goes back"
        );
        after = b[0].next_after.clone();
        let fresh: Vec<&Delivery> = b[0]
            .deliveries
            .iter()
            .filter(|d| !seen.contains(&d.seq.unwrap_or(0)))
            .collect();
        if b[0].deliveries.is_empty() {
            break;
        }
        for d in &fresh {
            seen.push(d.seq.expect("seq"));
        }
        let refs: Vec<DeliveryRef> = b[0]
            .deliveries
            .iter()
            .map(|d| dref(d, Epoch(0), 1))
            .collect();
        s.complete(&refs).await.expect("complete");
    }
    assert_eq!(
        seen,
        (1..=10).collect::<Vec<_>>(),
        "every delivery once, in key order"
    );

    // Published after the last claim: the cursor sees it.
    s.publish(vec![ev(Some("c10"), "t.x", Some(key))])
        .await
        .expect("publish");
    let b = s
        .claim(&one_lane_claim(lane, Epoch(0), after, 3))
        .await
        .expect("claim");
    assert_eq!(
        b[0].deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect::<Vec<_>>(),
        vec!["c10"]
    );
    // Claims for several lanes in one call keep the request order.
    let other = (lane + 1) % s.lanes();
    let b = s
        .claim(&[
            LaneClaim {
                lane: other,
                epoch: Epoch(0),
                after: Default::default(),
                limit: 10,
            },
            LaneClaim {
                lane,
                epoch: Epoch(0),
                after: Default::default(),
                limit: 10,
            },
            LaneClaim {
                lane: other,
                epoch: Epoch(9),
                after: Default::default(),
                limit: 10,
            },
            // The same lane twice is answered twice.
            LaneClaim {
                lane,
                epoch: Epoch(0),
                after: Default::default(),
                limit: 10,
            },
        ])
        .await
        .expect("claim");
    assert_eq!(
        b.iter().map(|x| (x.lane, x.owned)).collect::<Vec<_>>(),
        vec![(other, true), (lane, true), (other, false), (lane, true)]
    );
    assert_eq!(b[1].deliveries.len(), 1);
    assert_eq!(b[3].deliveries, b[1].deliveries);
    assert!(b[2].deliveries.is_empty());
}

async fn handler_catalog_validates_and_round_trips(h: &dyn Harness) {
    let s = h.store();
    let mut nh = new_handler("hooks", &["issues.*", "push"]);
    nh.max_attempts = 3;
    nh.timeout_ms = 2_500;
    nh.max_in_flight = 7;
    let a = s.create_handler(nh).await.expect("create");
    assert!(a.id.starts_with("hdl_"));
    assert!(a.secret.starts_with("whsec_"), "secret generated");
    assert_eq!(a.state, HandlerState::Enabled);
    assert_eq!(
        (a.max_attempts, a.timeout_ms, a.max_in_flight),
        (3, 2_500, 7)
    );
    assert_eq!(s.get_handler(&a.id).await.expect("get"), a);

    let mut with_secret = new_handler("second", &["*"]);
    with_secret.secret = format!("whsec_{}", "QUJD".repeat(8));
    let b = s.create_handler(with_secret.clone()).await.expect("create");
    assert_eq!(b.secret, with_secret.secret);
    let mut limited = new_handler("limited", &["*"]);
    limited.rate_limit = Some(RateLimit {
        per_second: 7,
        burst: 3,
    });
    let c = s.create_handler(limited).await.expect("create limited");
    assert_eq!(
        c.rate_limit,
        Some(RateLimit {
            per_second: 7,
            burst: 3
        })
    );
    assert_eq!(
        s.get_handler(&c.id).await.expect("get limited"),
        c,
        "a rate limit given at registration is stored"
    );
    s.delete_handler(&c.id).await.expect("delete limited");
    assert_eq!(
        s.list_handlers().await.expect("list"),
        vec![a.clone(), b.clone()],
        "creation order"
    );

    for bad in [
        new_handler("bad-route", &["a*b"]),
        new_handler("no-routes", &[]),
        NewHandler {
            url: "ftp://x".into(),
            ..new_handler("bad-url", &["*"])
        },
        NewHandler {
            max_attempts: 0,
            ..new_handler("zero", &["*"])
        },
        NewHandler {
            secret: "whsec_short".into(),
            ..new_handler("short-secret", &["*"])
        },
        NewHandler {
            rate_limit: Some(RateLimit {
                per_second: 0,
                burst: 1,
            }),
            ..new_handler("zero-rate", &["*"])
        },
    ] {
        let err = s.create_handler(bad).await.expect_err("invalid handler");
        assert!(matches!(err, StoreError::Invalid(_)), "got {err:?}");
    }
    assert_eq!(s.list_handlers().await.expect("list").len(), 2);
    assert!(matches!(
        s.get_handler("hdl_nope").await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        s.set_handler_state("hdl_nope", HandlerState::Disabled)
            .await,
        Err(StoreError::NotFound(_))
    ));
}

async fn reopening_keeps_lanes_and_data(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    s.publish(vec![ev(Some("kept"), "t.x", Some("k"))])
        .await
        .expect("publish");
    // Asking for 8 lanes on an existing store keeps the lanes it was created with.
    let again = h.reopen().await;
    assert_eq!(again.lanes(), s.lanes());
    assert_eq!(again.get_handler(&a.id).await.expect("get"), a);
    assert_eq!(counts(&*again).await.deliveries, 1);
    // The second connection sees handlers created through the first at once.
    let b = handler(&*s, "b", &["*"]).await;
    again
        .publish(vec![ev(Some("seen"), "t.x", None)])
        .await
        .expect("publish");
    let ds = claim_all(&*s).await;
    assert!(ds
        .iter()
        .any(|d| d.event_id == "seen" && d.handler_id == b.id));
}

async fn concurrent_publishes_of_one_id_store_it_once(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let mut tasks = Vec::new();
    for p in 0..8 {
        let st = if p % 2 == 0 {
            s.clone()
        } else {
            h.reopen().await
        };
        tasks.push(tokio::spawn(async move {
            let mut accepted = 0;
            for i in 0..10 {
                let batch = vec![
                    ev(Some(&format!("same-{i}")), "t.x", Some("k")),
                    ev(Some(&format!("same-{}", (i + 1) % 10)), "t.x", Some("k")),
                ];
                let out = st.publish(batch).await.expect("publish");
                assert_eq!(out.accepted + out.duplicates, 2);
                accepted += out.accepted;
            }
            accepted
        }));
    }
    let mut accepted = 0;
    for t in tasks {
        accepted += t.await.expect("publisher task");
    }
    assert_eq!(accepted, 10, "each id accepted exactly once");
    let c = counts(&*s).await;
    assert_eq!((c.events, c.deliveries), (10, 10));
    assert_eq!(
        seqs_of_key(&claim_all(&*s).await, "k"),
        (1..=10).collect::<Vec<_>>()
    );
}

/// Asserts that keys `k0` to `k{keys - 1}` have gapless sequence numbers
/// from 1, in claim order.
fn assert_keys_gapless(ds: &[Delivery], keys: usize) {
    for k in 0..keys {
        let key = format!("k{k}");
        let seqs = seqs_of_key(ds, &key);
        let want: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(seqs, want, "{key}: gapless");
    }
}

/// Each keyed delivery's sequence number, by event id.
fn seq_by_event(ds: &[Delivery]) -> HashMap<&str, i64> {
    ds.iter()
        .filter_map(|d| Some((d.event_id.as_str(), d.seq?)))
        .collect()
}

/// 32 callers, 3 single-event publishes each, at once: keyed and unkeyed,
/// generated and client ids, an id two callers repeat, an id already
/// stored, and one caller whose batch has a bad event.
async fn concurrent_publishes_are_grouped_and_each_answered(h: &dyn Harness) {
    const CALLERS: usize = 32;
    const ROUNDS: usize = 3;
    const BAD: usize = 13;
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let old = s
        .publish(vec![ev(Some("old-1"), "t.x", None)])
        .await
        .expect("publish");
    assert_eq!(old.accepted, 1);
    let before = h.publish_stats();
    let start = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let mut tasks = Vec::new();
    for c in 0..CALLERS {
        let (st, start) = (s.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let key = (c % 2 == 0).then(|| format!("k{}", c % 3));
            let mut answers = Vec::new();
            for r in 0..ROUNDS {
                let id = match (c, r) {
                    (5 | 6, 0) => Some("rep".to_string()),
                    (7, 0) => Some("old-1".to_string()),
                    _ if c % 4 == 0 => None,
                    _ => Some(format!("c{c}-r{r}")),
                };
                let mut batch = vec![ev(id.as_deref(), "t.x", key.as_deref())];
                if c == BAD && r == 1 {
                    batch.push(ev(Some("has space"), "t.x", key.as_deref()));
                }
                answers.push((id, st.publish(batch).await));
            }
            answers
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("caller task"));
    }
    let mut rep_accepted = 0;
    let mut ids_of: HashMap<usize, Vec<String>> = HashMap::new();
    for (c, rounds) in answers.into_iter().enumerate() {
        for (r, (id, result)) in rounds.into_iter().enumerate() {
            if c == BAD && r == 1 {
                let err = result.expect_err("the batch with a bad event is refused");
                assert!(
                    matches!(&err, StoreError::Invalid(m) if m.starts_with("events[1]")),
                    "{err:?}"
                );
                continue;
            }
            let out = result.unwrap_or_else(|e| panic!("caller {c} round {r}: {e:?}"));
            assert_eq!(out.ids.len(), 1, "caller {c}: its own ids only");
            if let Some(id) = &id {
                assert_eq!(&out.ids[0], id, "caller {c} round {r}");
            }
            match (c, r) {
                (5 | 6, 0) => {
                    assert_eq!(out.accepted + out.duplicates, 1);
                    rep_accepted += out.accepted;
                }
                (7, 0) => assert_eq!((out.accepted, out.duplicates), (0, 1), "stored before"),
                _ => assert_eq!(
                    (out.accepted, out.duplicates),
                    (1, 0),
                    "caller {c} round {r}"
                ),
            }
            if !(c == 7 && r == 0) && !(c == 6 && r == 0) {
                ids_of.entry(c).or_default().push(out.ids[0].clone());
            }
        }
    }
    assert_eq!(
        rep_accepted, 1,
        "an id repeated by two callers is stored once"
    );

    let ds = claim_all(&*s).await;
    // old-1, then every round of every caller but the refused one, the
    // stored id and the repeated id.
    assert_eq!(ds.len(), 1 + CALLERS * ROUNDS - 3);
    let stored: HashSet<&str> = ds.iter().map(|d| d.event_id.as_str()).collect();
    assert!(!stored.contains("has space"));
    let seq_of = seq_by_event(&ds);
    assert_keys_gapless(&ds, 3);
    for (c, ids) in &ids_of {
        if c % 2 == 1 {
            continue;
        }
        let seqs: Vec<i64> = ids
            .iter()
            .filter(|id| id.as_str() != "rep")
            .map(|id| seq_of[id.as_str()])
            .collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "caller {c}: {seqs:?} in its order"
        );
    }
    // Fewer publish transactions than publishes: callers were grouped.
    let after = h.publish_stats();
    let publishes = after.publishes - before.publishes;
    let writes = after.writes - before.writes;
    assert_eq!(publishes, (CALLERS * ROUNDS - 1) as u64, "valid publishes");
    assert!(
        writes < publishes,
        "{writes} writes for {publishes} publishes"
    );
}

/// Callers of full batches at once: groups of several thousand events.
async fn a_group_of_several_thousand_events_is_written(h: &dyn Harness) {
    const CALLERS: usize = 5;
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let start = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let mut tasks = Vec::new();
    for c in 0..CALLERS {
        let (st, start) = (s.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            let batch: Vec<NewEvent> = (0..MAX_BATCH)
                .map(|i| {
                    ev(
                        Some(&format!("c{c}-{i}")),
                        "t.x",
                        Some(&format!("k{}", i % 7)),
                    )
                })
                .collect();
            start.wait().await;
            st.publish(batch).await
        }));
    }
    for t in tasks {
        let out = t.await.expect("caller task").expect("publish");
        assert_eq!((out.accepted, out.duplicates), (MAX_BATCH, 0));
    }
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), CALLERS * MAX_BATCH);
    let seq_of = seq_by_event(&ds);
    assert_keys_gapless(&ds, 7);
    for c in 0..CALLERS {
        for i in 7..MAX_BATCH {
            let (a, b) = (format!("c{c}-{}", i - 7), format!("c{c}-{i}"));
            assert!(
                seq_of[a.as_str()] < seq_of[b.as_str()],
                "batch order within a key"
            );
        }
    }
}

async fn handler_patch_changes_settings_and_checks_them(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["issues.*"]).await;
    let other = handler(&*s, "other", &["*"]).await;
    let patch = HandlerPatch {
        url: Some("https://example.com/new".into()),
        event_types: Some(vec!["push".into()]),
        max_attempts: Some(3),
        timeout_ms: Some(2_000),
        max_in_flight: Some(7),
        rate_limit: Some(Some(RateLimit {
            per_second: 5,
            burst: 2,
        })),
        ..HandlerPatch::default()
    };
    let changed = s.update_handler(&a.id, &patch).await.expect("update");
    assert_eq!(changed.name, "a", "absent fields stay");
    assert_eq!(changed.url, "https://example.com/new");
    assert_eq!(changed.event_types, vec!["push"]);
    assert_eq!(
        (
            changed.max_attempts,
            changed.timeout_ms,
            changed.max_in_flight
        ),
        (3, 2_000, 7)
    );
    assert_eq!(
        changed.rate_limit,
        Some(RateLimit {
            per_second: 5,
            burst: 2
        })
    );
    assert_eq!(changed.secret, a.secret);
    assert_eq!(s.get_handler(&a.id).await.expect("get"), changed);
    assert_eq!(
        s.get_handler(&other.id).await.expect("get other"),
        other,
        "other handlers untouched"
    );
    // Routes apply to events published after the change.
    s.publish(vec![
        ev(Some("p1"), "push", None),
        ev(Some("i1"), "issues.opened", None),
    ])
    .await
    .expect("publish");
    let to_a: Vec<String> = claim_all(&*s)
        .await
        .into_iter()
        .filter(|d| d.handler_id == a.id)
        .map(|d| d.event_id)
        .collect();
    assert_eq!(to_a, vec!["p1"]);

    // The limit can be removed; bad fields change nothing.
    let cleared = s
        .update_handler(
            &a.id,
            &HandlerPatch {
                rate_limit: Some(None),
                ..HandlerPatch::default()
            },
        )
        .await
        .expect("clear rate limit");
    assert_eq!(cleared.rate_limit, None);
    for bad in [
        HandlerPatch {
            event_types: Some(vec!["bad*pattern*".into()]),
            ..HandlerPatch::default()
        },
        HandlerPatch {
            url: Some("ftp://example.com".into()),
            ..HandlerPatch::default()
        },
        HandlerPatch {
            max_attempts: Some(0),
            ..HandlerPatch::default()
        },
        HandlerPatch {
            rate_limit: Some(Some(RateLimit {
                per_second: 0,
                burst: 1,
            })),
            ..HandlerPatch::default()
        },
    ] {
        let e = s.update_handler(&a.id, &bad).await.unwrap_err();
        assert!(matches!(e, StoreError::Invalid(_)), "{bad:?}: {e}");
    }
    assert_eq!(s.get_handler(&a.id).await.expect("get"), cleared);
    assert!(matches!(
        s.update_handler("hdl_nope", &HandlerPatch::default()).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn secret_rotation_keeps_the_previous_secret_until_its_end(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    assert_eq!(a.signing_secrets(Utc::now()), vec![a.secret.as_str()]);
    let new = generate_secret();
    let until = Utc::now() + chrono::Duration::hours(24);
    let rotated = s
        .rotate_handler_secret(&a.id, &new, until)
        .await
        .expect("rotate");
    assert_eq!(rotated.secret, new);
    assert_eq!(rotated.previous_secret.as_deref(), Some(a.secret.as_str()));
    let stored_until = rotated.previous_secret_until.expect("until");
    assert!(
        (stored_until - until).num_milliseconds().abs() < 1,
        "{stored_until} {until}"
    );
    assert_eq!(s.get_handler(&a.id).await.expect("get"), rotated);
    assert_eq!(
        rotated.signing_secrets(Utc::now()),
        vec![new.as_str(), a.secret.as_str()],
        "both sign during the grace period, the new one first"
    );
    assert_eq!(
        rotated.signing_secrets(until + chrono::Duration::seconds(1)),
        vec![new.as_str()],
        "only the new one after it"
    );
    // A second rotation drops the first secret.
    let newer = generate_secret();
    let again = s
        .rotate_handler_secret(&a.id, &newer, until)
        .await
        .expect("rotate again");
    assert_eq!(
        again.signing_secrets(Utc::now()),
        vec![newer.as_str(), new.as_str()]
    );
    assert!(matches!(
        s.rotate_handler_secret(&a.id, "not-a-secret", until).await,
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        s.rotate_handler_secret("hdl_nope", &generate_secret(), until)
            .await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(s.get_handler(&a.id).await.expect("get"), again);
}

async fn handler_state_changes_record_time_and_reason(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    assert_eq!(
        (a.state_changed_at, a.state_reason.as_deref()),
        (None, None)
    );
    let before = Utc::now() - chrono::Duration::seconds(1);
    let off = s
        .change_handler_state(&a.id, HandlerState::Disabled, "gone")
        .await
        .expect("disable");
    assert_eq!(off.was, HandlerState::Enabled);
    assert!(off.changed());
    let off = off.handler;
    assert_eq!(off.state, HandlerState::Disabled);
    assert_eq!(off.state_reason.as_deref(), Some("gone"));
    let at = off.state_changed_at.expect("changed at");
    assert!(at >= before && at <= Utc::now(), "{at}");
    // The same state again changes nothing.
    let same = s
        .change_handler_state(&a.id, HandlerState::Disabled, "failing")
        .await
        .expect("disable again");
    assert!(!same.changed(), "{same:?}");
    assert_eq!(same.handler, off);
    assert_eq!(s.get_handler(&a.id).await.expect("get"), off);
    s.mark_handler_failing(&a.id, true, Utc::now())
        .await
        .expect("failing");
    let on = s
        .set_handler_state(&a.id, HandlerState::Enabled)
        .await
        .expect("enable");
    assert_eq!(on.state, HandlerState::Enabled);
    assert_eq!(on.state_reason.as_deref(), Some("api"));
    assert!(on.state_changed_at.expect("changed") >= at);
    assert_eq!(
        on.failing_since, None,
        "enabling starts a new failure count"
    );
    assert!(matches!(
        s.change_handler_state("hdl_nope", HandlerState::Enabled, "api")
            .await,
        Err(StoreError::NotFound(_))
    ));
}

/// Of concurrent calls setting the same state, through two connections
/// (two nodes), exactly one answers that it changed the state: the one
/// the API counts and logs (`lanebus_handlers_disabled_total`), so four keys
/// answered `410` at once on two nodes count one disable.
async fn concurrent_state_changes_are_seen_changed_once(h: &dyn Harness) {
    let stores = [h.store(), h.reopen().await];
    let a = handler(&*stores[0], "a", &["*"]).await;
    for round in 0..4 {
        for (to, was) in [
            (HandlerState::Disabled, HandlerState::Enabled),
            (HandlerState::Enabled, HandlerState::Disabled),
        ] {
            let calls = (0..8).map(|i| {
                let s = stores[i % 2].clone();
                let id = a.id.clone();
                async move { s.change_handler_state(&id, to, "gone").await }
            });
            let changes: Vec<StateChange> = futures::future::join_all(calls)
                .await
                .into_iter()
                .collect::<Result<_, _>>()
                .expect("change");
            let changed: Vec<&StateChange> = changes.iter().filter(|c| c.changed()).collect();
            assert_eq!(changed.len(), 1, "round {round}, to {to:?}: {changes:#?}");
            assert_eq!(changed[0].was, was);
            assert!(changes.iter().all(|c| c.handler.state == to));
            assert!(changes.iter().filter(|c| !c.changed()).all(|c| c.was == to));
        }
    }
}

async fn failing_since_is_set_once_and_cleared(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    assert_eq!(a.failing_since, None);
    let t1 = Utc::now() - chrono::Duration::minutes(5);
    s.mark_handler_failing(&a.id, true, t1).await.expect("mark");
    let got = s.get_handler(&a.id).await.expect("get").failing_since;
    assert_eq!(
        got.map(|t| t.timestamp_micros()),
        Some(t1.timestamp_micros())
    );
    // A later failure keeps the start of the run.
    s.mark_handler_failing(&a.id, true, Utc::now())
        .await
        .expect("mark again");
    let got = s.get_handler(&a.id).await.expect("get").failing_since;
    assert_eq!(
        got.map(|t| t.timestamp_micros()),
        Some(t1.timestamp_micros())
    );
    s.mark_handler_failing(&a.id, false, Utc::now())
        .await
        .expect("clear");
    assert_eq!(s.get_handler(&a.id).await.expect("get").failing_since, None);
    assert!(matches!(
        s.mark_handler_failing("hdl_nope", true, Utc::now()).await,
        Err(StoreError::NotFound(_))
    ));
}

// ---------------------------------------------------------------------------
// Payload filters (store/src/filter.rs)
// ---------------------------------------------------------------------------

fn filter(v: serde_json::Value) -> Filter {
    Filter::parse(&v).expect("valid filter")
}

async fn filtered_handler(
    s: &dyn Store,
    name: &str,
    types: &[&str],
    f: serde_json::Value,
) -> Handler {
    s.create_handler(NewHandler {
        filter: Some(filter(f)),
        ..new_handler(name, types)
    })
    .await
    .expect("create filtered handler")
}

fn with_payload(id: &str, ty: &str, key: Option<&str>, payload: &[u8]) -> NewEvent {
    NewEvent {
        payload: payload.to_vec(),
        ..ev(Some(id), ty, key)
    }
}

/// Each case: a filter, and payloads with whether they match. The answers
/// are the documented semantics; every store must give them.
fn filter_cases() -> Vec<(serde_json::Value, Vec<(&'static str, bool)>)> {
    use serde_json::json;
    vec![
        (
            json!({"path": "/n", "equals": 1}),
            vec![
                (r#"{"n":1}"#, true),
                (r#"{"n":1.0}"#, true),
                (r#"{"n":1e0}"#, true),
                (r#"{"n":"1"}"#, false),
                (r#"{"n":true}"#, false),
                (r#"{}"#, false),
            ],
        ),
        (
            json!({"path": "/s", "equals": "1"}),
            vec![(r#"{"s":"1"}"#, true), (r#"{"s":1}"#, false)],
        ),
        (
            json!({"path": "/s", "equals": "é/x"}),
            vec![(r#"{"s":"\u00e9\/x"}"#, true), (r#"{"s":"e/x"}"#, false)],
        ),
        (
            json!({"path": "/z", "equals": null}),
            vec![
                (r#"{"z":null}"#, true),
                (r#"{}"#, false),
                (r#"{"z":false}"#, false),
            ],
        ),
        (
            json!({"path": "/b", "equals": false}),
            vec![
                (r#"{"b":false}"#, true),
                (r#"{"b":0}"#, false),
                (r#"{"b":null}"#, false),
            ],
        ),
        (
            json!({"path": "/c", "in": ["DE", "FR", 2]}),
            vec![
                (r#"{"c":"DE"}"#, true),
                (r#"{"c":"US"}"#, false),
                (r#"{"c":2.0}"#, true),
                (r#"{"c":"2"}"#, false),
                (r#"{}"#, false),
                (r#"{"c":["DE"]}"#, false),
            ],
        ),
        (
            json!({"path": "/a/0/b", "exists": true}),
            vec![
                (r#"{"a":[{"b":null}]}"#, true),
                (r#"{"a":[{}]}"#, false),
                (r#"{"a":{"0":{"b":1}}}"#, true),
                (r#"{"a":[]}"#, false),
                (r#"{"a":"x"}"#, false),
            ],
        ),
        (
            json!({"path": "/a/01", "exists": true}),
            vec![(r#"{"a":[1,2]}"#, false), (r#"{"a":{"01":1}}"#, true)],
        ),
        (
            json!({"path": "/x", "exists": false}),
            vec![(r#"{}"#, true), (r#"{"x":null}"#, false)],
        ),
        (
            json!({"path": "/t", "gt": 100}),
            vec![
                (r#"{"t":100.5}"#, true),
                (r#"{"t":100}"#, false),
                (r#"{"t":"200"}"#, false),
                (r#"{"t":null}"#, false),
                (r#"{}"#, false),
                (r#"{"t":[200]}"#, false),
                (r#"{"t":true}"#, false),
            ],
        ),
        (
            json!({"path": "/t", "gte": 100}),
            vec![(r#"{"t":100.0}"#, true), (r#"{"t":99.99}"#, false)],
        ),
        (
            json!({"path": "/t", "lt": 0}),
            vec![
                (r#"{"t":-1}"#, true),
                (r#"{"t":0}"#, false),
                (r#"{"t":-0.5}"#, true),
            ],
        ),
        (
            json!({"path": "/t", "lte": 1.5}),
            vec![(r#"{"t":1.5}"#, true), (r#"{"t":2}"#, false)],
        ),
        (
            json!({"path": "/a~1b/~0c", "equals": 1}),
            vec![
                (r#"{"a/b":{"~c":1}}"#, true),
                (r#"{"a":{"b":{"~c":1}}}"#, false),
            ],
        ),
        (
            json!({"path": "", "equals": 5}),
            vec![("5", true), (r#""5""#, false)],
        ),
        (
            json!({"and": [
                {"path": "/total", "gte": 100},
                {"or": [{"path": "/c", "in": ["DE"]}, {"path": "/vip", "equals": true}]},
                {"not": {"path": "/test", "exists": true}}
            ]}),
            vec![
                (r#"{"total":150,"c":"DE"}"#, true),
                (r#"{"total":100,"c":"US","vip":true}"#, true),
                (r#"{"total":150,"c":"US"}"#, false),
                (r#"{"total":150,"c":"DE","test":false}"#, false),
                (r#"{"total":99,"c":"DE"}"#, false),
            ],
        ),
        (
            json!({"not": {"path": "/x", "exists": true}}),
            vec![
                (r#"{}"#, true),
                ("not json", false),
                (r#"{"x":1}"#, false),
                // U+0000 anywhere does not stop the filter (jsonb refuses it).
                (r#"{"s":"a\u0000b"}"#, true),
                (r#"{"a\u0000":1}"#, true),
                // A number whose nearest double is infinite: unparsable.
                (r#"{"big":1e400}"#, false),
                (r#"{"big":[-1e400]}"#, false),
                (nines(400), false),
                (r#"{"max":1.7976931348623157e308,"tiny":1e-400}"#, true),
            ],
        ),
        (
            json!({"path": "/s", "equals": "\\u0000"}),
            vec![
                (r#"{"s":"\\u0000"}"#, true),
                (r#"{"s":"\u0000"}"#, false),
                (r#"{"s":"\\\u0000"}"#, false),
                (r#"{"s":"\\\\u0000"}"#, false),
            ],
        ),
        (
            json!({"path": "/s", "exists": true}),
            vec![(r#"{"s":"\u0000"}"#, true), (r#"{"t":"\u0000"}"#, false)],
        ),
        (
            json!({"path": "/price", "equals": 92049.38554384977}),
            vec![
                (r#"{"price":92049.38554384977}"#, true),
                (r#"{"price":92049.38554384976}"#, false),
            ],
        ),
        (
            // Below half the least double: 0, as Rust reads it.
            json!({"path": "/t", "equals": 0}),
            vec![
                (r#"{"t":1e-400}"#, true),
                (r#"{"t":-2e-324}"#, true),
                (r#"{"t":3e-324}"#, false),
            ],
        ),
        (
            json!({"path": "/t", "gt": 0}),
            vec![
                (r#"{"t":1e-400}"#, false),
                (r#"{"t":5e-324}"#, true),
                (r#"{"t":1.7976931348623157e308}"#, true),
            ],
        ),
    ]
}

/// A payload of one integer of `n` nines.
fn nines(n: usize) -> &'static str {
    Box::leak(format!(r#"{{"n":{}}}"#, "9".repeat(n)).into_boxed_str())
}

async fn filters_decide_deliveries_at_publish(h: &dyn Harness) {
    let s = h.store();
    let plain = handler(&*s, "plain", &["f.*"]).await;
    let cases = filter_cases();
    let mut handlers = Vec::new();
    let mut events = Vec::new();
    let mut expected: HashSet<(String, String)> = HashSet::new();
    for (i, (f, payloads)) in cases.iter().enumerate() {
        let ty = format!("f.{i}");
        let hd = filtered_handler(&*s, &format!("f{i}"), &[&ty], f.clone()).await;
        for (j, (payload, matches)) in payloads.iter().enumerate() {
            let id = format!("e{i}-{j}");
            // The Rust evaluator agrees with the table too.
            assert_eq!(
                hd.filter
                    .as_ref()
                    .unwrap()
                    .matches_payload(payload.as_bytes()),
                *matches,
                "{f} {payload}"
            );
            if *matches {
                expected.insert((hd.id.clone(), id.clone()));
            }
            events.push(with_payload(&id, &ty, None, payload.as_bytes()));
        }
        handlers.push(hd);
    }
    let n = events.len();
    s.publish(events).await.expect("publish");
    let ds = claim_all(&*s).await;
    let got: HashSet<(String, String)> = ds
        .iter()
        .filter(|d| d.handler_id != plain.id)
        .map(|d| (d.handler_id.clone(), d.event_id.clone()))
        .collect();
    let mut missing: Vec<_> = expected.difference(&got).collect();
    let mut extra: Vec<_> = got.difference(&expected).collect();
    missing.sort();
    extra.sort();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
    // The handler without a filter gets every event its route matches.
    assert_eq!(ds.iter().filter(|d| d.handler_id == plain.id).count(), n);
    assert_eq!(counts(&*s).await.deliveries as usize, n + expected.len());
}

async fn a_filter_that_matches_nothing_creates_no_delivery_row(h: &dyn Harness) {
    let s = h.store();
    let plain = handler(&*s, "plain", &["o.*"]).await;
    let none = filtered_handler(
        &*s,
        "none",
        &["o.*"],
        serde_json::json!({"path": "/never", "exists": true}),
    )
    .await;
    let some = filtered_handler(
        &*s,
        "some",
        &["o.*"],
        serde_json::json!({"path": "/n", "gte": 2}),
    )
    .await;
    let events: Vec<NewEvent> = (1..=6)
        .map(|i| {
            with_payload(
                &format!("o{i}"),
                "o.x",
                Some("k"),
                format!(r#"{{"n":{i}}}"#).as_bytes(),
            )
        })
        .collect();
    s.publish(events).await.expect("publish");
    assert_eq!(counts(&*s).await.deliveries, 6 + 5);
    let ds = claim_all(&*s).await;
    assert!(ds.iter().all(|d| d.handler_id != none.id));
    let page = s
        .handler_deliveries(&HandlerDeliveriesQuery {
            handler_id: none.id.clone(),
            state: DeliveryListState::Pending,
            key: None,
            after: None,
            limit: 100,
            completed_since: Utc::now() - chrono::TimeDelta::days(1),
        })
        .await
        .expect("handler deliveries");
    assert!(page.is_empty(), "{page:?}");
    // Per key, a filtered handler's deliveries keep the sequence order.
    let of = |hd: &Handler| -> Vec<Delivery> {
        ds.iter()
            .filter(|d| d.handler_id == hd.id)
            .cloned()
            .collect()
    };
    assert_eq!(seqs_of_key(&of(&some), "k"), vec![2, 3, 4, 5, 6]);
    assert_eq!(seqs_of_key(&of(&plain), "k"), vec![1, 2, 3, 4, 5, 6]);
    let ids: Vec<i64> = of(&some).iter().map(|d| d.id).collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "ids follow the sequence: {ids:?}"
    );
}

async fn filters_hold_for_publish_in(h: &dyn Harness) {
    let s = h.store();
    let f = filtered_handler(
        &*s,
        "f",
        &["p.x"],
        serde_json::json!({"path": "/ok", "equals": true}),
    )
    .await;
    let out = h
        .publish_in_many(
            vec![
                vec![with_payload("p1", "p.x", None, br#"{"ok":true}"#)],
                vec![with_payload("p2", "p.x", None, br#"{"ok":false}"#)],
            ],
            true,
        )
        .await
        .expect("publish_in");
    assert_eq!(out.len(), 2);
    let ds = claim_all(&*s).await;
    let got: Vec<&str> = ds
        .iter()
        .filter(|d| d.handler_id == f.id)
        .map(|d| d.event_id.as_str())
        .collect();
    assert_eq!(got, vec!["p1"]);
}

async fn handler_filter_round_trips_and_patch_sets_and_removes_it(h: &dyn Harness) {
    use serde_json::json;
    let s = h.store();
    let f1 =
        json!({"and": [{"path": "/n", "gte": 1.5}, {"path": "/c", "in": ["a", 1, null, true]}]});
    let hd = filtered_handler(&*s, "f", &["q.*"], f1.clone()).await;
    assert_eq!(hd.filter.as_ref().map(Filter::to_json), Some(f1.clone()));
    let read = s.get_handler(&hd.id).await.expect("get");
    assert_eq!(read, hd, "stored as answered");
    assert_eq!(s.list_handlers().await.expect("list")[0].filter, hd.filter);
    // Another field changed: the filter stays.
    let renamed = s
        .update_handler(
            &hd.id,
            &HandlerPatch {
                name: Some("g".into()),
                ..Default::default()
            },
        )
        .await
        .expect("rename");
    assert_eq!(renamed.filter, hd.filter);
    s.publish(vec![with_payload("q1", "q.x", None, br#"{"n":2,"c":"a"}"#)])
        .await
        .expect("publish");
    // Set another filter: applies to events published after the change.
    let f2 = filter(json!({"path": "/n", "lt": 0}));
    let set = s
        .update_handler(
            &hd.id,
            &HandlerPatch {
                filter: Some(Some(f2.clone())),
                ..Default::default()
            },
        )
        .await
        .expect("set filter");
    assert_eq!(set.filter.as_ref(), Some(&f2));
    assert_eq!(
        s.get_handler(&hd.id).await.expect("get").filter.as_ref(),
        Some(&f2)
    );
    s.publish(vec![
        with_payload("q2", "q.x", None, br#"{"n":2,"c":"a"}"#),
        with_payload("q3", "q.x", None, br#"{"n":-1}"#),
    ])
    .await
    .expect("publish");
    // Remove it: every routed event again.
    let removed = s
        .update_handler(
            &hd.id,
            &HandlerPatch {
                filter: Some(None),
                ..Default::default()
            },
        )
        .await
        .expect("remove filter");
    assert_eq!(removed.filter, None);
    assert_eq!(s.get_handler(&hd.id).await.expect("get").filter, None);
    s.publish(vec![with_payload("q4", "q.x", None, b"[]")])
        .await
        .expect("publish");
    let mut got: Vec<String> = claim_all(&*s)
        .await
        .into_iter()
        .map(|d| d.event_id)
        .collect();
    got.sort();
    assert_eq!(got, vec!["q1", "q3", "q4"]);
}

async fn invalid_filters_are_refused_and_store_nothing(h: &dyn Harness) {
    use serde_json::json;
    let s = h.store();
    let hd = handler(&*s, "h", &["*"]).await;
    for bad in [
        Filter::And(vec![]),
        Filter::Field(filter::Condition {
            path: "no-slash".into(),
            test: filter::Test::Exists(true),
        }),
        Filter::Field(filter::Condition {
            path: "/a".into(),
            test: filter::Test::In(vec![json!([1])]),
        }),
        Filter::Field(filter::Condition {
            path: "/a".into(),
            test: filter::Test::In(vec![json!(1); rules::filter::MAX_IN_VALUES + 1]),
        }),
        // U+0000, which PostgreSQL's jsonb refuses, in a value and a path.
        Filter::Field(filter::Condition {
            path: "/a".into(),
            test: filter::Test::Equals(json!("a\u{0}")),
        }),
        Filter::Field(filter::Condition {
            path: "/a\u{0}".into(),
            test: filter::Test::Exists(true),
        }),
    ] {
        let err = s
            .create_handler(NewHandler {
                filter: Some(bad.clone()),
                ..new_handler("bad", &["*"])
            })
            .await
            .expect_err("refused");
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.starts_with("filter")),
            "{err}"
        );
        let err = s
            .update_handler(
                &hd.id,
                &HandlerPatch {
                    filter: Some(Some(bad)),
                    ..Default::default()
                },
            )
            .await
            .expect_err("refused");
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.starts_with("filter")),
            "{err}"
        );
    }
    let all = s.list_handlers().await.expect("list");
    assert_eq!(all.len(), 1);
    assert_eq!(all[0], hd, "unchanged");
}

async fn recover_puts_back_only_what_the_filter_let_through(h: &dyn Harness) {
    let s = h.store();
    let hd = filtered_handler(
        &*s,
        "f",
        &["r.x"],
        serde_json::json!({"path": "/keep", "equals": true}),
    )
    .await;
    let t = Utc::now() - chrono::TimeDelta::seconds(10);
    s.publish(vec![
        with_payload("r1", "r.x", Some("k"), br#"{"keep":true}"#),
        with_payload("r2", "r.x", Some("k"), br#"{"keep":false}"#),
        with_payload("r3", "r.x", Some("k"), br#"{"keep":true}"#),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    assert_eq!(
        ds.iter().map(|d| d.event_id.as_str()).collect::<Vec<_>>(),
        vec!["r1", "r3"]
    );
    let refs: Vec<DeliveryRef> = ds.iter().map(|d| dref(d, Epoch(0), 1)).collect();
    s.complete(&refs).await.expect("complete");
    let out = s.recover(&hd.id, t).await.expect("recover");
    assert_eq!((out.recovered, out.already_pending), (2, 0));
    let back: Vec<String> = claim_all(&*s)
        .await
        .into_iter()
        .map(|d| d.event_id)
        .collect();
    assert_eq!(back, vec!["r1", "r3"]);
}

/// Tests of PostgreSQL-only behaviour: commit-ordered cursor, NOTIFY.
mod postgres_only {
    use super::*;
    use sqlx::Connection as _;

    fn lane_cursor(lane: Lane, after: impl Into<ClaimCursor>, limit: u32) -> [LaneClaim; 1] {
        one_lane_claim(lane, Epoch(0), after, limit)
    }

    /// `lanebus.publish()` and `lanebus.publish_batch()`, from SQL in another
    /// session, honour payload filters: the filtered handler gets no
    /// delivery row for an event its filter does not match.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sql_publish_honours_payload_filters() {
        let h = PgHarness::new().await;
        let s = h.store();
        let f = filtered_handler(
            &*s,
            "f",
            &["s.x"],
            serde_json::json!({"path": "/amount", "gt": 10}),
        )
        .await;
        let plain = handler(&*s, "plain", &["s.x"]).await;
        let mut conn = sqlx::PgConnection::connect(&h.url).await.expect("connect");
        let mut tx = conn.begin().await.expect("begin");
        for (id, payload) in [
            ("s1", r#"{"amount": 11}"#),
            ("s2", r#"{"amount": "11"}"#),
            ("s3", r#"{"amount": 10.0}"#),
        ] {
            sqlx::query_scalar::<_, String>("SELECT lanebus.publish('s.x', NULL, $1::jsonb, $2)")
                .bind(payload)
                .bind(id)
                .fetch_one(&mut *tx)
                .await
                .expect("lanebus.publish");
        }
        sqlx::query(
            "SELECT * FROM lanebus.publish_batch(ARRAY['s.x', 's.x'], ARRAY[NULL, NULL]::text[], \
             ARRAY['{\"amount\": 10.5}', '{}']::jsonb[], ARRAY['s4', 's5'])",
        )
        .fetch_all(&mut *tx)
        .await
        .expect("lanebus.publish_batch");
        tx.commit().await.expect("commit");
        let ds = claim_all(&*s).await;
        let mut got: Vec<&str> = ds
            .iter()
            .filter(|d| d.handler_id == f.id)
            .map(|d| d.event_id.as_str())
            .collect();
        got.sort_unstable();
        assert_eq!(got, vec!["s1", "s4"]);
        assert_eq!(ds.iter().filter(|d| d.handler_id == plain.id).count(), 5);
        assert_eq!(counts(&*s).await.deliveries, 7);
        Harness::cleanup(&h).await;
    }

    /// The late-commit pitfall: a publish transaction that got its id before
    /// another publish committed, and commits after a claim read the other.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claim_cursor_does_not_skip_a_late_commit() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        // Unkeyed events whose ids hash to the same lane.
        let lane = lane_of_event(None, "late", s.lanes());
        let early_id = (0..)
            .map(|i| format!("early-{i}"))
            .find(|id| lane_of_event(None, id, s.lanes()) == lane)
            .expect("an id in the lane");

        let mut held = h.store.pool().begin().await.expect("begin");
        let out = h
            .store
            .publish_in(&mut held, vec![ev(Some("late"), "t.x", None)])
            .await
            .expect("publish_in");
        assert_eq!(out.accepted, 1);
        s.publish(vec![ev(Some(&early_id), "t.x", None)])
            .await
            .expect("publish");

        let first = s.claim(&lane_cursor(lane, 0, 100)).await.expect("claim");
        let ids: Vec<&str> = first[0]
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        assert_eq!(
            ids,
            vec![early_id.as_str()],
            "the held publish is not visible yet"
        );

        held.commit().await.expect("commit the late publish");
        let second = s
            .claim(&lane_cursor(lane, first[0].next_after.clone(), 100))
            .await
            .expect("claim");
        assert!(
            second[0].deliveries.iter().any(|d| d.event_id == "late"),
            "the claim cursor skipped a late-committing publish: {:?}",
            second[0].deliveries
        );
        h.cleanup().await;
    }

    /// A transaction left open elsewhere on the server (an idle session that
    /// took an id) does not hold the cursor back: rows committed after it
    /// began are read once, not re-read by every claim, so a lane's rows
    /// past the limit come through (issue 18, item 3: on main every claim
    /// re-read from the open transaction's id, so a lane whose first `limit`
    /// rows the owner already held never got further).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn an_open_transaction_does_not_hold_the_cursor_back() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let key = "held-back";
        let lane = lane_of_key(key, s.lanes());
        let mut idle = h.store.pool().begin().await.expect("begin");
        let idle_xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
            .fetch_one(&mut *idle)
            .await
            .expect("take an id");
        for i in 0..6 {
            s.publish(vec![ev(Some(&format!("h{i}")), "t.x", Some(key))])
                .await
                .expect("publish");
        }
        let mut after = ClaimCursor::default();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let b = s
                .claim(&one_lane_claim(lane, Epoch(0), after.clone(), 2))
                .await
                .expect("claim");
            seen.extend(b[0].deliveries.iter().map(|d| d.event_id.clone()));
            after = b[0].next_after.clone();
        }
        assert_eq!(
            seen,
            ["h0", "h1", "h2", "h3", "h4", "h5"],
            "three claims of 2 read the six rows once each, in order"
        );
        let b = s
            .claim(&one_lane_claim(lane, Epoch(0), after.clone(), 2))
            .await
            .expect("claim");
        assert!(
            b[0].deliveries.is_empty(),
            "rows read before were returned again: {:?}",
            b[0].deliveries
        );
        assert!(
            b[0].next_after.open.contains(&idle_xid),
            "the idle transaction stays open in the cursor: {:?}",
            b[0].next_after
        );
        idle.rollback().await.expect("rollback");
        h.cleanup().await;
    }

    /// A keyed delivery whose xid the key raised above its transaction's id
    /// (the transaction got its id before another publisher of the key
    /// committed) is still read when that transaction commits after a claim
    /// passed the raised xid: it is found by its transaction id.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_raised_row_of_a_late_commit_is_read() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let key = "raised";
        let lane = lane_of_key(key, s.lanes());
        // The late transaction takes its id first.
        let mut late = h.store.pool().begin().await.expect("begin");
        let late_xid: i64 = sqlx::query_scalar("SELECT pg_current_xact_id()::text::bigint")
            .fetch_one(&mut *late)
            .await
            .expect("take an id");
        s.publish(vec![ev(Some("k1"), "t.x", Some(key))])
            .await
            .expect("publish");
        // Its publish of the key comes after k1 committed: xid raised to k1's.
        h.store
            .publish_in(&mut late, vec![ev(Some("k2"), "t.x", Some(key))])
            .await
            .expect("publish_in");
        let first = s
            .claim(&one_lane_claim(lane, Epoch(0), 0, 100))
            .await
            .expect("claim");
        let ids: Vec<&str> = first[0]
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        assert_eq!(ids, ["k1"]);
        assert!(
            first[0].next_after.open.contains(&late_xid),
            "the late transaction is open: {:?}",
            first[0].next_after
        );
        late.commit().await.expect("commit");
        let second = s
            .claim(&one_lane_claim(
                lane,
                Epoch(0),
                first[0].next_after.clone(),
                100,
            ))
            .await
            .expect("claim");
        let ids: Vec<&str> = second[0]
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        assert_eq!(ids, ["k2"], "the raised row of the late commit was skipped");
        h.cleanup().await;
    }

    /// A handler delete that meets a deadlock (a lane owner discarding the
    /// deleted handler's rows in another order) repeats the aborted chunk
    /// and finishes: the answer is the counts, not a 500 after the handler
    /// row is already gone (new-user finding: 3 of 4 deletes of a 200,000
    /// backlog failed with "deadlock detected" and left dead letters behind).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_handler_delete_that_meets_a_deadlock_finishes() {
        let h = PgHarness::new().await;
        let s = h.store();
        let gone = handler(&*s, "gone", &["*"]).await;
        let key = "dl";
        for i in 0..2 {
            s.publish(vec![ev(Some(&format!("d{i}")), "t.x", Some(key))])
                .await
                .expect("publish");
        }
        let ids: Vec<i64> =
            sqlx::query_scalar("SELECT id FROM deliveries WHERE handler_id = $1 ORDER BY xid")
                .bind(&gone.id)
                .fetch_all(h.store.pool())
                .await
                .expect("ids");
        assert_eq!(ids.len(), 2);
        // Another session takes the later row first ...
        let mut other = h.store.pool().begin().await.expect("begin");
        sqlx::query("DELETE FROM deliveries WHERE id = $1")
            .bind(ids[1])
            .execute(&mut *other)
            .await
            .expect("lock the later row");
        // ... the delete takes the earlier one and waits for the later ...
        let del = {
            let s = s.clone();
            let id = gone.id.clone();
            tokio::spawn(async move { s.delete_handler(&id).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(400)).await;
        // ... and the other session asks for the earlier one: a deadlock,
        // which PostgreSQL breaks by aborting the delete's statement.
        let waits = async {
            sqlx::query("DELETE FROM deliveries WHERE id = $1")
                .bind(ids[0])
                .execute(&mut *other)
                .await
        };
        match waits.await {
            Ok(_) => other.commit().await.expect("commit"),
            Err(_) => other.rollback().await.expect("rollback"),
        }
        let out = del.await.expect("join").expect("the delete finishes");
        assert!(out.deliveries <= 2);
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries WHERE handler_id = $1")
            .bind(&gone.id)
            .fetch_one(h.store.pool())
            .await
            .expect("count");
        assert_eq!(left, 0, "deliveries of the deleted handler left");
        h.cleanup().await;
    }

    /// A deposed owner's completion that meets a fence in progress waits for
    /// it and then changes nothing (invariant 4), although its statement
    /// began while the old epoch was still the committed one. Without the
    /// `FOR SHARE` lock on the lane row the completion would read the old
    /// epoch from its snapshot and delete the delivery.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_completion_meeting_a_fence_in_progress_changes_nothing() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let lane = lane_of_key("race", s.lanes());
        assert!(s.fence(lane, "n1", Epoch(1)).await.expect("fence"));
        s.publish(vec![ev(Some("r1"), "t.x", Some("race"))])
            .await
            .expect("publish");
        let b = s
            .claim(&one_lane_claim(lane, Epoch(1), 0, 10))
            .await
            .expect("claim");
        let d = b[0].deliveries[0].clone();

        let mut fence_tx = h.store.pool().begin().await.expect("begin");
        sqlx::query("UPDATE lanes SET epoch = 2, owner = 'n2' WHERE lane = $1")
            .bind(i32::from(lane))
            .execute(&mut *fence_tx)
            .await
            .expect("fence in a held transaction");
        let stale = {
            let s = s.clone();
            tokio::spawn(async move {
                s.complete(&[DeliveryRef {
                    id: d.id,
                    lane,
                    epoch: Epoch(1),
                    attempts: 1,
                }])
                .await
            })
        };
        // Give the completion time to start and take its snapshot.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        fence_tx.commit().await.expect("commit the fence");
        let done = stale.await.expect("join").expect("complete");
        assert!(
            done.is_empty(),
            "a completion at epoch 1 changed rows after epoch 2 committed: {done:?}"
        );
        assert_eq!(counts(&*s).await.deliveries, 1, "the delivery must remain");
        h.cleanup().await;
    }

    /// A dead-letter write that holds a handler's delivery while the
    /// handler is deleted: the delete waits for it and discards the dead
    /// letter too (it was left behind, orphaned, when the delete read one
    /// snapshot taken before the wait).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_dead_letter_written_during_a_handler_delete_is_discarded_too() {
        let h = PgHarness::new().await;
        let s = h.store();
        let id = handler(&*s, "doomed", &["*"]).await.id;
        s.publish(vec![ev(Some("dl-race"), "t.x", Some("k"))])
            .await
            .expect("publish");
        // The dead-letter statement of a node, held open: delivery row
        // deleted (locked), dead letter inserted, not committed.
        let mut node_tx = h.store.pool().begin().await.expect("begin");
        sqlx::query(
            "WITH d AS (DELETE FROM deliveries WHERE handler_id = $1 RETURNING *) \
             INSERT INTO dead_letters (handler_id, event_id, lane, key, seq, attempts, last_error) \
             SELECT handler_id, event_id, lane, key, seq, 3, 'boom' FROM d",
        )
        .bind(&id)
        .execute(&mut *node_tx)
        .await
        .expect("dead letter in a held transaction");
        let delete = {
            let (s, id) = (s.clone(), id.clone());
            tokio::spawn(async move { s.delete_handler(&id).await })
        };
        // Let the delete start and meet the locked delivery row.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        node_tx.commit().await.expect("commit the dead letter");
        let deleted = delete.await.expect("join").expect("delete");
        let c = counts(&*s).await;
        assert_eq!(
            (c.deliveries, c.dead_letters),
            (0, 0),
            "left behind by the handler delete: {c:?} (answered {deleted:?})"
        );
        assert_eq!(deleted.dead_letters, 1, "{deleted:?}");
        h.cleanup().await;
    }

    /// A handler delete walks each lane in chunks of the claim index
    /// `(lane, xid)`: every row of the handler goes, across chunk bounds,
    /// in a transaction with more rows in a lane than a chunk holds, among
    /// another handler's rows, and in the last lane; the other handler's
    /// rows stay.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_handler_delete_walks_every_chunk_of_every_lane() {
        let h = PgHarness::new().await;
        let s = h.store();
        let doomed = handler(&*s, "doomed", &["*"]).await.id;
        let kept = handler(&*s, "kept", &["*"]).await.id;
        let last = i32::from(s.lanes()) - 1;
        // (lane, rows of doomed, rows of kept), one transaction each.
        let mut txs = vec![(0, 3_000, 2_500), (last, 1, 0)];
        txs.extend((0..12).map(|i| (i % 3, 700 * (i % 2), 300 + i)));
        txs.push((0, 2_001, 0));
        let pool = h.store.pool();
        for &(lane, d, k) in &txs {
            sqlx::query(
                "INSERT INTO deliveries (lane, handler_id, event_id) \
                 SELECT $1, CASE WHEN g <= $3 THEN $2 ELSE $4 END, 'e' || g \
                 FROM generate_series(1, $3 + $5) g",
            )
            .bind(lane)
            .bind(&doomed)
            .bind(d)
            .bind(&kept)
            .bind(k)
            .execute(pool)
            .await
            .expect("insert deliveries");
        }
        let of = |id: &str| {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM deliveries WHERE handler_id = $1")
                .bind(id.to_owned())
                .fetch_one(pool)
        };
        let (d, k) = (
            of(&doomed).await.expect("count"),
            of(&kept).await.expect("count"),
        );
        assert_eq!(d, txs.iter().map(|t| i64::from(t.1)).sum::<i64>(), "seeded");
        let deleted = s.delete_handler(&doomed).await.expect("delete");
        assert_eq!(deleted.deliveries, d as u64, "{deleted:?}");
        assert_eq!(of(&doomed).await.expect("count"), 0, "left behind");
        assert_eq!(of(&kept).await.expect("count"), k, "another handler's rows");
        h.cleanup().await;
    }

    /// A publish that read a handler before its DELETE and commits after it
    /// leaves the deleted handler a delivery; when that delivery fails for
    /// good, it goes without a dead letter (nobody could replay one, and it
    /// would keep its event from being pruned; found in review).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_deleted_handlers_late_delivery_leaves_no_dead_letter() {
        let h = PgHarness::new().await;
        let s = h.store();
        let id = handler(&*s, "doomed", &["*"]).await.id;
        let lane = lane_of_key("late", s.lanes());
        assert!(s.fence(lane, "n1", Epoch(1)).await.expect("fence"));
        let mut late = h.store.pool().begin().await.expect("begin");
        h.store
            .publish_in(&mut late, vec![ev(Some("late-1"), "t.x", Some("late"))])
            .await
            .expect("publish_in");
        s.delete_handler(&id).await.expect("delete");
        late.commit().await.expect("commit the late publish");
        let b = s
            .claim(&one_lane_claim(lane, Epoch(1), 0, 10))
            .await
            .expect("claim");
        let d = b[0].deliveries[0].clone();
        assert_eq!(d.handler_id, id, "the orphan delivery");
        let gone = s
            .dead_letter(&[DeadLetterRequest {
                id: d.id,
                lane,
                epoch: Epoch(1),
                attempts: 3,
                last_error: "boom".into(),
                failure: None,
            }])
            .await
            .expect("dead letter");
        assert_eq!(gone, vec![d.id], "the delivery is settled");
        let c = counts(&*s).await;
        assert_eq!((c.deliveries, c.dead_letters), (0, 0), "{c:?}");
        h.cleanup().await;
    }

    /// Transaction ids follow first writes, not key-lock order: a publisher
    /// with an older transaction id can take a key's next number after a
    /// younger one. Claim order (and limit cuts) must still follow sequence order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_keys_claim_order_follows_sequence_order_not_transaction_ids() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let key = "inverted";
        let lane = lane_of_key(key, s.lanes());

        // Old transaction: gets its id now, by writing something unrelated.
        let mut old = h.store.pool().begin().await.expect("begin");
        h.store
            .publish_in(
                &mut old,
                vec![ev(Some("unrelated"), "t.x", Some("elsewhere"))],
            )
            .await
            .expect("publish_in");
        // Younger transaction publishes the key first: seq 1.
        s.publish(vec![ev(Some("first"), "t.x", Some(key))])
            .await
            .expect("publish");
        // The old transaction publishes the key next: seq 2.
        h.store
            .publish_in(&mut old, vec![ev(Some("second"), "t.x", Some(key))])
            .await
            .expect("publish_in");
        old.commit().await.expect("commit");

        let b = s.claim(&lane_cursor(lane, 0, 1)).await.expect("claim");
        let got: Vec<(&str, Option<i64>)> = b[0]
            .deliveries
            .iter()
            .filter(|d| d.key.as_deref() == Some(key))
            .map(|d| (d.event_id.as_str(), d.seq))
            .collect();
        assert_eq!(
            got.first(),
            Some(&("first", Some(1))),
            "seq 1 comes first: {got:?}"
        );
        let all = s.claim(&lane_cursor(lane, 0, 100)).await.expect("claim");
        let seqs = seqs_of_key(&all[0].deliveries, key);
        assert_eq!(seqs, vec![1, 2]);
        h.cleanup().await;
    }

    /// One transaction with more rows in a lane than the claim limit must not
    /// stall the cursor: its rows come back together.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_big_transaction_does_not_stall_a_limited_claim() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let lane = lane_of_key("big", s.lanes());
        s.publish(
            (0..10)
                .map(|i| ev(Some(&format!("b{i}")), "t.x", Some("big")))
                .collect(),
        )
        .await
        .expect("publish");
        s.publish(vec![ev(Some("after"), "t.x", Some("big"))])
            .await
            .expect("publish");
        let b = s.claim(&lane_cursor(lane, 0, 3)).await.expect("claim");
        assert_eq!(
            seqs_of_key(&b[0].deliveries, "big"),
            (1..=10).collect::<Vec<_>>()
        );
        // Complete them, as the owner does: a transaction still running
        // elsewhere in the cluster (other tests) may hold xmin back, and then
        // the cursor re-reads until the rows are gone.
        let refs: Vec<DeliveryRef> = b[0]
            .deliveries
            .iter()
            .map(|d| dref(d, Epoch(0), 1))
            .collect();
        assert_eq!(s.complete(&refs).await.expect("complete").len(), 10);
        let next = s
            .claim(&lane_cursor(lane, b[0].next_after.clone(), 3))
            .await
            .expect("claim");
        let ids: Vec<&str> = next[0]
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        assert!(ids.contains(&"after"), "the cursor moved on: {ids:?}");
        h.cleanup().await;
    }

    /// publish_in with a client id that a concurrent transaction is inserting:
    /// the caller's transaction survives and counts it as a duplicate.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publish_in_survives_a_concurrent_publisher_of_the_same_id() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let mut first = h.store.pool().begin().await.expect("begin");
        h.store
            .publish_in(&mut first, vec![ev(Some("contested"), "t.x", Some("k"))])
            .await
            .expect("publish_in");
        let store = h.store.clone();
        let second = tokio::spawn(async move {
            let mut tx = store.pool().begin().await.expect("begin");
            let out = store
                .publish_in(
                    &mut tx,
                    vec![
                        ev(Some("contested"), "t.x", Some("k")),
                        ev(Some("mine"), "t.x", Some("k")),
                    ],
                )
                .await
                .expect("publish_in must absorb the race");
            tx.commit()
                .await
                .expect("the caller's transaction is still usable");
            out
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        first.commit().await.expect("commit");
        let out = second.await.expect("task");
        assert_eq!((out.accepted, out.duplicates), (1, 1));
        let c = counts(&*s).await;
        assert_eq!((c.events, c.deliveries), (2, 2));
        assert_eq!(seqs_of_key(&claim_all(&*s).await, "k"), vec![1, 2]);
        h.cleanup().await;
    }

    /// The next wake-up of `rx`, waited for at most `secs` seconds.
    async fn next_wake(rx: &mut wake::WakeReceiver, secs: u64, what: &str) -> wake::Woken {
        tokio::time::timeout(std::time::Duration::from_secs(secs), rx.recv())
            .await
            .unwrap_or_else(|_| panic!("{what}: none within {secs} s"))
            .expect("channel open")
    }

    /// A publishing transaction sends one wake-up, which names the lanes
    /// that got deliveries (and no others), so listeners claim only those.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publish_wakes_listeners_once_per_transaction() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "t", &["t.*"]).await;
        let Wakeups::Push(mut rx) = s.wakeups().await.expect("wakeups") else {
            panic!("postgres pushes wake-ups");
        };
        let other = h.reopen().await;
        let ids: Vec<String> = (0..50).map(|i| format!("w{i}")).collect();
        other
            .publish(ids.iter().map(|id| ev(Some(id), "t.x", None)).collect())
            .await
            .expect("publish");
        let woken = next_wake(&mut rx, 5, "the publish's wake-up").await;
        let lanes: std::collections::BTreeSet<Lane> = ids
            .iter()
            .map(|id| lane_of_event(None, id, s.lanes()))
            .collect();
        assert!(lanes.len() > 1, "the events spread over lanes");
        assert_eq!(woken, wake::Woken::Lanes(lanes), "the lanes published into");
        // One transaction, one notification: nothing else is queued.
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(rx.try_recv(), None, "coalesced to one wake-up");
        // A keyed event wakes its key's lane only; an event no handler
        // routes wakes nothing.
        s.publish(vec![ev(Some("unrouted"), "u.x", None)])
            .await
            .expect("publish");
        s.publish(vec![ev(Some("keyed"), "t.x", Some("order-7"))])
            .await
            .expect("publish");
        let woken = next_wake(&mut rx, 5, "the publish's wake-up").await;
        let lane = lane_of_key("order-7", s.lanes());
        assert_eq!(woken, wake::Woken::Lanes([lane].into()));
        // A listener whose connection is killed reconnects and wakes up.
        let mut admin = sqlx::PgConnection::connect(&h.url).await.expect("connect");
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
        )
        .execute(&mut admin)
        .await
        .expect("terminate listener");
        let woken = next_wake(&mut rx, 10, "a wake-up after reconnecting").await;
        assert_eq!(woken, wake::Woken::All, "what was missed is not known");
        s.publish(vec![ev(Some("after-reconnect"), "t.x", None)])
            .await
            .expect("publish");
        next_wake(&mut rx, 5, "wake-ups flow again after reconnecting").await;
        let _ = admin.close().await;
        h.cleanup().await;
    }

    /// A connection of another process listening on the wake-up channel.
    async fn listener(url: &str) -> sqlx::postgres::PgListener {
        let mut l = sqlx::postgres::PgListener::connect(url)
            .await
            .expect("connect");
        l.listen("lanebus").await.expect("listen");
        l
    }

    /// Whether `l` hears nothing for 400 ms.
    async fn quiet(l: &mut sqlx::postgres::PgListener) -> bool {
        tokio::time::timeout(std::time::Duration::from_millis(400), l.recv())
            .await
            .is_err()
    }

    /// The payload of the next NOTIFY `l` hears, within 5 s.
    async fn heard(l: &mut sqlx::postgres::PgListener, what: &str) -> String {
        tokio::time::timeout(std::time::Duration::from_secs(5), l.recv())
            .await
            .unwrap_or_else(|_| panic!("no NOTIFY {what}"))
            .expect("listen")
            .payload()
            .to_string()
    }

    /// A receiver that says which lanes its node runs gets the store's own
    /// publishes into them in process, and no NOTIFY goes out for a write
    /// whose lanes all run there; other lanes, other processes' publishes
    /// and a dropped receiver still go through NOTIFY.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn own_publishes_wake_lanes_run_in_process_without_notify() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "t", &["t.*"]).await;
        let Wakeups::Push(mut rx) = s.wakeups().await.expect("wakeups") else {
            panic!("postgres pushes wake-ups");
        };
        let here = lane_of_key("here", s.lanes());
        let there = (0..)
            .map(|i| format!("there-{i}"))
            .find(|k| lane_of_key(k, s.lanes()) != here)
            .expect("a key in another lane");
        let elsewhere = lane_of_key(&there, s.lanes());
        assert!(rx.set_runs(std::sync::Arc::new(move |l| l == here)));
        assert!(
            !rx.set_runs(std::sync::Arc::new(|_| true)),
            "told once only"
        );
        let mut outside = listener(&h.url).await;

        // A lane run here: woken in process, nothing for other processes.
        s.publish(vec![ev(None, "t.x", Some("here"))])
            .await
            .expect("publish");
        let woken = next_wake(&mut rx, 5, "the in-process wake-up").await;
        assert_eq!(woken, wake::Woken::Lanes([here].into()));
        assert!(quiet(&mut outside).await, "no NOTIFY for a lane run here");
        // publish_in, then the wake-up after the commit: likewise.
        let mut tx = h.store.pool().begin().await.expect("begin");
        let out = h
            .store
            .publish_in(&mut tx, vec![ev(None, "t.x", Some("here"))])
            .await
            .expect("publish_in");
        tx.commit().await.expect("commit");
        h.store.wake_after_commit(&out).await.expect("wake");
        let woken = next_wake(&mut rx, 5, "the in-process wake-up").await;
        assert_eq!(woken, wake::Woken::Lanes([here].into()));
        assert!(quiet(&mut outside).await, "no NOTIFY after publish_in");

        // A lane run elsewhere: one NOTIFY, which this receiver hears too.
        s.publish(vec![ev(None, "t.x", Some(&there))])
            .await
            .expect("publish");
        assert_eq!(
            heard(&mut outside, "for a lane run elsewhere").await,
            elsewhere.to_string()
        );
        let woken = next_wake(&mut rx, 5, "the NOTIFY, heard here").await;
        assert_eq!(woken, wake::Woken::Lanes([elsewhere].into()));

        // Another process's publish into a lane run here: NOTIFY.
        let other = h.reopen().await;
        other
            .publish(vec![ev(None, "t.x", Some("here"))])
            .await
            .expect("publish");
        assert_eq!(
            heard(&mut outside, "for another process's publish").await,
            here.to_string()
        );

        // Once the receiver is gone, no lane runs here: NOTIFY again.
        drop(rx);
        s.publish(vec![ev(None, "t.x", Some("here"))])
            .await
            .expect("publish");
        assert_eq!(
            heard(&mut outside, "once the receiver is gone").await,
            here.to_string()
        );
        h.cleanup().await;
    }

    /// The in-process wake-up names the lanes that got deliveries, not
    /// those of events no handler routes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn in_process_wake_ups_name_only_lanes_with_deliveries() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "t", &["t.*"]).await;
        let Wakeups::Push(mut rx) = s.wakeups().await.expect("wakeups") else {
            panic!("postgres pushes wake-ups");
        };
        assert!(rx.set_runs(Arc::new(|_| true)));
        let routed = lane_of_key("routed", s.lanes());
        let other = (0..)
            .map(|i| format!("unrouted-{i}"))
            .find(|k| lane_of_key(k, s.lanes()) != routed)
            .expect("a key in another lane");
        let mut outside = listener(&h.url).await;
        s.publish(vec![
            ev(None, "t.x", Some("routed")),
            ev(None, "u.x", Some(&other)),
        ])
        .await
        .expect("publish");
        let woken = next_wake(&mut rx, 5, "the in-process wake-up").await;
        assert_eq!(woken, wake::Woken::Lanes([routed].into()));
        // Nothing routed at all: no wake-up.
        s.publish(vec![ev(None, "u.x", Some(&other))])
            .await
            .expect("publish");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert_eq!(rx.try_recv(), None);
        assert!(quiet(&mut outside).await, "no NOTIFY: every lane runs here");
        h.cleanup().await;
    }

    /// A lane that stops running here between the write's check and its
    /// commit (handed over meanwhile) gets its NOTIFY after the commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_lane_handed_over_during_the_write_still_gets_its_notify() {
        let h = PgHarness::new().await;
        let s = h.store();
        handler(&*s, "t", &["t.*"]).await;
        let Wakeups::Push(rx) = s.wakeups().await.expect("wakeups") else {
            panic!("postgres pushes wake-ups");
        };
        let here = lane_of_key("here", s.lanes());
        // Runs here when the write looks, no longer once it committed.
        let looks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = looks.clone();
        assert!(rx.set_runs(Arc::new(move |l| {
            l == here && seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0
        })));
        let mut outside = listener(&h.url).await;
        s.publish(vec![ev(None, "t.x", Some("here"))])
            .await
            .expect("publish");
        assert_eq!(
            heard(&mut outside, "after the commit for a lane handed over").await,
            here.to_string()
        );
        assert!(looks.load(std::sync::atomic::Ordering::SeqCst) >= 2);
        h.cleanup().await;
    }

    /// Several nodes connecting to one new database at once: the migration
    /// runs once (advisory lock), all agree on the lanes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_connects_to_a_new_database_agree() {
        let h = PgHarness::new().await;
        let db = format!("lanebus_t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = sqlx::PgConnection::connect(&h.admin_url)
            .await
            .expect("connect");
        sqlx::query(&format!("CREATE DATABASE {db}"))
            .execute(&mut admin)
            .await
            .expect("create database");
        let url = with_database(&h.admin_url, &db);
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { PgStore::connect_with_lanes(&url, 32).await })
            })
            .collect();
        let mut stores = Vec::new();
        for o in opens {
            stores.push(o.await.expect("task").expect("connect"));
        }
        for s in &stores {
            assert_eq!(s.lanes(), 32);
            assert_eq!(s.lane_rows().await.expect("lane rows").len(), 32);
            s.migrate().await.expect("migrate again is a no-op");
        }
        for s in &stores {
            s.pool().close().await;
        }
        let _ = sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
        let _ = admin.close().await;
        h.cleanup().await;
    }
}

/// Tests of SQLite-only behaviour.
mod sqlite_only {
    use super::*;

    #[tokio::test]
    async fn sqlite_polls() {
        let h = SqliteHarness::new().await;
        assert!(matches!(h.store().wakeups().await, Ok(Wakeups::Poll)));
        h.cleanup().await;
    }

    #[tokio::test]
    async fn an_in_memory_store_works_on_one_connection() {
        let s = SqliteStore::connect("sqlite::memory:").await.expect("open");
        handler(&s, "all", &["*"]).await;
        s.publish(vec![ev(Some("m"), "t.x", Some("k"))])
            .await
            .expect("publish");
        let ds = claim_all(&s).await;
        assert_eq!(ds.len(), 1);
        assert_eq!(
            s.complete(&[dref(&ds[0], Epoch(0), 1)])
                .await
                .expect("complete"),
            vec![ds[0].id]
        );
        assert_eq!(counts(&s).await.completions, 1);
    }

    /// Several processes opening one new file at once (the demo's three
    /// nodes): one creates the schema and the lanes, all agree.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_opens_of_a_new_file_agree() {
        let dir =
            std::env::temp_dir().join(format!("lanebus-open-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let url = format!("sqlite://{}", dir.join("shared.db").display());
        let opens: Vec<_> = (0..4)
            .map(|_| {
                let url = url.clone();
                tokio::spawn(async move { SqliteStore::connect(&url).await })
            })
            .collect();
        let mut stores = Vec::new();
        for o in opens {
            stores.push(o.await.expect("task").expect("open"));
        }
        for s in &stores {
            assert_eq!(s.lanes(), DEFAULT_LANES);
            assert_eq!(
                s.lane_rows().await.expect("lane rows").len(),
                usize::from(DEFAULT_LANES)
            );
            s.migrate().await.expect("migrate again is a no-op");
        }
        for s in &stores {
            s.pool().close().await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    const CHILD_DB: &str = "LANEBUS_TEST_CHILD_SQLITE_URL";
    const CHILD_NAME: &str = "LANEBUS_TEST_CHILD_NAME";

    /// Three processes publishing into one file at once (the demo's three
    /// nodes share one): every write waits for the file lock, sequences stay
    /// gapless. The test binary runs itself as the child processes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn several_processes_share_one_file() {
        if let (Ok(url), Ok(name)) = (std::env::var(CHILD_DB), std::env::var(CHILD_NAME)) {
            // Child: publish 20 batches of 10 events over three keys.
            let s = SqliteStore::connect(&url).await.expect("child open");
            for b in 0..20 {
                let batch = (0..10)
                    .map(|i| {
                        ev(
                            Some(&format!("{name}-{b}-{i}")),
                            "t.x",
                            Some(&format!("shared-{}", i % 3)),
                        )
                    })
                    .collect();
                assert_eq!(s.publish(batch).await.expect("child publish").accepted, 10);
            }
            return;
        }
        let dir =
            std::env::temp_dir().join(format!("lanebus-procs-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let url = format!("sqlite://{}", dir.join("shared.db").display());
        let s = SqliteStore::connect(&url).await.expect("open");
        handler(&s, "all", &["*"]).await;
        let exe = std::env::current_exe().expect("test binary");
        let children: Vec<_> = (0..3)
            .map(|n| {
                std::process::Command::new(&exe)
                    .args([
                        "--exact",
                        "sqlite_only::several_processes_share_one_file",
                        "--test-threads",
                        "1",
                    ])
                    .env(CHILD_DB, &url)
                    .env(CHILD_NAME, format!("proc{n}"))
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("spawn child")
            })
            .collect();
        // Meanwhile this process completes what it claims, as a node would.
        let mut completed = 0;
        for mut child in children {
            let status = tokio::task::spawn_blocking(move || child.wait())
                .await
                .expect("join")
                .expect("wait");
            assert!(status.success(), "child process failed: {status}");
            let ds = claim_all(&s).await;
            let refs: Vec<DeliveryRef> = ds.iter().map(|d| dref(d, Epoch(0), 1)).collect();
            completed += s.complete(&refs).await.expect("complete").len();
        }
        let c = counts(&s).await;
        assert_eq!(c.events, 600);
        assert_eq!(c.completions + c.deliveries, 600);
        assert_eq!(completed as i64, c.completions);
        // Sequence numbers per key: gapless, each once, across processes.
        let seqs: Vec<(Option<String>, Option<i64>)> =
            sqlx::query_as("SELECT key, seq FROM events ORDER BY key, seq")
                .fetch_all(s.pool())
                .await
                .expect("read events");
        for k in 0..3 {
            let key = format!("shared-{k}");
            let mine: Vec<i64> = seqs
                .iter()
                .filter(|(kk, _)| kk.as_deref() == Some(&key))
                .filter_map(|(_, q)| *q)
                .collect();
            let per_batch = (0..10).filter(|i| i % 3 == k).count() as i64;
            assert_eq!(mine, (1..=3 * 20 * per_batch).collect::<Vec<_>>(), "{key}");
        }
        s.pool().close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// SQLite's answer to the late-commit pitfall: a held publish transaction
    /// holds the write lock, so a second publish waits for it (and does not
    /// fail), and ids follow commit order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_held_publish_in_makes_other_writers_wait() {
        let h = SqliteHarness::new().await;
        let s = h.store.clone();
        handler(&*s, "all", &["*"]).await;
        let mut held = s.pool().begin_with("BEGIN IMMEDIATE").await.expect("begin");
        s.publish_in(&mut held, vec![ev(Some("held"), "t.x", Some("k"))])
            .await
            .expect("publish_in");
        let other = s.clone();
        let waiting = tokio::spawn(async move {
            other
                .publish(vec![ev(Some("waiting"), "t.x", Some("k"))])
                .await
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(
            !waiting.is_finished(),
            "the second publish waits for the write lock"
        );
        held.commit().await.expect("commit");
        let out = waiting
            .await
            .expect("task")
            .expect("the waiting publish succeeds");
        assert_eq!(out.accepted, 1);
        let ds = claim_all(&*s).await;
        let order: Vec<(&str, Option<i64>)> =
            ds.iter().map(|d| (d.event_id.as_str(), d.seq)).collect();
        assert_eq!(order, vec![("held", Some(1)), ("waiting", Some(2))]);
        h.cleanup().await;
    }
}

/// Tests of MongoDB-only behaviour: concurrent publishers on hot keys, the
/// caller's transaction, the per-lane cursor under a late commit, fencing
/// against a fence held in a transaction, change-stream wake-ups.
#[cfg(feature = "mongodb")]
mod mongodb_only {
    use super::*;
    use std::time::Duration;

    use ::mongodb::bson::{doc, Document};

    /// Issue 18 item 5: `publish_in` on a session without a transaction in
    /// progress (never started; already committed; already aborted) is
    /// refused and writes nothing. Before, it wrote the events and their
    /// deliveries as separate, non-atomic writes: a failure between them
    /// left events that are never delivered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publish_in_refuses_a_session_without_a_transaction() {
        let h = MongoHarness::new().await;
        let s: Arc<dyn Store> = h.store.clone();
        handler(&*s, "all", &["*"]).await;
        let refused = |r: Result<PublishOutcome, StoreError>, case: &str| match r {
            Err(StoreError::Invalid(m)) => assert!(m.contains("transaction"), "{case}: {m}"),
            other => panic!("{case}: publish_in answered {other:?}"),
        };
        let mut session = h.store.client().start_session().await.expect("session");
        refused(
            h.store
                .publish_in(&mut session, vec![ev(Some("no-tx"), "t.x", Some("k"))])
                .await,
            "never started",
        );
        session.start_transaction().await.expect("start");
        h.store
            .publish_in(&mut session, vec![ev(Some("in-tx"), "t.x", Some("k"))])
            .await
            .expect("publish_in inside a transaction");
        session.commit_transaction().await.expect("commit");
        refused(
            h.store
                .publish_in(
                    &mut session,
                    vec![ev(Some("after-commit"), "t.x", Some("k"))],
                )
                .await,
            "after commit",
        );
        session.start_transaction().await.expect("start again");
        session.abort_transaction().await.expect("abort");
        refused(
            h.store
                .publish_in(
                    &mut session,
                    vec![ev(Some("after-abort"), "t.x", Some("k"))],
                )
                .await,
            "after abort",
        );
        let c = counts(&*s).await;
        assert_eq!(
            (c.events, c.deliveries),
            (1, 1),
            "only the transaction's event: {c:?}"
        );
        // The session is still usable for a proper transaction.
        session.start_transaction().await.expect("start once more");
        h.store
            .publish_in(&mut session, vec![ev(Some("in-tx-2"), "t.x", Some("k"))])
            .await
            .expect("publish_in inside the next transaction");
        session.commit_transaction().await.expect("commit");
        assert_eq!(counts(&*s).await.events, 2);
    }

    /// 8 publishers, each 2,000 events over the same 10 keys in batches of
    /// 50, on two independent clients: no duplicate sequence number, every
    /// key gapless, every event delivered once (claimed through the cursor
    /// and completed), in per-key sequence order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn eight_publishers_on_ten_hot_keys_get_gapless_sequences() {
        const PUBLISHERS: usize = 8;
        const EVENTS: usize = 2_000;
        const BATCH: usize = 50;
        const KEYS: usize = 10;
        let h = MongoHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let other = h.reopen().await;
        let started = std::time::Instant::now();
        let mut tasks = Vec::new();
        for p in 0..PUBLISHERS {
            let st = if p % 2 == 0 { s.clone() } else { other.clone() };
            tasks.push(tokio::spawn(async move {
                for b in 0..EVENTS / BATCH {
                    let batch: Vec<NewEvent> = (0..BATCH)
                        .map(|i| {
                            let n = b * BATCH + i;
                            ev(
                                Some(&format!("p{p}-{n}")),
                                "load.test",
                                Some(&format!("hot-{}", (p + n) % KEYS)),
                            )
                        })
                        .collect();
                    let out = st.publish(batch).await.expect("concurrent publish");
                    assert_eq!(out.accepted, BATCH);
                }
            }));
        }
        for t in tasks {
            t.await.expect("publisher task");
        }
        let publish_secs = started.elapsed().as_secs_f64();
        let total = PUBLISHERS * EVENTS;
        let c = counts(&*s).await;
        assert_eq!((c.events, c.deliveries), (total as i64, total as i64));

        // Drain through the cursor, 200 per lane per claim, completing in
        // batches of 500 as the node's store actor does (the test server's
        // `$in` grows with the square of the list; see the module docs).
        let lanes: Vec<Lane> = (0..KEYS)
            .map(|k| lane_of_key(&format!("hot-{k}"), s.lanes()))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let mut after: HashMap<Lane, ClaimCursor> =
            lanes.iter().map(|l| (*l, ClaimCursor::default())).collect();
        let mut seen_events: HashSet<String> = HashSet::new();
        let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
        loop {
            let claims: Vec<LaneClaim> = lanes
                .iter()
                .map(|l| LaneClaim {
                    lane: *l,
                    epoch: Epoch(0),
                    after: after[l].clone(),
                    limit: 200,
                })
                .collect();
            let batches = s.claim(&claims).await.expect("claim");
            let mut refs = Vec::new();
            for b in &batches {
                after.insert(b.lane, b.next_after.clone());
                for d in &b.deliveries {
                    assert!(
                        seen_events.insert(d.event_id.clone()),
                        "{} delivered twice",
                        d.event_id
                    );
                    per_key
                        .entry(d.key.clone().expect("keyed"))
                        .or_default()
                        .push(d.seq.expect("seq"));
                    refs.push(dref(d, Epoch(0), 1));
                }
            }
            if refs.is_empty() {
                break;
            }
            for chunk in refs.chunks(500) {
                assert_eq!(
                    s.complete(chunk).await.expect("complete").len(),
                    chunk.len()
                );
            }
        }
        assert_eq!(seen_events.len(), total, "every event delivered once");
        assert_eq!(per_key.len(), KEYS);
        for (key, seqs) in &per_key {
            let n = seqs.len() as i64;
            assert_eq!(
                seqs,
                &(1..=n).collect::<Vec<_>>(),
                "{key}: gapless, no duplicate, claimed in sequence order"
            );
        }
        let c = counts(&*s).await;
        assert_eq!((c.deliveries, c.completions), (0, total as i64));
        eprintln!(
            "8 x 2,000 events on 10 keys published in {publish_secs:.1} s ({:.0} events/s)",
            total as f64 / publish_secs
        );
        h.cleanup().await;
    }

    /// `publish_in` inside the caller's transaction: an abort leaves
    /// nothing (no event, no delivery, no sequence number taken); a commit
    /// is claimable.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publish_in_aborted_leaves_nothing_committed_is_claimable() {
        let h = MongoHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let client = h.store.client().clone();
        let app = h
            .store
            .database()
            .collection::<::mongodb::bson::Document>("orders");

        let mut session = client.start_session().await.expect("session");
        session.start_transaction().await.expect("begin");
        app.insert_one(doc! { "_id": "order-1" })
            .session(&mut session)
            .await
            .expect("app write");
        let out = h
            .store
            .publish_in(
                &mut session,
                vec![ev(Some("aborted"), "order.created", Some("o"))],
            )
            .await
            .expect("publish_in");
        assert_eq!(out.accepted, 1);
        session.abort_transaction().await.expect("abort");
        assert_eq!(
            counts(&*s).await,
            StoreCounts::default(),
            "aborted: nothing stored"
        );
        assert!(claim_all(&*s).await.is_empty());
        assert_eq!(app.count_documents(doc! {}).await.expect("count"), 0);

        session.start_transaction().await.expect("begin");
        app.insert_one(doc! { "_id": "order-2" })
            .session(&mut session)
            .await
            .expect("app write");
        h.store
            .publish_in(
                &mut session,
                vec![ev(Some("committed"), "order.created", Some("o"))],
            )
            .await
            .expect("publish_in");
        session.commit_transaction().await.expect("commit");
        let ds = claim_all(&*s).await;
        assert_eq!(
            ds.iter()
                .map(|d| (d.event_id.as_str(), d.seq))
                .collect::<Vec<_>>(),
            vec![("committed", Some(1))],
            "committed is claimable; the aborted one gave its number back"
        );
        assert_eq!(app.count_documents(doc! {}).await.expect("count"), 1);
        h.cleanup().await;
    }

    /// The late-commit pitfall: a publish transaction into a lane held open
    /// while another publish (into another lane) commits and a claim reads.
    /// A second publisher into the held lane cannot commit before the held
    /// one (it write-conflicts and retries), so the cursor of the held lane
    /// cannot move past the held transaction's positions.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claim_cursor_does_not_skip_a_late_commit() {
        let h = MongoHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let lane = lane_of_event(None, "late", s.lanes());
        let same_lane = (0..)
            .map(|i| format!("early-{i}"))
            .find(|id| lane_of_event(None, id, s.lanes()) == lane)
            .expect("an id in the lane");
        let other_lane = (0..)
            .map(|i| format!("other-{i}"))
            .find(|id| lane_of_event(None, id, s.lanes()) != lane)
            .expect("an id in another lane");

        let mut held = h.store.client().start_session().await.expect("session");
        held.start_transaction().await.expect("begin");
        h.store
            .publish_in(&mut held, vec![ev(Some("late"), "t.x", None)])
            .await
            .expect("publish_in");

        // Another lane commits while the held transaction is open.
        s.publish(vec![ev(Some(&other_lane), "t.x", None)])
            .await
            .expect("publish into another lane");
        // A publisher into the same lane has to wait for the held one.
        let blocked = {
            let s = s.clone();
            let id = same_lane.clone();
            tokio::spawn(async move { s.publish(vec![ev(Some(&id), "t.x", None)]).await })
        };
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !blocked.is_finished(),
            "a publish into the held lane committed before the held transaction"
        );
        let first = s
            .claim(&one_lane_claim(lane, Epoch(0), 0, 100))
            .await
            .expect("claim");
        assert!(
            first[0].deliveries.is_empty(),
            "nothing of the lane is visible yet: {:?}",
            first[0].deliveries
        );

        held.commit_transaction()
            .await
            .expect("commit the late publish");
        blocked
            .await
            .expect("join")
            .expect("the waiting publish succeeds after the held one");
        let second = s
            .claim(&one_lane_claim(
                lane,
                Epoch(0),
                first[0].next_after.clone(),
                100,
            ))
            .await
            .expect("claim");
        assert_eq!(
            second[0]
                .deliveries
                .iter()
                .map(|d| d.event_id.as_str())
                .collect::<Vec<_>>(),
            vec!["late", same_lane.as_str()],
            "the cursor skipped the late commit, or read out of commit order"
        );
        h.cleanup().await;
    }

    /// A deposed owner's completion that meets a fence in progress (an epoch
    /// raise held open in a transaction) changes nothing once the fence
    /// commits (invariant 4): its transaction's write of the lane document
    /// conflicts with the fence, and its retry sees the new epoch.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_completion_meeting_a_fence_in_progress_changes_nothing() {
        let h = MongoHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let lane = lane_of_key("race", s.lanes());
        assert!(s.fence(lane, "n1", Epoch(1)).await.expect("fence"));
        s.publish(vec![
            ev(Some("r1"), "t.x", Some("race")),
            ev(Some("r2"), "t.x", Some("race")),
        ])
        .await
        .expect("publish");
        let b = s
            .claim(&one_lane_claim(lane, Epoch(1), 0, 10))
            .await
            .expect("claim");
        let (d1, d2) = (b[0].deliveries[0].clone(), b[0].deliveries[1].clone());

        let lanes = h
            .store
            .database()
            .collection::<::mongodb::bson::Document>("lanes");
        let mut fence_tx = h.store.client().start_session().await.expect("session");
        fence_tx.start_transaction().await.expect("begin");
        lanes
            .update_one(
                doc! { "_id": i32::from(lane) },
                doc! { "$set": { "epoch": 2i64, "owner": "n2" } },
            )
            .session(&mut fence_tx)
            .await
            .expect("fence in a held transaction");
        let stale = {
            let s = s.clone();
            tokio::spawn(async move {
                let done = s.complete(&[dref(&d1, Epoch(1), 1)]).await;
                let dead = s
                    .dead_letter(&[DeadLetterRequest {
                        id: d2.id,
                        lane,
                        epoch: Epoch(1),
                        attempts: 8,
                        last_error: "stale".into(),
                        failure: None,
                    }])
                    .await;
                (done, dead)
            })
        };
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !stale.is_finished(),
            "the completion did not wait for the fence in progress"
        );
        fence_tx
            .commit_transaction()
            .await
            .expect("commit the fence");
        let (done, dead) = stale.await.expect("join");
        assert!(
            done.expect("complete").is_empty(),
            "a completion at epoch 1 changed rows after epoch 2 committed"
        );
        assert!(dead.expect("dead letter").is_empty());
        let c = counts(&*s).await;
        assert_eq!((c.deliveries, c.completions, c.dead_letters), (2, 0, 0));

        // The deliveries are intact for the next owner.
        assert!(s.fence(lane, "n3", Epoch(3)).await.expect("fence"));
        let b = s
            .claim(&one_lane_claim(lane, Epoch(3), 0, 10))
            .await
            .expect("claim");
        assert_eq!(b[0].deliveries.len(), 2);
        h.cleanup().await;
    }

    /// A store on a new database whose client records every command it
    /// sends (driver command events), and the record.
    async fn monitored_store(
        lanes: u16,
    ) -> (
        lanebus_store::mongodb::MongoStore,
        Arc<std::sync::Mutex<Vec<Document>>>,
    ) {
        use ::mongodb::event::{command::CommandEvent, EventHandler};

        let db = format!("lanebus_t_{}", uuid::Uuid::new_v4().simple());
        let url = with_database(&mongo_base_url(), &db);
        let seen: Arc<std::sync::Mutex<Vec<Document>>> = Arc::default();
        let mut options = ::mongodb::options::ClientOptions::parse(&url)
            .await
            .expect("url");
        let log = seen.clone();
        options.command_event_handler = Some(EventHandler::callback(move |e| {
            if let CommandEvent::Started(c) = e {
                log.lock().expect("lock").push(c.command);
            }
        }));
        let client = ::mongodb::Client::with_options(options).expect("client");
        let store = lanebus_store::mongodb::MongoStore::with_client(client, &db, lanes)
            .await
            .expect("open");
        (store, seen)
    }

    /// Issue 18 item 6: a fence is confirmed with a majority read. The
    /// test server has one member, so no rollback can be staged; what it
    /// checks is what the driver sends: the lane `update` at write concern
    /// majority, then the `find` of the lane at read concern majority, in
    /// the same session and after the update's cluster time (so the read
    /// sees the write). Before, the `find` read at the default (local)
    /// level, which can return a lane document a rollback takes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn fence_is_confirmed_with_a_majority_read() {
        let (store, seen) = monitored_store(8).await;
        seen.lock().expect("lock").clear();
        assert!(store.fence(3, "n1", Epoch(1)).await.expect("fence"));
        assert!(!store
            .fence(3, "n2", Epoch(1))
            .await
            .expect("fence, same epoch"));
        let commands: Vec<Document> = std::mem::take(&mut *seen.lock().expect("lock"))
            .into_iter()
            .filter(|c| c.get_str("update") == Ok("lanes") || c.get_str("find") == Ok("lanes"))
            .collect();
        assert_eq!(commands.len(), 4, "{commands:?}");
        for pair in commands.chunks(2) {
            let (update, find) = (&pair[0], &pair[1]);
            assert!(update.contains_key("update"), "{update}");
            let w = update
                .get_document("writeConcern")
                .unwrap_or_else(|_| panic!("update without a write concern: {update}"));
            assert_eq!(w.get_str("w"), Ok("majority"), "{update}");
            assert!(find.contains_key("find"), "{find}");
            let r = find
                .get_document("readConcern")
                .unwrap_or_else(|_| panic!("find without a read concern: {find}"));
            assert_eq!(r.get_str("level"), Ok("majority"), "{find}");
            assert!(
                r.contains_key("afterClusterTime"),
                "not causally after the update: {find}"
            );
            assert_eq!(
                update.get("lsid"),
                find.get("lsid"),
                "one session: {update} {find}"
            );
        }
        store.database().drop().await.expect("drop");
    }

    /// Round trips per operation, counted from the driver's command events
    /// (what the `mongodb` module docs quote): a publish of 100 keyed events
    /// to 2 handlers, a claim of 10 lanes, a completion of 200 deliveries.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn round_trips_per_publish_claim_and_complete() {
        let (store, seen) = monitored_store(DEFAULT_LANES).await;
        handler(&store, "a", &["*"]).await;
        handler(&store, "b", &["t.*"]).await;
        let take = || -> Vec<String> {
            std::mem::take(&mut *seen.lock().expect("lock"))
                .iter()
                .filter_map(|c| c.keys().next().cloned())
                .collect()
        };
        take();

        let events: Vec<NewEvent> = (0..100)
            .map(|i| {
                ev(
                    Some(&format!("rt-{i}")),
                    "t.x",
                    Some(&format!("key-{}", i % 10)),
                )
            })
            .collect();
        store.publish(events).await.expect("publish");
        let publish = take();
        // Again on the same keys: the counters exist now (update, not insert).
        let events: Vec<NewEvent> = (0..100)
            .map(|i| ev(None, "t.x", Some(&format!("key-{}", i % 10))))
            .collect();
        store.publish(events).await.expect("publish");
        let publish_again = take();
        let lanes: Vec<Lane> = (0..10)
            .map(|k| lane_of_key(&format!("key-{k}"), store.lanes()))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let claims: Vec<LaneClaim> = lanes
            .iter()
            .map(|l| LaneClaim {
                lane: *l,
                epoch: Epoch(0),
                after: Default::default(),
                limit: 1000,
            })
            .collect();
        let batches = store.claim(&claims).await.expect("claim");
        let claim = take();
        let refs: Vec<DeliveryRef> = batches
            .iter()
            .flat_map(|b| b.deliveries.iter().map(|d| dref(d, Epoch(0), 1)))
            .collect();
        assert_eq!(refs.len(), 400);
        let refs = &refs[..200];
        assert_eq!(store.complete(refs).await.expect("complete").len(), 200);
        let complete = take();
        eprintln!(
            "round trips: publish of 100 events x 2 handlers {} {publish:?}; again, generated ids {} \
             {publish_again:?}; claim of {} lanes {} {claim:?}; complete of 200 {} {complete:?}",
            publish.len(),
            publish_again.len(),
            lanes.len(),
            claim.len(),
            complete.len()
        );
        assert!(publish.len() <= 8, "publish: {publish:?}");
        assert!(publish_again.len() <= 7, "publish: {publish_again:?}");
        assert!(claim.len() <= 3, "claim: {claim:?}");
        assert!(complete.len() <= 6, "complete: {complete:?}");
        let _ = store.database().drop().await;
    }

    /// The change stream wakes a subscriber on publish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn publish_wakes_a_change_stream_subscriber() {
        let h = MongoHarness::new().await;
        let s = h.store();
        handler(&*s, "all", &["*"]).await;
        let Wakeups::Push(mut rx) = s.wakeups().await.expect("wakeups") else {
            panic!("the test server offers change streams: expected Wakeups::Push");
        };
        s.publish(vec![ev(Some("wake"), "t.x", None)])
            .await
            .expect("publish");
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("a wake-up within 10 s")
            .expect("channel open");
        h.cleanup().await;
    }

    /// `lanebus_store::open` accepts mongodb URLs (what `lanebus node
    /// --store mongodb://...` uses), and migrating again is idempotent.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn open_takes_mongodb_urls_and_migrate_is_idempotent() {
        let h = MongoHarness::new().await;
        let s = lanebus_store::open(&h.url).await.expect("open");
        assert_eq!(s.backend(), "mongodb");
        assert_eq!(s.lanes(), DEFAULT_LANES);
        h.store.migrate().await.expect("migrate again");
        h.store.migrate().await.expect("and again");
        assert_eq!(s.lane_rows().await.expect("lanes").len(), 256);
        s.ping().await.expect("ping");
        h.cleanup().await;
    }

    /// An expectation below the key's committed number is refused at once,
    /// while another transaction holds the key's counter. Before, the
    /// publish raised the counter first and checked after: it met the open
    /// writer's write conflict and retried until that writer ended (or for
    /// 60 s), so under many writers of one key the stale ones kept the
    /// counter busy and a current one could run out of retries.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_stale_expectation_does_not_wait_for_an_open_writer() {
        let h = MongoHarness::new().await;
        let s: Arc<dyn Store> = h.store.clone();
        handler(&*s, "all", &["*"]).await;
        s.publish(vec![at("k1", "k", Some(0))])
            .await
            .expect("k at 1");
        let mut session = h.store.client().start_session().await.expect("session");
        session.start_transaction().await.expect("start");
        h.store
            .publish_in(&mut session, vec![at("k2", "k", Some(1))])
            .await
            .expect("the open writer raises k's counter");
        let stale = tokio::time::timeout(
            Duration::from_secs(20),
            s.publish(vec![at("late", "k", Some(0))]),
        )
        .await
        .expect("a stale expectation answered while the writer is open");
        assert!(
            matches!(&stale, Err(StoreError::SeqConflict { key, expected: 0, current: 1, index: 0, at: 1 }) if key == "k"),
            "{stale:?}"
        );
        session.commit_transaction().await.expect("commit");
        let ds = claim_all(&*s).await;
        assert_eq!(seqs_of_key(&ds, "k"), vec![1, 2]);
        assert_eq!(counts(&*s).await.events, 2, "nothing of the stale publish");
        h.cleanup().await;
    }

    /// The change stream's wake-ups name the lanes that got deliveries, as
    /// PostgreSQL's do, so a node claims those lanes and not every lane.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn wake_ups_name_the_lanes_published_into() {
        let h = MongoHarness::new().await;
        let s: Arc<dyn Store> = h.store.clone();
        handler(&*s, "t", &["t.*"]).await;
        let Wakeups::Push(mut rx) = s.wakeups().await.expect("wakeups") else {
            panic!("the test server offers change streams");
        };
        // What the stream reports of the handler's setup, if anything.
        tokio::time::sleep(Duration::from_millis(500)).await;
        while rx.try_recv().is_some() {}
        s.publish(vec![ev(Some("keyed"), "t.x", Some("order-7"))])
            .await
            .expect("publish");
        let woken = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("a wake-up within 20 s")
            .expect("channel open");
        let lane = lane_of_key("order-7", s.lanes());
        assert_eq!(woken, wake::Woken::Lanes([lane].into()));
        h.cleanup().await;
    }
}

async fn deliver_at_sets_the_first_due_time(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["*"]).await;
    let at = Utc::now() + chrono::TimeDelta::hours(1);
    let mut later = ev(Some("late"), "t.x", Some("k"));
    later.deliver_at = Some(at);
    let before = Utc::now();
    s.publish(vec![later, ev(Some("next"), "t.x", Some("k"))])
        .await
        .expect("publish");
    let ds = claim_all(&*s).await;
    let late = ds.iter().find(|d| d.event_id == "late").expect("late");
    let next = ds.iter().find(|d| d.event_id == "next").expect("next");
    // Microseconds round-trip on every backend.
    assert_eq!(late.due_at.timestamp_micros(), at.timestamp_micros());
    assert!(next.due_at <= Utc::now() && next.due_at >= before - chrono::TimeDelta::seconds(5));
    assert_eq!((late.seq, next.seq), (Some(1), Some(2)));
    assert!(!late.replay && !next.replay);

    // More than MAX_DELIVER_AHEAD ahead: the whole batch is refused.
    let mut far = ev(Some("far"), "t.x", None);
    far.deliver_at = Some(Utc::now() + MAX_DELIVER_AHEAD + chrono::TimeDelta::minutes(1));
    let err = s
        .publish(vec![ev(Some("ok"), "t.x", None), far])
        .await
        .expect_err("too far ahead");
    assert!(
        matches!(&err, StoreError::Invalid(m) if m.contains("deliver_at")),
        "{err}"
    );
    assert_eq!(counts(&*s).await.events, 2);
}

/// Dead-letters `ds` one call each, in the given order.
async fn dead_letter_each(s: &dyn Store, ds: &[&Delivery]) {
    for d in ds {
        let moved = s
            .dead_letter(&[DeadLetterRequest {
                id: d.id,
                lane: d.lane,
                epoch: Epoch(0),
                attempts: 1,
                last_error: "boom".into(),
                failure: None,
            }])
            .await
            .expect("dead letter");
        assert_eq!(moved, vec![d.id]);
    }
}

async fn dead_letters_are_replayed_by_time_range_in_key_order(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    let b = handler(&*s, "b", &["other"]).await;
    s.publish(vec![
        ev(Some("e1"), "t.x", Some("k")),
        ev(Some("e2"), "t.x", Some("k")),
        ev(Some("e3"), "t.x", Some("k")),
        ev(Some("early"), "t.x", None),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let by = |id: &str| ds.iter().find(|d| d.event_id == id).expect("claimed");
    dead_letter_each(&*s, &[by("early")]).await;
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let t = Utc::now();
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    // Dead letters of one key created out of sequence order.
    dead_letter_each(&*s, &[by("e3"), by("e1"), by("e2")]).await;

    // Another handler's window is empty; an unknown handler replays nothing.
    assert_eq!(
        s.replay_dead_letters_between(&b.id, Some(t), None)
            .await
            .expect("replay"),
        0
    );
    assert_eq!(
        s.replay_dead_letters_between("hdl_00000000000000000000000000000000", None, None)
            .await
            .expect("replay"),
        0
    );
    let before = s.lane_rows().await.expect("lanes");
    assert_eq!(
        s.replay_dead_letters_between(&a.id, Some(t), None)
            .await
            .expect("replay since"),
        3
    );
    assert_eq!(counts(&*s).await.dead_letters, 1, "the early one stays");
    // Claimed in delivery-id order per lane, a key's replays come in
    // sequence order.
    let claims: Vec<LaneClaim> = before
        .iter()
        .map(|r| LaneClaim {
            lane: r.lane,
            epoch: r.epoch,
            after: Default::default(),
            limit: 100,
        })
        .collect();
    let again: Vec<Delivery> = s
        .claim(&claims)
        .await
        .expect("claim")
        .into_iter()
        .flat_map(|b| b.deliveries)
        .collect();
    assert_eq!(seqs_of_key(&again, "k"), vec![1, 2, 3]);
    assert!(again.iter().all(|d| d.attempts == 0 && !d.replay));
    assert_eq!(
        s.replay_dead_letters_between(&a.id, None, Some(t))
            .await
            .expect("replay until"),
        1
    );
    assert_eq!(counts(&*s).await.dead_letters, 0);
}

async fn recover_puts_completed_events_back_as_replays(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    let b = handler(&*s, "b", &["*"]).await;
    s.publish(vec![
        ev(Some("r1"), "t.x", Some("k")),
        ev(Some("r2"), "t.x", Some("k")),
        ev(Some("r3"), "t.x", Some("k")),
        ev(Some("r4"), "t.x", Some("k")),
        ev(Some("u1"), "t.x", None),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let of = |h: &Handler, ids: &[&str]| -> Vec<DeliveryRef> {
        ds.iter()
            .filter(|d| d.handler_id == h.id && ids.contains(&d.event_id.as_str()))
            .map(|d| dref(d, Epoch(0), 1))
            .collect()
    };
    s.complete(&of(&a, &["r1"])).await.expect("complete");
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let t = Utc::now();
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    s.complete(&of(&a, &["r2", "r3", "u1"]))
        .await
        .expect("complete");
    s.complete(&of(&b, &["r1", "r2", "r3", "r4", "u1"]))
        .await
        .expect("complete");
    // r4 is still pending for a.

    let out = s.recover(&a.id, t).await.expect("recover");
    assert_eq!(
        out,
        RecoverOutcome {
            recovered: 3,
            already_pending: 0,
            pruned: 0
        }
    );
    let all = claim_all(&*s).await;
    let mut back: Vec<&Delivery> = all.iter().filter(|d| d.replay).collect();
    back.sort_by_key(|d| d.event_id.clone());
    assert_eq!(
        back.iter().map(|d| d.event_id.as_str()).collect::<Vec<_>>(),
        vec!["r2", "r3", "u1"]
    );
    for d in &back {
        assert_eq!(d.handler_id, a.id);
        assert_eq!(d.attempts, 0);
        assert_eq!(d.payload.as_ref(), br#"{"n":1}"#);
    }
    assert_eq!(
        seqs_of_key(&back.iter().map(|d| (*d).clone()).collect::<Vec<_>>(), "k"),
        vec![2, 3]
    );
    assert!(
        all.iter().any(|d| d.event_id == "r4" && !d.replay),
        "the pending one is untouched"
    );
    // Asked again before they are delivered: nothing doubles.
    let again = s.recover(&a.id, t).await.expect("recover");
    assert_eq!((again.recovered, again.already_pending), (0, 3));
    // Delivered again (a second completion each), then recovered once more:
    // each event once.
    let refs: Vec<DeliveryRef> = back.iter().map(|d| dref(d, Epoch(0), 1)).collect();
    assert_eq!(s.complete(&refs).await.expect("complete").len(), 3);
    let third = s.recover(&a.id, t).await.expect("recover");
    assert_eq!((third.recovered, third.already_pending), (3, 0));
    // Before anything completed: r1 too.
    let c_before = counts(&*s).await;
    let all_of_b = s
        .recover(&b.id, t - chrono::TimeDelta::seconds(10))
        .await
        .expect("recover b");
    assert_eq!(all_of_b.recovered, 5);
    assert_eq!(counts(&*s).await.deliveries, c_before.deliveries + 5);
    let err = s
        .recover("hdl_00000000000000000000000000000000", t)
        .await
        .expect_err("unknown handler");
    assert!(matches!(err, StoreError::NotFound(_)), "{err}");
}

/// An event completed long after its publish (a disabled handler, retries,
/// `deliver_at`) is kept for the retention period after that completion,
/// so a recovery since then finds it.
async fn retention_counts_from_the_last_completion(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    s.publish(vec![
        ev(Some("prompt"), "t.x", Some("k")),
        ev(Some("late"), "t.x", Some("k2")),
        ev(Some("retried"), "t.x", Some("k3")),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let by = |id: &str| ds.iter().find(|d| d.event_id == id).expect("claimed");
    s.complete(&[dref(by("prompt"), Epoch(0), 1)])
        .await
        .expect("complete prompt");
    // Two hours pass; "late" is still pending; then it completes. "retried"
    // failed and is due again now (its due time is no longer its publish
    // time); then it completes.
    h.age(chrono::TimeDelta::hours(2)).await;
    let r = Reschedule {
        id: by("retried").id,
        lane: by("retried").lane,
        epoch: Epoch(0),
        attempts: 5,
        due_at: Utc::now(),
        last_error: "HTTP 500".into(),
        failure: None,
    };
    assert_eq!(s.reschedule(&[r]).await.expect("reschedule").len(), 1);
    s.complete(&[
        dref(by("late"), Epoch(0), 1),
        dref(by("retried"), Epoch(0), 6),
    ])
    .await
    .expect("complete late");

    // A one-hour retention: "prompt" (published and completed two hours
    // ago) goes; "late" and "retried" (published two hours ago, completed
    // now) stay.
    let cutoff = Utc::now() - chrono::TimeDelta::hours(1);
    assert_eq!(
        s.prune(cutoff, 100).await.expect("prune"),
        Pruned {
            completions: 1,
            events: 1
        }
    );
    assert_eq!(
        counts(&*s).await.events,
        2,
        "the late-completed events are kept"
    );
    let out = s.recover(&a.id, cutoff).await.expect("recover");
    assert_eq!(
        out,
        RecoverOutcome {
            recovered: 2,
            already_pending: 0,
            pruned: 0
        },
        "a recovery since the cutoff finds the late-completed events"
    );
    let back = claim_all(&*s).await;
    let mut ids: Vec<(&str, bool)> = back
        .iter()
        .map(|d| (d.event_id.as_str(), d.replay))
        .collect();
    ids.sort();
    assert_eq!(ids, vec![("late", true), ("retried", true)]);
    let refs: Vec<DeliveryRef> = back.iter().map(|d| dref(d, Epoch(0), 1)).collect();
    assert_eq!(s.complete(&refs).await.expect("complete replays").len(), 2);
    // Past their last completion's retention too, they go.
    let later = Utc::now() + chrono::TimeDelta::minutes(5);
    let gone = s.prune(later, 100).await.expect("prune");
    assert_eq!(gone.events, 2, "{gone:?}");
    assert_eq!(counts(&*s).await.events, 0);
}

/// Old events kept by a pending delivery must not stop the pruning of
/// later, unneeded events, however many there are: successive batches (a
/// node runs a pass a minute) reach them. MongoDB read the kept ones from
/// the oldest on in every batch, a few rounds of them, and pruned nothing
/// more once they filled those rounds (found in review).
async fn prune_passes_over_many_kept_events(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "a", &["t.*"]).await;
    // 17 kept events (a pending delivery each): more than 8 rounds of a
    // batch of 2.
    let kept: Vec<NewEvent> = (0..17)
        .map(|i| ev(Some(&format!("kept{i}")), "t.x", None))
        .collect();
    s.publish(kept).await.expect("publish kept");
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    // Published later, matches no handler: nothing needs it.
    s.publish(vec![ev(Some("free"), "u.y", None)])
        .await
        .expect("publish free");
    let cutoff = Utc::now() + chrono::TimeDelta::minutes(5);
    let mut events = 0;
    for _batch in 0..10 {
        events += s.prune(cutoff, 2).await.expect("prune").events;
    }
    assert_eq!(events, 1, "the unneeded event is pruned");
    assert_eq!(counts(&*s).await.events, 17, "the kept ones are kept");
}

async fn prune_removes_old_completed_events_and_keeps_pending_and_dead(h: &dyn Harness) {
    let s = h.store();
    let a = handler(&*s, "a", &["*"]).await;
    s.publish(vec![
        ev(Some("done1"), "t.x", Some("k")),
        ev(Some("done2"), "t.x", None),
        ev(Some("done3"), "t.x", None),
        ev(Some("pending"), "t.x", Some("k")),
        ev(Some("dead"), "t.x", None),
    ])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let by = |id: &str| ds.iter().find(|d| d.event_id == id).expect("claimed");
    let done: Vec<DeliveryRef> = ["done1", "done2", "done3"]
        .iter()
        .map(|id| dref(by(id), Epoch(0), 1))
        .collect();
    s.complete(&done).await.expect("complete");
    dead_letter_each(&*s, &[by("dead")]).await;
    let since = Utc::now() - chrono::TimeDelta::seconds(60);

    // Nothing is old enough yet.
    let past = Utc::now() - chrono::TimeDelta::hours(1);
    assert_eq!(s.prune(past, 100).await.expect("prune"), Pruned::default());

    // Everything published until five minutes from now is "old" (an event
    // is kept two minutes past the cutoff; see the late-completion test):
    // batches of 2.
    let cutoff = Utc::now() + chrono::TimeDelta::minutes(5);
    let first = s.prune(cutoff, 2).await.expect("prune");
    assert_eq!(
        first,
        Pruned {
            completions: 2,
            events: 2
        }
    );
    let second = s.prune(cutoff, 2).await.expect("prune");
    assert_eq!(
        second,
        Pruned {
            completions: 1,
            events: 1
        }
    );
    assert_eq!(s.prune(cutoff, 2).await.expect("prune"), Pruned::default());
    let c = counts(&*s).await;
    assert_eq!(
        (c.events, c.completions, c.deliveries, c.dead_letters),
        (2, 0, 1, 1)
    );

    // The pending delivery is still claimable with its event, the dead
    // letter still names its event's type.
    let left = claim_all(&*s).await;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].event_id, "pending");
    assert_eq!(left[0].payload.as_ref(), br#"{"n":1}"#);
    let dead = s
        .list_dead_letters(&DeadLetterFilter {
            handler_id: Some(a.id.clone()),
            after_id: None,
            limit: 10,
        })
        .await
        .expect("list");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].event_type, "t.x");
    // A recovery after the prune finds nothing left to deliver.
    let out = s.recover(&a.id, since).await.expect("recover");
    assert_eq!(out, RecoverOutcome::default());
    // The dead letter replayed and completed: its event goes too.
    assert_eq!(
        s.replay_dead_letters(&[], Some(&a.id))
            .await
            .expect("replay"),
        1
    );
    let all = claim_all(&*s).await;
    let refs: Vec<DeliveryRef> = all.iter().map(|d| dref(d, Epoch(0), 1)).collect();
    assert_eq!(s.complete(&refs).await.expect("complete").len(), 2);
    let cutoff = Utc::now() + chrono::TimeDelta::minutes(5);
    assert_eq!(
        s.prune(cutoff, 100).await.expect("prune"),
        Pruned {
            completions: 2,
            events: 2
        }
    );
    assert_eq!(counts(&*s).await.events, 0);
    // An id pruned may be published again as new.
    let again = s
        .publish(vec![ev(Some("done1"), "t.x", None)])
        .await
        .expect("publish");
    assert_eq!(again.accepted, 1);
}

/// The store's clock, truncated to the microseconds every backend stores.
async fn store_now(s: &dyn Store) -> DateTime<Utc> {
    let now = s.now().await.expect("now");
    DateTime::from_timestamp_micros(now.timestamp_micros()).expect("time")
}

async fn lookup_event_shows_each_handlers_delivery_state(h: &dyn Harness) {
    let s = h.store();
    let pending = handler(&*s, "pending", &["t.*"]).await;
    let done = handler(&*s, "done", &["t.*"]).await;
    let dead = handler(&*s, "dead", &["t.lookup"]).await;
    handler(&*s, "elsewhere", &["other.*"]).await;
    let payload = br#"{"order":42,"note":"seventeen bytes+"}"#.to_vec();
    s.publish(vec![
        NewEvent {
            payload: payload.clone(),
            ..ev(Some("lk1"), "t.lookup", Some("k"))
        },
        // Same key, so same lane: its records must not show in lk1's lookup.
        ev(Some("lk2"), "t.lookup", Some("k")),
    ])
    .await
    .expect("publish");
    assert_eq!(s.lookup_event("lk-none").await.expect("lookup"), None);

    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 6, "two events to three handlers");
    let of = |handler: &Handler, event: &str| -> Delivery {
        ds.iter()
            .find(|d| d.handler_id == handler.id && d.event_id == event)
            .expect("delivery")
            .clone()
    };
    let fresh = s
        .lookup_event("lk1")
        .await
        .expect("lookup")
        .expect("stored");
    let d = of(&pending, "lk1");
    assert_eq!(
        (
            fresh.id.as_str(),
            fresh.event_type.as_str(),
            fresh.key.as_deref(),
            fresh.seq,
            fresh.lane,
            fresh.published_at,
            fresh.payload_bytes,
        ),
        (
            "lk1",
            "t.lookup",
            Some("k"),
            Some(1),
            d.lane,
            d.published_at,
            payload.len() as u64
        )
    );
    let mut ids = vec![pending.id.clone(), done.id.clone(), dead.id.clone()];
    ids.sort();
    let listed: Vec<&str> = fresh
        .handlers
        .iter()
        .map(|h| h.handler_id.as_str())
        .collect();
    assert_eq!(listed, ids, "one entry per matching handler, by id");
    for entry in &fresh.handlers {
        assert_eq!(
            entry.state,
            DeliveryState::Pending {
                attempts: 0,
                due_at: d.due_at,
                last_error: None,
                attempt_log: vec![],
            },
            "{entry:?}"
        );
    }

    let due = DateTime::from_timestamp_micros(
        (Utc::now() + chrono::Duration::seconds(90)).timestamp_micros(),
    )
    .expect("time");
    let rescheduled = s
        .reschedule(&[Reschedule {
            id: d.id,
            lane: d.lane,
            epoch: Epoch(0),
            attempts: 2,
            due_at: due,
            last_error: "HTTP 503 from endpoint".into(),
            failure: None,
        }])
        .await
        .expect("reschedule");
    assert_eq!(rescheduled, vec![d.id]);
    let before = store_now(&*s).await;
    let c = of(&done, "lk1");
    assert_eq!(
        s.complete(&[dref(&c, Epoch(0), 3)])
            .await
            .expect("complete"),
        vec![c.id]
    );
    let x = of(&dead, "lk1");
    let moved = s
        .dead_letter(&[DeadLetterRequest {
            id: x.id,
            lane: x.lane,
            epoch: Epoch(0),
            attempts: 8,
            last_error: "HTTP 410 from endpoint".into(),
            failure: None,
        }])
        .await
        .expect("dead letter");
    assert_eq!(moved, vec![x.id]);
    // lk2's deliveries end otherwise, so a lookup mixing events shows.
    let other: Vec<DeliveryRef> = [&pending, &done]
        .iter()
        .map(|h| dref(&of(h, "lk2"), Epoch(0), 1))
        .collect();
    assert_eq!(s.complete(&other).await.expect("complete").len(), 2);
    let after = store_now(&*s).await + chrono::Duration::microseconds(1);

    let got = s
        .lookup_event("lk1")
        .await
        .expect("lookup")
        .expect("stored");
    assert_eq!(got.published_at, fresh.published_at);
    assert_eq!(got.payload_bytes, payload.len() as u64);
    let entry = |handler: &Handler| -> HandlerDelivery {
        got.handlers
            .iter()
            .find(|e| e.handler_id == handler.id)
            .unwrap_or_else(|| panic!("{} listed: {got:?}", handler.name))
            .clone()
    };
    assert_eq!(got.handlers.len(), 3, "{got:?}");
    assert_eq!(
        entry(&pending),
        HandlerDelivery {
            handler_id: pending.id.clone(),
            handler_name: Some("pending".into()),
            state: DeliveryState::Pending {
                attempts: 2,
                due_at: due,
                last_error: Some("HTTP 503 from endpoint".into()),
                attempt_log: vec![],
            },
        }
    );
    let e = entry(&done);
    assert_eq!(e.handler_name.as_deref(), Some("done"));
    match e.state {
        DeliveryState::Completed {
            completed_at,
            attempts,
        } => {
            assert_eq!(attempts, 3);
            assert!(
                before <= completed_at && completed_at <= after,
                "completed at {completed_at}, between {before} and {after}"
            );
        }
        other => panic!("done: {other:?}"),
    }
    let e = entry(&dead);
    assert_eq!(e.handler_name.as_deref(), Some("dead"));
    match e.state {
        DeliveryState::DeadLettered {
            failed_at,
            attempts,
            last_error,
            ..
        } => {
            assert_eq!(
                (attempts, last_error.as_str()),
                (8, "HTTP 410 from endpoint")
            );
            assert!(
                before <= failed_at && failed_at <= after,
                "failed at {failed_at}, between {before} and {after}"
            );
        }
        other => panic!("dead: {other:?}"),
    }

    // A deleted handler's completions stay, without a name; its dead
    // letters go with it.
    s.delete_handler(&done.id).await.expect("delete");
    s.delete_handler(&dead.id).await.expect("delete");
    let got = s
        .lookup_event("lk1")
        .await
        .expect("lookup")
        .expect("stored");
    let listed: Vec<(&str, Option<&str>)> = got
        .handlers
        .iter()
        .map(|e| (e.handler_id.as_str(), e.handler_name.as_deref()))
        .collect();
    let mut want = vec![
        (pending.id.as_str(), Some("pending")),
        (done.id.as_str(), None),
    ];
    want.sort();
    assert_eq!(listed, want);
}

/// An event published with a generated id, delivered and pruned past
/// retention is no longer found; its id, a UUIDv7, still tells when it was
/// published (what `GET /v1/events/{id}` answers `410 pruned` by). An event
/// of the same publish that still has a pending delivery is kept.
async fn lookup_of_a_pruned_event_finds_none(h: &dyn Harness) {
    let s = h.store();
    let hd = handler(&*s, "h", &["t.*"]).await;
    let out = s
        .publish(vec![ev(None, "t.done", None), ev(None, "t.waiting", None)])
        .await
        .expect("publish");
    let [done, waiting] = [out.ids[0].clone(), out.ids[1].clone()];
    let ds = claim_all(&*s).await;
    let d = ds
        .iter()
        .find(|d| d.event_id == done && d.handler_id == hd.id)
        .expect("delivery")
        .clone();
    // The id's time (the publishing node's clock, milliseconds) and the
    // publish time (the store's clock): the same moment, give or take the
    // two clocks and the call.
    let made = lanebus_store::event_id_time(&done).expect("a generated id is a UUIDv7");
    let apart = (d.published_at - made).abs();
    assert!(
        apart < chrono::Duration::seconds(60),
        "id made {made}, published {}",
        d.published_at
    );
    assert!(lanebus_store::event_id_time(&waiting).is_some());
    assert_eq!(
        s.complete(&[dref(&d, Epoch(0), 1)])
            .await
            .expect("complete")
            .len(),
        1
    );
    assert!(s.lookup_event(&done).await.expect("lookup").is_some());

    // A cutoff well after the publish: the SQL backends prune only events
    // published two minutes before it.
    let cutoff = store_now(&*s).await + chrono::Duration::minutes(3);
    let pruned = s.prune(cutoff, 100).await.expect("prune");
    assert_eq!((pruned.completions, pruned.events), (1, 1), "{pruned:?}");
    assert_eq!(s.lookup_event(&done).await.expect("lookup"), None);
    let kept = s
        .lookup_event(&waiting)
        .await
        .expect("lookup")
        .expect("pending: kept");
    assert_eq!(kept.handlers.len(), 1);
    // Never published: the same answer.
    let never = lanebus_store::generate_event_id();
    assert_eq!(s.lookup_event(&never).await.expect("lookup"), None);
}

/// Every page of `handler_deliveries` with `limit` 2, following the
/// cursors; each page but the last is full.
async fn all_pages(s: &dyn Store, q: &HandlerDeliveriesQuery) -> Vec<HandlerDeliveryItem> {
    let mut q = HandlerDeliveriesQuery {
        limit: 2,
        ..q.clone()
    };
    let mut all = Vec::new();
    loop {
        let page = s.handler_deliveries(&q).await.expect("page");
        assert!(page.len() <= 2, "{page:?}");
        let full = page.len() == 2;
        q.after = page.last().map(HandlerDeliveryItem::cursor);
        all.extend(page);
        if !full {
            return all;
        }
        assert!(all.len() <= 100, "cursor does not move: {all:?}");
    }
}

async fn handler_deliveries_page_newest_first_per_state(h: &dyn Harness) {
    let s = h.store();
    let mine = handler(&*s, "mine", &["d.*"]).await;
    let other = handler(&*s, "other", &["d.*"]).await;
    // Two keys of one lane, so delivery ids follow the publish order on
    // every backend (MongoDB's are lane positions).
    let lane = lane_of_event(Some("ka"), "", s.lanes());
    let kb = (0..10_000)
        .map(|i| format!("kb{i}"))
        .find(|k| lane_of_event(Some(k), "", s.lanes()) == lane)
        .expect("a second key of the lane");
    let keys: Vec<&str> = (0..9)
        .map(|i| if i % 2 == 0 { "ka" } else { kb.as_str() })
        .collect();
    for (i, key) in keys.iter().enumerate() {
        let id = format!("e{}", i + 1);
        s.publish(vec![ev(Some(&id), "d.made", Some(key))])
            .await
            .expect("publish");
    }
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 18, "nine events to two handlers");
    let of = |h: &Handler, n: usize| -> Delivery {
        let event = format!("e{n}");
        ds.iter()
            .find(|d| d.handler_id == h.id && d.event_id == event)
            .expect("delivery")
            .clone()
    };
    // e1..e3 dead, e4..e6 completed (one call each, so in order), e7..e9
    // pending (e8 after a failed attempt), for both handlers.
    for n in 1..=3 {
        for h in [&mine, &other] {
            let d = of(h, n);
            let req = DeadLetterRequest {
                id: d.id,
                lane: d.lane,
                epoch: Epoch(0),
                attempts: n as u32,
                last_error: format!("HTTP 50{n}"),
                failure: None,
            };
            assert_eq!(s.dead_letter(&[req]).await.expect("dead"), vec![d.id]);
        }
    }
    let before = store_now(&*s).await;
    for n in 4..=6 {
        for h in [&mine, &other] {
            let d = of(h, n);
            let done = s.complete(&[dref(&d, Epoch(0), n as u32)]).await;
            assert_eq!(done.expect("complete"), vec![d.id]);
        }
    }
    let due = DateTime::from_timestamp_micros(
        (Utc::now() + chrono::Duration::seconds(90)).timestamp_micros(),
    )
    .expect("time");
    for h in [&mine, &other] {
        let d = of(h, 8);
        let r = Reschedule {
            id: d.id,
            lane: d.lane,
            epoch: Epoch(0),
            attempts: 2,
            due_at: due,
            last_error: "HTTP 429".into(),
            failure: None,
        };
        assert_eq!(s.reschedule(&[r]).await.expect("reschedule"), vec![d.id]);
    }
    let after = store_now(&*s).await + chrono::Duration::microseconds(1);

    let query = |state, key: Option<&str>| HandlerDeliveriesQuery {
        handler_id: mine.id.clone(),
        state,
        key: key.map(Into::into),
        after: None,
        limit: 100,
        completed_since: before - chrono::Duration::hours(1),
    };
    let events = |items: &[HandlerDeliveryItem]| -> Vec<String> {
        items.iter().map(|i| i.event_id.clone()).collect()
    };
    let names = |ns: &[usize]| -> Vec<String> { ns.iter().map(|n| format!("e{n}")).collect() };

    let pending = all_pages(&*s, &query(DeliveryListState::Pending, None)).await;
    assert_eq!(events(&pending), names(&[9, 8, 7]));
    for (item, n) in pending.iter().zip([9, 8, 7]) {
        let d = of(&mine, n);
        let state = if n == 8 {
            DeliveryState::Pending {
                attempts: 2,
                due_at: due,
                last_error: Some("HTTP 429".into()),
                attempt_log: vec![],
            }
        } else {
            DeliveryState::Pending {
                attempts: 0,
                due_at: d.due_at,
                last_error: None,
                attempt_log: vec![],
            }
        };
        let want = HandlerDeliveryItem {
            event_id: format!("e{n}"),
            event_type: Some("d.made".into()),
            key: Some(keys[n - 1].into()),
            seq: d.seq,
            lane: Some(lane),
            id: Some(d.id),
            state,
        };
        assert_eq!(item, &want);
    }

    let dead = all_pages(&*s, &query(DeliveryListState::Dead, None)).await;
    assert_eq!(events(&dead), names(&[3, 2, 1]));
    for (item, n) in dead.iter().zip([3u32, 2, 1]) {
        assert_eq!(
            (item.event_type.as_deref(), item.lane, item.key.as_deref()),
            (Some("d.made"), Some(lane), Some(keys[n as usize - 1]))
        );
        match &item.state {
            DeliveryState::DeadLettered {
                failed_at,
                attempts,
                last_error,
                ..
            } => {
                assert_eq!((*attempts, last_error.clone()), (n, format!("HTTP 50{n}")));
                assert!(*failed_at <= after, "{item:?}");
            }
            other => panic!("dead: {other:?}"),
        }
    }
    let ids: Vec<i64> = dead.iter().map(|i| i.id.expect("dead letter id")).collect();
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "{ids:?}");
    let listed = s
        .list_dead_letters(&DeadLetterFilter {
            handler_id: Some(mine.id.clone()),
            after_id: None,
            limit: 100,
        })
        .await
        .expect("dead letters");
    let mut known: Vec<i64> = listed.iter().map(|d| d.id).collect();
    known.reverse();
    assert_eq!(ids, known, "the dead-letter ids, for replay");

    let completed = all_pages(&*s, &query(DeliveryListState::Completed, None)).await;
    assert_eq!(events(&completed), names(&[6, 5, 4]));
    let mut last = after;
    for (item, n) in completed.iter().zip([6u32, 5, 4]) {
        assert_eq!(
            (item.event_type.as_deref(), item.lane, item.id, item.seq),
            (Some("d.made"), Some(lane), None, of(&mine, n as usize).seq)
        );
        match item.state {
            DeliveryState::Completed {
                completed_at,
                attempts,
            } => {
                assert_eq!(attempts, n);
                assert!(before <= completed_at && completed_at <= last, "{item:?}");
                last = completed_at;
            }
            ref other => panic!("completed: {other:?}"),
        }
    }
    // Completions before `completed_since` are not read.
    let late = HandlerDeliveriesQuery {
        completed_since: after,
        ..query(DeliveryListState::Completed, None)
    };
    assert_eq!(s.handler_deliveries(&late).await.expect("page"), vec![]);

    // The key filter, on each state (an exactly full last page included).
    let ka = |state| query(state, Some("ka"));
    let got = all_pages(&*s, &ka(DeliveryListState::Pending)).await;
    assert_eq!(events(&got), names(&[9, 7]));
    let got = all_pages(&*s, &ka(DeliveryListState::Dead)).await;
    assert_eq!(events(&got), names(&[3, 1]));
    let got = all_pages(&*s, &ka(DeliveryListState::Completed)).await;
    assert_eq!(events(&got), names(&[5]));
    let got = all_pages(&*s, &query(DeliveryListState::Completed, Some(&kb))).await;
    assert_eq!(events(&got), names(&[6, 4]));

    // The other handler's rows are its own; an unknown handler has none.
    let theirs = HandlerDeliveriesQuery {
        handler_id: other.id.clone(),
        ..query(DeliveryListState::Pending, None)
    };
    let got = all_pages(&*s, &theirs).await;
    assert_eq!(events(&got), names(&[9, 8, 7]));
    let ids: Vec<Option<i64>> = got.iter().map(|i| i.id).collect();
    let want: Vec<Option<i64>> = [9, 8, 7].iter().map(|&n| Some(of(&other, n).id)).collect();
    assert_eq!(ids, want);
    let nobody = HandlerDeliveriesQuery {
        handler_id: "hdl_00000000000000000000000000000000".into(),
        ..query(DeliveryListState::Dead, None)
    };
    assert_eq!(s.handler_deliveries(&nobody).await.expect("page"), vec![]);
}

/// The position an item is ordered by in [`Store::handler_deliveries`]:
/// the id for pending deliveries and dead letters, `(completed_at,
/// event_id)` for completions; newest first is descending.
fn list_position(i: &HandlerDeliveryItem) -> (i64, String) {
    match (&i.state, i.id) {
        (DeliveryState::Completed { completed_at, .. }, _) => {
            (completed_at.timestamp_micros(), i.event_id.clone())
        }
        (_, id) => (
            id.expect("pending and dead items have an id"),
            String::new(),
        ),
    }
}

/// Every page of `q` at `q.limit`, following the cursors: each page but
/// the last is full, the last is shorter (possibly empty).
async fn pages_of(s: &dyn Store, q: &HandlerDeliveriesQuery) -> Vec<HandlerDeliveryItem> {
    let mut q = q.clone();
    let mut all: Vec<HandlerDeliveryItem> = Vec::new();
    loop {
        let page = s.handler_deliveries(&q).await.expect("page");
        assert!(page.len() <= q.limit as usize, "page over its limit");
        let full = page.len() == q.limit as usize;
        if let (Some(last), Some(first)) = (all.last(), page.first()) {
            assert!(
                list_position(last) > list_position(first),
                "page boundary after {} items (limit {}): {last:?} then {first:?}",
                all.len(),
                q.limit
            );
        }
        q.after = page.last().map(HandlerDeliveryItem::cursor);
        all.extend(page);
        if !full {
            return all;
        }
    }
}

/// The states of [`handler_deliveries_page_over_ten_thousand_rows`]: event
/// `i`'s delivery to `mine` is completed when `i % 3 == 0`, dead when 1,
/// pending when 2 (30,300 events: 10,100 a state); on MongoDB (SecantusDB,
/// in Python, about 20 times slower here) only the completions, the state
/// with ties, go over 10,000: dead when `i % 11 == 1`, pending when 2,
/// completed otherwise (12,300 events: 10,064 completed), read at one page
/// size (1,000: its pages still end inside runs of one completion time).
#[derive(Clone, Copy)]
struct PagingLayout {
    events: usize,
    modulus: usize,
    /// States whose listing must hold over 10,000 rows.
    large: &'static [DeliveryListState],
    /// Page sizes each state is read at.
    limits: &'static [u32],
}

impl PagingLayout {
    fn of(s: &dyn Store) -> PagingLayout {
        if s.backend() == "mongodb" {
            PagingLayout {
                events: 12_300,
                modulus: 11,
                large: &[DeliveryListState::Completed],
                limits: &[1_000],
            }
        } else {
            PagingLayout {
                events: 30_300,
                modulus: 3,
                large: &[
                    DeliveryListState::Pending,
                    DeliveryListState::Dead,
                    DeliveryListState::Completed,
                ],
                limits: &[1_000, 333, 97],
            }
        }
    }

    fn state(&self, i: usize) -> DeliveryListState {
        match i % self.modulus {
            1 => DeliveryListState::Dead,
            2 => DeliveryListState::Pending,
            _ => DeliveryListState::Completed,
        }
    }
}

/// Every pending delivery of `handler` as a [`DeliveryRef`] at epoch 0
/// and `attempts`, with its event id: read from one page of
/// [`Store::handler_deliveries`] instead of claims (claiming 30,000
/// deliveries takes minutes on SecantusDB; completions are fenced by lane
/// epoch, not by a claim).
async fn pending_refs(s: &dyn Store, handler: &Handler) -> Vec<(String, DeliveryRef)> {
    let q = HandlerDeliveriesQuery {
        handler_id: handler.id.clone(),
        state: DeliveryListState::Pending,
        key: None,
        after: None,
        limit: 100_000,
        completed_since: DateTime::UNIX_EPOCH,
    };
    let page = s.handler_deliveries(&q).await.expect("pending");
    page.into_iter()
        .map(|i| {
            let r = DeliveryRef {
                id: i.id.expect("a pending item has an id"),
                lane: i.lane.expect("a pending item has a lane"),
                epoch: Epoch(0),
                attempts: 1,
            };
            (i.event_id, r)
        })
        .collect()
}

/// Paging over more than 10,000 rows of one handler in each state, with
/// another handler's rows mixed in: every row once, newest first, at
/// several page sizes (boundaries inside runs of completions of one
/// timestamp: a `complete` call writes one completion time for its whole
/// batch), with the key filter, and an empty page after the last. On
/// MongoDB only the completions go over 10,000 ([`PagingLayout`]).
async fn handler_deliveries_page_over_ten_thousand_rows(h: &dyn Harness) {
    const N: usize = 10_000;
    const KEYS: usize = 8;
    let s = h.store();
    let layout = PagingLayout::of(&*s);
    let mine = handler(&*s, "mine", &["p.*"]).await;
    let other = handler(&*s, "other", &["p.odd"]).await;
    // Event i: `p{i:05}`; every 9th unkeyed, every 10th also to `other`.
    let key_of = |i: usize| (!i.is_multiple_of(9)).then(|| format!("k{}", i % KEYS));
    let all: Vec<usize> = (0..layout.events).collect();
    for chunk in all.chunks(MAX_BATCH) {
        let batch: Vec<NewEvent> = chunk
            .iter()
            .map(|&i| {
                let ty = if i % 10 == 0 { "p.odd" } else { "p.made" };
                ev(Some(&format!("p{i:05}")), ty, key_of(i).as_deref())
            })
            .collect();
        let out = s.publish(batch).await.expect("publish");
        assert_eq!(out.accepted, chunk.len());
    }
    let theirs = pending_refs(&*s, &other).await;
    let mut ds: Vec<(String, DeliveryRef, bool)> = pending_refs(&*s, &mine)
        .await
        .into_iter()
        .map(|(e, r)| (e, r, true))
        .chain(theirs.into_iter().map(|(e, r)| (e, r, false)))
        .collect();
    // In publish order, as a lane delivers them: dead letters of a key then
    // get their ids in sequence order.
    ds.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(ds.len(), layout.events + layout.events.div_ceil(10));
    let index = |e: &str| -> usize { e[1..].parse().expect("event index") };
    // `other`'s deliveries completed along with `mine`'s, in the same
    // calls; otherwise pending.
    let (mut done, mut dead) = (Vec::new(), Vec::new());
    for (event_id, r, of_mine) in &ds {
        let i = index(event_id);
        match layout.state(i) {
            DeliveryListState::Completed => done.push(DeliveryRef {
                attempts: 1 + (i % 4) as u32,
                ..*r
            }),
            DeliveryListState::Dead if *of_mine => dead.push(DeadLetterRequest {
                id: r.id,
                lane: r.lane,
                epoch: Epoch(0),
                attempts: 3,
                last_error: "HTTP 500".into(),
                failure: None,
            }),
            _ => {}
        }
    }
    for chunk in done.chunks(1_000) {
        let n = s.complete(chunk).await.expect("complete").len();
        assert_eq!(n, chunk.len());
    }
    for chunk in dead.chunks(1_000) {
        let n = s.dead_letter(chunk).await.expect("dead letter").len();
        assert_eq!(n, chunk.len());
    }

    let query = |state, key: Option<&str>, limit| HandlerDeliveriesQuery {
        handler_id: mine.id.clone(),
        state,
        key: key.map(Into::into),
        after: None,
        limit,
        completed_since: DateTime::UNIX_EPOCH,
    };
    for state in [
        DeliveryListState::Pending,
        DeliveryListState::Dead,
        DeliveryListState::Completed,
    ] {
        let want: HashSet<String> = (0..layout.events)
            .filter(|&i| layout.state(i) == state)
            .map(|i| format!("p{i:05}"))
            .collect();
        if layout.large.contains(&state) {
            assert!(want.len() > N, "{state:?}: {} rows", want.len());
        }
        // One page of everything: the reference order.
        let whole = s
            .handler_deliveries(&query(state, None, 100_000))
            .await
            .expect("whole");
        let ids: Vec<&str> = whole.iter().map(|i| i.event_id.as_str()).collect();
        let unique: HashSet<String> = ids.iter().map(|s| s.to_string()).collect();
        assert_eq!(ids.len(), unique.len(), "{state:?}: an event listed twice");
        assert_eq!(
            unique, want,
            "{state:?}: every row of the handler, no other"
        );
        let positions: Vec<(i64, String)> = whole.iter().map(list_position).collect();
        assert!(
            positions.windows(2).all(|w| w[0] > w[1]),
            "{state:?}: strictly descending positions"
        );
        // Newest first: within a key, descending sequence numbers.
        let mut last_seq: HashMap<&str, i64> = HashMap::new();
        for i in &whole {
            if let Some(key) = i.key.as_deref() {
                let seq = i.seq.expect("keyed item has a seq");
                if let Some(prev) = last_seq.insert(key, seq) {
                    assert!(prev > seq, "{state:?}: key {key}: seq {prev} then {seq}");
                }
            }
        }
        if state == DeliveryListState::Completed {
            let times: HashSet<i64> = positions.iter().map(|p| p.0).collect();
            assert!(
                times.len() * 100 < whole.len(),
                "completions share their times: {} times for {} rows",
                times.len(),
                whole.len()
            );
        }
        for &limit in layout.limits {
            let paged = pages_of(&*s, &query(state, None, limit)).await;
            assert!(paged == whole, "{state:?}, limit {limit}: pages differ");
        }
        // Past the last item: an empty page.
        let past = HandlerDeliveriesQuery {
            after: whole.last().map(HandlerDeliveryItem::cursor),
            ..query(state, None, 100)
        };
        assert_eq!(s.handler_deliveries(&past).await.expect("page"), vec![]);
        // The key filter: the same rows of that key, in the same order.
        let keyed = pages_of(&*s, &query(state, Some("k3"), 97)).await;
        let want: Vec<&HandlerDeliveryItem> = whole
            .iter()
            .filter(|i| i.key.as_deref() == Some("k3"))
            .collect();
        assert!(want.len() > 97, "{state:?}: {} of key k3", want.len());
        assert!(
            keyed.iter().eq(want.into_iter()),
            "{state:?}: key filter pages differ"
        );
    }
    // The other handler's rows are its own.
    let theirs = HandlerDeliveriesQuery {
        handler_id: other.id.clone(),
        ..query(DeliveryListState::Completed, None, 100_000)
    };
    let got = s.handler_deliveries(&theirs).await.expect("page");
    let want = (0..layout.events)
        .filter(|&i| i % 10 == 0 && layout.state(i) == DeliveryListState::Completed)
        .count();
    assert_eq!(got.len(), want);
}

fn failed(
    attempt: u32,
    status: Option<u16>,
    error: Option<AttemptError>,
    body: &str,
) -> FailedAttempt {
    FailedAttempt {
        attempt,
        at: DateTime::from_timestamp_micros(1_780_000_000_000_000 + i64::from(attempt))
            .expect("time"),
        status,
        error,
        duration_ms: u64::from(attempt) * 10,
        body: FailedAttempt::body_prefix(body.as_bytes()),
        body_withheld: false,
    }
}

/// The attempt log of `handler`'s record of `event`, as a lookup shows it.
async fn lookup_log(
    s: &dyn Store,
    event: &str,
    handler: &Handler,
) -> (DeliveryState, Vec<FailedAttempt>) {
    let got = s
        .lookup_event(event)
        .await
        .expect("lookup")
        .expect("stored");
    let state = got
        .handlers
        .into_iter()
        .find(|e| e.handler_id == handler.id)
        .unwrap_or_else(|| panic!("{} listed", handler.name))
        .state;
    let log = match &state {
        DeliveryState::Pending { attempt_log, .. }
        | DeliveryState::DeadLettered { attempt_log, .. } => attempt_log.clone(),
        DeliveryState::Completed { .. } => Vec::new(),
    };
    (state, log)
}

/// The attempt log of the only item of `handler`'s deliveries in `state`.
async fn listed_log(
    s: &dyn Store,
    handler: &Handler,
    state: DeliveryListState,
) -> Vec<FailedAttempt> {
    let items = s
        .handler_deliveries(&HandlerDeliveriesQuery {
            handler_id: handler.id.clone(),
            state,
            key: None,
            after: None,
            limit: 10,
            completed_since: DateTime::from_timestamp_micros(0).expect("time"),
        })
        .await
        .expect("page");
    assert_eq!(items.len(), 1, "{items:?}");
    match &items[0].state {
        DeliveryState::Pending { attempt_log, .. }
        | DeliveryState::DeadLettered { attempt_log, .. } => attempt_log.clone(),
        other => panic!("{other:?}"),
    }
}

/// An event to three handlers: one succeeds at once, one fails twice (a
/// 500 with a body, then a refused connection) and then succeeds, one
/// fails until it is a dead letter. Each failure rides on its reschedule
/// or dead letter; the log keeps the last ATTEMPT_LOG_LEN, the dead letter
/// keeps its delivery's, a completion none.
async fn attempt_log_keeps_the_last_failed_attempts(h: &dyn Harness) {
    let s = h.store();
    let ok = handler(&*s, "ok", &["a.*"]).await;
    let flaky = handler(&*s, "flaky", &["a.*"]).await;
    let dead = handler(&*s, "dead", &["a.*"]).await;
    s.publish(vec![ev(Some("al1"), "a.log", Some("k"))])
        .await
        .expect("publish");
    let ds = claim_all(&*s).await;
    let of = |handler: &Handler| -> Delivery {
        ds.iter()
            .find(|d| d.handler_id == handler.id)
            .expect("delivery")
            .clone()
    };
    let resched = |d: &Delivery, attempts: u32, failure: Option<FailedAttempt>| Reschedule {
        id: d.id,
        lane: d.lane,
        epoch: Epoch(0),
        attempts,
        due_at: Utc::now(),
        last_error: format!("attempt {attempts} failed"),
        failure,
    };

    // Succeeds at once: a completion, no attempt log.
    assert_eq!(
        s.complete(&[dref(&of(&ok), Epoch(0), 1)])
            .await
            .expect("complete")
            .len(),
        1
    );
    let (state, log) = lookup_log(&*s, "al1", &ok).await;
    assert!(
        matches!(state, DeliveryState::Completed { attempts: 1, .. }),
        "{state:?}"
    );
    assert_eq!(log, vec![]);

    // Fails twice: a 500 with a body (multi-byte text past 1 KiB, cut on
    // a character boundary), then a refused connection.
    let long = format!(
        "{{\"error\":\"database down\",\"detail\":\"{}\"}}",
        "é".repeat(600)
    );
    let first = failed(1, Some(500), None, &long);
    let body = first.body.clone().expect("body");
    assert!(
        body.len() <= ATTEMPT_BODY_BYTES && body.len() > ATTEMPT_BODY_BYTES - 4,
        "{}",
        body.len()
    );
    assert!(long.starts_with(&body) && !body.contains('\u{FFFD}'));
    let second = failed(2, None, Some(AttemptError::Refused), "");
    let d = of(&flaky);
    assert_eq!(
        s.reschedule(&[resched(&d, 1, Some(first.clone()))])
            .await
            .expect("reschedule"),
        vec![d.id]
    );
    let (state, log) = lookup_log(&*s, "al1", &flaky).await;
    assert!(
        matches!(state, DeliveryState::Pending { attempts: 1, .. }),
        "{state:?}"
    );
    assert_eq!(log, vec![first.clone()]);
    assert_eq!(
        s.reschedule(&[resched(&d, 2, Some(second.clone()))])
            .await
            .expect("reschedule"),
        vec![d.id]
    );
    // A reschedule without a failure leaves the log as it is.
    assert_eq!(
        s.reschedule(&[resched(&d, 2, None)])
            .await
            .expect("reschedule"),
        vec![d.id]
    );
    let (state, log) = lookup_log(&*s, "al1", &flaky).await;
    assert!(
        matches!(state, DeliveryState::Pending { attempts: 2, .. }),
        "{state:?}"
    );
    assert_eq!(log, vec![first.clone(), second.clone()]);
    assert_eq!(log[0].status, Some(500));
    assert_eq!(log[1].error, Some(AttemptError::Refused));
    assert_eq!(
        listed_log(&*s, &flaky, DeliveryListState::Pending).await,
        vec![first, second]
    );
    // A claim still reads the delivery (the log is not part of it).
    let again = claim_all(&*s).await;
    assert_eq!(again.iter().filter(|x| x.id == d.id).count(), 1);
    assert_eq!(
        s.complete(&[dref(&d, Epoch(0), 3)])
            .await
            .expect("complete"),
        vec![d.id]
    );
    let (state, log) = lookup_log(&*s, "al1", &flaky).await;
    assert!(
        matches!(state, DeliveryState::Completed { attempts: 3, .. }),
        "{state:?}"
    );
    assert_eq!(log, vec![]);

    // Fails seven times: the pending log keeps the last ATTEMPT_LOG_LEN,
    // and so does the dead letter, the last failure appended.
    let x = of(&dead);
    let all: Vec<FailedAttempt> = (1..=7)
        .map(|n| failed(n, Some(500 + n as u16), None, &format!("busy {n}")))
        .collect();
    for f in &all[..6] {
        let r = resched(&x, f.attempt, Some(f.clone()));
        assert_eq!(s.reschedule(&[r]).await.expect("reschedule"), vec![x.id]);
    }
    let (_, log) = lookup_log(&*s, "al1", &dead).await;
    assert_eq!(log, all[6 - ATTEMPT_LOG_LEN..6].to_vec());
    let moved = s
        .dead_letter(&[DeadLetterRequest {
            id: x.id,
            lane: x.lane,
            epoch: Epoch(0),
            attempts: 7,
            last_error: "http 507".into(),
            failure: Some(all[6].clone()),
        }])
        .await
        .expect("dead letter");
    assert_eq!(moved, vec![x.id]);
    let (state, log) = lookup_log(&*s, "al1", &dead).await;
    assert!(
        matches!(state, DeliveryState::DeadLettered { attempts: 7, .. }),
        "{state:?}"
    );
    assert_eq!(log, all[7 - ATTEMPT_LOG_LEN..].to_vec());
    assert_eq!(listed_log(&*s, &dead, DeliveryListState::Dead).await, log);
    assert_eq!(log.last().map(|f| f.body.as_deref()), Some(Some("busy 7")));

    // A replayed dead letter is a fresh delivery with an empty log.
    assert_eq!(
        s.replay_dead_letters(&[], Some(&dead.id))
            .await
            .expect("replay"),
        1
    );
    let (state, log) = lookup_log(&*s, "al1", &dead).await;
    assert!(
        matches!(state, DeliveryState::Pending { attempts: 0, .. }),
        "{state:?}"
    );
    assert_eq!(log, vec![]);
}

/// The `lanebus.` types are lanebus's own (operational events): `publish`
/// and `publish_in` refuse them, storing nothing; `publish_operational`
/// takes only them, idempotently by id; only routes that start with
/// `lanebus.` receive them (not `*`).
async fn operational_types_are_reserved_and_routed_apart(h: &dyn Harness) {
    let s = h.store();
    let all = handler(&*s, "all", &["*"]).await;
    let ops = handler(&*s, "ops", &["lanebus.*"]).await;
    let exact = handler(&*s, "exact", &["lanebus.handler.disabled"]).await;
    let near = handler(&*s, "near", &["lanebus*"]).await;
    let op = ev(Some("lbop_1"), "lanebus.handler.disabled", Some(&all.id));

    let err = s.publish(vec![op.clone()]).await.expect_err("reserved");
    assert!(
        matches!(&err, StoreError::Invalid(m) if m.contains("reserved")),
        "{err}"
    );
    let err = h
        .publish_in_many(vec![vec![op.clone()]], true)
        .await
        .expect_err("reserved in the caller's transaction too");
    assert!(matches!(&err, StoreError::Invalid(_)), "{err}");
    let err = s
        .publish_operational(vec![ev(Some("o1"), "orders.placed", None)])
        .await
        .expect_err("only operational types");
    assert!(matches!(&err, StoreError::Invalid(_)), "{err}");
    assert_eq!(counts(&*s).await, StoreCounts::default(), "nothing stored");

    let out = s
        .publish_operational(vec![op.clone()])
        .await
        .expect("operational publish");
    assert_eq!((out.accepted, out.duplicates), (1, 0));
    let out = s.publish_operational(vec![op]).await.expect("again");
    assert_eq!(
        (out.accepted, out.duplicates),
        (0, 1),
        "same id: stored once"
    );
    s.publish(vec![ev(Some("n1"), "lanebusx.y", None)])
        .await
        .expect("a near miss is an ordinary type");

    let ds = claim_all(&*s).await;
    let mut got: Vec<(&str, &str)> = ds
        .iter()
        .map(|d| {
            let name = [&all, &ops, &exact, &near]
                .into_iter()
                .find(|x| x.id == d.handler_id)
                .map_or("?", |x| x.name.as_str());
            (d.event_id.as_str(), name)
        })
        .collect();
    got.sort_unstable();
    assert_eq!(
        got,
        vec![
            ("lbop_1", "exact"),
            ("lbop_1", "ops"),
            ("n1", "all"),
            ("n1", "near"),
        ]
    );
    let d = ds.iter().find(|d| d.event_id == "lbop_1").expect("claimed");
    assert_eq!((d.key.as_deref(), d.seq), (Some(all.id.as_str()), Some(1)));
}

/// Every enable and disable stores its operational event once, keyed by
/// the handler, in the order of the changes: a repeated call and
/// concurrent calls add nothing. `change_handler_state` alone tells it
/// (the SQL backends in the state change's own transaction, MongoDB right
/// after its single-document update); `change_state` tells it again, a
/// duplicate.
async fn state_changes_tell_their_operational_event_once(h: &dyn Harness) {
    use lanebus_store::operational;
    let s = h.store();
    let ops = handler(&*s, "ops", &["lanebus.*"]).await;
    let target = handler(&*s, "orders", &["orders.*"]).await;
    let id_of = |c: &StateChange| {
        operational::state_changed(&c.handler, true, Utc::now())
            .and_then(|e| e.id)
            .expect("an id")
    };

    let off = change_state(&*s, &target.id, HandlerState::Disabled, "api")
        .await
        .expect("disable");
    assert!(off.changed());
    let again = change_state(&*s, &target.id, HandlerState::Disabled, "gone")
        .await
        .expect("disable again");
    assert!(!again.changed());
    assert_eq!(counts(&*s).await.events, 1, "one event for one change");
    let told = s
        .lookup_event(&id_of(&off))
        .await
        .expect("lookup")
        .expect("the disable is told");
    assert_eq!(told.event_type, operational::HANDLER_DISABLED);
    assert_eq!(told.key.as_deref(), Some(target.id.as_str()));
    assert_eq!(told.handlers.len(), 1, "to ops only");
    assert_eq!(told.handlers[0].handler_id, ops.id);

    let on = s
        .change_handler_state(&target.id, HandlerState::Enabled, "api")
        .await
        .expect("enable");
    assert!(
        s.lookup_event(&id_of(&on)).await.expect("lookup").is_some(),
        "told by the state change itself"
    );
    // Told (again: a duplicate where it was) by the one step of changes.
    change_state(&*s, &target.id, HandlerState::Enabled, "api")
        .await
        .expect("enable again");
    assert_eq!(counts(&*s).await.events, 2);

    let (a, b) = tokio::join!(
        change_state(&*s, &target.id, HandlerState::Disabled, "gone"),
        change_state(&*s, &target.id, HandlerState::Disabled, "gone"),
    );
    let (a, b) = (a.expect("disable"), b.expect("disable"));
    assert!(a.changed() != b.changed(), "exactly one changed it");
    assert_eq!(counts(&*s).await.events, 3, "concurrent calls tell once");

    let mut told: Vec<(i64, String)> = claim_all(&*s)
        .await
        .into_iter()
        .map(|d| {
            assert_eq!(d.handler_id, ops.id);
            (d.seq.expect("keyed"), d.event_type)
        })
        .collect();
    told.sort_unstable();
    assert_eq!(
        told,
        vec![
            (1, operational::HANDLER_DISABLED.to_owned()),
            (2, operational::HANDLER_ENABLED.to_owned()),
            (3, operational::HANDLER_DISABLED.to_owned()),
        ]
    );
}

// ---------------------------------------------------------------------------
// Expected sequences (optimistic concurrency on a key)
// ---------------------------------------------------------------------------

/// 128 writers use one key as an event stream with optimistic concurrency,
/// through four store instances (four group writers, so publishes race in
/// the database, not only in one queue); each publishes one event expecting
/// the key's last sequence it knows (0 at first), and on a conflict takes
/// the current sequence the answer names, until the key has `total`
/// events (SQLite: two instances, whose writes queue for the file's lock
/// anyway). Each sequence is won by exactly one writer, the key's sequences
/// are 1 to `total` without a gap, each writer's successes are exactly the
/// stored events it published, and each conflict names a sequence past the
/// one expected.
async fn expected_seq_lets_exactly_one_writer_win_each_sequence(h: &dyn Harness) {
    const WRITERS: usize = 128;
    let s = h.store();
    // SecantusDB, the MongoDB-compatible server the tests run on, is slow
    // (a Python server): 32 sequences there (about 128 tries each), 256 on
    // the others.
    let total: i64 = if s.backend() == "mongodb" { 32 } else { 256 };
    handler(&*s, "all", &["*"]).await;
    let instances = if s.backend() == "sqlite" { 2 } else { 4 };
    let mut stores = vec![s.clone()];
    for _ in 1..instances {
        stores.push(h.reopen().await);
    }
    let start = Arc::new(tokio::sync::Barrier::new(WRITERS));
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (st, start) = (stores[w % stores.len()].clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let mut seen = 0;
            let (mut won, mut conflicts) = (Vec::new(), 0usize);
            while seen < total {
                let id = format!("w{w}-after-{seen}");
                match st.publish(vec![at(&id, "stream", Some(seen))]).await {
                    Ok(out) => {
                        assert_eq!((out.accepted, out.duplicates), (1, 0), "writer {w}");
                        seen += 1;
                        won.push((seen, id));
                    }
                    Err(StoreError::SeqConflict {
                        key,
                        expected,
                        current,
                        ..
                    }) => {
                        assert_eq!((key.as_str(), expected), ("stream", seen), "writer {w}");
                        assert!(
                            current > seen && current <= total,
                            "writer {w}: expected {seen}, told {current}"
                        );
                        seen = current;
                        conflicts += 1;
                    }
                    // MongoDB: the store retried write conflicts for
                    // TXN_RETRY_LIMIT and gave up (nothing written); as its
                    // docs say, the caller runs the publish again.
                    Err(StoreError::Conflict(_)) if st.backend() == "mongodb" => {}
                    Err(e) => panic!("writer {w}: {e:?}"),
                }
            }
            (won, conflicts)
        }));
    }
    let (mut won, mut conflicts) = (Vec::new(), 0);
    for t in tasks {
        let (w, c) = t.await.expect("writer task");
        won.extend(w);
        conflicts += c;
    }
    assert!(conflicts > 0, "128 writers of one key met no conflict");
    won.sort();
    let seqs: Vec<i64> = won.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(
        seqs,
        (1..=total).collect::<Vec<_>>(),
        "each sequence won by exactly one writer"
    );
    let ds = claim_all(&*s).await;
    assert_eq!(seqs_of_key(&ds, "stream"), seqs, "stored gapless, in order");
    let stored: Vec<(i64, String)> = ds
        .iter()
        .map(|d| (d.seq.expect("keyed"), d.event_id.clone()))
        .collect();
    assert_eq!(
        stored, won,
        "each success is the stored event at its sequence"
    );
    assert_eq!(counts(&*s).await.events, total);
}

/// A broken expectation stores nothing of its batch and takes no sequence
/// number, alone or in a caller's transaction; an expectation counts the
/// batch's earlier events of its key; a duplicate's is not checked; one
/// without a key, or below 0, is invalid input.
async fn a_broken_expectation_stores_nothing_of_the_batch(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let out = s
        .publish(vec![at("a1", "a", Some(0)), at("a2", "a", Some(1))])
        .await
        .expect("a new key is at 0");
    assert_eq!(out.accepted, 2);
    let conflict = |r: Result<Vec<PublishOutcome>>| match r {
        Err(StoreError::SeqConflict {
            key,
            expected,
            current,
            index,
            at,
        }) => (key, expected, current, index, at),
        other => panic!("expected a conflict, got {other:?}"),
    };
    // Over two keys, the last event's expectation breaks.
    let batch = vec![
        at("b1", "b", Some(0)),
        at("a3", "a", Some(2)),
        at("a4", "a", Some(2)),
    ];
    let got = conflict(s.publish(batch).await.map(|o| vec![o]));
    // Its third event (index 2) expected 2, where a would stand at 3.
    assert_eq!(got, ("a".into(), 2, 2, 2, 3), "a stands at 2");
    // In a caller's transaction, after a batch that held.
    let got = conflict(
        h.publish_in_many(
            vec![vec![at("b1", "b", Some(0))], vec![at("a3", "a", Some(1))]],
            true,
        )
        .await,
    );
    assert_eq!(got, ("a".into(), 1, 2, 0, 2));
    let c = counts(&*s).await;
    assert_eq!((c.events, c.deliveries), (2, 2), "nothing of either batch");

    for (e, says) in [
        (
            NewEvent {
                expected_seq: Some(0),
                ..ev(Some("u1"), "t.x", None)
            },
            "needs a key",
        ),
        (at("a3", "a", Some(-1)), "0 or more"),
    ] {
        let err = s.publish(vec![e.clone()]).await.expect_err("refused");
        assert!(
            matches!(&err, StoreError::Invalid(m) if m.starts_with("events[0]: expected_seq") && m.contains(says)),
            "{err:?}"
        );
        let err = h
            .publish_in_many(vec![vec![e]], true)
            .await
            .expect_err("refused in a caller's transaction too");
        assert!(matches!(&err, StoreError::Invalid(_)), "{err:?}");
    }

    // Held: later events of a key expect the next values, or nothing.
    let out = s
        .publish(vec![
            at("b1", "b", Some(0)),
            at("a3", "a", Some(2)),
            at("a4", "a", None),
            at("a5", "a", Some(4)),
        ])
        .await
        .expect("every expectation holds");
    assert_eq!(out.accepted, 4);
    // A retry of a stored event is a duplicate, its expectation (held by
    // its first publish, stale now) not checked; a6's counts a5.
    let out = s
        .publish(vec![at("a3", "a", Some(2)), at("a6", "a", Some(5))])
        .await
        .expect("a duplicate is not checked");
    assert_eq!((out.accepted, out.duplicates), (1, 1));
    let ds = claim_all(&*s).await;
    let order: Vec<(&str, i64)> = ds
        .iter()
        .filter(|d| d.key.as_deref() == Some("a"))
        .map(|d| (d.event_id.as_str(), d.seq.unwrap_or(0)))
        .collect();
    assert_eq!(
        order,
        vec![
            ("a1", 1),
            ("a2", 2),
            ("a3", 3),
            ("a4", 4),
            ("a5", 5),
            ("a6", 6)
        ],
        "no number was taken by the refused batches"
    );
    assert_eq!(seqs_of_key(&ds, "b"), vec![1]);
}

/// Callers publishing at once, each on a key of its own with the right
/// expectation but one: only that caller gets the conflict, whichever
/// group its batch joined; the others are stored and answered.
async fn a_broken_expectation_fails_only_its_caller(h: &dyn Harness) {
    const CALLERS: usize = 24;
    const WRONG: usize = 7;
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    for round in 0..2i64 {
        let start = Arc::new(tokio::sync::Barrier::new(CALLERS));
        let tasks: Vec<_> = (0..CALLERS)
            .map(|c| {
                let (st, start) = (s.clone(), start.clone());
                // Round 0: the wrong caller expects 3 of its new key. Round
                // 1: every key is at 1 (the wrong one at 0).
                let expected = match (c, round) {
                    (WRONG, 0) => 3,
                    (WRONG, _) => 0,
                    (_, r) => r,
                };
                tokio::spawn(async move {
                    start.wait().await;
                    let batch = vec![
                        at(&format!("c{c}-r{round}"), &format!("k{c}"), Some(expected)),
                        ev(Some(&format!("u{c}-r{round}")), "t.x", None),
                    ];
                    st.publish(batch).await
                })
            })
            .collect();
        for (c, t) in tasks.into_iter().enumerate() {
            let result = t.await.expect("caller task");
            if (c, round) == (WRONG, 0) {
                assert!(
                    matches!(&result, Err(StoreError::SeqConflict { key, expected: 3, current: 0, .. })
                        if key == "k7"),
                    "{result:?}"
                );
            } else {
                let out = result.unwrap_or_else(|e| panic!("caller {c} round {round}: {e:?}"));
                assert_eq!((out.accepted, out.duplicates), (2, 0), "caller {c}");
            }
        }
    }
    let c = counts(&*s).await;
    assert_eq!(
        c.events,
        (4 * CALLERS - 2) as i64,
        "all but the wrong batch"
    );
    let ds = claim_all(&*s).await;
    for c in 0..CALLERS {
        let want = if c == WRONG { vec![1] } else { vec![1, 2] };
        assert_eq!(seqs_of_key(&ds, &format!("k{c}")), want, "k{c}");
    }
}

/// In a caller's transaction, a broken expectation refuses its batch:
/// PostgreSQL and SQLite roll back the batch's savepoint and the
/// transaction goes on; MongoDB, without savepoints, aborts the
/// transaction, so nothing of it is committed (its raised key counter
/// would leave a gap).
async fn a_broken_expectation_in_a_caller_transaction(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    s.publish(vec![at("a1", "a", Some(0))])
        .await
        .expect("publish");
    let (results, commit) = h
        .publish_in_each(vec![
            vec![at("b1", "b", Some(0))],
            vec![at("c1", "c", None), at("a2", "a", Some(0))],
            vec![at("a2", "a", Some(1))],
        ])
        .await;
    assert_eq!(results[0].as_ref().map(|o| o.accepted).ok(), Some(1));
    assert!(
        matches!(&results[1], Err(StoreError::SeqConflict { key, expected: 0, current: 1, index: 1, at: 1 })
            if key == "a"),
        "{:?}",
        results[1]
    );
    let ds = claim_all(&*s).await;
    if s.backend() == "mongodb" {
        assert!(results[2].is_err(), "the transaction was aborted");
        assert!(commit.is_err(), "the transaction was aborted");
        assert_eq!(counts(&*s).await.events, 1, "a1 only");
        assert_eq!(seqs_of_key(&ds, "a"), vec![1]);
    } else {
        assert_eq!(results[2].as_ref().map(|o| o.accepted).ok(), Some(1));
        commit.expect("the transaction stays usable");
        assert_eq!(seqs_of_key(&ds, "a"), vec![1, 2]);
        assert_eq!(seqs_of_key(&ds, "b"), vec![1]);
        assert!(
            seqs_of_key(&ds, "c").is_empty(),
            "nothing of the refused batch"
        );
    }
}

// ---------------------------------------------------------------------------
// Event-type catalog
// ---------------------------------------------------------------------------

fn payload_ev(id: &str, ty: &str, payload: &str) -> NewEvent {
    NewEvent {
        payload: payload.as_bytes().to_vec(),
        ..ev(Some(id), ty, None)
    }
}

fn order_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "required": ["amount"],
        "properties": {"amount": {"type": "integer", "minimum": 1}}
    })
}

fn new_type(name: &str, schema: Option<serde_json::Value>, aliases: &[&str]) -> NewEventType {
    NewEventType {
        name: name.into(),
        description: format!("{name} happened"),
        schema,
        aliases: aliases.iter().map(|a| a.to_string()).collect(),
    }
}

fn invalid_message(e: StoreError) -> String {
    match e {
        StoreError::Invalid(m) => m,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

async fn event_type_schemas_validate_payloads_and_refuse_whole_batches(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let t = s
        .create_event_type(new_type("order.paid", Some(order_schema()), &[]))
        .await
        .expect("create");
    assert_eq!(t.schema, Some(order_schema()));
    assert!(!t.deprecated);
    s.create_event_type(new_type("order.noted", None, &[]))
        .await
        .expect("create without schema");

    // A schema that is not a valid draft 2020-12 schema is refused, naming it.
    for bad in [
        serde_json::json!({"type": "integr"}),
        serde_json::json!({"minimum": "one"}),
        serde_json::json!({"$ref": "https://example.com/s.json"}),
    ] {
        let e = s
            .create_event_type(new_type("bad.schema", Some(bad.clone()), &[]))
            .await
            .expect_err("invalid schema");
        assert!(invalid_message(e).contains("schema"), "{bad}");
    }

    s.publish(vec![
        payload_ev("ok-1", "order.paid", r#"{"amount": 5}"#),
        payload_ev("ok-2", "order.noted", r#"[1, "anything"]"#),
        payload_ev("ok-3", "uncataloged", r#""free""#),
    ])
    .await
    .expect("valid payloads");

    let before = counts(&*s).await;
    for (batch_bad, pointer, keyword) in [
        (r#"{"amount": 0}"#, "/amount", "minimum"),
        (r#"{"amount": "5"}"#, "/amount", "type"),
        (r#"{}"#, "/", "required"),
    ] {
        let batch = vec![
            payload_ev("fine", "order.paid", r#"{"amount": 2}"#),
            payload_ev("broken", "order.paid", batch_bad),
        ];
        let m = invalid_message(s.publish(batch.clone()).await.expect_err("refused"));
        assert!(m.contains("events[1]"), "{m}");
        assert!(m.contains(&format!("at {pointer} ")), "{m}");
        assert!(m.contains(&format!("{keyword:?}")), "{m}");
        let e = h
            .publish_in_many(vec![batch], true)
            .await
            .expect_err("refused in a caller transaction too");
        assert!(invalid_message(e).contains("events[1]"));
    }
    // Concurrent batches, one of them invalid: only its caller fails.
    let mut tasks = Vec::new();
    for i in 0..6 {
        let s = Arc::clone(&s);
        tasks.push(tokio::spawn(async move {
            let amount = if i == 3 { 0 } else { 1 };
            s.publish(vec![payload_ev(
                &format!("c-{i}"),
                "order.paid",
                &format!(r#"{{"amount": {amount}}}"#),
            )])
            .await
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.expect("join");
        assert_eq!(r.is_err(), i == 3, "batch {i}: {r:?}");
    }
    let after = counts(&*s).await;
    assert_eq!(
        after.events,
        before.events + 5,
        "nothing of a refused batch"
    );

    // Removing the schema lets any payload through.
    s.update_event_type(
        "order.paid",
        &EventTypePatch {
            schema: Some(None),
            ..Default::default()
        },
    )
    .await
    .expect("drop schema");
    s.publish(vec![payload_ev("late", "order.paid", "{}")])
        .await
        .expect("no schema any more");
}

/// A filtered handler routed on a cataloged type's alias: one delivery of a
/// matching event published under the alias, none of another (the SQLite
/// join once lost its parentheses around the route tests here).
async fn filters_hold_for_a_route_on_an_alias(h: &dyn Harness) {
    let s = h.store();
    s.create_event_type(new_type("order.paid", None, &["payment.done"]))
        .await
        .expect("create");
    let by_alias = filtered_handler(
        &*s,
        "alias",
        &["payment.done"],
        serde_json::json!({"path": "/ok", "equals": true}),
    )
    .await;
    let by_pattern = filtered_handler(
        &*s,
        "pattern",
        &["payment.*"],
        serde_json::json!({"path": "/ok", "equals": true}),
    )
    .await;
    s.publish(vec![
        with_payload("yes", "payment.done", Some("k"), br#"{"ok":true}"#),
        with_payload("no", "payment.done", Some("k"), br#"{"ok":false}"#),
    ])
    .await
    .expect("publish under the alias");
    let ds = claim_all(&*s).await;
    let mut got: Vec<(&str, &str)> = ds
        .iter()
        .map(|d| (d.handler_id.as_str(), d.event_id.as_str()))
        .collect();
    got.sort();
    let mut want = vec![
        (by_alias.id.as_str(), "yes"),
        (by_pattern.id.as_str(), "yes"),
    ];
    want.sort();
    assert_eq!(got, want);
    assert_eq!(counts(&*s).await.deliveries, 2);
}

async fn an_alias_is_stored_and_routed_under_the_wire_name(h: &dyn Harness) {
    let s = h.store();
    let by_old = handler(&*s, "old", &["payment.done"]).await;
    let by_prefix = handler(&*s, "prefix", &["payment.*"]).await;
    let by_wire = handler(&*s, "wire", &["order.paid"]).await;
    let other = handler(&*s, "other", &["order.refunded"]).await;
    s.create_event_type(new_type("order.paid", None, &["payment.done"]))
        .await
        .expect("create");
    s.publish(vec![ev(Some("a1"), "payment.done", Some("k"))])
        .await
        .expect("publish under the alias");
    h.publish_in_many(vec![vec![ev(Some("a2"), "payment.done", None)]], true)
        .await
        .expect("publish_in under the alias");
    s.publish(vec![ev(Some("a3"), "order.paid", None)])
        .await
        .expect("publish under the wire name");
    let ds = claim_all(&*s).await;
    for id in ["a1", "a2", "a3"] {
        let got: HashSet<&str> = ds
            .iter()
            .filter(|d| d.event_id == id)
            .map(|d| {
                assert_eq!(
                    d.event_type, "order.paid",
                    "{id} stored under the wire name"
                );
                d.handler_id.as_str()
            })
            .collect();
        let want = HashSet::from([
            by_old.id.as_str(),
            by_prefix.id.as_str(),
            by_wire.id.as_str(),
        ]);
        assert_eq!(
            got, want,
            "{id}: routes on the alias, a pattern of it, the wire name"
        );
    }
    assert!(ds.iter().all(|d| d.handler_id != other.id));
    let looked = s.lookup_event("a1").await.expect("lookup").expect("stored");
    assert_eq!(looked.event_type, "order.paid");

    // A rename: the old wire name becomes an alias; everything keeps matching.
    let renamed = s
        .update_event_type(
            "payment.done",
            &EventTypePatch {
                name: Some("order.settled".into()),
                ..Default::default()
            },
        )
        .await
        .expect("rename");
    assert_eq!(renamed.name, "order.settled");
    assert_eq!(renamed.aliases, vec!["payment.done", "order.paid"]);
    assert_eq!(
        renamed.created_at,
        s.get_event_type("order.settled")
            .await
            .expect("get")
            .created_at
    );
    assert_eq!(
        s.get_event_type("order.paid")
            .await
            .expect("by old name")
            .name,
        "order.settled"
    );
    s.publish(vec![ev(Some("r1"), "order.paid", None)])
        .await
        .expect("publish under the old wire name");
    let ds = claim_all(&*s).await;
    let r1: Vec<&Delivery> = ds.iter().filter(|d| d.event_id == "r1").collect();
    assert_eq!(r1.len(), 3, "{r1:?}");
    assert!(r1.iter().all(|d| d.event_type == "order.settled"));
}

async fn the_strict_setting_refuses_types_not_in_the_catalog(h: &dyn Harness) {
    let s = h.store();
    let hd = handler(&*s, "all", &["*", "lanebus.*"]).await;
    assert_eq!(
        s.catalog_settings().await.expect("read"),
        CatalogSettings::default()
    );
    s.publish(vec![ev(Some("u1"), "unknown.kind", None)])
        .await
        .expect("off by default");
    s.create_event_type(new_type("known.kind", None, &["known.old"]))
        .await
        .expect("create");
    let on = CatalogSettings { strict: true };
    assert_eq!(s.set_catalog_settings(on).await.expect("set"), on);
    assert_eq!(s.catalog_settings().await.expect("read"), on);
    let m = invalid_message(
        s.publish(vec![
            ev(Some("k1"), "known.kind", None),
            ev(Some("u2"), "unknown.kind", None),
        ])
        .await
        .expect_err("strict"),
    );
    assert!(m.contains("events[1]") && m.contains("unknown.kind"), "{m}");
    h.publish_in_many(vec![vec![ev(Some("u3"), "unknown.kind", None)]], true)
        .await
        .expect_err("strict in a caller transaction too");
    // Cataloged names and aliases pass, deprecated types too.
    let dep = s
        .deprecate_event_type("known.old")
        .await
        .expect("deprecate");
    assert!(dep.deprecated);
    assert!(
        s.get_event_type("known.kind")
            .await
            .expect("get")
            .deprecated
    );
    s.publish(vec![
        ev(Some("k2"), "known.kind", None),
        ev(Some("k3"), "known.old", None),
    ])
    .await
    .expect("cataloged types pass");
    // lanebus's own operational events are exempt.
    s.set_handler_state(&hd.id, HandlerState::Disabled)
        .await
        .expect("disable publishes an operational event");
    let ds = claim_all(&*s).await;
    assert!(
        ds.iter().any(|d| d.event_type.starts_with("lanebus.")),
        "{ds:?}"
    );
    assert!(ds
        .iter()
        .all(|d| !["u2", "k1", "u3"].contains(&d.event_id.as_str())));
    s.set_catalog_settings(CatalogSettings { strict: false })
        .await
        .expect("off");
    s.publish(vec![ev(Some("u4"), "unknown.kind", None)])
        .await
        .expect("off again");
}

async fn a_catalog_change_is_honoured_by_the_next_publish_elsewhere(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    // Both store values have published (cached the catalog) before.
    let other = h.reopen().await;
    s.publish(vec![payload_ev("w1", "order.paid", "{}")])
        .await
        .expect("warm");
    other
        .publish(vec![payload_ev("w2", "order.paid", "{}")])
        .await
        .expect("warm");
    other
        .create_event_type(new_type("order.paid", Some(order_schema()), &["order.old"]))
        .await
        .expect("create elsewhere");
    s.publish(vec![payload_ev("x1", "order.paid", "{}")])
        .await
        .expect_err("the very next publish honours the schema");
    h.publish_in_many(vec![vec![payload_ev("x2", "order.paid", "{}")]], true)
        .await
        .expect_err("publish_in too");
    s.publish(vec![payload_ev("x3", "order.old", r#"{"amount": 1}"#)])
        .await
        .expect("alias");
    other
        .set_catalog_settings(CatalogSettings { strict: true })
        .await
        .expect("strict elsewhere");
    s.publish(vec![payload_ev("x4", "else.where", "{}")])
        .await
        .expect_err("strict honoured at once");
    other
        .update_event_type(
            "order.paid",
            &EventTypePatch {
                aliases: Some(vec!["order.older".into()]),
                ..Default::default()
            },
        )
        .await
        .expect("update elsewhere");
    s.publish(vec![payload_ev("x5", "order.old", r#"{"amount": 1}"#)])
        .await
        .expect_err("the removed alias is unknown now");
    s.publish(vec![payload_ev("x6", "order.older", r#"{"amount": 1}"#)])
        .await
        .expect("the new alias");
    let ds = claim_all(&*s).await;
    let types: HashMap<&str, &str> = ds
        .iter()
        .map(|d| (d.event_id.as_str(), d.event_type.as_str()))
        .collect();
    assert_eq!(types.get("x3"), Some(&"order.paid"));
    assert_eq!(types.get("x6"), Some(&"order.paid"));
    for id in ["x1", "x2", "x4", "x5"] {
        assert!(!types.contains_key(id), "{id} stored");
    }
}

async fn event_type_names_and_aliases_are_unique(h: &dyn Harness) {
    let s = h.store();
    let a = s
        .create_event_type(new_type("a.kind", None, &["a.old"]))
        .await
        .expect("create a");
    for (name, aliases) in [
        ("a.kind", vec![]),
        ("a.old", vec![]),
        ("b.kind", vec!["a.kind"]),
        ("b.kind", vec!["a.old"]),
    ] {
        let e = s
            .create_event_type(new_type(name, None, &aliases))
            .await
            .expect_err("taken");
        assert!(
            matches!(e, StoreError::Conflict(_)),
            "{name} {aliases:?}: {e:?}"
        );
    }
    s.create_event_type(new_type("b.kind", None, &[]))
        .await
        .expect("create b");
    for patch in [
        EventTypePatch {
            aliases: Some(vec!["a.old".into()]),
            ..Default::default()
        },
        EventTypePatch {
            name: Some("a.kind".into()),
            ..Default::default()
        },
    ] {
        let e = s
            .update_event_type("b.kind", &patch)
            .await
            .expect_err("taken");
        assert!(matches!(e, StoreError::Conflict(_)), "{patch:?}: {e:?}");
    }
    for bad in [
        new_type("lanebus.mine", None, &[]),
        new_type("has space", None, &[]),
        new_type("c.kind", None, &["c.kind"]),
        new_type("c.kind", None, &["x", "x"]),
        NewEventType {
            aliases: (0..=rules::event_type::MAX_ALIASES)
                .map(|i| format!("c.{i}"))
                .collect(),
            ..new_type("c.kind", None, &[])
        },
        NewEventType {
            description: "d".repeat(rules::event_type::MAX_DESCRIPTION_CHARS + 1),
            ..new_type("c.kind", None, &[])
        },
    ] {
        let e = s.create_event_type(bad.clone()).await.expect_err("invalid");
        assert!(matches!(e, StoreError::Invalid(_)), "{bad:?}: {e:?}");
    }
    let e = s
        .update_event_type("nope", &EventTypePatch::default())
        .await
        .expect_err("unknown");
    assert!(matches!(e, StoreError::NotFound(_)), "{e:?}");
    assert!(matches!(
        s.get_event_type("nope").await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(s.get_event_type("a.old").await.expect("by alias"), a);
    let names: Vec<String> = s
        .list_event_types()
        .await
        .expect("list")
        .into_iter()
        .map(|t| t.name)
        .collect();
    assert_eq!(names, vec!["a.kind", "b.kind"]);
    // A type may take back a name it gave up.
    let moved = s
        .update_event_type(
            "a.kind",
            &EventTypePatch {
                name: Some("a.new".into()),
                ..Default::default()
            },
        )
        .await
        .expect("rename");
    assert_eq!(moved.aliases, vec!["a.old", "a.kind"]);
    let back = s
        .update_event_type(
            "a.new",
            &EventTypePatch {
                name: Some("a.kind".into()),
                ..Default::default()
            },
        )
        .await
        .expect("rename back");
    assert_eq!(
        (back.name.as_str(), back.aliases.clone()),
        ("a.kind", vec!["a.old".to_string(), "a.new".to_string()])
    );
}

// ---------------------------------------------------------------------------
// Personal fields (crypto-shredding)
// ---------------------------------------------------------------------------

fn master(byte: u8) -> personal::MasterKey {
    personal::MasterKey::from_bytes(&[byte; 32]).expect("master key")
}

fn profile_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "x-lanebus-subject": "/user",
        "required": ["user"],
        "properties": {
            "user": {"type": "string"},
            "email": {"type": "string", "x-lanebus-personal": true},
            "profile": {"properties": {
                "name": {"type": "string", "x-lanebus-personal": true},
                "plan": {"type": "string"}
            }}
        }
    })
}

fn profile_event(user: &str, email: &str, name: &str) -> NewEvent {
    NewEvent {
        event_type: "user.signed_up".into(),
        key: Some(user.into()),
        payload: serde_json::to_vec(&serde_json::json!({
            "user": user, "email": email, "profile": {"name": name, "plan": "pro"}
        }))
        .expect("json"),
        ..NewEvent::default()
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Whether any raw row holds `needle`.
async fn raw_holds(h: &dyn Harness, needle: &[u8]) -> bool {
    h.raw_rows().await.iter().any(|r| contains(r, needle))
}

async fn opened(s: &dyn Store, d: &Delivery) -> (serde_json::Value, Vec<String>) {
    let o = personal::open(s, &d.event_id, &d.payload)
        .await
        .expect("open payload")
        .expect("envelopes");
    (
        serde_json::from_slice(&o.payload).expect("json"),
        o.redacted,
    )
}

async fn personal_fields_are_sealed_at_rest_and_shredded_with_their_key(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    // Marks without a subject pointer are refused.
    let unnamed = serde_json::json!({"properties": {"email": {"x-lanebus-personal": true}}});
    let m = invalid_message(
        s.create_event_type(new_type("user.bad", Some(unnamed), &[]))
            .await
            .expect_err("marks without a subject"),
    );
    assert!(m.contains("names no subject"), "{m}");
    // Created on another node: this one's cached catalog does not know the
    // marks yet, so its first write finds them and the publish is sealed
    // and written again.
    h.reopen()
        .await
        .create_event_type(new_type("user.signed_up", Some(profile_schema()), &[]))
        .await
        .expect("create");
    // No master key on this node: refused, nothing stored.
    let e = s
        .publish(vec![profile_event(
            "alice",
            "alice@example.org",
            "Alice Liddell",
        )])
        .await
        .expect_err("no master key");
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    assert!(!raw_holds(h, b"alice@example.org").await);

    s.keyring().set_master(master(1));
    // The schema is checked on the plaintext; the subject must be there.
    let e = s
        .publish(vec![NewEvent {
            event_type: "user.signed_up".into(),
            payload: br#"{"email":"x@example.org"}"#.to_vec(),
            ..NewEvent::default()
        }])
        .await
        .expect_err("no subject");
    assert!(matches!(e, StoreError::Invalid(_)), "{e:?}");
    s.publish(vec![
        profile_event("alice", "alice@example.org", "Alice Liddell"),
        profile_event("bob", "bob@example.org", "Bob Dobbs"),
    ])
    .await
    .expect("publish");
    // Inside a caller's transaction nothing can encrypt: refused.
    let e = h
        .publish_in_many(
            vec![vec![profile_event("carol", "carol@example.org", "Carol")]],
            true,
        )
        .await
        .expect_err("publish_in of a type with personal fields");
    assert!(matches!(e, StoreError::Invalid(_)), "{e:?}");
    for plain in [
        &b"alice@example.org"[..],
        b"Alice Liddell",
        b"bob@example.org",
        b"Bob Dobbs",
        b"carol@example.org",
    ] {
        assert!(
            !raw_holds(h, plain).await,
            "raw rows hold {}",
            String::from_utf8_lossy(plain)
        );
    }
    assert!(raw_holds(h, b"lbenc:v1:").await);
    assert!(
        raw_holds(h, b"\"plan\":\"pro\"").await,
        "other fields stay plain"
    );
    let alice_key = s.subject_keys(&["alice".into()]).await.expect("keys");
    assert_eq!(alice_key.len(), 1);
    assert!(raw_holds(h, &alice_key[0].wrapped).await);

    // Delivered payloads open to the published values, on any node with
    // the master key.
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 2);
    let other = h.reopen().await;
    other.keyring().set_master(master(1));
    for d in &ds {
        assert!(!contains(&d.payload, b"@example.org"));
        let (v, redacted) = opened(&*other, d).await;
        assert!(redacted.is_empty());
        let user = v["user"].as_str().expect("user").to_owned();
        assert_eq!(v["email"], format!("{user}@example.org"));
        assert_eq!(v["profile"]["plan"], "pro");
    }
    let alice = ds
        .iter()
        .find(|d| contains(&d.payload, b"\"user\":\"alice\""))
        .expect("alice's delivery");
    let bob = ds
        .iter()
        .find(|d| contains(&d.payload, b"\"user\":\"bob\""))
        .expect("bob's delivery");

    // Deleting alice's key on this node: the other node, whose cache holds
    // it, can no longer read her fields; bob's are untouched.
    assert!(personal::forget_subject(&*s, "alice")
        .await
        .expect("forget"));
    assert!(!personal::forget_subject(&*s, "alice").await.expect("again"));
    for node in [&s, &other] {
        let (v, redacted) = opened(&**node, alice).await;
        assert_eq!(v["email"], serde_json::Value::Null);
        assert_eq!(v["profile"]["name"], serde_json::Value::Null);
        assert_eq!(v["profile"]["plan"], "pro");
        assert_eq!(redacted, vec!["/email", "/profile/name"]);
        let (v, redacted) = opened(&**node, bob).await;
        assert_eq!(v["email"], "bob@example.org");
        assert!(redacted.is_empty());
    }
    assert!(!raw_holds(h, &alice_key[0].wrapped).await, "key bytes gone");
    assert!(!raw_holds(h, b"alice@example.org").await);
    assert!(s
        .subject_keys(&["alice".into()])
        .await
        .expect("keys")
        .is_empty());

    // A later event of the same subject gets a new key.
    s.publish(vec![profile_event("alice", "alice@new.example", "Alice")])
        .await
        .expect("publish again");
    let again = claim_all(&*s).await;
    let fresh = again
        .iter()
        .find(|d| contains(&d.payload, b"\"user\":\"alice\"") && d.event_id != alice.event_id)
        .expect("new delivery");
    let (v, _) = opened(&*other, fresh).await;
    assert_eq!(v["email"], "alice@new.example");
    let new_key = s.subject_keys(&["alice".into()]).await.expect("keys");
    assert_ne!(new_key[0].wrapped, alice_key[0].wrapped);
}

async fn master_key_rotation_keeps_personal_fields_readable(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    // Created elsewhere, so the first publish here is sealed twice (the
    // first write finds marks its cached catalog did not have).
    h.reopen()
        .await
        .create_event_type(new_type("user.signed_up", Some(profile_schema()), &[]))
        .await
        .expect("create");
    s.keyring().set_master(master(1));
    s.publish(vec![
        profile_event("alice", "alice@example.org", "Alice"),
        profile_event("bob", "bob@example.org", "Bob"),
    ])
    .await
    .expect("publish");
    let before = h.raw_rows().await;
    let n = personal::rotate(&*s, &master(1), &master(2))
        .await
        .expect("rotate");
    assert_eq!(n, 2);
    assert_eq!(
        personal::rotate(&*s, &master(1), &master(2))
            .await
            .expect("rotate again"),
        0,
        "keys already under the new master are left alone"
    );
    let keys = s.all_subject_keys().await.expect("keys");
    assert!(keys.iter().all(|k| k.key_id == master(2).id()));
    // Events are untouched: their raw payloads are the same bytes.
    let payloads = |rows: &[Vec<u8>]| {
        let mut p: Vec<Vec<u8>> = rows
            .iter()
            .filter(|r| contains(r, b"lbenc:v1:"))
            .cloned()
            .collect();
        p.sort();
        p
    };
    assert_eq!(payloads(&before), payloads(&h.raw_rows().await));
    let ds = claim_all(&*s).await;
    // The old master no longer opens them: the attempt fails (and is
    // retried); nothing is sent as if the subject were erased.
    let e = personal::open(&*s, &ds[0].event_id, &ds[0].payload)
        .await
        .expect_err("a stale master key");
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    let other = h.reopen().await;
    other.keyring().set_master(master(2));
    for d in &ds {
        let (v, redacted) = opened(&*other, d).await;
        assert!(redacted.is_empty());
        let user = v["user"].as_str().expect("user").to_owned();
        assert_eq!(v["email"], format!("{user}@example.org"));
    }
}

/// A filter decides on the payload as stored: a personal field is its
/// sealed envelope there, so only `exists` can tell anything of it, on every
/// store alike (PostgreSQL's filter runs in SQL on the stored bytes).
async fn filters_see_personal_fields_sealed(h: &dyn Harness) {
    let s = h.store();
    s.create_event_type(new_type("user.signed_up", Some(profile_schema()), &[]))
        .await
        .expect("create");
    s.keyring().set_master(master(1));
    let cases = [
        (
            "email-exists",
            serde_json::json!({"path": "/email", "exists": true}),
            true,
        ),
        (
            "email-equals",
            serde_json::json!({"path": "/email", "equals": "alice@example.org"}),
            false,
        ),
        (
            "plan",
            serde_json::json!({"path": "/profile/plan", "equals": "pro"}),
            true,
        ),
        (
            "user",
            serde_json::json!({"path": "/user", "equals": "alice"}),
            true,
        ),
    ];
    let mut ids = Vec::new();
    for (name, f, _) in &cases {
        ids.push(filtered_handler(&*s, name, &["user.*"], f.clone()).await.id);
    }
    s.publish(vec![NewEvent {
        id: Some("pf1".into()),
        ..profile_event("alice", "alice@example.org", "Alice Liddell")
    }])
    .await
    .expect("publish");
    let found = s
        .lookup_event("pf1")
        .await
        .expect("lookup")
        .expect("stored");
    for ((name, _, want), id) in cases.iter().zip(&ids) {
        let got = found.handlers.iter().any(|d| &d.handler_id == id);
        assert_eq!(got, *want, "handler {name}");
    }
}

/// A sealed field opens only in its own event and field: an envelope
/// copied from the store into another event is sent as `null`, never
/// decrypted; a string that merely starts like an envelope is left alone.
async fn a_copied_envelope_does_not_open_in_another_event(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    s.create_event_type(new_type("user.signed_up", Some(profile_schema()), &[]))
        .await
        .expect("create");
    s.keyring().set_master(master(1));
    s.publish(vec![NewEvent {
        id: Some("ce1".into()),
        ..profile_event("alice", "alice@example.org", "Alice Liddell")
    }])
    .await
    .expect("publish");
    let ds = claim_all(&*s).await;
    let d = ds.iter().find(|d| d.event_id == "ce1").expect("delivery");
    let (v, redacted) = opened(&*s, d).await;
    assert_eq!(
        (v["email"].as_str(), redacted.len()),
        (Some("alice@example.org"), 0)
    );
    // The same stored bytes as another event's payload.
    let o = personal::open(&*s, "ce2", &d.payload)
        .await
        .expect("open")
        .expect("envelopes");
    let v: serde_json::Value = serde_json::from_slice(&o.payload).expect("json");
    assert_eq!(v["email"], serde_json::Value::Null);
    assert_eq!(o.redacted, vec!["/email", "/profile/name"]);
    assert!(!contains(&o.payload, b"alice@example.org"));
    // Not an envelope: sent as published.
    assert_eq!(
        personal::open(&*s, "ce3", br#"{"note":"lbenc:v1:hello"}"#)
            .await
            .expect("open"),
        None
    );
}

/// Issue 15 finding: a payload with personal fields went through
/// `serde_json::Value` at publish and delivery, so receivers got other
/// bytes than the publisher sent (key order, spacing, escapes, and numbers:
/// `1e2` came back as `100.0`). Only the personal values' own text is
/// replaced, by its envelope at rest and by `null` after erasure.
async fn personal_payloads_are_delivered_as_the_published_bytes(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let schema = serde_json::json!({
        "type": "object",
        "x-lanebus-subject": "/id",
        "properties": {
            "id": {"type": ["string", "number"]},
            "email": {"x-lanebus-personal": true},
            "score": {"x-lanebus-personal": true},
            "profile": {"properties": {
                "name": {"x-lanebus-personal": true},
                "address": {"x-lanebus-personal": true}
            }}
        }
    });
    s.create_event_type(new_type("user.signed_up", Some(schema), &[]))
        .await
        .expect("create");
    s.keyring().set_master(master(1));
    let published: [(&str, &[u8]); 2] = [
        (
            "rb1",
            b"{ \"profile\" : {\"plan\":\"pro\" ,  \"name\":  \"Ren\\u00e9e \\ud83d\\ude00\\\"x\\\"\",\n  \
              \"address\" : { \"city\" : \"K\\u00f6ln\",\"zip\" :5.0E+1 } },\n\t\"id\":\"r\\u0065n\" , \
              \"n\": 1e2, \"email\" :\"ren@example.org\"  , \"score\":1E2}",
        ),
        (
            "rb2",
            b"{\"score\": 0.10, \"id\" : 1e2,\"email\":\"num@example.org\", \"z\":[1 , 2.50]}",
        ),
    ];
    s.publish(
        published
            .iter()
            .map(|(id, payload)| NewEvent {
                id: Some((*id).into()),
                event_type: "user.signed_up".into(),
                payload: payload.to_vec(),
                ..NewEvent::default()
            })
            .collect(),
    )
    .await
    .expect("publish");
    for plain in [
        &b"ren@example.org"[..],
        b"num@example.org",
        b"Ren\\u00e9e",
        b"K\\u00f6ln",
        b"5.0E+1",
        b"1E2",
    ] {
        assert!(
            !raw_holds(h, plain).await,
            "raw rows hold {}",
            String::from_utf8_lossy(plain)
        );
    }
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), 2);
    for (id, bytes) in published {
        let d = ds.iter().find(|d| d.event_id == id).expect("delivery");
        // At rest the bytes around each personal value are the published ones.
        if id == "rb1" {
            assert!(
                d.payload
                    .starts_with(b"{ \"profile\" : {\"plan\":\"pro\" ,  \"name\":  \"lbenc:v1:"),
                "{}",
                String::from_utf8_lossy(&d.payload)
            );
        }
        let o = personal::open(&*s, id, &d.payload)
            .await
            .expect("open")
            .expect("envelopes");
        assert!(o.redacted.is_empty());
        assert_eq!(
            String::from_utf8_lossy(&o.payload),
            String::from_utf8_lossy(bytes),
            "delivered bytes of {id}"
        );
    }
    // Erased: `null` in place of each value, the rest as published.
    let subject = s
        .all_subject_keys()
        .await
        .expect("keys")
        .into_iter()
        .map(|k| k.subject)
        .find(|k| k != "ren")
        .expect("the numeric subject");
    assert!(personal::forget_subject(&*s, "ren").await.expect("forget"));
    let d = ds.iter().find(|d| d.event_id == "rb1").expect("delivery");
    let o = personal::open(&*s, "rb1", &d.payload)
        .await
        .expect("open")
        .expect("envelopes");
    assert_eq!(
        String::from_utf8_lossy(&o.payload),
        "{ \"profile\" : {\"plan\":\"pro\" ,  \"name\":  null,\n  \
         \"address\" : null },\n\t\"id\":\"r\\u0065n\" , \
         \"n\": 1e2, \"email\" :null  , \"score\":null}"
    );
    assert_eq!(
        o.redacted,
        vec!["/profile/name", "/profile/address", "/email", "/score"]
    );
    let d = ds.iter().find(|d| d.event_id == "rb2").expect("delivery");
    let o = personal::open(&*s, "rb2", &d.payload)
        .await
        .expect("open")
        .expect("envelopes");
    assert_eq!(o.payload.as_ref(), published[1].1, "subject {subject}");
}

/// Break-it finding (issue 15): delivery takes every unescaped payload
/// string reading as an envelope (`lbenc:v1:`, base64url, `:`, base64) for
/// one, in any event, sealed or not. A publisher's (or its end user's)
/// string `"lbenc:v1:YQ:AAAA"` in an uncataloged event was stored as sent
/// and then failed every attempt on a node without a master key (dead
/// letter, and again on replay), or was sent as `null` with
/// `lanebus-redacted` on one with a key: not the published bytes. Such a
/// string is refused at publish (`publish` and `publish_in`); written
/// with an escape, as a key, or not base64 after the prefix, it is data.
async fn a_string_reading_as_an_envelope_is_refused_at_publish(h: &dyn Harness) {
    let s = h.store();
    handler(&*s, "all", &["*"]).await;
    let event = |id: &str, payload: &[u8]| NewEvent {
        id: Some(id.into()),
        event_type: "note.added".into(),
        payload: payload.to_vec(),
        ..NewEvent::default()
    };
    for payload in [
        &br#"{"note":"lbenc:v1:YQ:AAAA"}"#[..],
        br#"["x", {"deep": [1, "lbenc:v1:YWxpY2U:"]}]"#,
        br#""lbenc:v1::""#,
    ] {
        let shown = String::from_utf8_lossy(payload);
        let m = invalid_message(
            s.publish(vec![event("f1", payload)])
                .await
                .expect_err(&format!("publish of {shown}")),
        );
        assert!(m.contains("envelope"), "{m}");
        let e = h
            .publish_in_many(vec![vec![event("f1", payload)]], true)
            .await
            .expect_err(&format!("publish_in of {shown}"));
        assert!(matches!(e, StoreError::Invalid(_)), "{e:?}");
    }
    assert!(!raw_holds(h, b"lbenc:v1:").await, "nothing stored");
    // Data, delivered as published even by a node without a master key.
    let kept: [(&str, &[u8]); 4] = [
        ("k1", br#"{"note":"\u006cbenc:v1:YQ:AAAA"}"#),
        ("k2", br#"{"note":"lbenc:v1:hello"}"#),
        ("k3", br#"{"lbenc:v1:YQ:AAAA": 1}"#),
        ("k4", br#"{"note":"see lbenc:v1:YQ:AAAA"}"#),
    ];
    s.publish(kept.iter().map(|(id, p)| event(id, p)).collect())
        .await
        .expect("publish data");
    let ds = claim_all(&*s).await;
    assert_eq!(ds.len(), kept.len());
    for d in &ds {
        let opened = personal::open(&*s, &d.event_id, &d.payload)
            .await
            .expect("opens without a master key");
        assert_eq!(opened, None, "{}", d.event_id);
    }
}

/// Break-it finding (issue 15): every occurrence of a personal field was
/// sealed, a key given twice included, so one publish of a 1 MiB payload
/// repeating a personal key (`{"u":<256-byte subject>,"a":1,"a":1,...}`)
/// stored about 68 MiB (each 1-byte value an envelope of 394 bytes), with
/// an AES seal per occurrence at publish and an open per occurrence at
/// every delivery attempt (MongoDB refuses a document that large). A
/// personal field given more than once is refused (`422`), nothing
/// stored: its value is sealed once, and no occurrence stays in clear.
async fn a_personal_key_given_many_times_does_not_multiply_the_stored_payload(h: &dyn Harness) {
    let s = h.store();
    let schema = serde_json::json!({
        "type": "object",
        "x-lanebus-subject": "/u",
        "properties": {
            "u": {"type": "string"},
            "a": {"x-lanebus-personal": true},
            "p": {"properties": {"b": {"x-lanebus-personal": true}}}
        }
    });
    s.create_event_type(new_type("user.noted", Some(schema), &[]))
        .await
        .expect("create");
    s.keyring().set_master(master(1));
    let subject = "s".repeat(personal::MAX_SUBJECT_BYTES);
    let mut many = format!("{{\"u\":\"{subject}\"");
    while many.len() < (1 << 20) - 16 {
        many.push_str(",\"a\":1");
    }
    many.push('}');
    let event = |payload: &[u8]| NewEvent {
        event_type: "user.noted".into(),
        payload: payload.to_vec(),
        ..NewEvent::default()
    };
    for payload in [
        many.as_bytes(),
        br#"{"u":"x","a":"secret-1","a":"secret-2"}"#,
        br#"{"u":"x","p":{"b":"secret-1"},"p":{"b":"secret-2"}}"#,
        br#"{"u":"x","p":{"b":"secret-1","b":"secret-2"}}"#,
    ] {
        let m = invalid_message(
            s.publish(vec![event(payload)])
                .await
                .expect_err("a personal field given more than once"),
        );
        assert!(m.contains("more than once"), "{m}");
    }
    assert!(!raw_holds(h, b"lbenc:v1:").await, "nothing stored");
    assert!(!raw_holds(h, b"secret-").await);
    // Once each: sealed as usual; a repeated key that is not personal is
    // the publisher's business.
    s.publish(vec![event(
        br#"{"u":"x","u":"y","a":"secret-1","p":{"b":"secret-2"},"n":1,"n":2}"#,
    )])
    .await
    .expect("publish");
    assert!(!raw_holds(h, b"secret-").await);
    assert!(raw_holds(h, b"\"n\":1,\"n\":2").await);
}
