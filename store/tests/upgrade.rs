//! Upgrades of an existing store: a database left at an older schema
//! version by an earlier build is brought to the current one by
//! [`lanebus_store::open`], its rows kept.
//!
//! Schema 5 (`migrations/*/0005_held_backfill.sql`): deliveries pending
//! when schema 4 added `deliveries.held` kept it NULL, even those
//! rescheduled (or delayed) before the upgrade, so their prompt completion
//! wrote no `late_completions` row and retention could prune an event a
//! recovery still needed. Version 5 marks every such row held.
//!
//! The schema-4 database is built as an earlier build left it: migration
//! files 1 to 4 (the same files the store applies) run on a fresh database,
//! `meta.schema_version` set to 4, then rows written with plain SQL as a
//! schema-4 node wrote them. PostgreSQL needs `LANEBUS_TEST_POSTGRES_URL` (a
//! superuser URL; a database is created and dropped per test).

mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use common::with_database;

/// Migrations 1 to 4 of each backend, as the store applies them.
const PG_SCHEMA_4: [&str; 4] = [
    include_str!("../migrations/postgres/0001_init.sql"),
    include_str!("../migrations/postgres/0002_handler_controls.sql"),
    include_str!("../migrations/postgres/0003_retention.sql"),
    include_str!("../migrations/postgres/0004_late_completions.sql"),
];
const SQLITE_SCHEMA_4: [&str; 4] = [
    include_str!("../migrations/sqlite/0001_init.sql"),
    include_str!("../migrations/sqlite/0002_handler_controls.sql"),
    include_str!("../migrations/sqlite/0003_retention.sql"),
    include_str!("../migrations/sqlite/0004_late_completions.sql"),
];

/// The pending deliveries of the schema-4 store: `(event id, attempts,
/// due in seconds from now, last error, held)`. Two never attempted, two
/// rescheduled before the upgrade to 4 (attempts made, due later, held
/// NULL), one rescheduled by a schema-4 node (held already set).
const PENDING: [(&str, i32, i64, Option<&str>, Option<bool>); 5] = [
    ("evt_plain_1", 0, 0, None, None),
    ("evt_plain_2", 0, 0, None, None),
    ("evt_retry_1", 1, 60, Some("HTTP 503"), None),
    ("evt_retry_2", 3, 600, Some("timeout after 5000 ms"), None),
    ("evt_held_4", 2, 120, Some("HTTP 500"), Some(true)),
];

const HANDLER: &str = "hdl_0123456789abcdef0123456789abcdef";

/// One pending delivery as read back: `(event id, attempts, due_at in
/// µs since the epoch, last error, held)`.
type Row = (String, i32, i64, Option<String>, Option<bool>);

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as i64
}

/// Checks the upgraded rows against [`PENDING`] (`before`: the same rows
/// read at schema 4): nothing lost or changed but `held`, every one held.
fn check_upgraded(before: &[Row], after: &[Row]) {
    assert_eq!(after.len(), PENDING.len(), "deliveries lost: {after:?}");
    for (b, a) in before.iter().zip(after) {
        assert_eq!(
            (&a.0, a.1, a.2, &a.3),
            (&b.0, b.1, b.2, &b.3),
            "a delivery changed beyond held"
        );
        assert_eq!(a.4, Some(true), "{} is not held after the upgrade", a.0);
    }
    let nulls = before.iter().filter(|r| r.4.is_none()).count();
    assert_eq!(
        nulls, 4,
        "the schema-4 store had held NULL rows: {before:?}"
    );
}

