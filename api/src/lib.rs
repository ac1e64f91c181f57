//! lanebus HTTP API (axum): the contract of `shared/DESIGN.md` section 4.
//!
//! The API talks to the store directly for publishing, the handler catalog
//! and dead letters, and reaches the running node only through [`NodeView`],
//! which the node crate implements (the API knows no actors).

#![warn(missing_docs)]

use std::sync::Arc;

use async_trait::async_trait;
use lanebus_store::{Lane, Store};
use serde::Serialize;

/// One lane as the node sees it (`GET /admin/lanes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LaneView {
    /// Lane number.
    pub lane: Lane,
    /// Owning node id, if any.
    pub owner: Option<String>,
    /// Current epoch.
    pub epoch: i64,
    /// `active`, `starting`, `draining`, `stopped` or `unassigned`.
    pub state: String,
    /// Milliseconds until the owner's lease expires; `None` without leases.
    pub lease_expires_in_ms: Option<i64>,
    /// Deliveries waiting in the lane (store count).
    pub backlog: i64,
    /// Deliveries of the lane being attempted on its owner now.
    pub in_flight: i64,
}

/// What the API needs from the running node. Implemented by the node crate.
#[async_trait]
pub trait NodeView: Send + Sync + 'static {
    /// This node's id.
    fn node_id(&self) -> String;

    /// The lane table, by lane number.
    async fn lanes(&self) -> Vec<LaneView>;

    /// Called after a publish through the API committed, with the lanes that
    /// got new deliveries, so the node can wake those lanes at once (stores
    /// without push wake-ups rely on this plus polling).
    fn published(&self, lanes: &[Lane]);

    /// Called after the handler catalog changed (create, delete, replay).
    fn handlers_changed(&self);

    /// Whether the node is ready (joined, store reachable, lanes started).
    async fn ready(&self) -> bool;

    /// Prometheus text exposition of the node's metrics.
    fn render_metrics(&self) -> String;
}

/// Shared state of the router.
#[derive(Clone)]
pub struct ApiState {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The running node.
    pub node: Arc<dyn NodeView>,
    /// Request limits.
    pub limits: Limits,
}

/// Request limits; each breach is a 4xx with a JSON error body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body, in bytes (default 8 MiB).
    pub max_body_bytes: usize,
    /// Largest single event payload, in bytes (default 1 MiB).
    pub max_payload_bytes: usize,
    /// Most events per publish call (default 1,000).
    pub max_batch: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_body_bytes: 8 << 20, max_payload_bytes: 1 << 20, max_batch: 1_000 }
    }
}
