//! The cluster as child processes (`lanebus node --bootstrap/--join`), on
//! SQLite and PostgreSQL (formation and a follower killed also on MongoDB),
//! with short leases (1500 ms lease, 300 ms renewals,
//! 500 ms margin; handler timeouts of 1000 ms, below the lease):
//!
//! - three nodes: every lane has one owner, counts differ by at most one,
//!   the admin view is the same from every node;
//! - a node SIGKILLed during a run of real payloads over many keys: its
//!   lanes move within lease + margin + 2 s; nothing lost, per-key order
//!   kept, the only repeats are of deliveries in flight on the killed node;
//! - the leader killed: the same;
//! - a node frozen (SIGSTOP) past its lease, then resumed: it stopped its
//!   lanes by itself, its stale store calls change nothing (counted in
//!   `lanebus_store_fenced_out_total`), no key out of order;
//! - a fourth node joins during a run: about a quarter of the lanes move,
//!   gracefully, with no repeats; a node removed on purpose likewise;
//! - the whole cluster stopped and started from its data dirs: same
//!   members, pending work delivered;
//! - two processes started with the same id never both deliver a delivery;
//! - a `--single` process started on the cluster's store fences every lane:
//!   the cluster shows its lanes `fenced_out` (not ready), re-fences them
//!   through Raft above the store's epochs after lease + margin, and once
//!   the intruder is stopped delivers everything, nothing lost, in order.
//!
//! The run size scales with `LANEBUS_TEST_CLUSTER_EVENTS` (default 3,000
//! events over 300 keys, 1,500 over 150 on MongoDB; the 20,000 over
//! 1,000 keys works too, it only takes longer in a debug build).

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use common::{expected, real_events, Backend, Registered, TestDb};
use lanebus_store::{handler_defaults, NewEvent, NewHandler, Store};
use lanebus_testkit::local_cluster::{self, LocalCluster, Start};
use lanebus_testkit::receiver::{Action, Expected, Receiver, Rule};

const ARGS: &[&str] = &[
    "--lease-ms",
    "1500",
    "--renew-interval-ms",
    "300",
    "--lease-margin-ms",
    "500",
    "--retry-base-ms",
    "50",
    "--poll-interval-ms",
    "50",
];

fn run_size() -> (usize, usize) {
    run_size_default(3_000)
}

