//! A sandbox of cluster members on 127.0.0.1 with temp data dirs, short
//! leases, and a "drainer" per node that releases handed-over lanes at once
//! (acting as the node's lane owners).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lanebus_cluster::{
    Cluster, ClusterConfig, ClusterView, Epoch, LeaseConfig, NetSwitch, NodeId, RaftTiming,
};
use tokio::task::JoinHandle;

pub const LEASE: LeaseConfig = LeaseConfig {
    lease_ms: 1_500,
    renew_interval_ms: 300,
    margin_ms: 500,
};

pub const LANES: u16 = 256;

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "lanebus_cluster=info,openraft=warn".into()),
        )
        .with_test_writer()
        .try_init();
}

pub struct Node {
    pub id: NodeId,
    pub dir: PathBuf,
    pub raft_addr: String,
    pub http_addr: String,
    pub cluster: Option<Arc<Cluster>>,
    /// Raft snapshot interval, in log entries.
    pub snapshot_every: u64,
    /// The cluster secret this node is started with.
    pub secret: Option<String>,
    /// The host recorded instead of the bound IP (`--advertise-addr`).
    pub advertise: Option<String>,
    drainer: Option<JoinHandle<()>>,
}

impl Node {
    pub fn c(&self) -> &Arc<Cluster> {
        self.cluster.as_ref().expect("node is running")
    }

    pub fn view(&self) -> ClusterView {
        self.c().state()
    }

    /// The lanes this node owns now, by its own lease.
    pub fn owned_now(&self) -> Vec<u16> {
        self.c()
            .node_lanes()
            .borrow()
            .owned
            .keys()
            .copied()
            .collect()
    }

    pub fn net(&self) -> NetSwitch {
        self.c().net().clone()
    }

    /// Starts (or restarts from its data dir) this node.
    pub async fn start(&mut self, drain: bool) {
        let mut cfg = ClusterConfig::new(self.id, &self.raft_addr, &self.http_addr, &self.dir);
        cfg.lanes = LANES;
        cfg.lease = LEASE;
        cfg.secret = self.secret.clone().map(lanebus_cluster::ClusterSecret);
        cfg.advertise_host = self.advertise.clone();
        cfg.raft = RaftTiming {
            heartbeat_ms: 60,
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 700,
            snapshot_every_entries: self.snapshot_every,
        };
        let c = Arc::new(Cluster::start(cfg).await.expect("cluster starts"));
        self.raft_addr = c.raft_addr().to_owned();
        if drain {
            self.drainer = Some(tokio::spawn(drainer(c.clone())));
        }
        self.cluster = Some(c);
    }

    /// Starts or stops the test's drainer for this node.
    pub fn set_drainer(&mut self, on: bool) {
        if let Some(d) = self.drainer.take() {
            d.abort();
        }
        if on {
            self.drainer = Some(tokio::spawn(drainer(self.c().clone())));
        }
    }

    /// Stops the node as a crash would (no handover, no goodbye).
    pub async fn kill(&mut self) {
        if let Some(d) = self.drainer.take() {
            d.abort();
            let _ = d.await;
        }
        if let Some(c) = self.cluster.take() {
            c.shutdown().await;
        }
    }
}

