//! lanebus HTTP API (axum): the contract of `docs/design.md` section 4.
//!
//! The API talks to the store directly for publishing, the handler catalog
//! and dead letters, and reaches the running node only through [`NodeView`],
//! which the node crate implements (the API knows no actors).
//!
//! ```text
//!  request ─▶ ensure_json_errors ─▶ DefaultBodyLimit ─▶ route table (routes.rs)
//!                 (safety net)        (413 JSON)            │
//!                                                          ▼
//!         extract::{Json, Path, Query}: every rejection is an ApiError
//!                                                          │
//!         validate the whole request first ───────────────▶ Store / NodeView
//! ```
//!
//! # Invariant 6: bad input gets a clear error and loses nothing
//!
//! Every answer with a 4xx/5xx status has the body
//! `{"error": {"code": "...", "message": "..."}}` ([`ApiError`]; the codes and
//! their statuses are listed on [`ErrorCode`]). That includes axum's own
//! rejections (bad JSON, wrong content type, body too large, bad path or
//! query parameters), unknown paths (404) and wrong methods (405). Each
//! request is validated completely before the store is called, so a rejected
//! request writes nothing: a publish batch with one bad event is refused
//! whole.
//!
//! # Metrics
//!
//! Listed in the `telemetry` module: `lanebus_events_published_total`,
//! `lanebus_events_duplicates_total`, `lanebus_api_errors_total{code}`,
//! `lanebus_deliveries_discarded_total`, `lanebus_dead_letters_replayed_total`;
//! [`describe_metrics`] gives them help text.
//!
//! # Routes
//!
//! The single list of paths is [`ROUTES`]; [`router`] serves exactly those,
//! and [`openapi::document`] describes exactly those (served at
//! `GET /openapi.json`, OpenAPI 3.1, with every operation's request and
//! answer schemas and its error codes by status).
//!
//! # Dashboard
//!
//! `GET /ui/` serves a small operator's dashboard (module [`ui`]): the lane
//! grid coloured by owner, the nodes and the handlers, polled every second
//! from `/admin/lanes`, `/admin/cluster` and `/admin/handlers`; an event
//! looked up by id, and a handler's page with its deliveries and plots of
//! its last 15 minutes on this node (`/admin/handlers/{id}/activity`). Its
//! HTML, CSS and script are embedded in the binary; it fetches nothing else.

#![warn(missing_docs)]

use std::sync::Arc;

use async_trait::async_trait;
use lanebus_store::{Epoch, Lane, Store};
use serde::Serialize;
use utoipa::ToSchema;

mod admin;
pub mod auth;
mod deliveries;
pub mod event_types;
/// The SSRF guard, kept with the handler rules in the store crate (the
/// delivery path checks it at each send).
pub use lanebus_store::egress;
pub mod error;
pub mod events;
pub mod extract;
pub mod handlers;
mod health;
mod lookup;
pub mod openapi;
mod recovery;
mod routes;
pub mod serve;
mod subjects;
mod telemetry;
pub mod ui;

pub use admin::{DEAD_LETTERS_COUNTED_MAX, DEFAULT_PAGE, MAX_PAGE, MAX_REPLAY_IDS};
pub use error::{ApiError, ErrorCode};
pub use health::PROMETHEUS_CONTENT_TYPE;
pub use routes::{router, Operation, RouteSpec, MAX_URI_BYTES, ROUTES};
pub use telemetry::describe_metrics;

