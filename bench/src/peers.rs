//! Peers side by side on the harness's PostgreSQL (docs/design.md section 10):
//! graphile-worker 0.17 and pg-boss 10, each at its documented best for
//! this machine and at its defaults, installed with `npm install` into
//! `bench/peers/node_modules` and driven by `bench/peers/driver.mjs`
//! (enqueue one job per call from 8 callers, then 100 per call, then the
//! drain, then the load of our mixed cells at each of [`mixed_rates`]);
//! pgbench running the minimal insert-then-delete work per item
//! (100 rows per statement) as the raw ceiling; and pgbench floors of
//! single-row commit transactions (1, 8, 32 clients, with and without
//! `pg_notify`), the floor of a one-event publish. Each peer gets its own
//! database; the counters are read around the drain only (snapshots as for
//! our cells; the floors: around the run).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use sqlx::{Connection as _, PgConnection};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

use crate::cells::{self, Kind};
use crate::pg;
use crate::sample::Latency;

/// One peer's measurement.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerResult {
    /// Peer name.
    pub name: String,
    /// Jobs (items for pgbench).
    pub jobs: u64,
    /// Jobs enqueued per second (100 per call).
    pub enqueue_rate: Option<f64>,
    /// Jobs enqueued per second one per call by 8 concurrent callers (for
    /// the pgbench floors: single-row commits per second).
    #[serde(default)]
    pub enqueue_one_rate: Option<f64>,
    /// Jobs drained per second by no-op handlers.
    pub drain_rate: Option<f64>,
    /// Counters per job over the drain (see [`pg::per_unit`]).
    pub counters: BTreeMap<String, f64>,
    /// Under the mixed load of our `pg-mixed-*` cells, one per offered rate.
    #[serde(default)]
    pub mixed: Vec<PeerMixed>,
    /// Settings or what went wrong.
    pub note: String,
}

/// A peer under the mixed load of our `pg-mixed-*` cells: its workers
/// running, 32 callers enqueue one job per call at `offered` jobs/s in all
/// for a 2 s warm-up and an 8 s window (`bench/peers/driver.mjs`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PeerMixed {
    /// Jobs per second offered.
    pub offered: u64,
    /// Jobs whose enqueue returned in the window, per second.
    pub accepted_rate: f64,
    /// From an enqueue call's return to its handler's start, milliseconds.
    pub latency: Latency,
}

/// The offered rates of our mixed cells (`pg-mixed-*` of [`cells::full`]),
/// ascending, each once.
pub fn mixed_rates() -> Vec<u64> {
    let rates: std::collections::BTreeSet<u64> = cells::full()
        .iter()
        .filter(|c| c.kind == Kind::Mixed && c.store == "postgres")
        .map(|c| c.rate)
        .collect();
    rates.into_iter().collect()
}

/// `node driver.mjs ARGS` in `dir`, its output piped.
fn driver(dir: &Path, args: &[&str], stdin: Stdio) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("node");
    c.arg(dir.join("driver.mjs"))
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

impl PeerResult {
    /// A peer that could not be measured.
    pub fn failed(name: &str, why: &str) -> Self {
        PeerResult {
            name: name.into(),
            note: format!("failed: {why}"),
            ..PeerResult::default()
        }
    }
}

async fn fresh_db(server: &pg::Server, name: &str) -> anyhow::Result<(String, PgConnection)> {
    let mut admin = PgConnection::connect(&server.url).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await?;
    let url = pg::with_db(&server.url, name)?;
    let mut c = PgConnection::connect(&url).await?;
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&mut c)
        .await?;
    Ok((url, c))
}

async fn drop_db(server: &pg::Server, name: &str) {
    if let Ok(mut admin) = PgConnection::connect(&server.url).await {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
    }
}

/// Jobs given to graphile-worker's defaults and pg-boss at best at most:
/// their drains (about 200 jobs a second here for pg-boss with one worker)
/// would not finish the full set's 100,000 in 300 s; the counters are per
/// job either way.
const PG_BOSS_MAX_JOBS: usize = 20_000;

