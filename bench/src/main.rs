//! `lanebus-bench`: the benchmark harness (see `bench/README.md`).
//!
//! ```text
//! lanebus-bench quick [--base REF] [--candidate .|REF] [--pairs N] ...
//! lanebus-bench full  [--base REF] ...
//! lanebus-bench sample --spec JSON     (the sample runner; run by the harness)
//! lanebus-bench cells                  (lists the cells of both sets)
//! ```

/// The same allocator as the `lanebus` binary (node/src/main.rs), so the
/// node a sample runs in this process allocates as it does there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod cells;
mod exact;
mod gate;
mod mongo;
mod peers;
mod pg;
mod report;
mod run;
mod sample;
mod stats;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "lanebus-bench",
    about = "lanebus benchmark harness: interleaved base and candidate, exact PostgreSQL counters, exactness, peers"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The quick set (the gate): 5 cells, 2 pairs, peers with 20,000 jobs.
    Quick(RunArgs),
    /// The full set: every cell, 3 pairs, peers with 100,000 jobs.
    Full(RunArgs),
    /// Runs one sample and prints `SAMPLE {json}` (used by the harness).
    Sample {
        /// The sample spec as JSON.
        #[arg(long)]
        spec: String,
    },
    /// Lists the cells.
    Cells,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Base git ref (must contain bench/).
    #[arg(long, default_value = "HEAD")]
    base: String,
    /// Patch applied to the base tree before building.
    #[arg(long)]
    base_patch: Option<PathBuf>,
    /// Candidate: `.` (this binary's tree) or a git ref.
    #[arg(long, default_value = ".")]
    candidate: String,
    /// Patch applied to the candidate tree (HEAD for `.`) before building.
    #[arg(long)]
    candidate_patch: Option<PathBuf>,
    /// Pairs per cell (default: 2 quick, 3 full).
    #[arg(long)]
    pairs: Option<usize>,
    /// Pairs per cell outside the quick set (default: `--pairs`); to fit
    /// a full run into the time there is, say so in its report.
    #[arg(long)]
    rest_pairs: Option<usize>,
    /// Start no further cell after this time (RFC 3339, e.g.
    /// `2026-11-30T23:55:00Z`); the peers still run, and the report and
    /// `env.json` (`cells_not_run`) name the cells left out.
    #[arg(long)]
    cells_until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only these cells (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Skip the peers.
    #[arg(long)]
    no_peers: bool,
    /// Jobs per peer (default: 20,000 quick, 100,000 full).
    #[arg(long)]
    peer_jobs: Option<usize>,
    /// Port of the harness's PostgreSQL.
    #[arg(long, default_value_t = 55571)]
    port: u16,
    /// Output directory (default bench/results/runs/<timestamp>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Target dir under which base and patched sides build, each in
    /// `sides/<side>` of its own (default: the repository's target/).
    #[arg(long)]
    target_dir: Option<PathBuf>,
    /// Cargo profile of side builds (measure with `release`; run the
    /// harness itself with the same profile).
    #[arg(long, default_value = "release")]
    profile: String,
    /// SecantusDB server command for the MongoDB cells (each sample starts
    /// its own); default `.venv/bin/secantusd-py` of the repository. The
    /// MongoDB cells are skipped when there is none.
    #[arg(long, env = mongo::SECANTUS_ENV)]
    mongod_cmd: Option<PathBuf>,
}

fn run_set(set: &str, a: RunArgs) -> ExitCode {
    let (mut cells, pairs, jobs) = match set {
        "quick" => (cells::quick(), 2, 20_000),
        _ => (cells::full(), 3, 100_000),
    };
    if !a.only.is_empty() {
        cells.retain(|c| a.only.contains(&c.name));
        if cells.is_empty() {
            eprintln!(
                "no cell matches --only {:?}; `lanebus-bench cells` lists them",
                a.only
            );
            return ExitCode::from(2);
        }
    }
    let repo = run::repo_root().unwrap_or_else(|_| PathBuf::from("."));
    let mut roots = vec![repo.clone()];
    roots.extend(run::main_worktree(&repo));
    let mongo_cmd = mongo::find_command(a.mongod_cmd.as_deref(), &roots);
    let n_mongo = cells.iter().filter(|c| c.store == "mongodb").count();
    if mongo_cmd.is_none() && n_mongo > 0 {
        eprintln!(
            "skipping {n_mongo} MongoDB cell(s): no SecantusDB server command \
             (--mongod-cmd, {}, or .venv/bin/secantusd-py in {})",
            mongo::SECANTUS_ENV,
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(" or ")
        );
        cells.retain(|c| c.store != "mongodb");
        if cells.is_empty() {
            return ExitCode::from(2);
        }
    }
    let n_nats = cells.iter().filter(|c| c.nats_sink).count();
    if n_nats > 0 && sample::nats_server().is_none() {
        eprintln!(
            "skipping {n_nats} NATS cell(s): no nats-server (LANEBUS_BENCH_NATS_SERVER, PATH, \
             /usr/sbin; Debian package nats-server)"
        );
        cells.retain(|c| !c.nats_sink);
        if cells.is_empty() {
            return ExitCode::from(2);
        }
    }
    let opts = run::RunOptions {
        cells,
        set: set.into(),
        base: a.base,
        base_patch: a.base_patch,
        candidate: a.candidate,
        candidate_patch: a.candidate_patch,
        pairs: a.pairs.unwrap_or(pairs).max(1),
        cells_until: a.cells_until,
        rest_pairs: a.rest_pairs.unwrap_or(a.pairs.unwrap_or(pairs)).max(1),
        peers: !a.no_peers,
        peer_jobs: a.peer_jobs.unwrap_or(jobs),
        port: a.port,
        out: a.out,
        target_dir: a.target_dir,
        profile: a.profile,
        mongo_cmd,
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run::run(opts)) {
        Ok((dir, passed)) => {
            println!("report: {}", dir.join("report.md").display());
            if passed {
                println!("GATE PASS");
                ExitCode::SUCCESS
            } else {
                println!("GATE FAIL (see the Gate section of the report)");
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    match cli.command {
        Cmd::Quick(a) => run_set("quick", a),
        Cmd::Full(a) => run_set("full", a),
        Cmd::Cells => {
            for c in cells::full() {
                println!("{:<30} {}", c.name, c.title);
            }
            ExitCode::SUCCESS
        }
        Cmd::Sample { spec } => {
            // Node logs on stderr when asked (RUST_LOG), to explain a sample.
            if std::env::var_os("RUST_LOG").is_some() {
                let _ = tracing_subscriber::fmt()
                    .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                    .with_writer(std::io::stderr)
                    .try_init();
            }
            let spec: sample::SampleSpec = match serde_json::from_str(&spec) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("bad --spec: {e}");
                    return ExitCode::from(2);
                }
            };
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("tokio: {e}");
                    return ExitCode::from(2);
                }
            };
            match rt.block_on(sample::run(spec)) {
                Ok(out) => {
                    println!("SAMPLE {}", serde_json::to_string(&out).unwrap_or_default());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("sample failed: {e:#}");
                    ExitCode::from(2)
                }
            }
        }
    }
}