/// Releases every lane the node is asked to hand over, at once.
async fn drainer(c: Arc<Cluster>) {
    let mut rx = c.node_lanes();
    loop {
        let lanes: Vec<(u16, Option<u64>)> = rx
            .borrow_and_update()
            .releasing
            .iter()
            .map(|(&l, r)| (l, r.at))
            .collect();
        for (lane, at) in lanes {
            if let Err(e) = c.release(lane, at).await {
                tracing::debug!(lane, error = %e, "test drainer: release failed");
            }
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

pub struct Sandbox {
    pub nodes: Vec<Node>,
    _root: tempfile::TempDir,
}

impl Sandbox {
    pub fn new() -> Self {
        init_tracing();
        Sandbox {
            nodes: Vec::new(),
            _root: tempfile::tempdir().expect("temp dir"),
        }
    }

    /// Adds node `id` (not started); its Raft port is picked at first start.
    pub fn add(&mut self, id: NodeId) -> usize {
        let dir = self._root.path().join(format!("node-{id}"));
        self.nodes.push(Node {
            id,
            dir,
            raft_addr: "127.0.0.1:0".into(),
            http_addr: format!("127.0.0.1:{}", 18_000 + id),
            cluster: None,
            snapshot_every: 200,
            secret: None,
            advertise: None,
            drainer: None,
        });
        self.nodes.len() - 1
    }

    pub fn node(&self, id: NodeId) -> &Node {
        self.nodes.iter().find(|n| n.id == id).expect("known node")
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .expect("known node")
    }

    pub fn running(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.cluster.is_some())
    }

    /// Starts `ids`: the first bootstraps, the others join through it.
    pub async fn start_cluster(&mut self, ids: &[NodeId]) {
        for &id in ids {
            self.add(id);
            self.node_mut(id).start(true).await;
        }
        let first = self.node(ids[0]).c().clone();
        first.bootstrap().await.expect("bootstrap");
        for &id in &ids[1..] {
            self.join(ids[0], id).await;
        }
    }

    /// Nodes 1, 2 and 3 started, three voters, the lanes balanced over
    /// them and every view the same (within 20 s).
    pub async fn three_balanced() -> Self {
        let mut sb = Sandbox::new();
        sb.start_cluster(&[1, 2, 3]).await;
        wait_until(Duration::from_secs(20), "3 nodes balanced", || {
            let v = sb.node(1).view();
            balanced_over(&v, &[1, 2, 3]) && voters(&v) == 3 && views_agree(&sb)
        })
        .await;
        sb
    }

    /// Asks member `via` to add node `id`.
    pub async fn join(&self, via: NodeId, id: NodeId) {
        let n = self.node(id);
        self.node(via)
            .c()
            .add_node(id, &n.raft_addr, &n.http_addr)
            .await
            .expect("join");
    }

    /// The leader as the running nodes agree on it.
    pub fn leader(&self) -> Option<NodeId> {
        let leaders: Vec<_> = self.running().map(|n| n.view().leader).collect();
        let l = leaders[0]?;
        (leaders.iter().all(|&x| x == Some(l)) && self.running().any(|n| n.id == l)).then_some(l)
    }
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after
/// `timeout`. Returns how long it took.
pub async fn wait_until<F: FnMut() -> bool>(
    timeout: Duration,
    what: &str,
    mut cond: F,
) -> Duration {
    let start = Instant::now();
    loop {
        if cond() {
            return start.elapsed();
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn wait_until_async<F, Fut>(timeout: Duration, what: &str, mut cond: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return start.elapsed();
        }
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One member as the replicated state holds it: id, raft address, HTTP
/// address, voter, leaving, lane count.
pub type MemberRow = (u64, String, String, bool, bool, usize);
/// One lane as the replicated state holds it: owner, epoch, state.
pub type LaneRow = (Option<u64>, Epoch, lanebus_cluster::assignment::LaneState);

/// The replicated part of a view: what must be equal on every node.
pub fn replicated(v: &ClusterView) -> (Vec<MemberRow>, Vec<LaneRow>) {
    let members: Vec<_> = v
        .members
        .iter()
        .map(|m| {
            (
                m.id,
                m.raft_addr.clone(),
                m.http_addr.clone(),
                m.voter,
                m.leaving,
                m.lanes,
            )
        })
        .collect();
    let lanes: Vec<_> = v
        .lanes
        .iter()
        .map(|l| (l.owner, l.epoch, l.state))
        .collect();
    (members, lanes)
}

/// What the replicated state must become after the owners of `before`'s
/// lanes restarted from their data dirs: the same members and owners, every
/// owned lane one epoch further (a restarted process records its new
/// incarnation, which moves its lanes to the next epoch so that nothing the
/// previous process did at the old epoch can be mistaken for its own).
pub fn after_restart(before: &(Vec<MemberRow>, Vec<LaneRow>)) -> (Vec<MemberRow>, Vec<LaneRow>) {
    let lanes = before
        .1
        .iter()
        .map(|&(owner, epoch, state)| {
            (
                owner,
                if owner.is_some() { epoch.next() } else { epoch },
                state,
            )
        })
        .collect();
    (before.0.clone(), lanes)
}

/// Lane → (owner, epoch) of a view.
pub fn owners(v: &ClusterView) -> BTreeMap<u16, (Option<NodeId>, Epoch)> {
    v.lanes
        .iter()
        .map(|l| (l.lane, (l.owner, l.epoch)))
        .collect()
}

/// Whether every lane is active with an owner among `nodes`, and counts
/// differ by at most one.
pub fn balanced_over(v: &ClusterView, nodes: &[NodeId]) -> bool {
    let mut counts: BTreeMap<NodeId, usize> = nodes.iter().map(|&n| (n, 0)).collect();
    for l in &v.lanes {
        if l.state != lanebus_cluster::assignment::LaneState::Active {
            return false;
        }
        match l.owner.and_then(|o| counts.get_mut(&o)) {
            Some(c) => *c += 1,
            None => return false,
        }
    }
    let (min, max) = (counts.values().min(), counts.values().max());
    matches!((min, max), (Some(a), Some(b)) if b - a <= 1)
}

/// Whether every running node shows the same replicated view.
pub fn views_agree(sb: &Sandbox) -> bool {
    let views: Vec<_> = sb.running().map(|n| replicated(&n.view())).collect();
    views.windows(2).all(|w| w[0] == w[1])
}

/// Whether nodes `ids` show the same replicated view.
pub fn views_agree_among(sb: &Sandbox, ids: &[NodeId]) -> bool {
    let views: Vec<_> = ids
        .iter()
        .map(|&id| replicated(&sb.node(id).view()))
        .collect();
    views.windows(2).all(|w| w[0] == w[1])
}

pub fn voters(v: &ClusterView) -> usize {
    v.members.iter().filter(|m| m.voter).count()
}
