//! The sandbox (after Quickwit's `ClusterSandboxBuilder`): real `lanebus
//! node` processes, each with its own data dir and free ports, a throwaway
//! database behind a TCP proxy, TCP proxies in front of every Raft address
//! (when the node can advertise an address other than the one it binds),
//! and the webhook receiver. The sandbox talks to nodes only through the
//! contract: the CLI to start them, signals to hurt them, HTTP to watch them.
//!
//! ```text
//!              ┌──────── raft proxies (per-link faults) ────────┐
//! lanebus node 1 ─┐                                              │
//! lanebus node 2 ─┼─▶ db proxy ─▶ PostgreSQL (scripts/pg-start) or SQLite file
//! lanebus node 3 ─┘
//!        │ webhooks
//!        ▼
//!     receiver (logs every request; told to fail, stall, reset)
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::process::{Child, Command};

use crate::plan::Lease;
use crate::proxy::{LinkMode, Proxy, Sources};
use crate::receiver::Receiver;

/// A throwaway PostgreSQL server for the whole suite (scripts/pg-start).
pub struct PgServer {
    dir: PathBuf,
    /// Its port.
    pub port: u16,
    scripts: PathBuf,
}

impl PgServer {
    /// Starts one in a new temporary directory.
    pub async fn start(scripts: &Path) -> anyhow::Result<PgServer> {
        let dir = std::env::temp_dir().join(format!("lanebus-chaos-pg-{}", std::process::id()));
        let port = free_port()?;
        let pg = PgServer {
            dir,
            port,
            scripts: scripts.to_path_buf(),
        };
        pg.up().await?;
        Ok(pg)
    }

    /// `postgres://postgres@127.0.0.1:PORT/DB`.
    pub fn url(&self, port: u16, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{db}")
    }

