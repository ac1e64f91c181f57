//! MongoDB cells: the throwaway MongoDB-compatible server a sample runs on,
//! and its counters.
//!
//! Real `mongod` cannot be installed on the machines this harness runs on,
//! so the server is SecantusDB (`secantusd-py`, a MongoDB-compatible test
//! server in Python, the one `scripts/test` uses): every figure of a
//! `mongo-*` cell is of that server, not of MongoDB. Each sample starts its
//! own server (`--storage-path :memory:`, a free loopback port, replica set
//! `secantus`) and kills it at the end, so every sample starts from an
//! empty server and an empty oplog.
//!
//! Counters, differenced between two snapshots (nothing can be reset on the
//! server):
//! - `mongo.op.insert|query|update|delete|getmore|command`: `serverStatus`
//!   `opcounters` (SecantusDB counts one per command: an `insert` of 100
//!   documents is 1, where MongoDB counts 100), less the harness's own
//!   probe commands (measured once per sample: two snapshots back to back);
//! - `mongo.requests`: `serverStatus` `network.numRequests` (wire messages
//!   received), less the probe's;
//! - `mongo.oplog_bytes`, `mongo.oplog_entries`: BSON size and number of
//!   the `local.oplog.rs` entries whose `ts` lies between the two
//!   snapshots' `operationTime` (SecantusDB logs one entry per document
//!   written, also inside a transaction, where MongoDB writes one
//!   `applyOps` entry per transaction).
//!
//! A counter the server does not report is left out and named in the
//! sample's `unavailable` list ("not available on this server" in the
//! report); nothing is estimated.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use mongodb::bson::{doc, Bson, Document, RawDocumentBuf, Timestamp};
use mongodb::Client;

/// Environment variable naming the SecantusDB server command.
pub const SECANTUS_ENV: &str = "LANEBUS_BENCH_SECANTUS";

/// Lanes of a MongoDB sample's store (instead of the default 256), as the
/// node tests use on this server (`node/tests/common`,
/// `MONGODB_TEST_LANES`): a claim's `$unionWith` sub-pipeline costs about
/// a scan of `deliveries` on SecantusDB, so a claim grows with the lanes
/// claimed together.
pub const LANES: u16 = 16;

/// The `opcounters` fields read, in the order of [`OPS`] counters.
const OPS: [&str; 6] = ["insert", "query", "update", "delete", "getmore", "command"];

