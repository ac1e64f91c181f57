//! The running cluster member: starts openraft on the on-disk storage and the
//! TCP transport, and runs the two duties that carry out what the pure code
//! ([`crate::assignment`], [`crate::lease`]) decides.
//!
//! ```text
//!                    ┌──────────── every node ─────────────┐
//!  renew task ──RenewLease──▶ write(): local client_write   │
//!     │ committed(sent_at)        └ ForwardToLeader ─TCP─▶ leader's client_write
//!     ▼                                                     │
//!  HolderLease ──valid?──▶ publisher ──▶ node_lanes()  (watch: owned and releasing
//!                              ▲                      together; empty when lapsed)
//!  state machine (applied) ────┘                            │
//!                    └──────────────────────────────────────┘
//!                    ┌──────────── leader only ────────────┐
//!  tick: live = members whose last renewal (applied, own clock,
//!        no earlier than the election) + lease + margin is not past
//!        plan_draining(lanes, live, leaving) ──▶ Apply{changes}
//!        reconcile Raft membership with the members table:
//!        add learners, promote while voters < target, remove leavers
//!                    └──────────────────────────────────────┘
//! ```
//!
//! ## Leases
//!
//! Every node proposes [`Command::RenewLease`] every `renew_interval_ms`
//! (each in its own task, with a deadline of `lease_ms`). When one commits,
//! [`HolderLease::committed`] gets the *send* time of that renewal, on this
//! node's monotonic clock; [`Cluster::node_lanes`] is emptied as soon as
//! `sent + lease_ms` passes without a newer commit, whether or not Raft is
//! reachable. The leader counts from when *it applied* a node's last renewal
//! (later than the send), and no earlier than its own election, and treats the
//! node as dead only after `lease_ms + margin_ms`
//! ([`LeaseConfig::expired_for_leader`]). So a node that cannot renew has
//! stopped its lanes before any other node may get them. A node that
//! cannot work its lanes withholds its renewals on purpose
//! ([`Cluster::withhold_renewals`]) to the same end. Keep
//! `election_timeout_max_ms + renew_interval_ms` well below `lease_ms`: no
//! renewal commits during an election.
//!
//! ## Membership
//!
//! The members table in the state machine is the source of truth; the
//! leader makes the Raft membership follow it, one change per tick: a new
//! member becomes a learner, a caught-up learner is promoted while there are
//! fewer than `voters` voters, a leaving member that owns no lane any more is
//! removed from Raft and then forgotten. So [`Cluster::add_node`] and
//! [`Cluster::remove_node`] are plain commands that work from any node, and
//! a leader that crashes half-way leaves nothing for a person to repair.
//!
//! ## Writes
//!
//! Writes ([`Command`]) are proposed with openraft's `client_write`. openraft
//! 0.9 does not forward a write made on a follower, so [`Cluster`] does: on
//! `ForwardToLeader` it sends the command to the leader's Raft address over
//! the transport (a `ClientWrite` RPC, one hop: the receiver never forwards
//! again) and retries, waiting for an election if needed, until a deadline.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};
use openraft::raft::ClientWriteResponse;
use openraft::{BasicNode, ChangeMembers, ServerState, SnapshotPolicy};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::assignment::{self, LaneState};
use crate::lease::{HolderLease, LeaseConfig};
use crate::network::{
    self, Channel, ClusterSecret, NetSwitch, NetworkFactory, RpcRequest, RpcResponse, Transport,
    WriteRejected,
};
use crate::state::{Command, CommandResult, Releasing};
use crate::storage::{self, Applied, LogStore, StateMachineStore};
use crate::{Epoch, NodeId, Raft, TypeConfig};

/// Raft timing, in milliseconds. Elections must finish well within a lease,
/// or a leader change costs every node its lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftTiming {
    /// Leader heartbeat interval.
    pub heartbeat_ms: u64,
    /// Lower bound of the randomized election timeout.
    pub election_timeout_min_ms: u64,
    /// Upper bound of the randomized election timeout.
    pub election_timeout_max_ms: u64,
    /// Build a snapshot (and purge the log behind it) after this many
    /// entries since the last one.
    pub snapshot_every_entries: u64,
}

impl Default for RaftTiming {
    /// 250 ms heartbeats, elections after 1 to 2 s of silence, a snapshot
    /// every 2,000 entries (about 3 minutes of renewals of 3 nodes at the
    /// default 2 s interval, plus lane changes).
    fn default() -> Self {
        RaftTiming {
            heartbeat_ms: 250,
            election_timeout_min_ms: 1_000,
            election_timeout_max_ms: 2_000,
            snapshot_every_entries: 2_000,
        }
    }
}

/// Everything [`Cluster::start`] needs.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// This node's id (`--id`); unique in the cluster, never reused.
    pub node_id: NodeId,
    /// `IP:PORT` the Raft RPC server binds and other nodes connect to. Port 0
    /// binds any free port ([`Cluster::raft_addr`] tells which): only for
    /// tests, since members are recorded with their address.
    pub raft_addr: String,
    /// `IP:PORT` of this node's HTTP API, recorded for forwarding.
    pub http_addr: String,
    /// Host name or IP other nodes reach this node at (`--advertise-addr`),
    /// when it differs from the bound IPs (a node bound to `0.0.0.0` in a
    /// container, a DNS name that survives an IP change). The members table
    /// then records `HOST:PORT` with the ports of
    /// [`raft_addr`](Self::raft_addr) and [`http_addr`](Self::http_addr).
    /// `None`: the bound addresses are recorded (and may not be unspecified).
    pub advertise_host: Option<String>,
    /// Directory for `raft.redb` (created if missing).
    pub data_dir: PathBuf,
    /// Number of lanes (the store's count). Fixed at the cluster's first
    /// start; a different count on a later start is refused.
    pub lanes: u16,
    /// Lease timing. `start` only refuses zero values; check it against the
    /// longest handler timeout with [`LeaseConfig::validate`] before (the node
    /// knows its handlers, this crate does not).
    pub lease: LeaseConfig,
    /// How many members become Raft voters (the first to join); the others
    /// are learners. 3 by default.
    pub voters: usize,
    /// Raft timing.
    pub raft: RaftTiming,
    /// Fault-injection switch (tests): cut to isolate this node.
    pub net: NetSwitch,
    /// Unique name of this process start; the node also uses it in the owner
    /// name it fences lanes with in the store. Proposed as
    /// [`Command::Incarnate`] before the first renewal, so a restarted node
    /// gets new epochs for its lanes. [`ClusterConfig::new`] makes one from
    /// the clock and the process id.
    pub incarnation: String,
    /// The cluster secret every Raft connection must prove (module
    /// `network`: an HMAC challenge, the secret never crosses the wire).
    /// `None` (or empty) is allowed only when [`raft_addr`](Self::raft_addr)
    /// is a loopback address; [`Cluster::start`] refuses it otherwise.
    pub secret: Option<ClusterSecret>,
}

