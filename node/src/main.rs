//! The `lanebus` binary (docs/design.md section 6, contract).
//!
//! ```text
//! lanebus node --id N --http-addr IP:PORT --raft-addr IP:PORT --data-dir DIR \
//!              --store URL [--bootstrap | --join http://IP:PORT | --single]
//!              [--lease-ms MS --renew-interval-ms MS --lease-margin-ms MS --voters N]
//!              [--admin-tokens T,.. --publish-tokens T,.. --cluster-secret S --join-token T]
//!              [--webhook-allow-cidrs CIDR,..]
//! lanebus migrate --store URL
//! lanebus rotate-master-key --store URL --old-key-file FILE --new-key-file FILE
//! lanebus demo [--store URL] [--events N] [--keys K] [--data PATH]
//! lanebus admin [--node URL] [--token T] [--output table|json]
//!               lanes | cluster | handlers | dead-letters list|replay | remove --id N
//! lanebus events [--node URL] [--token T] [--output table|json]
//!               get ID | publish --type T [--key K] --data JSON|@FILE|-
//! lanebus handlers [--node URL] [--token T] [--output table|json]
//!               list | get H | create NAME --url URL --route T | delete H
//!               | deliveries H [--state pending|dead|completed]
//! ```
//!
//! Configuration is layered: defaults, then the TOML file of `--config`
//! (unknown keys are an error), then `LANEBUS_*` environment variables, then
//! flags; the result is validated before anything starts.

/// mimalloc rather than the system allocator: at dispatch, glibc malloc
/// took about 40 % of the node's CPU (bench/results, pg-dispatch-1n-tuned).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod admin;
mod api_cli;
mod client;
mod config;
mod demo;

use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};

use config::NodeArgs;

#[derive(Debug, Parser)]
#[command(
    name = "lanebus",
    version,
    about = "lanebus: a distributed event dispatcher (events to signed webhooks, in order per key)"
)]
struct Cli {
    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `lanebus_node=debug`.
    #[arg(long, global = true, env = "LANEBUS_LOG", default_value = "info")]
    log: String,
    /// Log format.
    #[arg(long, global = true, env = "LANEBUS_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a node: HTTP API, Raft member, lane owners, webhook delivery.
    ///
    /// --bootstrap starts a new cluster, --join URL asks a member to add this
    /// node, a restart from its data dir needs neither. --single runs without
    /// a cluster (owns every lane).
    Node(Box<NodeArgs>),
    /// Creates or upgrades the store's schema and exits.
    Migrate(MigrateArgs),
    /// Rewraps every subject's data key (personal fields) under a new
    /// master key; events are not touched. Run it, then restart the nodes
    /// with the new key: a node still on the old key cannot open the
    /// rewrapped keys (it fails publishes of personal types and sends
    /// their fields as null) until it has the new one.
    RotateMasterKey(RotateArgs),
    /// Self-contained demo: three nodes as child processes, a webhook
    /// receiver, real GitHub payloads, one node killed halfway, and the
    /// exactness verdict (exits non-zero if an invariant broke).
    Demo(demo::DemoFlags),
    /// A running node's admin API: lanes, cluster, handlers (disable,
    /// enable), dead letters (list, replay), planned removal.
    Admin(admin::AdminArgs),
    /// Events: publish one, or see where its deliveries stand (`get`).
    Events(api_cli::EventsArgs),
    /// Handlers: create, list, get, delete, and a handler's deliveries
    /// (pending, dead, completed).
    Handlers(api_cli::HandlersArgs),
}

#[derive(Debug, Args)]
struct RotateArgs {
    /// Store URL: `postgres://...`, `mongodb://...` (a replica set) or `sqlite://PATH`.
    #[arg(long, env = "LANEBUS_STORE")]
    store: String,
    /// File holding the master key the data keys are wrapped by now (32
    /// bytes as 64 hex digits or base64).
    #[arg(long)]
    old_key_file: std::path::PathBuf,
    /// File holding the new master key.
    #[arg(long)]
    new_key_file: std::path::PathBuf,
}

