//! Group commit on PostgreSQL, counted by the server: concurrent
//! single-event publishes share transactions and publish statements
//! (issue 13). Transactions are counted exactly as the distinct
//! `deliveries.xid` of unkeyed events (the publishing transaction's id),
//! statements by `pg_stat_statements`. Needs `LANEBUS_TEST_POSTGRES_URL` (a
//! superuser URL of a server with `pg_stat_statements` preloaded, as
//! `scripts/pg-start` makes; a database is created and dropped).

mod common;

use std::sync::Arc;

use lanebus_store::{NewEvent, Store};

const ROUNDS: usize = 4;

/// Publish statements run in the current database so far.
async fn publish_calls(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query LIKE '%INSERT INTO key_seqs%'",
    )
    .fetch_one(pool)
    .await
    .expect("read pg_stat_statements (preloaded by scripts/pg-start)")
}

/// `publishers` tasks publish `ROUNDS` single unkeyed events each, all at
/// once. Returns (publishes, transactions, statements).
async fn run(publishers: usize) -> (usize, i64, i64) {
    let db = format!("lanebus_group_{publishers}_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&pool)
        .await
        .expect("create extension pg_stat_statements");
    let calls_before = publish_calls(&pool).await;
    let store = Arc::new(store);
    let start = Arc::new(tokio::sync::Barrier::new(publishers));
    let mut tasks = Vec::new();
    for _ in 0..publishers {
        let (store, start) = (store.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            for _ in 0..ROUNDS {
                let e = NewEvent {
                    id: None,
                    event_type: "t.x".into(),
                    key: None,
                    payload: b"{}".to_vec(),
                    deliver_at: None,
                    expected_seq: None,
                };
                let out = store.publish(vec![e]).await.expect("publish");
                assert_eq!(out.accepted, 1);
            }
        }));
    }
    for t in tasks {
        t.await.expect("publisher");
    }
    let publishes = publishers * ROUNDS;
    let (deliveries, transactions): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT xid) FROM deliveries")
            .fetch_one(&pool)
            .await
            .expect("count deliveries");
    assert_eq!(deliveries, publishes as i64, "one delivery per event");
    let statements = publish_calls(&pool).await - calls_before;
    common::drop_pg_database(&admin, pool, &db).await;
    eprintln!(
        "{publishers} publishers: {publishes} publishes, {transactions} transactions, \
         {statements} publish statements"
    );
    (publishes, transactions, statements)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_single_event_publishes_share_transactions() {
    for publishers in [8, 64] {
        let (publishes, transactions, statements) = run(publishers).await;
        assert!(
            transactions < publishes as i64,
            "{publishers} publishers: {transactions} transactions for {publishes} publishes"
        );
        assert_eq!(
            statements, transactions,
            "one publish statement per transaction"
        );
    }
}

fn keyed(key: &str) -> NewEvent {
    NewEvent {
        id: None,
        event_type: "t.x".into(),
        key: Some(key.into()),
        payload: b"{}".to_vec(),
        deliver_at: None,
        expected_seq: None,
    }
}

/// A key's counter held by an open transaction elsewhere (a `publish_in`
/// not committed yet) holds back that key's publishers only: publishes of
/// other keys, queued behind the held key's publish, are written and
/// answered while it still waits, and it is stored once the transaction
/// commits. Before, the single writer waited on the lock (up to
/// `lock_timeout`, 10 s) with every later publish queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_held_elsewhere_holds_back_only_its_own_publishers() {
    let db = format!("lanebus_group_held_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let store = Arc::new(store);

    // The caller's transaction publishes on "held" and stays open.
    let mut tx = pool.begin().await.expect("begin");
    store
        .publish_in(&mut tx, vec![keyed("held")])
        .await
        .expect("publish_in");

    let held = {
        let store = store.clone();
        tokio::spawn(async move { store.publish(vec![keyed("held")]).await })
    };
    common::wait_for_a_lock_wait(&pool, "the held key's publish").await;

    let mut others = Vec::new();
    for i in 0..16 {
        let store = store.clone();
        others.push(tokio::spawn(async move {
            store.publish(vec![keyed(&format!("k{i}"))]).await
        }));
    }
    for o in others {
        let out = o.await.expect("publisher").expect("publish of another key");
        assert_eq!(out.accepted, 1);
        assert!(
            !held.is_finished(),
            "another key's publish was answered only after the held key's publish ended: {:?}",
            held.await
        );
    }

    tx.commit().await.expect("commit");
    let out = held
        .await
        .expect("publisher")
        .expect("the held key's publish, once the transaction committed");
    assert_eq!(out.accepted, 1);
    let seqs: Vec<i64> =
        sqlx::query_scalar("SELECT seq FROM deliveries WHERE key = 'held' ORDER BY seq")
            .fetch_all(&pool)
            .await
            .expect("seqs");
    assert_eq!(seqs, vec![1, 2], "the held key's events in commit order");
    common::drop_pg_database(&admin, pool, &db).await;
}

/// Statement calls, plans and `BEGIN`s run in the current database so far
/// (plans are counted by sessions with `pg_stat_statements.track_planning`).
async fn calls_plans_begins(pool: &sqlx::PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(calls) FILTER (WHERE query LIKE '%INSERT INTO key_seqs%'), 0)::bigint, \
                coalesce(sum(plans) FILTER (WHERE query LIKE '%INSERT INTO key_seqs%'), 0)::bigint, \
                coalesce(sum(calls) FILTER (WHERE query = 'BEGIN'), 0)::bigint \
         FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(pool)
    .await
    .expect("read pg_stat_statements (preloaded by scripts/pg-start)")
}

/// One publisher's single-event publishes, one group each: each group's
/// write is the publish statement alone (no `BEGIN`/`COMMIT` round trips)
/// and reuses one plan. Under `plan_cache_mode = auto` PostgreSQL planned a
/// one-event batch's statement anew at every call (bench/results/stmt.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_write_is_one_statement_planned_once() {
    const PUBLISHES: i64 = 20;
    let db = format!("lanebus_group_plan_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    // Sessions opened from now on count their plans: the group writer's
    // opens at its first write.
    for sql in [
        format!("ALTER DATABASE {db} SET pg_stat_statements.track_planning = on"),
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements".to_string(),
    ] {
        sqlx::query(&sql).execute(&pool).await.expect(&sql);
    }
    let (calls0, plans0, begins0) = calls_plans_begins(&pool).await;
    for i in 0..PUBLISHES {
        let out = store
            .publish(vec![keyed(&format!("k{i}"))])
            .await
            .expect("publish");
        assert_eq!(out.accepted, 1);
    }
    let (calls, plans, begins) = calls_plans_begins(&pool).await;
    assert_eq!(
        calls - calls0,
        PUBLISHES,
        "one publish statement per publish"
    );
    assert!(
        plans - plans0 <= 2,
        "{} plans for {PUBLISHES} publish statements",
        plans - plans0
    );
    assert_eq!(begins - begins0, 0, "no BEGIN around a group's write");
    common::drop_pg_database(&admin, pool, &db).await;
}