fn run_size_default(default: usize) -> (usize, usize) {
    let events = std::env::var("LANEBUS_TEST_CLUSTER_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    (events, (events / 10).clamp(1, 1_000))
}

struct Fixture {
    db: TestDb,
    store: std::sync::Arc<dyn Store>,
    rx: Receiver,
    handlers: Vec<Registered>,
    cluster: LocalCluster,
}

impl Fixture {
    async fn new(backend: Backend, name: &str) -> anyhow::Result<Fixture> {
        Self::with_args(backend, name, ARGS).await
    }

    async fn with_args(backend: Backend, name: &str, args: &[&str]) -> anyhow::Result<Fixture> {
        let db = TestDb::new(backend, name).await?;
        let dir = std::env::temp_dir().join(format!(
            "lanebus-cluster-{name}-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&dir)?;
        let rx = Receiver::start().await?;
        // A little work per request so that runs last long enough to be cut.
        rx.add_rule(Rule {
            handler: None,
            key: None,
            action: Action::Delay(Duration::from_millis(2)),
        });
        let store = lanebus_store::open(&db.url).await?;
        let mut handlers = Vec::new();
        for (name, routes) in [("issues", vec!["issues.*"]), ("all", vec!["*"])] {
            let h = store
                .create_handler(NewHandler {
                    name: name.into(),
                    url: rx.url(name),
                    event_types: routes.iter().map(|s| s.to_string()).collect(),
                    max_attempts: handler_defaults::MAX_ATTEMPTS,
                    timeout_ms: 1_000,
                    max_in_flight: handler_defaults::MAX_IN_FLIGHT,
                    secret: lanebus_store::generate_secret(),
                    rate_limit: None,
                    filter: None,
                })
                .await?;
            rx.set_secret(name, &h.secret);
            handlers.push(Registered {
                id: h.id,
                name: name.into(),
                secret: h.secret,
                routes: h.event_types,
            });
        }
        let cluster = LocalCluster::new(env!("CARGO_BIN_EXE_lanebus"), &dir, &db.url, args);
        Ok(Fixture {
            db,
            store,
            rx,
            handlers,
            cluster,
        })
    }

    /// Node 1 bootstraps, the others join it; waits until balanced.
    async fn start(&mut self, ids: &[u64]) -> anyhow::Result<()> {
        self.cluster.spawn(ids[0], Start::Bootstrap)?;
        self.cluster
            .wait_ready(ids[0], Duration::from_secs(30))
            .await?;
        let url = self.cluster.url(ids[0]);
        for &id in &ids[1..] {
            self.cluster.spawn(id, Start::Join(url.clone()))?;
        }
        for &id in ids {
            self.cluster.wait_ready(id, Duration::from_secs(30)).await?;
        }
        self.cluster
            .wait_balanced(ids[0], ids, Duration::from_secs(30))
            .await?;
        Ok(())
    }

    /// Publishes `n` real events over `keys` keys straight into the store.
    async fn publish(&self, n: usize, keys: usize, prefix: &str) -> anyhow::Result<Vec<Expected>> {
        let (_, events) = real_events(&common::samples(), n, keys, prefix);
        for chunk in events.chunks(200) {
            let batch = chunk
                .iter()
                .map(|e| NewEvent {
                    id: Some(e.id.clone()),
                    event_type: e.event_type.clone(),
                    key: e.key.clone(),
                    payload: e.payload.clone().into_bytes(),
                    deliver_at: None,
                    expected_seq: None,
                })
                .collect();
            self.store.publish(batch).await?;
        }
        Ok(expected(&events, &self.handlers))
    }

    async fn wait_all(&self, exp: &[Expected], secs: u64) -> anyhow::Result<()> {
        let done = self
            .rx
            .wait_accepted(exp.len(), Duration::from_secs(secs))
            .await;
        ensure!(
            done,
            "only {} of {} arrived (logs in {})",
            self.rx.accepted_distinct(),
            exp.len(),
            self.cluster.dir().display()
        );
        // Let late repeats show.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(())
    }

    /// Nothing lost, order kept, signatures valid, and every repeat
    /// explained by one of `events_ms`. Returns the number of repeats.
    fn check(&self, exp: &[Expected], events_ms: &[f64]) -> anyhow::Result<usize> {
        let v = self.rx.verdict(exp);
        ensure!(
            v.lost == 0 && v.out_of_order == 0 && v.bad_signatures == 0 && v.unexpected == 0,
            "{v:?} (logs in {})",
            self.cluster.dir().display()
        );
        let r = local_cluster::repeats(&self.rx.requests(), events_ms);
        ensure!(
            r.unexplained.is_empty(),
            "unexplained repeats: {:?} (logs in {})",
            &r.unexplained[..r.unexplained.len().min(10)],
            self.cluster.dir().display()
        );
        Ok(r.repeated)
    }

    async fn finish(mut self) {
        let ids: Vec<u64> = self.cluster.nodes.keys().copied().collect();
        for id in ids {
            let _ = self.cluster.stop(id, Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(self.cluster.dir());
        drop(self.cluster);
        self.db.drop_db().await;
    }
}

async fn leader(c: &LocalCluster, via: u64) -> anyhow::Result<u64> {
    let v = c.get_json(via, "/admin/cluster").await?;
    v["leader"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .context("no leader")
}

fn alive(ids: &[u64]) -> BTreeSet<String> {
    ids.iter().map(u64::to_string).collect()
}

/// Waits until `via` shows the lanes balanced over `ids`; returns how long.
async fn time_to_balance(
    c: &LocalCluster,
    via: u64,
    ids: &[u64],
    secs: u64,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    c.wait_balanced(via, ids, Duration::from_secs(secs)).await?;
    Ok(t.elapsed())
}

async fn three_nodes_balanced(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::new(backend, "formation").await?;
    f.start(&[1, 2, 3]).await?;
    let view = |l: Vec<local_cluster::ApiLane>| -> Vec<(u16, Option<String>, i64, String)> {
        l.into_iter()
            .map(|l| (l.lane, l.owner, l.epoch, l.state))
            .collect()
    };
    let counts = local_cluster::balance(&f.cluster.lanes(1).await?, &alive(&[1, 2, 3]))
        .map_err(anyhow::Error::msg)?;
    // Each node shows the table of the Raft state it applied, so a node a
    // step behind (a loaded machine) shows the previous one for a moment:
    // the tables must agree once every node has caught up.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let first = view(f.cluster.lanes(1).await?);
        let mut other = None;
        for id in [2, 3] {
            if view(f.cluster.lanes(id).await?) != first {
                other = Some(id);
                break;
            }
        }
        match other {
            None => break,
            Some(id) => ensure!(
                Instant::now() < deadline,
                "node {id} shows another lane table than node 1 for 20 s"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for id in [2, 3] {
        let c = f.cluster.get_json(id, "/admin/cluster").await?;
        ensure!(c["nodes"].as_array().map(Vec::len) == Some(3), "{c}");
    }
    println!("{backend:?}: three nodes, lanes per node {counts:?}, same view from each");
    f.finish().await;
    Ok(())
}

/// A long lease, so that lanes moving well before it ends can only be the
/// graceful stop's doing.
const ARGS_LONG_LEASE: &[&str] = &[
    "--lease-ms",
    "60000",
    "--renew-interval-ms",
    "1000",
    "--lease-margin-ms",
    "2000",
    "--retry-base-ms",
    "50",
    "--poll-interval-ms",
    "50",
];

/// Lanes of a stopped node moved before this can only have been given up:
/// the lease plus the margin of [`ARGS_LONG_LEASE`] is 62 s, and a graceful
/// stop hands over in about a second (a deadline a loaded machine meets).
const GIVEN_UP_WITHIN: Duration = Duration::from_secs(45);

/// SIGTERM of a follower: it drains, gives its lease up, and the leader
/// moves its lanes at once, not after the lease (60 s) and the margin; the
/// keys keep being delivered, nothing is lost, order per key holds.
async fn graceful_stop(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::with_args(backend, "sigterm", ARGS_LONG_LEASE).await?;
    f.start(&[1, 2, 3]).await?;
    let (n, keys) = run_size_default(3_000);
    let exp = f.publish(n, keys, "stop").await?;
    ensure!(
        f.rx.wait_accepted(exp.len() / 3, Duration::from_secs(120))
            .await,
        "the run did not get going"
    );
    let leader = leader(&f.cluster, 1).await?;
    let victim = [1u64, 2, 3]
        .into_iter()
        .find(|&id| id != leader)
        .expect("a follower");
    let stopped = std::time::Instant::now();
    let stop_ms = f.rx.now_ms();
    f.cluster.stop(victim, Duration::from_secs(20))?;
    let exited = stopped.elapsed();
    let moved = loop {
        let lanes = f.cluster.lanes(leader).await?;
        let theirs = lanes
            .iter()
            .filter(|l| l.owner.as_deref() == Some(&victim.to_string()))
            .count();
        if theirs == 0 && lanes.iter().all(|l| l.state == "active") {
            break stopped.elapsed();
        }
        ensure!(
            stopped.elapsed() < GIVEN_UP_WITHIN,
            "node {victim}'s lanes had not moved {} ms after SIGTERM ({theirs} left): \
             the lease was not given up",
            stopped.elapsed().as_millis()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    f.wait_all(&exp, 180).await?;
    // A graceful stop sends nothing twice; a repeat could only follow the
    // moves (a completion refused by the next owner's fence).
    let repeats = f.check(&exp, &[stop_ms])?;
    println!(
        "{backend:?}: {repeats} repeats; node {victim} stopped in {} ms, its lanes moved {} ms after SIGTERM \
         (lease 60,000 ms + margin 2,000 ms)",
        exited.as_millis(),
        moved.as_millis()
    );
    f.finish().await;
    Ok(())
}

/// SIGKILL `victim` (a follower, or the leader) a third into a run.
async fn killed_during_run(backend: Backend, kill_leader: bool) -> anyhow::Result<()> {
    let mut f = Fixture::new(backend, if kill_leader { "killleader" } else { "kill3" }).await?;
    f.start(&[1, 2, 3]).await?;
    // MongoDB: a smaller default run (the test server is slow; see
    // common::MONGODB_TEST_LANES).
    let (n, keys) = if backend == Backend::Mongodb {
        run_size_default(1_500)
    } else {
        run_size()
    };
    let exp = f.publish(n, keys, "run").await?;
    ensure!(
        f.rx.wait_accepted(exp.len() / 3, Duration::from_secs(120))
            .await,
        "the run did not get going"
    );
    let victim = if kill_leader {
        leader(&f.cluster, 1).await?
    } else {
        3
    };
    let rest: Vec<u64> = [1, 2, 3].into_iter().filter(|&i| i != victim).collect();
    f.cluster.kill(victim)?;
    let kill_ms = f.rx.now_ms();
    // How soon the lanes move is lease arithmetic, tested with a manual
    // clock in lanebus-cluster's lease engine; here only that they move,
    // within a deadline a loaded machine meets.
    let moved = time_to_balance(&f.cluster, rest[0], &rest, 60).await?;
    f.wait_all(&exp, 180).await?;
    let repeats = f.check(&exp, &[kill_ms])?;
    if kill_leader {
        let new = leader(&f.cluster, rest[0]).await?;
        ensure!(new != victim, "leader still {new}");
    }
    println!(
        "{backend:?}: killed node {victim}{} after a third of {} deliveries; lanes moved in {} ms; {repeats} repeats (in flight at the kill); none lost, order kept",
        if kill_leader { " (the leader)" } else { "" },
        exp.len(),
        moved.as_millis()
    );
    f.finish().await;
    Ok(())
}

fn fenced_out_total(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("lanebus_store_fenced_out_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn paused_past_lease(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::new(backend, "pause").await?;
    f.start(&[1, 2, 3]).await?;
    let (n, keys) = run_size();
    let exp = f.publish(n, keys, "pause").await?;
    ensure!(
        f.rx.wait_accepted(exp.len() / 4, Duration::from_secs(120))
            .await,
        "the run did not get going"
    );
    f.cluster.signal(3, "STOP")?;
    let stop_ms = f.rx.now_ms();
    let moved = time_to_balance(&f.cluster, 1, &[1, 2], 30).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Taken before the signal: node 3 may send as soon as it runs again,
    // before `kill` returns.
    let cont_ms = f.rx.now_ms();
    f.cluster.signal(3, "CONT")?;
    f.wait_all(&exp, 180).await?;
    // Node 3 is back: it renews again and gets lanes again.
    f.cluster
        .wait_balanced(1, &[1, 2, 3], Duration::from_secs(30))
        .await?;
    let m = reqwest::get(format!("{}/metrics", f.cluster.url(3)))
        .await?
        .text()
        .await?;
    // Whether node 3 still had store calls to make on resume depends on
    // what was in flight at the instant of SIGSTOP (its own lease check
    // usually stops it first), so the count is reported, not required; that
    // stale calls change nothing is what the exactness check below proves
    // (and the store conformance suite's fencing tests prove per backend).
    let fenced = fenced_out_total(&m);
    let repeats = f.check(&exp, &[stop_ms, cont_ms])?;
    println!(
        "{backend:?}: node 3 frozen past its lease; lanes moved in {} ms; on resume {fenced} stale store items refused; {repeats} repeats; none lost, order kept",
        moved.as_millis()
    );
    f.finish().await;
    Ok(())
}

/// The graceful-move scenario (a fourth node catching up the whole Raft
/// log while three nodes deliver) on these loaded 2-core machines can stall
/// renewals past a 1.5 s lease in a debug build, which turns graceful moves
/// into failovers; it runs with a 3 s lease instead
/// ([`common::lease_3s_args`]).
async fn fourth_joins_and_one_leaves(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::with_args(backend, "join4", &common::lease_3s_args()).await?;
    f.start(&[1, 2, 3]).await?;
    let before = f.cluster.lanes(1).await?;
    let (n, keys) = run_size();
    let exp = f.publish(n, keys, "join").await?;
    ensure!(
        f.rx.wait_accepted(exp.len() / 4, Duration::from_secs(120))
            .await,
        "the run did not get going"
    );
    let url = f.cluster.url(1);
    f.cluster.spawn(4, Start::Join(url))?;
    f.cluster.wait_ready(4, Duration::from_secs(30)).await?;
    f.cluster
        .wait_balanced(1, &[1, 2, 3, 4], Duration::from_secs(60))
        .await?;
    let after = f.cluster.lanes(1).await?;
    let moved = before
        .iter()
        .zip(&after)
        .filter(|(a, b)| a.owner != b.owner)
        .count();
    ensure!(
        (60..=68).contains(&moved),
        "{moved} lanes moved to the fourth node"
    );
    ensure!(
        after
            .iter()
            .filter(|l| l.owner.as_deref() == Some("4"))
            .count()
            == moved,
        "lanes moved between old nodes"
    );
    // A node removed on purpose hands its lanes over likewise.
    let r = reqwest::Client::new()
        .post(format!("{}/admin/cluster/remove", f.cluster.url(2)))
        .json(&serde_json::json!({"id": 2}))
        .send()
        .await?;
    ensure!(r.status().is_success(), "remove answered {}", r.status());
    f.cluster
        .wait_balanced(1, &[1, 3, 4], Duration::from_secs(60))
        .await?;
    f.wait_all(&exp, 180).await?;
    let repeats = f.check(&exp, &[])?;
    ensure!(repeats == 0, "{repeats} repeats in graceful moves");
    println!("{backend:?}: node 4 joined, {moved} lanes moved to it; node 2 removed; no repeats");
    f.finish().await;
    Ok(())
}

/// A handler registered after the nodes started, slower than the drain
/// bound the nodes would have computed at start (1,000 ms handlers: 1.5 s):
/// a join moves lanes while its attempts (2.3 s) are in flight, and the old
/// owners wait for them (the bound follows the catalog), so nothing is sent
/// twice and no key has two requests in flight. With the bound taken at
/// start the new owners sent the in-flight deliveries again.
async fn handler_added_after_start(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::with_args(backend, "late_handler", &common::lease_3s_args()).await?;
    f.start(&[1, 2]).await?;
    let slow = f
        .store
        .create_handler(NewHandler {
            name: "slow".into(),
            url: f.rx.url("slow"),
            event_types: vec!["*".into()],
            max_attempts: handler_defaults::MAX_ATTEMPTS,
            timeout_ms: 2_400,
            max_in_flight: handler_defaults::MAX_IN_FLIGHT,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    f.rx.set_secret("slow", &slow.secret);
    f.rx.add_rule(Rule {
        handler: Some("slow".into()),
        key: None,
        action: Action::Delay(Duration::from_millis(2_300)),
    });
    f.handlers.push(Registered {
        id: slow.id,
        name: "slow".into(),
        secret: slow.secret,
        routes: slow.event_types,
    });
    // Both nodes' catalogs reload (every 5 s) before the work starts.
    tokio::time::sleep(Duration::from_millis(5_500)).await;
    let exp = f.publish(300, 100, "late").await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f.rx.requests().iter().any(|r| r.handler == "slow") {
        ensure!(Instant::now() < deadline, "no request to the slow handler");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The drains of this move are in the logs after this point (the
    // formation's own, before the slow handler existed, come before it).
    let dir = f.cluster.dir().to_path_buf();
    let log_of = |id: u64| dir.join(format!("node-{id}.1.log"));
    let offsets: Vec<usize> = [1, 2]
        .iter()
        .map(|&id| std::fs::read_to_string(log_of(id)).map_or(0, |l| l.len()))
        .collect();
    f.cluster.spawn(3, Start::Join(f.cluster.url(1)))?;
    f.cluster.wait_ready(3, Duration::from_secs(30)).await?;
    f.cluster
        .wait_balanced(1, &[1, 2, 3], Duration::from_secs(60))
        .await?;
    f.wait_all(&exp, 120).await?;
    let repeats = f.check(&exp, &[]).context("a repeat in a graceful move")?;
    let bounds: Vec<String> = [1, 2]
        .iter()
        .zip(&offsets)
        .filter_map(|(&id, &from)| {
            std::fs::read_to_string(log_of(id))
                .ok()
                .map(|l| l.get(from..).unwrap_or_default().to_string())
        })
        .flat_map(|log| {
            log.lines()
                .filter(|l| l.contains("handing the lane over"))
                .filter_map(|l| l.split("bound_ms=").nth(1))
                .map(|b| b.split_whitespace().next().unwrap_or_default().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    ensure!(
        !bounds.is_empty() && bounds.iter().all(|b| b == "2500"),
        "drain bounds logged: {bounds:?}"
    );
    ensure!(repeats == 0, "{repeats} repeats in the graceful move");
    println!(
        "{backend:?}: lanes moved to a joining node while 2.3 s attempts were in flight; {} drains bounded at 2,500 ms; no repeats",
        bounds.len()
    );
    f.finish().await;
    Ok(())
}

async fn whole_cluster_restarts(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::new(backend, "restart").await?;
    f.start(&[1, 2, 3]).await?;
    let exp1 = f.publish(300, 30, "first").await?;
    f.wait_all(&exp1, 60).await?;
    for id in [1, 2, 3] {
        f.cluster.stop(id, Duration::from_secs(10))?;
    }
    // Work published while the whole cluster is down.
    let exp2 = f.publish(300, 30, "second").await?;
    for id in [1, 2, 3] {
        f.cluster.spawn(id, Start::Restart)?;
    }
    for id in [1, 2, 3] {
        f.cluster.wait_ready(id, Duration::from_secs(30)).await?;
    }
    f.cluster
        .wait_balanced(2, &[1, 2, 3], Duration::from_secs(30))
        .await?;
    let c = f.cluster.get_json(3, "/admin/cluster").await?;
    let ids: Vec<&str> = c["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["id"].as_str())
        .collect();
    ensure!(ids == ["1", "2", "3"], "members after restart: {ids:?}");
    let all: Vec<Expected> = exp1.into_iter().chain(exp2).collect();
    f.wait_all(&all, 60).await?;
    f.check(&all, &[])?;
    println!("{backend:?}: whole cluster restarted from its data dirs; same members; pending work delivered");
    f.finish().await;
    Ok(())
}

/// Two `--single` processes with the same id started together: only one
/// holds each (lane, epoch), so no delivery reaches the receiver twice.
async fn same_id_twice(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "sameid").await?;
    let dir =
        std::env::temp_dir().join(format!("lanebus-sameid-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir)?;
    let rx = Receiver::start().await?;
    let store = lanebus_store::open(&db.url).await?;
    let h = store
        .create_handler(NewHandler {
            name: "all".into(),
            url: rx.url("all"),
            event_types: vec!["*".into()],
            max_attempts: handler_defaults::MAX_ATTEMPTS,
            timeout_ms: 1_000,
            max_in_flight: handler_defaults::MAX_IN_FLIGHT,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await?;
    rx.set_secret("all", &h.secret);
    let mut a = LocalCluster::new(
        env!("CARGO_BIN_EXE_lanebus"),
        dir.join("a"),
        &db.url,
        &["--single", "--poll-interval-ms", "50"],
    );
    let mut b = LocalCluster::new(
        env!("CARGO_BIN_EXE_lanebus"),
        dir.join("b"),
        &db.url,
        &["--single", "--poll-interval-ms", "50"],
    );
    std::fs::create_dir_all(a.dir())?;
    std::fs::create_dir_all(b.dir())?;
    a.spawn(1, Start::Restart)?;
    b.spawn(1, Start::Restart)?;
    a.wait_ready(1, Duration::from_secs(30)).await?;
    b.wait_ready(1, Duration::from_secs(30)).await?;
    let (_, events) = real_events(&common::samples(), 600, 60, "same");
    let batch: Vec<NewEvent> = events
        .iter()
        .map(|e| NewEvent {
            id: Some(e.id.clone()),
            event_type: e.event_type.clone(),
            key: e.key.clone(),
            payload: e.payload.clone().into_bytes(),
            deliver_at: None,
            expected_seq: None,
        })
        .collect();
    store.publish(batch).await?;
    let reg = vec![Registered {
        id: h.id,
        name: "all".into(),
        secret: h.secret,
        routes: h.event_types,
    }];
    let exp = expected(&events, &reg);
    ensure!(
        rx.wait_accepted(exp.len(), Duration::from_secs(60)).await,
        "only {} of {} arrived",
        rx.accepted_distinct(),
        exp.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let v = rx.verdict(&exp);
    ensure!(v.exact(), "{v:?}");
    let rows = store.lane_rows().await?;
    // Each (lane, epoch) has one holder; started together, the two may
    // split the lanes between them, never share one.
    let owners: BTreeSet<&str> = rows.iter().filter_map(|r| r.owner.as_deref()).collect();
    ensure!(
        rows.iter()
            .all(|r| r.owner.as_deref().is_some_and(|o| o.starts_with("1/"))),
        "lanes without an incarnation-named owner: {owners:?}"
    );
    println!(
        "{backend:?}: two processes with id 1 started together; lanes held by {} incarnation(s), each lane by one; every delivery once",
        owners.len()
    );
    drop(a);
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
    Ok(())
}

/// The stall of a cluster whose lanes a `--single` process fenced on the
/// same store (equal epochs under another name: the cluster never fenced
/// again): the cluster takes its lanes back through Raft and delivers all.
async fn single_intruder(backend: Backend) -> anyhow::Result<()> {
    let mut f = Fixture::new(backend, "intruder").await?;
    f.start(&[1, 2]).await?;
    let (n, keys) = (400, 40);
    let mut exp = f.publish(n, keys, "before").await?;
    f.wait_all(&exp, 60).await?;

    // The intruder: same store, `--single`, its own data dir and ports.
    let mut single = LocalCluster::new(
        env!("CARGO_BIN_EXE_lanebus"),
        f.cluster.dir().join("single"),
        &f.db.url,
        &["--single", "--poll-interval-ms", "50"],
    );
    std::fs::create_dir_all(single.dir())?;
    single.spawn(7, Start::Restart)?;
    single.wait_ready(7, Duration::from_secs(30)).await?;
    // The cluster's nodes see their lanes fenced out: shown in the admin
    // view (any node) and in /readyz.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut seen_fenced, mut seen_unready) = (0, false);
    while seen_fenced == 0 || !seen_unready {
        ensure!(
            Instant::now() < deadline,
            "lanes fenced out by the intruder not shown ({seen_fenced} fenced_out, \
             readyz 503 seen: {seen_unready})"
        );
        let fenced = f
            .cluster
            .lanes(1)
            .await?
            .iter()
            .filter(|l| l.state == "fenced_out")
            .count();
        seen_fenced = seen_fenced.max(fenced);
        let ready = reqwest::get(format!("{}/readyz", f.cluster.url(2)))
            .await?
            .status();
        seen_unready |= ready == reqwest::StatusCode::SERVICE_UNAVAILABLE;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    single.stop(7, Duration::from_secs(5))?;
    let stopped = Instant::now();
    exp.extend(f.publish(n, keys, "after").await?);
    // Re-fenced after lease + margin (counted from the refusal), then
    // delivered; the bound leaves room for a loaded machine.
    f.wait_all(&exp, 30).await?;
    let took = stopped.elapsed();
    let repeats = f.check(&exp, &[])?;
    // Every delivery arrived once the lanes that had work were taken back;
    // the others are re-fenced too, perhaps a little later.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rows = f.store.lane_rows().await?;
        let held = rows
            .iter()
            .filter(|r| r.owner.as_deref().is_none_or(|o| o.starts_with("7/")))
            .count();
        if held == 0 {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{held} lanes still held by the intruder 60 s after everything arrived"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let fenced = f
        .cluster
        .lanes(2)
        .await?
        .iter()
        .filter(|l| l.state != "active")
        .count();
    ensure!(fenced == 0, "{fenced} lanes not active after the re-fence");
    f.cluster.wait_ready(1, Duration::from_secs(5)).await?;
    // Said at WARN once per lane, not once per claim.
    let mut warned = 0;
    for id in [1, 2] {
        let log = std::fs::read_to_string(f.cluster.dir().join(format!("node-{id}.1.log")))?;
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("fenced out by a process outside the cluster"))
            .collect();
        ensure!(
            lines.iter().all(|l| l.contains("WARN")) && lines.len() <= 256,
            "node {id}: {} fenced-out lines",
            lines.len()
        );
        warned += lines.len();
    }
    ensure!(warned > 0, "no WARN about the fenced-out lanes");
    println!(
        "{backend:?}: {warned} lanes reported fenced out at WARN; intruder stopped; {} deliveries complete {} ms later, {repeats} repeats",
        exp.len(),
        took.as_millis()
    );
    drop(single);
    f.finish().await;
    Ok(())
}

/// One scenario at a time: they time leases, and three debug-build nodes
/// per scenario already fill these 2-core machines.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

macro_rules! on_both {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                let _one = SERIAL.lock().await;
                $body(Backend::Sqlite).await.unwrap();
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                let _one = SERIAL.lock().await;
                $body(Backend::Postgres).await.unwrap();
            }
        }
    };
}

on_both!(
    three_nodes_every_lane_one_owner_same_view,
    three_nodes_balanced
);
async fn follower_killed(b: Backend) -> anyhow::Result<()> {
    killed_during_run(b, false).await
}
async fn leader_killed(b: Backend) -> anyhow::Result<()> {
    killed_during_run(b, true).await
}

on_both!(follower_killed_lanes_move_nothing_lost, follower_killed);

/// On MongoDB: formation and a follower SIGKILLed during a run.
mod mongodb {
    use super::*;
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_nodes_every_lane_one_owner_same_view() {
        let _one = SERIAL.lock().await;
        three_nodes_balanced(Backend::Mongodb).await.unwrap();
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn follower_killed_lanes_move_nothing_lost() {
        let _one = SERIAL.lock().await;
        follower_killed(Backend::Mongodb).await.unwrap();
    }
}
on_both!(leader_killed_nothing_lost, leader_killed);
on_both!(
    single_intruder_lanes_taken_back_nothing_lost,
    single_intruder
);
on_both!(frozen_past_lease_stops_by_itself, paused_past_lease);
on_both!(
    fourth_node_joins_and_one_is_removed_gracefully,
    fourth_joins_and_one_leaves
);
on_both!(
    whole_cluster_restarts_from_data_dirs,
    whole_cluster_restarts
);
on_both!(same_id_twice_never_both_deliver, same_id_twice);

/// SQLite only: the drain bound is node logic, the same on every store.
mod handler_added_after_start_drains_its_attempts {
    use super::*;
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let _one = SERIAL.lock().await;
        handler_added_after_start(Backend::Sqlite).await.unwrap();
    }
}

/// A lease shorter than the longest handler timeout plus a renewal interval
/// plus the attempt slack is refused at start, with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_shorter_than_a_handler_timeout_is_refused() {
    let db = TestDb::new(Backend::Sqlite, "leasecheck").await.unwrap();
    let store = lanebus_store::open(&db.url).await.unwrap();
    store
        .create_handler(NewHandler {
            name: "slow".into(),
            url: "http://127.0.0.1:9/slow".into(),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms: 5_000,
            max_in_flight: 1,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        })
        .await
        .unwrap();
    let dir = std::env::temp_dir().join(format!(
        "lanebus-leasecheck-{}",
        uuid::Uuid::now_v7().simple()
    ));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lanebus"))
        .args([
            "node",
            "--id",
            "1",
            "--http-addr",
            "127.0.0.1:0",
            "--raft-addr",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(&dir)
        .args([
            "--store",
            &db.url,
            "--bootstrap",
            "--lease-ms",
            "3000",
            "--renew-interval-ms",
            "500",
        ])
        .env_remove("LANEBUS_CONFIG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started with a lease below a handler timeout"
    );
    assert!(
        stderr.contains(
            "lease_ms 3000 must be at least the longest handler timeout (5000 ms) plus \
             renew_interval_ms (500) plus 100 ms"
        ),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
}

mod graceful_stop_gives_the_lease_up {
    use super::*;
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite() {
        let _one = SERIAL.lock().await;
        graceful_stop(Backend::Sqlite).await.unwrap();
    }
}

/// A node started with other lease settings than the cluster's is refused
/// at join (`409`, naming both settings) and never becomes a member: the
/// leader reassigns a node's lanes after its own lease plus margin, so a
/// member with a longer lease could still send after its lanes moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_other_lease_settings_is_refused_at_join() {
    let _one = SERIAL.lock().await;
    let db = TestDb::new(Backend::Sqlite, "leasejoin").await.unwrap();
    let dir = std::env::temp_dir().join(format!(
        "lanebus-leasejoin-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut first = LocalCluster::new(env!("CARGO_BIN_EXE_lanebus"), &dir, &db.url, ARGS);
    first.spawn(1, Start::Bootstrap).unwrap();
    first.wait_ready(1, Duration::from_secs(30)).await.unwrap();
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let mut second = LocalCluster::new(
        env!("CARGO_BIN_EXE_lanebus"),
        &other,
        &db.url,
        &common::lease_3s_args(),
    );
    second.spawn(2, Start::Join(first.url(1))).unwrap();
    let log = other.join("node-2.1.log");
    let deadline = Instant::now() + Duration::from_secs(60);
    let members = loop {
        let v = first.get_json(1, "/admin/cluster").await.unwrap();
        let members = v["nodes"].as_array().map_or(0, Vec::len);
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if members > 1 || text.contains("join refused") {
            break members;
        }
        assert!(
            Instant::now() < deadline,
            "node 2 neither joined nor was refused in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(members, 1, "node 2 joined with other lease settings");
    assert!(
        text.contains("lease settings") && text.contains("3000") && text.contains("1500"),
        "the refusal names both settings: {text}"
    );
    // A request without the settings (an older node, or by hand) too.
    let r = reqwest::Client::new()
        .post(format!("{}/admin/cluster/join", first.url(1)))
        .json(&serde_json::json!({"id": 3, "raft_addr": "127.0.0.1:9", "http_addr": "127.0.0.1:9"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let body = r.text().await.unwrap();
    assert!(body.contains("no lease settings"), "{body}");
    let v = first.get_json(1, "/admin/cluster").await.unwrap();
    assert_eq!(v["nodes"].as_array().map_or(0, Vec::len), 1);
    // Restarted from its data dir without --join, the refused node says it
    // is no member rather than waiting silently.
    second.stop(2, Duration::from_secs(5)).unwrap();
    second.spawn(2, Start::Restart).unwrap();
    let log = other.join("node-2.2.log");
    let deadline = Instant::now() + Duration::from_secs(90);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("not a member of the cluster")
    {
        assert!(
            Instant::now() < deadline,
            "the restarted node did not say it is no member"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = second.stop(2, Duration::from_secs(5));
    let _ = first.stop(1, Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
}