#[derive(Debug, Args)]
struct MigrateArgs {
    /// Store URL: `postgres://...`, `mongodb://...` (a replica set) or `sqlite://PATH`.
    #[arg(long, env = "LANEBUS_STORE")]
    store: String,
}

fn init_tracing(filter: &str, format: LogFormat) {
    let mut env = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // PostgreSQL's notices at migration ("relation ... already exists,
    // skipping") are not news at every start, unless asked for by name.
    if !filter.contains("sqlx") {
        if let Ok(d) = "sqlx::postgres::notice=warn".parse() {
            env = env.add_directive(d);
        }
    }
    let filter = env;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.log, cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Node(args) => run_node(*args).await,
            Command::Migrate(args) => migrate(args).await,
            Command::RotateMasterKey(args) => rotate_master_key(args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Admin(args) => admin::run(args).await,
            Command::Events(args) => api_cli::events(args).await,
            Command::Handlers(args) => api_cli::handlers(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run_node(args: NodeArgs) -> anyhow::Result<ExitCode> {
    let cfg = config::load(args)?;
    // Refused before any directory is created (the node checks again).
    let opts = cfg.node_options();
    opts.check()?;
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("cannot create data dir {}", cfg.data_dir.display()))?;
    config::create_sqlite_dir(&cfg.store)?;
    tracing::info!(
        id = cfg.id,
        http_addr = %cfg.http_addr,
        raft_addr = %cfg.raft_addr,
        advertise_addr = ?cfg.advertise_addr,
        data_dir = %cfg.data_dir.display(),
        store = %config::redact(&cfg.store),
        single = cfg.single,
        bootstrap = cfg.bootstrap,
        join = ?cfg.join,
        lease_ms = cfg.lease.lease_ms,
        webhook_allow_cidrs = ?cfg.webhook_allow.iter().map(ToString::to_string).collect::<Vec<_>>(),
        cluster_secret = cfg.cluster_secret.is_some(),
        "starting node"
    );
    let node = lanebus_node::start(opts).await?;
    println!("lanebus node {} listening on {}", cfg.id, node.http_addr);
    tokio::select! {
        r = wait_for_signal() => {
            r?;
            tracing::info!("signal received, shutting down");
            node.shutdown().await?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r?,
        _ = term.recv() => {}
    }
    Ok(())
}

async fn migrate(args: MigrateArgs) -> anyhow::Result<ExitCode> {
    config::create_sqlite_dir(&args.store)?;
    let store = lanebus_store::open(&args.store)
        .await
        .with_context(|| format!("cannot open store {}", config::redact(&args.store)))?;
    println!(
        "store {} ({}) is migrated, {} lanes",
        config::redact(&args.store),
        store.backend(),
        store.lanes()
    );
    Ok(ExitCode::SUCCESS)
}

async fn rotate_master_key(args: RotateArgs) -> anyhow::Result<ExitCode> {
    let key = |f: &std::path::Path| -> anyhow::Result<lanebus_store::personal::MasterKey> {
        config::master_key(Some(f), None)?
            .and_then(std::sync::Arc::into_inner)
            .context("no master key read")
    };
    let (old, new) = (key(&args.old_key_file)?, key(&args.new_key_file)?);
    anyhow::ensure!(old != new, "the old and the new master key are the same");
    let store = lanebus_store::open(&args.store)
        .await
        .with_context(|| format!("cannot open store {}", config::redact(&args.store)))?;
    let n = lanebus_store::personal::rotate(&*store, &old, &new).await?;
    println!(
        "{n} data keys of store {} rewrapped from master key {} to {}",
        config::redact(&args.store),
        old.id(),
        new.id()
    );
    Ok(ExitCode::SUCCESS)
}
