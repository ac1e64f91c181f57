//! `lanebus events` and `lanebus handlers`: the `/v1` API from a shell,
//! without curl.
//!
//! ```text
//! lanebus events get ID                 GET    /v1/events/{id}
//! lanebus events publish --type T [--key K] [--id ID] [--deliver-at TIME] [--expected-seq N] --data JSON|@FILE|-
//!                                       POST   /v1/events
//! lanebus handlers list                 GET    /v1/handlers
//! lanebus handlers get H                GET    /v1/handlers/{id}
//! lanebus handlers create NAME --url URL --route T[,T...] [--max-attempts N] [--timeout-ms MS]
//!                         [--max-in-flight N] [--secret S] [--rate-limit N [--burst N]]
//!                                       POST   /v1/handlers
//! lanebus handlers delete H             DELETE /v1/handlers/{id}
//! lanebus handlers deliveries H [--state pending|dead|completed] [--key K] [--after CURSOR] [--limit N]
//!                                       GET    /v1/handlers/{id}/deliveries
//! ```
//!
//! The flags `--node`, `--token`, `--output`, `--config` and the exit
//! status are those of every API command ([`crate::client`]). A handler
//! `H` is named by id (`hdl_...`) or by name. Tables show the fields listed
//! in docs/api.md and ignore others; `--output json` prints the API's
//! answer unchanged, fields added later included.

use std::fmt::Write as _;
use std::io::Read as _;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::client::{cells, fields_table, grid, handlers_table, one_line, path, text, Remote};

/// `lanebus events ...`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    #[command(subcommand)]
    command: EventsCommand,
    #[command(flatten)]
    remote: Remote,
}

#[derive(Debug, Subcommand)]
enum EventsCommand {
    /// Where an event's deliveries stand, per handler ("why didn't my
    /// webhook arrive?"): pending (failed attempts so far, time of the next
    /// attempt, last error), completed (when, after how many attempts) or
    /// dead_lettered (when, last error). An event no longer stored is an
    /// error saying why, as the node tells: pruned past the retention
    /// period (410, for a generated id older than the period) or not found
    /// (404).
    Get {
        /// Event id, as published (`ids` of the publish answer).
        id: String,
    },
    /// Publishes one event; prints its id.
    Publish(PublishArgs),
}

#[derive(Debug, Args)]
struct PublishArgs {
    /// Event type, such as `issues.opened`: 1 to 128 characters of
    /// `A-Z a-z 0-9 . _ : / -`.
    #[arg(long = "type", value_name = "TYPE")]
    event_type: String,
    /// Ordering key, 1 to 256 bytes without control characters: a key's
    /// events are delivered in publish order. No key, no ordering.
    #[arg(long)]
    key: Option<String>,
    /// Event id, 1 to 128 printable ASCII characters: an id already stored
    /// is not published again [default: a UUIDv7 made by the node].
    #[arg(long)]
    id: Option<String>,
    /// Deliver no sooner than this time: RFC 3339 such as
    /// `2026-12-01T09:00:00Z`, at most 7 days ahead.
    #[arg(long, value_name = "TIME")]
    deliver_at: Option<String>,
    /// Publish only if the key's last sequence number is N (0: the key has
    /// no event yet); otherwise the node answers `409 conflict` with the
    /// key's `current_seq` and stores nothing. Needs `--key`.
    #[arg(long, value_name = "N", requires = "key", allow_hyphen_values = true)]
    expected_seq: Option<u64>,
    /// The payload, any JSON value, sent byte for byte (at most 1 MiB):
    /// the JSON itself (`'{"n": 1}'`), `@FILE` to read it from a file, or
    /// `-` to read it from standard input.
    #[arg(long, value_name = "JSON|@FILE|-")]
    data: String,
}

/// `lanebus handlers ...`.
#[derive(Debug, Args)]
pub struct HandlersArgs {
    #[command(subcommand)]
    command: HandlersCommand,
    #[command(flatten)]
    remote: Remote,
}

#[derive(Debug, Subcommand)]
enum HandlersCommand {
    /// Every handler: id, name, state (and why disabled), rate limit,
    /// routes, URL.
    List,
    /// One handler, every field (its signing secret included).
    Get {
        /// The handler (id `hdl_...` or name).
        handler: String,
    },
    /// Registers a handler: events whose type matches a route are
    /// delivered to its URL. Prints the handler with its id and signing
    /// secret.
    Create(CreateArgs),
    /// Deletes a handler with its pending deliveries and dead letters;
    /// prints how many were discarded.
    Delete {
        /// The handler (id `hdl_...` or name).
        handler: String,
    },
    /// A handler's deliveries in one state, newest first, one page at a
    /// time (the next with `--after`).
    Deliveries(DeliveriesArgs),
}