/// One lane as the node sees it (`GET /admin/lanes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct LaneView {
    /// Lane number.
    #[schema(value_type = u16)]
    pub lane: Lane,
    /// Owning node id, if any.
    pub owner: Option<String>,
    /// Current epoch (a number, at most `i64::MAX`: what the store holds).
    #[schema(value_type = i64)]
    pub epoch: Epoch,
    /// `active`, `releasing`, `unassigned`, `fenced_out` (the store holds
    /// the lane for a process outside the cluster), `lease_lapsed` (assigned,
    /// but its owner's lease ran out: nobody works it until the owner renews
    /// or the leader moves it), or `stopped` (single node).
    #[schema(example = "active")]
    pub state: String,
    /// Milliseconds until the owner's lease expires; `None` without leases.
    pub lease_expires_in_ms: Option<i64>,
    /// Deliveries of the lane stored and not yet completed or dead-lettered
    /// (the store's count: due, waiting for a retry or `deliver_at`, held
    /// for a disabled handler, claimed or in flight alike). Not the metric
    /// `lanebus_lane_queued`, which counts what the owner holds in memory.
    pub backlog: i64,
    /// Deliveries of the lane being attempted on its owner now.
    pub in_flight: i64,
}

/// The cluster as one node sees it: the body of `GET /admin/cluster`.
///
/// ```json
/// {"node_id": "n1", "leader": "n1", "term": 3,
///  "nodes": [{"id": "n1", "raft_addr": "10.0.0.1:7001",
///             "http_addr": "10.0.0.1:8080", "voter": true, "alive": true,
///             "lanes": 256}]}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ClusterView {
    /// Id of the node that answered.
    pub node_id: String,
    /// Id of the current Raft leader; `None` while there is none (election).
    pub leader: Option<String>,
    /// Current Raft term (`0` for a single node without Raft).
    pub term: u64,
    /// Every member, voters and learners, by id.
    pub nodes: Vec<ClusterNodeView>,
}

/// One member of the cluster (see [`ClusterView`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct ClusterNodeView {
    /// Node id.
    pub id: String,
    /// Raft address (`IP:PORT`, or `HOST:PORT` for a node started with `--advertise-addr NAME`); `None` when unknown.
    pub raft_addr: Option<String>,
    /// HTTP address of the node's API (`IP:PORT` or `HOST:PORT`); `None` when unknown.
    pub http_addr: Option<String>,
    /// Whether the node is a voter (`false`: learner).
    pub voter: bool,
    /// Whether the node holds a live lease.
    pub alive: bool,
    /// Number of lanes the node owns.
    pub lanes: u32,
}

/// Body of `POST /admin/cluster/join`: the node to add.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// The new node's id (a positive integer, unique in the cluster).
    pub id: u64,
    /// Its Raft address, `IP:PORT` or `HOST:PORT` (a DNS name).
    pub raft_addr: String,
    /// Its HTTP API address, `IP:PORT` or `HOST:PORT`.
    pub http_addr: String,
    /// Its lease settings. A member refuses (`409`) settings other than
    /// its own, and a request without them: the leader reassigns a node's
    /// lanes after the leader's lease plus margin, so a node with a longer
    /// lease would still start attempts after its lanes moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<LeaseSettings>,
}

/// A node's lease settings (`--lease-ms`, `--renew-interval-ms`,
/// `--lease-margin-ms`), in milliseconds; every member of a cluster runs the
/// same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseSettings {
    /// How long a committed renewal keeps a node's lanes.
    pub lease_ms: u64,
    /// How often a node renews.
    pub renew_interval_ms: u64,
    /// The leader's extra wait past a lease before it reassigns the lanes.
    pub margin_ms: u64,
}

impl std::fmt::Display for LeaseSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--lease-ms {} --renew-interval-ms {} --lease-margin-ms {}",
            self.lease_ms, self.renew_interval_ms, self.margin_ms
        )
    }
}

/// Body of `POST /admin/cluster/remove`: the node to remove on purpose.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RemoveRequest {
    /// The node's id.
    pub id: u64,
}

/// Why a change of membership was not made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterChangeError {
    /// This node runs without a cluster (single node): `409 conflict`.
    NotClustered,
    /// No Raft leader could be reached in time: `503 not_ready`; retry.
    Unavailable(String),
    /// The cluster refused (e.g. the id is a member with other addresses,
    /// or unknown): `409 conflict`.
    Refused(String),
}

