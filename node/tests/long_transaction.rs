//! A transaction left open elsewhere on the PostgreSQL server (an idle
//! session that took a transaction id) must starve nothing: a key whose
//! receiver fails every attempt, with a backlog many times the lane's buffer,
//! must not hold up the lane's other keys, and nothing may be handed over
//! again after its completion (issue 18, item 3). On main the claim cursor
//! could not pass the open transaction, so every claim re-read the failing
//! key's backlog first and the other keys waited until it ended.

mod common;

use std::time::Duration;

use anyhow::{ensure, Context as _};
use common::{test_options, Api, Backend, TestDb};
use lanebus_store::{lane_of_key, DEFAULT_LANES};
use lanebus_testkit::receiver::{Action, Expected, Receiver, Rule};
use serde_json::Value;
use sqlx::Connection as _;

/// The failing key's backlog: several times the default lane buffer (256).
const FAILING_EVENTS: usize = 1_200;
/// Other keys of the failing key's lane, and of any lane.
const SAME_LANE_KEYS: usize = 20;
const OTHER_KEYS: usize = 200;
const EVENTS_PER_KEY: usize = 5;

fn event(id: String, key: &str, i: usize) -> Value {
    serde_json::json!({"id": id, "type": "push", "key": key, "payload": {"n": i}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transaction_elsewhere_starves_no_key_postgres() {
    if std::env::var("LANEBUS_TEST_POSTGRES_URL").is_err() {
        eprintln!("LANEBUS_TEST_POSTGRES_URL not set: skipped (scripts/test sets it)");
        return;
    }
    open_transaction_starves_nothing().await.unwrap();
}

async fn open_transaction_starves_nothing() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Postgres, "long_tx").await?;
    let rx = Receiver::start().await?;
    // Default lane buffer and poll interval: the regime users run.
    let node = lanebus_node::start(test_options(&db.url)).await?;
    let api = Api::new(&node.base_url());
    let h = api
        .create_handler("all", &rx.url("all"), &["*"], 100)
        .await?;
    rx.set_secret("all", &h.secret);

    let failing = "stuck-0".to_string();
    let lane = lane_of_key(&failing, DEFAULT_LANES);
    let same_lane: Vec<String> = (1..)
        .map(|i| format!("flow-{i}"))
        .filter(|k| lane_of_key(k, DEFAULT_LANES) == lane)
        .take(SAME_LANE_KEYS)
        .collect();
    let others: Vec<String> = (0..OTHER_KEYS).map(|i| format!("other-{i}")).collect();
    rx.add_rule(Rule {
        handler: None,
        key: Some(failing.clone()),
        action: Action::Status {
            status: 500,
            retry_after: None,
        },
    });
    // Some first attempts of the other keys fail once: their retries must
    // not come back as new attempts after the completion.
    for k in same_lane.iter().step_by(3).chain(others.iter().step_by(7)) {
        rx.add_rule(Rule {
            handler: None,
            key: Some(k.clone()),
            action: Action::FailFirst {
                n: 1,
                status: 503,
                retry_after: None,
            },
        });
    }

    // An idle session elsewhere on the server holds a transaction id open
    // for the whole test (the snapshot horizon cannot pass it).
    let mut idle = sqlx::PgConnection::connect(&db.url).await?;
    sqlx::query("BEGIN").execute(&mut idle).await?;
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut idle)
        .await?;

    let failing_events: Vec<Value> = (0..FAILING_EVENTS)
        .map(|i| event(format!("stuck-{i}"), &failing, i))
        .collect();
    api.publish(&failing_events, 50).await?;
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .filter(|r| r.key.as_deref() == Some(failing.as_str()))
            .count()
            >= 2)
            .await,
        "the failing key was never attempted twice"
    );

    let mut events = Vec::new();
    let mut expected = Vec::new();
    for i in 0..EVENTS_PER_KEY {
        for k in same_lane.iter().chain(&others) {
            let id = format!("{k}-{i}");
            expected.push(Expected {
                handler: "all".into(),
                event_id: id.clone(),
                key: Some(k.clone()),
            });
            events.push(event(id, k, i));
        }
    }
    api.publish(&events, 25).await?;

    let delivered = rx
        .wait_until(Duration::from_secs(90), |log| {
            let accepted: std::collections::HashSet<&str> = log
                .iter()
                .filter(|r| r.accepted())
                .map(|r| r.event_id.as_str())
                .collect();
            expected
                .iter()
                .all(|e| accepted.contains(e.event_id.as_str()))
        })
        .await;
    let v = rx.verdict(&expected);
    ensure!(
        delivered,
        "keys waited behind the failing key while a transaction was open: {v:?}"
    );
    // Let stale claims, if any, come back before judging repeats.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reqs: Vec<_> = rx
        .requests()
        .into_iter()
        .filter(|r| r.key.as_deref() != Some(failing.as_str()))
        .collect();
    let v = lanebus_testkit::receiver::verdict(&reqs, &expected);
    ensure!(v.exact(), "{v:?}");
    common::ensure_no_repeat_without_failure(&reqs)?;
    let metrics = api.metrics().await?;
    let horizon = metrics
        .lines()
        .find(|l| l.starts_with("lanebus_claim_horizon_age_seconds"))
        .context("no lanebus_claim_horizon_age_seconds metric")?;
    let age: f64 = horizon
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .context("horizon age value")?;
    ensure!(
        age > 1.0,
        "the open transaction's age is not shown: {horizon}"
    );

    sqlx::query("ROLLBACK").execute(&mut idle).await?;
    idle.close().await.ok();
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
