//! Session settings of the store's own PostgreSQL connections
//! (`postgres::SESSION_DEFAULTS`), each unless the URL sets it: JIT is off
//! (compiling the claim at every execution once its estimated cost passes
//! `jit_above_cost` cost 200-600 ms per claim); statements, lock waits and
//! idle transactions are bounded, and TCP keepalives find a vanished node
//! (issue 18 item 4). Needs `LANEBUS_TEST_POSTGRES_URL` (a superuser URL; a
//! database is created and dropped).

mod common;

use lanebus_store::postgres::PgStore;

/// A fresh database `name` on the test server: (admin pool, its URL).
async fn fresh_database(name: &str) -> (sqlx::PgPool, String) {
    let admin_url = std::env::var("LANEBUS_TEST_POSTGRES_URL").expect(
        "LANEBUS_TEST_POSTGRES_URL is not set: run the tests with scripts/test, which starts a \
         throwaway PostgreSQL",
    );
    let db = format!("{name}_{}", std::process::id());
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    drop_database(&admin, &db).await;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await
        .unwrap();
    (admin, common::with_database(&admin_url, &db))
}

async fn drop_database(admin: &sqlx::PgPool, db: &str) {
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(admin)
        .await
        .unwrap();
}

/// An unkeyed event `id` of type `t.x`.
fn event(id: &str) -> lanebus_store::NewEvent {
    lanebus_store::NewEvent {
        id: Some(id.into()),
        event_type: "t.x".into(),
        key: None,
        payload: b"{}".to_vec(),
        deliver_at: None,
        expected_seq: None,
    }
}

/// `url` with the session `options` (URL-encoded) appended.
fn with_options(url: &str, options: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options={options}")
}

#[tokio::test]
async fn the_store_turns_jit_off_unless_the_url_sets_it() {
    let (admin, url) = fresh_database("lanebus_jit").await;
    let jit = |store: &PgStore| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>("SHOW jit")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let store = PgStore::connect(&url).await.unwrap();
    assert_eq!(jit(&store).await, "off");
    let store = PgStore::connect(&with_options(&url, "-c%20jit%3Don"))
        .await
        .unwrap();
    assert_eq!(jit(&store).await, "on");
    drop(store);
    drop_database(&admin, &format!("lanebus_jit_{}", std::process::id())).await;
}

#[tokio::test]
async fn the_store_bounds_statements_unless_the_url_sets_it() {
    let (admin, url) = fresh_database("lanebus_bounds").await;
    let settings = |store: PgStore| async move {
        let mut out = Vec::new();
        for name in [
            "statement_timeout",
            "lock_timeout",
            "idle_in_transaction_session_timeout",
            "tcp_keepalives_idle",
            "tcp_keepalives_interval",
            "tcp_keepalives_count",
        ] {
            let v: String = sqlx::query_scalar(&format!("SHOW {name}"))
                .fetch_one(store.pool())
                .await
                .unwrap();
            out.push(v);
        }
        out
    };
    let store = PgStore::connect(&url).await.unwrap();
    assert_eq!(
        settings(store).await,
        ["30s", "10s", "1min", "30", "10", "3"],
        "statement, lock, idle-in-transaction timeouts; keepalive idle, interval, count"
    );
    let store = PgStore::connect(&with_options(
        &url,
        "-c%20statement_timeout%3D5s%20-c%20lock_timeout%3D0",
    ))
    .await
    .unwrap();
    assert_eq!(
        settings(store).await[..2],
        ["5s", "0"],
        "the URL's statement and lock timeouts win"
    );
    drop_database(&admin, &format!("lanebus_bounds_{}", std::process::id())).await;
}