impl ClusterConfig {
    /// A configuration with the defaults: 256 lanes, the default lease, 3
    /// voters, default Raft timing.
    pub fn new(
        node_id: NodeId,
        raft_addr: impl Into<String>,
        http_addr: impl Into<String>,
        data_dir: impl Into<PathBuf>,
    ) -> Self {
        ClusterConfig {
            node_id,
            raft_addr: raft_addr.into(),
            http_addr: http_addr.into(),
            advertise_host: None,
            data_dir: data_dir.into(),
            lanes: 256,
            lease: LeaseConfig::default(),
            voters: 3,
            raft: RaftTiming::default(),
            net: NetSwitch::default(),
            incarnation: default_incarnation(),
            secret: None,
        }
    }
}

/// How long [`Cluster::add_node`] waits for the new member to answer the
/// Raft handshake at its address.
pub const JOIN_PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Checks an advertised host: an IP that is not unspecified, or a DNS name
/// (RFC 1123 labels of letters, digits and hyphens, at most 253 bytes); no
/// port, no scheme. The error says what was wrong.
pub fn check_advertise_host(host: &str) -> std::result::Result<(), String> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        if ip.is_unspecified() {
            return Err(format!(
                "advertise_addr {host:?} is an unspecified address: peers cannot reach it"
            ));
        }
        return Ok(());
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if host.is_empty() || host.len() > 253 || !host.split('.').all(label_ok) {
        return Err(format!(
            "advertise_addr {host:?} must be an IP or a DNS name without port or scheme, such as \
             10.0.0.5 or lanebus-1.internal"
        ));
    }
    Ok(())
}

/// `host` with the port of `addr` (`IP:PORT`): `HOST:PORT`, brackets
/// around an IPv6 host.
fn advertised(host: &str, addr: &str) -> Result<String> {
    let port = addr
        .parse::<std::net::SocketAddr>()
        .map_err(|_| ClusterError::Config(format!("{addr:?} must be IP:PORT")))?
        .port();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    Ok(match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, port).to_string(),
        Err(_) => format!("{host}:{port}"),
    })
}

/// A name for this process start: wall-clock nanoseconds and process id, in
/// hex (unique enough: two starts of one node id in the same nanosecond with
/// the same pid do not happen).
fn default_incarnation() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{nanos:x}-{:x}", std::process::id())
}

/// Errors of the cluster API.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A configuration value is unusable (caller's mistake).
    #[error("invalid cluster config: {0}")]
    Config(String),
    /// The Raft address could not be bound.
    #[error("cannot bind raft_addr {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The data dir could not be opened or read.
    #[error("raft storage in {path}: {message}")]
    Storage {
        /// The data dir.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// The data dir was created with another lane count.
    #[error("data dir holds {found} lanes but {configured} are configured; the lane count is fixed when the cluster is created")]
    LaneCount {
        /// Lanes in the data dir.
        found: usize,
        /// Lanes configured.
        configured: u16,
    },
    /// No leader could be reached in time (election in progress, this node
    /// cut off, or no quorum). Retry later.
    #[error("no raft leader reachable within {timeout_ms} ms")]
    Unavailable {
        /// How long was tried.
        timeout_ms: u64,
    },
    /// The state machine refused the command (e.g. releasing a lane this
    /// node is not releasing); the reason says why.
    #[error("refused: {0}")]
    Refused(String),
    /// Raft stopped (shut down or a storage fault); fatal for this node.
    #[error("raft failed: {0}")]
    Raft(String),
}

/// Shorthand for results of this module.
pub type Result<T, E = ClusterError> = std::result::Result<T, E>;

/// One member in [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MemberView {
    /// Node id.
    pub id: NodeId,
    /// Raft RPC address.
    pub raft_addr: String,
    /// HTTP API address.
    pub http_addr: String,
    /// Whether it is a Raft voter (else a learner, or not yet in Raft).
    pub voter: bool,
    /// Whether its removal was requested.
    pub leaving: bool,
    /// Whether its lease is current as this node knows it (see
    /// [`ClusterView`]).
    pub alive: bool,
    /// Lanes it owns (active or releasing).
    pub lanes: usize,
    /// Milliseconds left of its lease as this node knows it (0 when lapsed;
    /// `None` before its first renewal).
    pub lease_expires_in_ms: Option<u64>,
}

/// One lane in [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LaneView {
    /// Lane number.
    pub lane: u16,
    /// Owner, if any.
    pub owner: Option<NodeId>,
    /// Fencing epoch.
    pub epoch: Epoch,
    /// Lifecycle state.
    pub state: LaneState,
    /// The owner's `lease_expires_in_ms` (see [`MemberView`]).
    pub lease_expires_in_ms: Option<u64>,
}

