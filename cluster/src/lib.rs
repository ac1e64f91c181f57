//! lanebus cluster: the lane assignment policy and the lease arithmetic, as
//! pure code that unit tests drive without Raft, actors or IO.
//!
//! The openraft glue (log and state machine storage, TCP transport) arrives
//! with the cluster issue and only *carries out* what these functions decide:
//! the leader runs [`assignment::plan`] over the replicated lane table and
//! proposes the result; every node checks its own lease with [`lease`].

#![warn(missing_docs)]

pub mod assignment;
pub mod lease;

/// A node's id in the cluster (the `--id` flag).
pub type NodeId = u64;
