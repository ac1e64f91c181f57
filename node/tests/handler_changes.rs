//! Handlers that change under their deliveries: a `410 Gone` disables the
//! handler and `POST /v1/handlers/{id}/enable` resumes it; a handler
//! disabled while a delivery waits for its retry is not attempted again; a
//! handler deleted while attempts wait for its concurrency slot gets no
//! further request; deliveries a late publish leaves for a deleted handler
//! are discarded (PostgreSQL race, and its outcome simulated on SQLite).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use common::{start_node, Api, Backend, TestDb};
use lanebus_node::receiver::{Action, Expected, Receiver, Rule};
use lanebus_store::{HandlerState, NewEvent, NewHandler, Store};
use serde_json::{json, Value};

/// Registers a handler through the API with `extra` fields; returns (id, secret).
async fn create(
    api: &Api,
    name: &str,
    url: &str,
    extra: Value,
) -> anyhow::Result<(String, String)> {
    let mut body = json!({"name": name, "url": url, "event_types": ["*"], "timeout_ms": 5000});
    for (k, v) in extra.as_object().context("extra is an object")? {
        body[k] = v.clone();
    }
    let (status, body) = api.post("/v1/handlers", body).await?;
    ensure!(status == 201, "create handler {name}: {status} {body}");
    Ok((
        body["id"].as_str().context("id")?.to_string(),
        body["secret"].as_str().context("secret")?.to_string(),
    ))
}

fn keyed_events(prefix: &str, n: usize, keys: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            json!({"id": format!("{prefix}-{i}"), "type": "push",
                   "key": format!("k{}", i % keys), "payload": {"n": i}})
        })
        .collect()
}

fn expected_of(handler: &str, events: &[Value]) -> Vec<Expected> {
    events
        .iter()
        .map(|e| Expected {
            handler: handler.into(),
            event_id: e["id"].as_str().unwrap_or_default().into(),
            key: e["key"].as_str().map(str::to_owned),
        })
        .collect()
}

async fn state_of(api: &Api, id: &str) -> anyhow::Result<String> {
    let (status, body) = api.get(&format!("/v1/handlers/{id}")).await?;
    ensure!(status == 200, "get handler: {status} {body}");
    Ok(body["state"].as_str().context("state")?.to_string())
}