/// The cluster as this node sees it (its applied state): what
/// `GET /admin/cluster` and `GET /admin/lanes` show.
///
/// Members, owners, epochs and states are replicated, so every node that has
/// applied the same log shows the same. `alive` and `lease_expires_in_ms` are
/// local estimates: for this node its own holder lease; for others, counted
/// from when this node applied their last renewal (the leader also counts no
/// earlier than its election, as it does when deciding).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ClusterView {
    /// This node.
    pub node_id: NodeId,
    /// The leader this node knows of.
    pub leader: Option<NodeId>,
    /// Current Raft term.
    pub term: u64,
    /// Members by id.
    pub members: Vec<MemberView>,
    /// The lane table, by lane number.
    pub lanes: Vec<LaneView>,
}

struct Inner {
    cfg: ClusterConfig,
    raft: Raft,
    sm: StateMachineStore,
    transport: Arc<Transport>,
    /// Origin of this node's monotonic milliseconds.
    base: Instant,
    holder: Mutex<HolderLease>,
    lanes: watch::Sender<NodeLanes>,
    /// (term, instant) this node became leader, while it is.
    leader_since: Mutex<Option<(u64, Instant)>>,
    /// Set by [`Cluster::release_lease`]: the renewal duty sends nothing more.
    released: std::sync::atomic::AtomicBool,
    /// Set by [`Cluster::withhold_renewals`]: the renewal duty sends nothing
    /// while it is.
    withheld: std::sync::atomic::AtomicBool,
}

/// A running cluster member. See the module docs for what it does.
///
/// Dropping it aborts its tasks without waiting; prefer [`Cluster::shutdown`].
pub struct Cluster {
    inner: Arc<Inner>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("node_id", &self.inner.cfg.node_id)
            .field("raft_addr", &self.inner.cfg.raft_addr)
            .finish_non_exhaustive()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let tasks = self
            .tasks
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for t in tasks.iter() {
            t.abort();
        }
    }
}

/// Proposes `cmd` on this node's Raft, without forwarding.
pub(crate) async fn local_write(
    raft: &Raft,
    cmd: Command,
) -> Result<ClientWriteResponse<TypeConfig>, WriteRejected> {
    raft.client_write(cmd).await.map_err(|e| match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            WriteRejected::ForwardToLeader {
                leader: f.leader_id,
            }
        }
        other => WriteRejected::Failed(other.to_string()),
    })
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Inner {
    fn now_ms(&self) -> u64 {
        millis(self.base.elapsed())
    }

    fn ms_of(&self, t: Instant) -> u64 {
        millis(t.saturating_duration_since(self.base))
    }

    fn me(&self) -> NodeId {
        self.cfg.node_id
    }

    /// Proposes `cmd`, forwarding to the leader when this node is not it,
    /// until `timeout`.
    async fn write(&self, cmd: Command, timeout: Duration) -> Result<CommandResult> {
        let deadline = tokio::time::Instant::now() + timeout;
        let unavailable = || ClusterError::Unavailable {
            timeout_ms: millis(timeout),
        };
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(unavailable());
            }
            let attempt = async {
                match local_write(&self.raft, cmd.clone()).await {
                    Ok(r) => Ok(Some(r.data)),
                    Err(WriteRejected::Failed(m)) => Err(ClusterError::Raft(m)),
                    Err(WriteRejected::ForwardToLeader { leader: None }) => Ok(None),
                    Err(WriteRejected::ForwardToLeader { leader: Some(l) }) => {
                        Ok(self.forward(l, &cmd, left).await)
                    }
                }
            };
            match tokio::time::timeout(left, attempt).await {
                Err(_) => return Err(unavailable()),
                Ok(Err(e)) => return Err(e),
                Ok(Ok(Some(r))) => return Ok(r),
                Ok(Ok(None)) => {
                    let pause = Duration::from_millis(50).min(left);
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Sends `cmd` to `leader`; `None` when it could not be carried out there
    /// (unreachable, or no longer the leader): the caller retries.
    async fn forward(
        &self,
        leader: NodeId,
        cmd: &Command,
        timeout: Duration,
    ) -> Option<CommandResult> {
        let addr = {
            let m = self.raft.metrics();
            let m = m.borrow();
            m.membership_config
                .membership()
                .get_node(&leader)
                .map(|n| n.addr.clone())
        }?;
        let req = RpcRequest::ClientWrite(cmd.clone());
        match self
            .transport
            .call(leader, &addr, Channel::Write, &req, timeout)
            .await
        {
            Ok(RpcResponse::ClientWrite(Ok(r))) => Some(r),
            Ok(RpcResponse::ClientWrite(Err(e))) => {
                tracing::debug!(leader, error = %e, "forwarded write rejected");
                None
            }
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(leader, error = %e, "forwarding write failed");
                None
            }
        }
    }

    /// Instant from which this node counts `node`'s lease: when it applied
    /// the node's last renewal, no earlier than `floor`.
    fn renewal_clock(&self, applied: &Applied, node: NodeId, floor: Instant) -> Option<Instant> {
        let rec = applied.data.state.leases.get(&node)?;
        if rec.renewals == 0 {
            return None;
        }
        Some(
            applied
                .renewed_at
                .get(&node)
                .map_or(floor, |&t| t.max(floor)),
        )
    }

    fn floor(&self) -> Instant {
        self.leader_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .map_or(self.base, |(_, t)| t)
    }

    /// Publishes owned and releasing lanes from the applied state and the
    /// holder lease.
    /// Whether this node may work lanes now: lease valid, and after a lapse
    /// the log applied up to the renewal that ended it
    /// ([`HolderLease::may_work`]).
    fn may_work(&self, applied: &Applied) -> bool {
        let applied_index = applied.data.last_applied.map_or(0, |l| l.index);
        self.holder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .may_work(&self.cfg.lease, self.now_ms(), applied_index)
    }

    /// Until when this node may work lanes: the end of its holder lease,
    /// `None` when it may not work now ([`Inner::may_work`]).
    fn work_until(&self, applied: &Applied) -> Option<Instant> {
        let applied_index = applied.data.last_applied.map_or(0, |l| l.index);
        let h = self
            .holder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !h.may_work(&self.cfg.lease, self.now_ms(), applied_index) {
            return None;
        }
        h.ends_at_ms(&self.cfg.lease)
            .map(|ms| self.base + Duration::from_millis(ms))
    }

    fn publish(&self, applied: &Applied, was_valid: &mut bool) {
        let valid = self.may_work(applied);
        if valid != *was_valid {
            if valid {
                tracing::info!(
                    node = self.me(),
                    "holder lease acquired; lanes may be worked"
                );
            } else {
                tracing::warn!(node = self.me(), "holder lease lapsed; stopping all lanes");
            }
            *was_valid = valid;
        }
        let lanes = if valid {
            NodeLanes {
                owned: applied.data.state.active_lanes(self.me()),
                releasing: applied.data.state.releasing_lanes(self.me()),
            }
        } else {
            NodeLanes::default()
        };
        self.lanes.send_if_modified(|v| {
            let changed = *v != lanes;
            *v = lanes;
            changed
        });
    }
}

/// This node's lanes as of one applied state ([`Cluster::node_lanes`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeLanes {
    /// Lanes this node may work, lane → epoch: those it owns in state
    /// `Active`, while its holder lease is valid by its own clock. The node
    /// starts a lane owner for each lane that appears, and stops (fences)
    /// those that disappear or change epoch.
    pub owned: BTreeMap<u16, Epoch>,
    /// Lanes this node must hand over, lane → [`Releasing`]: stop claiming
    /// them, drain in-flight work (with a bound), then
    /// [`Cluster::release`] the handover. A lane here is not in `owned`.
    pub releasing: BTreeMap<u16, Releasing>,
}

