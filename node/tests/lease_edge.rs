//! Attempts never outlive their owner (issue 18, items 1 and 2), with
//! in-process handlers so that the node's own view of its lease can be read
//! from inside an attempt:
//!
//! - a one-node cluster whose renewals stop: no attempt started while the
//!   lease had less left than the handler's timeout, so none is still
//!   running when the lease ends;
//! - a lane owner fenced out while attempts of its lanes wait for the
//!   handler's `max_in_flight` permit: once every owner has stopped, none of
//!   those attempts is sent.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::ensure;
use async_trait::async_trait;
use common::{test_options, Api, Backend, TestDb};
use lanebus_cluster::{Cluster, LeaseConfig, RaftTiming};
use lanebus_node::actors::LaneState;
use lanebus_node::node::ClusterOptions;
use lanebus_node::{Handler, HandlerError};
use lanebus_store::{Delivery, NewHandler};

/// Registers the in-process handler `name` (every event type) and has the
/// node's catalog reload.
async fn register(
    node: &lanebus_node::NodeHandle,
    name: &str,
    timeout_ms: u64,
    max_in_flight: u32,
) -> anyhow::Result<()> {
    node.store()
        .create_handler(NewHandler {
            name: name.into(),
            url: format!("http://inproc.invalid/{name}"),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms,
            max_in_flight,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    lanebus_api::NodeView::handlers_changed(&*node.state);
    Ok(())
}

/// One attempt as the handler saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// The node's lease was valid when the attempt ended.
    lease_at_end: bool,
}

/// Works `work` per attempt, then notes whether the node still holds its
/// lease.
struct LeaseWitness {
    cluster: OnceLock<Arc<Cluster>>,
    work: Duration,
    seen: Mutex<Vec<Seen>>,
}

#[async_trait]
impl Handler for LeaseWitness {
    async fn handle(&self, _: &Delivery) -> Result<(), HandlerError> {
        tokio::time::sleep(self.work).await;
        let lease_at_end = self.cluster.get().is_some_and(|c| c.may_work());
        self.seen
            .lock()
            .expect("not poisoned")
            .push(Seen { lease_at_end });
        Ok(())
    }
}

/// A one-node cluster (1,500 ms lease renewed every 300 ms, 500 ms margin)
/// delivers a steady stream of events on distinct keys to a handler with a
/// 1,000 ms timeout whose attempts take 700 ms. Its renewals then stop
/// ([`Cluster::release_lease`]), so the lease ends within 1.5 s while events
/// keep arriving. An attempt may start only while the remaining lease
/// covers the timeout plus the slack: every attempt ends with the lease
/// still valid. Before the rule, attempts started in the lease's last
/// 700 ms and were still running when it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_attempt_starts_that_cannot_finish_inside_the_lease() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "lease_edge").await?;
    let witness = Arc::new(LeaseWitness {
        cluster: OnceLock::new(),
        work: Duration::from_millis(700),
        seen: Mutex::default(),
    });
    let dir = std::env::temp_dir().join(format!(
        "lanebus-lease-edge-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let mut opts = test_options(&db.url);
    opts.in_process
        .insert("witness".into(), witness.clone() as Arc<dyn Handler>);
    let mut c = ClusterOptions::new(1, "127.0.0.1:0", &dir);
    c.bootstrap = true;
    c.lease = LeaseConfig {
        lease_ms: 1_500,
        renew_interval_ms: 300,
        margin_ms: 500,
    };
    c.raft = RaftTiming {
        heartbeat_ms: 100,
        election_timeout_min_ms: 300,
        election_timeout_max_ms: 600,
        ..RaftTiming::default()
    };
    opts.cluster = Some(c);
    let node = lanebus_node::start(opts).await?;
    let cluster = node.state.cluster().expect("a cluster member").clone();
    let _ = witness.cluster.set(cluster.clone());
    register(&node, "witness", 1_000, 256).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cluster.may_work() {
        ensure!(Instant::now() < deadline, "the node never held its lease");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let api = Api::new(&node.base_url());
    let publish = |i: usize| serde_json::json!({"id": format!("edge-{i}"), "type": "t.x", "key": format!("k-{i}"), "payload": {"i": i}});
    // Deliveries flow while the lease is renewed.
    let mut i = 0;
    while witness.seen.lock().expect("not poisoned").is_empty() {
        ensure!(Instant::now() < deadline, "nothing delivered");
        api.publish(&[publish(i)], 1).await?;
        i += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Renewals stop: the lease ends within 1.5 s; events keep coming.
    let release = {
        let c = cluster.clone();
        tokio::spawn(async move { c.release_lease(Duration::from_secs(2)).await })
    };
    let stop_at = Instant::now() + Duration::from_millis(2_500);
    while Instant::now() < stop_at {
        api.publish(&[publish(i)], 1).await?;
        i += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let _ = release.await;
    ensure!(!cluster.may_work(), "the lease did not end");
    // Attempts under way end within their timeout.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let seen = witness.seen.lock().expect("not poisoned").clone();
    let outlived = seen.iter().filter(|s| !s.lease_at_end).count();
    println!(
        "{} events published, {} attempts, {outlived} still running when the lease ended",
        i,
        seen.len()
    );
    ensure!(
        outlived == 0,
        "{outlived} of {} attempts were still running when the node's lease ended",
        seen.len()
    );
    node.shutdown().await?;
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
    Ok(())
}

/// Counts attempts and holds each for a while.
struct Slow {
    calls: AtomicUsize,
    work: Duration,
}

#[async_trait]
impl Handler for Slow {
    async fn handle(&self, _: &Delivery) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.work).await;
        Ok(())
    }
}

/// A handler with `max_in_flight` 1 and work on 20 keys: the attempts of
/// most lanes wait for the handler's one permit. Another owner then fences
/// every lane at a higher epoch; this node's lane owners are fenced out at
/// their next claim and stop. An attempt waiting for the permit belongs to
/// an owner that is gone: it is not sent (the new owner sends that
/// delivery; sent here too it could arrive after the new owner's next one
/// of the same key). Before, every queued attempt was still sent, one
/// after another, after all owners had stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_of_an_owner_that_stopped_are_not_sent() -> anyhow::Result<()> {
    let db = TestDb::new(Backend::Sqlite, "owner_tie").await?;
    let slow = Arc::new(Slow {
        calls: AtomicUsize::new(0),
        work: Duration::from_millis(200),
    });
    let mut opts = test_options(&db.url);
    opts.in_process
        .insert("slow".into(), slow.clone() as Arc<dyn Handler>);
    let node = lanebus_node::start(opts).await?;
    register(&node, "slow", 5_000, 1).await?;
    let api = Api::new(&node.base_url());
    let events: Vec<serde_json::Value> = (0..60)
        .map(|i| serde_json::json!({"id": format!("tie-{i}"), "type": "t.x", "key": format!("k-{}", i % 20), "payload": {"i": i}}))
        .collect();
    api.publish(&events, 60).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while slow.calls.load(Ordering::SeqCst) < 3 {
        ensure!(Instant::now() < deadline, "nothing delivered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let other = lanebus_store::open(&db.url).await?;
    for row in other.lane_rows().await? {
        ensure!(
            other.fence(row.lane, "intruder", row.epoch.next()).await?,
            "fence lane {}",
            row.lane
        );
    }
    loop {
        let board = node.state.board().snapshot();
        if board.values().all(|s| s.state == LaneState::FencedOut) {
            break;
        }
        ensure!(Instant::now() < deadline, "lane owners still running");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at_stop = slow.calls.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let after = slow.calls.load(Ordering::SeqCst) - at_stop;
    println!("{at_stop} attempts before every owner stopped, {after} after");
    ensure!(
        after == 0,
        "{after} attempts sent after their lane owners had stopped"
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
