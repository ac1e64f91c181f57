//! `lanebus admin`: a running node's admin API from a shell.
//!
//! ```text
//! lanebus admin [--node URL] [--token T] [--output table|json] COMMAND
//!   lanes                         GET  /admin/lanes     lane ranges per owner, epochs, backlog
//!   cluster                       GET  /admin/cluster   members, leader, term, liveness
//!   handlers                      GET  /admin/handlers  state, dead-letter counts, routes
//!   dead-letters list [--handler H] [--after ID] [--limit N]
//!                                 GET  /admin/dead-letters
//!   dead-letters replay ID | --handler H | --all
//!                                 POST /admin/dead-letters/{ID}/replay, /admin/dead-letters/replay
//!   remove --id N                 POST /admin/cluster/remove
//! ```
//!
//! `--node` (or `LANEBUS_NODE`, or `node` in the `--config` TOML file) is
//! any node's base URL, `http://127.0.0.1:8080` by default. `--token` (or
//! `LANEBUS_TOKEN`, or `token` in the file) is sent as `Authorization:
//! Bearer`, for nodes that ask for an admin token. `--output json` prints
//! the API's JSON answer as it came; `table` (the default) a table for
//! people. A handler is named by id (`hdl_...`) or by name.
//!
//! Exit status: 0, or 1 with `error: ...` on stderr when the node cannot be
//! reached or answers an error (its `code` and `message` are printed). A
//! closed standard output (`| head`) ends the command quietly.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{ArgGroup, Args, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config;

/// `lanebus admin ...`.
#[derive(Debug, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminArgs {
    /// What to do.
    #[command(subcommand)]
    #[serde(skip)]
    command: Option<AdminCommand>,
    /// TOML config file (keys `node`, `token`; unknown keys are an error).
    #[arg(long, global = true, env = "LANEBUS_ADMIN_CONFIG")]
    #[serde(skip)]
    config: Option<std::path::PathBuf>,
    /// Base URL of any node's HTTP API [default: http://127.0.0.1:8080].
    #[arg(long, global = true, env = "LANEBUS_NODE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    /// Admin token, sent as `Authorization: Bearer TOKEN` (for nodes that
    /// require one).
    #[arg(long, global = true, env = "LANEBUS_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<String>,
    /// `table` for people, `json` for the API's answer as it came.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    #[serde(skip)]
    output: Output,
}

/// Output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table.
    #[default]
    Table,
    /// The API's JSON, unchanged.
    Json,
}

#[derive(Debug, Clone, Subcommand)]
enum AdminCommand {
    /// Lanes as ranges per owner and state, with epochs, backlog and in-flight.
    Lanes,
    /// Cluster members: leader, liveness, lane counts, addresses.
    Cluster,
    /// Handlers with their state and dead-letter counts.
    Handlers,
    /// Dead letters: list or replay.
    #[command(subcommand)]
    DeadLetters(DeadLetters),
    /// Disables a handler: its deliveries are kept, not attempted, until
    /// it is enabled.
    Disable {
        /// The handler (id `hdl_...` or name).
        handler: String,
    },
    /// Enables a handler (disabled by hand, by a `410 Gone` answer, or for
    /// failing too long): its kept deliveries resume, in order per key.
    Enable {
        /// The handler (id `hdl_...` or name).
        handler: String,
    },
    /// Removes a node on purpose: its lanes are handed over, then it leaves.
    Remove {
        /// Id of the node to remove.
        #[arg(long)]
        id: u64,
    },
}

