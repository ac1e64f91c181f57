//! Running a node: wiring the store, the actors, the HTTP API and the lane
//! assignment together.
//!
//! ```text
//!  thread "lanebus-node": actix System on a multi-threaded tokio runtime
//!    ├─ StoreActor                       (system arbiter)
//!    ├─ LaneOwner × owned lanes          (system arbiter) ── KeyHandler × keys with work
//!    ├─ assignment watch → start/stop lane owners
//!    ├─ store wake-ups → Wake to every lane owner
//!    └─ tokio workers: axum HTTP API, webhook requests, catalog refresh
//! ```
//!
//! Actors run on the system arbiter's thread; everything that blocks or
//! burns CPU per request (HTTP serving, building and signing webhook bodies,
//! TLS) runs on the tokio worker threads. [`start`] runs the node on its own
//! OS thread so it can be used from any context (the CLI, tests, the demo)
//! and returns a [`NodeHandle`] once the node is ready.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use async_trait::async_trait;
use lanebus_api::{ApiState, LaneView, Limits, NodeView};
use lanebus_store::{Epoch, Lane, Store, StoreError, Wakeups};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::{oneshot, watch};

use crate::actors::lane_owner::{Drain, LaneDeps, StopLane, Wake};
use crate::actors::{LaneBoard, LaneConfig, LaneOwner, LaneState, StoreActor, StoreActorConfig};
use crate::assignment::{AssignmentError, LaneAssignment, LocalAssignment, OwnedLanes};
use crate::catalog::HandlerCatalog;
use crate::handler::{Dispatcher, Handler};
use crate::metrics;
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
    /// In-process handlers, served for handlers whose URL is
    /// `http://inproc.invalid/NAME` (see [`crate::handler`]).
    pub in_process: HashMap<String, Arc<dyn Handler>>,
    /// HTTP API request limits.
    pub limits: Limits,
    /// At shutdown, how long to wait for in-flight attempts to finish
    /// before abandoning them (default 5 s).
    pub drain_timeout: Duration,
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
            in_process: HashMap::new(),
            limits: Limits::default(),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

type Owners = Arc<Mutex<BTreeMap<Lane, (Epoch, Addr<LaneOwner>)>>>;

/// The node as the API sees it ([`NodeView`]).
pub struct NodeState {
    node_id: String,
    store: Arc<dyn Store>,
    owners: Owners,
    board: Arc<LaneBoard>,
    catalog: Arc<HandlerCatalog>,
    metrics: PrometheusHandle,
    ready: watch::Sender<bool>,
}

impl NodeState {
    /// Observable lane state of this node.
    pub fn board(&self) -> &Arc<LaneBoard> {
        &self.board
    }

    fn wake_all(&self) {
        for (_, addr) in self.owners.lock().expect("not poisoned").values() {
            addr.do_send(Wake);
        }
    }
}

#[async_trait]
impl NodeView for NodeState {
    fn node_id(&self) -> String {
        self.node_id.clone()
    }

    async fn lanes(&self) -> Vec<LaneView> {
        let rows = self.store.lane_rows().await.unwrap_or_default();
        let board = self.board.snapshot();
        rows.into_iter()
            .map(|r| {
                let mine = board
                    .get(&r.lane)
                    .filter(|s| s.epoch == r.epoch && r.owner.as_deref() == Some(&self.node_id));
                LaneView {
                    lane: r.lane,
                    owner: r.owner,
                    epoch: r.epoch,
                    state: match mine {
                        Some(s) => s.state.as_str().to_string(),
                        None if board.contains_key(&r.lane) => {
                            LaneState::Stopped.as_str().to_string()
                        }
                        None => "unassigned".to_string(),
                    },
                    lease_expires_in_ms: None,
                    backlog: r.backlog,
                    in_flight: mine.map(|s| s.in_flight as i64).unwrap_or(0),
                }
            })
            .collect()
    }

    fn published(&self, lanes: &[Lane]) {
        let owners = self.owners.lock().expect("not poisoned");
        for lane in lanes {
            if let Some((_, addr)) = owners.get(lane) {
                addr.do_send(Wake);
            }
        }
    }

    fn handlers_changed(&self) {
        self.catalog.request_reload();
    }

    async fn ready(&self) -> bool {
        *self.ready.borrow() && self.store.ping().await.is_ok()
    }

