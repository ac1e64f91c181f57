//! A node whose actor thread stops running (here: a task that blocks it)
//! delivers nothing while its HTTP API still answers. `/readyz` must say so
//! (503 `not_ready`, naming the actor thread) and the gauge
//! `lanebus_actor_thread_stalled` must read 1, so that an operator or an
//! orchestrator can tell; both clear once the thread runs again, and the
//! event published meanwhile is delivered then.

mod common;

use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{test_options, Api, Backend, TestDb};
use lanebus_testkit::receiver::Receiver;
use serde_json::json;

/// How long the test blocks the actor thread: past the watchdog's bound
/// (`lanebus_node::watchdog::STALL_CHECKS` checks of 500 ms) with room.
const BLOCKED: Duration = Duration::from_secs(12);

async fn readyz(base: &str) -> anyhow::Result<(u16, String)> {
    let r = reqwest::get(format!("{base}/readyz")).await?;
    Ok((r.status().as_u16(), r.text().await?))
}

fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_actor_thread_makes_the_node_unready_until_it_runs() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "watchdog").await?;
    let rx = Receiver::start().await?;
    let node = lanebus_node::start(test_options(&db.url)).await?;
    let base = node.base_url();
    let api = Api::new(&base);
    api.create_handler("h", &rx.url("h"), &["orders.*"], 5)
        .await?;
    api.publish(&[json!({"type": "orders.placed", "payload": {"n": 1}})], 1)
        .await?;
    ensure!(
        rx.wait_accepted(1, Duration::from_secs(30)).await,
        "the first event was not delivered"
    );
    ensure!(readyz(&base).await?.0 == 200, "ready before the stall");

    // Blocks the thread of the node's actors.
    let started = Instant::now();
    node.state
        .actor_arbiter()
        .spawn(async { std::thread::sleep(BLOCKED) });
    api.publish(&[json!({"type": "orders.placed", "payload": {"n": 2}})], 1)
        .await?;
    let mut refused = None;
    while started.elapsed() < BLOCKED - Duration::from_secs(1) {
        let (status, body) = readyz(&base).await?;
        if status == 503 {
            refused = Some((body, started.elapsed()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some((body, after)) = refused else {
        anyhow::bail!("/readyz kept answering 200 while the actor thread was blocked");
    };
    ensure!(
        body.contains("not_ready") && body.contains("actor thread"),
        "/readyz's 503 names the actor thread: {body}"
    );
    ensure!(
        after >= Duration::from_secs(5),
        "a stall is reported after 5 s at the earliest, here after {after:?}"
    );
    let metrics = api.metrics().await?;
    ensure!(
        gauge(&metrics, "lanebus_actor_thread_stalled") == Some(1.0),
        "the gauge reads 1 during the stall"
    );
    ensure!(
        rx.accepted_distinct() == 1,
        "nothing is delivered while the thread is blocked"
    );

    // Runs again: ready, the gauge back at 0, the waiting event delivered.
    let deadline = Instant::now() + BLOCKED + Duration::from_secs(20);
    loop {
        let (status, body) = readyz(&base).await?;
        if status == 200 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "never ready again after the stall: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        gauge(&api.metrics().await?, "lanebus_actor_thread_stalled") == Some(0.0),
        "the gauge reads 0 again"
    );
    ensure!(
        rx.wait_accepted(2, Duration::from_secs(30)).await,
        "the event published during the stall was not delivered after it"
    );
    node.shutdown().await?;
    Ok(())
}
