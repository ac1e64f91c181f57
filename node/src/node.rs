//! Running a node: wiring the store, the actors, the HTTP API and the lane
//! assignment together.
//!
//! ```text
//!  thread "lanebus-node": actix System on a multi-threaded tokio runtime
//!    ├─ StoreActor                       (system arbiter)
//!    ├─ LaneSupervisor                   (system arbiter): assignment watch →
//!    │    start/stop/drain lane owners (plan_lanes); hears when they stopped
//!    ├─ LaneOwner × owned lanes          (system arbiter) ── KeyRunner × keys with work
//!    ├─ cluster member (openraft, --cluster mode): leases, lane table
//!    ├─ store wake-ups → Wake to the lanes named (or every lane owner)
//!    └─ tokio workers: axum HTTP API, webhook requests, catalog refresh
//! ```
//!
//! Actors run on the system arbiter's thread; everything that blocks or
//! burns CPU per request (HTTP serving, building and signing webhook bodies,
//! TLS) runs on the tokio worker threads. [`start`] runs the node on its own
//! OS thread so it can be used from any context (the CLI, tests, the demo)
//! and returns a [`NodeHandle`] once the node is ready.
//!
//! With [`NodeOptions::cluster`] the node is a Raft member
//! ([`lanebus_cluster::Cluster`]) and works the lanes Raft gives it
//! ([`RaftAssignment`]); without, it owns every lane ([`LocalAssignment`]).
//! A lane handed over (planned move) is drained: its owner stops claiming,
//! in-flight work gets [`ClusterOptions::handover_drain`] to finish, then the
//! lane is released; what is still in flight then is abandoned to the next
//! owner (repeated there, invariant 3).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use actix::prelude::*;
use async_trait::async_trait;
use lanebus_api::auth::{Auth, Scope};
use lanebus_api::egress::EgressPolicy;
use lanebus_api::{
    ApiState, ClusterChangeError, ClusterNodeView, ClusterView, JoinRequest, LaneView,
    LeaseSettings, Limits, NodeView,
};
use lanebus_cluster::{
    Cluster, ClusterConfig, ClusterError, ClusterSecret, LeaseConfig, RaftTiming,
};
use lanebus_store::wake::Woken;
use lanebus_store::{Lane, Store, StoreError, Wakeups};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::{oneshot, watch};

use crate::activity::HandlerActivity;
use crate::actors::lane_owner::{LaneDeps, StopLane, Wake};
use crate::actors::lane_supervisor::{Apply, DrainBound, Owners, Shutdown};
use crate::actors::store_actor::Quiesce;
use crate::actors::{
    LaneBoard, LaneConfig, LaneOwner, LaneState, LaneSupervisor, StoreActor, StoreActorConfig,
};
use crate::assignment::{
    owner_node, AssignmentError, FencedOutLanes, LaneAssignment, LocalAssignment, OwnerTie,
    RaftAssignment, Room, WorkGate,
};
use crate::catalog::HandlerCatalog;
use crate::handler::{AttemptCounter, Dispatcher, Handler};
use crate::metrics;
use crate::watchdog::{self, ActorWatchdog};
use crate::webhook::{WebhookError, WebhookSender};

/// Why a node could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Opening or reading the store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Lane fencing failed.
    #[error(transparent)]
    Assignment(#[from] AssignmentError),
    /// The webhook client could not be built.
    #[error(transparent)]
    Webhook(#[from] WebhookError),
    /// The HTTP address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The runtime could not be built or the node thread died.
    #[error("node runtime: {0}")]
    Runtime(String),
    /// A configuration value is unusable (e.g. the lease is not longer than
    /// the longest handler timeout); the message says why.
    #[error("config: {0}")]
    Config(String),
    /// The cluster member could not start, bootstrap or join.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// A cluster member ([`NodeOptions::cluster`] set) whose data dir holds
    /// no Raft state (`raft.redb`) and that neither bootstraps
    /// ([`ClusterOptions::bootstrap`], `--bootstrap`) nor joins
    /// ([`ClusterOptions::join`], `--join URL`): it would take events and
    /// never deliver them. Run without a cluster with `cluster: None`
    /// (`--single`).
    #[error(
        "{} holds no cluster state and none of --bootstrap (start a cluster), --join URL \
         (join one) or --single (run without a cluster) is given: this node would take \
         events and never deliver them",
        data_dir.display()
    )]
    NoClusterState {
        /// The data dir without `raft.redb`.
        data_dir: PathBuf,
    },
    /// [`NodeOptions::webhook_source_ip`] is not an address of this host:
    /// every attempt would fail to bind and end as a dead letter.
    #[error("webhook_source_ip {ip} is not an address of this host (cannot bind to it)")]
    WebhookSourceIp {
        /// The address.
        ip: std::net::IpAddr,
        /// Why binding a socket to it failed.
        source: std::io::Error,
    },
}

/// Running as a cluster member (`lanebus node` without `--single`).
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Node id in the cluster (`--id`), a positive integer.
    pub node_id: u64,
    /// Raft address to bind and record, `IP:PORT`.
    pub raft_addr: String,
    /// Host or IP recorded for this node instead of the bound IPs
    /// ([`ClusterConfig::advertise_host`], `--advertise-addr`).
    pub advertise_host: Option<String>,
    /// The node's data dir (Raft log and state machine).
    pub data_dir: PathBuf,
    /// Lease timing; checked at start against the longest handler timeout.
    pub lease: LeaseConfig,
    /// How many members are Raft voters.
    pub voters: usize,
    /// Raft timing.
    pub raft: RaftTiming,
    /// Start a new cluster with this node ([`Cluster::bootstrap`]).
    pub bootstrap: bool,
    /// Ask the member at this URL (`http://IP:PORT`) to add this node
    /// (`POST /admin/cluster/join`, retried until it answers).
    pub join: Option<String>,
    /// Bound of the drain of a lane handed over; `None`: the longest handler
    /// timeout + 500 ms, at most `lease_ms - renew_interval_ms`.
    pub handover_drain: Option<Duration>,
    /// The cluster secret every Raft connection proves
    /// ([`ClusterConfig::secret`]); `None` only with a loopback Raft address.
    pub secret: Option<ClusterSecret>,
    /// Bearer token (with the `admin` scope) sent with the join request to
    /// [`join`](Self::join), for members that require tokens.
    pub join_token: Option<String>,
}