/// Installs the peers (once) and runs each; a peer that fails is reported
/// as failed, the others still run.
///
/// # Errors
/// If npm cannot install the peers.
pub async fn run_all(
    repo: &Path,
    server: &pg::Server,
    jobs: usize,
) -> anyhow::Result<Vec<PeerResult>> {
    let dir = repo.join("bench/peers");
    let mut out = Vec::new();
    if !dir.join("node_modules/graphile-worker").exists()
        || !dir.join("node_modules/pg-boss").exists()
    {
        eprintln!("installing peers with npm (graphile-worker 0.17, pg-boss 10)...");
        let st = tokio::process::Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--silent"])
            .current_dir(&dir)
            .status()
            .await?;
        if !st.success() {
            bail!("npm install in {} failed", dir.display());
        }
    }
    let pm = pg::postmaster_pid(&server.dir);
    for (peer, note) in [
        (
            "graphile-best",
            "graphile-worker 0.17 at its best here: concurrency 24, completeJobBatchDelay 0, localQueue 500",
        ),
        (
            "graphile-defaults",
            "graphile-worker 0.17, its defaults (concurrency 1, poll 2 s, LISTEN/NOTIFY)",
        ),
        (
            "pg-boss-best",
            "pg-boss 10 at its best here: 24 workers, batchSize 100, polling 0.5 s",
        ),
        (
            "pg-boss-defaults",
            "pg-boss 10, its defaults (one worker, batchSize 1, polling 2 s)",
        ),
    ] {
        let cap = match peer {
            "graphile-best" => jobs,
            // One job per 2 s poll: 50 jobs take about 100 s.
            "pg-boss-defaults" => 50,
            _ => PG_BOSS_MAX_JOBS,
        };
        let jobs = jobs.min(cap);
        let capped = jobs == cap && peer != "graphile-best";
        eprintln!("peer {peer}: {jobs} jobs");
        let r = tokio::time::timeout(
            Duration::from_secs(300),
            run_js(&dir, server, pm, peer, jobs),
        )
        .await;
        let mut r = match r {
            Ok(Ok(mut r)) => {
                r.note = if capped {
                    format!("{note}; {jobs} jobs (its drain would not finish more in the 300 s a peer is given)")
                } else {
                    note.into()
                };
                r
            }
            Ok(Err(e)) => PeerResult::failed(peer, &format!("{e:#}")),
            Err(_) => PeerResult::failed(peer, "timed out after 300 s"),
        };
        drop_db(server, &format!("peer_{}", peer.replace('-', "_"))).await;
        // pg-boss's defaults take one job per 2 s poll: no mixed load.
        if peer != "pg-boss-defaults" {
            for rate in mixed_rates() {
                eprintln!("peer {peer}: mixed at {rate}/s");
                match run_mixed(&dir, server, peer, rate).await {
                    Ok(m) => r.mixed.push(m),
                    Err(e) => r.note.push_str(&format!("; mixed at {rate}/s failed: {e:#}")),
                }
                drop_db(server, &format!("peer_{}_mixed", peer.replace('-', "_"))).await;
            }
        }
        out.push(r);
    }
    eprintln!("pgbench ceiling");
    out.push(match pgbench(server, pm).await {
        Ok(r) => r,
        Err(e) => PeerResult::failed("pgbench", &format!("{e:#}")),
    });
    drop_db(server, "peer_pgbench").await;
    for clients in [1, 8, 32] {
        for notify in [false, true] {
            let name = format!(
                "pgbench-commit-c{clients}{}",
                if notify { "-notify" } else { "" }
            );
            eprintln!("{name} floor");
            out.push(match commit_floor(server, pm, clients, notify).await {
                Ok(mut r) => {
                    r.name = name;
                    r
                }
                Err(e) => PeerResult::failed(&name, &format!("{e:#}")),
            });
            drop_db(server, "peer_pgbench_commit").await;
        }
    }
    Ok(out)
}

/// Transactions processed and tps from pgbench's output.
fn pgbench_counts(text: &str) -> anyhow::Result<(f64, f64)> {
    let tx: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("number of transactions actually processed: "))
        .and_then(|v| v.split(['/', ' ']).next())
        .and_then(|v| v.parse().ok())
        .context("pgbench output without a transaction count")?;
    let tps: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("pgbench output without tps")?;
    Ok((tx, tps))
}

