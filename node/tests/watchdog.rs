//! A node whose actor thread stops running (here: a task that blocks it)
//! delivers nothing while its HTTP API still answers.
//!
//! - Alone, `/readyz` must say so (503 `not_ready`, naming the actor
//!   thread) and the gauge `lanebus_actor_thread_stalled` must read 1, so
//!   that an operator or an orchestrator can tell; both clear once the
//!   thread runs again, and the event published meanwhile is delivered.
//! - In a cluster, its lanes must move to the other node, which delivers
//!   their events while the thread is still blocked.

mod common;

use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use common::{test_options, Api, Backend, TestDb};
use lanebus_node::{ClusterOptions, NodeHandle};
use lanebus_testkit::receiver::Receiver;
use serde_json::{json, Value};

/// How long the test blocks the actor thread: past the watchdog's bound
/// (`lanebus_node::watchdog::STALL_CHECKS` checks of 500 ms) with room.
const BLOCKED: Duration = Duration::from_secs(12);

async fn readyz(base: &str) -> anyhow::Result<(u16, String)> {
    let r = reqwest::get(format!("{base}/readyz")).await?;
    Ok((r.status().as_u16(), r.text().await?))
}

/// Waits until no delivery is left in the store or in flight (`GET
/// /admin/lanes`): a store write of the actor thread is not under way when
/// the test blocks it.
async fn settled(api: &Api) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, v) = api.get("/admin/lanes").await?;
        let lanes = v["lanes"].as_array().context("lanes")?;
        let busy: i64 = lanes
            .iter()
            .map(|l| l["backlog"].as_i64().unwrap_or(1) + l["in_flight"].as_i64().unwrap_or(1))
            .sum();
        if busy == 0 {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "deliveries never settled: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Blocks the thread of `node`'s actors for `d`.
fn block_actor_thread(node: &NodeHandle, d: Duration) {
    node.state
        .actor_arbiter()
        .spawn(async move { std::thread::sleep(d) });
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
    settled(&api).await?;
    ensure!(readyz(&base).await?.0 == 200, "ready before the stall");

    let started = Instant::now();
    block_actor_thread(&node, BLOCKED);
    tokio::time::timeout(
        Duration::from_secs(5),
        api.publish(&[json!({"type": "orders.placed", "payload": {"n": 2}})], 1),
    )
    .await
    .context("a publish waited for the blocked actor thread")??;
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
    // 10 checks of 500 ms; the block may begin up to one beat (100 ms)
    // after the last beat.
    ensure!(
        after >= Duration::from_millis(4_800),
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

    // Runs again: ready (after 5 s of beats), the gauge back at 0, the
    // waiting event delivered.
    let deadline = Instant::now() + BLOCKED + Duration::from_secs(25);
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

/// A node of `cluster` on `db` with a 3 s lease (as the cluster tests'
/// `lease_3s_args`), bootstrapping the cluster or joining `join`.
async fn cluster_node(
    db: &TestDb,
    id: u64,
    dir: &std::path::Path,
    join: Option<String>,
) -> anyhow::Result<NodeHandle> {
    let mut opts = test_options(&db.url);
    opts.node_id = id.to_string();
    let raft = lanebus_testkit::local_cluster::free_port()?;
    let mut c = ClusterOptions::new(id, raft.to_string(), dir.join(format!("node-{id}")));
    c.lease = lanebus_cluster::LeaseConfig {
        lease_ms: 3_000,
        renew_interval_ms: 500,
        margin_ms: 1_000,
    };
    c.bootstrap = join.is_none();
    c.join = join;
    opts.cluster = Some(c);
    Ok(lanebus_node::start(opts).await?)
}

/// Lanes by owner in `node`'s view of the cluster, `None` while a lane has
/// no owner or is not active.
fn owners(node: &NodeHandle) -> Option<std::collections::BTreeMap<u64, usize>> {
    let lanes = node.state.cluster()?.state().lanes;
    let mut per = std::collections::BTreeMap::new();
    for l in &lanes {
        if l.state != lanebus_cluster::assignment::LaneState::Active {
            return None;
        }
        *per.entry(l.owner?).or_default() += 1;
    }
    Some(per)
}

async fn wait_owners(
    node: &NodeHandle,
    what: &str,
    within: Duration,
    ok: impl Fn(&std::collections::BTreeMap<u64, usize>) -> bool,
) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    loop {
        if let Some(per) = owners(node) {
            if ok(&per) {
                return Ok(t0.elapsed());
            }
        }
        ensure!(
            t0.elapsed() < within,
            "{what}: not within {within:?}; lanes by owner: {:?}",
            owners(node)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How long the cluster test blocks node 2's actor thread: the stall's 5 s,
/// the 3 s lease and 1 s margin, the leader's moves and fences, and the
/// deliveries, with room for a loaded machine.
const BLOCKED_IN_CLUSTER: Duration = Duration::from_secs(25);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_with_a_stalled_actor_thread_loses_its_lanes() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "watchdog_cluster").await?;
    let dir = std::env::temp_dir().join(format!(
        "lanebus-watchdog-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos()
    ));
    let rx = Receiver::start().await?;
    let one = cluster_node(&db, 1, &dir, None).await?;
    let two = cluster_node(&db, 2, &dir, Some(one.base_url())).await?;
    wait_owners(&one, "balanced over both", Duration::from_secs(60), |p| {
        p.len() == 2 && p.values().all(|&n| n >= 100)
    })
    .await?;
    let api = Api::new(&one.base_url());
    api.create_handler_timeout("h", &rx.url("h"), &["orders.*"], 5, 1_000)
        .await?;

    let started = Instant::now();
    block_actor_thread(&two, BLOCKED_IN_CLUSTER);
    let moved = wait_owners(
        &one,
        "node 2's lanes moved to node 1",
        BLOCKED_IN_CLUSTER,
        |p| p.keys().eq([1].iter()),
    )
    .await?;
    // Keyed over many lanes, half of them node 2's before: all delivered by
    // node 1 while node 2's thread is still blocked.
    let events: Vec<Value> = (0..64)
        .map(|i| json!({"type": "orders.placed", "key": format!("k{i}"), "payload": {"n": i}}))
        .collect();
    api.publish(&events, 64).await?;
    let left = BLOCKED_IN_CLUSTER.saturating_sub(started.elapsed());
    ensure!(
        rx.wait_accepted(64, left).await,
        "node 1 did not deliver the events of node 2's former lanes while node 2 was stalled \
         ({} of 64)",
        rx.accepted_distinct()
    );
    ensure!(
        started.elapsed() < BLOCKED_IN_CLUSTER,
        "delivered only after the block ended"
    );
    let (status, body) = readyz(&two.base_url()).await?;
    ensure!(
        status == 503 && body.contains("actor thread"),
        "node 2's /readyz names its stall: {status} {body}"
    );
    eprintln!(
        "node 2's lanes moved {moved:?} after its actor thread was blocked (lease 3 s, margin 1 s)"
    );

    // Back: node 2 renews again and gets lanes again.
    wait_owners(
        &one,
        "balanced over both again",
        BLOCKED_IN_CLUSTER + Duration::from_secs(60),
        |p| p.len() == 2,
    )
    .await?;
    two.shutdown().await?;
    one.shutdown().await?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
