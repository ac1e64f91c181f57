//! The transactional outbox (docs/design.md section 7, invariant 5): events
//! published inside the caller's transaction are delivered if and only if
//! the caller commits, and a transaction that commits late is not skipped by
//! the lane owners' claim cursor.

mod common;

use std::time::Duration;

use anyhow::ensure;
use common::{start_node, Api, Backend, TestDb};
use lanebus_store::{NewEvent, Store as _};
use lanebus_testkit::receiver::Receiver;

fn event(id: &str, key: &str) -> NewEvent {
    NewEvent {
        id: Some(id.into()),
        event_type: "invoice.paid".into(),
        key: Some(key.into()),
        payload: br#"{"n":1}"#.to_vec(),
        deliver_at: None,
        expected_seq: None,
    }
}

fn api_events(prefix: &str, n: usize, key: &str) -> Vec<serde_json::Value> {
    (0..n)
        .map(|i| serde_json::json!({"id": format!("{prefix}-{i}"), "type": "invoice.created", "key": key, "payload": {"i": i}}))
        .collect()
}

fn got(rx: &Receiver, id: &str) -> bool {
    rx.requests()
        .iter()
        .any(|r| r.event_id == id && r.accepted())
}

/// SQLite: a transaction holds the file's write lock while open, so other
/// publishers wait for it (documented on `SqliteStore::publish_in`); what is
/// checked here is commit → delivered, rollback → never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_in_delivers_on_commit_only_sqlite() {
    run_sqlite().await.unwrap();
}

async fn run_sqlite() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "outbox").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    // The application's own connection pool on the same file.
    let app = lanebus_store::sqlite::SqliteStore::connect(&db.url).await?;

    api.publish(&api_events("before", 10, "k-before"), 100)
        .await?;
    ensure!(
        rx.wait_accepted(10, Duration::from_secs(30)).await,
        "events before the transaction"
    );

    let mut tx = app.pool().begin_with("BEGIN IMMEDIATE").await?;
    app.publish_in(&mut tx, vec![event("late-commit", "k-late")])
        .await?;
    // While the transaction is open the event does not exist for anyone.
    let early = rx
        .wait_until(Duration::from_secs(1), |log| {
            log.iter().any(|r| r.event_id == "late-commit")
        })
        .await;
    ensure!(!early, "an event of an open transaction was delivered");
    tx.commit().await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .any(|r| r.event_id == "late-commit" && r.accepted()))
            .await,
        "committed event not delivered"
    );

    let mut tx = app.pool().begin_with("BEGIN IMMEDIATE").await?;
    app.publish_in(&mut tx, vec![event("rolled-back", "k-late")])
        .await?;
    tx.rollback().await?;
    api.publish(&api_events("after", 1, "k-late"), 100).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .any(|r| r.event_id == "after-0" && r.accepted()))
            .await,
        "event after the rollback not delivered"
    );
    ensure!(
        !got(&rx, "rolled-back"),
        "a rolled-back event was delivered"
    );
    let counts = node.store().counts().await?;
    ensure!(
        counts.events == 12,
        "store holds {} events, expected 12 (the rolled-back one must not exist)",
        counts.events
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// PostgreSQL: a transaction held open for 3 s while other events publish
/// and are delivered; its event is delivered after the commit (the claim
/// cursor re-reads from the oldest open transaction, so a late commit is not
/// skipped), and a rolled-back event never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_in_delivers_on_commit_only_postgres() {
    run_postgres().await.unwrap();
}

async fn run_postgres() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Postgres, "outbox").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    let app = lanebus_store::postgres::PgStore::connect(&db.url).await?;

    let opened = std::time::Instant::now();
    let mut tx = app.pool().begin().await?;
    app.publish_in(&mut tx, vec![event("late-commit", "k-late")])
        .await?;
    let mut tx_rb = app.pool().begin().await?;
    app.publish_in(&mut tx_rb, vec![event("rolled-back", "k-rb")])
        .await?;

    // Meanwhile, other events (other keys) publish and are delivered.
    let mut others = Vec::new();
    for k in 0..5 {
        others.extend(api_events(&format!("during-{k}"), 10, &format!("k-{k}")));
    }
    api.publish(&others, 10).await?;
    ensure!(
        rx.wait_accepted(others.len(), Duration::from_secs(30))
            .await,
        "events published during the open transaction"
    );
    ensure!(
        !got(&rx, "late-commit"),
        "an event of an open transaction was delivered"
    );

    tokio::time::sleep(Duration::from_secs(3).saturating_sub(opened.elapsed())).await;
    tx.commit().await?;
    tx_rb.rollback().await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .any(|r| r.event_id == "late-commit" && r.accepted()))
            .await,
        "the late commit was not delivered"
    );
    api.publish(&api_events("after", 1, "k-rb"), 100).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .any(|r| r.event_id == "after-0" && r.accepted()))
            .await,
        "event after the rollback not delivered"
    );
    ensure!(
        !got(&rx, "rolled-back"),
        "a rolled-back event was delivered"
    );
    let counts = node.store().counts().await?;
    ensure!(
        counts.events == 52,
        "store holds {} events, expected 52",
        counts.events
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// PostgreSQL: a node's own publishes (API, and `Store::publish` on the
/// node's store) wake its lanes in process and send no NOTIFY, which would
/// serialize their commits on PostgreSQL's notify lock; another process's
/// publishes, `publish_in` then `wake_after_commit` and `Store::publish`,
/// still wake the node through NOTIFY. The poll interval is a minute, so
/// every delivery here comes from a wake-up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_publishes_wake_in_process_others_by_notify_postgres() {
    own_publishes_postgres().await.unwrap();
}