impl ClusterOptions {
    /// Defaults for node `node_id` with its Raft on `raft_addr` and its
    /// files in `data_dir`: default lease and Raft timing, 3 voters.
    pub fn new(node_id: u64, raft_addr: impl Into<String>, data_dir: impl Into<PathBuf>) -> Self {
        ClusterOptions {
            node_id,
            raft_addr: raft_addr.into(),
            advertise_host: None,
            data_dir: data_dir.into(),
            lease: LeaseConfig::default(),
            voters: 3,
            raft: RaftTiming::default(),
            bootstrap: false,
            join: None,
            handover_drain: None,
            secret: None,
            join_token: None,
        }
    }
}

/// The drain bound of a handover: a bit above the longest handler timeout
/// (so an attempt under way can finish), below the lease less one renewal
/// interval (the lane must not outstay the lease).
pub fn handover_drain_bound(lease: &LeaseConfig, longest_timeout_ms: u64) -> Duration {
    let cap = lease
        .lease_ms
        .saturating_sub(lease.renew_interval_ms)
        .max(1);
    Duration::from_millis((longest_timeout_ms + 500).min(cap))
}

/// Where the node's store comes from.
#[derive(Clone)]
pub enum StoreSource {
    /// Open this URL (`sqlite://...`, `postgres://...`) and migrate it.
    Url(String),
    /// Use an already opened store.
    Opened(Arc<dyn Store>),
}

/// Everything a node is started with.
#[derive(Clone)]
pub struct NodeOptions {
    /// This node's id (the lanes' owner name in the store).
    pub node_id: String,
    /// Address of the HTTP API (`127.0.0.1:0` picks a free port).
    pub http_addr: SocketAddr,
    /// The store.
    pub store: StoreSource,
    /// Per-lane tuning; `poll_interval` is overridden by [`Self::poll_interval`].
    pub lane: LaneConfig,
    /// Claim without wake-up at least this often; `None` picks 100 ms for
    /// stores without push wake-ups and 1 s for stores with them.
    pub poll_interval: Option<Duration>,
    /// Store actor tuning.
    pub store_actor: StoreActorConfig,
    /// Reload the handler catalog at least this often (default 5 s).
    pub catalog_refresh: Duration,
    /// Disable a handler whose attempts failed without a success for this
    /// long (default 5 days, [`crate::catalog::DEFAULT_AUTO_DISABLE_AFTER`]).
    pub auto_disable_after: Duration,
    /// In-process handlers, served for handlers whose URL is
    /// `http://inproc.invalid/NAME` (see [`crate::handler`]).
    pub in_process: HashMap<String, Arc<dyn Handler>>,
    /// HTTP API request limits.
    pub limits: Limits,
    /// At shutdown, how long to wait for in-flight attempts to finish
    /// before abandoning them (default 5 s). Store calls under way then get
    /// the rest of it, and at least 5 s, before they are cut off.
    pub drain_timeout: Duration,
    /// Run as a Raft cluster member; `None`: a single node owning every
    /// lane.
    pub cluster: Option<ClusterOptions>,
    /// Local address webhook requests are sent from; `None`: the OS picks
    /// (see [`WebhookSender::with_source_ip`]).
    pub webhook_source_ip: Option<std::net::IpAddr>,
    /// Retention of completed events (default 24 h, pruned every minute by
    /// the owner of lane 0; see [`crate::retention`]).
    pub retention: crate::retention::RetentionConfig,
    /// The SSRF guard: where webhooks may be sent, checked at registration
    /// and at every send ([`lanebus_api::egress`]). The default refuses
    /// loopback, private, link-local and unique-local targets; embedders
    /// whose receivers run on this machine use
    /// [`EgressPolicy::allow_loopback`].
    pub egress: EgressPolicy,
    /// Credentials and TLS of NATS JetStream handlers ([`crate::nats`]).
    pub nats: crate::nats::NatsSettings,
    /// Credentials and TLS of Kafka handlers ([`crate::kafka`]).
    pub kafka: crate::kafka::KafkaSettings,
    /// Bearer tokens of the API ([`lanebus_api::auth`]). The default,
    /// [`Auth::open`], allows every request, and is accepted only with a
    /// loopback [`http_addr`](Self::http_addr): [`start`] refuses to serve
    /// an open API on any other address.
    pub auth: Auth,
    /// The master key wrapping subjects' data keys (personal fields,
    /// [`lanebus_store::personal`]), given to the store's keyring at start;
    /// `None`: types with personal fields cannot be published here, and
    /// their fields cannot be delivered.
    pub master_key: Option<Arc<lanebus_store::personal::MasterKey>>,
}

impl NodeOptions {
    /// Defaults for a node `node_id` on `store`, API on a free local port.
    pub fn new(node_id: impl Into<String>, store: StoreSource) -> Self {
        NodeOptions {
            node_id: node_id.into(),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            store,
            lane: LaneConfig::default(),
            poll_interval: None,
            store_actor: StoreActorConfig::default(),
            catalog_refresh: Duration::from_secs(5),
            auto_disable_after: crate::catalog::DEFAULT_AUTO_DISABLE_AFTER,
            in_process: HashMap::new(),
            limits: Limits::default(),
            drain_timeout: Duration::from_secs(5),
            cluster: None,
            webhook_source_ip: None,
            retention: crate::retention::RetentionConfig::default(),
            egress: EgressPolicy::default(),
            nats: crate::nats::NatsSettings::default(),
            kafka: crate::kafka::KafkaSettings::default(),
            auth: Auth::open(),
            master_key: None,
        }
    }

    /// The checks [`start`] makes before it opens anything: a cluster
    /// member must have Raft state in its data dir, bootstrap or join
    /// ([`NodeError::NoClusterState`]), and the webhook source address must
    /// be one of this host's ([`NodeError::WebhookSourceIp`]; checked by
    /// binding a socket to it on port 0). Callers may run them earlier,
    /// e.g. before creating directories.
    ///
    /// # Errors
    /// The first check that fails.
    pub fn check(&self) -> Result<(), NodeError> {
        if let Some(c) = &self.cluster {
            if !c.bootstrap && c.join.is_none() && !c.data_dir.join("raft.redb").exists() {
                return Err(NodeError::NoClusterState {
                    data_dir: c.data_dir.clone(),
                });
            }
        }
        if let Some(ip) = self.webhook_source_ip {
            std::net::TcpListener::bind((ip, 0))
                .map_err(|source| NodeError::WebhookSourceIp { ip, source })?;
        }
        Ok(())
    }
}

