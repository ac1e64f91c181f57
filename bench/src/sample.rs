//! The sample runner: one sample of one cell, run as a child process of the
//! build being measured (`lanebus-bench sample --spec JSON`). It creates a
//! fresh database (or SQLite file), sets the cell up, resets the database
//! statistics, runs the warm-up and the steady window (fixed lengths; nothing
//! waits for a drain), reads the counters at both ends of the steady window,
//! stops the node and checks exactness. It prints one line
//! `SAMPLE {json}` on stdout.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use async_trait::async_trait;
use lanebus_node::{ClusterOptions, Handler, HandlerError, NodeHandle, NodeOptions, StoreSource};
use lanebus_store::mongodb::MongoStore;
use lanebus_store::postgres::PgStore;
use lanebus_store::sqlite::SqliteStore;
use lanebus_store::{Delivery, DeliveryRef, Epoch, LaneClaim, NewEvent, NewHandler, Store};
use rand::{Rng as _, SeedableRng as _};
use serde::{Deserialize, Serialize};
use sqlx::{Connection as _, PgConnection};

use crate::cells::{Cell, Kind, Via};
use crate::exact::{self, Exactness, Handled, Held};
use crate::mongo;
use crate::pg;

/// What the harness hands a sample runner.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampleSpec {
    /// The cell.
    pub cell: Cell,
    /// Server URL (`.../postgres`) of the harness's PostgreSQL.
    pub pg_url: String,
    /// Its data directory (for the postmaster pid and CPU times).
    pub pg_dir: Option<PathBuf>,
    /// Scratch directory for SQLite files.
    pub work_dir: PathBuf,
    /// MongoDB cells: the SecantusDB server command the sample starts its
    /// own server with (see [`crate::mongo`]).
    #[serde(default)]
    pub mongo_cmd: Option<PathBuf>,
}

/// Commit-to-handler latency of a mixed sample, milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Deliveries measured.
    pub count: u64,
}

/// One sample's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SampleOut {
    /// Cell name.
    pub cell: String,
    /// Units (events or deliveries) of the steady window.
    pub units: u64,
    /// Steady window, seconds (measured).
    pub window_s: f64,
    /// Units per second of the steady window.
    pub rate: f64,
    /// Mixed: events accepted per second in the steady window.
    pub accepted_rate: f64,
    /// Hand-overs to the handlers per second in the steady window.
    pub handled_rate: f64,
    /// Counters per unit (see [`pg::per_unit`]): database counters over
    /// the whole sample (from the reset after setup until every connection
    /// closed) per event stored (publish) or delivery completed (dispatch,
    /// mixed); CPU over the steady window per unit of the window.
    pub counters: BTreeMap<String, f64>,
    /// Mixed: commit-to-handler latency.
    pub latency: Option<Latency>,
    /// The exactness check.
    pub exact: Exactness,
    /// Why the sample is invalid (empty: valid).
    pub problems: Vec<String>,
    /// Milliseconds waited after every connection closed until the table
    /// statistics agreed with the rows the database holds.
    pub stats_wait_ms: f64,
    /// Whether they still disagreed after 8 s; database counters of such
    /// a sample are left out of the medians.
    pub stats_incomplete: bool,
    /// Counters the database server does not report (MongoDB cells on the
    /// test server): left out, not estimated.
    pub unavailable: Vec<String>,
    /// Cluster cells: lanes whose owner or epoch differed between the start
    /// and the end of the steady window (0 in a steady run).
    pub lane_moves_in_window: u64,
}

/// Records hand-overs; `Hang` never returns (publish cells through a node:
/// nothing may complete).
struct BenchHandler {
    idx: u16,
    /// Cluster id of the node serving it (1 with one node).
    node: u64,
    log: Arc<Log>,
    hang: bool,
    started: Arc<Instant>,
}

#[derive(Default)]
struct Log {
    handled: Mutex<Vec<(Handled, Instant)>>,
    /// Per hand-over, in the order of `handled`: delivery id, its lane,
    /// its attempt (1, 2, ...), the time since the sample started and the
    /// node that handed it over, for explaining a repeat
    /// (`LANEBUS_BENCH_REPEATS=1` prints them; cluster cells check them).
    detail: Mutex<Vec<Detail>>,
    count: AtomicU64,
}

/// One hand-over's detail (see [`Log::detail`]).
type Detail = (i64, u16, u32, Duration, u64);

#[async_trait]
impl Handler for BenchHandler {
    async fn handle(&self, d: &Delivery) -> Result<(), HandlerError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        let h = Handled {
            handler: self.idx,
            event: d.event_id.as_str().into(),
            key: d.key.as_deref().map(Into::into),
            seq: d.seq,
        };
        {
            let mut handled = self.log.handled.lock().expect("log lock");
            let now = Instant::now();
            handled.push((h, now));
            self.log.detail.lock().expect("log lock").push((
                d.id,
                d.lane,
                d.attempts + 1,
                now.saturating_duration_since(*self.started),
                self.node,
            ));
        }
        self.log.count.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The stores of a sample: the trait object, plus the concrete PostgreSQL
/// store for `publish_in` and a probe connection for counters.
struct Stores {
    dyn_store: Arc<dyn Store>,
    pg: Option<Arc<PgStore>>,
    /// The stores of cluster members 2, 3, ... (each node its own pool).
    extra: Vec<Arc<PgStore>>,
    probe: Option<PgConnection>,
    db: Option<String>,
    url: String,
    mongo: Option<MongoSide>,
}

impl Stores {
    /// A store with nothing else: no PostgreSQL side, probe or server.
    fn only(dyn_store: Arc<dyn Store>, url: String) -> Stores {
        Stores {
            dyn_store,
            pg: None,
            extra: Vec::new(),
            probe: None,
            db: None,
            url,
            mongo: None,
        }
    }
}

/// A MongoDB sample's own server, the harness's probe connection, and the
/// snapshots that bound the whole sample.
struct MongoSide {
    server: mongo::Server,
    probe: mongo::Probe,
    /// The latest snapshot taken.
    last: Option<mongo::Snap>,
    /// After the setup (the sample's start).
    start: Option<mongo::Snap>,
    /// After every connection of the sample closed (its end).
    end: Option<mongo::Snap>,
}

async fn open(spec: &SampleSpec) -> anyhow::Result<Stores> {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    if spec.cell.store == "mongodb" {
        return open_mongo(spec, &tag).await;
    }
    if spec.cell.store == "sqlite" {
        std::fs::create_dir_all(&spec.work_dir)?;
        let path = spec.work_dir.join(format!("bench-{tag}.db"));
        let url = format!("sqlite://{}", path.display());
        let store = SqliteStore::connect(&url).await?;
        return Ok(Stores::only(Arc::new(store), url));
    }
    let db = format!("bench_{}", &tag[..16]);
    let mut admin = PgConnection::connect(&spec.pg_url).await?;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&mut admin)
        .await?;
    let url = pg::with_db(&spec.pg_url, &db)?;
    let store = Arc::new(PgStore::connect(&url).await?);
    let mut probe = PgConnection::connect(&url).await?;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&mut probe)
        .await?;
    Ok(Stores {
        pg: Some(store.clone()),
        probe: Some(probe),
        db: Some(db),
        ..Stores::only(store, url)
    })
}

