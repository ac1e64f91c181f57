//! `PgStore::publish_in` in the caller's transaction on PostgreSQL
//! (issue 13): no NOTIFY inside it, the wake-up after its commit. Needs
//! `LANEBUS_TEST_POSTGRES_URL` (a superuser URL, as `scripts/pg-start`
//! makes; a database is created and dropped per test).

mod common;

use lanebus_store::postgres::CHANNEL;
use lanebus_store::NewEvent;
use sqlx::postgres::PgListener;

fn event(id: &str, key: Option<&str>) -> NewEvent {
    NewEvent {
        id: Some(id.into()),
        event_type: "t.x".into(),
        key: key.map(Into::into),
        payload: b"{}".to_vec(),
        deliver_at: None,
    }
}

/// The next notification's payload on `listener`.
async fn next_payload(listener: &mut PgListener) -> String {
    listener
        .recv()
        .await
        .expect("notification")
        .payload()
        .to_owned()
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
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(CHANNEL)
        .execute(&pool)
        .await
        .expect("marker");
    assert_eq!(
        next_payload(&mut listener).await,
        "marker",
        "the caller's transaction sent a NOTIFY"
    );

    store.wake_after_commit(&out).await.expect("wake");
    assert_eq!(next_payload(&mut listener).await, "", "the wake-up");

    drop(listener);
    common::drop_pg_database(&admin, pool, &db).await;
}