/// The node as the API sees it ([`NodeView`]).
pub struct NodeState {
    node_id: String,
    store: Arc<dyn Store>,
    cluster: Option<Arc<Cluster>>,
    /// The lane owners, as the [`LaneSupervisor`] runs them.
    owners: Owners,
    board: Arc<LaneBoard>,
    catalog: Arc<HandlerCatalog>,
    metrics: PrometheusHandle,
    ready: watch::Sender<bool>,
    retention: Duration,
    /// The lane lease of a cluster member (`None` with `--single`).
    lease: Option<LeaseConfig>,
    /// Lanes Raft gives this node that someone outside the cluster holds
    /// in the store (see [`crate::assignment`]): `/readyz` answers 503
    /// while any is listed.
    fenced_out: FencedOutLanes,
    /// The dispatcher's count of attempts under way (the graceful stop gives
    /// the lease up only when its total is 0).
    attempts: Arc<AttemptCounter>,
    /// The dispatcher's per-handler samples of recent attempts.
    activity: Arc<HandlerActivity>,
    /// The store wakes the lanes of its own publishes that this node runs
    /// ([`set_runs`](lanebus_store::wake::WakeReceiver::set_runs)): the
    /// API's hint after a publish would wake them twice.
    store_wakes_publishes: bool,
    /// Whether the actor thread runs ([`crate::watchdog`]).
    watchdog: Arc<ActorWatchdog>,
    /// The arbiter of the actor thread.
    actors: actix_rt::ArbiterHandle,
}

impl NodeState {
    /// The arbiter whose thread runs this node's actors (lane owners, key
    /// handlers, the store actor), for work that must run on that thread.
    /// Nothing sent there may block: it would stop every actor of the node
    /// (which [`crate::watchdog`] reports).
    pub fn actor_arbiter(&self) -> &actix_rt::ArbiterHandle {
        &self.actors
    }

    /// Observable lane state of this node.
    pub fn board(&self) -> &Arc<LaneBoard> {
        &self.board
    }

    /// The cluster member, when the node runs in a cluster.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    fn wake_all(&self) {
        for o in self.owners.lock().expect("not poisoned").values() {
            o.addr.do_send(Wake);
        }
    }

    /// Wakes the owners of `lanes` this node runs.
    fn wake(&self, lanes: impl IntoIterator<Item = Lane>) {
        let owners = self.owners.lock().expect("not poisoned");
        for lane in lanes {
            if let Some(o) = owners.get(&lane) {
                o.addr.do_send(Wake);
            }
        }
    }

    /// `GET /admin/lanes` in a cluster: owner, epoch, state and lease from
    /// the Raft state this node applied (the same on every node), backlog
    /// from the store; `in_flight` is this node's own count for the lanes it
    /// runs and 0 for the others (ask their owner for theirs). An active
    /// lane that the store holds for a process outside the cluster (a higher
    /// epoch, or the same epoch under another node's name) shows as
    /// `fenced_out` until Raft re-fences it.
    async fn cluster_lanes(&self, cluster: &Cluster) -> Vec<LaneView> {
        let view = cluster.state();
        let rows: HashMap<Lane, lanebus_store::LaneRow> = self
            .store
            .lane_rows()
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|r| (r.lane, r))
            .collect();
        let board = self.board.snapshot();
        let me = cluster.node_id();
        view.lanes
            .into_iter()
            .map(|l| {
                let in_flight = if l.owner == Some(me) {
                    board
                        .get(&l.lane)
                        .filter(|s| s.epoch == l.epoch && s.state == LaneState::Active)
                        .map_or(0, |s| s.in_flight as i64)
                } else {
                    0
                };
                let row = rows.get(&l.lane);
                let owner = l.owner.map(|o| o.to_string());
                let outsider = row.is_some_and(|r| {
                    r.epoch > l.epoch
                        || (r.epoch == l.epoch
                            && r.owner.as_deref().map(owner_node) != owner.as_deref())
                });
                LaneView {
                    lane: l.lane,
                    owner,
                    epoch: l.epoch,
                    state: cluster_lane_state(&l.state, outsider, l.lease_expires_in_ms)
                        .to_string(),
                    lease_expires_in_ms: l.lease_expires_in_ms.map(|m| m as i64),
                    backlog: row.map_or(0, |r| r.backlog),
                    in_flight,
                }
            })
            .collect()
    }
}

/// The `state` of a lane in `/admin/lanes` in a cluster, from its Raft
/// state, whether the store holds it for a process outside the cluster, and
/// its owner's lease as this node sees it (`Some(0)`: ran out; nobody works
/// the lane until the owner renews or the leader moves it).
fn cluster_lane_state(
    state: &lanebus_cluster::assignment::LaneState,
    outsider: bool,
    lease_expires_in_ms: Option<u64>,
) -> &'static str {
    use lanebus_cluster::assignment::LaneState as Raft;
    match state {
        Raft::Unassigned => "unassigned",
        Raft::Active if outsider => LaneState::FencedOut.as_str(),
        Raft::Active if lease_expires_in_ms == Some(0) => "lease_lapsed",
        Raft::Active => "active",
        Raft::Releasing { .. } | Raft::Handover { .. } => "releasing",
    }
}

fn change_error(e: ClusterError) -> ClusterChangeError {
    match e {
        ClusterError::Refused(m) => ClusterChangeError::Refused(m),
        other => ClusterChangeError::Unavailable(other.to_string()),
    }
}

#[async_trait]
impl NodeView for NodeState {
    fn node_id(&self) -> String {
        self.node_id.clone()
    }