/// Reads the pending deliveries with `read` (a query giving [`Row`]s),
/// opens the store at `url` (which applies the pending migrations), checks
/// it is at schema 5, and reads them again: `(before, after)`.
async fn upgrade<DB>(url: &str, pool: &sqlx::Pool<DB>, read: &str) -> (Vec<Row>, Vec<Row>)
where
    DB: sqlx::Database,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    for<'q> <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    Row: for<'r> sqlx::FromRow<'r, DB::Row>,
    (String,): for<'r> sqlx::FromRow<'r, DB::Row>,
{
    let before: Vec<Row> = sqlx::query_as(read).fetch_all(pool).await.expect("rows");
    let store = lanebus_store::open(url)
        .await
        .expect("upgrade to 5 and later");
    assert_eq!(store.counts().await.expect("counts").deliveries, 5);
    let (version,): (String,) =
        sqlx::query_as("SELECT value FROM meta WHERE key = 'schema_version'")
            .fetch_one(pool)
            .await
            .expect("version");
    let version: i64 = version.parse().expect("a number");
    assert!(version >= 5, "schema version {version} after the upgrade");
    let after: Vec<Row> = sqlx::query_as(read).fetch_all(pool).await.expect("rows");
    attempt_log_after_upgrade(&*store).await;
    (before, after)
}

/// Schema 6 (SQLite) and 7 (PostgreSQL) add the attempt log: a delivery
/// stored before reads with an empty one and keeps a failure recorded
/// after the upgrade.
async fn attempt_log_after_upgrade(store: &dyn lanebus_store::Store) {
    use lanebus_store::{AttemptError, DeliveryState, Epoch, FailedAttempt, LaneClaim, Reschedule};
    let log_of = |state: &DeliveryState| match state {
        DeliveryState::Pending { attempt_log, .. } => attempt_log.clone(),
        other => panic!("not pending: {other:?}"),
    };
    let lookup = || async {
        let e = store.lookup_event("evt_retry_1").await.expect("lookup");
        log_of(&e.expect("stored").handlers[0].state)
    };
    assert_eq!(lookup().await, vec![]);
    let claim = LaneClaim {
        lane: 0,
        epoch: Epoch(0),
        after: Default::default(),
        limit: 10,
    };
    let batch = store.claim(&[claim]).await.expect("claim");
    let d = batch[0]
        .deliveries
        .iter()
        .find(|d| d.event_id == "evt_retry_1")
        .expect("pending");
    let failure = FailedAttempt {
        attempt: 2,
        at: chrono::Utc::now(),
        status: None,
        error: Some(AttemptError::Timeout),
        duration_ms: 5000,
        body: None,
        body_withheld: false,
    };
    let r = Reschedule {
        id: d.id,
        lane: 0,
        epoch: Epoch(0),
        attempts: 2,
        due_at: chrono::Utc::now(),
        last_error: "timeout after 5000 ms".into(),
        failure: Some(failure.clone()),
    };
    assert_eq!(
        store.reschedule(&[r]).await.expect("reschedule"),
        vec![d.id]
    );
    assert_eq!(lookup().await, vec![failure]);
}