/// Length of one [`ActivitySample`] (`GET /admin/handlers/{id}/activity`).
pub const ACTIVITY_INTERVAL_S: u32 = 10;
/// How far back `GET /admin/handlers/{id}/activity` reaches: 15 minutes,
/// 90 samples of [`ACTIVITY_INTERVAL_S`].
pub const ACTIVITY_WINDOW_S: u32 = 900;

/// One handler's attempts on the answering node over the last 15 minutes:
/// the body of `GET /admin/handlers/{id}/activity`, from the node's own
/// counters (no store read but the handler's existence).
///
/// ```json
/// {"node_id": "1", "handler_id": "hdl_...", "interval_s": 10, "window_s": 900,
///  "samples": [{"at": "2026-12-02T01:00:00Z", "seconds": 10.0, "deliveries": 52,
///               "failures": 3, "deliveries_per_s": 5.2, "failures_per_s": 0.3,
///               "p99_attempt_ms": 41.9}]}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct HandlerActivity {
    /// Id of the node that answered: the samples count this node's attempts
    /// only (each member counts the attempts of the lanes it owns; ask each
    /// member for the cluster's total).
    pub node_id: String,
    /// The handler.
    pub handler_id: String,
    /// Length of a sample, in seconds (10).
    pub interval_s: u32,
    /// How far back the samples reach, in seconds (900).
    pub window_s: u32,
    /// Oldest first, one per interval since the node started (at most 90),
    /// the last one being the interval under way; intervals without an
    /// attempt are there with zeros.
    pub samples: Vec<ActivitySample>,
}

/// One interval of a handler's attempts on one node (see [`HandlerActivity`]).
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ActivitySample {
    /// Start of the interval (RFC 3339).
    #[schema(value_type = String, format = DateTime)]
    pub at: chrono::DateTime<chrono::Utc>,
    /// Seconds the sample covers: the interval's length, or for the
    /// interval under way the time elapsed in it (at least 1).
    pub seconds: f64,
    /// Attempts that delivered (a 2xx, or an in-process handler's `Ok`).
    pub deliveries: u64,
    /// Attempts that failed (retried, dead-lettered or `410`).
    pub failures: u64,
    /// `deliveries / seconds`.
    pub deliveries_per_s: f64,
    /// `failures / seconds`.
    pub failures_per_s: f64,
    /// 99th percentile of the duration of every attempt of the interval
    /// (delivered or failed), in milliseconds (hdrhistogram, 2 significant
    /// digits); `null` without attempts.
    pub p99_attempt_ms: Option<f64>,
}

