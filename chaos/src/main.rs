//! `lanebus-chaos`: the chaos suite. Starts real `lanebus node` processes,
//! a throwaway database and a webhook receiver ([`sandbox`]), publishes
//! while it injects named faults ([`plan`]), heals, and judges what the
//! receiver got against docs/design.md section 2 ([`lanebus_testkit::oracle`]). Every random
//! choice comes from one seed ([`rng`]), printed first.
//!
//! ```text
//! lanebus-chaos [--seed S] [--store postgres|sqlite] quick | full [--repeats N]
//! lanebus-chaos [--seed S] run SCENARIO...
//! lanebus-chaos list
//! ```
//!
//! Exits 1 if any scenario broke an invariant or the harness failed;
//! scenarios that cannot run here (no cluster yet, no PostgreSQL) are
//! listed as skipped with the reason.

mod plan;
mod proxy;
mod publisher;
mod receiver;
mod rng;
mod run;
mod sandbox;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};

use plan::{Scale, SCENARIOS};
use run::{Ctx, Outcome};

/// Lease the nodes are started with (when `lanebus node` has the flags),
/// in milliseconds: short, so that failovers fit in a quick run, and above
/// the handler timeout ([`plan::TIMEOUT_MS`]) as the node requires. The
/// node derives its Raft timing from it (elections after 1 to 2 s here,
/// heartbeats every 250 ms): with a 3 s lease (elections after 0.6 to
/// 1.25 s) a 2-core machine under load average 20 starved elections until
/// the cluster had no leader for 50 s after a partition.
pub const LEASE_MS: u64 = 6_000;
/// Lease renewal interval, in milliseconds.
pub const RENEW_MS: u64 = 500;
/// Safety margin before a dead node's lanes move, in milliseconds.
pub const LEASE_MARGIN_MS: u64 = 1_000;