#[derive(Debug, Clone, Subcommand)]
enum DeadLetters {
    /// One page of dead letters, oldest first.
    List {
        /// Only this handler's (id `hdl_...` or name).
        #[arg(long)]
        handler: Option<String>,
        /// Only ids greater than this (the `next_after` of the page before).
        #[arg(long)]
        after: Option<i64>,
        /// Page size, 1 to 1,000 [default: 100].
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Puts dead letters back as deliveries: one by id, a handler's, or all.
    #[command(group(ArgGroup::new("which").required(true).args(["id", "handler", "all"])))]
    Replay {
        /// Dead-letter id.
        id: Option<i64>,
        /// Every dead letter of this handler (id `hdl_...` or name).
        #[arg(long)]
        handler: Option<String>,
        /// Every dead letter of every handler.
        #[arg(long)]
        all: bool,
    },
}

/// A node's admin API.
struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// Sends `method path` (with a JSON `body`); the answer's text when it
    /// is a success, else the API's error code and message.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<String> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method.clone(), &url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.map_err(|e| {
            let why = if e.is_timeout() {
                "no answer in time".to_string()
            } else if e.is_connect() {
                "connection failed".to_string()
            } else {
                "request failed".to_string()
            };
            anyhow::anyhow!(
                "cannot reach the node at {} ({why}: {}); is a node running there? Pass --node URL or set LANEBUS_NODE",
                self.base,
                root_cause(&e)
            )
        })?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .with_context(|| format!("{method} {url}: answer cut off"))?;
        if status.is_success() {
            return Ok(text);
        }
        let detail = match serde_json::from_str::<Value>(&text) {
            Ok(v) if v["error"]["code"].is_string() => format!(
                "{}: {}",
                v["error"]["code"].as_str().unwrap_or_default(),
                v["error"]["message"].as_str().unwrap_or_default()
            ),
            _ => text.chars().take(500).collect(),
        };
        bail!("{method} {url} answered {status}: {detail}")
    }

    async fn get(&self, path: &str) -> anyhow::Result<String> {
        self.call(reqwest::Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Option<Value>) -> anyhow::Result<String> {
        self.call(reqwest::Method::POST, path, body).await
    }

    /// A handler's id from its id or name.
    async fn handler_id(&self, handler: &str) -> anyhow::Result<String> {
        if handler.starts_with("hdl_") {
            return Ok(handler.to_string());
        }
        let list: Value = serde_json::from_str(&self.get("/v1/handlers").await?)?;
        let matches: Vec<&str> = list["handlers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|h| h["name"] == handler)
            .filter_map(|h| h["id"].as_str())
            .collect();
        match matches.as_slice() {
            [id] => Ok(id.to_string()),
            [] => bail!("no handler named {handler:?} (give its id hdl_... or its name)"),
            _ => bail!(
                "{} handlers are named {handler:?}: give the id ({})",
                matches.len(),
                matches.join(", ")
            ),
        }
    }
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

/// Runs `lanebus admin ...`.
///
/// # Errors
/// A bad config file, an unreachable node, an error answer.
pub async fn run(args: AdminArgs) -> anyhow::Result<ExitCode> {
    lanebus_node::webhook::install_crypto_provider();
    let Some(command) = args.command.clone() else {
        bail!("lanebus admin needs a command: lanes, cluster, handlers, dead-letters, disable, enable or remove (see --help)");
    };
    let output = args.output;
    let file = args.config.clone();
    let args: AdminArgs = config::layered(&args, file.as_deref())?;
    let base = args
        .node
        .unwrap_or_else(|| "http://127.0.0.1:8080".to_string())
        .trim_end_matches('/')
        .to_string();
    if !base.starts_with("http://") && !base.starts_with("https://") {
        bail!("--node must be a URL such as http://127.0.0.1:8080, got {base:?}");
    }
    let client = Client {
        base,
        token: args.token.filter(|t| !t.is_empty()),
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(60))
            .build()
            .context("http client")?,
    };
    let (text, table): (String, fn(&Value) -> String) = match &command {
        AdminCommand::Lanes => (client.get("/admin/lanes").await?, lanes_table),
        AdminCommand::Cluster => (client.get("/admin/cluster").await?, cluster_table),
        AdminCommand::Handlers => (client.get("/admin/handlers").await?, handlers_table),
        AdminCommand::DeadLetters(DeadLetters::List {
            handler,
            after,
            limit,
        }) => {
            let mut query = Vec::new();
            if let Some(h) = handler {
                query.push(format!("handler_id={}", client.handler_id(h).await?));
            }
            if let Some(a) = after {
                query.push(format!("after={a}"));
            }
            if let Some(l) = limit {
                query.push(format!("limit={l}"));
            }
            let path = if query.is_empty() {
                "/admin/dead-letters".to_string()
            } else {
                format!("/admin/dead-letters?{}", query.join("&"))
            };
            (client.get(&path).await?, dead_letters_table)
        }
        AdminCommand::DeadLetters(DeadLetters::Replay { id, handler, all }) => {
            let text = match (id, handler, all) {
                (Some(id), _, _) => {
                    client
                        .post(&format!("/admin/dead-letters/{id}/replay"), None)
                        .await?
                }
                (None, Some(h), _) => {
                    let id = client.handler_id(h).await?;
                    client
                        .post(
                            "/admin/dead-letters/replay",
                            Some(serde_json::json!({ "handler_id": id })),
                        )
                        .await?
                }
                _ => {
                    client
                        .post(
                            "/admin/dead-letters/replay",
                            Some(serde_json::json!({ "all": true })),
                        )
                        .await?
                }
            };
            (text, replayed_line)
        }
        AdminCommand::Disable { handler } | AdminCommand::Enable { handler } => {
            let (verb, then) = if matches!(command, AdminCommand::Disable { .. }) {
                (
                    "disable",
                    "its deliveries are kept, not attempted, until `lanebus admin enable`",
                )
            } else {
                ("enable", "its kept deliveries resume, in order per key")
            };
            let id = client.handler_id(handler).await?;
            let text = client
                .post(&format!("/v1/handlers/{id}/{verb}"), None)
                .await?;
            let out = match output {
                Output::Json => with_newline(text),
                Output::Table => format!("handler {id} is {verb}d: {then}\n"),
            };
            return emit(&out);
        }
        AdminCommand::Remove { id } => {
            let text = client
                .post(
                    "/admin/cluster/remove",
                    Some(serde_json::json!({ "id": id })),
                )
                .await?;
            let out = match output {
                Output::Json => with_newline(text),
                Output::Table => format!(
                    "node {id} is leaving: its lanes are handed over, then it leaves the cluster\n"
                ),
            };
            return emit(&out);
        }
    };
    let out = match output {
        Output::Json => with_newline(text),
        Output::Table => {
            let body: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: the answer is not JSON", client.base))?;
            table(&body)
        }
    };
    emit(&out)
}

fn with_newline(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// Writes `out` to standard output; a closed pipe (`| head`) is not an
/// error.
fn emit(out: &str) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Err(e) => Err(e).context("cannot write to standard output"),
    }
}

