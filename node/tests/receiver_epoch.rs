//! The receiver's fencing recipe (docs/api.md, "Receiving webhooks";
//! `examples/src/receiver.rs`) against a real deposed owner (issue 14):
//! three `lanebus node` processes on one store deliver through a small
//! HTTP proxy to the example receiver, which de-duplicates by `webhook-id`
//! and answers `409` to a new id whose `lanebus-epoch` is below the highest
//! it accepted for its lane.
//!
//! ```text
//!  node A ──e1 (epoch a)──▶ proxy: held ........................ released ──▶ receiver: 409
//!    SIGSTOP, lease ends;  lane moves to B (epoch b > a)
//!  node B ──e1 (epoch b)──▶ proxy: 502 (the path fails), dead letter
//!  node B ──e2 (epoch b)──▶ proxy ──▶ receiver: 200, applied, epoch b kept
//! ```
//!
//! Why a dead letter: the new owner delivers the key's events in order, so
//! a deposed owner's late request is either for an event the new owner has
//! delivered too (the receiver knows its id: a duplicate, `200`, not
//! applied again) or for one it gave up on. Only then is the late request
//! a write the receiver has never seen, of a lower sequence than what it
//! applied since, and only the epoch tells it apart: without the check the
//! receiver applies e1 after e2.
//!
//! The hold stands for a partition between node A and the receiver that
//! heals after A's lane moved: the request left A (A waits for its answer)
//! and reaches the receiver late. The proxy SIGSTOPs A as soon as it holds
//! the request, well inside the handler's timeout, so that A neither times
//! out nor renews its lease.

mod common;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use common::{Backend, TestDb};
use lanebus_examples::receiver::Inbox;
use lanebus_store::{lane_of_key, DeadLetterFilter, NewEvent, NewHandler, DEFAULT_LANES};
use lanebus_testkit::local_cluster::{LocalCluster, Start};

const HANDLER_TIMEOUT_MS: u64 = 2_000;

const KEY: &str = "customer-7";

/// One request through the proxy, recorded when it was answered.
#[derive(Debug, Clone)]
struct Hop {
    /// The sending node's id (nodes of a local cluster send from
    /// `127.0.0.{id + 1}`).
    sender: u64,
    /// `webhook-id`.
    id: String,
    /// `lanebus-sequence`.
    seq: Option<i64>,
    /// `lanebus-lane`.
    lane: Option<u16>,
    /// `lanebus-epoch`.
    epoch: Option<i64>,
    /// Whether it reached the receiver (else the proxy answered 502).
    forwarded: bool,
    /// The answer the node got.
    status: u16,
    /// The answer's body.
    body: String,
}

/// What the proxy does with the first request of [`Proxy::hold_id`].
#[derive(Default)]
struct Gate {
    /// The node whose request is held.
    held_by: Option<u64>,
    /// Whether the held request may go on.
    released: bool,
}

/// An HTTP proxy in front of the receiver that holds the first request of
/// one event (and freezes its sender) until released, and fails that
/// event's requests from every other node with 502.
struct Proxy {
    target: String,
    hold_id: String,
    /// Process ids of the nodes, to freeze the holder.
    pids: HashMap<u64, u32>,
    client: reqwest::Client,
    gate: Mutex<Gate>,
    log: Mutex<Vec<Hop>>,
    changed: tokio::sync::Notify,
}

impl Proxy {
    fn hops(&self) -> Vec<Hop> {
        self.log.lock().expect("not poisoned").clone()
    }

    fn held_by(&self) -> Option<u64> {
        self.gate.lock().expect("not poisoned").held_by
    }

    fn release(&self) {
        self.gate.lock().expect("not poisoned").released = true;
        self.changed.notify_waiters();
    }

    /// Waits until `cond` holds over the log; `what` names it for the error.
    async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&[Hop]) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            if cond(&self.hops()) {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() && !cond(&self.hops()) {
                anyhow::bail!(
                    "{what}: not within {timeout:?}; requests: {:#?}",
                    self.hops()
                );
            }
        }
    }
}

fn node_of(ip: IpAddr) -> u64 {
    match ip {
        IpAddr::V4(v4) => u64::from(v4.octets()[3]).saturating_sub(1),
        IpAddr::V6(_) => 0,
    }
}