async fn run_js(
    dir: &Path,
    server: &pg::Server,
    pm: Option<u32>,
    peer: &str,
    jobs: usize,
) -> anyhow::Result<PeerResult> {
    let db = format!("peer_{}", peer.replace('-', "_"));
    let (url, mut probe) = fresh_db(server, &db).await?;
    let mut child = driver(dir, &[peer, &url, &jobs.to_string()], Stdio::piped())
        .spawn()
        .context("starting node")?;
    let pid = child.id().context("node pid")?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let mut stderr = child.stderr.take().context("stderr")?;
    let enq = async {
        let one = read_line(&mut lines, "ONE ").await?;
        Ok::<_, anyhow::Error>((one, read_line(&mut lines, "ENQUEUED ").await?))
    }
    .await;
    let (one, enq) = match enq {
        Ok(v) => v,
        Err(e) => {
            let mut err = String::new();
            let _ = tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut err).await;
            bail!(
                "{e}: {}",
                err.lines().take(8).collect::<Vec<_>>().join(" | ")
            );
        }
    };
    // The enqueue's backends may still hold unflushed table and WAL
    // statistics: an idle backend that flushed less than a second ago
    // flushes again after PGSTAT_IDLE_INTERVAL (10 s, PostgreSQL 15
    // pgstat.c). Wait that long, so the enqueue does not leak into the
    // drain's counters.
    tokio::time::sleep(Duration::from_secs(11)).await;
    sqlx::query("CHECKPOINT").execute(&mut probe).await?;
    pg::reset(&mut probe).await?;
    let s0 = pg::snapshot(&mut probe, pm, pg::tree_cpu(pid)).await?;
    stdin.write_all(b"GO\n").await?;
    stdin.flush().await?;
    let drained = read_line(&mut lines, "DRAINED ").await?;
    // CPU at the end of the drain; database counters once the driver has
    // exited and its backends have flushed their statistics at exit.
    let s1 = pg::snapshot(&mut probe, pm, pg::tree_cpu(pid)).await?;
    drop(stdin);
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    let _ = child.start_kill();
    pg::wait_alone(&mut probe).await?;
    let s2 = pg::snapshot(&mut probe, pm, s1.app_cpu).await?;
    let mut end = s2;
    end.db_cpu = s1.db_cpu;
    Ok(PeerResult {
        name: peer.into(),
        jobs: jobs as u64,
        enqueue_rate: Some(enq.0 / enq.1),
        enqueue_one_rate: Some(one.0 / one.1),
        drain_rate: Some(drained.0 / drained.1),
        counters: pg::per_unit(&s0, &end, drained.0 as u64),
        note: String::new(),
        mixed: Vec::new(),
    })
}

/// Runs `peer` under the mixed load at `rate` jobs/s (see [`PeerMixed`]) in
/// a fresh database; at most 60 s.
async fn run_mixed(
    dir: &Path,
    server: &pg::Server,
    peer: &str,
    rate: u64,
) -> anyhow::Result<PeerMixed> {
    let db = format!("peer_{}_mixed", peer.replace('-', "_"));
    let (url, _probe) = fresh_db(server, &db).await?;
    let child = driver(dir, &[peer, &url, "0", &rate.to_string()], Stdio::null())
        .spawn()
        .context("starting node")?;
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .context("no answer within 60 s")??;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("MIXED "))
        .with_context(|| {
            let err = String::from_utf8_lossy(&out.stderr);
            format!(
                "driver printed no MIXED line: {}",
                err.lines().take(8).collect::<Vec<_>>().join(" | ")
            )
        })?;
    parse_mixed(rate, line)
}

/// Parses the driver's "<accepted> <window s> <p50> <p99> <max> <count>".
fn parse_mixed(offered: u64, line: &str) -> anyhow::Result<PeerMixed> {
    let v: Vec<f64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad MIXED line {line:?}"))?;
    let [accepted, window, p50, p99, max, count] = v[..] else {
        bail!("MIXED line {line:?} has {} fields, not 6", v.len());
    };
    if !(window > 0.0 && count >= 1.0) {
        bail!("MIXED line {line:?} measured nothing");
    }
    Ok(PeerMixed {
        offered,
        accepted_rate: accepted / window,
        latency: Latency {
            p50,
            p99,
            max,
            count: count as u64,
        },
    })
}

/// Reads lines until one starts with `want`; parses "<count> <seconds>".
async fn read_line(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    want: &str,
) -> anyhow::Result<(f64, f64)> {
    while let Some(l) = lines.next_line().await? {
        if let Some(rest) = l.strip_prefix(want) {
            let mut it = rest.split_whitespace();
            let n: f64 = it.next().context("count")?.parse()?;
            let s: f64 = it.next().context("seconds")?.parse()?;
            return Ok((n, s));
        }
    }
    bail!("driver ended before {want}")
}