#[derive(Debug, Parser)]
#[command(
    name = "lanebus-chaos",
    about = "lanebus chaos suite: faults injected into real nodes, judged by an oracle"
)]
struct Cli {
    /// Seed of every random choice [default: from the clock, printed].
    #[arg(long, global = true, env = "LANEBUS_CHAOS_SEED")]
    seed: Option<u64>,
    /// The `lanebus` binary [default: `lanebus` next to this binary, else
    /// target/debug/lanebus].
    #[arg(long, global = true, env = "LANEBUS_BIN")]
    lanebus: Option<PathBuf>,
    /// Store backend of the nodes.
    #[arg(long, global = true, value_enum, default_value_t = StoreKind::Postgres)]
    store: StoreKind,
    /// Keep every sandbox directory (failed ones are always kept).
    #[arg(long, global = true)]
    keep: bool,
    /// Also write the table (Markdown) to this file.
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// A throwaway PostgreSQL (scripts/pg-start), a database per scenario.
    Postgres,
    /// A SQLite file per scenario (no database-server faults).
    Sqlite,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Every scenario, short (CI).
    Quick,
    /// Every scenario, longer, repeated with new seeds.
    Full {
        /// Runs of each scenario (the first with --seed, then derived seeds).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// The named scenarios, short.
    Run {
        /// Scenario names (see `list`).
        #[arg(required = true)]
        names: Vec<String>,
        /// At the full scale instead of the quick one.
        #[arg(long)]
        full: bool,
    },
    /// Lists the scenarios.
    List,
    /// (internal) the child publisher: publishes until killed.
    #[command(hide = true)]
    PublishChild {
        /// Journal file.
        #[arg(long)]
        out: PathBuf,
        /// Node base URLs.
        urls: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // On SIGINT or SIGTERM the suite's future is dropped: node processes
    // are killed (kill_on_drop) and the database removed (PgServer's Drop).
    let run = async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = real_main(cli) => r,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
            _ = term.recv() => Err(anyhow::anyhow!("terminated")),
        }
    };
    match rt.block_on(run) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn real_main(cli: Cli) -> anyhow::Result<ExitCode> {
    lanebus_node::webhook::install_crypto_provider();
    let seed = cli.seed.unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        rng::mix(t ^ u64::from(std::process::id())) >> 1
    });
    let (scale, names, repeats): (Scale, Vec<String>, usize) = match &cli.command {
        Cmd::List => {
            for (n, about) in SCENARIOS {
                println!("{n:<20} {about}");
            }
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::PublishChild { out, urls } => {
            let spec = publisher::PubSpec {
                name: "child".into(),
                keys: 10,
                max_batch: 100,
                pause_ms: 10,
                unkeyed_percent: 10,
            };
            publisher::child(spec, seed, urls.clone(), out).await?;
            return Ok(ExitCode::SUCCESS);
        }
        Cmd::Quick => (Scale::Quick, all_names(), 1),
        Cmd::Full { repeats } => (Scale::Full, all_names(), (*repeats).max(1)),
        Cmd::Run { names, full } => {
            for n in names {
                if !SCENARIOS.iter().any(|(s, _)| s == n) {
                    anyhow::bail!("unknown scenario {n:?} (see `lanebus-chaos list`)");
                }
            }
            (
                if *full { Scale::Full } else { Scale::Quick },
                names.clone(),
                1,
            )
        }
    };
    let what = match &cli.command {
        Cmd::Quick => "quick".to_string(),
        Cmd::Full { repeats } => format!("full --repeats {repeats}"),
        Cmd::Run { names, .. } => format!("run {}", names.join(" ")),
        _ => unreachable!(),
    };
    println!(
        "lanebus-chaos {what}: seed = {seed} (repeat with: lanebus-chaos --seed {seed} --store {} {what})",
        match cli.store {
            StoreKind::Postgres => "postgres",
            StoreKind::Sqlite => "sqlite",
        }
    );
    let bin = cli.lanebus.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|me| me.parent().map(|d| d.join("lanebus")))
            .filter(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("target/debug/lanebus"))
    });
    let bin = bin.canonicalize().with_context(|| {
        format!(
            "lanebus binary {} not found (build it with `cargo build --bin lanebus`, or pass --lanebus)",
            bin.display()
        )
    })?;
    let flags = sandbox::NodeFlags::probe(&bin).await?;
    println!(
        "lanebus: {} (lease flags: {}, raft advertise address: {}, webhook source address: {})",
        bin.display(),
        flags.lease_flags,
        flags.advertise_flag,
        flags.source_ip_flag
    );
    let scripts = workspace_root().join("scripts");
    let pg = match cli.store {
        StoreKind::Postgres => {
            let pg = sandbox::PgServer::start(&scripts).await?;
            println!("throwaway PostgreSQL on port {}", pg.port);
            Some(Arc::new(pg))
        }
        StoreKind::Sqlite => None,
    };
    let work = std::env::temp_dir().join(format!("lanebus-chaos-{seed}"));
    let mut ctx = Ctx {
        bin,
        flags,
        pg: pg.clone(),
        work: work.clone(),
        keep: cli.keep,
        clustered: None,
        me: std::env::current_exe()?,
    };
    let suite_start = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut index = 0;
    for s in plan::seeds(seed, repeats) {
        for name in &names {
            let plan = plan::build(name, s, scale).expect("known name");
            index += 1;
            println!("\n== {} (seed {s}) ==", plan.name);
            let started = Instant::now();
            let outcome = run::run(&mut ctx, &plan, index).await;
            match &outcome {
                Outcome::Ran { report, .. } if !report.passed() => {
                    for p in &report.problems {
                        println!("  problem: {p}");
                    }
                }
                Outcome::Skipped(why) => println!("  skipped: {why}"),
                Outcome::Error(e) => println!("  harness error: {e}"),
                Outcome::Ran { .. } => {}
            }
            let row = Row {
                name: plan.name,
                seed: s,
                secs: started.elapsed().as_secs_f64(),
                outcome,
            };
            println!("{}", row_line(&row));
            rows.push(row);
        }
    }
    // The server stops when its last handle goes (PgServer's Drop).
    drop(ctx);
    drop(pg);
    let _ = std::fs::remove_dir(&work);
    let table = table(&rows, suite_start.elapsed().as_secs_f64(), seed);
    println!("\n{table}");
    if let Some(out) = &cli.out {
        std::fs::write(out, &table)?;
    }
    let failed = rows.iter().any(|r| match &r.outcome {
        Outcome::Ran { report, .. } => !report.passed(),
        Outcome::Error(_) => true,
        Outcome::Skipped(_) => false,
    });
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn all_names() -> Vec<String> {
    SCENARIOS.iter().map(|(n, _)| n.to_string()).collect()
}