/// The body of `POST /v1/handlers` but `rate_limit` (two flags).
#[derive(Debug, Args, Serialize)]
struct CreateArgs {
    /// Name, 1 to 128 characters (other commands accept it for the id
    /// while it is unique).
    name: String,
    /// Where deliveries are sent: an absolute `http` or `https` URL,
    /// without credentials (`user:password@`); loopback, private and
    /// link-local addresses are refused unless the node allows them.
    #[arg(long)]
    url: String,
    /// Route: an event type, or a prefix with one trailing `*`
    /// (`invoice.*`, `*`); repeat the flag or separate with commas, 1 to
    /// 100 routes.
    #[arg(
        long = "route",
        value_name = "TYPE",
        required = true,
        value_delimiter = ','
    )]
    #[serde(rename = "event_types")]
    routes: Vec<String>,
    /// Attempts before a delivery becomes a dead letter, 1 to 100 [default:
    /// 8].
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_attempts: Option<u32>,
    /// Timeout of one attempt, in milliseconds, 100 to 300,000 [default:
    /// 10,000].
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    timeout_ms: Option<u64>,
    /// Concurrent attempts per node, 1 to 10,000 [default: 64].
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_in_flight: Option<u32>,
    /// Signing secret, `whsec_` + base64 of 24 to 64 bytes [default: one
    /// generated by the node].
    #[arg(long, value_name = "SECRET")]
    #[serde(skip_serializing_if = "Option::is_none")]
    secret: Option<String>,
    /// Requests per second each node sends to the handler at most
    /// [default: no limit].
    #[arg(long, value_name = "PER_SECOND")]
    #[serde(skip)]
    rate_limit: Option<u32>,
    /// Burst of the rate limit, in requests [default: `--rate-limit`].
    #[arg(long, value_name = "N", requires = "rate_limit")]
    #[serde(skip)]
    burst: Option<u32>,
}

#[derive(Debug, Args)]
struct DeliveriesArgs {
    /// The handler (id `hdl_...` or name).
    handler: String,
    /// Which deliveries: `pending` (not yet delivered: failed attempts so
    /// far, next attempt), `dead` (dead letters) or `completed` (delivered,
    /// within the node's retention period) [default: pending].
    #[arg(long, value_enum)]
    state: Option<State>,
    /// Only this ordering key's events.
    #[arg(long)]
    key: Option<String>,
    /// The next page: the `more: --after CURSOR` of the page before (same
    /// `--state`).
    #[arg(long, value_name = "CURSOR")]
    after: Option<String>,
    /// Page size, 1 to 1,000 [default: 100].
    #[arg(long, value_name = "N")]
    limit: Option<u32>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum State {
    Pending,
    Dead,
    Completed,
}

/// The event fields of `GET /v1/events/{id}`, in the order shown.
const EVENT_FIELDS: &[&str] = &[
    "id",
    "type",
    "key",
    "seq",
    "lane",
    "published_at",
    "payload_bytes",
];

/// The fields of a handler, in the order shown (others follow by name).
const HANDLER_FIELDS: &[&str] = &[
    "id",
    "name",
    "url",
    "event_types",
    "state",
    "state_reason",
    "state_changed_at",
    "failing_since",
    "max_attempts",
    "timeout_ms",
    "max_in_flight",
    "rate_limit",
    "created_at",
    "secret",
    "previous_secret_until",
];

/// Runs `lanebus events ...`.
///
/// # Errors
/// Bad `--data`, a bad config file, an unreachable node, an error answer.
pub async fn events(args: EventsArgs) -> anyhow::Result<ExitCode> {
    let output = args.remote.output;
    match args.command {
        EventsCommand::Get { id } => {
            let client = args.remote.client()?;
            let answer = client.get(&path(&["v1", "events", &id])?).await?;
            client.print(output, answer, event_table)
        }
        EventsCommand::Publish(p) => {
            // Read before the client: bad input is refused without a node.
            let payload = payload(&p.data)?;
            let client = args.remote.client()?;
            // A struct, not `json!`: a `Value` would rewrite the payload
            // (`1.50` as `1.5`; key order without `preserve_order`).
            let body = PublishBody {
                events: [EventBody {
                    event_type: &p.event_type,
                    key: p.key.as_deref(),
                    id: p.id.as_deref(),
                    deliver_at: p.deliver_at.as_deref(),
                    expected_seq: p.expected_seq,
                    payload,
                }],
            };
            let answer = client
                .call(reqwest::Method::POST, "/v1/events", Some(&body))
                .await?;
            client.print(output, answer, |b| {
                let id = text(&b["ids"][0]);
                if b["accepted"] == 1 {
                    format!("published event {id}\n")
                } else {
                    format!("event {id} was already stored: not published again\n")
                }
            })
        }
    }
}

/// `POST /v1/events` with one event.
#[derive(Serialize)]
struct PublishBody<'a> {
    events: [EventBody<'a>; 1],
}

/// One event of `POST /v1/events`, its payload as written.
#[derive(Serialize)]
struct EventBody<'a> {
    #[serde(rename = "type")]
    event_type: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deliver_at: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expected_seq: Option<u64>,
    payload: Box<RawValue>,
}

