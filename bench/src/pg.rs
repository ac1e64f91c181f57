//! The throwaway PostgreSQL the harness runs everything on, and the exact
//! counters it reads: WAL position and `pg_stat_wal`, `pg_stat_statements`
//! calls of the sample's database, `pg_stat_user_tables` per table, and the
//! CPU time of the PostgreSQL processes and of the sample process from
//! `/proc`.
//!
//! Counters are read as snapshots at the start and the end of the steady
//! window and divided by the units of the window. Table and WAL-record
//! statistics are flushed by each backend at most once a second, so a
//! snapshot lags by up to about a second at both ends alike; WAL bytes come
//! from `pg_current_wal_insert_lsn()` and statement calls from
//! `pg_stat_statements`, which are current.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _};
use serde::{Deserialize, Serialize};
use sqlx::{Connection as _, PgConnection};

/// Settings of the throwaway server, on top of `scripts/pg-start`'s
/// (`fsync = on`, `synchronous_commit = on`, `shared_buffers = 256MB`,
/// `max_connections = 300`, `pg_stat_statements` preloaded). Checkpoints
/// are spaced out like the reference's (`max_wal_size = 4GB`), so that
/// full-page images after a checkpoint land rarely inside a window.
pub const SETTINGS: &[(&str, &str)] = &[
    ("max_wal_size", "4GB"),
    ("checkpoint_timeout", "30min"),
    ("pg_stat_statements.track", "top"),
    ("track_counts", "on"),
    ("log_checkpoints", "on"),
    ("log_autovacuum_min_duration", "0"),
];

/// Settings recorded in env.json.
pub const REPORTED_SETTINGS: &[&str] = &[
    "server_version",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "wal_compression",
    "shared_buffers",
    "max_wal_size",
    "checkpoint_timeout",
    "autovacuum",
    "max_connections",
];

/// A server started by the harness.
#[derive(Debug)]
pub struct Server {
    /// Data directory.
    pub dir: PathBuf,
    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub url: String,
    repo: PathBuf,
}

impl Server {
    /// Starts a fresh server in `dir` (removed first) on `port` with
    /// `scripts/pg-start` of the repository at `repo`, then applies
    /// [`SETTINGS`].
    pub async fn start(repo: &Path, dir: &Path, port: u16) -> anyhow::Result<Server> {
        if dir.join("postmaster.pid").exists() {
            let _ = Command::new(repo.join("scripts/pg-stop")).arg(dir).status();
        }
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let out = Command::new(repo.join("scripts/pg-start"))
            .arg(dir)
            .arg(port.to_string())
            .output()
            .context("running scripts/pg-start")?;
        if !out.status.success() {
            bail!(
                "scripts/pg-start failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let url = String::from_utf8(out.stdout)?.trim().to_owned();
        let mut c = PgConnection::connect(&url).await?;
        for (k, v) in SETTINGS {
            sqlx::query(&format!("ALTER SYSTEM SET {k} = '{v}'"))
                .execute(&mut c)
                .await?;
        }
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut c)
            .await?;
        Ok(Server {
            dir: dir.to_owned(),
            url,
            repo: repo.to_owned(),
        })
    }

    /// The server's settings of [`REPORTED_SETTINGS`].
    pub async fn settings(&self) -> anyhow::Result<BTreeMap<String, String>> {
        let mut c = PgConnection::connect(&self.url).await?;
        let rows: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name = ANY($1)",
        )
        .bind(REPORTED_SETTINGS)
        .fetch_all(&mut c)
        .await?;
        Ok(rows.into_iter().collect())
    }

    /// Stops the server.
    pub fn stop(&self) {
        let _ = Command::new(self.repo.join("scripts/pg-stop"))
            .arg(&self.dir)
            .status();
    }
}

/// `url` with its database part replaced by `db`.
pub fn with_db(url: &str, db: &str) -> anyhow::Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let i = base
        .rfind('/')
        .filter(|i| *i > "postgres://".len())
        .context("postgres url without a database part")?;
    Ok(match query {
        Some(q) => format!("{}/{db}?{q}", &base[..i]),
        None => format!("{}/{db}", &base[..i]),
    })
}