async fn own_publishes_postgres() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Postgres, "own_wake").await?;
    let rx = Receiver::start().await?;
    let mut opts = common::test_options(&db.url);
    opts.poll_interval = Some(Duration::from_secs(60));
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    let mut outside = sqlx::postgres::PgListener::connect(&db.url).await?;
    outside.listen("lanebus").await?;

    for i in 0..10 {
        api.publish(&api_events(&format!("api-{i}"), 1, &format!("k-{i}")), 1)
            .await?;
    }
    // In a lane of its own: a claim for another event cannot pick it up.
    let lanes = node.store().lanes();
    let api_lanes: Vec<u16> = (0..10)
        .map(|i| lanebus_store::lane_of_key(&format!("k-{i}"), lanes))
        .collect();
    let key = (0..)
        .map(|i| format!("k-node-{i}"))
        .find(|k| !api_lanes.contains(&lanebus_store::lane_of_key(k, lanes)))
        .expect("a key in another lane");
    node.store().publish(vec![event("in-node", &key)]).await?;
    ensure!(
        rx.wait_accepted(11, Duration::from_secs(20)).await,
        "the node's own publishes were not delivered without polling"
    );
    let heard = tokio::time::timeout(Duration::from_millis(500), outside.recv()).await;
    ensure!(
        heard.is_err(),
        "a NOTIFY went out for a publish whose lanes this node runs: {heard:?}"
    );

    let app = lanebus_store::postgres::PgStore::connect(&db.url).await?;
    let mut tx = app.pool().begin().await?;
    let out = app
        .publish_in(&mut tx, vec![event("from-app-tx", "k-app")])
        .await?;
    tx.commit().await?;
    app.wake_after_commit(&out).await?;
    app.publish(vec![event("from-app", "k-app")]).await?;
    ensure!(
        rx.wait_accepted(13, Duration::from_secs(20)).await,
        "another process's publishes did not wake the node"
    );
    ensure!(
        got(&rx, "from-app-tx") && got(&rx, "from-app"),
        "both of the other process's events"
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// MongoDB: a transaction on a session of the store's client (`publish_in`)
/// held open while other events publish and are delivered; its event is
/// delivered after the commit (the lane's position counter orders commits,
/// so a late commit is not skipped), an aborted one leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_in_delivers_on_commit_only_mongodb() {
    run_mongodb().await.unwrap();
}

async fn run_mongodb() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Mongodb, "outbox").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    // The application's own store (and client) on the same database.
    let app = lanebus_store::mongodb::MongoStore::connect(&db.url).await?;

    let mut tx = app.client().start_session().await?;
    tx.start_transaction().await?;
    app.publish_in(&mut tx, vec![event("late-commit", "k-late")])
        .await?;
    let mut tx_ab = app.client().start_session().await?;
    tx_ab.start_transaction().await?;
    app.publish_in(&mut tx_ab, vec![event("aborted", "k-ab")])
        .await?;

    // Meanwhile, other events (other keys) publish and are delivered. They
    // must be in other lanes: publishers into one lane are serialized (the
    // open transaction holds the lane's position counter until it ends).
    let lanes = common::MONGODB_TEST_LANES;
    let held = [
        lanebus_store::lane_of_key("k-late", lanes),
        lanebus_store::lane_of_key("k-ab", lanes),
    ];
    for k in 0..3 {
        ensure!(
            !held.contains(&lanebus_store::lane_of_key(&format!("k-{k}"), lanes)),
            "k-{k} shares a lane with an open transaction"
        );
    }
    let mut others = Vec::new();
    for k in 0..3 {
        others.extend(api_events(&format!("during-{k}"), 5, &format!("k-{k}")));
    }
    api.publish(&others, 5).await?;
    ensure!(
        rx.wait_accepted(others.len(), Duration::from_secs(60))
            .await,
        "events published during the open transactions"
    );
    ensure!(
        !got(&rx, "late-commit") && !got(&rx, "aborted"),
        "an event of an open transaction was delivered"
    );

    tx.commit_transaction().await?;
    tx_ab.abort_transaction().await?;
    ensure!(
        rx.wait_until(Duration::from_secs(60), |log| log
            .iter()
            .any(|r| r.event_id == "late-commit" && r.accepted()))
            .await,
        "the late commit was not delivered"
    );
    api.publish(&api_events("after", 1, "k-ab"), 100).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(60), |log| log
            .iter()
            .any(|r| r.event_id == "after-0" && r.accepted()))
            .await,
        "event after the abort not delivered"
    );
    ensure!(!got(&rx, "aborted"), "an aborted event was delivered");
    let counts = node.store().counts().await?;
    ensure!(
        counts.events == 17,
        "store holds {} events, expected 17 (the aborted one must not exist)",
        counts.events
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