    async fn lanes(&self) -> Result<Vec<LaneView>, lanebus_store::StoreError> {
        if let Some(c) = &self.cluster {
            // Raft's table; the store only adds outsiders' fences.
            return Ok(self.cluster_lanes(c).await);
        }
        let rows = self.store.lane_rows().await?;
        let board = self.board.snapshot();
        Ok(rows
            .into_iter()
            .map(|r| {
                let mine = board.get(&r.lane).filter(|s| {
                    s.epoch == r.epoch && r.owner.as_deref().map(owner_node) == Some(&self.node_id)
                });
                LaneView {
                    lane: r.lane,
                    owner: r.owner.as_deref().map(|o| owner_node(o).to_string()),
                    epoch: r.epoch,
                    state: match (mine, board.get(&r.lane)) {
                        (Some(s), _) => s.state.as_str().to_string(),
                        (None, Some(s)) if s.state == LaneState::FencedOut => {
                            LaneState::FencedOut.as_str().to_string()
                        }
                        (None, Some(_)) => LaneState::Stopped.as_str().to_string(),
                        (None, None) => "unassigned".to_string(),
                    },
                    lease_expires_in_ms: None,
                    backlog: r.backlog,
                    in_flight: mine.map(|s| s.in_flight as i64).unwrap_or(0),
                }
            })
            .collect())
    }

    fn published(&self, lanes: &[Lane]) {
        if !self.store_wakes_publishes {
            self.wake(lanes.iter().copied());
        }
    }

    fn handlers_changed(&self) {
        self.catalog.request_reload();
    }

    fn handler_activity(&self, handler_id: &str) -> Vec<lanebus_api::ActivitySample> {
        use crate::clock::Clock as _;
        let clock = crate::clock::SystemClock;
        self.activity.samples(handler_id, clock.now(), clock.wall())
    }

    fn retention(&self) -> Option<Duration> {
        Some(self.retention)
    }

    fn longest_timeout(&self) -> Option<Duration> {
        self.lease
            .map(|l| Duration::from_millis(l.longest_timeout_ms()))
    }

    /// Started, joined (in a cluster), no lane of this node fenced out by a
    /// process outside the cluster, and its actor thread running (`/readyz`
    /// pings the store itself).
    async fn ready(&self) -> Result<(), String> {
        if !*self.ready.borrow() {
            return Err("starting or stopping".into());
        }
        // First: a stall also lets the lease lapse, which `joined` reports.
        if self.watchdog.stalled() {
            return Err(
                "its actor thread has stopped running, so its lanes deliver nothing (see its \
                 ERROR log)"
                    .into(),
            );
        }
        if self.cluster.as_ref().is_some_and(|c| !c.joined()) {
            return Err("not a cluster member with a valid lease (yet)".into());
        }
        let fenced: Vec<Lane> = {
            let f = self.fenced_out.lock().expect("not poisoned");
            f.keys().copied().collect()
        };
        if !fenced.is_empty() {
            return Err(format!(
                "{} of its lanes fenced out by a process outside the cluster (lanes {fenced:?})",
                fenced.len()
            ));
        }
        Ok(())
    }

    /// The API checked the id and the addresses (`422` before this call).
    async fn join_node(&self, req: JoinRequest) -> Result<(), ClusterChangeError> {
        let c = self
            .cluster
            .as_ref()
            .ok_or(ClusterChangeError::NotClustered)?;
        if let Some(ours) = self.lease.as_ref().map(lease_settings) {
            let Some(theirs) = req.lease else {
                tracing::warn!(
                    node = req.id,
                    "join refused: the request carries no lease settings"
                );
                return Err(ClusterChangeError::Refused(format!(
                    "the join request carries no lease settings (a node older than this one, or \
                     a request made by hand): add \"lease\": {{\"lease_ms\": {}, \
                     \"renew_interval_ms\": {}, \"margin_ms\": {}}} if node {} runs the \
                     cluster's settings ({ours})",
                    ours.lease_ms, ours.renew_interval_ms, ours.margin_ms, req.id
                )));
            };
            if theirs != ours {
                tracing::warn!(node = req.id, ours = %ours, theirs = %theirs, "join refused: lease settings differ");
                return Err(ClusterChangeError::Refused(format!(
                    "lease settings differ: this cluster runs {ours}, node {} was started with {theirs}; \
                     start it with the cluster's settings (a longer lease than the leader's would let \
                     it send after its lanes moved)",
                    req.id
                )));
            }
        }
        c.add_node(req.id, &req.raft_addr, &req.http_addr)
            .await
            .map_err(change_error)
    }

    async fn remove_node(&self, id: u64) -> Result<(), ClusterChangeError> {
        let c = self
            .cluster
            .as_ref()
            .ok_or(ClusterChangeError::NotClustered)?;
        c.remove_node(id).await.map_err(change_error)
    }

    async fn cluster(&self) -> ClusterView {
        let Some(c) = &self.cluster else {
            // Lane counts are left at 0 while the store does not answer.
            let lanes = self.lanes().await.unwrap_or_default();
            let owned = lanes
                .iter()
                .filter(|l| l.owner.as_deref() == Some(self.node_id.as_str()))
                .count();
            return ClusterView {
                node_id: self.node_id.clone(),
                leader: Some(self.node_id.clone()),
                term: 0,
                nodes: vec![ClusterNodeView {
                    id: self.node_id.clone(),
                    raft_addr: None,
                    http_addr: None,
                    voter: true,
                    alive: true,
                    lanes: owned as u32,
                }],
            };
        };
        let v = c.state();
        ClusterView {
            node_id: v.node_id.to_string(),
            leader: v.leader.map(|l| l.to_string()),
            term: v.term,
            nodes: v
                .members
                .into_iter()
                .map(|m| ClusterNodeView {
                    id: m.id.to_string(),
                    raft_addr: Some(m.raft_addr),
                    http_addr: Some(m.http_addr),
                    voter: m.voter,
                    alive: m.alive,
                    lanes: m.lanes as u32,
                })
                .collect(),
        }
    }

    fn render_metrics(&self) -> String {
        crate::metrics::claim_horizon_age(self.board.horizon_age());
        self.metrics.render()
    }
}

/// A running node. Dropping it does not stop the node; call [`shutdown`](Self::shutdown).
pub struct NodeHandle {
    /// The bound HTTP API address.
    pub http_addr: SocketAddr,
    /// The node's state (store, lanes, metrics).
    pub state: Arc<NodeState>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), NodeError>>>,
    exited: Option<oneshot::Receiver<()>>,
}

impl NodeHandle {
    /// `http://IP:PORT` of the API.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The node's store.
    pub fn store(&self) -> Arc<dyn Store> {
        self.state.store.clone()
    }

