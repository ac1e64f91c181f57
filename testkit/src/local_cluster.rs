//! A cluster of `lanebus node` child processes on this machine: what
//! `lanebus demo` runs and what the cluster tests drive (kill, pause,
//! restart), plus the checks both make on what they see.
//!
//! ```text
//!  LocalCluster ── spawn(id, Bootstrap | Join(url) | Restart) ──▶ lanebus node --id N ...
//!       │             (own data dir under `dir`, free ports, log in dir/node-N.log)
//!       ├─ kill (SIGKILL), signal (SIGSTOP/SIGCONT/SIGTERM)
//!       └─ lanes(id) / cluster(id): GET /admin/lanes, /admin/cluster
//! ```
//!
//! Pure checks: [`balance`] (every lane active with a live owner, counts
//! within one) and [`repeats`] (every delivery accepted more than once is
//! explained by an event: first accepted before it, again after it, at most
//! one such repeat per (handler, key), as docs/design.md invariant 3 allows).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde::Deserialize;

use crate::invariants::{self, Cause, Causes, Earlier, Model};
use crate::receiver::Received;

/// How a node process starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Start {
    /// `--bootstrap`: a new cluster.
    Bootstrap,
    /// `--join URL`.
    Join(String),
    /// Neither: restart from the data dir.
    Restart,
}

/// One lane of `GET /admin/lanes`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ApiLane {
    /// Lane number.
    pub lane: u16,
    /// Owner node id.
    pub owner: Option<String>,
    /// Epoch.
    pub epoch: i64,
    /// `active`, `releasing`, `unassigned`.
    pub state: String,
    /// Store backlog.
    pub backlog: i64,
}

#[derive(Deserialize)]
struct LaneList {
    lanes: Vec<ApiLane>,
}

/// A node process of the cluster.
#[derive(Debug)]
pub struct ChildNode {
    /// Node id.
    pub id: u64,
    /// HTTP API address.
    pub http: SocketAddr,
    /// Raft address.
    pub raft: SocketAddr,
    /// Data dir.
    pub data_dir: PathBuf,
    /// The running process, if any.
    pub child: Option<Child>,
    /// Starts so far (names the log file).
    pub lives: u32,
}

/// Child processes of `lanebus node` sharing one store. Dropping it kills
/// every process still running.
#[derive(Debug)]
pub struct LocalCluster {
    bin: PathBuf,
    dir: PathBuf,
    store: String,
    args: Vec<String>,
    /// Nodes by id.
    pub nodes: BTreeMap<u64, ChildNode>,
    http: reqwest::Client,
}

/// `lanebus node` flags of a 3 s lease renewed every 500 ms with a 1 s
/// margin (a failover takes lease + margin plus a renewal tick, about
/// 4.5 s): room for a 2 s handler timeout inside the lease on a loaded
/// machine. The demo and the cluster tests add their own retry and poll
/// flags ([`with_lease_3s`]).
pub const LEASE_3S: [&str; 6] = [
    "--lease-ms",
    "3000",
    "--renew-interval-ms",
    "500",
    "--lease-margin-ms",
    "1000",
];

