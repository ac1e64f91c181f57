//! The node's actors (actix 0.13). Each carries out what the pure modules
//! ([`crate::ordering`], [`crate::claim`], [`crate::retry`],
//! [`crate::assignment`]) decide.
//!
//! - [`StoreActor`]: one per node, batches store calls.
//! - [`LaneSupervisor`]: one per node, owns the lane owners and follows
//!   the lane assignment.
//! - [`LaneOwner`]: one per owned lane.
//! - [`KeyRunner`]: one per (handler, key) with work.
//!
//! [`budget`] is the node-wide budget of buffered payload bytes the lane
//! owners share (pure arithmetic plus counters).

pub mod budget;
pub mod key_runner;
pub mod lane_owner;
pub mod lane_supervisor;
pub mod store_actor;

pub use key_runner::KeyRunner;
pub use lane_owner::{LaneBoard, LaneConfig, LaneOwner, LaneState, LaneStatus};
pub use lane_supervisor::LaneSupervisor;
pub use store_actor::{StoreActor, StoreActorConfig};
