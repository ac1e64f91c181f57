//! The lanebus node: actix actors that run lanes, per-key runners and the
//! store actor; webhook sending; the handler catalog cache. The `lanebus`
//! binary is `src/main.rs`; its demo runs on `lanebus-testkit`.
//!
//! Pure decisions live in [`retry`], [`ordering`], [`claim`],
//! [`auto_disable`] and [`assignment`] (with unit tests, no IO: they take
//! `now`, which tests drive with a [`clock::ManualClock`]); [`actors`] read
//! the clock and carry them out; [`node`] wires a running node (see
//! `docs/design.md` section 3). [`webhook`] is the request contract of
//! docs/design.md section 5; [`handler`] puts in-process handlers on the
//! same path.
//!
//! ```no_run
//! # async fn run() -> Result<(), lanebus_node::NodeError> {
//! use lanebus_node::{NodeOptions, StoreSource};
//! let node = lanebus_node::start(NodeOptions::new("1", StoreSource::Url("sqlite:///tmp/lanebus.db".into()))).await?;
//! println!("API on {}", node.base_url());
//! node.shutdown().await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod activity;
pub mod actors;
pub mod assignment;
pub mod auto_disable;
pub mod catalog;
pub mod claim;
pub mod clock;
pub mod handler;
pub mod kafka;
pub mod metrics;
pub mod nats;
pub mod node;
pub mod operational;
pub mod ordering;
pub mod rate;
pub mod retention;
pub mod retry;
pub mod watchdog;
pub mod webhook;

pub use handler::{Handler, HandlerError};
pub use node::{start, ClusterOptions, NodeError, NodeHandle, NodeOptions, StoreSource};