async fn relay(
    State(p): State<Arc<Proxy>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, String) {
    let sender = node_of(peer.ip());
    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok());
    let mut hop = Hop {
        sender,
        id: h("webhook-id").unwrap_or_default().to_owned(),
        seq: h("lanebus-sequence").and_then(|v| v.parse().ok()),
        lane: h("lanebus-lane").and_then(|v| v.parse().ok()),
        epoch: h("lanebus-epoch").and_then(|v| v.parse().ok()),
        forwarded: false,
        status: 502,
        body: String::new(),
    };
    let mut hold = false;
    if hop.id == p.hold_id {
        let mut gate = p.gate.lock().expect("not poisoned");
        match gate.held_by {
            None => {
                gate.held_by = Some(sender);
                hold = true;
            }
            Some(a) if a != sender => {
                drop(gate);
                hop.body = "the path to the receiver failed".into();
                p.log.lock().expect("not poisoned").push(hop.clone());
                p.changed.notify_waiters();
                return (StatusCode::BAD_GATEWAY, hop.body);
            }
            Some(_) => {}
        }
    }
    if hold {
        // The sender waits for the answer: freeze it now, inside the
        // handler's timeout, so that it neither times out nor renews.
        if let Some(pid) = p.pids.get(&sender) {
            let _ = std::process::Command::new("kill")
                .args(["-STOP", &pid.to_string()])
                .status();
        }
        p.changed.notify_waiters();
        loop {
            let notified = p.changed.notified();
            if p.gate.lock().expect("not poisoned").released {
                break;
            }
            notified.await;
        }
    }
    let mut fwd = HeaderMap::new();
    for (k, v) in &headers {
        if k != "host" && k != "content-length" {
            fwd.insert(k.clone(), v.clone());
        }
    }
    match p
        .client
        .post(&p.target)
        .headers(fwd)
        .body(body)
        .send()
        .await
    {
        Ok(r) => {
            hop.forwarded = true;
            hop.status = r.status().as_u16();
            hop.body = r.text().await.unwrap_or_default();
        }
        Err(e) => hop.body = format!("receiver unreachable: {e}"),
    }
    p.log.lock().expect("not poisoned").push(hop.clone());
    p.changed.notify_waiters();
    (
        StatusCode::from_u16(hop.status).unwrap_or(StatusCode::BAD_GATEWAY),
        hop.body,
    )
}

async fn serve_proxy(p: Arc<Proxy>, listener: tokio::net::TcpListener) {
    let app = axum::Router::new()
        .route("/webhook", axum::routing::post(relay))
        .with_state(p)
        .into_make_service_with_connect_info::<SocketAddr>();
    let _ = axum::serve(listener, app).await;
}

/// The last warnings and errors of each node's log under `dir`, for a
/// failure's message (CI keeps the output, not the files).
fn warnings(dir: &std::path::Path) -> String {
    let mut out = format!("logs in {}", dir.display());
    let mut logs: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        out.push_str(&format!("\n{}:", log.display()));
        for l in &lines[lines.len().saturating_sub(12)..] {
            out.push_str(&format!("\n  {}", l.chars().take(240).collect::<String>()));
        }
    }
    out
}

fn event(id: &str, n: i64) -> NewEvent {
    NewEvent {
        id: Some(id.into()),
        event_type: "order.updated".into(),
        key: Some(KEY.into()),
        payload: serde_json::json!({"customer": KEY, "n": n})
            .to_string()
            .into_bytes(),
        deliver_at: None,
        expected_seq: None,
    }
}