/// Clock ticks per second of `/proc/*/stat` CPU times (`USER_HZ`, 100 on
/// Linux x86_64 and arm64).
pub const CLOCK_TICKS: f64 = 100.0;

/// User + system CPU ticks of process `pid` (`/proc/PID/stat` fields 14 and
/// 15), or of this process for `"self"`; the ticks of its waited-for
/// (exited and reaped) children (fields 16 and 17); and the parent pid.
fn proc_ticks(pid: &str) -> Option<(u64, u64, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): ppid is field 4, utime 14, stime 15,
    // cutime 16, cstime 17.
    let ppid = f.get(1)?.parse().ok()?;
    let n = |i: usize| -> Option<u64> { f.get(i)?.parse().ok() };
    Some((n(11)? + n(12)?, n(13)? + n(14)?, ppid))
}

/// CPU seconds used so far by this process.
pub fn self_cpu() -> f64 {
    proc_ticks("self").map_or(0.0, |(t, _, _)| t as f64 / CLOCK_TICKS)
}

/// CPU seconds used so far by process `pid` and its children: its own, the
/// live children's, and the exited children's it has reaped (`cutime` +
/// `cstime`). The postmaster reaps every backend, so a backend that exits
/// between two readings keeps its CPU in the total (counting live
/// children only made the difference negative when backends exited).
/// Children that exited but are not yet reaped are read as live (a zombie
/// keeps its times until reaped).
pub fn tree_cpu(pid: u32) -> f64 {
    let mut total = proc_ticks(&pid.to_string()).map_or(0, |(t, c, _)| t + c);
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if !name.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            if let Some((t, _, ppid)) = proc_ticks(name) {
                if ppid == pid {
                    total += t;
                }
            }
        }
    }
    total as f64 / CLOCK_TICKS
}

