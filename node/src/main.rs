//! The `lanebus` binary (DESIGN.md section 6, contract).
//!
//! ```text
//! lanebus node --id N --http-addr IP:PORT --raft-addr IP:PORT --data-dir DIR \
//!              --store URL [--bootstrap | --join http://IP:PORT | --single]
//!              [--lease-ms MS --renew-interval-ms MS --lease-margin-ms MS --voters N]
//! lanebus migrate --store URL
//! lanebus demo [--store URL] [--events N] [--keys K] [--data PATH]
//! lanebus admin lanes|cluster|handlers [--node http://IP:PORT]
//! lanebus admin remove --id N [--node http://IP:PORT]
//! ```
//!
//! Configuration is layered: defaults, then the TOML file of `--config`
//! (unknown keys are an error), then `LANEBUS_*` environment variables, then
//! flags; the result is validated before anything starts.

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
    Node(NodeArgs),
    /// Creates or upgrades the store's schema and exits.
    Migrate(MigrateArgs),
    /// Self-contained demo: three nodes as child processes, a webhook
    /// receiver, real GitHub payloads, one node killed halfway, and the
    /// exactness verdict (exits non-zero if an invariant broke).
    Demo(demo::DemoFlags),
    /// Reads a running node's admin API.
    Admin(AdminArgs),
}

#[derive(Debug, Args)]
struct MigrateArgs {
    /// Store URL: `postgres://...` or `sqlite://PATH`.
    #[arg(long, env = "LANEBUS_STORE")]
    store: String,
}

#[derive(Debug, Args, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AdminArgs {
    /// What to show.
    #[arg(value_enum)]
    #[serde(skip)]
    what: AdminWhat,
    /// TOML config file (key `node`; unknown keys are an error).
    #[arg(long, env = "LANEBUS_ADMIN_CONFIG")]
    #[serde(skip)]
    config: Option<std::path::PathBuf>,
    /// Base URL of any node's HTTP API [default: http://127.0.0.1:8080].
    #[arg(long, env = "LANEBUS_NODE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    /// With `remove`: the id of the node to remove (its lanes are handed
    /// over gracefully, then it leaves the cluster).
    #[arg(long)]
    #[serde(skip)]
    id: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
enum AdminWhat {
    /// Lanes as ranges per owner, with epoch and backlog.
    #[default]
    Lanes,
    /// Cluster members and leader.
    Cluster,
    /// Registered handlers.
    Handlers,
    /// Removes a node on purpose (`--id N`): POST /admin/cluster/remove.
    Remove,
}

fn init_tracing(filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
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
            Command::Node(args) => run_node(args).await,
            Command::Migrate(args) => migrate(args).await,
            Command::Demo(args) => demo::run(args).await,
            Command::Admin(args) => admin(args).await,
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
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("cannot create data dir {}", cfg.data_dir.display()))?;
    config::create_sqlite_dir(&cfg.store)?;
    tracing::info!(
        id = cfg.id,
        http_addr = %cfg.http_addr,
        raft_addr = %cfg.raft_addr,
        data_dir = %cfg.data_dir.display(),
        store = %config::redact(&cfg.store),
        single = cfg.single,
        bootstrap = cfg.bootstrap,
        join = ?cfg.join,
        lease_ms = cfg.lease.lease_ms,
        "starting node"
    );
    let node = lanebus_node::start(cfg.node_options()).await?;
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

async fn admin(args: AdminArgs) -> anyhow::Result<ExitCode> {
    lanebus_node::webhook::install_crypto_provider();
    let what = args.what;
    let remove_id = args.id;
    let file = args.config.clone();
    let args: AdminArgs = config::layered(&args, file.as_deref())?;
    let node = args
        .node
        .unwrap_or_else(|| "http://127.0.0.1:8080".to_string());
    let base = node.trim_end_matches('/');
    if what == AdminWhat::Remove {
        let Some(id) = remove_id else {
            anyhow::bail!("admin remove needs --id N, the node to remove");
        };
        let resp = reqwest::Client::new()
            .post(format!("{base}/admin/cluster/remove"))
            .json(&serde_json::json!({ "id": id }))
            .send()
            .await
            .with_context(|| format!("cannot reach {base}"))?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            anyhow::bail!("{base}/admin/cluster/remove answered {status}: {body}");
        }
        println!("node {id} is leaving: its lanes are handed over, then it leaves the cluster");
        return Ok(ExitCode::SUCCESS);
    }
    let path = match what {
        AdminWhat::Remove => unreachable!("handled above"),
        AdminWhat::Lanes => "/admin/lanes",
        AdminWhat::Cluster => "/admin/cluster",
        AdminWhat::Handlers => "/v1/handlers",
    };
    let resp = reqwest::get(format!("{base}{path}"))
        .await
        .with_context(|| format!("cannot reach {base}"))?;
    let status = resp.status();
    let body: serde_json::Value = resp
        .json()
        .await
        .with_context(|| format!("{base}{path}: answer is not JSON"))?;
    if !status.is_success() {
        anyhow::bail!("{base}{path} answered {status}: {body}");
    }
    match what {
        AdminWhat::Lanes => print!("{}", lanes_table(&body)),
        AdminWhat::Handlers => print!("{}", handlers_table(&body)),
        AdminWhat::Cluster => println!("{}", serde_json::to_string_pretty(&body)?),
        AdminWhat::Remove => {}
    }
    Ok(ExitCode::SUCCESS)
}

