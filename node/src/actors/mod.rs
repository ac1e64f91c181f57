//! The node's actors (actix 0.13). Each carries out what the pure modules
//! ([`crate::ordering`], [`crate::retry`], [`crate::assignment`]) decide.
//!
//! - [`StoreActor`]: one per node, batches store calls.
//! - [`LaneOwner`]: one per owned lane.
//! - [`KeyHandler`]: one per (handler, key) with work.
//!
//! [`budget`] is the node-wide budget of buffered payload bytes the lane
//! owners share (pure arithmetic plus counters).

pub mod budget;
pub mod key_handler;
pub mod lane_owner;
pub mod store_actor;

pub use key_handler::KeyHandler;
pub use lane_owner::{LaneBoard, LaneConfig, LaneOwner, LaneState, LaneStatus};
pub use store_actor::{StoreActor, StoreActorConfig};