fn workspace_root() -> PathBuf {
    // The binary runs from the workspace (cargo run, scripts/test); fall
    // back to the crate's compile-time location.
    let cwd = std::env::current_dir().unwrap_or_default();
    if cwd.join("scripts/pg-start").exists() {
        return cwd;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or(cwd)
}

struct Row {
    name: &'static str,
    seed: u64,
    secs: f64,
    outcome: Outcome,
}

const HEADER: &str = "| scenario | seed | events | deliveries | lost | dead-lettered | repeats: failed / node timeout / owner change / unattributed | out of order | overlaps | other violations | recover s | drain s | time s | result |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";

fn secs(ms: Option<u64>) -> String {
    ms.map_or("-".into(), |m| format!("{:.1}", m as f64 / 1e3))
}

fn row_line(r: &Row) -> String {
    match &r.outcome {
        Outcome::Ran {
            report: x,
            drained_ms,
        } => {
            let other = x.corrupted
                + x.bad_signatures
                + x.unexpected
                + x.torn_batches
                + x.two_owners
                + x.deposed_sends
                + x.completed_and_dead;
            format!(
                "| {} | {} | {}{} | {} | {} | {} | {} / {} / {} / {} | {} | {} | {} | {} | {} | {:.0} | {} |",
                r.name,
                r.seed,
                x.events,
                if x.in_doubt > 0 {
                    format!(" (+{} in doubt)", x.in_doubt)
                } else {
                    String::new()
                },
                x.requests,
                x.lost,
                x.dead_lettered,
                x.repeats.failed,
                x.repeats.node_timeout,
                x.repeats.owner_change,
                x.repeats.unattributed,
                x.out_of_order,
                x.overlaps,
                other,
                secs(x.recovered_ms),
                secs(*drained_ms),
                r.secs,
                if x.passed() { "pass" } else { "FAIL" }
            )
        }
        Outcome::Skipped(why) => format!(
            "| {} | {} | | | | | | | | | | | {:.0} | skipped: {why} |",
            r.name, r.seed, r.secs
        ),
        Outcome::Error(e) => format!(
            "| {} | {} | | | | | | | | | | | {:.0} | ERROR: {} |",
            r.name,
            r.seed,
            r.secs,
            e.lines().next().unwrap_or_default()
        ),
    }
}

fn table(rows: &[Row], total_secs: f64, seed: u64) -> String {
    let mut s = format!("lanebus-chaos results, seed {seed}\n\n{HEADER}");
    for r in rows {
        let _ = writeln!(s, "{}", row_line(r));
    }
    let ran = rows
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Ran { .. }))
        .count();
    let passed = rows
        .iter()
        .filter(|r| matches!(&r.outcome, Outcome::Ran { report, .. } if report.passed()))
        .count();
    let errors = rows
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Error(_)))
        .count();
    let _ = writeln!(
        s,
        "\n{passed} of {ran} scenarios passed, {errors} harness errors, {} skipped, {:.0} s in total",
        rows.len() - ran - errors,
        total_secs
    );
    s
}