impl Cluster {
    /// Opens the data dir, binds the Raft address and starts Raft and the
    /// duties. A data dir with Raft state rejoins its cluster by itself; a
    /// new one waits for [`Cluster::bootstrap`] here or for
    /// [`Cluster::add_node`] on a member.
    ///
    /// # Errors
    /// [`ClusterError::Config`] (zero lanes or voters, a zero lease value,
    /// invalid Raft timing),
    /// [`ClusterError::Bind`], [`ClusterError::Storage`],
    /// [`ClusterError::LaneCount`], [`ClusterError::Raft`].
    pub async fn start(mut cfg: ClusterConfig) -> Result<Cluster> {
        if cfg.lanes == 0 {
            return Err(ClusterError::Config("lanes must be greater than 0".into()));
        }
        if cfg.voters == 0 {
            return Err(ClusterError::Config("voters must be greater than 0".into()));
        }
        cfg.lease
            .validate(0)
            .map_err(|e| ClusterError::Config(e.to_string()))?;
        if cfg.raft.election_timeout_max_ms + cfg.lease.renew_interval_ms >= cfg.lease.lease_ms {
            // Renewals cannot commit during an election: if one can outlast
            // the lease, every node stops its lanes at each leader change.
            tracing::warn!(
                election_timeout_max_ms = cfg.raft.election_timeout_max_ms,
                renew_interval_ms = cfg.lease.renew_interval_ms,
                lease_ms = cfg.lease.lease_ms,
                "an election can outlast the lease: leader changes will stop every node's lanes"
            );
        }
        let storage_err = |message: String| ClusterError::Storage {
            path: cfg.data_dir.clone(),
            message,
        };
        std::fs::create_dir_all(&cfg.data_dir).map_err(|e| storage_err(e.to_string()))?;
        let db = open_db_retrying(&cfg.data_dir)
            .await
            .map_err(|e| storage_err(e.to_string()))?;
        let sm = StateMachineStore::open(db.clone(), cfg.lanes)
            .map_err(|e| storage_err(e.to_string()))?;
        let found = sm.current().data.state.lanes.len();
        if found != usize::from(cfg.lanes) {
            return Err(ClusterError::LaneCount {
                found,
                configured: cfg.lanes,
            });
        }
        let secret: network::Secret = cfg
            .secret
            .as_ref()
            .map_or(&b""[..], |s| s.0.as_bytes())
            .into();
        if secret.is_empty() {
            let loopback = cfg
                .raft_addr
                .parse::<std::net::SocketAddr>()
                .is_ok_and(|a| a.ip().is_loopback());
            if !loopback {
                return Err(ClusterError::Config(format!(
                    "refusing to serve raft on {} without a cluster secret: any host that can \
                     reach it could join the cluster; set cluster_secret (--cluster-secret, \
                     LANEBUS_CLUSTER_SECRET) on every node, or use a loopback raft address",
                    cfg.raft_addr
                )));
            }
        }
        // The members table records the addresses a node binds, or its
        // advertised host; peers cannot reach 0.0.0.0 or [::] on another
        // host.
        if let Some(host) = &cfg.advertise_host {
            check_advertise_host(host).map_err(ClusterError::Config)?;
        } else {
            for (name, a) in [("raft_addr", &cfg.raft_addr), ("http_addr", &cfg.http_addr)] {
                if a.parse::<std::net::SocketAddr>()
                    .is_ok_and(|a| a.ip().is_unspecified())
                {
                    return Err(ClusterError::Config(format!(
                        "{name} {a} is an unspecified address: the cluster records the address \
                         a node binds and its peers use it to reach the node; bind the address \
                         the other nodes reach this one at, or give that host with \
                         advertise_addr (--advertise-addr), or run --single"
                    )));
                }
            }
        }
        let listener =
            TcpListener::bind(&cfg.raft_addr)
                .await
                .map_err(|source| ClusterError::Bind {
                    addr: cfg.raft_addr.clone(),
                    source,
                })?;
        if let Ok(a) = listener.local_addr() {
            cfg.raft_addr = a.to_string();
        }
        // From here on `raft_addr` and `http_addr` are the recorded
        // (advertised) addresses.
        if let Some(host) = &cfg.advertise_host {
            cfg.raft_addr = advertised(host, &cfg.raft_addr)?;
            cfg.http_addr = advertised(host, &cfg.http_addr)?;
        }

        let t = cfg.raft;
        let raft_cfg = openraft::Config {
            cluster_name: "lanebus".into(),
            heartbeat_interval: t.heartbeat_ms,
            election_timeout_min: t.election_timeout_min_ms,
            election_timeout_max: t.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(t.snapshot_every_entries),
            max_in_snapshot_log_to_keep: t.snapshot_every_entries.min(500),
            purge_batch_size: t.snapshot_every_entries.clamp(1, 256),
            ..Default::default()
        }
        .validate()
        .map_err(|e| ClusterError::Config(e.to_string()))?;
        let transport = Arc::new(Transport::new(cfg.net.clone(), secret.clone()));
        let raft = Raft::new(
            cfg.node_id,
            Arc::new(raft_cfg),
            NetworkFactory {
                transport: transport.clone(),
            },
            LogStore::new(db),
            sm.clone(),
        )
        .await
        .map_err(|e| ClusterError::Raft(e.to_string()))?;
        tracing::info!(node = cfg.node_id, raft_addr = %cfg.raft_addr, "raft started");

        let inner = Arc::new(Inner {
            cfg,
            raft: raft.clone(),
            sm,
            transport,
            base: Instant::now(),
            holder: Mutex::default(),
            lanes: watch::channel(NodeLanes::default()).0,
            leader_since: Mutex::default(),
            released: std::sync::atomic::AtomicBool::new(false),
            withheld: std::sync::atomic::AtomicBool::new(false),
        });
        let tasks = vec![
            tokio::spawn(network::serve(
                listener,
                raft,
                inner.cfg.net.clone(),
                secret,
                inner.me(),
            )),
            tokio::spawn(renew_loop(inner.clone())),
            tokio::spawn(publish_loop(inner.clone())),
            tokio::spawn(leader_loop(inner.clone())),
        ];
        Ok(Cluster {
            inner,
            tasks: Mutex::new(tasks),
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.me()
    }

    /// This process start's incarnation ([`ClusterConfig::incarnation`]).
    pub fn incarnation(&self) -> &str {
        &self.inner.cfg.incarnation
    }

    /// The Raft address other nodes reach this one at (`IP:PORT`, or
    /// `HOST:PORT` with [`ClusterConfig::advertise_host`]): the bound one,
    /// with the port picked when 0 was asked.
    pub fn raft_addr(&self) -> &str {
        &self.inner.cfg.raft_addr
    }

    /// The HTTP API address recorded for this node (`IP:PORT`, or
    /// `HOST:PORT` with [`ClusterConfig::advertise_host`]).
    pub fn http_addr(&self) -> &str {
        &self.inner.cfg.http_addr
    }

    /// Starts a one-node cluster of this node and records it as a member.
    /// Idempotent: on a node whose data dir already holds a cluster it only
    /// makes sure this node is a member (forwarding to the leader).
    ///
    /// # Errors
    /// [`ClusterError::Unavailable`] if no leader could be reached within 10
    /// s, [`ClusterError::Refused`] if this id is a member with other
    /// addresses, [`ClusterError::Raft`].
    pub async fn bootstrap(&self) -> Result<()> {
        let raft = &self.inner.raft;
        let initialized = raft
            .is_initialized()
            .await
            .map_err(|e| ClusterError::Raft(e.to_string()))?;
        if !initialized {
            let node = BasicNode::new(self.inner.cfg.raft_addr.clone());
            match raft
                .initialize(BTreeMap::from([(self.node_id(), node)]))
                .await
            {
                Ok(()) => tracing::info!(node = self.node_id(), "bootstrapped a one-node cluster"),
                Err(RaftError::APIError(e)) => {
                    tracing::info!(error = %e, "cluster already initialized");
                }
                Err(e) => return Err(ClusterError::Raft(e.to_string())),
            }
        }
        let cfg = &self.inner.cfg;
        self.add_node(cfg.node_id, &cfg.raft_addr, &cfg.http_addr)
            .await
    }

    /// Adds a member (the `--join` request of a new node). Works on any
    /// member: the command is forwarded to the leader. Returns once the
    /// member is recorded; the leader then makes it a Raft learner, and a
    /// voter while there are fewer voters than configured, on its next ticks.
    /// Idempotent for the same id and addresses.
    ///
    /// # Errors
    /// [`ClusterError::Refused`] if `id` is a member with other addresses,
    /// another member uses either address, or node `id` does not answer the
    /// Raft handshake at `raft_addr` within [`JOIN_PROBE_TIMEOUT`] (not
    /// running, another node there, another cluster secret);
    /// [`ClusterError::Unavailable`] if no leader answered within 10 s,
    /// [`ClusterError::Raft`].
    pub async fn add_node(&self, id: NodeId, raft_addr: &str, http_addr: &str) -> Result<()> {
        // Another member's address would make a member nobody reaches (a
        // typo, or a copied config). Checked against this node's applied
        // state before the proposal: the log's rule stays as it was.
        let state = self.inner.sm.current();
        let members = &state.data.state.members;
        if let Some((other, m)) = members
            .iter()
            .find(|(n, m)| **n != id && (m.raft_addr == raft_addr || m.http_addr == http_addr))
        {
            return Err(ClusterError::Refused(format!(
                "node {other} already uses raft_addr {} / http_addr {}: each member needs its own",
                m.raft_addr, m.http_addr
            )));
        }
        // The new member must answer at its Raft address, as itself and with
        // the cluster secret: an address that reaches nobody, another node
        // (another spelling of a member's address), or a node with another
        // secret would make a member nobody can replicate to.
        let known = members
            .get(&id)
            .is_some_and(|m| m.raft_addr == raft_addr && m.http_addr == http_addr);
        if !known {
            self.inner
                .transport
                .probe(id, raft_addr, JOIN_PROBE_TIMEOUT)
                .await
                .map_err(|e| {
                    ClusterError::Refused(format!(
                        "raft_addr {raft_addr} does not answer as node {id}: {e}"
                    ))
                })?;
        }
        let cmd = Command::AddNode {
            node: id,
            raft_addr: raft_addr.to_owned(),
            http_addr: http_addr.to_owned(),
        };
        self.command(cmd).await
    }

    /// Requests the planned removal of a member: its lanes are handed over
    /// (it must keep running and releasing them), then the leader removes it
    /// from Raft and forgets it. Works on any member (forwarded).
    ///
    /// # Errors
    /// [`ClusterError::Refused`] for an unknown id,
    /// [`ClusterError::Unavailable`], [`ClusterError::Raft`].
    pub async fn remove_node(&self, id: NodeId) -> Result<()> {
        self.command(Command::RemoveNode { node: id }).await
    }

    /// Reports that this node has drained `lane` in the handover applied
    /// at log index `at` ([`Releasing::at`], listed by
    /// [`Cluster::node_lanes`]): the handover target owns it from now on,
    /// at `epoch + 1` ([`Command::ReleaseHandover`]).
    ///
    /// # Errors
    /// [`ClusterError::Refused`] if this node is not releasing `lane` in
    /// that handover (any more: e.g. it was cancelled, even if the lane
    /// was handed over again since), [`ClusterError::Unavailable`],
    /// [`ClusterError::Raft`].
    pub async fn release(&self, lane: u16, at: Option<u64>) -> Result<()> {
        self.command(Command::ReleaseHandover {
            lane,
            from: self.node_id(),
            at,
        })
        .await
    }

    /// Reports lanes this node owns that someone outside the cluster fenced
    /// in the store: `(lane, Raft epoch held, epoch found in the store)`.
    /// Those still owned here at that epoch get `max(epoch, store epoch) + 1`
    /// ([`Command::Refence`]), which [`Cluster::node_lanes`] then shows.
    ///
    /// # Errors
    /// [`ClusterError::Refused`] if this node is not a member,
    /// [`ClusterError::Unavailable`], [`ClusterError::Raft`].
    pub async fn refence(&self, lanes: Vec<(u16, Epoch, Epoch)>) -> Result<()> {
        self.command(Command::Refence {
            node: self.node_id(),
            lanes,
        })
        .await
    }

    async fn command(&self, cmd: Command) -> Result<()> {
        let r = self.inner.write(cmd, Duration::from_secs(10)).await?;
        if r.ok {
            Ok(())
        } else {
            Err(ClusterError::Refused(r.reason.unwrap_or_default()))
        }
    }

    /// The lanes this node may work right now and those it must hand over
    /// ([`NodeLanes`]), from one applied state: both change in one step.
    /// Empty while the holder lease is lapsed (even if Raft is
    /// unreachable: that is the point).
    pub fn node_lanes(&self) -> watch::Receiver<NodeLanes> {
        self.inner.lanes.subscribe()
    }

    /// Whether this node is a recorded member of the cluster's state.
    pub fn is_member(&self) -> bool {
        let inner = &self.inner;
        inner
            .sm
            .current()
            .data
            .state
            .members
            .contains_key(&inner.me())
    }

    /// Whether this node is a recorded member and holds a valid lease (what
    /// `GET /readyz` means by "joined").
    pub fn joined(&self) -> bool {
        let inner = &self.inner;
        let member = inner
            .sm
            .current()
            .data
            .state
            .members
            .contains_key(&inner.me());
        member && inner.may_work(&inner.sm.current())
    }

    /// Whether this node may hand work over right now: its lease is valid by
    /// its own clock and, after a lapse, it has applied the log up to the
    /// renewal that ended the lapse. Cheap (a lock and a clock read): lane
    /// owners check it before every attempt, because after a pause (SIGSTOP)
    /// their timers may fire before [`Cluster::node_lanes`] is emptied.
    pub fn may_work(&self) -> bool {
        self.inner.may_work(&self.inner.sm.current())
    }

    /// Until when this node may hand work over: the end of its holder
    /// lease by its own clock, or `None` when it may not work now (see
    /// [`Cluster::may_work`]). An attempt starts only if it can end by then
    /// (its handler's timeout plus [`crate::lease::ATTEMPT_SLACK_MS`]).
    /// Cheap, like [`Cluster::may_work`].
    pub fn work_until(&self) -> Option<Instant> {
        self.inner.work_until(&self.inner.sm.current())
    }

    /// The leader's id and HTTP address, as far as this node knows.
    pub fn leader(&self) -> Option<(NodeId, Option<String>)> {
        let leader = self.inner.raft.metrics().borrow().current_leader?;
        let http = self
            .inner
            .sm
            .current()
            .data
            .state
            .members
            .get(&leader)
            .map(|m| m.http_addr.clone());
        Some((leader, http))
    }

    /// The cluster as this node sees it (see [`ClusterView`]).
    pub fn state(&self) -> ClusterView {
        let inner = &self.inner;
        let (leader, term) = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            (m.current_leader, m.current_term)
        };
        let applied = inner.sm.current();
        let now = Instant::now();
        let now_ms = inner.ms_of(now);
        let floor = inner.floor();
        let lease = inner.cfg.lease;
        let expires = |node: NodeId| -> Option<u64> {
            if node == inner.me() {
                let h = inner
                    .holder
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                return Some(h.remaining_ms(&lease, now_ms));
            }
            let t = inner.renewal_clock(&applied, node, floor)?;
            Some((inner.ms_of(t) + lease.lease_ms).saturating_sub(now_ms))
        };
        let s = &applied.data.state;
        let voters: BTreeSet<NodeId> = applied.data.last_membership.voter_ids().collect();
        let members = s
            .members
            .iter()
            .map(|(&id, m)| {
                let left = expires(id);
                MemberView {
                    id,
                    raft_addr: m.raft_addr.clone(),
                    http_addr: m.http_addr.clone(),
                    voter: voters.contains(&id),
                    leaving: m.leaving,
                    alive: left.is_some_and(|l| l > 0),
                    lanes: s.lanes_of(id),
                    lease_expires_in_ms: left,
                }
            })
            .collect();
        let lanes = s
            .lanes
            .iter()
            .enumerate()
            .map(|(l, e)| LaneView {
                lane: l as u16,
                owner: e.owner,
                epoch: e.epoch,
                state: e.state,
                lease_expires_in_ms: e.owner.and_then(expires),
            })
            .collect();
        ClusterView {
            node_id: inner.me(),
            leader,
            term,
            members,
            lanes,
        }
    }

    /// The underlying openraft handle (metrics, diagnostics).
    pub fn raft(&self) -> &Raft {
        &self.inner.raft
    }

    /// The fault-injection switch of this node's network (tests).
    pub fn net(&self) -> &NetSwitch {
        &self.inner.cfg.net
    }

    /// Gives this node's lease up for a graceful stop: renewals stop, and
    /// the leader counts the node as not live at once, so it moves the
    /// node's lanes without waiting for the lease and the margin (the next
    /// owners fence the next epoch, as after a failure). Call it only when
    /// this node works no lane any more: lanes drained and stopped, nothing
    /// in flight (otherwise a late attempt could overtake the next owner's).
    /// The node is live again after a restart's first renewal.
    ///
    /// # Errors
    /// [`ClusterError::Unavailable`] when no leader applied it within
    /// `timeout` (the lanes then move after the lease, as before),
    /// [`ClusterError::Refused`] when not a member.
    pub async fn release_lease(&self, timeout: Duration) -> Result<()> {
        self.inner
            .released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let r = self
            .inner
            .write(
                Command::ReleaseLease {
                    node: self.inner.me(),
                },
                timeout,
            )
            .await?;
        if r.ok {
            Ok(())
        } else {
            Err(ClusterError::Refused(r.reason.unwrap_or_default()))
        }
    }

    /// Withholds this node's lease renewals while `withhold` is true (a
    /// renewal already sent may still commit): a node that cannot work its
    /// lanes (its actor thread stalled) lets its lease lapse, so it stops
    /// its lanes ([`Cluster::node_lanes`] empties) and, after the lease
    /// plus the margin, the leader moves them, as for a paused process.
    /// `false` sends renewals again; the node gets lanes again once the
    /// leader sees it renew.
    pub fn withhold_renewals(&self, withhold: bool) {
        self.inner
            .withheld
            .store(withhold, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops the duties, the RPC server and Raft, and waits for them, so the
    /// data dir can be opened again. Lanes are not handed over: to leave for
    /// good, [`Cluster::remove_node`] first.
    /// Idempotent; the other methods fail with [`ClusterError::Raft`]
    /// afterwards.
    pub async fn shutdown(&self) {
        let tasks = std::mem::take(
            &mut *self
                .tasks
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        if let Err(e) = self.inner.raft.shutdown().await {
            tracing::warn!(error = %e, "raft shutdown");
        }
        tracing::info!(node = self.inner.me(), "cluster member stopped");
    }
}

/// Opens the redb file, waiting a little while a previous instance in this
/// process (a restart in tests) still holds it.
async fn open_db_retrying(dir: &std::path::Path) -> Result<Arc<redb::Database>, redb::Error> {
    let mut tries = 0;
    loop {
        match storage::open_db(dir) {
            Err(redb::Error::DatabaseAlreadyOpen) if tries < 40 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            r => return r,
        }
    }
}

/// Holder duty: send a renewal every `renew_interval_ms`, each in its own
/// task so that a slow one does not delay the next; a committed renewal
/// extends the holder lease from when it was sent.
async fn renew_loop(inner: Arc<Inner>) {
    let lease = inner.cfg.lease;
    let mut every = tokio::time::interval(Duration::from_millis(lease.renew_interval_ms));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut inflight = JoinSet::new();
    let mut incarnated = false;
    loop {
        tokio::select! {
            _ = every.tick() => {}
            Some(_) = inflight.join_next(), if !inflight.is_empty() => continue,
        }
        let joined = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            let joined = m.membership_config.membership().nodes().next().is_some();
            joined
        };
        if !joined
            || inner.released.load(std::sync::atomic::Ordering::SeqCst)
            || inner.withheld.load(std::sync::atomic::Ordering::SeqCst)
        {
            // Not part of a cluster yet (waiting for bootstrap or join): a
            // renewal could only wait for a leader nobody knows. Or the lease
            // was given up (stopping), or renewals are withheld (the node
            // cannot work its lanes).
            continue;
        }
        if !incarnated {
            // Before the first renewal of this process: new epochs for the
            // lanes a previous process of this node held (see
            // `Command::Incarnate`). Refused while not yet a member.
            let cmd = Command::Incarnate {
                node: inner.me(),
                incarnation: inner.cfg.incarnation.clone(),
            };
            match inner
                .write(cmd, Duration::from_millis(lease.lease_ms))
                .await
            {
                Ok(r) if r.ok => {
                    tracing::info!(node = inner.me(), incarnation = %inner.cfg.incarnation, "incarnation recorded");
                    incarnated = true;
                }
                Ok(r) => {
                    tracing::debug!(reason = ?r.reason, "incarnation refused (not a member yet?)")
                }
                Err(e) => tracing::debug!(error = %e, "incarnation failed"),
            }
            continue;
        }
        let inner = inner.clone();
        inflight.spawn(async move {
            let sent_at = inner.now_ms();
            let cmd = Command::RenewLease { node: inner.me() };
            match inner
                .write(cmd, Duration::from_millis(lease.lease_ms))
                .await
            {
                Ok(r) if r.ok => {
                    inner
                        .holder
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .committed(&lease, sent_at, r.index);
                }
                Ok(r) => {
                    tracing::debug!(reason = ?r.reason, "lease renewal refused (not a member yet?)")
                }
                Err(e) => tracing::debug!(error = %e, "lease renewal failed"),
            }
        });
    }
}

/// Holder duty: recompute owned and releasing lanes whenever the state
/// machine changes, and often enough to notice a lapsing lease promptly.
async fn publish_loop(inner: Arc<Inner>) {
    let mut rx = inner.sm.subscribe();
    let mut was_valid = false;
    loop {
        let applied = rx.borrow_and_update().clone();
        inner.publish(&applied, &mut was_valid);
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}

/// Leader duty, every tick while this node leads: plan lanes over the live
/// set and reconcile the Raft membership.
async fn leader_loop(inner: Arc<Inner>) {
    let tick = Duration::from_millis((inner.cfg.lease.renew_interval_ms / 2).clamp(50, 1_000));
    let mut every = tokio::time::interval(tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let (is_leader, term) = {
            let m = inner.raft.metrics();
            let m = m.borrow();
            (
                m.state == ServerState::Leader && m.current_leader == Some(inner.me()),
                m.current_term,
            )
        };
        {
            let mut since = inner
                .leader_since
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match (*since, is_leader) {
                (_, false) => *since = None,
                (Some((t, _)), true) if t == term => {}
                (_, true) => {
                    tracing::info!(
                        node = inner.me(),
                        term,
                        "became leader; lease clocks of all nodes start now"
                    );
                    *since = Some((term, Instant::now()));
                }
            }
        }
        if !is_leader {
            continue;
        }
        if let Err(e) = leader_tick(&inner).await {
            tracing::debug!(error = %e, "leader tick");
        }
    }
}

async fn leader_tick(inner: &Inner) -> Result<()> {
    let applied = inner.sm.current();
    let floor = inner.floor();
    let now_ms = inner.now_ms();
    let s = &applied.data.state;
    let mut live = BTreeSet::new();
    let mut draining = BTreeSet::new();
    for (&id, m) in &s.members {
        let Some(t) = inner.renewal_clock(&applied, id, floor) else {
            continue;
        };
        if inner.cfg.lease.expired_for_leader(inner.ms_of(t), now_ms) {
            continue;
        }
        if m.leaving {
            draining.insert(id);
        } else {
            live.insert(id);
        }
    }
    let changes = assignment::plan_draining(&s.lanes, &live, &draining);
    if !changes.is_empty() {
        tracing::info!(
            changes = changes.len(),
            live = ?live,
            draining = ?draining,
            "proposing lane changes"
        );
        let timeout = Duration::from_millis(inner.cfg.lease.lease_ms);
        // The plan's premise (which owners were dead) is the state applied
        // up to here: an owner renewing before the command is applied keeps
        // its lanes.
        let planned_at = applied.data.last_applied.map_or(0, |l| l.index);
        let r = tokio::time::timeout(
            timeout,
            local_write(
                &inner.raft,
                Command::ApplyPlanned {
                    changes,
                    planned_at,
                },
            ),
        )
        .await
        .map_err(|_| ClusterError::Unavailable {
            timeout_ms: millis(timeout),
        })?;
        r.map_err(|e| ClusterError::Raft(e.to_string()))?;
        return Ok(());
    }
    reconcile_membership(inner, &applied).await
}

/// One Raft membership change per tick, toward: every member known to Raft,
/// `voters` of them voting, leavers without lanes removed and forgotten.
async fn reconcile_membership(inner: &Inner, applied: &Applied) -> Result<()> {
    let (raft_nodes, voters, learners, replication, last_index) = {
        let m = inner.raft.metrics();
        let m = m.borrow();
        let mem = m.membership_config.membership();
        if m.membership_config.membership().get_joint_config().len() > 1 {
            return Ok(()); // a change is in progress
        }
        (
            mem.nodes().map(|(id, _)| *id).collect::<BTreeSet<_>>(),
            mem.voter_ids().collect::<BTreeSet<_>>(),
            mem.learner_ids().collect::<BTreeSet<_>>(),
            m.replication.clone().unwrap_or_default(),
            m.last_log_index.unwrap_or(0),
        )
    };
    let s = &applied.data.state;
    let raft_err = |e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>| {
        ClusterError::Raft(e.to_string())
    };

    // Leavers that own nothing any more: out of Raft, then forgotten.
    for (&id, m) in &s.members {
        if !m.leaving || s.lanes_of(id) > 0 {
            continue;
        }
        if voters.contains(&id) {
            tracing::info!(node = id, "removing voter");
            inner
                .raft
                .change_membership(ChangeMembers::RemoveVoters(BTreeSet::from([id])), false)
                .await
                .map_err(raft_err)?;
            return Ok(());
        }
        if raft_nodes.contains(&id) {
            tracing::info!(node = id, "removing learner");
            inner
                .raft
                .change_membership(ChangeMembers::RemoveNodes(BTreeSet::from([id])), false)
                .await
                .map_err(raft_err)?;
            return Ok(());
        }
        tracing::info!(node = id, "forgetting removed member");
        local_write(&inner.raft, Command::Forget { node: id })
            .await
            .map_err(|e| ClusterError::Raft(e.to_string()))?;
        return Ok(());
    }

    // New members become learners.
    for (&id, m) in &s.members {
        if !m.leaving && !raft_nodes.contains(&id) {
            tracing::info!(node = id, raft_addr = %m.raft_addr, "adding learner");
            inner
                .raft
                .add_learner(id, BasicNode::new(m.raft_addr.clone()), false)
                .await
                .map_err(raft_err)?;
            return Ok(());
        }
    }

    // Promote caught-up learners while voters are fewer than the target.
    if voters.len() < inner.cfg.voters {
        let caught_up = learners.iter().copied().find(|id| {
            s.members.get(id).is_some_and(|m| !m.leaving)
                && replication
                    .get(id)
                    .and_then(|l| l.as_ref())
                    .is_some_and(|l| l.index + 50 >= last_index)
        });
        if let Some(id) = caught_up {
            tracing::info!(
                node = id,
                voters = voters.len(),
                target = inner.cfg.voters,
                "promoting learner to voter"
            );
            inner
                .raft
                .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), true)
                .await
                .map_err(raft_err)?;
        }
    }
    Ok(())
}