/// A lock wait cut by `lock_timeout` (SQLSTATE `55P03`) and a statement cut
/// by `statement_timeout` (`57014`) are [`StoreError::Timeout`], which the
/// API answers with `503 store_unavailable` (before, they were `Database`:
/// `500 internal`).
#[tokio::test]
async fn lock_and_statement_timeouts_are_timeouts() {
    use lanebus_store::{HandlerState, NewHandler, Store, StoreError};
    let (admin, url) = fresh_database("lanebus_timeouts").await;
    let store = PgStore::connect(&with_options(&url, "-c%20lock_timeout%3D100ms"))
        .await
        .unwrap();
    let h = store
        .create_handler(NewHandler {
            name: "locked".into(),
            url: "http://127.0.0.1:9/hook".into(),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms: 1_000,
            max_in_flight: 1,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await
        .unwrap();
    // Another session holds the handler's row lock: the store's lock wait
    // ends by lock_timeout, then (lock_timeout off) by statement_timeout.
    let other = sqlx::PgPool::connect(&url).await.unwrap();
    let mut tx = other.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM handlers WHERE id = $1 FOR UPDATE")
        .bind(&h.id)
        .execute(&mut *tx)
        .await
        .unwrap();
    let by_statement = PgStore::connect(&with_options(
        &url,
        "-c%20lock_timeout%3D0%20-c%20statement_timeout%3D100ms",
    ))
    .await
    .unwrap();
    for (store, cut_by) in [
        (&store, "lock_timeout"),
        (&by_statement, "statement_timeout"),
    ] {
        let err = store
            .change_handler_state(&h.id, HandlerState::Disabled, "test")
            .await
            .expect_err("the row is locked");
        assert!(matches!(err, StoreError::Timeout(_)), "{cut_by}: {err:?}");
    }
    tx.rollback().await.unwrap();
    assert!(
        store
            .change_handler_state(&h.id, HandlerState::Disabled, "test")
            .await
            .expect("unlocked")
            .changed(),
        "nothing was changed while the row was locked"
    );
    drop((store, by_statement, other));
    drop_database(&admin, &format!("lanebus_timeouts_{}", std::process::id())).await;
}

/// Connections the server ended while they were idle (a restart,
/// `pg_terminate_backend`) are replaced: a publish right after runs again
/// on a new connection (the group writer keeps its connection between
/// groups, untested; its write fails on the lost session and runs again on
/// a new one), and claims and reads, after `postgres::PING_IDLE` (their
/// connections are pinged only after that time unused), go on without an
/// error.
#[tokio::test]
async fn connections_ended_while_idle_are_replaced_before_use() {
    use lanebus_store::{LaneClaim, Store};
    let (admin, url) = fresh_database("lanebus_idle_ended").await;
    let store = PgStore::connect(&url).await.unwrap();
    store
        .create_handler(common::new_handler("h", &["t.*"]))
        .await
        .unwrap();
    let claims: Vec<LaneClaim> = store
        .lane_rows()
        .await
        .unwrap()
        .iter()
        .map(|r| LaneClaim {
            lane: r.lane,
            epoch: r.epoch,
            after: Default::default(),
            limit: 1_000,
        })
        .collect();
    let claimed = |store: &PgStore| {
        let claims = claims.clone();
        let store = store.clone();
        async move {
            let batches = store.claim(&claims).await.expect("claim");
            batches.iter().map(|b| b.deliveries.len()).sum::<usize>()
        }
    };
    // Each of the store's pools has a connection open: the group writer's,
    // the claims', the store's own.
    store.publish(vec![event("before")]).await.unwrap();
    assert_eq!(claimed(&store).await, 1);
    assert_eq!(store.counts().await.unwrap().deliveries, 1);
    let ended: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'lanebus') t",
    )
    .fetch_one(&sqlx::PgPool::connect(&url).await.unwrap())
    .await
    .unwrap();
    assert!(ended >= 3, "{ended} sessions ended");
    store
        .publish(vec![event("at-once")])
        .await
        .expect("publish at once");
    tokio::time::sleep(lanebus_store::postgres::PING_IDLE + std::time::Duration::from_millis(300))
        .await;
    store.publish(vec![event("after")]).await.expect("publish");
    assert_eq!(claimed(&store).await, 3);
    assert_eq!(store.counts().await.expect("counts").deliveries, 3);
    drop(store);
    drop_database(
        &admin,
        &format!("lanebus_idle_ended_{}", std::process::id()),
    )
    .await;
}

/// The group writer keeps its connection out of its pool between groups
/// (so that sqlx's test of a returned connection costs no round trip per
/// group); closing the store's pool still ends every session of the
/// store, that one too.
#[tokio::test]
async fn closing_the_pool_ends_the_group_writers_session() {
    use lanebus_store::Store;
    let (admin, url) = fresh_database("lanebus_writer_closed").await;
    let db = format!("lanebus_writer_closed_{}", std::process::id());
    let store = PgStore::connect(&url).await.unwrap();
    let sessions = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(&db)
        .fetch_one(&admin)
        .await
        .unwrap()
    };
    for i in 0..3 {
        store
            .publish(vec![event(&format!("e{i}"))])
            .await
            .expect("publish");
    }
    assert!(sessions().await >= 1, "the store has sessions open");
    store.pool().close().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let open = sessions().await;
        if open == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{open} sessions of the store still open after its pool was closed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    drop(store);
    drop_database(&admin, &db).await;
}

/// A server that ends idle sessions (`idle_session_timeout`, SQLSTATE
/// `57P05`) ends the group writer's too while no publish comes: the next
/// publish still succeeds: the writer gives back a connection unused for
/// `PING_IDLE` (to its pool, which tests it), and a publish whose session
/// turns out ended (`57P05`) runs again on a new one.
#[tokio::test]
async fn a_publish_after_the_server_ended_the_idle_writer_session_succeeds() {
    use lanebus_store::Store;
    let (admin, url) = fresh_database("lanebus_writer_idle").await;
    let store = PgStore::connect(&with_options(&url, "-c%20idle_session_timeout%3D300"))
        .await
        .unwrap();
    store.publish(vec![event("first")]).await.expect("publish");
    tokio::time::sleep(lanebus_store::postgres::PING_IDLE + std::time::Duration::from_millis(500))
        .await;
    store
        .publish(vec![event("after")])
        .await
        .expect("publish after the server ended the idle session");
    drop(store);
    drop_database(
        &admin,
        &format!("lanebus_writer_idle_{}", std::process::id()),
    )
    .await;
}
