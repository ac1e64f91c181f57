//! Shared harness of the node's integration tests: a fresh database per test
//! on either backend, a node in-process, the HTTP API client, real payloads.
//!
//! PostgreSQL tests need `LANEBUS_TEST_POSTGRES_URL` (a server where the test
//! may create databases); `scripts/test` starts a throwaway one and sets it.
//! MongoDB tests need `LANEBUS_TEST_MONGODB_URI` (a replica set; each test
//! uses its own database in it); `scripts/test` starts a MongoDB-compatible
//! test server and sets it. Without the variable those tests fail.

#![allow(dead_code)]

pub mod wrapped;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use lanebus_node::{NodeHandle, NodeOptions, StoreSource};
use lanebus_testkit::receiver::Expected;
use lanebus_testkit::sample_data::{self, Sample};
use serde_json::Value;
use sqlx::Connection as _;

/// The backends the tests run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    Mongodb,
}

/// The MongoDB server of the tests.
pub const MONGODB_URI_VAR: &str = "LANEBUS_TEST_MONGODB_URI";

/// Lanes of a MongoDB test store (instead of the default 256). On the test
/// server (SecantusDB) each `$unionWith` sub-pipeline of a claim costs about
/// a scan of `deliveries` (a 64-lane claim chunk took 14 s with 1,800
/// deliveries stored, where each lane alone answers in 50 ms; MongoDB uses
/// the `(lane, pos)` index for each), so a claim's cost grows with the lanes
/// claimed together. 16 lanes keep the node tests to minutes there; keys
/// share lanes more, which the per-key order checks only make harder.
pub const MONGODB_TEST_LANES: u16 = 16;

/// `LANEBUS_TEST_MONGODB_URI` with its database (the URL's path) set to `db`.
pub fn mongodb_url(db: &str) -> anyhow::Result<String> {
    let Ok(base) = std::env::var(MONGODB_URI_VAR) else {
        bail!(
            "{MONGODB_URI_VAR} is not set: the MongoDB tests need a replica set. Run them with \
             scripts/test, which starts a MongoDB-compatible test server, or set it to \
             mongodb://HOST:PORT/?replicaSet=NAME for a MongoDB you run"
        );
    };
    // By hand, not url::Url: a seed list (h1,h2,h3) is no URL host.
    let (head, query) = base.split_at(base.find('?').unwrap_or(base.len()));
    let hosts_from = head.find("://").map_or(0, |i| i + 3);
    let hosts_end = head[hosts_from..]
        .find('/')
        .map_or(head.len(), |i| hosts_from + i);
    Ok(format!("{}/{db}{query}", &head[..hosts_end]))
}

/// A fresh, empty database for one test.
pub struct TestDb {
    pub backend: Backend,
    pub url: String,
    dir: Option<PathBuf>,
    pg: Option<(String, String)>,
    mongo: bool,
}

fn unique(name: &str) -> String {
    format!(
        "{name}_{}",
        &uuid::Uuid::now_v7().simple().to_string()[18..]
    )
}

impl TestDb {
    /// A new database named after the test.
    pub async fn new(backend: Backend, name: &str) -> anyhow::Result<TestDb> {
        let name = unique(name);
        match backend {
            Backend::Sqlite => {
                let dir = std::env::temp_dir().join(format!("lanebus-test-{name}"));
                std::fs::create_dir_all(&dir)?;
                let url = format!("sqlite://{}", dir.join("lanebus.db").display());
                Ok(TestDb {
                    backend,
                    url,
                    dir: Some(dir),
                    pg: None,
                    mongo: false,
                })
            }
            Backend::Postgres => {
                let Ok(admin) = std::env::var("LANEBUS_TEST_POSTGRES_URL") else {
                    bail!(
                        "LANEBUS_TEST_POSTGRES_URL is not set: run the tests with scripts/test, which starts \
                         a throwaway PostgreSQL, or set it to a server where tests may create databases"
                    );
                };
                let db = format!("lanebus_{name}").to_lowercase();
                let mut conn = sqlx::PgConnection::connect(&admin).await.with_context(|| {
                    format!("cannot connect to LANEBUS_TEST_POSTGRES_URL {admin}")
                })?;
                sqlx::query(&format!("CREATE DATABASE \"{db}\""))
                    .execute(&mut conn)
                    .await?;
                conn.close().await.ok();
                let mut u = url::Url::parse(&admin)?;
                u.set_path(&format!("/{db}"));
                Ok(TestDb {
                    backend,
                    url: u.to_string(),
                    dir: None,
                    pg: Some((admin, db)),
                    mongo: false,
                })
            }
            Backend::Mongodb => {
                let url = mongodb_url(&format!("lanebus_{name}").to_lowercase())?;
                // Created with MONGODB_TEST_LANES lanes before any node opens
                // it (an existing store keeps its lane count).
                lanebus_store::mongodb::MongoStore::connect_with_lanes(&url, MONGODB_TEST_LANES)
                    .await
                    .with_context(|| format!("cannot open the MongoDB test store at {url}"))?;
                Ok(TestDb {
                    backend,
                    url,
                    dir: None,
                    pg: None,
                    mongo: true,
                })
            }
        }
    }