/// Runs `script` under pgbench (`clients` connections, `threads` threads,
/// 10 s) on a fresh database `db` holding the table `q (id bigserial,
/// payload text)`; returns pgbench's transactions and tps, and the counters
/// around the run per `per_tx` units of each transaction.
async fn run_pgbench(
    server: &pg::Server,
    pm: Option<u32>,
    db: &str,
    script: &str,
    (clients, threads): (usize, usize),
    per_tx: f64,
) -> anyhow::Result<(f64, f64, BTreeMap<String, f64>)> {
    let (url, mut probe) = fresh_db(server, db).await?;
    sqlx::query("CREATE TABLE q (id bigserial PRIMARY KEY, payload text NOT NULL)")
        .execute(&mut probe)
        .await?;
    let file = std::env::temp_dir().join(format!("lanebus-bench-{db}-{}.sql", std::process::id()));
    std::fs::write(&file, script)?;
    sqlx::query("CHECKPOINT").execute(&mut probe).await?;
    pg::reset(&mut probe).await?;
    let s0 = pg::snapshot(&mut probe, pm, 0.0).await?;
    let (c, j) = (clients.to_string(), threads.to_string());
    let out = tokio::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-c", &c, "-j", &j, "-T", "10", "-f"])
        .arg(&file)
        .arg(&url)
        .output()
        .await?;
    pg::wait_alone(&mut probe).await?;
    let s1 = pg::snapshot(&mut probe, pm, 0.0).await?;
    let _ = std::fs::remove_file(&file);
    if !out.status.success() {
        bail!("pgbench: {}", String::from_utf8_lossy(&out.stderr));
    }
    let (tx, tps) = pgbench_counts(&String::from_utf8_lossy(&out.stdout))?;
    let mut counters = pg::per_unit(&s0, &s1, (tx * per_tx) as u64);
    counters.remove("cpu_app_ms");
    Ok((tx, tps, counters))
}

async fn pgbench(server: &pg::Server, pm: Option<u32>) -> anyhow::Result<PeerResult> {
    let (tx, tps, counters) = run_pgbench(
        server,
        pm,
        "peer_pgbench",
        "INSERT INTO q (payload) SELECT repeat('x', 200) FROM generate_series(1, 100);\n\
         DELETE FROM q WHERE id IN (SELECT id FROM q ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED);\n",
        (2, 2),
        100.0,
    )
    .await?;
    Ok(PeerResult {
        name: "pgbench".into(),
        jobs: (tx * 100.0) as u64,
        enqueue_rate: None,
        enqueue_one_rate: None,
        drain_rate: Some(tps * 100.0),
        counters,
        note: "pgbench -c 2 -T 10: INSERT 100 rows, then DELETE the 100 oldest (one statement each); rate = items inserted and deleted per second".into(),
        mixed: Vec::new(),
    })
}

/// The small-write floor: pgbench transactions of one single-row insert of
/// about 200 bytes (with `pg_notify` in each when `notify`), `clients`
/// connections, 10 s; `enqueue_one_rate` is its transactions per second,
/// counters are per transaction.
async fn commit_floor(
    server: &pg::Server,
    pm: Option<u32>,
    clients: usize,
    notify: bool,
) -> anyhow::Result<PeerResult> {
    let mut sql = String::from("BEGIN;\nINSERT INTO q (payload) VALUES (repeat('x', 200));\n");
    if notify {
        sql.push_str("SELECT pg_notify('floor', '');\n");
    }
    sql.push_str("COMMIT;\n");
    let (tx, tps, counters) = run_pgbench(
        server,
        pm,
        "peer_pgbench_commit",
        &sql,
        (clients, clients.min(4)),
        1.0,
    )
    .await?;
    Ok(PeerResult {
        name: String::new(),
        jobs: tx as u64,
        enqueue_rate: None,
        enqueue_one_rate: Some(tps),
        drain_rate: None,
        counters,
        note: format!(
            "pgbench -c {clients} -T 10: BEGIN; one single-row INSERT{}; COMMIT (the floor of a one-event publish)",
            if notify { "; pg_notify" } else { "" }
        ),
        mixed: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mixed_rates_are_those_of_the_mixed_cells() {
        assert_eq!(mixed_rates(), vec![1000, 5000]);
    }

    #[test]
    fn a_mixed_line_gives_rates_and_latency() {
        let m = parse_mixed(1000, "7996 8 3.1 9.75 40.2 9990").unwrap();
        assert_eq!(m.offered, 1000);
        assert!((m.accepted_rate - 999.5).abs() < 1e-9);
        assert_eq!(
            (m.latency.p50, m.latency.p99, m.latency.max, m.latency.count),
            (3.1, 9.75, 40.2, 9990)
        );
    }

    #[test]
    fn a_short_or_empty_mixed_line_is_refused() {
        assert!(parse_mixed(1000, "7996 8 3.1 9.75 40.2").is_err());
        assert!(parse_mixed(1000, "0 8 NaN NaN undefined 0").is_err());
        assert!(parse_mixed(1000, "0 8 1 1 1 0").is_err());
    }
}