    /// Starts the server (again, from its directory).
    pub async fn up(&self) -> anyhow::Result<()> {
        let out = Command::new(self.scripts.join("pg-start"))
            .arg(&self.dir)
            .arg(self.port.to_string())
            .output()
            .await
            .context("cannot run scripts/pg-start")?;
        if !out.status.success() {
            bail!(
                "scripts/pg-start failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Stops the server, keeping its data (`pg_ctl stop -m fast`: sessions
    /// are terminated, as in a restart by an operator). scripts/pg-stop
    /// would remove the data too.
    pub async fn down(&self) -> anyhow::Result<()> {
        let bindir = pg_bindir().context("no PostgreSQL server binaries found")?;
        let mut cmd = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bindir.join("pg_ctl"));
            c
        } else {
            Command::new(bindir.join("pg_ctl"))
        };
        let out = cmd
            .arg("-D")
            .arg(&self.dir)
            .args(["-m", "fast", "-w", "stop"])
            .output()
            .await
            .context("cannot run pg_ctl stop")?;
        if !out.status.success() {
            bail!(
                "pg_ctl stop failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Creates database `name`.
    pub async fn create_db(&self, name: &str) -> anyhow::Result<()> {
        use sqlx::Connection as _;
        let mut c = sqlx::PgConnection::connect(&self.url(self.port, "postgres")).await?;
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut c)
            .await?;
        Ok(())
    }
}

impl Drop for PgServer {
    /// Stops the server and removes its directory (scripts/pg-stop).
    fn drop(&mut self) {
        let _ = std::process::Command::new(self.scripts.join("pg-stop"))
            .arg(&self.dir)
            .output();
    }
}

fn pg_bindir() -> Option<PathBuf> {
    let mut found = None;
    for d in std::fs::read_dir("/usr/lib/postgresql").ok()?.flatten() {
        let bin = d.path().join("bin");
        if bin.join("pg_ctl").exists() {
            found = Some(bin);
        }
    }
    found
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Where a scenario's data lives.
pub enum Store {
    /// A database of the suite's PostgreSQL server.
    Postgres {
        /// The server.
        server: Arc<PgServer>,
        /// Database name.
        db: String,
    },
    /// A SQLite file in the sandbox dir.
    Sqlite,
}

/// Node settings passed as flags.
#[derive(Debug, Clone, Copy)]
pub struct NodeFlags {
    /// Whether `--lease-ms` and friends exist.
    pub lease_flags: bool,
    /// Whether `--raft-advertise-addr` exists.
    pub advertise_flag: bool,
    /// Whether `--webhook-source-ip` exists: each node then sends its
    /// webhooks from its own loopback address ([`source_ip`]), and the
    /// receiver knows the sender from the peer address.
    pub source_ip_flag: bool,
}

impl NodeFlags {
    /// Reads `lanebus node --help` of `bin`.
    pub async fn probe(bin: &Path) -> anyhow::Result<NodeFlags> {
        let out = Command::new(bin)
            .args(["node", "--help"])
            .output()
            .await
            .with_context(|| format!("cannot run {}", bin.display()))?;
        let help = String::from_utf8_lossy(&out.stdout);
        Ok(NodeFlags {
            lease_flags: help.contains("--lease-ms") && help.contains("--lease-margin-ms"),
            advertise_flag: help.contains("--raft-advertise-addr"),
            source_ip_flag: help.contains("--webhook-source-ip"),
        })
    }
}

/// One node process.
pub struct NodeProc {
    /// `--id`.
    pub id: u64,
    /// HTTP address.
    pub http: SocketAddr,
    /// Raft address it binds.
    pub raft_bind: SocketAddr,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Whether it is frozen (SIGSTOP).
    pub paused: bool,
    /// Whether it left the cluster on purpose (a planned removal) and was
    /// stopped: not started again, not counted for health.
    pub retired: bool,
    starts: u32,
}

impl NodeProc {
    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Whether its process runs.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// The node process's id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

/// The running system of one scenario.
pub struct Sandbox {
    /// Its directory (data dirs, logs, SQLite file).
    pub dir: PathBuf,
    bin: PathBuf,
    flags: NodeFlags,
    /// Whether nodes get the suite's lease flags (else the node's
    /// defaults).
    suite_lease: bool,
    store_url: String,
    /// The database proxy (PostgreSQL only).
    pub db_proxy: Option<Proxy>,
    /// The nodes, index `i` has id `i + 1`.
    pub nodes: Vec<NodeProc>,
    /// One proxy per node's Raft address (when the node can advertise it).
    pub raft_proxies: Vec<Proxy>,
    sources: Sources,
    /// The webhook receiver.
    pub receiver: Receiver,
    /// HTTP client for the contract.
    pub http: reqwest::Client,
    /// Whether the node runs a real cluster (`GET /admin/cluster` has a term).
    pub clustered: bool,
    /// When the run started (time base of every log).
    pub start: Instant,
}

impl Sandbox {
    /// Builds a sandbox: database, receiver, `n` nodes (the first with
    /// `--bootstrap`, the others `--join`ing it); if the first node turns
    /// out to be single-node, the others are not started. `lease`: the
    /// suite's short lease (as flags, when the node has them) or the node's
    /// defaults.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        bin: &Path,
        flags: NodeFlags,
        lease: Lease,
        store: &Store,
        n: usize,
        seed: u64,
        dir: PathBuf,
        proxied: bool,
    ) -> anyhow::Result<Sandbox> {
        let start = Instant::now();
        // A directory kept from an earlier run with the same seed would
        // hand its data dirs (an old cluster) to the new nodes.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let sources: Sources = Arc::default();
        let (store_url, db_proxy) = match store {
            Store::Postgres { server, db } => {
                server.create_db(db).await?;
                let target: SocketAddr = format!("127.0.0.1:{}", server.port).parse()?;
                let p = Proxy::start(target, None, Arc::default(), seed).await?;
                (server.url(p.listen.port(), db), Some(p))
            }
            Store::Sqlite => (format!("sqlite://{}", dir.join("store.db").display()), None),
        };
        let receiver = Receiver::start(seed, start, sources.clone()).await?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(3))
            .build()?;
        let mut sb = Sandbox {
            dir,
            bin: bin.to_path_buf(),
            flags,
            suite_lease: lease == Lease::Suite,
            store_url,
            db_proxy,
            nodes: Vec::new(),
            raft_proxies: Vec::new(),
            sources,
            receiver,
            http,
            clustered: false,
            start,
        };
        for i in 0..n {
            let id = i as u64 + 1;
            let raft_bind: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
            let node = NodeProc {
                id,
                http: format!("127.0.0.1:{}", free_port()?).parse()?,
                raft_bind,
                data_dir: sb.dir.join(format!("node-{id}")),
                log: sb.dir.join(format!("node-{id}.log")),
                child: None,
                paused: false,
                retired: false,
                starts: 0,
            };
            if proxied && flags.advertise_flag {
                let p = Proxy::start(raft_bind, None, sb.sources.clone(), seed ^ id).await?;
                sb.raft_proxies.push(p);
            }
            sb.nodes.push(node);
        }
        sb.first_start(0).await?;
        sb.clustered = sb.term(0).await.unwrap_or(0) > 0;
        if sb.clustered {
            for i in 1..n {
                sb.first_start(i).await?;
            }
            if proxied && !flags.advertise_flag {
                sb.move_behind_proxies(seed).await?;
            }
        } else {
            sb.nodes.truncate(1);
            for p in sb.raft_proxies.drain(1..) {
                p.stop();
            }
        }
        Ok(sb)
    }

    /// Puts a proxy in front of every node's Raft address without a node
    /// flag for it: the members table keeps the address a node joined with,
    /// so each node in turn is stopped, started again from its data dir
    /// binding a new port, and a proxy takes over the recorded address and
    /// forwards to the new port.
    async fn move_behind_proxies(&mut self, seed: u64) -> anyhow::Result<()> {
        for i in 0..self.nodes.len() {
            self.stop(i).await;
            let recorded = self.nodes[i].raft_bind;
            let bind: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
            self.nodes[i].raft_bind = bind;
            let p = Proxy::start(bind, Some(recorded), self.sources.clone(), seed ^ i as u64)
                .await
                .with_context(|| format!("cannot put a proxy on {recorded}"))?;
            self.raft_proxies.push(p);
            self.spawn(i).await?;
            self.wait_ready(i, Duration::from_secs(60)).await?;
        }
        // Every lane owned again before the scenario starts.
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if self.all_lanes_active().await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("lanes not all active within 60 s after moving the nodes behind proxies")
    }

    /// Whether node 1's `GET /admin/lanes` shows every lane owned and active.
    pub async fn all_lanes_active(&self) -> bool {
        let Ok(r) = self
            .http
            .get(format!("{}/admin/lanes", self.nodes[0].url()))
            .send()
            .await
        else {
            return false;
        };
        let Ok(v) = r.json::<serde_json::Value>().await else {
            return false;
        };
        let lanes = v["lanes"].as_array().cloned().unwrap_or_default();
        !lanes.is_empty()
            && lanes
                .iter()
                .all(|l| !l["owner"].is_null() && l["state"].as_str() == Some("active"))
    }

    /// Milliseconds since the run started.
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    /// First start of node `i`, until ready. A first start has no state to
    /// keep, so when it fails (a free port taken by another process between
    /// our probe and the node's bind, or anything else) the node gets new
    /// ports, an empty data dir and one more try; the first failure and the
    /// end of its log are printed, not hidden.
    async fn first_start(&mut self, i: usize) -> anyhow::Result<()> {
        for attempt in 0..2 {
            self.spawn(i).await?;
            match self.wait_ready(i, Duration::from_secs(60)).await {
                Ok(()) => return Ok(()),
                Err(e) if attempt == 1 => return Err(e),
                Err(e) => {
                    println!(
                        "  first start of node {} failed, trying again: {e:#}",
                        self.nodes[i].id
                    );
                    self.kill(i).await;
                    let node = &mut self.nodes[i];
                    let old = node.log.with_extension("first-try.log");
                    let _ = std::fs::rename(&node.log, old);
                    node.http = format!("127.0.0.1:{}", free_port()?).parse()?;
                    node.raft_bind = format!("127.0.0.1:{}", free_port()?).parse()?;
                    node.starts = 0;
                    let _ = std::fs::remove_dir_all(&node.data_dir);
                }
            }
        }
        unreachable!("the loop returns")
    }

    /// Starts node `i`'s process (first start: `--bootstrap` or `--join`).
    pub async fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let first_url = self.nodes[0].url();
        let adv = self
            .raft_proxies
            .get(i)
            .filter(|_| self.flags.advertise_flag)
            .map(|p| p.listen);
        let node = &mut self.nodes[i];
        std::fs::create_dir_all(&node.data_dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&node.log)?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("node")
            .args(["--id", &node.id.to_string()])
            .args(["--http-addr", &node.http.to_string()])
            .args(["--raft-addr", &node.raft_bind.to_string()])
            .arg("--data-dir")
            .arg(&node.data_dir)
            .args(["--store", &self.store_url])
            .args(["--retry-base-ms", "50", "--retry-cap-ms", "400"])
            .env("LANEBUS_LOG", "info")
            // The receiver is on loopback, which the SSRF guard refuses
            // unless allowed.
            .env("LANEBUS_WEBHOOK_ALLOW_CIDRS", "127.0.0.0/8,::1/128")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        if let Some(a) = adv {
            cmd.args(["--raft-advertise-addr", &a.to_string()]);
        }
        if self.flags.source_ip_flag {
            cmd.args(["--webhook-source-ip", &source_ip(node.id).to_string()]);
        }
        if self.flags.lease_flags && self.suite_lease {
            cmd.args(["--lease-ms", &crate::LEASE_MS.to_string()])
                .args(["--renew-interval-ms", &crate::RENEW_MS.to_string()])
                .args(["--lease-margin-ms", &crate::LEASE_MARGIN_MS.to_string()]);
        }
        if node.starts == 0 {
            if i == 0 {
                cmd.arg("--bootstrap");
            } else {
                cmd.args(["--join", &first_url]);
            }
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", self.bin.display()))?;
        if let Some(pid) = child.id() {
            self.sources
                .lock()
                .expect("sources")
                .insert(pid, node.id.to_string());
        }
        node.child = Some(child);
        node.paused = false;
        node.starts += 1;
        Ok(())
    }

    /// Waits until node `i` answers `/readyz` with 200. Fails at once when
    /// the process exits, else after `within`; the error carries the end of
    /// the node's log (CI keeps no sandbox directory).
    pub async fn wait_ready(&mut self, i: usize, within: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        let url = format!("{}/readyz", self.nodes[i].url());
        loop {
            if let Ok(r) = self.http.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            let exited = match self.nodes[i].child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                None => Some("not running".to_string()),
                _ => None,
            };
            if exited.is_some() || Instant::now() > deadline {
                let node = &self.nodes[i];
                let why = match exited {
                    Some(status) => format!("exited ({status})"),
                    None => format!("not ready within {within:?}"),
                };
                bail!(
                    "node {} {why} (log: {}); its last log lines:\n{}",
                    node.id,
                    node.log.display(),
                    log_tail(&node.log, 25)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn term(&self, i: usize) -> anyhow::Result<u64> {
        let v: serde_json::Value = self
            .http
            .get(format!("{}/admin/cluster", self.nodes[i].url()))
            .send()
            .await?
            .json()
            .await?;
        Ok(v["term"].as_u64().unwrap_or(0))
    }

    /// The leader's index as a live node reports it.
    pub async fn leader(&self) -> Option<usize> {
        for n in self.nodes.iter().filter(|n| n.running() && !n.paused) {
            let Ok(r) = self
                .http
                .get(format!("{}/admin/cluster", n.url()))
                .send()
                .await
            else {
                continue;
            };
            let Ok(v) = r.json::<serde_json::Value>().await else {
                continue;
            };
            if let Some(l) = v["leader"].as_str() {
                return self.nodes.iter().position(|n| n.id.to_string() == l);
            }
        }
        None
    }

    /// SIGKILL node `i`.
    pub async fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            if let Some(pid) = c.id() {
                self.sources.lock().expect("sources").remove(&pid);
                if self.nodes[i].paused {
                    signal(pid, "CONT").await;
                }
            }
            let _ = c.kill().await;
        }
        self.nodes[i].paused = false;
    }

    /// SIGTERM node `i` and wait for it to exit (SIGKILL after 10 s).
    pub async fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            if let Some(pid) = c.id() {
                self.sources.lock().expect("sources").remove(&pid);
                signal(pid, "TERM").await;
            }
            if tokio::time::timeout(Duration::from_secs(10), c.wait())
                .await
                .is_err()
            {
                let _ = c.kill().await;
            }
        }
    }

    /// Stops node `i` (SIGTERM) after it left the cluster on purpose; it
    /// stays out of the run.
    pub async fn retire(&mut self, i: usize) {
        self.stop(i).await;
        self.nodes[i].retired = true;
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`) node `i`.
    pub async fn pause(&mut self, i: usize, stop: bool) {
        if let Some(pid) = self.nodes[i].pid() {
            signal(pid, if stop { "STOP" } else { "CONT" }).await;
            self.nodes[i].paused = stop;
        }
    }

    /// Cuts (`true`) or heals the Raft links of node `i` in both directions.
    pub fn isolate(&self, i: usize, cut: bool) {
        let me = self.nodes[i].id.to_string();
        for (j, p) in self.raft_proxies.iter().enumerate() {
            let mode = if cut { LinkMode::Cut } else { LinkMode::Pass };
            if j == i {
                p.set(None, mode);
            } else {
                p.set(Some(&me), mode);
            }
        }
    }

    /// Cuts node `i`'s outgoing Raft links and makes the others lossy.
    pub fn one_way(&self, i: usize, loss: u32) {
        let me = self.nodes[i].id.to_string();
        for (j, p) in self.raft_proxies.iter().enumerate() {
            p.set(None, LinkMode::Flaky(loss));
            if j != i {
                p.set(Some(&me), LinkMode::Cut);
            }
        }
    }

    /// Every proxy back to passing, every paused node resumed, every dead
    /// node started again.
    pub async fn heal(&mut self) -> anyhow::Result<()> {
        for p in &self.raft_proxies {
            p.heal();
        }
        if let Some(p) = &self.db_proxy {
            p.heal();
        }
        for i in 0..self.nodes.len() {
            if self.nodes[i].paused {
                self.pause(i, false).await;
            }
            if !self.nodes[i].running() && !self.nodes[i].retired {
                self.spawn(i).await?;
            }
        }
        Ok(())
    }

    /// Base URLs of nodes that run and are not frozen.
    pub fn live_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.running() && !n.paused)
            .map(NodeProc::url)
            .collect()
    }

    /// Every node's base URL, but those retired.
    pub fn all_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| !n.retired)
            .map(NodeProc::url)
            .collect()
    }

    /// Stops everything; the directory is kept when `keep`.
    pub async fn teardown(mut self, keep: bool) {
        for i in 0..self.nodes.len() {
            self.kill(i).await;
        }
        for p in &self.raft_proxies {
            p.stop();
        }
        if let Some(p) = &self.db_proxy {
            p.stop();
        }
        if !keep {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

async fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .await;
}

/// The loopback address node `id` sends its webhooks from when the node has
/// `--webhook-source-ip`: `127.0.1.<id>` (Linux routes all of 127.0.0.0/8
/// to loopback, so the receiver on 127.0.0.1 sees it as the peer).
pub fn source_ip(id: u64) -> std::net::Ipv4Addr {
    std::net::Ipv4Addr::new(127, 0, 1, u8::try_from(id).expect("node ids up to 255"))
}

/// The node id of a webhook request's peer address (see [`source_ip`]).
pub fn sender_of(peer: SocketAddr) -> Option<String> {
    match peer.ip() {
        std::net::IpAddr::V4(v4) if v4.octets()[..3] == [127, 0, 1] && v4.octets()[3] > 0 => {
            Some(v4.octets()[3].to_string())
        }
        _ => None,
    }
}

/// A port that was free a moment ago.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The last `n` lines of a log file, each indented, or a note that it
/// cannot be read.
fn log_tail(path: &Path, n: usize) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(n)..]
                .iter()
                .map(|l| format!("    | {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
        Err(e) => format!("    (cannot read it: {e})"),
    }
}