    /// Stops the node and waits for its thread to end: lanes stop claiming,
    /// in-flight attempts get [`NodeOptions::drain_timeout`] to finish and be
    /// recorded; what is still in flight then is abandoned (its deliveries
    /// stay in the store and are attempted again by the lane's next owner).
    /// Store calls under way (claims, completions) end before the node
    /// does, within the drain timeout or 5 s after it, whichever is later.
    ///
    /// # Errors
    /// [`NodeError::Runtime`] if the node thread panicked.
    pub async fn shutdown(mut self) -> Result<(), NodeError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.join().await
    }

    /// Waits until the node stops by itself (it never does unless its
    /// runtime fails) or the process is interrupted.
    ///
    /// # Errors
    /// What the node thread returned.
    pub async fn wait(mut self) -> Result<(), NodeError> {
        if let Some(rx) = self.exited.take() {
            let _ = rx.await;
        }
        self.join().await
    }

    async fn join(&mut self) -> Result<(), NodeError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        tokio::task::spawn_blocking(move || thread.join())
            .await
            .map_err(|e| NodeError::Runtime(e.to_string()))?
            .map_err(|_| NodeError::Runtime("node thread panicked".into()))?
    }
}

/// Starts a node on its own thread and returns once it serves HTTP and owns
/// its lanes.
///
/// # Errors
/// [`NodeError`] naming what failed during start-up; first the checks of
/// [`NodeOptions::check`] (no cluster state and no way to get one, a
/// webhook source address not on this host), before the store is opened.
pub async fn start(opts: NodeOptions) -> Result<NodeHandle, NodeError> {
    let (started_tx, started_rx) = oneshot::channel();
    let (shutdown_tx, shutdown_rx) = oneshot::channel();
    let (exited_tx, exited_rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("lanebus-node".into())
        .spawn(move || {
            let system = actix_rt::System::with_tokio_rt(|| {
                tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .thread_name("lanebus-worker")
                    .build()
                    .expect("tokio runtime")
            });
            let handle = system.block_on(async { tokio::runtime::Handle::current() });
            let res = system.block_on(run(opts, started_tx, shutdown_rx));
            // Actors still holding a pooled database connection are dropped
            // with the system; returning the connection spawns a task, which
            // needs a tokio context even while the runtime shuts down.
            {
                let _context = handle.enter();
                drop(system);
            }
            let _ = exited_tx.send(());
            res
        })
        .map_err(|e| NodeError::Runtime(e.to_string()))?;
    match started_rx.await {
        Ok(Ok((http_addr, state))) => Ok(NodeHandle {
            http_addr,
            state,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
            exited: Some(exited_rx),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => match thread.join() {
            Ok(Err(e)) => Err(e),
            _ => Err(NodeError::Runtime(
                "node thread ended during start-up".into(),
            )),
        },
    }
}

type Started = Result<(SocketAddr, Arc<NodeState>), NodeError>;

async fn run(
    opts: NodeOptions,
    started: oneshot::Sender<Started>,
    shutdown: oneshot::Receiver<()>,
) -> Result<(), NodeError> {
    let drain_timeout = opts.drain_timeout;
    let Booted {
        store_actor,
        api,
        retention,
        supervisor,
        state,
        addr,
        watchdog,
    } = match boot(opts).await {
        Ok(v) => v,
        Err(e) => {
            let msg = e.to_string();
            let _ = started.send(Err(e));
            return Err(NodeError::Runtime(msg));
        }
    };
    // Ready (`/readyz` 200) comes later in a cluster: once this node is a
    // member ("joined the cluster" below).
    tracing::info!(node_id = %state.node_id, http_addr = %addr, backend = state.store.backend(), "node started");
    if let Some(c) = state.cluster.clone() {
        tokio::spawn(async move {
            while !c.joined() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            tracing::info!(node_id = c.node_id(), "joined the cluster: ready");
        });
    }
    let _ = started.send(Ok((addr, state.clone())));
    let _ = shutdown.await;
    tracing::info!(node_id = %state.node_id, "node stopping");
    state.ready.send_replace(false);
    // The actors stop from here on: no stall to report.
    let _ = watchdog.send(());
    // The supervisor starts no owner any more (a second owner of a lane at
    // the same epoch next to the one draining would claim the rows still in
    // flight and hand them over again), drains its owners and answers once
    // they all stopped, or at the deadline.
    let deadline = tokio::time::Instant::now() + drain_timeout;
    let (done, drained) = oneshot::channel();
    supervisor.do_send(Shutdown {
        until: deadline.into_std(),
        done,
    });
    let (owners, ties): (Vec<Addr<LaneOwner>>, Vec<Arc<OwnerTie>>) =
        drained.await.unwrap_or_default().into_iter().unzip();
    // Attempts of owners stopped earlier (a lapsed lease stops them at
    // once, their attempts go on) are not on the board: the dispatcher
    // counts every attempt under way.
    while state.attempts.total() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let on_board: usize = state
        .board
        .snapshot()
        .values()
        .filter(|s| s.state == LaneState::Active)
        .map(|s| s.in_flight)
        .sum();
    let abandoned = on_board.max(state.attempts.total());
    if abandoned > 0 {
        tracing::warn!(
            abandoned,
            "drain timed out: in-flight deliveries left to the next owner"
        );
    }
    for (a, tie) in owners.into_iter().zip(ties) {
        tie.end();
        a.do_send(StopLane);
    }
    if let Some(c) = &state.cluster {
        // Drained: nothing of this node's lanes is in flight, so it can give
        // its lease up and the leader moves the lanes at once (otherwise
        // their keys wait for the lease and the margin). Not after a drain
        // that timed out: an attempt still in flight must not overtake the
        // next owner's, which is what waiting for the lease prevents.
        if abandoned == 0 {
            let lease = state.lease.map_or(Duration::from_secs(2), |l| {
                Duration::from_millis(l.lease_ms)
            });
            match c.release_lease(lease.min(Duration::from_secs(2))).await {
                Ok(()) => tracing::info!("lease given up: the lanes move now"),
                Err(e) => {
                    tracing::warn!(error = %e, "could not give the lease up: the lanes move after it ends")
                }
            }
        }
        c.shutdown().await;
    }
    // The store calls under way end before the runtime goes (no new one
    // starts): a call cut off there leaves its outcome unknown and, on
    // MongoDB, its transaction open on the server, holding the lane
    // documents or counters it wrote until the server reaps it (the driver
    // aborts a dropped session's transaction in a task of this runtime,
    // which never runs once it has gone). They get the rest of the drain,
    // and at least QUIESCE_GRACE: a stop stays bounded by the drain timeout
    // the operator set, not by the store's call timeout.
    // The HTTP API likewise: it takes no new request and answers those under
    // way (a publish among them is acknowledged or refused, never cut off);
    // retention pruning stops between its statements.
    let quiesce = deadline
        .saturating_duration_since(tokio::time::Instant::now())
        .max(QUIESCE_GRACE);
    let _ = api.stop.send(());
    let _ = retention.stop.send(());
    let calls = async {
        let _ = store_actor.send(Quiesce).await;
        let _ = api.task.await;
        let _ = retention.task.await;
    };
    if tokio::time::timeout(quiesce, calls).await.is_err() {
        tracing::warn!(
            waited_ms = quiesce.as_millis() as u64,
            "store calls or requests still under way at stop: cut off (their outcome is \
             unknown; a MongoDB transaction among them stays open until the server aborts it)"
        );
    }
    System::current().stop();
    Ok(())
}

/// Least time a stopping node gives its store calls under way after the
/// drain (see [`run`]), so a drain that used its whole timeout does not cut
/// off a call that was about to end.
const QUIESCE_GRACE: Duration = Duration::from_secs(5);

/// What [`boot`] started.
struct Booted {
    state: Arc<NodeState>,
    /// The API's address.
    addr: SocketAddr,
    supervisor: Addr<LaneSupervisor>,
    store_actor: Addr<StoreActor>,
    /// The HTTP API's server.
    api: Stoppable,
    /// The retention pruning task.
    retention: Stoppable,
    /// Stops the actor thread's watchdog.
    watchdog: oneshot::Sender<()>,
}

/// A task that ends soon after it is told to stop (between its requests or
/// statements, never in one).
struct Stoppable {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Stoppable {
    /// Spawns `run`, which gets the stop signal.
    fn spawn<F>(run: impl FnOnce(oneshot::Receiver<()>) -> F) -> Self
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let (stop, rx) = oneshot::channel();
        Stoppable {
            stop,
            task: tokio::spawn(run(rx)),
        }
    }
}

/// Starts everything a node runs, in order: the store and the handler
/// catalog, the API's listener, the cluster member, the shared state and
/// the API, the lane assignment and its lane owners, the store's
/// wake-ups. Returns once the node is ready (its lanes fenced and their
/// owners started).
async fn boot(opts: NodeOptions) -> Result<Booted, NodeError> {
    opts.check()?;
    let metrics_handle = metrics::install_recorder();
    let (store, catalog) = open_store(&opts).await?;
    let wakeups = store.wakeups().await?;
    let (listener, addr) = bind_api(&opts).await?;
    let cluster = start_cluster(&opts, &store, addr).await?;
    let (owners, fenced_out) = (Owners::default(), FencedOutLanes::default());
    let store_wakes_publishes = match &wakeups {
        Wakeups::Push(rx) => {
            rx.set_runs(runs_lane(&owners, work_gate(cluster.as_ref()), &fenced_out))
        }
        Wakeups::Poll => false,
    };
    let dispatcher = Dispatcher::new(
        WebhookSender::with_source_ip(opts.egress.clone(), opts.webhook_source_ip)?,
        opts.in_process.clone(),
        store.lanes(),
    )
    .with_nats(opts.nats.clone())
    .with_kafka(opts.kafka.clone())
    .with_keys(store.clone());
    let state = Arc::new(NodeState {
        node_id: opts.node_id.clone(),
        store: store.clone(),
        cluster: cluster.clone(),
        owners,
        board: Arc::new(LaneBoard::default()),
        catalog: catalog.clone(),
        metrics: metrics_handle,
        ready: watch::channel(false).0,
        retention: opts.retention.retention,
        lease: opts.cluster.as_ref().map(|c| c.lease),
        fenced_out,
        attempts: dispatcher.attempt_counter(),
        activity: dispatcher.activity(),
        store_wakes_publishes,
        watchdog: Arc::new(ActorWatchdog::default()),
        actors: actix_rt::Arbiter::current(),
    });
    let watchdog = start_watchdog(&state);
    let retention = {
        let (store, board, config) = (store.clone(), Arc::downgrade(&state.board), opts.retention);
        Stoppable::spawn(move |stop| crate::retention::run(store, board, config, stop))
    };
    let api = serve_api(&opts, listener, &state);
    let store_actor = StoreActor::new(store.clone(), opts.store_actor).start();
    let deps = LaneDeps {
        store_actor: store_actor.clone(),
        catalog,
        dispatcher,
        board: state.board.clone(),
        config: lane_config(&opts, &wakeups),
        gate: work_gate(cluster.as_ref()),
        fenced_out: None,
        supervisor: None,
    };
    let (assignment, drain_bound) = assignment(&opts, &state).await?;
    let supervisor = start_lane_supervisor(&state, deps, assignment, drain_bound).await?;
    forward_wakeups(wakeups, &state);
    state.ready.send_replace(true);
    Ok(Booted {
        state,
        addr,
        supervisor,
        store_actor,
        api,
        retention,
        watchdog,
    })
}

/// Beats on the actor thread (this one) and checks the beats on a worker
/// ([`crate::watchdog`]); a stall withholds the cluster's lease renewals.
/// The checker ends when the returned sender is used or dropped.
fn start_watchdog(state: &Arc<NodeState>) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel();
    actix_rt::spawn(watchdog::beat(state.watchdog.clone(), watchdog::BEAT));
    let cluster = state.cluster.clone();
    tokio::spawn(watchdog::watch(
        state.watchdog.clone(),
        watchdog::CHECK,
        watchdog::STALL_CHECKS,
        move |stalled| {
            if let Some(c) = &cluster {
                c.withhold_renewals(stalled);
            }
        },
        stopped,
    ));
    stop
}

/// Opens the store and loads the handler catalog (reloaded in the
/// background from then on); checks the cluster's lease against the
/// longest handler timeout.
async fn open_store(
    opts: &NodeOptions,
) -> Result<(Arc<dyn Store>, Arc<HandlerCatalog>), NodeError> {
    let store = match &opts.store {
        StoreSource::Url(url) => lanebus_store::open(url).await?,
        StoreSource::Opened(s) => s.clone(),
    };
    if let Some(k) = &opts.master_key {
        store.keyring().set_master(Arc::clone(k));
    }
    let catalog = Arc::new(HandlerCatalog::new(store.clone()));
    catalog.set_auto_disable_after(opts.auto_disable_after);
    catalog.reload_fresh().await?;
    tokio::spawn(catalog.clone().refresh_loop(opts.catalog_refresh));
    let longest_timeout_ms = catalog.longest_timeout_ms();
    if let Some(c) = &opts.cluster {
        c.lease.validate(longest_timeout_ms).map_err(|e| {
            NodeError::Config(format!(
                "{e} (lease_ms {}, renew_interval_ms {}, lease_margin_ms {})",
                c.lease.lease_ms, c.lease.renew_interval_ms, c.lease.margin_ms
            ))
        })?;
    }
    Ok((store, catalog))
}

/// The lane owners' tuning: the poll interval defaults to 1 s for stores
/// that push wake-ups, 100 ms for the others.
fn lane_config(opts: &NodeOptions, wakeups: &Wakeups) -> LaneConfig {
    let mut config = opts.lane;
    config.poll_interval = opts.poll_interval.unwrap_or(match wakeups {
        Wakeups::Push(_) => Duration::from_secs(1),
        Wakeups::Poll => Duration::from_millis(100),
    });
    config
}

/// Binds the API's listener; refuses an address off loopback without
/// tokens.
async fn bind_api(opts: &NodeOptions) -> Result<(tokio::net::TcpListener, SocketAddr), NodeError> {
    if opts.auth.is_open() && !opts.http_addr.ip().is_loopback() {
        return Err(NodeError::Config(format!(
            "refusing to serve the API on {} without tokens: anyone who can reach it could \
             publish and change handlers; set admin_tokens and/or publish_tokens \
             (--admin-tokens, LANEBUS_ADMIN_TOKENS, ...), or bind http_addr to a loopback \
             address such as 127.0.0.1",
            opts.http_addr
        )));
    }
    let listener = tokio::net::TcpListener::bind(opts.http_addr)
        .await
        .map_err(|source| NodeError::Bind {
            addr: opts.http_addr,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| NodeError::Bind {
        addr: opts.http_addr,
        source,
    })?;
    if opts.auth.is_open() {
        tracing::info!(
            http_addr = %addr,
            "no API tokens configured: the API serves on loopback only and allows every request"
        );
    } else {
        tracing::info!(
            publish_tokens = opts.auth.count(Scope::Publish),
            admin_tokens = opts.auth.count(Scope::Admin),
            "the API requires bearer tokens"
        );
    }
    Ok((listener, addr))
}

/// Starts the Raft member of a cluster node (`None` with `--single`),
/// advertising the API at `addr`.
async fn start_cluster(
    opts: &NodeOptions,
    store: &Arc<dyn Store>,
    addr: SocketAddr,
) -> Result<Option<Arc<Cluster>>, NodeError> {
    let Some(c) = &opts.cluster else {
        return Ok(None);
    };
    let mut cfg = ClusterConfig::new(
        c.node_id,
        c.raft_addr.clone(),
        addr.to_string(),
        &c.data_dir,
    );
    cfg.lanes = store.lanes();
    cfg.lease = c.lease;
    cfg.voters = c.voters;
    cfg.raft = c.raft;
    cfg.incarnation = uuid::Uuid::now_v7().simple().to_string();
    cfg.secret = c.secret.clone();
    cfg.advertise_host = c.advertise_host.clone();
    Ok(Some(Arc::new(Cluster::start(cfg).await?)))
}

/// Whether this node may hand work over: in a cluster, while its holder
/// lease is valid ([`Cluster::work_until`]); always without one.
fn work_gate(cluster: Option<&Arc<Cluster>>) -> WorkGate {
    match cluster {
        Some(c) => {
            let c = c.clone();
            WorkGate::new(move || c.work_until().map_or(Room::Closed, Room::Until))
        }
        None => WorkGate::default(),
    }
}

/// Serves the HTTP API on `listener` until told to stop, then answers the
/// requests under way and ends.
fn serve_api(
    opts: &NodeOptions,
    listener: tokio::net::TcpListener,
    state: &Arc<NodeState>,
) -> Stoppable {
    let app = lanebus_api::router(ApiState {
        store: state.store.clone(),
        node: state.clone(),
        limits: opts.limits,
        egress: opts.egress.clone(),
        auth: opts.auth.clone(),
    });
    Stoppable::spawn(move |stop| async move {
        // The wrapped listener gives hyper's own refusals (a URI over its
        // limit, an unparsable request) the API's JSON error shape.
        if let Err(e) = axum::serve(lanebus_api::serve::listener(listener), app)
            .with_graceful_shutdown(async move {
                let _ = stop.await;
            })
            .await
        {
            tracing::error!(error = %e, "http server stopped");
        }
    })
}

/// The node's lane assignment and the bound of a handover's drain: through
/// Raft in a cluster (bootstrapping or joining first, as asked), every lane
/// without one.
async fn assignment(
    opts: &NodeOptions,
    state: &Arc<NodeState>,
) -> Result<(Arc<dyn LaneAssignment>, DrainBound), NodeError> {
    let (Some(c), Some(o)) = (&state.cluster, &opts.cluster) else {
        return Ok((
            Arc::new(LocalAssignment::new(
                state.store.clone(),
                opts.node_id.clone(),
            )),
            DrainBound::Fixed(opts.drain_timeout),
        ));
    };
    if o.bootstrap {
        bootstrap(c).await?;
    }
    if !o.bootstrap && o.join.is_none() {
        tokio::spawn(warn_if_never_admitted(c.clone()));
    }
    if let Some(url) = &o.join {
        tokio::spawn(join_loop(
            url.clone(),
            o.join_token.clone(),
            JoinRequest {
                id: o.node_id,
                raft_addr: c.raft_addr().to_string(),
                http_addr: c.http_addr().to_string(),
                lease: Some(lease_settings(&o.lease)),
            },
        ));
    }
    let bound = match o.handover_drain {
        Some(d) => DrainBound::Fixed(d),
        None => DrainBound::Handover(o.lease),
    };
    // A lane fenced by an outsider is taken back after the same bound as a
    // dead node's lanes.
    let refence_after = Duration::from_millis(o.lease.lease_ms + o.lease.margin_ms);
    let assignment = RaftAssignment::new(
        c.clone(),
        state.store.clone(),
        refence_after,
        state.fenced_out.clone(),
    );
    Ok((Arc::new(assignment), bound))
}

/// Starts the assignment (its lanes fenced) and the lane supervisor that
/// follows it with lane owners built from `deps`; returns once the owners
/// of the lanes fenced so far are started.
async fn start_lane_supervisor(
    state: &Arc<NodeState>,
    mut deps: LaneDeps,
    assignment: Arc<dyn LaneAssignment>,
    drain_bound: DrainBound,
) -> Result<Addr<LaneSupervisor>, NodeError> {
    deps.fenced_out = assignment.fenced_out_reports();
    tracing::info!(owner = assignment.owner(), "fencing lanes as this owner");
    let work = assignment.start().await?;
    let supervisor =
        LaneSupervisor::new(state.owners.clone(), deps, assignment, work, drain_bound).start();
    supervisor
        .send(Apply)
        .await
        .map_err(|e| NodeError::Runtime(format!("lane supervisor: {e}")))?;
    Ok(supervisor)
}

/// Whether this node runs `lane`, as the store asks before it leaves a
/// publish's NOTIFY out ([`set_runs`](lanebus_store::wake::WakeReceiver::set_runs)):
/// an owner is running and not handing the lane over (the next owner, on
/// another node, must hear of new work), the node may work (`gate`: in a
/// cluster, its lease is valid), and no process outside the cluster holds
/// the lane (`fenced_out`). Called on the store's publish path: a poisoned
/// lock is read all the same.
fn runs_lane(
    owners: &Owners,
    gate: WorkGate,
    fenced_out: &FencedOutLanes,
) -> lanebus_store::wake::RunsLane {
    let (owners, fenced_out) = (owners.clone(), fenced_out.clone());
    Arc::new(move |lane| {
        gate.open()
            && owners
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&lane)
                .is_some_and(|o| !o.draining && o.addr.connected())
            && !fenced_out
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(&lane)
    })
}

/// Passes the store's wake-ups (if it pushes them) to the owners of the
/// lanes they name, or to every lane owner.
fn forward_wakeups(wakeups: Wakeups, state: &Arc<NodeState>) {
    if let Wakeups::Push(mut rx) = wakeups {
        let st = state.clone();
        actix_rt::spawn(async move {
            while let Some(woken) = rx.recv().await {
                match woken {
                    Woken::All => st.wake_all(),
                    Woken::Lanes(lanes) => st.wake(lanes),
                }
            }
        });
    }
}

/// `--bootstrap`: a one-node cluster of this node (idempotent), retried
/// while no leader is elected yet.
async fn bootstrap(cluster: &Cluster) -> Result<(), NodeError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match cluster.bootstrap().await {
            Ok(()) => return Ok(()),
            Err(ClusterError::Unavailable { .. }) if tokio::time::Instant::now() < deadline => {
                tracing::info!("bootstrap: waiting for a leader");
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// How long a node restarted from its data dir, without `--join`, may take
/// to find itself in the cluster's state before it says it is not there.
const ADMITTED_WITHIN: Duration = Duration::from_secs(30);

/// Logs at WARN when a node started from its data dir without `--join` is
/// no member after [`ADMITTED_WITHIN`]: its data dir holds Raft state, but
/// it was never admitted (a refused join), so it would wait for ever.
async fn warn_if_never_admitted(c: Arc<Cluster>) {
    tokio::time::sleep(ADMITTED_WITHIN).await;
    if !c.is_member() {
        tracing::warn!(
            after_s = ADMITTED_WITHIN.as_secs(),
            "this node is not a member of the cluster: its data dir holds Raft state, but no \
             join was ever accepted (a refused join?); start it with --join URL and the \
             cluster's settings"
        );
    }
}

/// The settings a join request carries and a member compares.
fn lease_settings(l: &LeaseConfig) -> LeaseSettings {
    LeaseSettings {
        lease_ms: l.lease_ms,
        renew_interval_ms: l.renew_interval_ms,
        margin_ms: l.margin_ms,
    }
}

/// `--join URL`: asks that member to add this node, until it answers 2xx
/// (retried every 500 ms while it cannot be reached or has no leader; a 409
/// is logged and retried too, slower, since an operator may fix it).
async fn join_loop(url: String, token: Option<String>, req: JoinRequest) {
    let client = reqwest::Client::new();
    let target = format!("{}/admin/cluster/join", url.trim_end_matches('/'));
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        let mut r = client.post(&target).json(&req);
        if let Some(t) = &token {
            r = r.bearer_auth(t);
        }
        let r = r.timeout(Duration::from_secs(15)).send().await;
        match r {
            Ok(resp) if resp.status().is_success() => {
                tracing::info!(url = %target, id = req.id, "joined: the cluster recorded this node");
                return;
            }
            Ok(resp) => {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                tracing::warn!(url = %target, %status, %body, attempt, "join refused; retrying");
                // A refusal an operator must fix (a conflict, a missing or
                // wrong join token) is asked again more slowly.
                let wait = if matches!(status.as_u16(), 401 | 403 | 409) {
                    5_000
                } else {
                    500
                };
                tokio::time::sleep(Duration::from_millis(wait)).await;
            }
            Err(e) => {
                tracing::info!(url = %target, error = %e, attempt, "join: member not reachable; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanebus_cluster::assignment::LaneState as Raft;

    #[test]
    fn an_active_lane_whose_owner_lease_ran_out_is_shown_lapsed() {
        assert_eq!(
            cluster_lane_state(&Raft::Active, false, Some(900)),
            "active"
        );
        assert_eq!(cluster_lane_state(&Raft::Active, false, None), "active");
        assert_eq!(
            cluster_lane_state(&Raft::Active, false, Some(0)),
            "lease_lapsed"
        );
        assert_eq!(
            cluster_lane_state(&Raft::Active, true, Some(0)),
            "fenced_out",
            "a fence from outside is said first"
        );
        assert_eq!(
            cluster_lane_state(&Raft::Releasing { to: 2 }, false, Some(0)),
            "releasing"
        );
        assert_eq!(
            cluster_lane_state(&Raft::Handover { to: 2, at: 9 }, false, None),
            "releasing"
        );
        assert_eq!(
            cluster_lane_state(&Raft::Unassigned, false, None),
            "unassigned"
        );
    }
}