/// Lanes grouped per owner and state: how many, their epochs, backlog and
/// in-flight summed, and the lane numbers as ranges (`0-85`, `86,88,...`;
/// shortened past 60 characters).
fn lanes_table(body: &serde_json::Value) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    #[derive(Default)]
    struct Group {
        lanes: Vec<i64>,
        epochs: (i64, i64),
        backlog: i64,
        in_flight: i64,
    }
    let lanes = body["lanes"].as_array().cloned().unwrap_or_default();
    let mut groups: BTreeMap<(String, String), Group> = BTreeMap::new();
    for l in &lanes {
        let owner = l["owner"].as_str().unwrap_or("-").to_string();
        let state = l["state"].as_str().unwrap_or("?").to_string();
        let g = groups.entry((owner, state)).or_default();
        let epoch = l["epoch"].as_i64().unwrap_or(0);
        g.epochs = if g.lanes.is_empty() {
            (epoch, epoch)
        } else {
            (g.epochs.0.min(epoch), g.epochs.1.max(epoch))
        };
        g.lanes.push(l["lane"].as_i64().unwrap_or(-1));
        g.backlog += l["backlog"].as_i64().unwrap_or(0);
        g.in_flight += l["in_flight"].as_i64().unwrap_or(0);
    }
    let mut out = format!(
        "{:<8} {:<10} {:>5} {:>9} {:>9} {:>9}  {}\n",
        "OWNER", "STATE", "LANES", "EPOCHS", "BACKLOG", "IN_FLIGHT", "RANGES"
    );
    for ((owner, state), g) in &groups {
        let epochs = if g.epochs.0 == g.epochs.1 {
            g.epochs.0.to_string()
        } else {
            format!("{}-{}", g.epochs.0, g.epochs.1)
        };
        let _ = writeln!(
            out,
            "{:<8} {:<10} {:>5} {:>9} {:>9} {:>9}  {}",
            owner,
            state,
            g.lanes.len(),
            epochs,
            g.backlog,
            g.in_flight,
            ranges(&g.lanes, 60)
        );
    }
    out
}

/// `0-3,5,7-9`, cut to about `max` characters with the count left out.
fn ranges(lanes: &[i64], max: usize) -> String {
    let mut sorted = lanes.to_vec();
    sorted.sort_unstable();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            sorted[i].to_string()
        } else {
            format!("{}-{}", sorted[i], sorted[j])
        });
        i = j + 1;
    }
    let mut out = String::new();
    for (n, p) in parts.iter().enumerate() {
        if out.len() + p.len() > max {
            out.push_str(&format!(",... (+{} ranges)", parts.len() - n));
            break;
        }
        if n > 0 {
            out.push(',');
        }
        out.push_str(p);
    }
    out
}

fn handlers_table(body: &serde_json::Value) -> String {
    use std::fmt::Write as _;
    let list = body["handlers"]
        .as_array()
        .or_else(|| body.as_array())
        .cloned()
        .unwrap_or_default();
    let mut out = format!(
        "{:<36} {:<16} {:<9} {:<24} {}\n",
        "ID", "NAME", "STATE", "EVENT_TYPES", "URL"
    );
    for h in list {
        let types: Vec<&str> = h["event_types"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str())
            .collect();
        let _ = writeln!(
            out,
            "{:<36} {:<16} {:<9} {:<24} {}",
            h["id"].as_str().unwrap_or("?"),
            h["name"].as_str().unwrap_or("?"),
            h["state"].as_str().unwrap_or("?"),
            types.join(","),
            h["url"].as_str().unwrap_or("?")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_printed_as_ranges_per_owner() {
        let mut lanes = Vec::new();
        for lane in 0..8 {
            let owner = if lane < 4 || lane == 6 { "1" } else { "2" };
            lanes.push(serde_json::json!({"lane": lane, "owner": owner, "epoch": 3 + lane % 2, "state": "active", "backlog": 1, "in_flight": 0}));
        }
        let table = lanes_table(&serde_json::json!({ "lanes": lanes }));
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows.len(), 3, "{table}");
        assert!(
            rows[1].starts_with("1 ") && rows[1].ends_with("0-3,6") && rows[1].contains(" 3-4 "),
            "{table}"
        );
        assert!(
            rows[2].starts_with("2 ") && rows[2].ends_with("4-5,7"),
            "{table}"
        );
        assert_eq!(
            ranges(&(0..100).step_by(2).collect::<Vec<_>>(), 10),
            "0,2,4,6,8,... (+45 ranges)"
        );
    }
}
