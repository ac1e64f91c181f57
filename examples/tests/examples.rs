//! The examples do what their docs say: on SQLite always, the outbox also
//! on PostgreSQL when `LANEBUS_TEST_POSTGRES_URL` is set (scripts/test sets
//! it).

use lanebus_examples::{embedded, outbox, receiver};

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("lanebus.db").display())
}

async fn outbox_commits_both_or_neither(url: &str) {
    let store = outbox::OutboxStore::open(url).await.unwrap();
    let stamp = chrono::Utc::now().timestamp_nanos_opt().unwrap();
    let order = |n: u32| outbox::Order {
        id: format!("{stamp}-{n}"),
        customer: "alice".into(),
        amount_cents: 100,
    };
    store.place(&order(1), false).await.unwrap();
    store.place(&order(2), true).await.unwrap();
    assert_eq!(store.stored(&order(1)).await.unwrap(), (true, true));
    assert_eq!(store.stored(&order(2)).await.unwrap(), (false, false));
    // A retried request: the row insert fails on its key and nothing of the
    // transaction stays, the event included.
    assert!(store.place(&order(1), false).await.is_err());
    assert_eq!(store.stored(&order(1)).await.unwrap(), (true, true));
}

#[tokio::test]
async fn outbox_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    outbox_commits_both_or_neither(&sqlite_url(&dir)).await;
}

#[tokio::test]
async fn outbox_on_postgres() {
    let Ok(base) = std::env::var("LANEBUS_TEST_POSTGRES_URL") else {
        eprintln!("LANEBUS_TEST_POSTGRES_URL not set: the PostgreSQL outbox example is not run");
        return;
    };
    // A database of its own, so the example's table meets no other test.
    let name = format!("lanebus_example_{}", std::process::id());
    let admin = sqlx::PgPool::connect(&base).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .unwrap();
    let mut url = url::Url::parse(&base).unwrap();
    url.set_path(&name);
    outbox_commits_both_or_neither(url.as_str()).await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_ledger_books_every_order_in_order_with_retries() {
    let dir = tempfile::tempdir().unwrap();
    // Twice on the same store: a second run delivers its own orders too.
    for _ in 0..2 {
        let r = embedded::run(&sqlite_url(&dir), 120, 4).await.unwrap();
        assert_eq!(embedded::distinct(&r.booked), 120);
        assert!(embedded::in_order(&r), "{:?}", r.booked);
        // Every customer's 10th, 20th, ... order failed once and was retried.
        let retried = r.booked.iter().filter(|(_, _, a)| *a == 2).count();
        assert_eq!(retried, 120 / 10, "{:?}", r.booked);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_verifies_signed_webhooks_and_refuses_forged_ones() {
    lanebus_node::webhook::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let events = receiver::run(&sqlite_url(&dir), 20).await.unwrap();
    assert_eq!(events.len(), 20);
    assert!(events
        .iter()
        .all(|e| e["type"] == "order.placed" && e["data"]["amount_cents"] == 100));

    // A forged request: right headers, signed with another secret.
    let own = lanebus_store::generate_secret();
    let inbox = receiver::Inbox::new(own.clone());
    let url = receiver::serve(inbox.clone()).await.unwrap();
    let other = lanebus_store::generate_secret();
    let now = chrono::Utc::now().timestamp();
    let body = br#"{"type":"order.placed","timestamp":"2026-12-01T00:00:00Z","data":{}}"#;
    let post = |ts: i64, secret: &str| {
        let sig = lanebus_node::webhook::sign(secret, "msg_1", ts, body).unwrap();
        reqwest::Client::new()
            .post(&url)
            .header("webhook-id", "msg_1")
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", sig)
            .body(body.to_vec())
            .send()
    };
    assert_eq!(post(now, &other).await.unwrap().status(), 401);
    assert_eq!(post(now - 600, &own).await.unwrap().status(), 401, "stale");
    let first = post(now, &own).await.unwrap();
    assert_eq!(first.status(), 200);
    let again = post(now, &own)
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    assert_eq!(again["duplicate"], true);
    assert_eq!(inbox.events().len(), 1);
    let missing = reqwest::Client::new()
        .post(&url)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 400);

    // The fencing token: a lower epoch for a lane than one seen is refused.
    let fenced = |id: &'static str, lane: u16, epoch: i64| {
        let sig = lanebus_node::webhook::sign(&own, id, now, body).unwrap();
        reqwest::Client::new()
            .post(&url)
            .header("webhook-id", id)
            .header("webhook-timestamp", now.to_string())
            .header("webhook-signature", sig)
            .header("lanebus-lane", lane.to_string())
            .header("lanebus-epoch", epoch.to_string())
            .body(body.to_vec())
            .send()
    };
    assert_eq!(fenced("msg_2", 7, 3).await.unwrap().status(), 200);
    let stale = fenced("msg_3", 7, 2).await.unwrap();
    assert_eq!(stale.status(), 409, "a deposed owner's epoch");
    let error = stale.json::<serde_json::Value>().await.unwrap();
    assert!(
        error["error"].as_str().unwrap().contains("below 3"),
        "{error}"
    );
    assert_eq!(
        fenced("msg_3", 8, 1).await.unwrap().status(),
        200,
        "another lane"
    );
    assert_eq!(
        fenced("msg_4", 7, 4).await.unwrap().status(),
        200,
        "a newer owner"
    );
    assert_eq!(fenced("msg_5", 7, 3).await.unwrap().status(), 409);
    // A replay of an accepted request with its (unsigned) epoch raised is a
    // duplicate and does not move the lane's epoch.
    let replayed = fenced("msg_4", 7, 99).await.unwrap();
    assert_eq!(replayed.status(), 200);
    assert_eq!(
        replayed.json::<serde_json::Value>().await.unwrap()["duplicate"],
        true
    );
    assert_eq!(
        fenced("msg_6", 7, 4).await.unwrap().status(),
        200,
        "the lane's epoch is still 4"
    );
    assert_eq!(inbox.events().len(), 5);
}