/// The postmaster pid of the server in `dir` (first line of
/// `postmaster.pid`).
pub fn postmaster_pid(dir: &Path) -> Option<u32> {
    std::fs::read_to_string(dir.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// Cumulative counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// WAL insert position, bytes.
    pub wal_bytes: i64,
    /// `pg_stat_wal.wal_records`.
    pub wal_records: i64,
    /// `pg_stat_wal.wal_fpi`.
    pub wal_fpi: i64,
    /// Sum of `pg_stat_statements.calls` in this database, harness queries
    /// (those mentioning `pg_stat` or tagged `bench-probe`) left out.
    pub statements: i64,
    /// Per table: inserted, updated, deleted, HOT-updated, dead tuples.
    pub tables: BTreeMap<String, [i64; 5]>,
    /// CPU seconds of the PostgreSQL processes.
    pub db_cpu: f64,
    /// CPU seconds of the measured application process(es).
    pub app_cpu: f64,
    /// Rows in the `completions` table (0 where there is none): deliveries
    /// completed, as the database counts them.
    pub completed: i64,
}

/// Waits (up to 5 s) until no backend but `c`'s is connected to `c`'s
/// database: a backend flushes its table and WAL statistics at exit at
/// the latest, so counters read after this are complete.
pub async fn wait_alone(c: &mut PgConnection) -> anyhow::Result<()> {
    for _ in 0..50 {
        let others: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND pid <> pg_backend_pid() /* bench-probe */",
        )
        .fetch_one(&mut *c)
        .await?;
        if others == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Resets the server's statistics (`pg_stat_reset`, `pg_stat_statements_reset`,
/// `pg_stat_reset_shared('wal')`), as the reference did before each sample.
pub async fn reset(c: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::query("SELECT pg_stat_reset(), pg_stat_statements_reset(), pg_stat_reset_shared('wal')")
        .execute(c)
        .await?;
    Ok(())
}

/// Reads a snapshot through `c` (connected to the measured database);
/// `pm` is the postmaster pid, `app_cpu` the application CPU seconds now.
pub async fn snapshot(
    c: &mut PgConnection,
    pm: Option<u32>,
    app_cpu: f64,
) -> anyhow::Result<Snapshot> {
    let (wal_bytes, wal_records, wal_fpi): (i64, i64, i64) = sqlx::query_as(
        "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, wal_records, wal_fpi FROM pg_stat_wal",
    )
    .fetch_one(&mut *c)
    .await?;
    let statements: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
         AND query NOT ILIKE '%pg_stat%' AND query NOT LIKE '%bench-probe%'",
    )
    .fetch_one(&mut *c)
    .await?;
    let rows: Vec<(String, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd, n_dead_tup FROM pg_stat_user_tables",
    )
    .fetch_all(&mut *c)
    .await?;
    let has_completions: bool =
        sqlx::query_scalar("SELECT to_regclass('completions') IS NOT NULL /* bench-probe */")
            .fetch_one(&mut *c)
            .await?;
    let completed: i64 = if has_completions {
        sqlx::query_scalar("SELECT count(*) FROM completions /* bench-probe */")
            .fetch_one(&mut *c)
            .await?
    } else {
        0
    };
    Ok(Snapshot {
        completed,
        wal_bytes,
        wal_records,
        wal_fpi,
        statements,
        tables: rows
            .into_iter()
            .map(|(n, a, b, d, e, f)| (n, [a, b, d, e, f]))
            .collect(),
        db_cpu: pm.map_or(0.0, tree_cpu),
        app_cpu,
    })
}

/// Counters per unit between two snapshots (`statements`, `wal_bytes`,
/// `wal_records`, `wal_fpi`, `<table>.ins|upd|del|hot_upd|dead`) and CPU
/// milliseconds per unit (`cpu_app_ms`, `cpu_db_ms`).
pub fn per_unit(a: &Snapshot, b: &Snapshot, units: u64) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    if units == 0 {
        return m;
    }
    let u = units as f64;
    m.insert(
        "statements".into(),
        (b.statements - a.statements) as f64 / u,
    );
    m.insert("wal_bytes".into(), (b.wal_bytes - a.wal_bytes) as f64 / u);
    m.insert(
        "wal_records".into(),
        (b.wal_records - a.wal_records) as f64 / u,
    );
    m.insert("wal_fpi".into(), (b.wal_fpi - a.wal_fpi) as f64 / u);
    m.insert("cpu_app_ms".into(), (b.app_cpu - a.app_cpu) * 1000.0 / u);
    m.insert("cpu_db_ms".into(), (b.db_cpu - a.db_cpu) * 1000.0 / u);
    for (t, vb) in &b.tables {
        let va = a.tables.get(t).copied().unwrap_or_default();
        for (i, what) in ["ins", "upd", "del", "hot_upd", "dead"].iter().enumerate() {
            m.insert(format!("{t}.{what}"), (vb[i] - va[i]) as f64 / u);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn db_part_of_urls_is_replaced() {
        assert_eq!(
            with_db("postgres://postgres@127.0.0.1:5/postgres", "b1").unwrap(),
            "postgres://postgres@127.0.0.1:5/b1"
        );
        assert_eq!(
            with_db("postgres://u@h:5/x?sslmode=disable", "b").unwrap(),
            "postgres://u@h:5/b?sslmode=disable"
        );
        assert!(with_db("postgres://h", "b").is_err());
    }

    #[test]
    fn per_unit_divides_differences() {
        let mut a = Snapshot::default();
        let mut b = Snapshot {
            wal_bytes: 1000,
            statements: 10,
            app_cpu: 0.5,
            ..Snapshot::default()
        };
        a.tables.insert("deliveries".into(), [1, 0, 0, 0, 0]);
        b.tables.insert("deliveries".into(), [1, 0, 100, 0, 100]);
        let m = per_unit(&a, &b, 100);
        assert_eq!(m["wal_bytes"], 10.0);
        assert_eq!(m["statements"], 0.1);
        assert_eq!(m["deliveries.del"], 1.0);
        assert_eq!(m["deliveries.ins"], 0.0);
        assert_eq!(m["cpu_app_ms"], 5.0);
        assert!(per_unit(&a, &b, 0).is_empty());
    }

    #[test]
    fn own_cpu_is_readable() {
        // Burn a little CPU so the tick counter has something to show.
        let t = std::time::Instant::now();
        let mut x = 1u64;
        while t.elapsed().as_millis() < 30 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        assert!(self_cpu() >= 0.0);
        assert!(proc_ticks("self").is_some());
    }
}