/// The server command: `flag` (`--mongod-cmd`), else
/// `$LANEBUS_BENCH_SECANTUS`, else the first `.venv/bin/secantusd-py` that
/// exists under `roots` (the repository, then its main worktree: a git
/// worktree has no `.venv` of its own). `None`: the MongoDB cells cannot
/// run.
pub fn find_command(flag: Option<&Path>, roots: &[PathBuf]) -> Option<PathBuf> {
    if let Some(p) = flag {
        return Some(p.to_owned());
    }
    if let Some(p) = std::env::var_os(SECANTUS_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    roots
        .iter()
        .map(|r| r.join(".venv/bin/secantusd-py"))
        .find(|p| p.exists())
}

/// A throwaway SecantusDB of one sample; killed on drop.
#[derive(Debug)]
pub struct Server {
    child: Child,
    /// `mongodb://127.0.0.1:PORT/?replicaSet=secantus`.
    pub url: String,
    /// Its process id (CPU times from `/proc`).
    pub pid: u32,
}

impl Server {
    /// Starts `cmd --host 127.0.0.1 --port PORT --storage-path :memory:`
    /// on a free port, its output to `log`, and waits (up to 30 s) until
    /// it answers `hello` as a replica-set member.
    ///
    /// # Errors
    /// The command cannot be run, exits, or does not answer in time.
    pub async fn start(cmd: &Path, log: &Path) -> anyhow::Result<Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        if let Some(d) = log.parent() {
            std::fs::create_dir_all(d)?;
        }
        let out = std::fs::File::create(log)?;
        let child = Command::new(cmd)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--storage-path", ":memory:"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone()?))
            .stderr(Stdio::from(out))
            .spawn()
            .with_context(|| format!("starting the MongoDB test server {}", cmd.display()))?;
        let pid = child.id();
        let mut server = Server {
            child,
            url: format!("mongodb://127.0.0.1:{port}/?replicaSet=secantus"),
            pid,
        };
        let t = Instant::now();
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "the MongoDB test server {} exited ({status}); its log: {}",
                    cmd.display(),
                    log.display()
                );
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                let client = Client::with_uri_str(&server.url).await?;
                let hello = client
                    .database("admin")
                    .run_command(doc! { "hello": 1 })
                    .await;
                if hello.is_ok_and(|h| h.get_str("setName").is_ok()) {
                    return Ok(server);
                }
            }
            if t.elapsed() > Duration::from_secs(30) {
                bail!(
                    "the MongoDB test server {} did not answer within 30 s; its log: {}",
                    cmd.display(),
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `url` with database `db`.
    pub fn db_url(&self, db: &str) -> String {
        self.url.replacen("/?", &format!("/{db}?"), 1)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Cumulative counters of one snapshot, probe overhead already taken off.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snap {
    /// `mongo.op.*` and `mongo.requests`.
    pub counters: BTreeMap<String, i64>,
    /// `operationTime` of the `serverStatus` answer (the oplog range's end).
    pub op_time: Option<Timestamp>,
    /// Completion documents.
    pub completed: i64,
}

/// The harness's own connection to the sample's server.
pub struct Probe {
    client: Client,
    db: String,
    /// Counters the probe itself adds per snapshot.
    overhead: BTreeMap<String, i64>,
    /// Snapshots taken since the overhead was measured.
    taken: i64,
    /// Counters the server does not report.
    pub unavailable: Vec<String>,
}

impl Probe {
    /// Connects to `url` (the sample's database `db`) and measures what one
    /// snapshot adds to the counters (two snapshots back to back).
    ///
    /// # Errors
    /// The server does not answer `serverStatus`.
    pub async fn open(url: &str, db: &str) -> anyhow::Result<Probe> {
        let client = Client::with_uri_str(url).await?;
        let mut p = Probe {
            client,
            db: db.to_owned(),
            overhead: BTreeMap::new(),
            taken: 0,
            unavailable: Vec::new(),
        };
        let (a, _) = p.raw().await?;
        let (b, _) = p.raw().await?;
        p.overhead = b
            .counters
            .iter()
            .map(|(k, v)| (k.clone(), v - a.counters.get(k).copied().unwrap_or(0)))
            .collect();
        p.taken = 0;
        Ok(p)
    }

    /// One snapshot without the overhead correction; the second value is
    /// the `serverStatus` document's missing fields.
    async fn raw(&mut self) -> anyhow::Result<(Snap, Vec<String>)> {
        let s = self
            .client
            .database("admin")
            .run_command(doc! { "serverStatus": 1 })
            .await?;
        let mut snap = Snap::default();
        let mut missing = Vec::new();
        let num = |d: &Document, k: &str| -> Option<i64> {
            match d.get(k)? {
                Bson::Int32(v) => Some(i64::from(*v)),
                Bson::Int64(v) => Some(*v),
                Bson::Double(v) => Some(*v as i64),
                _ => None,
            }
        };
        let ops = s.get_document("opcounters").ok();
        for k in OPS {
            match ops.and_then(|d| num(d, k)) {
                Some(v) => {
                    snap.counters.insert(format!("mongo.op.{k}"), v);
                }
                None => missing.push(format!("mongo.op.{k}")),
            }
        }
        match s
            .get_document("network")
            .ok()
            .and_then(|d| num(d, "numRequests"))
        {
            Some(v) => {
                snap.counters.insert("mongo.requests".into(), v);
            }
            None => missing.push("mongo.requests".into()),
        }
        snap.op_time = s.get_timestamp("operationTime").ok();
        if snap.op_time.is_none() {
            missing.push("mongo.oplog_bytes".into());
            missing.push("mongo.oplog_entries".into());
        }
        snap.completed = self
            .client
            .database(&self.db)
            .collection::<Document>("completions")
            .estimated_document_count()
            .await
            .map_or(0, |n| n as i64);
        self.taken += 1;
        Ok((snap, missing))
    }

    /// A snapshot: cumulative counters less the probe's own commands of
    /// the snapshots before it.
    ///
    /// # Errors
    /// The server does not answer.
    pub async fn snapshot(&mut self) -> anyhow::Result<Snap> {
        let before = self.taken;
        let (mut s, missing) = self.raw().await?;
        for (k, v) in s.counters.iter_mut() {
            *v -= before * self.overhead.get(k).copied().unwrap_or(0);
        }
        for m in missing {
            if !self.unavailable.contains(&m) {
                self.unavailable.push(m);
            }
        }
        Ok(s)
    }

    /// BSON bytes and number of the oplog entries with `from < ts <= to`.
    ///
    /// # Errors
    /// The oplog cannot be read.
    pub async fn oplog(&self, from: Timestamp, to: Timestamp) -> anyhow::Result<(i64, i64)> {
        let mut cur = self
            .client
            .database("local")
            .collection::<RawDocumentBuf>("oplog.rs")
            .find(doc! { "ts": { "$gt": from, "$lte": to } })
            .await?;
        let (mut bytes, mut n) = (0i64, 0i64);
        while cur.advance().await? {
            bytes += cur.current().as_bytes().len() as i64;
            n += 1;
        }
        Ok((bytes, n))
    }
}

/// The counters of a whole sample: `b − a` of every counter, plus the
/// oplog between the two snapshots; not divided.
///
/// # Errors
/// The oplog cannot be read.
pub async fn whole(probe: &Probe, a: &Snap, b: &Snap) -> anyhow::Result<BTreeMap<String, i64>> {
    let mut m: BTreeMap<String, i64> = b
        .counters
        .iter()
        .map(|(k, v)| (k.clone(), v - a.counters.get(k).copied().unwrap_or(0)))
        .collect();
    if let (Some(from), Some(to)) = (a.op_time, b.op_time) {
        let (bytes, n) = probe.oplog(from, to).await?;
        m.insert("mongo.oplog_bytes".into(), bytes);
        m.insert("mongo.oplog_entries".into(), n);
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_goes_before_the_query() {
        let s = Server {
            child: Command::new("true").spawn().unwrap(),
            url: "mongodb://127.0.0.1:5/?replicaSet=secantus".into(),
            pid: 0,
        };
        assert_eq!(
            s.db_url("bench"),
            "mongodb://127.0.0.1:5/bench?replicaSet=secantus"
        );
    }

    #[test]
    fn the_flag_wins_then_the_environment() {
        let repo = &[PathBuf::from("/nonexistent-repo")];
        assert_eq!(
            find_command(Some(Path::new("/x/secantusd")), repo),
            Some(PathBuf::from("/x/secantusd"))
        );
        if std::env::var_os(SECANTUS_ENV).is_none() {
            assert_eq!(find_command(None, repo), None);
        }
    }
}