/// `--data`: the JSON itself, `@FILE` or `-` (standard input), checked to
/// be one JSON value and kept as written.
fn payload(data: &str) -> anyhow::Result<Box<RawValue>> {
    let (json, from) = if data == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("--data -: cannot read standard input as UTF-8 text")?;
        (s, "standard input (--data -)".to_string())
    } else if let Some(file) = data.strip_prefix('@') {
        let s = std::fs::read_to_string(file)
            .with_context(|| format!("--data @{file}: cannot read {file:?}"))?;
        (s, format!("file {file:?} (--data @{file})"))
    } else {
        (data.to_string(), "--data".to_string())
    };
    RawValue::from_string(json.trim().to_string()).map_err(|e| {
        anyhow::anyhow!(
            "{from} is not JSON ({e}): give a JSON value such as '{{\"n\": 1}}' or '\"text\"', @FILE or - for standard input"
        )
    })
}

/// Runs `lanebus handlers ...`.
///
/// # Errors
/// A bad config file, an unreachable node, an unknown handler name, an
/// error answer.
pub async fn handlers(args: HandlersArgs) -> anyhow::Result<ExitCode> {
    let output = args.remote.output;
    let client = args.remote.client()?;
    match args.command {
        HandlersCommand::List => {
            let answer = client.get("/v1/handlers").await?;
            client.print(output, answer, handlers_table)
        }
        HandlersCommand::Get { handler } => {
            let id = client.handler_id(&handler).await?;
            let answer = client.get(&path(&["v1", "handlers", &id])?).await?;
            client.print(output, answer, handler_fields)
        }
        HandlersCommand::Create(c) => {
            let mut body = serde_json::to_value(&c)?;
            if let Some(per_second) = c.rate_limit {
                body["rate_limit"] = serde_json::json!({ "per_second": per_second });
                if let Some(burst) = c.burst {
                    body["rate_limit"]["burst"] = burst.into();
                }
            }
            let answer = client.post("/v1/handlers", Some(body)).await?;
            client.print(output, answer, handler_fields)
        }
        HandlersCommand::Delete { handler } => {
            let id = client.handler_id(&handler).await?;
            let answer = client
                .call::<Value>(
                    reqwest::Method::DELETE,
                    &path(&["v1", "handlers", &id])?,
                    None,
                )
                .await?;
            client.print(output, answer, |b| {
                format!(
                    "deleted handler {id}: {} pending deliveries and {} dead letters discarded\n",
                    text(&b["discarded_deliveries"]),
                    text(&b["discarded_dead_letters"])
                )
            })
        }
        HandlersCommand::Deliveries(d) => {
            let id = client.handler_id(&d.handler).await?;
            let mut query = url::form_urlencoded::Serializer::new(String::new());
            if let Some(s) = d.state {
                query.append_pair("state", s.to_possible_value().expect("a value").get_name());
            }
            if let Some(k) = &d.key {
                query.append_pair("key", k);
            }
            if let Some(a) = &d.after {
                query.append_pair("after", a);
            }
            if let Some(l) = d.limit {
                query.append_pair("limit", &l.to_string());
            }
            let query = query.finish();
            let mut p = path(&["v1", "handlers", &id, "deliveries"])?;
            if !query.is_empty() {
                p = format!("{p}?{query}");
            }
            let answer = client.get(&p).await?;
            client.print(output, answer, deliveries_table)
        }
    }
}

fn handler_fields(body: &Value) -> String {
    fields_table(body, HANDLER_FIELDS, &[])
}

/// The time that goes with a delivery's state: the next attempt
/// (pending), the completion, the dead letter.
fn when(d: &Value) -> String {
    ["next_attempt_at", "completed_at", "failed_at"]
        .iter()
        .map(|f| &d[*f])
        .find(|v| !v.is_null())
        .map_or_else(|| "-".to_string(), text)
}