/// A MongoDB sample: its own SecantusDB (killed when the sample's stores
/// are dropped), a store of [`mongo::LANES`] lanes in database `bench`,
/// and the probe connection.
async fn open_mongo(spec: &SampleSpec, tag: &str) -> anyhow::Result<Stores> {
    let cmd = spec.mongo_cmd.as_deref().context(
        "a MongoDB cell needs the SecantusDB command (--mongod-cmd or LANEBUS_BENCH_SECANTUS)",
    )?;
    let log = spec.work_dir.join(format!("secantus-{tag}.log"));
    let server = mongo::Server::start(cmd, &log).await?;
    let url = server.db_url("bench");
    let store = MongoStore::connect_with_lanes(&url, mongo::LANES).await?;
    let probe = mongo::Probe::open(&server.db_url("bench"), "bench").await?;
    let _ = std::fs::remove_file(&log);
    Ok(Stores {
        mongo: Some(MongoSide {
            server,
            probe,
            last: None,
            start: None,
            end: None,
        }),
        ..Stores::only(Arc::new(store), url)
    })
}

/// A JSON object of about `len` bytes (hex noise from a seeded generator).
fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let noise: String = (0..len.saturating_sub(30) / 2)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect();
    format!(r#"{{"action":"opened","body":"{noise}"}}"#).into_bytes()
}

/// Event generator of one publisher: seeded by publisher index, so both
/// sides publish the same keys in the same order.
struct Gen {
    rng: rand::rngs::StdRng,
    keys: usize,
    payload: Vec<u8>,
    /// [`Cell::personal`]: each event names a subject and its personal
    /// field.
    personal: bool,
}