async fn late_write_of_a_deposed_owner(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "receiver_epoch").await?;
    let dir = std::env::temp_dir().join(format!(
        "lanebus-receiver-epoch-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir)?;
    let store = lanebus_store::open(&db.url).await?;
    let secret = lanebus_store::generate_secret();
    let inbox = Inbox::new(secret.clone());
    let target = lanebus_examples::receiver::serve(inbox.clone()).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxy_url = format!("http://{}/webhook", listener.local_addr()?);
    let handler = store
        .create_handler(NewHandler {
            name: "orders".into(),
            url: proxy_url,
            event_types: vec!["order.*".into()],
            // One attempt: the new owner's failed attempt of e1 makes it a
            // dead letter and the key goes on to e2.
            max_attempts: 1,
            timeout_ms: HANDLER_TIMEOUT_MS,
            max_in_flight: 16,
            secret,
            rate_limit: None,
            filter: None,
        })
        .await?;

    let mut cluster = LocalCluster::new(
        env!("CARGO_BIN_EXE_lanebus"),
        &dir,
        &db.url,
        &common::lease_3s_args(),
    );
    cluster.spawn(1, Start::Bootstrap)?;
    cluster.wait_ready(1, Duration::from_secs(60)).await?;
    let join = cluster.url(1);
    for id in [2, 3] {
        cluster.spawn(id, Start::Join(join.clone()))?;
    }
    for id in [1, 2, 3] {
        cluster.wait_ready(id, Duration::from_secs(60)).await?;
    }
    cluster
        .wait_balanced(1, &[1, 2, 3], Duration::from_secs(60))
        .await?;
    // Freeze a node only once its fencing writes are done: on SQLite a node
    // frozen inside one keeps the file's write lock, and no other node can
    // take its lanes until it resumes.
    let balanced = Instant::now();
    common::wait_fenced(&cluster, 1, store.as_ref(), Duration::from_secs(60))
        .await
        .with_context(|| warnings(&dir))?;
    println!(
        "{backend:?}: every lane fenced in the store {} ms after the cluster showed them balanced",
        balanced.elapsed().as_millis()
    );
    let mut pids = HashMap::new();
    for id in [1, 2, 3] {
        pids.insert(id, cluster.pid(id).context("node not running")?);
    }
    let proxy = Arc::new(Proxy {
        target,
        hold_id: "e1".into(),
        pids,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?,
        gate: Mutex::default(),
        log: Mutex::default(),
        changed: tokio::sync::Notify::new(),
    });
    tokio::spawn(serve_proxy(proxy.clone(), listener));

    // e1 and e2 of one key: the lane's owner (A) sends e1; the proxy holds
    // it and freezes A.
    store.publish(vec![event("e1", 1), event("e2", 2)]).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let a = loop {
        let notified = proxy.changed.notified();
        if let Some(a) = proxy.held_by() {
            break a;
        }
        ensure!(
            Instant::now() < deadline,
            "no node sent e1 within 60 s (logs in {})",
            dir.display()
        );
        let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
    };
    let lane = lane_of_key(KEY, DEFAULT_LANES);

    // A's lease ends; another node (B) takes the lane at a higher epoch,
    // fails e1 (dead letter) and delivers e2, which the receiver applies.
    proxy
        .wait(
            "e2 accepted from the lane's new owner",
            Duration::from_secs(60),
            |hops| hops.iter().any(|h| h.id == "e2" && h.status == 200),
        )
        .await
        .with_context(|| warnings(&dir))?;
    let hops = proxy.hops();
    let e2 = hops
        .iter()
        .find(|h| h.id == "e2" && h.status == 200)
        .expect("waited for")
        .clone();
    ensure!(
        e2.sender != a,
        "node {a} sent e2 itself: its held attempt of e1 ended before it was frozen \
         (a timeout?); requests: {hops:#?} (logs in {})",
        dir.display()
    );
    let b = e2.sender;
    let owner = cluster
        .lanes(b)
        .await?
        .into_iter()
        .find(|l| l.lane == lane)
        .context("the key's lane")?;
    ensure!(
        owner.owner.as_deref() == Some(b.to_string().as_str()) && Some(owner.epoch) == e2.epoch,
        "lane {lane} as node {b} sees it: {owner:?}; e2 came from node {b} at epoch {:?}",
        e2.epoch
    );
    ensure!(
        hops.iter()
            .any(|h| h.id == "e1" && h.sender == b && !h.forwarded),
        "node {b} sent e2 without attempting e1: {hops:#?}"
    );

    // The partition heals: A's held request reaches the receiver.
    proxy.release();
    proxy
        .wait(
            "the held request answered",
            Duration::from_secs(30),
            |hops| hops.iter().any(|h| h.id == "e1" && h.sender == a),
        )
        .await?;
    cluster.signal(a, "CONT")?;
    let hops = proxy.hops();
    let late = hops
        .iter()
        .find(|h| h.id == "e1" && h.sender == a)
        .expect("waited for")
        .clone();

    // What the receiver applied for the key, in order: B's e2 only. Without
    // the epoch check it would have applied A's e1 (sequence 1) after e2.
    let applied: Vec<i64> = inbox
        .events()
        .iter()
        .filter(|e| e["data"]["customer"] == KEY)
        .filter_map(|e| e["data"]["n"].as_i64())
        .collect();
    ensure!(
        applied == [2],
        "the receiver applied {applied:?} for {KEY} (A's late e1 is n 1): {hops:#?}"
    );
    ensure!(
        late.forwarded && late.status == 409,
        "A's late e1 was answered {} ({}), not 409",
        late.status,
        late.body
    );
    let (ea, eb) = (
        late.epoch.context("lanebus-epoch")?,
        e2.epoch.context("lanebus-epoch")?,
    );
    ensure!(
        ea < eb && late.lane == Some(lane) && e2.lane == Some(lane),
        "A's e1 at lane {:?} epoch {ea}, B's e2 at lane {:?} epoch {eb}",
        late.lane,
        e2.lane
    );
    ensure!(
        late.seq < e2.seq,
        "sequences: A's e1 {:?}, B's e2 {:?}",
        late.seq,
        e2.seq
    );
    // Nothing of A's was accepted after B's first accepted request.
    let first_b = hops
        .iter()
        .position(|h| h.sender == b && h.status == 200)
        .expect("e2");
    ensure!(
        !hops[first_b..]
            .iter()
            .any(|h| h.sender == a && (200..300).contains(&h.status)),
        "node {a}'s requests accepted after node {b}'s: {hops:#?}"
    );
    // e1 is a dead letter (B's failed attempt), not lost silently.
    let dead = store
        .list_dead_letters(&DeadLetterFilter {
            handler_id: Some(handler.id.clone()),
            after_id: None,
            limit: 10,
        })
        .await?;
    ensure!(
        dead.iter().map(|d| d.event_id.as_str()).collect::<Vec<_>>() == ["e1"],
        "dead letters: {dead:?}"
    );
    println!(
        "{backend:?}: node {a} sent e1 at epoch {ea}, held and frozen; node {b} took lane {lane} at epoch {eb}, \
         e1 failed there (dead letter), e2 applied; A's e1 then answered {} and not applied",
        late.status
    );

    for id in [1, 2, 3] {
        let _ = cluster.stop(id, Duration::from_secs(5));
    }
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
    Ok(())
}

/// One cluster at a time on these small machines.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_write_of_a_deposed_owner_is_refused_sqlite() {
    let _one = SERIAL.lock().await;
    late_write_of_a_deposed_owner(Backend::Sqlite)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_write_of_a_deposed_owner_is_refused_postgres() {
    let _one = SERIAL.lock().await;
    late_write_of_a_deposed_owner(Backend::Postgres)
        .await
        .unwrap();
}

#[cfg(test)]
mod fenced_tests {
    use super::common::fenced;
    use lanebus_store::{Epoch, LaneRow};
    use lanebus_testkit::local_cluster::ApiLane;

    fn lane(lane: u16, owner: &str, epoch: i64) -> ApiLane {
        ApiLane {
            lane,
            owner: Some(owner.into()),
            epoch,
            state: "active".into(),
            backlog: 0,
        }
    }

    fn row(lane: u16, owner: &str, epoch: u64) -> LaneRow {
        LaneRow {
            lane,
            owner: Some(owner.into()),
            epoch: Epoch(epoch),
            backlog: 0,
        }
    }

    #[test]
    fn fenced_wants_the_store_at_the_clusters_owner_and_epoch() {
        let lanes = [lane(0, "1", 3), lane(1, "2", 4)];
        assert_eq!(
            fenced(&lanes, &[row(0, "1/a", 3), row(1, "2/b", 4)]),
            Ok(())
        );
        let behind = [row(0, "1/a", 3), row(1, "1/a", 2)];
        assert!(fenced(&lanes, &behind).unwrap_err().starts_with("lane 1:"));
        assert!(fenced(&lanes, &[row(0, "1/a", 3)])
            .unwrap_err()
            .starts_with("lane 1:"));
        let other_node = [row(0, "12/a", 3), row(1, "2/b", 4)];
        assert!(fenced(&lanes, &other_node)
            .unwrap_err()
            .starts_with("lane 0:"));
    }
}