/// Lanes grouped per owner and state: how many, their epochs, backlog and
/// in-flight summed, and the lane numbers as ranges (`0-85`, `86,88,...`;
/// shortened past 60 characters).
pub(crate) fn lanes_table(body: &Value) -> String {
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

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn cluster_table(body: &Value) -> String {
    let mut out = format!(
        "answered by {}, leader {}, term {}\n",
        text(&body["node_id"]),
        text(&body["leader"]),
        text(&body["term"])
    );
    let _ = writeln!(
        out,
        "{:<8} {:<8} {:<7} {:<6} {:>5}  {:<21} RAFT",
        "NODE", "ROLE", "VOTER", "ALIVE", "LANES", "HTTP"
    );
    for n in body["nodes"].as_array().into_iter().flatten() {
        let role = if n["id"] == body["leader"] {
            "leader"
        } else {
            "follower"
        };
        let _ = writeln!(
            out,
            "{:<8} {:<8} {:<7} {:<6} {:>5}  {:<21} {}",
            text(&n["id"]),
            role,
            if n["voter"] == true { "yes" } else { "learner" },
            if n["alive"] == true { "yes" } else { "NO" },
            text(&n["lanes"]),
            text(&n["http_addr"]),
            text(&n["raft_addr"])
        );
    }
    out
}

fn handlers_table(body: &Value) -> String {
    let exact = body["dead_letters_exact"] != false;
    let mut out = format!(
        "{:<36} {:<16} {:<18} {:<10} {:>12} {:<24} {}\n",
        "ID", "NAME", "STATE", "RATE", "DEAD_LETTERS", "EVENT_TYPES", "URL"
    );
    for h in body["handlers"].as_array().into_iter().flatten() {
        let types: Vec<&str> = h["event_types"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_str())
            .collect();
        let dead = format!(
            "{}{}",
            if exact { "" } else { ">=" },
            text(&h["dead_letters"])
        );
        // "disabled (gone)"; "enabled, failing" while attempts fail.
        let state = match (&h["state_reason"], &h["failing_since"]) {
            (r, _) if h["state"] == "disabled" && r.is_string() => {
                format!("disabled ({})", text(r))
            }
            (_, f) if f.is_string() => format!("{}, failing", text(&h["state"])),
            _ => text(&h["state"]),
        };
        let rate = match h["rate_limit"]["per_second"].as_u64() {
            Some(n) => format!("{n}/s"),
            None => "-".into(),
        };
        let _ = writeln!(
            out,
            "{:<36} {:<16} {:<18} {:<10} {:>12} {:<24} {}",
            text(&h["id"]),
            text(&h["name"]),
            state,
            rate,
            dead,
            types.join(","),
            text(&h["url"])
        );
    }
    out
}

fn dead_letters_table(body: &Value) -> String {
    let mut out = format!(
        "{:>8} {:<36} {:<30} {:<20} {:<16} {:>5} {:>8} {:<25} {}\n",
        "ID", "HANDLER", "EVENT", "TYPE", "KEY", "SEQ", "ATTEMPTS", "FAILED_AT", "LAST_ERROR"
    );
    for d in body["dead_letters"].as_array().into_iter().flatten() {
        let error: String = text(&d["last_error"])
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(80)
            .collect();
        let _ = writeln!(
            out,
            "{:>8} {:<36} {:<30} {:<20} {:<16} {:>5} {:>8} {:<25} {}",
            text(&d["id"]),
            text(&d["handler_id"]),
            text(&d["event_id"]),
            text(&d["event_type"]),
            text(&d["key"]),
            text(&d["seq"]),
            text(&d["attempts"]),
            text(&d["failed_at"]),
            error
        );
    }
    if let Some(next) = body["next_after"].as_i64() {
        let _ = writeln!(out, "more: --after {next}");
    }
    out
}

fn replayed_line(body: &Value) -> String {
    let n = body["replayed"].as_u64().unwrap_or(0);
    format!(
        "replayed {n} dead {}\n",
        if n == 1 { "letter" } else { "letters" }
    )
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

    #[test]
    fn cluster_handlers_and_dead_letters_tables() {
        let c = serde_json::json!({"node_id": "2", "leader": "1", "term": 4, "nodes": [
            {"id": "1", "raft_addr": "127.0.0.1:9080", "http_addr": "127.0.0.1:8080", "voter": true, "alive": true, "lanes": 128},
            {"id": "2", "raft_addr": null, "http_addr": null, "voter": false, "alive": false, "lanes": 0}]});
        let t = cluster_table(&c);
        assert!(t.starts_with("answered by 2, leader 1, term 4\n"), "{t}");
        assert!(t.lines().nth(2).unwrap().contains("leader"), "{t}");
        assert!(t.lines().nth(3).unwrap().contains(" NO "), "{t}");
        let h = serde_json::json!({"dead_letters_exact": false, "handlers": [
            {"id": "hdl_1", "name": "a", "url": "http://x", "event_types": ["a.*", "b"], "state": "enabled",
             "state_reason": null, "failing_since": null, "rate_limit": null, "dead_letters": 3},
            {"id": "hdl_2", "name": "b", "url": "http://y", "event_types": ["*"], "state": "disabled",
             "state_reason": "gone", "failing_since": null, "rate_limit": {"per_second": 5, "burst": 5}, "dead_letters": 0},
            {"id": "hdl_3", "name": "c", "url": "http://z", "event_types": ["*"], "state": "enabled",
             "state_reason": null, "failing_since": "2026-01-01T00:00:00Z", "rate_limit": null, "dead_letters": 0}]});
        let t = handlers_table(&h);
        assert!(t.contains(">=3") && t.contains("a.*,b"), "{t}");
        let row = |id: &str| {
            t.lines()
                .find(|l| l.starts_with(id))
                .expect("row")
                .to_owned()
        };
        assert!(
            row("hdl_1 ").contains(" enabled ") && row("hdl_1 ").contains(" - "),
            "{t}"
        );
        assert!(
            row("hdl_2 ").contains("disabled (gone)") && row("hdl_2 ").contains(" 5/s "),
            "{t}"
        );
        assert!(row("hdl_3 ").contains("enabled, failing"), "{t}");
        let d = serde_json::json!({"next_after": 9, "dead_letters": [
            {"id": 9, "handler_id": "hdl_1", "event_id": "e", "event_type": "t", "key": null, "seq": null,
             "attempts": 2, "last_error": "HTTP 500\nbody", "failed_at": "2026-01-01T00:00:00Z"}]});
        let t = dead_letters_table(&d);
        assert!(
            t.contains("HTTP 500 body") && t.ends_with("more: --after 9\n"),
            "{t}"
        );
        assert_eq!(
            replayed_line(&serde_json::json!({"replayed": 1})),
            "replayed 1 dead letter\n"
        );
    }
}
