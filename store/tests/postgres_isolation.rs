//! `PgStore::publish_in` in the caller's transaction on PostgreSQL
//! (issue 13): no NOTIFY inside it, the wake-up after its commit; under
//! each isolation level, raw and through `PgStore::transaction`, whose
//! retry of serialization failures leaves nothing of a failed attempt. Needs
//! `LANEBUS_TEST_POSTGRES_URL` (a superuser URL, as `scripts/pg-start`
//! makes; a database is created and dropped per test).

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use futures::FutureExt;

use lanebus_store::postgres::{Isolation, PgStore, TxError, CHANNEL};
use lanebus_store::{lane_of_event, Lane, NewEvent, Store};
use sqlx::postgres::PgListener;
use sqlx::PgPool;

const LEVELS: [(Isolation, &str); 3] = [
    (Isolation::ReadCommitted, "read committed"),
    (Isolation::RepeatableRead, "repeatable read"),
    (Isolation::Serializable, "serializable"),
];

fn event(id: &str, key: Option<&str>) -> NewEvent {
    NewEvent {
        id: Some(id.into()),
        event_type: "t.x".into(),
        key: key.map(Into::into),
        payload: b"{}".to_vec(),
        deliver_at: None,
        expected_seq: None,
    }
}

/// The next notification's payload on `listener` (within a minute).
/// The payload of a wake-up naming the lanes of `events` (id, key).
fn lanes_payload(store: &PgStore, events: &[(&str, Option<&str>)]) -> String {
    let lanes: BTreeSet<Lane> = events
        .iter()
        .map(|(id, key)| lane_of_event(*key, id, store.lanes()))
        .collect();
    let named: Vec<String> = lanes.iter().map(Lane::to_string).collect();
    named.join(",")
}

async fn next_payload(listener: &mut PgListener) -> String {
    tokio::time::timeout(std::time::Duration::from_secs(60), listener.recv())
        .await
        .expect("a notification within a minute")
        .expect("notification")
        .payload()
        .to_owned()
}

/// Sends a marker NOTIFY and asserts (else panics with `what`) that it is
/// the next notification `listener` gets: nothing was sent before it.
async fn nothing_before_a_marker(pool: &PgPool, listener: &mut PgListener, what: &str) {
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(CHANNEL)
        .execute(pool)
        .await
        .expect("marker");
    assert_eq!(next_payload(listener).await, "marker", "{what}");
}

