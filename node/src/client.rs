//! What the API commands (`lanebus admin`, `lanebus events`, `lanebus
//! handlers`) share: where the node is and how to authenticate
//! ([`Remote`]), the HTTP client with its error messages ([`Client`]), and
//! the output helpers.
//!
//! `--node` (or `LANEBUS_NODE`, or `node` in the `--config` TOML file) is
//! any node's base URL, `http://127.0.0.1:8080` by default. `--token` (or
//! `LANEBUS_TOKEN`, or `token` in the file) is sent as `Authorization:
//! Bearer`, for nodes with tokens configured. `--output json` prints the
//! API's JSON answer as it came; `table` (the default) a table for people.
//!
//! Exit status: 0, or 1 with `error: ...` on stderr when the node cannot be
//! reached or answers an error (its status, `code` and `message` are
//! printed). A closed standard output (`| head`) ends the command quietly.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config;

/// The node to talk to, the token, the output format: flags of every API
/// command (`global`, so they go before or after the subcommand).
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Node and output")]
#[serde(deny_unknown_fields)]
pub struct Remote {
    /// TOML config file (keys `node`, `token`; unknown keys are an error).
    #[arg(long, global = true, env = "LANEBUS_ADMIN_CONFIG")]
    #[serde(skip)]
    config: Option<std::path::PathBuf>,
    /// Base URL of any node's HTTP API [default: http://127.0.0.1:8080].
    #[arg(long, global = true, env = "LANEBUS_NODE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    node: Option<String>,
    /// API token, sent as `Authorization: Bearer TOKEN` (for nodes with
    /// tokens configured): an admin token, or a publish token for
    /// `lanebus events publish`.
    #[arg(long, global = true, env = "LANEBUS_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<String>,
    /// `table` for people, `json` for the API's answer as it came.
    #[arg(long, global = true, value_enum, default_value_t = Output::Table)]
    #[serde(skip)]
    pub output: Output,
}