impl Gen {
    fn new(cell: &Cell, publisher: usize) -> Self {
        Gen {
            rng: rand::rngs::StdRng::seed_from_u64(publisher as u64 + 1),
            keys: cell.keys,
            payload: payload(cell.payload_bytes, publisher as u64),
            personal: cell.personal,
        }
    }
    fn batch(&mut self, n: usize) -> Vec<NewEvent> {
        (0..n)
            .map(|_| NewEvent {
                id: None,
                event_type: "issues.opened".into(),
                key: (self.keys > 0).then(|| format!("k{}", self.rng.random_range(0..self.keys))),
                payload: self.payload(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect()
    }
    /// The payload, with a subject and its personal field spliced in
    /// front for a personal cell (about 40 bytes more).
    fn payload(&mut self) -> Vec<u8> {
        if !self.personal {
            return self.payload.clone();
        }
        let s = self.rng.random_range(0..crate::cells::PERSONAL_SUBJECTS);
        let head = format!(r#"{{"subject":"u{s}","email":"u{s}@example.org","#);
        [head.as_bytes(), &self.payload[1..]].concat()
    }
}

/// The master key of personal cells.
fn bench_master_key() -> anyhow::Result<Arc<lanebus_store::personal::MasterKey>> {
    Ok(Arc::new(lanebus_store::personal::MasterKey::from_bytes(
        &[7; 32],
    )?))
}

/// Catalogs `issues.opened` with `/email` personal and the subject at
/// `/subject`, and gives `store` the master key.
async fn setup_personal(store: &dyn Store) -> anyhow::Result<()> {
    store.keyring().set_master(bench_master_key()?);
    store
        .create_event_type(lanebus_store::NewEventType {
            name: "issues.opened".into(),
            schema: Some(serde_json::json!({
                "type": "object",
                "x-lanebus-subject": "/subject",
                "properties": {"email": {"type": "string", "x-lanebus-personal": true}}
            })),
            ..lanebus_store::NewEventType::default()
        })
        .await?;
    Ok(())
}

/// Catalogs `issues.opened` with [`crate::cells::SCHEMA`].
async fn setup_schema(store: &dyn Store) -> anyhow::Result<()> {
    store
        .create_event_type(lanebus_store::NewEventType {
            name: "issues.opened".into(),
            schema: Some(serde_json::from_str(crate::cells::SCHEMA)?),
            ..lanebus_store::NewEventType::default()
        })
        .await?;
    Ok(())
}

const WARMUP: u8 = 0;
const STEADY: u8 = 1;
const DONE: u8 = 2;

/// A mixed cell's publisher `p`: its first tick, after the publishers'
/// common start, and the period of its ticks (one batch per tick). The
/// publishers' ticks are spread evenly over a period, so the cell offers a
/// steady rate rather than one burst per period, as the peers' driver does
/// (`bench/peers/driver.mjs`, `mixed`).
fn ticks(cell: &Cell, p: usize) -> (Duration, Duration) {
    let per = cell.rate as f64 / cell.publishers.max(1) as f64 / cell.batch.max(1) as f64;
    let period = Duration::from_secs_f64(1.0 / per.max(0.001));
    (
        period.mul_f64(p as f64 / cell.publishers.max(1) as f64),
        period,
    )
}

/// Publishes one batch the cell's way; returns accepted ids.
async fn publish_one(
    cell: &Cell,
    stores: &Stores,
    http: &Option<(reqwest::Client, String)>,
    events: Vec<NewEvent>,
) -> anyhow::Result<Vec<String>> {
    match cell.via {
        Via::Store => Ok(stores.dyn_store.publish(events).await?.ids),
        Via::PublishIn => {
            let pg = stores.pg.as_ref().context("publish_in needs PostgreSQL")?;
            let mut tx = pg.pool().begin().await?;
            let out = pg.publish_in(&mut tx, events).await?;
            tx.commit().await?;
            Ok(out.ids)
        }
        Via::Http => {
            let (client, base) = http.as_ref().context("no node for HTTP publish")?;
            let body = serde_json::json!({
                "events": events.iter().map(|e| {
                    let payload: serde_json::Value = serde_json::from_slice(&e.payload).unwrap_or_default();
                    serde_json::json!({"type": e.event_type, "key": e.key, "payload": payload})
                }).collect::<Vec<_>>()
            });
            let resp = client
                .post(format!("{base}/v1/events"))
                .json(&body)
                .send()
                .await?;
            if !resp.status().is_success() {
                bail!("POST /v1/events: {}", resp.status());
            }
            #[derive(Deserialize)]
            struct Answer {
                ids: Vec<String>,
            }
            Ok(resp.json::<Answer>().await?.ids)
        }
    }
}

/// Runs one sample.
///
/// # Errors
/// Setup, database and node failures (an invalid sample is not an error: it
/// comes back with its problems).
pub async fn run(spec: SampleSpec) -> anyhow::Result<SampleOut> {
    let cell = spec.cell.clone();
    let mut stores = open(&spec).await?;
    let result = run_in(&spec, &cell, &mut stores).await;
    if let Some(db) = stores.db.clone() {
        drop(stores.probe.take());
        if let Some(pg) = &stores.pg {
            pg.pool().close().await;
        }
        drop(stores);
        if let Ok(mut admin) = PgConnection::connect(&spec.pg_url).await {
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                .execute(&mut admin)
                .await;
        }
    }
    result
}

async fn run_in(spec: &SampleSpec, cell: &Cell, stores: &mut Stores) -> anyhow::Result<SampleOut> {
    let log = Arc::new(Log::default());
    let started = Arc::new(Instant::now());
    let hang = cell.kind == Kind::Publish;
    // Setup (handlers, preload) goes through the setup store, whose pool is
    // closed before the statistics reset: its backends exit and flush their
    // table and WAL statistics at exit, so none of the setup's rows or WAL
    // records land in the sample's counters.
    let setup = stores.dyn_store.clone();
    let receiver = if cell.http_sink {
        Some(lanebus_testkit::receiver::Receiver::start().await?)
    } else {
        None
    };
    let nats = if cell.nats_sink {
        Some(NatsSink::start(&spec.work_dir).await?)
    } else {
        None
    };
    if cell.personal {
        setup_personal(&*setup).await?;
    } else if cell.schema {
        setup_schema(&*setup).await?;
    }
    let mut names: Vec<String> = Vec::new();
    let mut handler_idx: HashMap<String, u16> = HashMap::new();
    for i in 0..cell.handlers {
        let name = format!("h{i}");
        let secret = lanebus_store::generate_secret();
        let url = match (&receiver, &nats) {
            (Some(r), _) => {
                r.set_secret(&name, &secret);
                r.url(&name)
            }
            (None, Some(n)) => format!("{}/bench.{name}", n.url),
            (None, None) => format!("{}{name}", lanebus_node::handler::IN_PROCESS_PREFIX),
        };
        let h = setup
            .create_handler(NewHandler {
                name: name.clone(),
                url,
                event_types: vec!["*".into()],
                max_attempts: 8,
                timeout_ms: 10_000,
                max_in_flight: cell.settings.max_in_flight(),
                secret,
                rate_limit: None,
                filter: None,
            })
            .await?;
        handler_idx.insert(h.id.to_string(), i as u16);
        names.push(name);
    }
    // The in-process handlers of node `node` (none for webhooks).
    let in_process_of = |node: u64| -> HashMap<String, Arc<dyn Handler>> {
        if receiver.is_some() || nats.is_some() {
            return HashMap::new();
        }
        names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let h: Arc<dyn Handler> = Arc::new(BenchHandler {
                    idx: i as u16,
                    node,
                    log: log.clone(),
                    hang,
                    started: started.clone(),
                });
                (name.clone(), h)
            })
            .collect()
    };

    // Preload (dispatch: 4 loaders; fixed-work drain: 1 loader, so the
    // backlog is the same every time), 500 events per call.
    let preloaded = Arc::new(AtomicU64::new(0));
    if matches!(cell.kind, Kind::Dispatch | Kind::CountDrain) && cell.preload > 0 {
        let loaders = if cell.kind == Kind::CountDrain { 1 } else { 4 };
        let per = cell.preload.div_ceil(loaders);
        let mut tasks = Vec::new();
        for l in 0..loaders {
            let store = setup.clone();
            let mut g = Gen::new(cell, 100 + l);
            let preloaded = preloaded.clone();
            let n = per.min(cell.preload.saturating_sub(l * per));
            tasks.push(tokio::spawn(async move {
                let mut left = n;
                while left > 0 {
                    let k = left.min(500);
                    let out = store.publish(g.batch(k)).await?;
                    preloaded.fetch_add(out.accepted as u64, Ordering::Relaxed);
                    left -= k;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
    }
    drop(setup);
    reopen(stores).await?;
    let store = stores.dyn_store.clone();
    let master_key = if cell.personal {
        let k = bench_master_key()?;
        store.keyring().set_master(Arc::clone(&k));
        Some(k)
    } else {
        None
    };

    let pm = spec.pg_dir.as_deref().and_then(pg::postmaster_pid);
    if let (Some(p), true) = (stores.probe.as_mut(), cell.kind.fixed_work()) {
        // Fixed-work cells compare exact counters: an autovacuum that falls
        // inside one sample and not the other added 13 % WAL to one A/A
        // sample. Off on this sample's tables (the time-windowed cells keep
        // it, as production does).
        let tables: Vec<String> = sqlx::query_scalar(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' /* bench-probe */",
        )
        .fetch_all(&mut *p)
        .await?;
        for t in tables {
            sqlx::query(&format!(
                "ALTER TABLE public.\"{t}\" SET (autovacuum_enabled = false) /* bench-probe */"
            ))
            .execute(&mut *p)
            .await?;
        }
    }
    if let Some(p) = stores.probe.as_mut() {
        // The measured store's pool is idle (it only checked the schema);
        // give its backends their idle flush, then reset.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        sqlx::query("CHECKPOINT").execute(&mut *p).await?;
        pg::reset(p).await?;
    }

    // Whole-sample database counters start here (after the preload).
    let sa = snapshot(stores, pm).await?;
    if let Some(m) = stores.mongo.as_mut() {
        m.start = m.last.clone();
    }
    if cell.kind.fixed_work() {
        return run_count(cell, stores, pm, sa, &handler_idx, &preloaded).await;
    }

    // A node, unless this is a publish cell through the store.
    let needs_node = cell.kind != Kind::Publish || cell.via == Via::Http;
    let node_options = |id: &str, store: Arc<dyn Store>, node: u64| {
        let mut opts = NodeOptions::new(id, StoreSource::Opened(store));
        opts.in_process = in_process_of(node);
        opts.master_key.clone_from(&master_key);
        if receiver.is_some() || nats.is_some() {
            opts.egress = lanebus_api::egress::EgressPolicy::allow_loopback();
        }
        if hang {
            // Publish through the API: handlers hang, so nothing completes;
            // a one-row buffer keeps the claims few.
            opts.lane.buffer_cap = 1;
            opts.drain_timeout = Duration::from_millis(100);
        } else {
            opts.lane.buffer_cap = cell.settings.lane_buffer();
        }
        opts.poll_interval = cell.settings.poll();
        opts
    };
    let cluster_dir = spec
        .work_dir
        .join(format!("cluster-{}", uuid::Uuid::new_v4().simple()));
    let mut members: Vec<NodeHandle> = Vec::new();
    let node = if !needs_node {
        None
    } else if cell.nodes <= 1 {
        Some(lanebus_node::start(node_options("bench", store.clone(), 1)).await?)
    } else {
        if cell.kind != Kind::Dispatch
            || receiver.is_some()
            || nats.is_some()
            || stores.pg.is_none()
        {
            bail!("cluster cells are PostgreSQL dispatch cells with in-process handlers");
        }
        let mut all = start_cluster(cell, stores, &cluster_dir, &node_options).await?;
        members = all.split_off(1);
        all.pop()
    };
    // Cluster cells: each lane's owners in the order seen (from node 1's
    // applied Raft state, polled every 50 ms until the shutdown), to
    // explain repeats by a change of owner.
    let owners: Arc<Mutex<HashMap<u16, Vec<u64>>>> = Arc::default();
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = match (&node, cell.nodes > 1) {
        (Some(n), true) => {
            let (state, owners, watching) = (n.state.clone(), owners.clone(), watching.clone());
            Some(tokio::spawn(async move {
                while watching.load(Ordering::Relaxed) {
                    if let Some(c) = state.cluster() {
                        record_owners(&mut owners.lock().expect("owners lock"), &c.state().lanes);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }))
        }
        _ => None,
    };
    let lane_table = |n: &Option<NodeHandle>| -> Vec<(u16, Option<u64>, Epoch)> {
        n.as_ref()
            .and_then(|n| n.state.cluster().map(|c| c.state().lanes))
            .unwrap_or_default()
            .into_iter()
            .map(|l| (l.lane, l.owner, l.epoch))
            .collect()
    };
    let http = node
        .as_ref()
        .map(|n| (reqwest::Client::new(), n.base_url()));

    // Publishers (publish and mixed cells).
    let phase = Arc::new(AtomicU8::new(WARMUP));
    let stop = Arc::new(AtomicBool::new(false));
    let in_window = Arc::new(AtomicU64::new(0));
    let accepted = Arc::new(AtomicU64::new(0));
    let commits: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let failure: Arc<Mutex<Option<String>>> = Arc::default();
    let shared = Arc::new((cell.clone(), http));
    let stores_ref = Arc::new(Stores {
        pg: stores.pg.clone(),
        ..Stores::only(store.clone(), stores.url.clone())
    });
    let mut publishers = Vec::new();
    let ticks_from = tokio::time::Instant::now();
    if cell.kind != Kind::Dispatch {
        for p in 0..cell.publishers {
            let (phase, stop, in_window, accepted, commits, failure, shared, stores_ref) = (
                phase.clone(),
                stop.clone(),
                in_window.clone(),
                accepted.clone(),
                commits.clone(),
                failure.clone(),
                shared.clone(),
                stores_ref.clone(),
            );
            publishers.push(tokio::spawn(async move {
                let (cell, http) = &*shared;
                let mut g = Gen::new(cell, p);
                let mut ticker = (cell.kind == Kind::Mixed).then(|| {
                    let (offset, period) = ticks(cell, p);
                    let mut t = tokio::time::interval_at(ticks_from + offset, period);
                    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                    t
                });
                while !stop.load(Ordering::Relaxed) {
                    if let Some(t) = ticker.as_mut() {
                        t.tick().await;
                    }
                    match publish_one(cell, &stores_ref, http, g.batch(cell.batch)).await {
                        Ok(ids) => {
                            let now = Instant::now();
                            accepted.fetch_add(ids.len() as u64, Ordering::Relaxed);
                            if phase.load(Ordering::Relaxed) == STEADY {
                                in_window.fetch_add(ids.len() as u64, Ordering::Relaxed);
                            }
                            if cell.kind == Kind::Mixed {
                                let mut c = commits.lock().expect("commits lock");
                                for id in ids {
                                    c.insert(id, now);
                                }
                            }
                        }
                        Err(e) => {
                            *failure.lock().expect("failure lock") = Some(e.to_string());
                            break;
                        }
                    }
                }
            }));
        }
    }

    tokio::time::sleep(Duration::from_secs_f64(cell.warmup_s)).await;
    let s0 = snapshot(stores, pm).await?;
    let handed = || match &receiver {
        Some(r) => r.accepted_distinct() as u64,
        None => log.count.load(Ordering::Relaxed),
    };
    let h0 = handed();
    let lanes0 = lane_table(&node);
    phase.store(STEADY, Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(cell.steady_s)).await;
    phase.store(DONE, Ordering::Relaxed);
    let window_end = Instant::now();
    let window = window_end.saturating_duration_since(t0);
    let h1 = handed();
    let lanes1 = lane_table(&node);
    let s1 = snapshot(stores, pm).await?;
    let events_in_window = in_window.load(Ordering::Relaxed);

    stop.store(true, Ordering::Relaxed);
    for p in publishers {
        let _ = p.await;
    }
    // Every member stops at once (one after the other, the last would
    // take over the lanes of the others first).
    let mut stopping = Vec::new();
    for n in node.into_iter().chain(members) {
        stopping.push(tokio::spawn(n.shutdown()));
    }
    for t in stopping {
        t.await??;
    }
    watching.store(false, Ordering::Relaxed);
    if let Some(w) = watcher {
        let _ = w.await;
    }
    let _ = std::fs::remove_dir_all(&cluster_dir);
    // Close every connection of the sample so the backends exit and flush
    // their statistics (table and WAL-record counters are flushed by a
    // backend about once a second, and at exit), then read the counters
    // of the whole sample.
    close_and_wait(stores).await?;
    // A fresh store for the count: pooled connections opened by the node's
    // runtime died with it.
    let (sb, stats_wait_ms, stats_complete, counts) = settle(stores, pm, cell.kind).await?;
    let mut problems = Vec::new();
    if let Some(e) = failure.lock().expect("failure lock").take() {
        problems.push(format!("publish failed: {e}"));
    }

    // Dispatch and mixed: deliveries completed in the window as the
    // database counts them (handlers may run ahead of their completions);
    // without a database counter (SQLite), hand-overs.
    let units = match cell.kind {
        Kind::Publish | Kind::CountPublish => events_in_window,
        _ if stores.probe.is_some() || stores.mongo.is_some() => {
            (s1.completed - s0.completed).max(0) as u64
        }
        _ => h1 - h0,
    };
    let held = Held {
        completed: counts.completions,
        pending: counts.deliveries,
        dead: counts.dead_letters,
    };
    let published = preloaded.load(Ordering::Relaxed) + accepted.load(Ordering::Relaxed);
    let expected = published as i64 * cell.handlers as i64;
    let mut handled: Vec<(Handled, Instant)> =
        std::mem::take(&mut *log.handled.lock().expect("log lock"));
    if let Some(r) = &receiver {
        // Webhooks: the receiver's accepted requests are the hand-overs.
        let base = Instant::now()
            .checked_sub(Duration::from_secs_f64(r.now_ms() / 1e3))
            .unwrap_or_else(Instant::now);
        let reqs = r.requests();
        let bad = reqs
            .iter()
            .filter(|q| q.signature_ok == Some(false))
            .count();
        if bad > 0 {
            problems.push(format!("{bad} webhook(s) with a bad signature"));
        }
        handled = reqs
            .into_iter()
            .filter(|q| q.accepted())
            .map(|q| {
                let at = base + Duration::from_secs_f64(q.arrived_ms / 1e3);
                let h = Handled {
                    handler: q
                        .handler
                        .strip_prefix('h')
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(u16::MAX),
                    event: q.event_id.as_str().into(),
                    key: q.key.map(Into::into),
                    seq: q.sequence,
                };
                (h, at)
            })
            .collect();
    }
    if let Some(n) = &nats {
        // NATS: the messages the stream holds are the hand-overs.
        handled = n.handled().await?;
    }
    let only: Vec<Handled> = handled.iter().map(|(h, _)| h.clone()).collect();
    let moved = if cell.nodes > 1 {
        let origins: Vec<exact::Origin> = log
            .detail
            .lock()
            .expect("log lock")
            .iter()
            .map(|d| exact::Origin {
                node: d.4,
                lane: d.1,
            })
            .collect();
        exact::moved_repeats(&only, &origins, &owners.lock().expect("owners lock"))
    } else {
        Default::default()
    };
    let ex = exact::check_moved(&only, held, expected, &moved);
    if ex.duplicated > 0 && std::env::var_os("LANEBUS_BENCH_REPEATS").is_some() {
        print_repeats(&only, &log.detail.lock().expect("log lock"));
    }
    problems.extend(ex.problems());
    if cell.kind == Kind::Publish && (held.completed != 0 || held.pending != expected) {
        problems.push(format!(
            "publish sample holds {} pending + {} completed deliveries, expected exactly {expected} pending",
            held.pending, held.completed
        ));
    }
    if cell.kind == Kind::Dispatch && exact::drained_by(&handled, window_end, expected) {
        problems.push(
            "the backlog drained before the window ended (every delivery handed over by its end): preload more"
                .into(),
        );
    }
    if units == 0 {
        problems.push("nothing was measured in the steady window".into());
    }

    let latency = (cell.kind == Kind::Mixed).then(|| {
        let commits = commits.lock().expect("commits lock");
        let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("histogram");
        for (h, at) in &handled {
            if let Some(c) = commits.get(&*h.event) {
                let us = at.saturating_duration_since(*c).as_micros() as u64;
                let _ = hist.record(us.max(1));
            }
        }
        Latency {
            p50: hist.value_at_quantile(0.5) as f64 / 1000.0,
            p99: hist.value_at_quantile(0.99) as f64 / 1000.0,
            max: hist.max() as f64 / 1000.0,
            count: hist.len(),
        }
    });

    // Database counters over the whole sample (exact: every backend has
    // flushed), per event stored or per delivery completed as the database
    // counts them; CPU over the steady window (exited processes take their
    // CPU time with them).
    let db_units = match cell.kind {
        Kind::Publish | Kind::CountPublish => counts.events,
        _ => counts.completions,
    }
    .max(0) as u64;
    let mut counters = pg::per_unit(&sa, &sb, db_units);
    let unavailable = mongo_counters(stores, &mut counters, db_units).await?;
    let window_counters = pg::per_unit(&s0, &s1, units);
    for k in ["cpu_app_ms", "cpu_db_ms"] {
        match window_counters.get(k) {
            Some(v) => counters.insert(k.to_owned(), *v),
            None => counters.remove(k),
        };
    }
    let secs = window.as_secs_f64();
    Ok(SampleOut {
        cell: cell.name.clone(),
        units,
        window_s: secs,
        rate: units as f64 / secs,
        accepted_rate: events_in_window as f64 / secs,
        handled_rate: (h1 - h0) as f64 / secs,
        counters,
        latency,
        exact: ex,
        problems,
        stats_wait_ms,
        stats_incomplete: !stats_complete,
        unavailable,
        lane_moves_in_window: lanes0.iter().zip(&lanes1).filter(|(a, b)| a != b).count() as u64,
    })
}

/// Appends each lane's owner to its history when it differs from the last
/// one recorded.
fn record_owners(owners: &mut HashMap<u16, Vec<u64>>, lanes: &[lanebus_cluster::LaneView]) {
    for l in lanes {
        if let Some(o) = l.owner {
            let h = owners.entry(l.lane).or_default();
            if h.last() != Some(&o) {
                h.push(o);
            }
        }
    }
}

/// Starts a Raft cluster of `cell.nodes` members in this process: node 1
/// bootstraps (and owns every lane at first), the others join it through
/// its API, each with its own store pool, Raft port and data dir under
/// `dir`; returns them (node 1 first) once every lane is active and the
/// members' lane counts differ by at most one.
///
/// # Errors
/// A member that does not start, or lanes not balanced within 60 s.
async fn start_cluster(
    cell: &Cell,
    stores: &mut Stores,
    dir: &std::path::Path,
    node_options: &dyn Fn(&str, Arc<dyn Store>, u64) -> NodeOptions,
) -> anyhow::Result<Vec<NodeHandle>> {
    let mut handles: Vec<NodeHandle> = Vec::new();
    for id in 1..=cell.nodes as u64 {
        let store: Arc<dyn Store> = if id == 1 {
            stores.dyn_store.clone()
        } else {
            let s = Arc::new(PgStore::connect(&stores.url).await?);
            stores.extra.push(s.clone());
            s
        };
        let mut opts = node_options(&id.to_string(), store, id);
        let raft = lanebus_testkit::local_cluster::free_port()?;
        let mut c = ClusterOptions::new(id, raft.to_string(), dir.join(format!("node-{id}")));
        match handles.first() {
            None => c.bootstrap = true,
            Some(first) => c.join = Some(first.base_url()),
        }
        opts.cluster = Some(c);
        handles.push(lanebus_node::start(opts).await?);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let want = handles.len();
    loop {
        let lanes = handles[0]
            .state
            .cluster()
            .map(|c| c.state().lanes)
            .unwrap_or_default();
        let mut per: HashMap<u64, usize> = HashMap::new();
        let active = lanes.iter().all(|l| {
            l.state == lanebus_cluster::assignment::LaneState::Active && l.owner.is_some()
        });
        for l in &lanes {
            if let Some(o) = l.owner {
                *per.entry(o).or_default() += 1;
            }
        }
        let (min, max) = (
            per.values().min().copied().unwrap_or(0),
            per.values().max().copied().unwrap_or(0),
        );
        if !lanes.is_empty() && active && per.len() == want && max <= min + 1 {
            return Ok(handles);
        }
        if Instant::now() > deadline {
            bail!("cluster lanes not balanced over {want} nodes within 60 s: {per:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads the end snapshot once the table statistics agree with what the
/// database holds: `events.ins` = events stored (publish and mixed: every
/// event was inserted after the reset) and `completions.ins` = completion
/// rows (dispatch, mixed, drain). Every backend of the sample has exited
/// by now, and a backend flushes at exit, yet on this machine about one
/// sample in eight still read short (a publish call's or a completion
/// batch's rows missing, and their WAL records with them, until about 4.5 s
/// later); waiting lets the late flush land. Polls every 100 ms for up to 8 s; returns the
/// snapshot, the milliseconds waited, and whether they agreed.
///
/// WAL bytes (the insert position) and statement calls are current at
/// once: they are taken before the store is counted and the wait (which
/// would count the counting's statements and any autovacuum WAL of the
/// wait).
async fn settle(
    stores: &mut Stores,
    pm: Option<u32>,
    kind: Kind,
) -> anyhow::Result<(pg::Snapshot, f64, bool, lanebus_store::StoreCounts)> {
    let pre = snapshot(stores, pm).await?;
    if let Some(m) = stores.mongo.as_mut() {
        m.end = m.last.clone();
    }
    let counts = lanebus_store::open(&stores.url).await?.counts().await?;
    let t = Instant::now();
    loop {
        let mut sb = snapshot(stores, pm).await?;
        sb.wal_bytes = pre.wal_bytes;
        sb.statements = pre.statements;
        if stores.probe.is_none() {
            return Ok((sb, 0.0, true, counts));
        }
        let ins = |t: &str| sb.tables.get(t).map_or(0, |v| v[0]);
        let events_ok = !matches!(kind, Kind::Publish | Kind::CountPublish | Kind::Mixed)
            || ins("events") >= counts.events;
        let completions_ok = matches!(kind, Kind::Publish | Kind::CountPublish)
            || ins("completions") >= counts.completions;
        let waited = t.elapsed();
        if events_ok && completions_ok {
            return Ok((sb, waited.as_secs_f64() * 1e3, true, counts));
        }
        if waited > Duration::from_secs(8) {
            return Ok((sb, waited.as_secs_f64() * 1e3, false, counts));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Closes the PostgreSQL store's pool and waits (up to 5 s) until no
/// backend but the probe's is connected to the sample's database: a
/// backend flushes its table and WAL statistics at exit at the latest.
async fn close_and_wait(stores: &mut Stores) -> anyhow::Result<()> {
    if let Some(pg) = &stores.pg {
        pg.pool().close().await;
    }
    for s in stores.extra.drain(..) {
        s.pool().close().await;
    }
    if let Some(p) = stores.probe.as_mut() {
        pg::wait_alone(p).await?;
    }
    Ok(())
}

/// Replaces the setup store by the measured store: closes the setup pool,
/// waits for its backends to exit (so their statistics are flushed before
/// the reset), then opens a new pool (its schema check runs before the
/// reset). SQLite keeps its store (no database counters).
async fn reopen(stores: &mut Stores) -> anyhow::Result<()> {
    if stores.pg.is_none() {
        return Ok(());
    }
    close_and_wait(stores).await?;
    let store = Arc::new(PgStore::connect(&stores.url).await?);
    stores.dyn_store = store.clone();
    stores.pg = Some(store);
    Ok(())
}

/// A fixed-work cell ([`Kind::CountPublish`], [`Kind::CountDrain`]): the
/// work runs to the end; database counters from the reset (`sa`) until
/// every connection closed, divided by the events stored or the
/// completions; CPU over the work.
async fn run_count(
    cell: &Cell,
    stores: &mut Stores,
    pm: Option<u32>,
    sa: pg::Snapshot,
    handler_idx: &HashMap<String, u16>,
    preloaded: &AtomicU64,
) -> anyhow::Result<SampleOut> {
    let store = stores.dyn_store.clone();
    let t0 = Instant::now();
    let mut handled: Vec<Handled> = Vec::new();
    let mut published = preloaded.load(Ordering::Relaxed);
    match cell.kind {
        Kind::CountPublish => {
            let mut g = Gen::new(cell, 0);
            let mut left = cell.preload;
            while left > 0 {
                let k = left.min(cell.batch.max(1));
                published += store.publish(g.batch(k)).await?.accepted as u64;
                left -= k;
            }
        }
        _ => {
            let lanes = store.lanes();
            let mut cursors: Vec<lanebus_store::ClaimCursor> =
                vec![Default::default(); usize::from(lanes)];
            let total = published * cell.handlers as u64;
            let limit = u32::try_from(cell.settings.lane_buffer()).unwrap_or(200);
            while (handled.len() as u64) < total {
                let claims: Vec<LaneClaim> = (0..lanes)
                    .map(|lane| LaneClaim {
                        lane,
                        epoch: Epoch(0),
                        after: cursors[usize::from(lane)].clone(),
                        limit,
                    })
                    .collect();
                let batches = store.claim(&claims).await?;
                let mut refs = Vec::new();
                for b in &batches {
                    cursors[usize::from(b.lane)] = b.next_after.clone();
                    for d in &b.deliveries {
                        handled.push(Handled {
                            handler: handler_idx
                                .get(d.handler_id.as_str())
                                .copied()
                                .unwrap_or(u16::MAX),
                            event: d.event_id.as_str().into(),
                            key: d.key.as_deref().map(Into::into),
                            seq: d.seq,
                        });
                        refs.push(DeliveryRef {
                            id: d.id,
                            lane: d.lane,
                            epoch: Epoch(0),
                            attempts: 1,
                        });
                    }
                }
                if refs.is_empty() {
                    break;
                }
                for chunk in refs.chunks(200) {
                    store.complete(chunk).await?;
                }
            }
        }
    }
    let window = t0.elapsed();
    let s1 = snapshot(stores, pm).await?;
    close_and_wait(stores).await?;
    let (sb, stats_wait_ms, stats_complete, counts) = settle(stores, pm, cell.kind).await?;
    let held = Held {
        completed: counts.completions,
        pending: counts.deliveries,
        dead: counts.dead_letters,
    };
    let expected = published as i64 * cell.handlers as i64;
    let ex = exact::check(&handled, held, expected);
    let mut problems = ex.problems();
    let units = match cell.kind {
        Kind::CountPublish => {
            if held.completed != 0 || held.pending != expected {
                problems.push(format!(
                    "publish sample holds {} pending + {} completed deliveries, expected exactly {expected} pending",
                    held.pending, held.completed
                ));
            }
            counts.events
        }
        _ => {
            if held.pending != 0 || held.completed != expected {
                problems.push(format!(
                    "drain left {} pending and completed {} of {expected}",
                    held.pending, held.completed
                ));
            }
            counts.completions
        }
    }
    .max(0) as u64;
    if units == 0 {
        problems.push("nothing was measured".into());
    }
    let mut counters = pg::per_unit(&sa, &sb, units);
    let unavailable = mongo_counters(stores, &mut counters, units).await?;
    let cpu = pg::per_unit(&sa, &s1, units);
    for k in ["cpu_app_ms", "cpu_db_ms"] {
        match cpu.get(k) {
            Some(v) => counters.insert(k.to_owned(), *v),
            None => counters.remove(k),
        };
    }
    let secs = window.as_secs_f64().max(1e-9);
    Ok(SampleOut {
        cell: cell.name.clone(),
        units,
        window_s: secs,
        rate: units as f64 / secs,
        accepted_rate: 0.0,
        handled_rate: handled.len() as f64 / secs,
        counters,
        latency: None,
        exact: ex,
        problems,
        stats_wait_ms,
        stats_incomplete: !stats_complete,
        unavailable,
        lane_moves_in_window: 0,
    })
}

async fn snapshot(stores: &mut Stores, pm: Option<u32>) -> anyhow::Result<pg::Snapshot> {
    if let Some(m) = stores.mongo.as_mut() {
        // The sample's own server: its CPU, its completion documents.
        let s = m.probe.snapshot().await?;
        let out = pg::Snapshot {
            app_cpu: pg::self_cpu(),
            db_cpu: pg::tree_cpu(m.server.pid),
            completed: s.completed,
            ..pg::Snapshot::default()
        };
        m.last = Some(s);
        return Ok(out);
    }
    match stores.probe.as_mut() {
        Some(p) => pg::snapshot(p, pm, pg::self_cpu()).await,
        None => Ok(pg::Snapshot {
            app_cpu: pg::self_cpu(),
            ..pg::Snapshot::default()
        }),
    }
}

/// MongoDB cells: replaces the PostgreSQL counters of `counters` by the
/// server's counters over the whole sample (from the snapshot after the
/// setup to the one after every connection closed; see [`crate::mongo`])
/// per unit; returns the counters the server does not report. Other
/// stores: unchanged, nothing unavailable.
async fn mongo_counters(
    stores: &Stores,
    counters: &mut BTreeMap<String, f64>,
    units: u64,
) -> anyhow::Result<Vec<String>> {
    let Some(m) = stores.mongo.as_ref() else {
        return Ok(Vec::new());
    };
    for k in ["statements", "wal_bytes", "wal_records", "wal_fpi"] {
        counters.remove(k);
    }
    if let (Some(a), Some(b), true) = (&m.start, &m.end, units > 0) {
        for (k, v) in mongo::whole(&m.probe, a, b).await? {
            counters.insert(k, v as f64 / units as f64);
        }
    }
    Ok(m.probe.unavailable.clone())
}

/// Prints every hand-over of an (event, handler) handed over more than once
/// with its delivery id, lane, attempt and time (stderr).
fn print_repeats(handled: &[Handled], detail: &[Detail]) {
    let mut by: HashMap<(u16, &str), Vec<usize>> = HashMap::new();
    for (i, h) in handled.iter().enumerate() {
        by.entry((h.handler, &h.event)).or_default().push(i);
    }
    let mut rows: Vec<_> = by.into_iter().filter(|(_, v)| v.len() > 1).collect();
    rows.sort_by_key(|(_, v)| v[0]);
    for ((handler, event), v) in rows {
        let parts: Vec<String> = v
            .iter()
            .filter_map(|&i| detail.get(i))
            .map(|(id, lane, attempt, at, node)| {
                format!(
                    "id={id} lane={lane} attempt={attempt} node={node} t={:.3}s",
                    at.as_secs_f64()
                )
            })
            .collect();
        eprintln!("REPEAT h{handler} event={event}: {}", parts.join(" | "));
    }
}

/// A NATS sink cell's server: a nats-server with JetStream on a free
/// loopback port, its store under the work dir (removed with the sample),
/// and the stream `BENCH` (subjects `bench.>`, file storage) the handlers
/// publish to. The server command: `LANEBUS_BENCH_NATS_SERVER`, else
/// `nats-server` on the PATH, else `/usr/sbin/nats-server` (Debian).
struct NatsSink {
    url: String,
    dir: PathBuf,
    stream: tokio::sync::Mutex<async_nats::jetstream::stream::Stream>,
    _server: tokio::process::Child,
}

/// The nats-server command of [`NatsSink`], if one is installed.
pub fn nats_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LANEBUS_BENCH_NATS_SERVER") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin")])
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
}

impl NatsSink {
    async fn start(work_dir: &std::path::Path) -> anyhow::Result<NatsSink> {
        let bin =
            nats_server().context("no nats-server (LANEBUS_BENCH_NATS_SERVER, PATH, /usr/sbin)")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir = work_dir.join(format!("nats-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir)?;
        let server = tokio::process::Command::new(&bin)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", bin.display()))?;
        let url = format!("nats://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let stream = loop {
            let made = async {
                let js = async_nats::jetstream::new(async_nats::connect(&url).await?);
                anyhow::Ok(
                    js.get_or_create_stream(async_nats::jetstream::stream::Config {
                        name: "BENCH".into(),
                        subjects: vec!["bench.>".into()],
                        storage: async_nats::jetstream::stream::StorageType::File,
                        ..Default::default()
                    })
                    .await?,
                )
            }
            .await;
            match made {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => bail!("nats-server on {port}: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        Ok(NatsSink {
            url,
            dir,
            stream: tokio::sync::Mutex::new(stream),
            _server: server,
        })
    }

    /// Every message the stream holds, as a hand-over at the time the
    /// stream stored it.
    async fn handled(&self) -> anyhow::Result<Vec<(Handled, Instant)>> {
        let mut stream = self.stream.lock().await;
        let last = stream.info().await?.state.last_sequence;
        let now_wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos() as i128;
        let now = Instant::now();
        let mut out = Vec::with_capacity(last as usize);
        for seq in 1..=last {
            let m = stream.get_raw_message(seq).await?;
            let h = |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned());
            let ago = (now_wall - m.time.unix_timestamp_nanos()).max(0) as u64;
            let handler = m
                .subject
                .strip_prefix("bench.h")
                .and_then(|n| n.parse().ok())
                .unwrap_or(u16::MAX);
            out.push((
                Handled {
                    handler,
                    // Nodes before the per-delivery Nats-Msg-Id sent the
                    // event id there and no lanebus-id (older bases).
                    event: h("lanebus-id")
                        .or_else(|| h("Nats-Msg-Id"))
                        .unwrap_or_default()
                        .as_str()
                        .into(),
                    key: h("lanebus-key").map(|k| k.as_str().into()),
                    seq: h("lanebus-sequence").and_then(|s| s.parse().ok()),
                },
                now.checked_sub(Duration::from_nanos(ago)).unwrap_or(now),
            ));
        }
        Ok(out)
    }
}

impl Drop for NatsSink {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_publishers_tick_evenly_spread() {
        let cell = crate::cells::full()
            .into_iter()
            .find(|c| c.name == "pg-mixed-1000-ours")
            .unwrap();
        assert_eq!((cell.publishers, cell.rate, cell.batch), (32, 1000, 1));
        let mut first: Vec<Duration> = (0..cell.publishers)
            .map(|p| {
                let (offset, period) = ticks(&cell, p);
                assert_eq!(period, Duration::from_millis(32));
                offset
            })
            .collect();
        first.sort();
        // One publish every millisecond, not 32 at once every 32 ms.
        for (i, w) in first.windows(2).enumerate() {
            let gap = w[1] - w[0];
            assert!(
                gap > Duration::from_micros(999) && gap < Duration::from_micros(1001),
                "gap {i}: {gap:?}"
            );
        }
        assert!(first[31] < Duration::from_millis(32));
    }

    #[test]
    fn personal_payloads_name_a_subject_and_its_field() {
        let cell = Cell {
            personal: true,
            ..Cell::default()
        };
        let mut g = Gen::new(&cell, 3);
        let mut subjects = std::collections::HashSet::new();
        for e in g.batch(50) {
            let v: serde_json::Value = serde_json::from_slice(&e.payload).unwrap();
            let s = v["subject"].as_str().unwrap().to_owned();
            assert_eq!(v["email"], format!("{s}@example.org"));
            assert_eq!(v["action"], "opened");
            subjects.insert(s);
        }
        assert!(subjects.len() > 1, "subjects vary");
        let plain = Gen::new(&Cell::default(), 3).batch(1).remove(0);
        let v: serde_json::Value = serde_json::from_slice(&plain.payload).unwrap();
        assert!(v.get("subject").is_none());
    }

    /// The schema cell's schema accepts every payload the bench sends and
    /// refuses one that breaks it, so the cell pays for real validation.
    #[tokio::test]
    async fn schema_cells_validate_every_payload() {
        let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
        setup_schema(&store).await.unwrap();
        let cell = Cell {
            schema: true,
            ..Cell::default()
        };
        let events = Gen::new(&cell, 2).batch(20);
        store.publish(events).await.unwrap();
        let mut bad = Gen::new(&cell, 2).batch(1);
        bad[0].payload = br#"{"action":"deleted","body":"x"}"#.to_vec();
        let err = store.publish(bad).await.unwrap_err();
        assert!(err.to_string().contains("/action"), "{err}");
    }
}