/// The caller's transaction sends no NOTIFY (so its commit does not take
/// PostgreSQL's notify-queue lock): the first notification a listener gets
/// after the caller committed is a marker sent after that commit, not a
/// wake-up from the commit. `wake_after_commit` then sends one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_in_sends_no_notify_from_the_callers_transaction() {
    let db = format!("lanebus_iso_notify_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let mut listener = PgListener::connect_with(&pool).await.expect("listener");
    listener.listen(CHANNEL).await.expect("listen");

    let mut tx = pool.begin().await.expect("begin");
    let out = store
        .publish_in(&mut tx, vec![event("e1", Some("k")), event("e2", None)])
        .await
        .expect("publish_in");
    assert_eq!(out.accepted, 2);
    tx.commit().await.expect("commit");
    nothing_before_a_marker(
        &pool,
        &mut listener,
        "the caller's transaction sent a NOTIFY",
    )
    .await;

    store.wake_after_commit(&out).await.expect("wake");
    assert_eq!(
        next_payload(&mut listener).await,
        lanes_payload(&store, &[("e1", Some("k")), ("e2", None)]),
        "the wake-up names the lanes published into"
    );

    drop(listener);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// Server settings that make a commit with `synchronous_commit = on` wait
/// for a standby that never comes (so a notifying commit holds
/// PostgreSQL's notify-queue lock until they are reset); every other
/// session commits with `synchronous_commit = local` meanwhile.
const NO_STANDBY: [&str; 3] = [
    "ALTER SYSTEM SET synchronous_commit = 'local'",
    "ALTER SYSTEM SET synchronous_standby_names = 'lanebus_test_no_standby'",
    "SELECT pg_reload_conf()",
];
const STANDBY_RESET: [&str; 3] = [
    "ALTER SYSTEM RESET synchronous_standby_names",
    "ALTER SYSTEM RESET synchronous_commit",
    "SELECT pg_reload_conf()",
];

/// Starts a transaction that NOTIFYs and commits on its own connection
/// and returns once its commit waits for the standby, holding the
/// notify-queue lock (a commit that did not wait yet, before the server
/// read the settings, is followed by another).
async fn hold_the_notify_lock(url: &str, pool: &PgPool) -> tokio::task::JoinHandle<()> {
    use sqlx::Connection;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let mut conn = sqlx::PgConnection::connect(url).await.expect("connect");
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut conn)
            .await
            .expect("pid");
        let holder = tokio::spawn(async move {
            sqlx::query("SET synchronous_commit = on")
                .execute(&mut conn)
                .await
                .expect("set");
            let mut tx = conn.begin().await.expect("begin");
            // A write, so the commit has a record to wait for the standby on.
            for sql in [
                "INSERT INTO held VALUES (1)",
                "SELECT pg_notify('elsewhere', '')",
            ] {
                sqlx::query(sql).execute(&mut *tx).await.expect(sql);
            }
            // Cancelled waits end with a warning, the commit done.
            let _ = tx.commit().await;
        });
        while !holder.is_finished() {
            let waits: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep'",
            )
            .bind(pid)
            .fetch_one(pool)
            .await
            .expect("pg_stat_activity");
            if waits > 0 {
                return holder;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no notifying commit waited for the standby"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

/// Serializes the tests that change the server's standby settings.
static STANDBY_SETTINGS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `body` while another session's notifying commit holds PostgreSQL's
/// notify-queue lock ([`hold_the_notify_lock`]) in database `db` of `pool`;
/// the server's settings are reset and the lock released whatever happens.
async fn under_the_notify_lock<F: std::future::Future>(
    admin: &PgPool,
    db: &str,
    pool: &PgPool,
    body: F,
) -> F::Output {
    let _only_us = STANDBY_SETTINGS.lock().await;
    let url = common::with_database(
        &std::env::var("LANEBUS_TEST_POSTGRES_URL").expect("url"),
        db,
    );
    sqlx::query("CREATE TABLE IF NOT EXISTS held (x int)")
        .execute(pool)
        .await
        .expect("held");
    for sql in NO_STANDBY {
        sqlx::query(sql).execute(admin).await.expect(sql);
    }
    let ran = std::panic::AssertUnwindSafe(async {
        let holder = hold_the_notify_lock(&url, pool).await;
        (holder, body.await)
    })
    .catch_unwind()
    .await;
    for sql in STANDBY_RESET {
        sqlx::query(sql).execute(admin).await.expect(sql);
    }
    let (holder, out) = ran.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    tokio::time::timeout(std::time::Duration::from_secs(60), holder)
        .await
        .expect("the held commit ends once the settings are reset")
        .expect("holder");
    out
}

/// The caller's commit does not need PostgreSQL's notify-queue lock: while
/// another session's notifying commit holds it (waiting for a synchronous
/// standby that never comes), a transaction that ran `publish_in` commits
/// within its 5 s `lock_timeout`. A NOTIFY in the caller's transaction
/// would make that commit wait for the lock and fail with `55P03`. Changes
/// server settings for the test's duration (reset at its end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_commit_does_not_wait_for_the_notify_lock() {
    let db = format!("lanebus_iso_lock_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let (published, committed) = under_the_notify_lock(&admin, &db, &pool, async {
        let mut tx = pool.begin().await.expect("begin");
        for sql in [
            "SET LOCAL synchronous_commit = local",
            "SET LOCAL lock_timeout = '5s'",
        ] {
            sqlx::query(sql).execute(&mut *tx).await.expect(sql);
        }
        let published = store
            .publish_in(&mut tx, vec![event("under-lock", Some("k"))])
            .await;
        (published, tx.commit().await)
    })
    .await;
    assert_eq!(published.expect("publish_in").accepted, 1);
    committed.expect("the caller's commit, while another holds the notify lock");
    let (events, _) = stored(&pool).await;
    assert!(events.contains("under-lock"));

    common::drop_pg_database(&admin, pool, &db).await;
}