#[tokio::test]
async fn sqlite_schema_4_pending_deliveries_are_held_after_upgrade() {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr as _;

    let dir = std::env::temp_dir().join(format!("lanebus-upgrade-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("store.db");
    let url = format!("sqlite://{}", path.display());
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::from_str(&url)
                .expect("url")
                .create_if_missing(true),
        )
        .await
        .expect("open sqlite file");
    for sql in SQLITE_SCHEMA_4 {
        sqlx::raw_sql(sql).execute(&pool).await.expect("migration");
    }
    sqlx::raw_sql(
        "INSERT INTO meta (key, value) VALUES ('schema_version', '4'); \
         WITH RECURSIVE n(lane) AS (SELECT 0 UNION ALL SELECT lane + 1 FROM n WHERE lane + 1 < 8) \
         INSERT INTO lanes (lane, owner, epoch) SELECT lane, NULL, 0 FROM n; \
         INSERT INTO meta (key, value) VALUES ('lanes', '8');",
    )
    .execute(&pool)
    .await
    .expect("schema-4 meta");
    let now = now_us();
    sqlx::query(
        "INSERT INTO handlers (id, name, url, event_types, max_attempts, timeout_ms, \
         max_in_flight, secret, state, created_at) \
         VALUES (?1, 'h', 'https://example.com/hook', '[\"*\"]', 5, 5000, 10, \
         'whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3', 'enabled', ?2)",
    )
    .bind(HANDLER)
    .bind(now)
    .execute(&pool)
    .await
    .expect("handler");
    for (event, attempts, due_in_s, error, held) in PENDING {
        sqlx::query(
            "INSERT INTO events (id, type, key, lane, seq, payload, published_at) \
             VALUES (?1, 't.x', NULL, 0, NULL, X'7B7D', ?2)",
        )
        .bind(event)
        .bind(now)
        .execute(&pool)
        .await
        .expect("event");
        sqlx::query(
            "INSERT INTO deliveries (lane, handler_id, event_id, attempts, due_at, last_error, held) \
             VALUES (0, ?1, ?2, ?3, ?4, ?5, ?6)",
        )
        .bind(HANDLER)
        .bind(event)
        .bind(attempts)
        .bind(now + due_in_s * 1_000_000)
        .bind(error)
        .bind(held)
        .execute(&pool)
        .await
        .expect("delivery");
    }
    let read = "SELECT event_id, attempts, due_at, last_error, held FROM deliveries ORDER BY id";
    let (before, after) = upgrade(&url, &pool, read).await;
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
    check_upgraded(&before, &after);
}

#[tokio::test]
async fn postgres_schema_4_pending_deliveries_are_held_after_upgrade() {
    use sqlx::Connection as _;

    let admin_url = std::env::var("LANEBUS_TEST_POSTGRES_URL").expect(
        "LANEBUS_TEST_POSTGRES_URL is not set: run the tests with scripts/test, which starts a \
         throwaway PostgreSQL, or set it to a server where tests may create databases",
    );
    let db = format!("lanebus_up_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&admin_url)
        .await
        .expect("connect to the test server");
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&mut admin)
        .await
        .expect("create database");
    let url = with_database(&admin_url, &db);
    let pool = sqlx::PgPool::connect(&url).await.expect("connect");
    for sql in PG_SCHEMA_4 {
        sqlx::raw_sql(sql).execute(&pool).await.expect("migration");
    }
    sqlx::raw_sql(
        "INSERT INTO meta (key, value) VALUES ('schema_version', '4'), ('lanes', '8'); \
         INSERT INTO lanes (lane) SELECT generate_series(0, 7);",
    )
    .execute(&pool)
    .await
    .expect("schema-4 meta");
    sqlx::query(
        "INSERT INTO handlers (id, name, url, event_types, max_attempts, timeout_ms, \
         max_in_flight, secret, state) \
         VALUES ($1, 'h', 'https://example.com/hook', ARRAY['*'], 5, 5000, 10, \
         'whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3', 'enabled')",
    )
    .bind(HANDLER)
    .execute(&pool)
    .await
    .expect("handler");
    for (event, attempts, due_in_s, error, held) in PENDING {
        sqlx::query(
            "INSERT INTO events (id, type, lane, payload) VALUES ($1, 't.x', 0, '\\x7b7d')",
        )
        .bind(event)
        .execute(&pool)
        .await
        .expect("event");
        sqlx::query(
            "INSERT INTO deliveries (lane, handler_id, event_id, attempts, due_at, last_error, held) \
             VALUES (0, $1, $2, $3, now() + make_interval(secs => $4), $5, $6)",
        )
        .bind(HANDLER)
        .bind(event)
        .bind(attempts)
        .bind(due_in_s as f64)
        .bind(error)
        .bind(held)
        .execute(&pool)
        .await
        .expect("delivery");
    }
    let read = "SELECT event_id, attempts, (extract(epoch FROM due_at) * 1e6)::bigint, \
                last_error, held FROM deliveries ORDER BY id";
    let (before, after) = upgrade(&url, &pool, read).await;
    pool.close().await;
    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&mut admin)
        .await;
    let _ = admin.close().await;
    check_upgraded(&before, &after);
}