/// The event's fields, then one row per handler with a record of it.
fn event_table(body: &Value) -> String {
    let mut out = fields_table(body, EVENT_FIELDS, &["handlers"]);
    let handlers = body["handlers"].as_array().cloned().unwrap_or_default();
    if handlers.is_empty() {
        out.push_str(
            "\nno handler has a delivery of this event (none matched its type when it was published, or they were deleted)\n",
        );
        return out;
    }
    out.push('\n');
    let rows = handlers.iter().map(|h| {
        let mut row = cells(h, &["handler_id", "handler_name", "state", "attempts"]);
        row.extend([when(h), one_line(&h["last_error"], 160)]);
        row
    });
    let header = "HANDLER NAME STATE ATTEMPTS WHEN LAST_ERROR";
    out + &grid(header, &[36, 16, 14, -8, 30, 0], rows)
}

/// One page of a handler's deliveries; the cursor of the next page.
fn deliveries_table(body: &Value) -> String {
    let deliveries = body["deliveries"].as_array().into_iter().flatten();
    let rows = deliveries.map(|d| {
        let mut row = cells(d, &["event_id", "type", "key", "seq", "state", "attempts"]);
        // A dead letter's id, for `lanebus admin dead-letters replay ID`.
        if !d["dead_letter_id"].is_null() {
            row[4] = format!("{} #{}", row[4], text(&d["dead_letter_id"]));
        }
        row.extend([when(d), one_line(&d["last_error"], 160)]);
        row
    });
    let header = "EVENT TYPE KEY SEQ STATE ATTEMPTS WHEN LAST_ERROR";
    let mut out = grid(header, &[36, 20, 16, -5, 18, -8, 30, 0], rows);
    if let Some(next) = body["next_after"].as_str() {
        let _ = writeln!(out, "more: --after {next}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::row_of;

    #[test]
    fn data_is_json_a_file_or_a_clear_error() {
        assert_eq!(
            payload(r#" {"b": 1, "a": [2]} "#).unwrap().get(),
            r#"{"b": 1, "a": [2]}"#
        );
        let err = payload("{not json").unwrap_err().to_string();
        assert!(
            err.starts_with("--data is not JSON (") && err.contains("@FILE"),
            "{err}"
        );
        let err = payload("@/nonexistent/lanebus.json").unwrap_err();
        assert!(
            format!("{err:#}").contains("cannot read \"/nonexistent/lanebus.json\""),
            "{err:#}"
        );
        let f = std::env::temp_dir().join(format!("lanebus-data-{}.json", std::process::id()));
        std::fs::write(&f, "[1, 2]\n").unwrap();
        assert_eq!(
            payload(&format!("@{}", f.display())).unwrap().get(),
            "[1, 2]"
        );
        std::fs::write(&f, "[1, 2] 3").unwrap();
        let err = payload(&format!("@{}", f.display()))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("file ") && err.contains("is not JSON"),
            "{err}"
        );
        let _ = std::fs::remove_file(f);
    }

    #[test]
    fn tables_show_each_state_with_its_time_and_ignore_new_fields() {
        let e = serde_json::json!({"id": "e1", "type": "t", "key": null, "seq": null, "lane": 3,
            "published_at": "2026-01-01T00:00:00Z", "payload_bytes": 7, "handlers": [
            {"handler_id": "hdl_1", "handler_name": "a", "state": "pending", "attempts": 2,
             "next_attempt_at": "2026-01-01T00:00:09Z", "last_error": "HTTP 500\nno", "completed_at": null,
             "failed_at": null, "attempt_log": [{"status": 500}]},
            {"handler_id": "hdl_2", "handler_name": null, "state": "completed", "attempts": 1,
             "next_attempt_at": null, "last_error": null, "completed_at": "2026-01-01T00:00:01Z", "failed_at": null}]});
        let t = event_table(&e);
        for (start, parts) in [
            ("id ", &[" e1"][..]),
            ("lane ", &[" 3"]),
            ("hdl_1 ", &[" pending ", " 2 ", "00:00:09Z", "HTTP 500 no"]),
            ("hdl_2 ", &[" completed ", " 1 ", "00:00:01Z"]),
        ] {
            let row = row_of(&t, start);
            assert!(parts.iter().all(|p| row.contains(p)), "{start}: {t}");
        }
        assert!(!t.contains("attempt_log") && !t.contains("handlers"), "{t}");

        let d = serde_json::json!({"next_after": "abc_-", "deliveries": [
            {"event_id": "e1", "type": "t", "key": "k", "seq": 4, "lane": 1, "state": "dead_lettered",
             "attempts": 3, "next_attempt_at": null, "last_error": "timeout", "completed_at": null,
             "failed_at": "2026-01-01T00:00:02Z", "dead_letter_id": 17}]});
        let t = deliveries_table(&d);
        assert!(
            t.contains(" dead_lettered #17 ") && t.contains("00:00:02Z"),
            "{t}"
        );
        assert!(t.ends_with("more: --after abc_-\n"), "{t}");
    }
}
