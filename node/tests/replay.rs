//! Delayed delivery, bulk dead-letter replay by time range, and recovery
//! (issue 4, items 4 and 5), end to end: a node, a real webhook receiver,
//! PostgreSQL and SQLite.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use chrono::{SecondsFormat, Utc};
use common::{start_node, test_options, Api, Backend, Registered, TestDb};
use lanebus_testkit::receiver::{Action, Expected, Received, Receiver, Rule};
use serde_json::json;

fn rfc3339(t: chrono::DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn first_arrival(reqs: &[Received], event_id: &str) -> Option<f64> {
    reqs.iter()
        .find(|r| r.event_id == event_id)
        .map(|r| r.arrived_ms)
}

/// Per key, the sequence numbers of the accepted requests in arrival order
/// must grow.
fn in_order_per_key(reqs: &[&Received]) -> anyhow::Result<()> {
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for r in reqs {
        if let (Some(k), Some(s)) = (&r.key, r.sequence) {
            per_key.entry(k.clone()).or_default().push(s);
        }
    }
    for (k, seqs) in &per_key {
        ensure!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {k}: out of order {seqs:?}"
        );
    }
    Ok(())
}

/// `deliver_at` a few seconds ahead: not delivered before, delivered after;
/// the same key's next event waits behind it; another key and an unkeyed
/// event flow at once. The issue asks for one minute ahead; the property
/// (not before the time, at it, and the key waiting) does not depend on the
/// horizon, so the test uses 10 s to keep CI short (and long enough that
/// the undelayed events arrive before it on a loaded machine).
async fn deliver_at_waits_and_holds_its_key(backend: Backend) -> anyhow::Result<()> {
    const AHEAD_MS: i64 = 10_000;
    let db = TestDb::new(backend, "deliver_at").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("h", &rx.url("h"), &["*"], 3).await?;
    rx.set_secret("h", &h.secret);

    // A bad format is 400, too far ahead 422; nothing is stored.
    let (status, body) = api
        .post(
            "/v1/events",
            json!({"events": [{"type": "t.x", "payload": 1, "deliver_at": "tomorrow"}]}),
        )
        .await?;
    ensure!(
        status == 400 && body["error"]["code"] == "invalid_parameter",
        "{status} {body}"
    );
    let far = Utc::now() + chrono::TimeDelta::days(8);
    let (status, body) = api
        .post(
            "/v1/events",
            json!({"events": [{"type": "t.x", "payload": 1, "deliver_at": rfc3339(far)}]}),
        )
        .await?;
    ensure!(
        status == 422 && body["error"]["code"] == "invalid_event",
        "{status} {body}"
    );

    // The receiver's clock first: `due` is then no earlier than `due_ms`
    // however long this thread waits between the two reads.
    let due_ms = rx.now_ms() + AHEAD_MS as f64;
    let due = Utc::now() + chrono::TimeDelta::milliseconds(AHEAD_MS);
    api.publish(
        &[
            json!({"id": "late", "type": "t.x", "key": "k", "payload": 1, "deliver_at": rfc3339(due)}),
            json!({"id": "next", "type": "t.x", "key": "k", "payload": 2}),
            json!({"id": "other", "type": "t.x", "key": "j", "payload": 3}),
            json!({"id": "u-late", "type": "t.x", "payload": 4, "deliver_at": rfc3339(due)}),
            json!({"id": "u-now", "type": "t.x", "payload": 5}),
        ],
        10,
    )
    .await?;
    ensure!(
        rx.wait_until(Duration::from_secs(10), |log| {
            ["other", "u-now"]
                .iter()
                .all(|id| log.iter().any(|r| r.event_id == *id))
        })
        .await,
        "undelayed events were held up: {:?}",
        rx.requests()
    );
    ensure!(
        rx.wait_accepted(5, Duration::from_secs(60)).await,
        "delayed events not delivered: {:?}",
        rx.requests()
    );
    let reqs = rx.requests();
    for id in ["late", "next", "u-late"] {
        let at = first_arrival(&reqs, id).context("arrived")?;
        ensure!(
            at >= due_ms - 5.0,
            "{id} arrived at {at:.0} ms, before its time {due_ms:.0} ms"
        );
    }
    ensure!(
        first_arrival(&reqs, "late") < first_arrival(&reqs, "next"),
        "the key's next event overtook the delayed one: {reqs:?}"
    );
    for id in ["other", "u-now"] {
        let at = first_arrival(&reqs, id).context("arrived")?;
        ensure!(at < due_ms, "{id} waited for the delayed ones ({at:.0} ms)");
    }
    let v = rx.verdict(&[
        exp("h", "late", Some("k")),
        exp("h", "next", Some("k")),
        exp("h", "other", Some("j")),
        exp("h", "u-late", None),
        exp("h", "u-now", None),
    ]);
    ensure!(v.exact(), "{v:?}");
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

fn exp(handler: &str, id: &str, key: Option<&str>) -> Expected {
    Expected {
        handler: handler.into(),
        event_id: id.into(),
        key: key.map(Into::into),
    }
}

/// 500 dead letters (10 keys x 50), replayed in bulk by handler and time
/// range: all 500 arrive, in order per key; the count is returned.
async fn bulk_replay_by_time_range(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "bulk_replay").await?;
    let rx = Receiver::start().await?;
    let node = start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("h", &rx.url("h"), &["*"], 1).await?;
    rx.set_secret("h", &h.secret);
    rx.add_rule(Rule {
        handler: Some("h".into()),
        key: None,
        action: Action::Status {
            status: 500,
            retry_after: None,
        },
    });
    let since = Utc::now() - chrono::TimeDelta::seconds(1);
    let events: Vec<serde_json::Value> = (0..500)
        .map(|i| json!({"id": format!("dl-{i}"), "type": "t.x", "key": format!("k{}", i % 10), "payload": {"i": i}}))
        .collect();
    api.publish(&events, 250).await?;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (status, body) = api
            .get(&format!(
                "/admin/dead-letters?handler_id={}&limit=1000",
                h.id
            ))
            .await?;
        ensure!(status == 200, "{status} {body}");
        let n = body["dead_letters"].as_array().map_or(0, Vec::len);
        if n == 500 {
            break;
        }
        ensure!(Instant::now() < deadline, "only {n} of 500 dead letters");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let until = Utc::now() + chrono::TimeDelta::seconds(1);
    rx.clear_rules();
    let before = rx.requests().len();

    // A window before the failures replays nothing; a bad time is 400;
    // a time range without a handler is 422.
    let (status, body) = api
        .post(
            "/admin/dead-letters/replay",
            json!({"handler_id": h.id, "until": rfc3339(since)}),
        )
        .await?;
    ensure!(status == 200 && body["replayed"] == 0, "{status} {body}");
    let (status, body) = api
        .post(
            "/admin/dead-letters/replay",
            json!({"handler_id": h.id, "since": "yesterday"}),
        )
        .await?;
    ensure!(status == 400, "{status} {body}");
    let (status, body) = api
        .post(
            "/admin/dead-letters/replay",
            json!({"since": rfc3339(since)}),
        )
        .await?;
    ensure!(status == 422, "{status} {body}");

    let (status, body) = api
        .post(
            "/admin/dead-letters/replay",
            json!({"handler_id": h.id, "since": rfc3339(since), "until": rfc3339(until)}),
        )
        .await?;
    ensure!(status == 200 && body["replayed"] == 500, "{status} {body}");
    ensure!(
        rx.wait_until(Duration::from_secs(60), |log| {
            log[before..].iter().filter(|r| r.accepted()).count() >= 500
        })
        .await,
        "replayed dead letters not all delivered"
    );
    let reqs = rx.requests();
    let replayed: Vec<&Received> = reqs[before..].iter().collect();
    ensure!(
        replayed.len() == 500 && replayed.iter().all(|r| r.accepted()),
        "{} requests after the replay",
        replayed.len()
    );
    let mut ids: Vec<&str> = replayed.iter().map(|r| r.event_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    ensure!(ids.len() == 500, "{} distinct events", ids.len());
    in_order_per_key(&replayed)?;
    ensure!(
        api.dead_letters(&h.id).await?.is_empty(),
        "dead letters left"
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// Waits until the store holds `n` completions: the receiver's 2xx comes
/// before the node records the completion.
async fn wait_completions(node: &lanebus_node::NodeHandle, n: i64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.store().counts().await?.completions < n {
        ensure!(Instant::now() < deadline, "only {n} completions recorded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Recover since T delivers again exactly the events completed since T,
/// with `lanebus-replay: true`, the same event ids, in order per key.
async fn recover_since(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "recover").await?;
    let rx = Receiver::start().await?;
    let mut opts = test_options(&db.url);
    opts.retention.retention = Duration::from_secs(3600);
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("h", &rx.url("h"), &["*"], 3).await?;
    rx.set_secret("h", &h.secret);
    let batch = |prefix: &str| -> Vec<serde_json::Value> {
        (0..40)
            .map(|i| {
                let mut e =
                    json!({"id": format!("{prefix}-{i}"), "type": "t.x", "payload": {"i": i}});
                if i % 4 != 0 {
                    e["key"] = json!(format!("k{}", i % 5));
                }
                e
            })
            .collect()
    };
    api.publish(&batch("old"), 40).await?;
    ensure!(
        rx.wait_accepted(40, Duration::from_secs(30)).await,
        "old batch"
    );
    wait_completions(&node, 40).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Utc::now();
    tokio::time::sleep(Duration::from_millis(200)).await;
    api.publish(&batch("new"), 40).await?;
    ensure!(
        rx.wait_accepted(80, Duration::from_secs(30)).await,
        "new batch"
    );
    wait_completions(&node, 80).await?;
    let before = rx.requests().len();

    let path = format!("/v1/handlers/{}/recover", h.id);
    let (status, body) = api.post(&path, json!({"since": "noon"})).await?;
    ensure!(status == 400, "{status} {body}");
    let old = Utc::now() - chrono::TimeDelta::hours(2);
    let (status, body) = api.post(&path, json!({"since": rfc3339(old)})).await?;
    ensure!(
        status == 422
            && body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("retention")),
        "{status} {body}"
    );
    let (status, body) = api
        .post(
            "/v1/handlers/hdl_00000000000000000000000000000000/recover",
            json!({"since": rfc3339(t)}),
        )
        .await?;
    ensure!(status == 404, "{status} {body}");

    let (status, body) = api.post(&path, json!({"since": rfc3339(t)})).await?;
    ensure!(
        status == 200 && body["recovered"] == 40 && body["pruned"] == 0,
        "{status} {body}"
    );
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log.len() >= before + 40)
            .await,
        "recovery not delivered"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reqs = rx.requests();
    let again: Vec<&Received> = reqs[before..].iter().collect();
    ensure!(again.len() == 40, "{} requests after recovery", again.len());
    let mut ids: Vec<String> = again.iter().map(|r| r.event_id.clone()).collect();
    ids.sort();
    let mut want: Vec<String> = (0..40).map(|i| format!("new-{i}")).collect();
    want.sort();
    ensure!(ids == want, "recovered {ids:?}");
    for r in &again {
        ensure!(
            r.headers.get("lanebus-replay").map(String::as_str) == Some("true"),
            "no lanebus-replay header: {r:?}"
        );
        ensure!(r.signature_ok == Some(true), "bad signature: {r:?}");
    }
    ensure!(
        reqs[..before]
            .iter()
            .all(|r| !r.headers.contains_key("lanebus-replay")),
        "first deliveries marked as replays"
    );
    in_order_per_key(&again)?;
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// The body's `data` of `r`.
fn data_of(r: &Received) -> anyhow::Result<serde_json::Value> {
    let body: serde_json::Value = serde_json::from_str(&r.body)?;
    Ok(body["data"].clone())
}

/// A node with a master key, type `user.seen` whose `/email` is personal
/// (subject `/user`), and handler `h` on a receiver.
async fn personal_node(
    backend: Backend,
    name: &str,
) -> anyhow::Result<(TestDb, Receiver, lanebus_node::NodeHandle, Api, Registered)> {
    let db = TestDb::new(backend, name).await?;
    let rx = Receiver::start().await?;
    let mut opts = test_options(&db.url);
    opts.retention.retention = Duration::from_secs(3600);
    opts.master_key = Some(std::sync::Arc::new(
        lanebus_store::personal::MasterKey::from_bytes(&[5; 32])?,
    ));
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let schema = json!({"x-lanebus-subject": "/user", "properties": {
        "user": {"type": "string"},
        "email": {"type": "string", "x-lanebus-personal": true}}});
    let (status, body) = api
        .post(
            "/v1/event-types",
            json!({"name": "user.seen", "schema": schema}),
        )
        .await?;
    ensure!(status == 201, "{status} {body}");
    let h = api.create_handler("h", &rx.url("h"), &["*"], 100).await?;
    rx.set_secret("h", &h.secret);
    Ok((db, rx, node, api, h))
}

/// Personal fields (crypto-shredding) end to end: receivers get them
/// decrypted, signed over the bytes sent; once a subject is erased
/// (`DELETE /v1/subjects/{id}`), its deliveries still pending, and a
/// recover of its events, send its fields as `null` with header
/// `lanebus-redacted`, and succeed; another subject's are untouched.
async fn personal_fields_are_redacted_after_erasure(backend: Backend) -> anyhow::Result<()> {
    let (db, rx, node, api, h) = personal_node(backend, "shred").await?;
    common::fail_always(&rx, "h");
    let t = Utc::now();
    api.publish(
        &[
            json!({"id": "a1", "type": "user.seen", "key": "alice",
                   "payload": {"user": "alice", "email": "alice@example.org"}}),
            json!({"id": "b1", "type": "user.seen", "key": "bob",
                   "payload": {"user": "bob", "email": "bob@example.org"}}),
        ],
        2,
    )
    .await?;
    // Failing attempts while the keys exist: decrypted, signed.
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| {
            ["a1", "b1"]
                .iter()
                .all(|id| log.iter().any(|r| r.event_id == *id))
        })
        .await,
        "no attempts: {:?}",
        rx.requests()
    );
    for r in rx.requests() {
        let user = if r.event_id == "a1" { "alice" } else { "bob" };
        ensure!(
            data_of(&r)?["email"] == format!("{user}@example.org"),
            "{r:?}"
        );
        ensure!(r.signature_ok == Some(true), "bad signature: {r:?}");
        ensure!(!r.headers.contains_key("lanebus-redacted"), "{r:?}");
    }
    let (status, body) = api.delete("/v1/subjects/alice").await?;
    ensure!(status == 204, "{status} {body}");
    rx.clear_rules();
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| {
            ["a1", "b1"]
                .iter()
                .all(|id| log.iter().any(|r| r.event_id == *id && r.accepted()))
        })
        .await,
        "pending deliveries not delivered: {:?}",
        rx.requests()
    );
    let check = |r: &Received| -> anyhow::Result<()> {
        ensure!(r.signature_ok == Some(true), "bad signature: {r:?}");
        let data = data_of(r)?;
        if r.event_id == "a1" {
            ensure!(data["email"].is_null() && data["user"] == "alice", "{r:?}");
            ensure!(
                r.headers.get("lanebus-redacted").map(String::as_str) == Some("/email"),
                "{r:?}"
            );
        } else {
            ensure!(data["email"] == "bob@example.org", "{r:?}");
            ensure!(!r.headers.contains_key("lanebus-redacted"), "{r:?}");
        }
        Ok(())
    };
    for r in rx.requests().iter().filter(|r| r.accepted()) {
        check(r)?;
    }
    wait_completions(&node, 2).await?;
    let before = rx.requests().len();
    let path = format!("/v1/handlers/{}/recover", h.id);
    let (status, body) = api.post(&path, json!({"since": rfc3339(t)})).await?;
    ensure!(status == 200 && body["recovered"] == 2, "{status} {body}");
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log.len() >= before + 2)
            .await,
        "recovery not delivered"
    );
    let reqs = rx.requests();
    ensure!(reqs.len() == before + 2, "{reqs:?}");
    for r in &reqs[before..] {
        ensure!(r.accepted(), "{r:?}");
        ensure!(r.headers.get("lanebus-replay").map(String::as_str) == Some("true"));
        check(r)?;
    }
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// Issue 15 finding: the attempt log kept the receiver's response body, so
/// a receiver echoing the payload left a personal value in the store that
/// `DELETE /v1/subjects/{id}` did not erase. An attempt whose payload had
/// personal fields decrypted keeps no body (`body_withheld`); another
/// event's attempt keeps its echo.
async fn echoed_personal_fields_are_not_kept_in_the_attempt_log(
    backend: Backend,
) -> anyhow::Result<()> {
    let (db, rx, node, api, h) = personal_node(backend, "echo").await?;
    rx.add_rule(Rule {
        handler: Some("h".into()),
        key: None,
        action: Action::Echo { status: 500 },
    });
    api.publish(
        &[
            json!({"id": "e1", "type": "user.seen", "key": "alice",
                   "payload": {"user": "alice", "email": "alice@example.org"}}),
            json!({"id": "e2", "type": "order.paid", "key": "o1",
                   "payload": {"note": "plain-echo-text"}}),
        ],
        2,
    )
    .await?;
    let log_of = |v: &serde_json::Value| v["handlers"][0]["attempt_log"].clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (personal, plain) = loop {
        let (s1, personal) = api.get("/v1/events/e1").await?;
        let (s2, plain) = api.get("/v1/events/e2").await?;
        ensure!(s1 == 200 && s2 == 200, "{personal} {plain}");
        if log_of(&personal)[0].is_object() && log_of(&plain)[0].is_object() {
            break (personal, plain);
        }
        ensure!(
            Instant::now() < deadline,
            "no attempts logged: {personal} {plain}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(
        rx.requests()
            .iter()
            .any(|r| r.event_id == "e1" && r.body.contains("alice@example.org")),
        "the receiver got the value decrypted"
    );
    let a = &log_of(&personal)[0];
    ensure!(a["body"].is_null() && a["body_withheld"] == true, "{a}");
    ensure!(a["status"] == 500, "{a}");
    let p = &log_of(&plain)[0];
    ensure!(
        p["body"]
            .as_str()
            .is_some_and(|b| b.contains("plain-echo-text"))
            && p["body_withheld"] == false,
        "{p}"
    );
    let (status, body) = api.delete("/v1/subjects/alice").await?;
    ensure!(status == 204, "{status} {body}");
    let (_, after) = api.get("/v1/events/e1").await?;
    let (_, listed) = api
        .get(&format!("/v1/handlers/{}/deliveries", h.id))
        .await?;
    for v in [&personal, &after, &listed] {
        ensure!(!v.to_string().contains("alice@example.org"), "{v}");
    }
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_personal_fields_are_not_kept_in_the_attempt_log_postgres() {
    echoed_personal_fields_are_not_kept_in_the_attempt_log(Backend::Postgres)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_personal_fields_are_not_kept_in_the_attempt_log_sqlite() {
    echoed_personal_fields_are_not_kept_in_the_attempt_log(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personal_fields_are_redacted_after_erasure_postgres() {
    personal_fields_are_redacted_after_erasure(Backend::Postgres)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn personal_fields_are_redacted_after_erasure_sqlite() {
    personal_fields_are_redacted_after_erasure(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_at_waits_and_holds_its_key_postgres() {
    deliver_at_waits_and_holds_its_key(Backend::Postgres)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliver_at_waits_and_holds_its_key_sqlite() {
    deliver_at_waits_and_holds_its_key(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_replay_by_time_range_postgres() {
    bulk_replay_by_time_range(Backend::Postgres).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_replay_by_time_range_sqlite() {
    bulk_replay_by_time_range(Backend::Sqlite).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_since_postgres() {
    recover_since(Backend::Postgres).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_since_sqlite() {
    recover_since(Backend::Sqlite).await.unwrap();
}