/// [`LEASE_3S`] followed by `more` flags.
pub fn with_lease_3s(more: &[&'static str]) -> Vec<&'static str> {
    [LEASE_3S.as_slice(), more].concat()
}

/// A free local TCP port, bound then released, so the child node can bind
/// it.
///
/// Chosen at random below Linux's default ephemeral range (32768-60999):
/// a port the kernel hands out for `bind(0)` or for an outgoing connection
/// of any concurrently running test could be taken again before the child
/// binds it ("address already in use", seen with parallel tests); a random
/// port in 20000-32767 is only ever taken by another caller of this
/// function, and rarely. Falls back to `bind(0)` if none is free.
///
/// # Errors
/// If no port can be bound.
pub fn free_port() -> std::io::Result<SocketAddr> {
    for _ in 0..64 {
        let port: u16 = rand::random_range(20_000..32_768);
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr();
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()
}

impl LocalCluster {
    /// A cluster of `bin` (the `lanebus` binary) nodes with data dirs under
    /// `dir`, on `store`, each started with the extra `args` (lease flags,
    /// tuning).
    pub fn new(
        bin: impl Into<PathBuf>,
        dir: impl Into<PathBuf>,
        store: &str,
        args: &[&str],
    ) -> Self {
        // reqwest is built without a rustls provider (as in the workspace):
        // install ring's, unless something installed one already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        LocalCluster {
            bin: bin.into(),
            dir: dir.into(),
            store: store.to_string(),
            args: args.iter().map(|s| s.to_string()).collect(),
            nodes: BTreeMap::new(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("http client"),
        }
    }

    /// The directory holding the data dirs and logs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `http://IP:PORT` of node `id`.
    ///
    /// # Panics
    /// For an id never spawned.
    pub fn url(&self, id: u64) -> String {
        format!("http://{}", self.nodes[&id].http)
    }

    /// Starts node `id` (new ports and data dir at its first start, the same
    /// ones at a restart).
    ///
    /// # Errors
    /// If the process cannot be spawned or a port found.
    pub fn spawn(&mut self, id: u64, start: Start) -> anyhow::Result<()> {
        if !self.nodes.contains_key(&id) {
            let node = ChildNode {
                id,
                http: free_port()?,
                raft: free_port()?,
                data_dir: self.dir.join(format!("node-{id}")),
                child: None,
                lives: 0,
            };
            self.nodes.insert(id, node);
        }
        let node = self.nodes.get_mut(&id).expect("inserted");
        node.lives += 1;
        let log = std::fs::File::create(self.dir.join(format!("node-{id}.{}.log", node.lives)))?;
        let mut cmd = Command::new(&self.bin);
        cmd.arg("node")
            .args(["--id", &id.to_string()])
            .args(["--http-addr", &node.http.to_string()])
            .args(["--raft-addr", &node.raft.to_string()])
            .arg("--data-dir")
            .arg(&node.data_dir)
            .args(["--store", &self.store])
            .args(&self.args);
        // Each node sends webhooks from its own loopback address, so a
        // receiver tells the nodes apart (`Received::sender`).
        if !self.args.iter().any(|a| a == "--webhook-source-ip") && id < 255 {
            cmd.args(["--webhook-source-ip", &format!("127.0.0.{}", id + 1)]);
        }
        match &start {
            Start::Bootstrap => {
                cmd.arg("--bootstrap");
            }
            Start::Join(url) => {
                cmd.args(["--join", url]);
            }
            Start::Restart => {}
        }
        for (k, _) in std::env::vars() {
            if k.starts_with("LANEBUS_") && k != "LANEBUS_LOG" {
                cmd.env_remove(k);
            }
        }
        // The receivers of local clusters listen on loopback, which the SSRF
        // guard refuses by default (a --webhook-allow-cidrs in `args` wins).
        cmd.env("LANEBUS_WEBHOOK_ALLOW_CIDRS", LOOPBACK_CIDRS);
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", self.bin.display()))?;
        node.child = Some(child);
        Ok(())
    }

    /// Process id of node `id`, if running.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.nodes.get(&id)?.child.as_ref().map(Child::id)
    }

    /// SIGKILL to node `id`; waits for it to be gone.
    ///
    /// # Errors
    /// If it cannot be signalled.
    pub fn kill(&mut self, id: u64) -> anyhow::Result<()> {
        if let Some(mut c) = self.nodes.get_mut(&id).and_then(|n| n.child.take()) {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`, `TERM`) to node `id` with kill(1).
    ///
    /// # Errors
    /// If the node is not running or kill(1) fails.
    pub fn signal(&self, id: u64, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid(id).context("node is not running")?;
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()?;
        if !st.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(())
    }

    /// SIGTERM to node `id`, then waits up to `timeout` for it to exit
    /// (SIGKILL after that).
    ///
    /// # Errors
    /// If it cannot be signalled.
    pub fn stop(&mut self, id: u64, timeout: Duration) -> anyhow::Result<()> {
        if self.pid(id).is_none() {
            return Ok(());
        }
        self.signal(id, "TERM")?;
        let deadline = Instant::now() + timeout;
        let node = self.nodes.get_mut(&id).expect("running");
        while Instant::now() < deadline {
            if let Some(c) = node.child.as_mut() {
                if c.try_wait()?.is_some() {
                    node.child = None;
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill(id)
    }

    /// Waits until node `id` answers `GET /readyz` with 200.
    ///
    /// # Errors
    /// If it does not within `timeout`.
    pub async fn wait_ready(&self, id: u64, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        let url = format!("{}/readyz", self.url(id));
        loop {
            if let Ok(r) = self.http.get(&url).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "node {id} not ready after {} ms (log in {})",
                    timeout.as_millis(),
                    self.dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `GET /admin/lanes` of node `id`.
    ///
    /// # Errors
    /// If it does not answer.
    pub async fn lanes(&self, id: u64) -> anyhow::Result<Vec<ApiLane>> {
        let r = self
            .http
            .get(format!("{}/admin/lanes", self.url(id)))
            .send()
            .await?
            .error_for_status()?;
        Ok(r.json::<LaneList>().await?.lanes)
    }

    /// `GET /admin/lanes` of node `id` as JSON.
    ///
    /// # Errors
    /// If it does not answer.
    pub async fn get_json(&self, id: u64, path: &str) -> anyhow::Result<serde_json::Value> {
        let r = self
            .http
            .get(format!("{}{path}", self.url(id)))
            .send()
            .await?
            .error_for_status()?;
        Ok(r.json().await?)
    }

    /// Waits until node `via` shows the lanes balanced over `alive`
    /// ([`balance`]); returns the lane table then.
    ///
    /// # Errors
    /// If that does not happen within `timeout` (naming the last problem).
    pub async fn wait_balanced(
        &self,
        via: u64,
        alive: &[u64],
        timeout: Duration,
    ) -> anyhow::Result<Vec<ApiLane>> {
        let alive: BTreeSet<String> = alive.iter().map(u64::to_string).collect();
        let deadline = Instant::now() + timeout;
        loop {
            let problem = match self.lanes(via).await {
                Ok(lanes) => match balance(&lanes, &alive) {
                    Ok(_) => return Ok(lanes),
                    Err(p) => p,
                },
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                bail!("lanes not balanced over {alive:?} via node {via}: {problem}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for n in self.nodes.values_mut() {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Whether every lane is active with an owner in `alive` and the owners'
/// counts differ by at most one; the count per owner when so.
///
/// # Errors
/// What is not balanced.
pub fn balance(
    lanes: &[ApiLane],
    alive: &BTreeSet<String>,
) -> Result<BTreeMap<String, usize>, String> {
    let mut counts: BTreeMap<String, usize> = alive.iter().map(|a| (a.clone(), 0)).collect();
    for l in lanes {
        let Some(owner) = l.owner.as_ref().filter(|o| alive.contains(*o)) else {
            return Err(format!("lane {} owned by {:?}", l.lane, l.owner));
        };
        if l.state != "active" {
            return Err(format!("lane {} is {}", l.lane, l.state));
        }
        *counts.get_mut(owner).expect("alive") += 1;
    }
    let (min, max) = (
        counts.values().min().copied().unwrap_or(0),
        counts.values().max().copied().unwrap_or(0),
    );
    if max > min + 1 {
        return Err(format!("uneven: {counts:?}"));
    }
    Ok(counts)
}

/// The deliveries accepted more than once, checked against the moments
/// (receiver milliseconds) at which a repeat is allowed (a kill, a pause).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Repeats {
    /// Deliveries accepted more than once.
    pub repeated: usize,
    /// Repeats no event explains, described.
    pub unexplained: Vec<String>,
}

/// How long after a fault a request the faulted node had already written
/// may still arrive at the receiver (socket buffers, the receiver's own
/// scheduling on a loaded machine), in milliseconds: a first arrival up to
/// this long after the fault still counts as in flight at the fault.
pub const IN_AIR_MS: f64 = 250.0;

/// The allowlist local clusters give their nodes
/// (`LANEBUS_WEBHOOK_ALLOW_CIDRS`): loopback, where their receivers listen.
pub const LOOPBACK_CIDRS: &str = "127.0.0.0/8,::1/128";

/// Classifies repeats with the one invariant checker
/// ([`invariants::repeats`] over the accepted requests): a delivery may be
/// accepted again only if its previous acceptance came before one of
/// `events_ms` (or within [`IN_AIR_MS`] after it) and the repeat after it,
/// and each (handler, key) has at most one such repeat per event (only its
/// in-flight delivery can be cut); or if the repeat carries a lower
/// `lanebus-epoch` than the previous acceptance (a deposed owner's late
/// request, sent by a process that was paused between its lease check and
/// the send).
pub fn repeats(log: &[Received], events_ms: &[f64]) -> Repeats {
    let accepted: Vec<&Received> = log.iter().filter(|r| r.accepted()).collect();
    let model = Model {
        expected: Vec::new(),
        observed: accepted
            .iter()
            .map(|r| crate::receiver::hand_over(r))
            .collect(),
        earlier: Earlier::Observed,
    };
    // Every repeat comes back unattributed; each is then explained here, once.
    let found = invariants::repeats(&model, &NoCause);
    let mut out = Repeats {
        repeated: found.unattributed.len(),
        unexplained: Vec::new(),
    };
    let mut per_slot: HashMap<(&str, &str, usize), u32> = HashMap::new();
    for x in &found.unattributed {
        let (prev, r) = (accepted[x.prev], accepted[x.q]);
        if matches!((epoch(prev), epoch(r)), (Some(a), Some(b)) if b < a) {
            continue; // a deposed owner's late request
        }
        let cut = events_ms
            .iter()
            .position(|&e| prev.arrived_ms < e + IN_AIR_MS && r.arrived_ms > e);
        let Some(i) = cut else {
            out.unexplained.push(format!(
                "{} {} accepted with no event in between: {} then {}",
                r.handler,
                r.event_id,
                describe(prev),
                describe(r)
            ));
            continue;
        };
        // At most one repeat per (handler, key) across each event.
        let Some(key) = r.key.as_deref() else {
            continue;
        };
        let n = per_slot.entry((&r.handler, key, i)).or_default();
        *n += 1;
        if *n == 2 {
            out.unexplained.push(format!(
                "{} key {key:?}: more than one repeat across the same event",
                r.handler
            ));
        }
    }
    out
}

/// Attributes nothing: [`repeats`] explains each repeat itself.
struct NoCause;

impl Causes for NoCause {
    fn repeat(&self, _: &Model, _: &invariants::Repeat) -> Option<Cause> {
        None
    }

    fn rewind(&self, _: &Model, _: &invariants::Repeat) -> bool {
        false
    }
}

fn epoch(r: &Received) -> Option<i64> {
    r.headers.get("lanebus-epoch")?.parse().ok()
}

/// One request of a repeat, as the failure message shows it.
fn describe(r: &Received) -> String {
    format!(
        "attempt {} at epoch {:?} from {} arrived {:.0} ms, answered {:.0} ms",
        r.attempt,
        epoch(r),
        r.sender.as_deref().unwrap_or("?"),
        r.arrived_ms,
        r.answered_ms
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(lane: u16, owner: &str, state: &str) -> ApiLane {
        ApiLane {
            lane,
            owner: Some(owner.into()),
            epoch: 1,
            state: state.into(),
            backlog: 0,
        }
    }

    #[test]
    fn balance_wants_live_active_owners_within_one() {
        let alive: BTreeSet<String> = ["1", "2"].iter().map(|s| s.to_string()).collect();
        let ok = vec![
            lane(0, "1", "active"),
            lane(1, "2", "active"),
            lane(2, "1", "active"),
        ];
        assert_eq!(balance(&ok, &alive).unwrap()["1"], 2);
        let dead = vec![lane(0, "3", "active")];
        assert!(balance(&dead, &alive).unwrap_err().contains("lane 0"));
        let moving = vec![lane(0, "1", "releasing"), lane(1, "2", "active")];
        assert!(balance(&moving, &alive).unwrap_err().contains("releasing"));
        let uneven = vec![lane(0, "1", "active"), lane(1, "1", "active")];
        assert!(balance(&uneven, &alive).unwrap_err().contains("uneven"));
    }

    fn rx(handler: &str, id: &str, key: &str, at: f64) -> Received {
        Received {
            sender: None,
            handler: handler.into(),
            event_id: id.into(),
            key: Some(key.into()),
            sequence: None,
            attempt: 1,
            arrived_ms: at,
            answered_ms: at,
            status: 200,
            signature_ok: Some(true),
            body: String::new(),
            headers: BTreeMap::new(),
        }
    }

    #[test]
    fn repeats_need_an_event_in_between_and_one_per_key() {
        let log = vec![
            rx("a", "e1", "k", 10.0),
            rx("a", "e1", "k", 30.0),
            rx("a", "e2", "j", 11.0),
        ];
        let r = repeats(&log, &[20.0]);
        assert_eq!((r.repeated, r.unexplained.len()), (1, 0), "{r:?}");
        let r = repeats(&log, &[40.0]);
        assert_eq!(r.unexplained.len(), 1, "{r:?}");
        let two = vec![
            rx("a", "e1", "k", 10.0),
            rx("a", "e1", "k", 30.0),
            rx("a", "e2", "k", 12.0),
            rx("a", "e2", "k", 31.0),
        ];
        assert_eq!(repeats(&two, &[20.0]).unexplained.len(), 1);
    }

    #[test]
    fn a_late_request_of_a_lower_epoch_is_a_deposed_owners() {
        let at = |t: f64, epoch: &str| {
            let mut r = rx("a", "e1", "k", t);
            r.headers.insert("lanebus-epoch".into(), epoch.into());
            r
        };
        let deposed = vec![at(10.0, "5"), at(30.0, "4")];
        assert_eq!(repeats(&deposed, &[]).unexplained.len(), 0);
        let same = vec![at(10.0, "5"), at(30.0, "5")];
        assert_eq!(repeats(&same, &[]).unexplained.len(), 1, "same owner twice");
        let newer = vec![at(10.0, "4"), at(30.0, "5")];
        assert_eq!(repeats(&newer, &[]).unexplained.len(), 1, "needs an event");
        assert_eq!(repeats(&newer, &[20.0]).unexplained.len(), 0);
    }
}