    /// Removes the database (best effort).
    pub async fn drop_db(self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some((admin, db)) = &self.pg {
            if let Ok(mut conn) = sqlx::PgConnection::connect(admin).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)"))
                    .execute(&mut conn)
                    .await;
            }
        }
        if self.mongo {
            if let Ok(store) = lanebus_store::mongodb::MongoStore::connect(&self.url).await {
                // Not on the test server `scripts/test` starts (SecantusDB,
                // in memory, discarded after the run): its dropDatabase
                // meeting a transaction left open (a node shut down with a
                // store call under way, or killed) waits for it while
                // holding the lock that the transaction's abort needs, and
                // every transaction on the server stops. mongod aborts such
                // a transaction after 60 s.
                let secantus = store
                    .database()
                    .run_command(mongodb::bson::doc! { "buildInfo": 1 })
                    .await
                    .is_ok_and(|b| b.contains_key("secantusVersion"));
                if !secantus {
                    let _ = store.database().drop().await;
                }
            }
        }
    }
}

/// `lanebus ARGS` as a user runs it: no `LANEBUS_*` variable but `env`,
/// `stdin` (or nothing) on its standard input.
pub async fn cli(
    args: &[&str],
    env: &[(&str, &str)],
    stdin: Option<&[u8]>,
) -> anyhow::Result<std::process::Output> {
    use tokio::io::AsyncWriteExt as _;
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_lanebus"));
    c.args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, _) in std::env::vars() {
        if k.starts_with("LANEBUS_") {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().copied());
    let mut child = c.spawn()?;
    let mut input = child.stdin.take().context("stdin")?;
    if let Some(bytes) = stdin {
        input.write_all(bytes).await?;
    }
    drop(input);
    Ok(child.wait_with_output().await?)
}

/// A command's standard output, as text.
pub fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A command's standard error, as text.
pub fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs [`cli`] and wants success; its standard output.
pub async fn cli_ok(args: &[&str]) -> anyhow::Result<String> {
    let o = cli(args, &[], None).await?;
    anyhow::ensure!(
        o.status.success(),
        "lanebus {args:?}: {}\n{}",
        o.status,
        stderr(&o)
    );
    Ok(stdout(&o))
}

/// Runs [`cli`] and wants success and JSON on standard output.
pub async fn cli_json(args: &[&str]) -> anyhow::Result<Value> {
    let out = cli_ok(args).await?;
    serde_json::from_str(&out).with_context(|| format!("{args:?} printed {out}"))
}

/// Node options for tests: short retries and polls.
pub fn test_options(url: &str) -> NodeOptions {
    let mut o = NodeOptions::new("test-1", StoreSource::Url(url.to_string()));
    o.lane.retry.base = Duration::from_millis(100);
    o.lane.retry.cap = Duration::from_secs(2);
    o.poll_interval = Some(Duration::from_millis(50));
    o.catalog_refresh = Duration::from_secs(1);
    // The receivers of the tests listen on loopback (the SSRF guard refuses
    // it by default).
    o.egress = lanebus_api::egress::EgressPolicy::allow_loopback();
    o
}

/// Makes the receiver answer `500` to every request of `handler`.
pub fn fail_always(rx: &lanebus_testkit::receiver::Receiver, handler: &str) {
    rx.add_rule(lanebus_testkit::receiver::Rule {
        handler: Some(handler.into()),
        key: None,
        action: lanebus_testkit::receiver::Action::Status {
            status: 500,
            retry_after: None,
        },
    });
}

/// Starts a node on `url` with [`test_options`].
pub async fn start_node(url: &str) -> anyhow::Result<NodeHandle> {
    Ok(lanebus_node::start(test_options(url)).await?)
}

/// A registered handler.
#[derive(Debug, Clone)]
pub struct Registered {
    pub id: String,
    pub name: String,
    pub secret: String,
    pub routes: Vec<String>,
}

/// Client of a node's HTTP API.
#[derive(Clone)]
pub struct Api {
    pub base: String,
    http: reqwest::Client,
}