/// What the API needs from the running node. Implemented by the node crate.
#[async_trait]
pub trait NodeView: Send + Sync + 'static {
    /// This node's id.
    fn node_id(&self) -> String;

    /// The lane table, by lane number.
    ///
    /// # Errors
    /// The store's error when the table comes from the store (a node
    /// without a cluster) and the store does not answer: `503`.
    async fn lanes(&self) -> Result<Vec<LaneView>, lanebus_store::StoreError>;

    /// Called after a publish through the API committed, with the lanes that
    /// got new deliveries, so the node can wake those lanes at once (stores
    /// without push wake-ups rely on this plus polling). Lanes are sorted
    /// and distinct; the call must not block (it runs on the request path).
    fn published(&self, lanes: &[Lane]);

    /// Called after the handler catalog changed (create, delete) and after a
    /// dead-letter replay put deliveries back; must not block.
    fn handlers_changed(&self);

    /// How long completed events are kept for recovery
    /// (`POST /v1/handlers/{id}/recover` refuses an older `since`; `GET
    /// /v1/events/{id}` answers `410 pruned` for a missing event whose
    /// UUIDv7 id is older); `None`: unknown, no bound is checked (and a
    /// missing event is `404`). The default: `None`.
    fn retention(&self) -> Option<std::time::Duration> {
        None
    }

    /// The longest handler `timeout_ms` a cluster member's lane lease
    /// leaves room for: the lease less one renewal interval less the
    /// attempt slack (`lanebus_cluster::LeaseConfig::longest_timeout_ms`).
    /// An attempt starts only while the remaining lease covers its timeout
    /// plus the slack, so that it ends before the lease does and cannot
    /// overlap the next owner's delivery of the same key; a longer timeout
    /// would hold attempts back. The API refuses a longer one, and a
    /// registration without `timeout_ms` gets the default or this bound,
    /// whichever is shorter. `None` (the default): no lease, no bound.
    fn longest_timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// Whether the node is ready (joined, lanes started); `Err` says why
    /// not, for `/readyz`'s `503 not_ready` (which pings the store itself).
    async fn ready(&self) -> Result<(), String>;

    /// Prometheus text exposition of the node's metrics.
    fn render_metrics(&self) -> String;

    /// The handler's attempts on this node over the last 15 minutes
    /// (`GET /admin/handlers/{id}/activity`'s samples, oldest first). The
    /// default: none.
    fn handler_activity(&self, handler_id: &str) -> Vec<ActivitySample> {
        let _ = handler_id;
        Vec::new()
    }

    /// Adds a member (`POST /admin/cluster/join`), forwarded to the Raft
    /// leader. Idempotent for the same id and addresses. The default: not
    /// clustered.
    async fn join_node(&self, req: JoinRequest) -> Result<(), ClusterChangeError> {
        let _ = req;
        Err(ClusterChangeError::NotClustered)
    }

    /// Removes a member on purpose (`POST /admin/cluster/remove`): its lanes
    /// are handed over gracefully, then it leaves Raft. The default: not
    /// clustered.
    async fn remove_node(&self, id: u64) -> Result<(), ClusterChangeError> {
        let _ = id;
        Err(ClusterChangeError::NotClustered)
    }

    /// The cluster membership for `GET /admin/cluster`.
    ///
    /// The default describes a single node without Raft: this node, leader of
    /// term 0, a live voter owning the lanes whose [`LaneView::owner`] is
    /// [`NodeView::node_id`], with unknown addresses. The node crate should
    /// override it with the Raft state machine's members (ids, addresses,
    /// voter or learner, lease alive) and the current leader and term.
    async fn cluster(&self) -> ClusterView {
        let id = self.node_id();
        let owned = self
            .lanes()
            .await
            .unwrap_or_default()
            .iter()
            .filter(|l| l.owner.as_deref() == Some(id.as_str()))
            .count();
        ClusterView {
            node_id: id.clone(),
            leader: Some(id.clone()),
            term: 0,
            nodes: vec![ClusterNodeView {
                id,
                raft_addr: None,
                http_addr: None,
                voter: true,
                alive: true,
                lanes: u32::try_from(owned).unwrap_or(u32::MAX),
            }],
        }
    }
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
    /// Where handler URLs may point ([`egress`], the SSRF guard), checked
    /// when a handler is registered.
    pub egress: egress::EgressPolicy,
    /// Bearer tokens and their scopes ([`auth`]); [`auth::Auth::open`]
    /// allows every request.
    pub auth: auth::Auth,
}

/// Request limits; each breach is a 4xx with a JSON error body. The batch
/// and payload limits may only tighten the store's rules
/// ([`lanebus_store::rules::event`]), which hold whatever they say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest request body, in bytes (default 8 MiB); larger is
    /// `413 body_too_large`.
    pub max_body_bytes: usize,
    /// Largest single event payload, in bytes (default 1 MiB); larger is
    /// `413 payload_too_large`, naming the event's index.
    pub max_payload_bytes: usize,
    /// Most events per publish call (default 1,000); more is
    /// `422 batch_too_large`.
    pub max_batch: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 8 << 20,
            max_payload_bytes: lanebus_store::rules::event::MAX_PAYLOAD_BYTES,
            max_batch: lanebus_store::rules::event::MAX_BATCH,
        }
    }
}