    fn render_metrics(&self) -> String {
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
/// [`NodeError`] naming what failed during start-up.
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
    let (state, addr) = match boot(opts).await {
        Ok(v) => v,
        Err(e) => {
            let msg = e.to_string();
            let _ = started.send(Err(e));
            return Err(NodeError::Runtime(msg));
        }
    };
    tracing::info!(node_id = %state.node_id, http_addr = %addr, backend = state.store.backend(), "node ready");
    let _ = started.send(Ok((addr, state.clone())));
    let _ = shutdown.await;
    tracing::info!(node_id = %state.node_id, "node stopping");
    state.ready.send_replace(false);
    let owners: Vec<Addr<LaneOwner>> =
        std::mem::take(&mut *state.owners.lock().expect("not poisoned"))
            .into_values()
            .map(|(_, a)| a)
            .collect();
    for a in &owners {
        a.do_send(Drain);
    }
    let deadline = tokio::time::Instant::now() + drain_timeout;
    while owners.iter().any(|a| a.connected()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let abandoned: usize = state
        .board
        .snapshot()
        .values()
        .filter(|s| s.state == LaneState::Active)
        .map(|s| s.in_flight)
        .sum();
    if abandoned > 0 {
        tracing::warn!(
            abandoned,
            "drain timed out: in-flight deliveries left to the next owner"
        );
    }
    for a in owners {
        a.do_send(StopLane);
    }
    System::current().stop();
    Ok(())
}

async fn boot(opts: NodeOptions) -> Result<(Arc<NodeState>, SocketAddr), NodeError> {
    let metrics_handle = metrics::install_recorder();
    let store = match &opts.store {
        StoreSource::Url(url) => lanebus_store::open(url).await?,
        StoreSource::Opened(s) => s.clone(),
    };
    let catalog = Arc::new(HandlerCatalog::new(store.clone()));
    catalog.reload_fresh().await?;
    tokio::spawn(catalog.clone().refresh_loop(opts.catalog_refresh));

    let wakeups = store.wakeups().await?;
    let mut lane_config = opts.lane;
    lane_config.poll_interval = opts.poll_interval.unwrap_or(match wakeups {
        Wakeups::Push(_) => Duration::from_secs(1),
        Wakeups::Poll => Duration::from_millis(100),
    });

    let store_actor = StoreActor::new(store.clone(), opts.store_actor).start();
    let dispatcher = Dispatcher::new(WebhookSender::new()?, opts.in_process.clone());
    let board = Arc::new(LaneBoard::default());
    let owners: Owners = Arc::default();
    let state = Arc::new(NodeState {
        node_id: opts.node_id.clone(),
        store: store.clone(),
        owners: owners.clone(),
        board: board.clone(),
        catalog: catalog.clone(),
        metrics: metrics_handle,
        ready: watch::channel(false).0,
    });

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
    let app = lanebus_api::router(ApiState {
        store: store.clone(),
        node: state.clone(),
        limits: opts.limits,
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "http server stopped");
        }
    });

    let deps = LaneDeps {
        store_actor,
        catalog,
        dispatcher,
        board,
        config: lane_config,
    };
    let assignment = LocalAssignment::new(store.clone(), opts.node_id.clone());
    let mut lanes = assignment.start().await?;
    apply_assignment(&owners, &deps, &lanes.borrow_and_update());
    let (owners2, deps2) = (owners.clone(), deps.clone());
    actix_rt::spawn(async move {
        let _keep = assignment;
        while lanes.changed().await.is_ok() {
            let owned = lanes.borrow_and_update().clone();
            apply_assignment(&owners2, &deps2, &owned);
        }
    });

    if let Wakeups::Push(mut rx) = wakeups {
        let st = state.clone();
        actix_rt::spawn(async move {
            while rx.recv().await.is_some() {
                st.wake_all();
            }
        });
    }
    state.ready.send_replace(true);
    Ok((state, addr))
}

/// Starts lane owners for new (lane, epoch) pairs and stops the others.
fn apply_assignment(owners: &Owners, deps: &LaneDeps, owned: &OwnedLanes) {
    let mut owners = owners.lock().expect("not poisoned");
    owners.retain(|lane, (epoch, addr)| {
        let keep = owned.get(lane) == Some(epoch);
        if !keep {
            addr.do_send(StopLane);
        }
        keep
    });
    for (&lane, &epoch) in owned {
        owners
            .entry(lane)
            .or_insert_with(|| (epoch, LaneOwner::new(lane, epoch, deps.clone()).start()));
    }
    tracing::info!(lanes = owners.len(), "lane owners running");
}
