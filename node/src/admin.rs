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
//! The flags `--node`, `--token`, `--output`, `--config` and the exit
//! status are those of every API command ([`crate::client`]). A handler is
//! named by id (`hdl_...`) or by name.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::bail;
use clap::{ArgGroup, Args, Subcommand};
use serde_json::Value;

use crate::client::{
    cells, emit, grid, handlers_table, one_line, text, with_newline, Output, Remote,
};

/// `lanebus admin ...`.
#[derive(Debug, Args)]
pub struct AdminArgs {
    /// What to do.
    #[command(subcommand)]
    command: Option<AdminCommand>,
    #[command(flatten)]
    remote: Remote,
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

/// Runs `lanebus admin ...`.
///
/// # Errors
/// A bad config file, an unreachable node, an error answer.
pub async fn run(args: AdminArgs) -> anyhow::Result<ExitCode> {
    let Some(command) = args.command.clone() else {
        bail!("lanebus admin needs a command: lanes, cluster, handlers, dead-letters, disable, enable or remove (see --help)");
    };
    let output = args.remote.output;
    let client = args.remote.client()?;
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
    client.print(output, text, table)
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

fn dead_letters_table(body: &Value) -> String {
    let rows = body["dead_letters"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| {
            let fields = [
                "id",
                "handler_id",
                "event_id",
                "event_type",
                "key",
                "seq",
                "attempts",
                "failed_at",
            ];
            let mut row = cells(d, &fields);
            row.push(one_line(&d["last_error"], 80));
            row
        });
    let header = "ID HANDLER EVENT TYPE KEY SEQ ATTEMPTS FAILED_AT LAST_ERROR";
    let mut out = grid(header, &[-8, 36, 30, 20, 16, -5, -8, 25, 0], rows);
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
    fn cluster_and_dead_letters_tables() {
        let c = serde_json::json!({"node_id": "2", "leader": "1", "term": 4, "nodes": [
            {"id": "1", "raft_addr": "127.0.0.1:9080", "http_addr": "127.0.0.1:8080", "voter": true, "alive": true, "lanes": 128},
            {"id": "2", "raft_addr": null, "http_addr": null, "voter": false, "alive": false, "lanes": 0}]});
        let t = cluster_table(&c);
        assert!(t.starts_with("answered by 2, leader 1, term 4\n"), "{t}");
        assert!(t.lines().nth(2).unwrap().contains("leader"), "{t}");
        assert!(t.lines().nth(3).unwrap().contains(" NO "), "{t}");
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