/// Wake-ups after commits are coalesced: while one NOTIFY waits for the
/// notify-queue lock, further `wake_after_commit` calls return at once, and
/// once the lock is free exactly one more NOTIFY follows the first, naming
/// the lanes of every coalesced call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::async_yields_async)] // the body hands the first wake-up's task out
async fn wake_ups_after_commits_are_coalesced() {
    let db = format!("lanebus_iso_wakes_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let store = Arc::new(store);
    let mut listener = PgListener::connect_with(&pool).await.expect("listener");
    listener.listen(CHANNEL).await.expect("listen");
    let published = |lane: Lane| lanebus_store::PublishOutcome {
        accepted: 1,
        duplicates: 0,
        ids: vec!["e".into()],
        lanes: vec![lane],
    };
    let first = under_the_notify_lock(&admin, &db, &pool, async {
        let first = {
            let (store, published) = (store.clone(), published(7));
            tokio::spawn(async move { store.wake_after_commit(&published).await })
        };
        common::wait_for_a_lock_wait(&pool, "the first wake-up").await;
        for i in 0..10 {
            tokio::time::timeout(
                std::time::Duration::from_secs(60),
                store.wake_after_commit(&published(i % 3)),
            )
            .await
            .expect("a wake-up asked for while one is in flight returns at once")
            .expect("wake");
        }
        first
    })
    .await;
    first.await.expect("task").expect("the first wake-up");
    assert_eq!(next_payload(&mut listener).await, "7", "the first wake-up");
    assert_eq!(
        next_payload(&mut listener).await,
        "0,1,2",
        "the coalesced one names the lanes of all ten"
    );
    nothing_before_a_marker(
        &pool,
        &mut listener,
        "more than one NOTIFY for the ten coalesced wake-ups",
    )
    .await;

    drop(listener);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// Stored event ids, and the event ids of stored deliveries (one handler:
/// one delivery per event).
async fn stored(pool: &PgPool) -> (BTreeSet<String>, Vec<String>) {
    let events = sqlx::query_scalar("SELECT id FROM events")
        .fetch_all(pool)
        .await
        .expect("events");
    let deliveries = sqlx::query_scalar("SELECT event_id FROM deliveries ORDER BY event_id")
        .fetch_all(pool)
        .await
        .expect("deliveries");
    (events.into_iter().collect(), deliveries)
}

/// Event ids a lane owner claims: every lane fenced at epoch 1, read from
/// its start.
async fn claimed(store: &PgStore) -> BTreeSet<String> {
    common::claim_all(store)
        .await
        .into_iter()
        .map(|d| d.event_id)
        .collect()
}

fn set(ids: &[String]) -> BTreeSet<String> {
    ids.iter().cloned().collect()
}

/// Under each isolation level, `publish_in` on the caller's own transaction
/// and through `PgStore::transaction`: a commit stores the events, their
/// deliveries and the caller's own row, and they are claimed; a rollback
/// (or the closure's error) leaves nothing. The helper's transaction runs at
/// the level asked, and its commit is followed by one wake-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_in_commits_or_leaves_nothing_at_every_isolation_level() {
    let db = format!("lanebus_iso_levels_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("orders");
    let mut listener = PgListener::connect_with(&pool).await.expect("listener");
    listener.listen(CHANNEL).await.expect("listen");
    let mut committed = Vec::new();
    for (level, name) in LEVELS {
        let tag = name.replace(' ', "-");

        // The caller's own transaction, committed and rolled back.
        for commit in [true, false] {
            let id = format!("{tag}-raw-{commit}");
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {name}"))
                .execute(&mut *tx)
                .await
                .expect("set level");
            sqlx::query("INSERT INTO orders VALUES ($1)")
                .bind(&id)
                .execute(&mut *tx)
                .await
                .expect("order");
            let out = store
                .publish_in(&mut tx, vec![event(&id, Some(&tag))])
                .await
                .expect("publish_in");
            assert_eq!(out.accepted, 1, "{id}");
            if commit {
                tx.commit().await.expect("commit");
                committed.push(id);
            } else {
                tx.rollback().await.expect("rollback");
            }
        }

        // The helper, committed: its level, the caller's row, the events.
        let ids = [format!("{tag}-helper-keyed"), format!("{tag}-helper")];
        let seen = store
            .transaction(level, |t| {
                let (ids, tag) = (ids.clone(), tag.clone());
                Box::pin(async move {
                    let seen: String = sqlx::query_scalar("SHOW transaction_isolation")
                        .fetch_one(t.conn())
                        .await?;
                    sqlx::query("INSERT INTO orders VALUES ($1)")
                        .bind(&ids[0])
                        .execute(t.conn())
                        .await?;
                    let out = t
                        .publish(vec![event(&ids[0], Some(&tag)), event(&ids[1], None)])
                        .await?;
                    assert_eq!(out.accepted, 2);
                    Ok(seen)
                })
            })
            .await
            .expect("transaction");
        assert_eq!(seen, name, "the helper's isolation level");
        assert_eq!(
            next_payload(&mut listener).await,
            lanes_payload(&store, &[(&ids[0], Some(&tag)), (&ids[1], None)]),
            "{name}: the wake-up after the helper's commit names its lanes"
        );
        committed.extend(ids);

        // The helper, its closure failing after the publish: rolled back.
        let id = format!("{tag}-helper-failed");
        let failed = store
            .transaction(level, |t| {
                let id = id.clone();
                Box::pin(async move {
                    sqlx::query("INSERT INTO orders VALUES ($1)")
                        .bind(&id)
                        .execute(t.conn())
                        .await?;
                    t.publish(vec![event(&id, None)]).await?;
                    Err::<(), _>(TxError::Other("the caller's own error".into()))
                })
            })
            .await;
        assert!(
            matches!(failed, Err(TxError::Other(_))),
            "{name}: {failed:?}"
        );
    }

    let (events, deliveries) = stored(&pool).await;
    assert_eq!(events, set(&committed), "stored events");
    let mut want = committed.clone();
    want.sort();
    assert_eq!(deliveries, want, "one delivery per committed event");
    let orders: Vec<String> = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_all(&pool)
        .await
        .expect("orders");
    assert_eq!(
        orders.len(),
        LEVELS.len() * 2,
        "the caller's rows of the committed transactions: {orders:?}"
    );
    assert_eq!(claimed(&store).await, set(&committed), "claimed");

    drop(listener);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// Write skew under SERIALIZABLE: two on-call doctors each go off call if
/// the other is still on. Both read before either writes (a barrier in the
/// first attempt), so PostgreSQL fails one transaction with `40001`; the
/// helper runs it again, which then sees the other's commit and stays on
/// call. The failed attempt's event and deliveries are not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serialization_failure_is_retried_and_leaves_nothing() {
    let db = format!("lanebus_iso_skew_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    sqlx::query("CREATE TABLE on_call (name text PRIMARY KEY, on_call bool NOT NULL)")
        .execute(&pool)
        .await
        .expect("on_call");
    sqlx::query("INSERT INTO on_call VALUES ('alice', true), ('bob', true)")
        .execute(&pool)
        .await
        .expect("doctors");
    let store = Arc::new(store);
    let both_read = Arc::new(tokio::sync::Barrier::new(2));
    let mut tasks = Vec::new();
    for me in ["alice", "bob"] {
        let (store, both_read) = (store.clone(), both_read.clone());
        tasks.push(tokio::spawn(async move {
            let attempts = Arc::new(AtomicU32::new(0));
            let went_off = store
                .transaction(Isolation::Serializable, |t| {
                    let (attempts, both_read) = (attempts.clone(), both_read.clone());
                    Box::pin(async move {
                        let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                        let on: i64 =
                            sqlx::query_scalar("SELECT count(*) FROM on_call WHERE on_call")
                                .fetch_one(t.conn())
                                .await?;
                        if attempt == 1 {
                            both_read.wait().await;
                        }
                        let off = on >= 2;
                        if off {
                            sqlx::query("UPDATE on_call SET on_call = false WHERE name = $1")
                                .bind(me)
                                .execute(t.conn())
                                .await?;
                        }
                        let what = if off { "off" } else { "stays" };
                        t.publish(vec![event(&format!("{me}-{what}-{attempt}"), None)])
                            .await?;
                        Ok(off)
                    })
                })
                .await
                .expect("the helper retries the serialization failure");
            (me, went_off, attempts.load(Ordering::SeqCst))
        }));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await.expect("task"));
    }
    let (winner, loser) = match (runs[0], runs[1]) {
        (a, b) if a.1 && !b.1 => (a, b),
        (a, b) if b.1 && !a.1 => (b, a),
        other => panic!("exactly one doctor goes off call: {other:?}"),
    };
    assert_eq!(winner.2, 1, "the winner committed at once: {runs:?}");
    assert!(loser.2 >= 2, "the loser was retried: {runs:?}");

    let want = set(&[
        format!("{}-off-1", winner.0),
        format!("{}-stays-{}", loser.0, loser.2),
    ]);
    let (events, deliveries) = stored(&pool).await;
    assert_eq!(events, want, "no event of the failed attempt");
    assert_eq!(set(&deliveries), want, "no delivery of the failed attempt");
    assert_eq!(deliveries.len(), 2);
    assert_eq!(claimed(&store).await, want, "claimed");

    common::drop_pg_database(&admin, pool, &db).await;
}

/// Under REPEATABLE READ a publish of a key whose counter another
/// transaction raised and committed meanwhile fails with `40001` (the
/// counter's row changed after the snapshot); the helper runs the
/// transaction again and the key's events keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_raced_under_repeatable_read_is_retried() {
    let db = format!("lanebus_iso_key_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let store = Arc::new(store);

    let mut first = pool.begin().await.expect("begin");
    store
        .publish_in(&mut first, vec![event("first", Some("k"))])
        .await
        .expect("publish_in");

    let attempts = Arc::new(AtomicU32::new(0));
    let second = {
        let (store, attempts) = (store.clone(), attempts.clone());
        tokio::spawn(async move {
            store
                .transaction(Isolation::RepeatableRead, |t| {
                    attempts.fetch_add(1, Ordering::SeqCst);
                    Box::pin(async move {
                        // Take the snapshot before the first commits.
                        sqlx::query("SELECT 1").execute(t.conn()).await?;
                        t.publish(vec![event("second", Some("k"))]).await
                    })
                })
                .await
        })
    };
    common::wait_for_a_lock_wait(&pool, "the second publish").await;
    first.commit().await.expect("commit");
    let out = second
        .await
        .expect("task")
        .expect("the helper retries the serialization failure");
    assert_eq!(out.accepted, 1);
    assert_eq!(attempts.load(Ordering::SeqCst), 2, "one retry");
    let seqs: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, seq FROM deliveries WHERE key = 'k' ORDER BY seq")
            .fetch_all(&pool)
            .await
            .expect("seqs");
    assert_eq!(seqs, vec![("first".into(), 1), ("second".into(), 2)]);

    common::drop_pg_database(&admin, pool, &db).await;
}