impl Api {
    pub fn new(base: &str) -> Api {
        lanebus_node::webhook::install_crypto_provider();
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: reqwest::Client::new(),
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("{method} {path}"))?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, v))
    }

    pub async fn create_handler(
        &self,
        name: &str,
        url: &str,
        routes: &[&str],
        max_attempts: u32,
    ) -> anyhow::Result<Registered> {
        self.create_handler_timeout(name, url, routes, max_attempts, 5_000)
            .await
    }

    /// [`Api::create_handler`] with another attempt timeout (a cluster's
    /// lane lease must be longer).
    pub async fn create_handler_timeout(
        &self,
        name: &str,
        url: &str,
        routes: &[&str],
        max_attempts: u32,
        timeout_ms: u64,
    ) -> anyhow::Result<Registered> {
        let (status, body) = self
            .call(
                reqwest::Method::POST,
                "/v1/handlers",
                Some(serde_json::json!({"name": name, "url": url, "event_types": routes, "max_attempts": max_attempts, "timeout_ms": timeout_ms})),
            )
            .await?;
        if status != 201 {
            bail!("create handler {name}: {status} {body}");
        }
        Ok(Registered {
            id: body["id"].as_str().context("id")?.to_string(),
            name: name.to_string(),
            secret: body["secret"].as_str().context("secret")?.to_string(),
            routes: routes.iter().map(|s| s.to_string()).collect(),
        })
    }

    /// Publishes in batches of `batch`.
    pub async fn publish(&self, events: &[Value], batch: usize) -> anyhow::Result<()> {
        for chunk in events.chunks(batch) {
            let (status, body) = self
                .call(
                    reqwest::Method::POST,
                    "/v1/events",
                    Some(serde_json::json!({ "events": chunk })),
                )
                .await?;
            if status != 202 {
                bail!("publish: {status} {body}");
            }
        }
        Ok(())
    }

    pub async fn dead_letters(&self, handler_id: &str) -> anyhow::Result<Vec<Value>> {
        let (status, body) = self
            .call(
                reqwest::Method::GET,
                &format!("/admin/dead-letters?handler_id={handler_id}&limit=1000"),
                None,
            )
            .await?;
        if status != 200 {
            bail!("dead letters: {status} {body}");
        }
        Ok(body["dead_letters"].as_array().cloned().unwrap_or_default())
    }

    pub async fn replay(&self, handler_id: &str) -> anyhow::Result<u64> {
        let (status, body) = self
            .call(
                reqwest::Method::POST,
                "/admin/dead-letters/replay",
                Some(serde_json::json!({"handler_id": handler_id})),
            )
            .await?;
        if status != 200 {
            bail!("replay: {status} {body}");
        }
        body["replayed"].as_u64().context("replayed")
    }

    pub async fn delete(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        self.call(reqwest::Method::DELETE, path, None).await
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        self.call(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> anyhow::Result<(u16, Value)> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// The node's Prometheus text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await?
            .text()
            .await?)
    }
}

/// The real payloads of the repository's `data/`.
pub fn samples() -> Vec<Sample> {
    let path = sample_data::find(None).expect("data/github-webhook-examples.json");
    sample_data::load(&path).expect("examples load")
}

/// One published event as the tests track it.
#[derive(Debug, Clone)]
pub struct Published {
    pub id: String,
    pub event_type: String,
    pub key: Option<String>,
    pub payload: String,
}

/// `n` events drawn round-robin from the samples, keys `repo-<i % keys>`
/// (`keys == 0`: unkeyed), ids `{prefix}-{i}`.
pub fn real_events(
    samples: &[Sample],
    n: usize,
    keys: usize,
    prefix: &str,
) -> (Vec<Value>, Vec<Published>) {
    let mut json = Vec::with_capacity(n);
    let mut tracked = Vec::with_capacity(n);
    for i in 0..n {
        let s = &samples[i % samples.len()];
        let key = (keys > 0).then(|| format!("repo-{}", i % keys));
        let id = format!("{prefix}-{i}");
        let payload: Value = serde_json::from_str(&s.payload).expect("json");
        let mut e = serde_json::json!({"id": id, "type": s.event_type, "payload": payload});
        if let Some(k) = &key {
            e["key"] = Value::String(k.clone());
        }
        json.push(e);
        tracked.push(Published {
            id,
            event_type: s.event_type.clone(),
            key,
            payload: s.payload.clone(),
        });
    }
    (json, tracked)
}

/// The deliveries the receiver should get for `events` over `handlers`.
pub fn expected(events: &[Published], handlers: &[Registered]) -> Vec<Expected> {
    let mut out = Vec::new();
    for e in events {
        for h in handlers {
            if lanebus_store::route::any_matches(&h.routes, &e.event_type) {
                out.push(Expected {
                    handler: h.name.clone(),
                    event_id: e.id.clone(),
                    key: e.key.clone(),
                });
            }
        }
    }
    out
}

