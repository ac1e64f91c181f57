//! lanebus cluster: which node owns which lane, decided through Raft
//! (openraft 0.9, `storage-v2`).
//!
//! Decisions are pure code that unit tests drive without Raft, actors or IO:
//! [`assignment`] (the leader's plan over the lane table) and [`lease`] (the
//! holder's and the leader's lease arithmetic). The rest only carries them
//! out:
//!
//! - [`state`]: the replicated state machine (members, leases, lane table)
//!   and its [`Command`]s;
//! - [`storage`]: the Raft log and state machine on disk (redb), snapshots;
//! - [`network`]: the TCP + bincode transport and RPC server;
//! - [`cluster`]: [`Cluster`], the API the node uses: start, bootstrap,
//!   join, the lanes this node may work, the cluster view.
//!
//! ```no_run
//! # async fn run() -> Result<(), lanebus_cluster::ClusterError> {
//! use lanebus_cluster::{Cluster, ClusterConfig};
//! let cluster = Cluster::start(ClusterConfig::new(
//!     1, "127.0.0.1:7001", "127.0.0.1:8001", "/var/lib/lanebus/1",
//! ))
//! .await?;
//! cluster.bootstrap().await?; // or: on a member, add_node(2, raft_addr, http_addr)
//! let mut lanes = cluster.node_lanes();
//! while lanes.changed().await.is_ok() {
//!     let owned = lanes.borrow().owned.clone(); // lane -> epoch: start/stop lane owners
//!     # let _ = owned;
//! }
//! # Ok(()) }
//! ```
//!
//! This crate knows no database: Raft decides owners and epochs; the node
//! fences them in the store.
//!
//! # Wiring it into a node
//!
//! | node concern | cluster API |
//! | --- | --- |
//! | start (`--id`, `--raft-addr`, `--http-addr`, `--data-dir`) | [`Cluster::start`] with [`ClusterConfig`]; check the lease first with [`LeaseConfig::validate`] against the longest handler timeout |
//! | `--bootstrap` | [`Cluster::bootstrap`] (idempotent) |
//! | `--join URL` | the new node POSTs `/admin/cluster/join` to URL; that node calls [`Cluster::add_node`] (works on any member: forwarded to the leader over Raft's transport) |
//! | restart without flags | nothing: the data dir holds the membership |
//! | lane owners | [`Cluster::node_lanes`] (`owned`): for each lane that appears (or whose epoch changes) fence the store at that epoch, then start its owner; stop owners whose lane disappears |
//! | planned moves | [`Cluster::node_lanes`] (`releasing`, read with `owned` from one state): stop claiming, drain in-flight work within a bound, then [`Cluster::release`] naming the handover; the lane must not stay here forever, the leader never takes it back by itself while this node is alive |
//! | `GET /admin/cluster`, `/admin/lanes` | [`Cluster::state`] ([`ClusterView`]); add backlog and in-flight from the store |
//! | `/readyz` "joined" | [`Cluster::joined`] |
//! | forwarding other writes over HTTP | [`Cluster::leader`] gives the leader's `http_addr` |
//! | removal on purpose | [`Cluster::remove_node`]; keep the node running until it is gone from [`ClusterView::members`] |
//! | SIGTERM | [`Cluster::shutdown`] (no handover; the lease runs out) |
//!
//! Errors: [`ClusterError::Unavailable`] (no leader in time: retry or answer
//! 503), [`ClusterError::Refused`] (the caller's request made no sense now:
//! 409/400), [`ClusterError::Config`]/[`ClusterError::Bind`]/
//! [`ClusterError::Storage`]/[`ClusterError::LaneCount`] at start (exit with
//! the message), [`ClusterError::Raft`] (fatal for the node).

#![warn(missing_docs)]

use std::io::Cursor;

pub mod assignment;
pub mod cluster;
pub mod lease;
pub mod network;
pub mod state;
pub mod storage;

pub use cluster::{
    check_advertise_host, Cluster, ClusterConfig, ClusterError, ClusterView, LaneView, MemberView,
    NodeLanes, RaftTiming,
};
pub use lanebus_types::Epoch;
pub use lease::LeaseConfig;
pub use network::{ClusterSecret, NetSwitch};
pub use state::{Command, CommandResult, Releasing};

/// A node's id in the cluster (the `--id` flag).
pub type NodeId = u64;

openraft::declare_raft_types!(
    /// openraft type configuration: [`Command`]s in, [`CommandResult`]s out,
    /// nodes addressed by their Raft address ([`openraft::BasicNode`]).
    pub TypeConfig:
        D = Command,
        R = CommandResult,
);

/// The openraft handle of this crate's type configuration.
pub type Raft = openraft::Raft<TypeConfig>;