impl Remote {
    /// The client these flags (layered over the `--config` file) describe.
    ///
    /// # Errors
    /// A bad config file, a `--node` that is not an `http(s)://` URL.
    pub fn client(&self) -> anyhow::Result<Client> {
        lanebus_node::webhook::install_crypto_provider();
        let args: Remote = config::layered(self, self.config.as_deref())?;
        let base = args
            .node
            .unwrap_or_else(|| "http://127.0.0.1:8080".to_string())
            .trim_end_matches('/')
            .to_string();
        if !base.starts_with("http://") && !base.starts_with("https://") {
            bail!("--node must be a URL such as http://127.0.0.1:8080, got {base:?}");
        }
        Ok(Client {
            base,
            token: args.token.filter(|t| !t.is_empty()),
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .timeout(Duration::from_secs(60))
                .build()
                .context("http client")?,
        })
    }
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

/// A node's HTTP API.
pub struct Client {
    pub base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// Sends `method path` (with `body` as JSON); the answer's text when it
    /// is a success, else the API's status, error code and message.
    pub async fn call<B: Serialize + ?Sized>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&B>,
    ) -> anyhow::Result<String> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.request(method.clone(), &url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(b);
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

    /// `GET path`.
    pub async fn get(&self, path: &str) -> anyhow::Result<String> {
        self.call::<Value>(reqwest::Method::GET, path, None).await
    }

    /// `POST path` with an optional JSON body.
    pub async fn post(&self, path: &str, body: Option<Value>) -> anyhow::Result<String> {
        self.call(reqwest::Method::POST, path, body.as_ref()).await
    }

    /// A handler's id from its id or name.
    pub async fn handler_id(&self, handler: &str) -> anyhow::Result<String> {
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

    /// Prints a successful answer: as it came (`json`) or through `table`.
    ///
    /// # Errors
    /// A `table` answer that is not JSON; a standard output that fails.
    pub fn print(
        &self,
        output: Output,
        text: String,
        table: impl FnOnce(&Value) -> String,
    ) -> anyhow::Result<ExitCode> {
        let out = match output {
            Output::Json => with_newline(text),
            Output::Table => {
                let body: Value = serde_json::from_str(&text)
                    .with_context(|| format!("{}: the answer is not JSON", self.base))?;
                table(&body)
            }
        };
        emit(&out)
    }
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

/// `/a/b/c` from its segments, each percent-encoded (an event id may hold
/// `/`, `?`, `#` or `%`).
///
/// # Errors
/// A segment `.` or `..` (valid event ids): URLs resolve them, encoded or
/// not (WHATWG URL Standard, "single-dot/double-dot URL path segment"), so
/// no request reaches such an id.
pub fn path(segments: &[&str]) -> anyhow::Result<String> {
    if let Some(dots) = segments.iter().find(|s| matches!(**s, "." | "..")) {
        bail!("{dots:?} cannot be named in a URL path (a URL resolves it as a directory step)");
    }
    let mut u = url::Url::parse("http://x/").expect("a valid URL");
    u.path_segments_mut()
        .expect("an http URL has a path")
        .pop_if_empty()
        .extend(segments);
    Ok(u.path().to_string())
}

/// `s` with a newline at the end.
pub fn with_newline(mut s: String) -> String {
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// Writes `out` to standard output; a closed pipe (`| head`) is not an
/// error.
pub fn emit(out: &str) -> anyhow::Result<ExitCode> {
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

/// A JSON value as a table cell: `-` for `null`, strings without quotes,
/// string arrays comma-joined, anything else as compact JSON.
pub fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.iter().all(Value::is_string) && !a.is_empty() => a
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(","),
        other => other.to_string(),
    }
}

/// [`text`] on one line (control characters as spaces), at most `max`
/// characters: for error messages that carry a response body.
pub fn one_line(v: &Value, max: usize) -> String {
    text(v)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(max)
        .collect()
}

/// A table: the `header` (column names separated by spaces), then a line
/// per row of cells; a column is padded to its width in `widths` (a
/// negative width aligns right), the last one is not.
pub fn grid(header: &str, widths: &[i16], rows: impl IntoIterator<Item = Vec<String>>) -> String {
    let header = header.split_whitespace().map(str::to_string).collect();
    let mut out = String::new();
    for cells in std::iter::once(header).chain(rows) {
        for (i, (cell, width)) in cells.iter().zip(widths).enumerate() {
            let w = usize::from(width.unsigned_abs());
            let sep = if i > 0 { " " } else { "" };
            let _ = match (i + 1 == widths.len(), *width < 0) {
                (true, _) => write!(out, "{sep}{cell}"),
                (false, true) => write!(out, "{sep}{cell:>w$}"),
                (false, false) => write!(out, "{sep}{cell:<w$}"),
            };
        }
        out.push('\n');
    }
    out
}

/// The cells of `fields` of `row`, as [`text`].
pub fn cells(row: &Value, fields: &[&str]) -> Vec<String> {
    fields.iter().map(|f| text(&row[*f])).collect()
}

/// Handlers as rows: id, name, state (and why disabled, or failing), rate
/// limit, routes, URL; dead-letter counts when the answer has them
/// (`GET /admin/handlers`, lower bounds marked `>=`, not `GET /v1/handlers`).
pub fn handlers_table(body: &Value) -> String {
    let counted = !body["dead_letters_exact"].is_null();
    let exact = body["dead_letters_exact"] != false;
    let (header, widths): (&str, &[i16]) = if counted {
        (
            "ID NAME STATE RATE DEAD_LETTERS EVENT_TYPES FILTER URL",
            &[36, 16, 18, 10, -12, 24, 24, 0],
        )
    } else {
        (
            "ID NAME STATE RATE EVENT_TYPES FILTER URL",
            &[36, 16, 18, 10, 24, 24, 0],
        )
    };
    let rows = body["handlers"].as_array().into_iter().flatten().map(|h| {
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
        let mut cells = vec![text(&h["id"]), text(&h["name"]), state, rate];
        if counted {
            let at_least = if exact { "" } else { ">=" };
            cells.push(format!("{at_least}{}", text(&h["dead_letters"])));
        }
        // The payload filter as compact JSON; `-` for none.
        let filter = match &h["filter"] {
            Value::Null => "-".to_owned(),
            f => f.to_string(),
        };
        cells.extend([text(&h["event_types"]), filter, text(&h["url"])]);
        cells
    });
    grid(header, widths, rows)
}

/// One object as `field  value` lines: the fields of `first` in that
/// order, then any other field (one added to the API later) by name;
/// the fields of `skip` are left out (printed as a table of their own).
pub fn fields_table(body: &Value, first: &[&str], skip: &[&str]) -> String {
    let Some(obj) = body.as_object() else {
        return with_newline(body.to_string());
    };
    let mut rest: Vec<&str> = obj
        .keys()
        .map(String::as_str)
        .filter(|k| !first.contains(k) && !skip.contains(k))
        .collect();
    rest.sort_unstable();
    let names: Vec<&str> = first
        .iter()
        .copied()
        .filter(|k| obj.contains_key(*k))
        .chain(rest)
        .collect();
    let width = names.iter().map(|n| n.len()).max().unwrap_or(0);
    let mut out = String::new();
    for name in names {
        let _ = writeln!(out, "{name:<width$}  {}", one_line(&obj[name], 500));
    }
    out
}

/// The line of `table` that starts with `start` (tests).
#[cfg(test)]
pub fn row_of(table: &str, start: &str) -> String {
    table
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no row {start:?} in\n{table}"))
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handlers_table_shows_state_rate_and_dead_letters_when_counted() {
        let h = serde_json::json!({"dead_letters_exact": false, "handlers": [
            {"id": "hdl_1", "name": "a", "url": "http://x", "event_types": ["a.*", "b"], "state": "enabled",
             "state_reason": null, "failing_since": null, "rate_limit": null, "dead_letters": 3},
            {"id": "hdl_2", "name": "b", "url": "http://y", "event_types": ["*"], "state": "disabled",
             "state_reason": "gone", "failing_since": null, "rate_limit": {"per_second": 5, "burst": 5}, "dead_letters": 0},
            {"id": "hdl_3", "name": "c", "url": "http://z", "event_types": ["*"], "state": "enabled",
             "state_reason": null, "failing_since": "2026-01-01T00:00:00Z", "rate_limit": null, "dead_letters": 0,
             "filter": {"path": "/n", "gt": 1}}]});
        let t = handlers_table(&h);
        assert!(
            t.contains(">=3") && t.contains("a.*,b") && t.contains("DEAD_LETTERS"),
            "{t}"
        );
        let row = |id: &str| row_of(&t, id);
        assert!(
            row("hdl_1 ").contains(" enabled ") && row("hdl_1 ").contains(" - "),
            "{t}"
        );
        assert!(
            row("hdl_2 ").contains("disabled (gone)") && row("hdl_2 ").contains(" 5/s "),
            "{t}"
        );
        assert!(row("hdl_3 ").contains("enabled, failing"), "{t}");
        assert!(row("hdl_3 ").contains(r#"{"path":"/n","gt":1}"#), "{t}");
        assert!(t.contains(" FILTER "), "{t}");
        // GET /v1/handlers counts no dead letters: no such column.
        let mut v1 = h.clone();
        v1.as_object_mut()
            .expect("object")
            .remove("dead_letters_exact");
        let t = handlers_table(&v1);
        assert!(!t.contains("DEAD_LETTERS") && !t.contains(">=3"), "{t}");
    }

    #[test]
    fn fields_table_lists_known_fields_first_then_new_ones() {
        let body = serde_json::json!({"zeta": {"a": 1}, "name": "n", "id": "hdl_1",
            "event_types": ["a", "b"], "last_error": "HTTP 500\nbody", "handlers": []});
        let t = fields_table(&body, &["id", "name", "missing"], &["handlers"]);
        let names: Vec<&str> = t
            .lines()
            .map(|l| l.split_whitespace().next().unwrap_or(""))
            .collect();
        assert_eq!(names, ["id", "name", "event_types", "last_error", "zeta"]);
        assert!(t.contains("a,b") && t.contains("HTTP 500 body") && t.contains(r#"{"a":1}"#));
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        let p = |s: &[&str]| path(s).map_err(|e| e.to_string());
        assert_eq!(
            p(&["v1", "events", "a/b?c#d%e f"]).as_deref(),
            Ok("/v1/events/a%2Fb%3Fc%23d%25e%20f")
        );
        assert_eq!(p(&["v1", "handlers"]).as_deref(), Ok("/v1/handlers"));
        assert!(p(&["v1", "events", ".."]).is_err_and(|e| e.contains("cannot be named")));
    }
}