/// Verifies recorded requests (`[{"secret", "body", "headers"}, ...]`) with
/// the official Python `standardwebhooks` package
/// (`node/tests/verify_standardwebhooks.py`, run by `python`); answers the
/// script's summary line.
pub fn verify_with_python(python: &str, entries: &[Value]) -> anyhow::Result<String> {
    let path = std::env::temp_dir().join(format!(
        "lanebus-swh-{}.json",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::write(&path, serde_json::to_vec(entries)?)?;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/verify_standardwebhooks.py"
    );
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(&path)
        .output()
        .context("run python")?;
    let _ = std::fs::remove_file(&path);
    anyhow::ensure!(
        out.status.success(),
        "standardwebhooks rejected signatures: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// No repeat without a cause: per event, every request but the last failed,
/// and the attempt numbers are 1, 2, 3, ... (one node, no owner change).
#[allow(dead_code)]
pub fn ensure_no_repeat_without_failure(
    reqs: &[lanebus_testkit::receiver::Received],
) -> anyhow::Result<()> {
    let mut per_event: std::collections::HashMap<&str, Vec<(u32, bool)>> = Default::default();
    for r in reqs {
        per_event
            .entry(r.event_id.as_str())
            .or_default()
            .push((r.attempt, r.accepted()));
    }
    for (id, tries) in &per_event {
        let n = tries.len();
        for (i, &(attempt, ok)) in tries.iter().enumerate() {
            anyhow::ensure!(attempt as usize == i + 1, "{id}: attempt numbers {tries:?}");
            anyhow::ensure!(
                ok == (i + 1 == n),
                "{id}: repeat without a failure {tries:?}"
            );
        }
    }
    Ok(())
}

/// `lanebus node` flags of a 3 s lease
/// ([`lanebus_testkit::local_cluster::LEASE_3S`]) with retries from 50 ms
/// and store polls every 50 ms: for cluster tests that need more room than
/// a 1.5 s lease on a loaded machine, or a handler timeout (up to 2 s)
/// inside the lease.
pub fn lease_3s_args() -> Vec<&'static str> {
    lanebus_testkit::local_cluster::with_lease_3s(&[
        "--retry-base-ms",
        "50",
        "--poll-interval-ms",
        "50",
    ])
}

/// Whether every lane of `lanes` (the cluster's view, `GET /admin/lanes`)
/// is fenced in the store (`rows`, `Store::lane_rows`) by its owner at its
/// epoch; a store owner is `NODE/INCARNATION`, compared by its node id.
///
/// # Errors
/// The first lane that is not.
pub fn fenced(
    lanes: &[lanebus_testkit::local_cluster::ApiLane],
    rows: &[lanebus_store::LaneRow],
) -> Result<(), String> {
    let by_lane: std::collections::HashMap<u16, &lanebus_store::LaneRow> =
        rows.iter().map(|r| (r.lane, r)).collect();
    for l in lanes {
        let row = by_lane.get(&l.lane);
        let node = row
            .and_then(|r| r.owner.as_deref())
            .map(|o| o.split('/').next().unwrap_or(o));
        let epoch = row.map(|r| r.epoch.0);
        if node != l.owner.as_deref() || epoch != u64::try_from(l.epoch).ok() {
            return Err(format!(
                "lane {}: the cluster has owner {:?} epoch {}, the store {node:?} epoch {epoch:?}",
                l.lane, l.owner, l.epoch
            ));
        }
    }
    Ok(())
}

/// Waits until `store` holds every lane fenced as node `via` shows it
/// ([`fenced`]): the owners have finished their fencing writes. On SQLite
/// a node paused inside such a write keeps the file's write lock and stops
/// every other node's writes until it resumes, so a test that pauses a
/// node waits for this first.
///
/// # Errors
/// If that does not happen within `timeout` (naming the last problem).
pub async fn wait_fenced(
    cluster: &lanebus_testkit::local_cluster::LocalCluster,
    via: u64,
    store: &dyn lanebus_store::Store,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let problem = match (cluster.lanes(via).await, store.lane_rows().await) {
            (Ok(lanes), Ok(rows)) => match fenced(&lanes, &rows) {
                Ok(()) => return Ok(()),
                Err(p) => p,
            },
            (Err(e), _) => e.to_string(),
            (_, Err(e)) => e.to_string(),
        };
        if std::time::Instant::now() > deadline {
            bail!("lanes not fenced in the store as node {via} shows them: {problem}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