async fn wait_state(api: &Api, id: &str, want: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let state = state_of(api, id).await?;
        if state == want {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "handler state {state}, expected {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls the store until `done(counts)` (deadline 30 s).
async fn wait_counts(
    store: &Arc<dyn Store>,
    what: &str,
    done: impl Fn(&lanebus_store::StoreCounts) -> bool,
) -> anyhow::Result<lanebus_store::StoreCounts> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let c = store.counts().await?;
        if done(&c) {
            return Ok(c);
        }
        ensure!(Instant::now() < deadline, "{what}: store counts {c:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn gone_disables_and_enable_resumes(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "gone").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    // One attempt only: a plain failure would dead-letter at once, a 410 must not.
    let (id, secret) = create(&api, "gone", &rx.url("gone"), json!({"max_attempts": 1})).await?;
    rx.set_secret("gone", &secret);
    rx.add_rule(Rule {
        handler: Some("gone".into()),
        key: None,
        action: Action::Status {
            status: 410,
            retry_after: None,
        },
    });
    let events = keyed_events("gone", 30, 3);
    let expected = expected_of("gone", &events);
    // One batch: events published while the handler is disabled create no
    // delivery for it (Store::set_handler_state).
    api.publish(&events, 30).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .any(|r| r.status == 410))
            .await,
        "no 410 answered"
    );
    rx.clear_rules();
    wait_state(&api, &id, "disabled").await?;

    // Kept, not attempted, not dead-lettered.
    let answered = rx.requests().len();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let reqs = rx.requests();
    ensure!(
        reqs.len() == answered,
        "{} requests after the handler was disabled",
        reqs.len() - answered
    );
    let accepted = rx.accepted_distinct();
    let c = node.store().counts().await?;
    ensure!(
        c.dead_letters == 0 && c.deliveries == (30 - accepted) as i64 && c.deliveries > 0,
        "while disabled: {c:?}, {accepted} accepted"
    );
    // (`lanebus_handlers_disabled`, the gauge, is process-wide and other
    // tests' nodes set it too: the counter is checked.)
    let metrics = api.metrics().await?;
    ensure!(
        metrics.contains(&format!(
            "lanebus_handlers_disabled_total{{handler=\"{id}\",reason=\"gone\"}}"
        )),
        "disabling is not in the metrics"
    );

    let (status, body) = api
        .post(&format!("/v1/handlers/{id}/enable"), json!({}))
        .await?;
    ensure!(
        status == 200 && body["state"] == "enabled",
        "enable: {status} {body}"
    );
    ensure!(
        rx.wait_accepted(expected.len(), Duration::from_secs(30))
            .await,
        "after enable: {:?}",
        rx.verdict(&expected)
    );
    let v = rx.verdict(&expected);
    ensure!(v.exact(), "{v:?}");
    // The attempt that got 410 was recorded: the next one is attempt 2.
    let reqs = rx.requests();
    for gone in reqs.iter().filter(|r| r.status == 410) {
        ensure!(gone.attempt == 1, "410 on attempt {}", gone.attempt);
        ensure!(
            reqs.iter()
                .any(|r| r.event_id == gone.event_id && r.accepted() && r.attempt == 2),
            "{} was not attempted again as attempt 2",
            gone.event_id
        );
    }
    ensure!(
        reqs.iter().all(|r| r.signature_ok == Some(true)),
        "a signature did not verify"
    );
    wait_counts(&node.store(), "after enable", |c| {
        c.deliveries == 0 && c.completions == 30 && c.dead_letters == 0
    })
    .await?;
    let (status, _) = api
        .post(
            "/v1/handlers/hdl_0123456789abcdef0123456789abcdef/enable",
            json!({}),
        )
        .await?;
    ensure!(
        status == 404,
        "enable of an unknown handler answered {status}"
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_disables_and_enable_resumes_sqlite() {
    gone_disables_and_enable_resumes(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gone_disables_and_enable_resumes_postgres() {
    gone_disables_and_enable_resumes(Backend::Postgres)
        .await
        .unwrap();
}

async fn disabled_while_retrying_stops_retries(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "disabled_retrying").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let (id, secret) = create(
        &api,
        "flaky",
        &rx.url("flaky"),
        json!({"max_attempts": 100}),
    )
    .await?;
    rx.set_secret("flaky", &secret);
    rx.add_rule(Rule {
        handler: Some("flaky".into()),
        key: None,
        action: Action::Status {
            status: 500,
            retry_after: None,
        },
    });
    let events = keyed_events("flaky", 3, 1);
    api.publish(&events, 3).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log.len() >= 3)
            .await,
        "no retries"
    );
    // Disabled by another node (here: the store directly); this node sees it
    // at its next catalog reload (1 s in tests).
    node.store()
        .set_handler_state(&id, HandlerState::Disabled)
        .await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let before = rx.requests().len();
    // Retries are at most 2 s apart in tests: 3 s without one means stopped.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = rx.requests().len();
    ensure!(
        after == before,
        "{} attempts after the handler was disabled",
        after - before
    );
    let c = node.store().counts().await?;
    ensure!(c.deliveries == 3 && c.dead_letters == 0, "{c:?}");
    rx.clear_rules();
    let (status, body) = api
        .post(&format!("/v1/handlers/{id}/enable"), json!({}))
        .await?;
    ensure!(status == 200, "enable: {status} {body}");
    let expected = expected_of("flaky", &events);
    ensure!(
        rx.wait_accepted(3, Duration::from_secs(30)).await,
        "after enable: {:?}",
        rx.verdict(&expected)
    );
    ensure!(rx.verdict(&expected).exact(), "{:?}", rx.verdict(&expected));
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_while_retrying_stops_retries_sqlite() {
    disabled_while_retrying_stops_retries(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disabled_while_retrying_stops_retries_postgres() {
    disabled_while_retrying_stops_retries(Backend::Postgres)
        .await
        .unwrap();
}

/// A receiver that counts requests as they arrive and never answers (the
/// attempt times out).
async fn hanging_receiver() -> anyhow::Result<(String, Arc<AtomicUsize>)> {
    let arrivals = Arc::new(AtomicUsize::new(0));
    let counter = arrivals.clone();
    let app = axum::Router::new().route(
        "/hang",
        axum::routing::post(move || {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(120)).await;
                "late"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/hang", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, arrivals))
}

async fn delete_stops_attempts_waiting_for_a_slot(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "delete_waiting").await?;
    let (url, arrivals) = hanging_receiver().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let (id, _) = create(
        &api,
        "hang",
        &url,
        json!({"max_in_flight": 1, "timeout_ms": 1000, "max_attempts": 100}),
    )
    .await?;
    // Unkeyed: all of them are handed out at once and wait for the one slot.
    let events: Vec<Value> = (0..20)
        .map(|i| json!({"id": format!("hang-{i}"), "type": "push", "payload": {"n": i}}))
        .collect();
    api.publish(&events, 20).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while arrivals.load(Ordering::SeqCst) == 0 {
        ensure!(Instant::now() < deadline, "no request arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, body) = api.delete(&format!("/v1/handlers/{id}")).await?;
    ensure!(status == 200, "delete: {status} {body}");
    let at_delete = arrivals.load(Ordering::SeqCst);
    // Three timeouts: each would free the slot for the next waiting attempt.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let later = arrivals.load(Ordering::SeqCst);
    ensure!(
        later == at_delete,
        "{} requests reached the receiver after the delete returned",
        later - at_delete
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held = node.state.board().held();
        let pending = node.store().counts().await?.deliveries;
        if held == 0 && pending == 0 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "after delete: {held} held, {pending} pending"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_stops_attempts_waiting_for_a_slot_sqlite() {
    delete_stops_attempts_waiting_for_a_slot(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_stops_attempts_waiting_for_a_slot_postgres() {
    delete_stops_attempts_waiting_for_a_slot(Backend::Postgres)
        .await
        .unwrap();
}

fn new_event(id: String, key: &str) -> NewEvent {
    NewEvent {
        id: Some(id),
        event_type: "push".into(),
        key: Some(key.into()),
        payload: b"{}".to_vec(),
    }
}

/// Waits until the node has discarded the orphans: nothing pending, nothing
/// completed, nothing sent, and the metric says how many.
async fn orphans_gone(
    node: &lanebus_node::NodeHandle,
    rx: &Receiver,
    handler_id: &str,
    n: usize,
) -> anyhow::Result<()> {
    let c = wait_counts(&node.store(), "orphans of a deleted handler", |c| {
        c.deliveries == 0
    })
    .await?;
    ensure!(c.completions == 0 && c.dead_letters == 0, "{c:?}");
    ensure!(rx.requests().is_empty(), "a deleted handler was sent to");
    let metrics = Api::new(&node.base_url()).metrics().await?;
    let line = format!("lanebus_orphan_deliveries_discarded_total{{handler=\"{handler_id}\"}} {n}");
    ensure!(metrics.contains(&line), "no {line:?} in the metrics");
    Ok(())
}

/// The race itself: a publish that read the handler before the delete and
/// commits after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_of_a_late_publish_are_discarded_postgres() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Postgres, "orphans").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let (id, _) = create(&api, "late", &rx.url("late"), json!({})).await?;
    let app = lanebus_store::postgres::PgStore::connect(&db.url).await?;
    let mut tx = app.pool().begin().await?;
    app.publish_in(
        &mut tx,
        (0..5)
            .map(|i| new_event(format!("late-{i}"), "k"))
            .collect(),
    )
    .await?;
    let (status, body) = api.delete(&format!("/v1/handlers/{id}")).await?;
    ensure!(
        status == 200 && body["discarded_deliveries"] == 0,
        "delete: {status} {body}"
    );
    tx.commit().await?;
    orphans_gone(&node, &rx, &id, 5).await?;
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// SQLite cannot race that way (one writer), so the race's outcome is made
/// by hand: delivery rows whose handler row is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphans_of_a_deleted_handler_are_discarded_sqlite() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "orphans").await?;
    let rx = Receiver::start().await?;
    let store = lanebus_store::sqlite::SqliteStore::connect(&db.url).await?;
    let h = store
        .create_handler(NewHandler {
            name: "late".into(),
            url: rx.url("late"),
            event_types: vec!["*".into()],
            max_attempts: 8,
            timeout_ms: 5000,
            max_in_flight: 64,
            secret: lanebus_store::generate_secret(),
        })
        .await?;
    store
        .publish(
            (0..5)
                .map(|i| new_event(format!("late-{i}"), "k"))
                .collect(),
        )
        .await?;
    sqlx::query("DELETE FROM handlers WHERE id = ?")
        .bind(&h.id)
        .execute(store.pool())
        .await?;
    store.pool().close().await;
    let node = start_node(&db.url).await?;
    orphans_gone(&node, &rx, &h.id, 5).await?;
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
