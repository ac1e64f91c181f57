//! `lanebus events` and `lanebus handlers` against a running node, as a
//! user runs them:
//!
//! - handlers created, listed, read and deleted through the CLI, each
//!   `--output json` equal to the API's answer to the same GET;
//! - an event published with `--data @FILE` reaches the receiver with its
//!   payload byte for byte; `--data -` reads standard input; an id holding
//!   `/` and `?` is looked up (percent-encoded);
//! - `events get` shows each handler's state: completed, completed after
//!   two failed attempts, dead-lettered;
//! - `handlers deliveries` per state, by key, paged with `--after`;
//! - bad input (`--data` not JSON, a missing file, an unknown handler, an
//!   API 4xx, a node that is down) is a clear message and exit status 1;
//!   an event pruned past retention says so;
//! - a publish token publishes, and is refused on the admin paths.

mod common;

use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use common::{cli, cli_json, cli_ok, start_node, stderr, test_options, Api, Backend, TestDb};
use lanebus_api::auth::{hash_token, Auth, Scope};
use lanebus_node::NodeHandle;
use lanebus_testkit::local_cluster::free_port;
use lanebus_testkit::receiver::{Action, Receiver, Rule};
use serde_json::Value;

/// A node on a fresh SQLite database `name`, and its base URL.
async fn sqlite_node(name: &str) -> anyhow::Result<(TestDb, NodeHandle, String)> {
    let db = TestDb::new(Backend::Sqlite, name).await?;
    let node = start_node(&db.url).await?;
    let url = node.base_url();
    Ok((db, node, url))
}

/// Stops `node`, drops `db`.
async fn stop(db: TestDb, node: NodeHandle) -> anyhow::Result<()> {
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}

/// `lanebus ARGS --node URL`, wanting success: its standard output.
async fn ok(url: &str, args: &[&str]) -> anyhow::Result<String> {
    cli_ok(&[args, &["--node", url]].concat()).await
}

/// [`ok`] with `--output json`, parsed.
async fn json(url: &str, args: &[&str]) -> anyhow::Result<Value> {
    cli_json(&[args, &["--node", url, "--output", "json"]].concat()).await
}

/// `lanebus ARGS --node URL`, wanting exit status 1 and nothing on
/// standard output: its standard error.
async fn fails(url: &str, args: &[&str], stdin: Option<&[u8]>) -> anyhow::Result<String> {
    let o = cli(&[args, &["--node", url]].concat(), &[], stdin).await?;
    let err = stderr(&o);
    ensure!(
        o.status.code() == Some(1) && o.stdout.is_empty() && err.starts_with("error: "),
        "{args:?}: {o:?}"
    );
    ensure!(!err.contains("panicked"), "{err}");
    Ok(err)
}

/// The row of `table` that starts with `start`.
fn row<'a>(table: &'a str, start: &str) -> anyhow::Result<&'a str> {
    table
        .lines()
        .find(|l| l.starts_with(start))
        .with_context(|| format!("no row {start:?} in\n{table}"))
}

/// Waits until `GET /v1/events/{id}` shows `n` handlers in a final state.
async fn wait_settled(api: &Api, path: &str, n: usize) -> anyhow::Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, v) = api.get(path).await?;
        let settled = v["handlers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|h| h["state"] != "pending")
            .count();
        if status == 200 && settled == n {
            return Ok(v);
        }
        ensure!(
            Instant::now() < deadline,
            "{path}: not settled in 60 s: {status} {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_and_events_through_the_cli() -> anyhow::Result<()> {
    let (db, node, url) = sqlite_node("api_cli").await?;
    let api = Api::new(&url);
    let rx = Receiver::start().await?;
    // flaky: 500 twice per event, then 200; broken: always 503.
    for (handler, action) in [
        (
            "flaky",
            Action::FailFirst {
                n: 2,
                status: 500,
                retry_after: None,
            },
        ),
        (
            "broken",
            Action::Status {
                status: 503,
                retry_after: None,
            },
        ),
    ] {
        let handler = Some(handler.to_string());
        rx.add_rule(Rule {
            handler,
            key: None,
            action,
        });
    }

    // Create: every flag reaches the API; the table shows the secret.
    let ok_h = json(
        &url,
        &[
            "handlers",
            "create",
            "ok",
            "--url",
            &rx.url("ok"),
            "--route",
            "order.*",
        ],
    )
    .await?;
    let (_, stored) = api
        .get(&format!(
            "/v1/handlers/{}",
            ok_h["id"].as_str().context("id")?
        ))
        .await?;
    ensure!(
        ok_h == stored,
        "create --output json: {ok_h}\nGET: {stored}"
    );
    let flaky = ok(
        &url,
        &[
            "handlers",
            "create",
            "flaky",
            "--url",
            &rx.url("flaky"),
            "--route",
            "order.paid,ping",
            "--max-attempts",
            "5",
            "--timeout-ms",
            "2000",
            "--max-in-flight",
            "7",
            "--rate-limit",
            "100",
            "--burst",
            "200",
        ],
    )
    .await?;
    let flaky_id = row(&flaky, "id ")?
        .split_whitespace()
        .nth(1)
        .context("id")?
        .to_string();
    ensure!(row(&flaky, "secret ")?.contains(" whsec_"), "{flaky}");
    let (_, f) = api.get(&format!("/v1/handlers/{flaky_id}")).await?;
    ensure!(
        f["name"] == "flaky"
            && f["event_types"] == serde_json::json!(["order.paid", "ping"])
            && f["max_attempts"] == 5
            && f["timeout_ms"] == 2000
            && f["max_in_flight"] == 7
            && f["rate_limit"] == serde_json::json!({"per_second": 100, "burst": 200}),
        "{f}"
    );
    ok(
        &url,
        &[
            "handlers",
            "create",
            "broken",
            "--url",
            &rx.url("broken"),
            "--route",
            "order.*",
            "--max-attempts",
            "1",
        ],
    )
    .await?;

    // List and get: JSON as the API answers, tables by name.
    let (_, want) = api.get("/v1/handlers").await?;
    ensure!(json(&url, &["handlers", "list"]).await? == want);
    let list = ok(&url, &["handlers", "list"]).await?;
    ensure!(list.lines().count() == 4, "{list}");
    ensure!(
        row(&list, &flaky_id)?.contains(" flaky ")
            && row(&list, &flaky_id)?.contains(" 100/s ")
            && row(&list, &flaky_id)?.contains(" order.paid,ping "),
        "{list}"
    );
    ensure!(json(&url, &["handlers", "get", "flaky"]).await? == f);
    let got = ok(&url, &["handlers", "get", &flaky_id]).await?;
    ensure!(
        row(&got, "name ")?.ends_with(" flaky") && row(&got, "max_attempts ")?.ends_with(" 5"),
        "{got}"
    );

    // Publish: from a file, byte for byte; from standard input; an id
    // that needs percent-encoding; a repeated id.
    let dir =
        std::env::temp_dir().join(format!("lanebus-api-cli-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("payload.json");
    let payload = r#"{"z": 1, "a": [1.50, 2e3], "s": "é"}"#;
    std::fs::write(&file, format!("{payload}\n"))?;
    let data = format!("@{}", file.display());
    let publish = [
        "events",
        "publish",
        "--type",
        "order.paid",
        "--key",
        "acct-1",
    ];
    let first = json(&url, &[&publish[..], &["--data", &data]].concat()).await?;
    ensure!(first["accepted"] == 1, "{first}");
    let first_id = first["ids"][0].as_str().context("ids")?.to_string();
    let from_stdin = ["--id", "evt/2?x", "--data", "-", "--node", &url];
    let stdin = Some(&br#"{"n": 2}"#[..]);
    let o = cli(&[&publish[..], &from_stdin].concat(), &[], stdin).await?;
    ensure!(
        o.status.success() && common::stdout(&o) == "published event evt/2?x\n",
        "{o:?}"
    );
    let again = ok(
        &url,
        &[
            "events",
            "publish",
            "--type",
            "order.paid",
            "--id",
            "evt/2?x",
            "--data",
            "null",
        ],
    )
    .await?;
    ensure!(
        again == "event evt/2?x was already stored: not published again\n",
        "{again}"
    );
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| log
            .iter()
            .any(|r| r.handler == "ok" && r.event_id == first_id))
            .await,
        "event {first_id} did not reach handler ok"
    );
    let body = rx
        .requests()
        .into_iter()
        .find(|r| r.handler == "ok" && r.event_id == first_id)
        .context("request")?
        .body;
    ensure!(
        body.contains(&format!(r#""data":{payload}"#)),
        "payload changed: {body}"
    );

    // Lookup: completed, completed after two failures, dead-lettered.
    let path = "/v1/events/evt%2F2%3Fx";
    let want = wait_settled(&api, path, 3).await?;
    ensure!(json(&url, &["events", "get", "evt/2?x"]).await? == want);
    let table = ok(&url, &["events", "get", "evt/2?x"]).await?;
    ensure!(
        row(&table, "id ")?.ends_with(" evt/2?x") && row(&table, "key ")?.ends_with(" acct-1"),
        "{table}"
    );
    let r = |name: &str| {
        table
            .lines()
            .find(|l| l.starts_with("hdl_") && l.split_whitespace().nth(1) == Some(name))
            .map(|l| l.split_whitespace().skip(2).collect::<Vec<_>>().join(" "))
            .with_context(|| format!("no row of {name} in\n{table}"))
    };
    ensure!(r("ok")?.starts_with("completed 1 "), "{table}");
    ensure!(r("flaky")?.starts_with("completed 3 "), "{table}");
    ensure!(
        r("broken")?.starts_with("dead_lettered 1 ") && r("broken")?.contains("503"),
        "{table}"
    );

    // Deliveries: per state, by key, paged.
    wait_settled(&api, &format!("/v1/events/{first_id}"), 3).await?;
    let broken_id = want["handlers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|h| h["handler_name"] == "broken")
        .and_then(|h| h["handler_id"].as_str())
        .context("broken")?
        .to_string();
    let (_, dead_want) = api
        .get(&format!("/v1/handlers/{broken_id}/deliveries?state=dead"))
        .await?;
    ensure!(
        json(
            &url,
            &["handlers", "deliveries", "broken", "--state", "dead"]
        )
        .await?
            == dead_want
    );
    let dead = ok(
        &url,
        &["handlers", "deliveries", "broken", "--state", "dead"],
    )
    .await?;
    ensure!(
        dead.lines().count() == 3 && row(&dead, "evt/2?x ")?.contains(" dead_lettered #"),
        "{dead}"
    );
    let page = [
        "handlers",
        "deliveries",
        "ok",
        "--state",
        "completed",
        "--key",
        "acct-1",
        "--limit",
        "1",
    ];
    let page1 = ok(&url, &page).await?;
    let cursor = page1
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("more: --after "))
        .with_context(|| format!("no cursor in\n{page1}"))?;
    ensure!(row(&page1, "evt/2?x ")?.contains(" completed "), "{page1}");
    let page2 = ok(&url, &[&page[..], &["--after", cursor]].concat()).await?;
    ensure!(
        row(&page2, &first_id).is_ok() && !page2.contains("evt/2?x"),
        "{page2}"
    );
    let pending = ok(&url, &["handlers", "deliveries", "ok"]).await?;
    ensure!(
        pending.lines().count() == 1,
        "nothing is pending: {pending}"
    );

    // Delete: the dead letter goes with the handler; the name is gone.
    let del = ok(&url, &["handlers", "delete", "broken"]).await?;
    ensure!(
        del == format!(
            "deleted handler {broken_id}: 0 pending deliveries and 2 dead letters discarded\n"
        ),
        "{del}"
    );
    ensure!(api.get(&format!("/v1/handlers/{broken_id}")).await?.0 == 404);
    let err = fails(&url, &["handlers", "get", "broken"], None).await?;
    ensure!(err.contains("no handler named \"broken\""), "{err}");

    let _ = std::fs::remove_dir_all(&dir);
    stop(db, node).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_and_error_answers_are_clear() -> anyhow::Result<()> {
    let (db, node, url) = sqlite_node("api_cli_err").await?;
    let down = format!("http://{}", free_port()?);

    // Refused before anything is sent: the node given is down, yet the
    // message is about the input.
    let publish = ["events", "publish", "--type", "t"];
    let err = fails(
        &down,
        &[&publish[..], &["--data", "{\"a\": 1"]].concat(),
        None,
    )
    .await?;
    ensure!(
        err.contains("--data is not JSON (") && err.contains("@FILE"),
        "{err}"
    );
    let err = fails(
        &down,
        &[&publish[..], &["--data", "-"]].concat(),
        Some(b"1 2"),
    )
    .await?;
    ensure!(
        err.contains("standard input (--data -) is not JSON"),
        "{err}"
    );
    let err = fails(
        &down,
        &[&publish[..], &["--data", "@/nonexistent/p.json"]].concat(),
        None,
    )
    .await?;
    ensure!(err.contains("cannot read \"/nonexistent/p.json\""), "{err}");
    let err = fails(&down, &["events", "get", ".."], None).await?;
    ensure!(err.contains("cannot be named in a URL path"), "{err}");

    // The API's 4xx: status, code and message.
    let err = fails(
        &url,
        &["events", "publish", "--type", "bad type", "--data", "1"],
        None,
    )
    .await?;
    ensure!(
        err.contains("422") && err.contains("invalid_event") && err.contains("bad type"),
        "{err}"
    );
    let err = fails(&url, &["events", "get", "nope"], None).await?;
    ensure!(err.contains("404") && err.contains("not_found"), "{err}");
    // Expected-version publish: the first at 0 holds, a second at 0 is
    // refused with where the key stands; without a key, clap refuses it.
    let stream = ["events", "publish", "--type", "t", "--key", "stream-1"];
    let at0 = [&stream[..], &["--expected-seq", "0", "--data", "1"]].concat();
    ensure!(ok(&url, &at0).await?.starts_with("published event "));
    let err = fails(&url, &at0, None).await?;
    ensure!(
        err.contains("409") && err.contains("conflict") && err.contains("at sequence 1"),
        "{err}"
    );
    // A generated id (a UUIDv7) from 2022, past the node's retention
    // period: the reason is shown.
    let old = "017f22e2-79b0-7cc3-98c4-dc0c0c07398f";
    let err = fails(&url, &["events", "get", old], None).await?;
    ensure!(
        err.contains("410")
            && err.contains("pruned")
            && err.contains(
                "its id dates from 2022-02-22T19:22:22.000Z, before the retention period (24 h)"
            ),
        "{err}"
    );
    let unknown = "hdl_0123456789abcdef0123456789abcdef";
    for args in [
        vec!["handlers", "deliveries", unknown],
        vec!["handlers", "get", unknown],
        vec!["handlers", "delete", unknown],
    ] {
        let err = fails(&url, &args, None).await?;
        ensure!(
            err.contains("404") && err.contains("not_found"),
            "{args:?}: {err}"
        );
    }
    let err = fails(&url, &["handlers", "deliveries", "nobody"], None).await?;
    ensure!(err.contains("no handler named \"nobody\""), "{err}");
    let err = fails(
        &url,
        &[
            "handlers",
            "create",
            "h",
            "--url",
            "ftp://example.com/",
            "--route",
            "a",
        ],
        None,
    )
    .await?;
    ensure!(
        err.contains("422") && err.contains("invalid_handler") && err.contains("ftp"),
        "{err}"
    );
    ensure!(
        api_handlers(&url).await? == 0,
        "a refused create stored a handler"
    );

    // Usage errors are clap's: exit status 2.
    for args in [
        vec!["handlers", "deliveries", "h", "--state", "bogus"],
        vec!["handlers", "create", "h", "--url", "http://x"],
        vec![
            "handlers", "create", "h", "--url", "http://x", "--route", "a", "--burst", "3",
        ],
        vec!["events", "publish", "--type", "t"],
    ] {
        let o = cli(&args, &[], None).await?;
        ensure!(o.status.code() == Some(2), "{args:?}: {o:?}");
    }
    // `--expected-seq` needs a key, and a number from 0.
    for (args, says) in [
        (
            vec![
                "events",
                "publish",
                "--type",
                "t",
                "--expected-seq",
                "0",
                "--data",
                "1",
            ],
            "--key",
        ),
        (
            vec![
                "events",
                "publish",
                "--type",
                "t",
                "--key",
                "k",
                "--expected-seq",
                "-1",
                "--data",
                "1",
            ],
            "invalid value '-1' for '--expected-seq <N>'",
        ),
    ] {
        let o = cli(&args, &[], None).await?;
        let err = stderr(&o);
        ensure!(
            o.status.code() == Some(2) && err.contains(says),
            "{args:?}: {o:?}"
        );
    }

    // A node that is down.
    for args in [
        vec!["events", "get", "e1"],
        vec!["events", "publish", "--type", "t", "--data", "{}"],
        vec!["handlers", "list"],
        vec!["handlers", "deliveries", "h"],
    ] {
        let err = fails(&down, &args, None).await?;
        ensure!(
            err.contains(&format!("cannot reach the node at {down}")),
            "{args:?}: {err}"
        );
    }

    stop(db, node).await
}

/// How many handlers the node at `url` has.
async fn api_handlers(url: &str) -> anyhow::Result<usize> {
    let (_, v) = Api::new(url).get("/v1/handlers").await?;
    Ok(v["handlers"].as_array().map_or(0, Vec::len))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_token_publishes_and_reads_nothing() -> anyhow::Result<()> {
    const PUBLISH: &str = "publish-token-0123456789";
    const ADMIN: &str = "admin-token-0123456789ab";
    let db = TestDb::new(Backend::Sqlite, "api_cli_auth").await?;
    let mut opts = test_options(&db.url);
    opts.auth = Auth::new(vec![
        (Scope::Publish, hash_token(PUBLISH)),
        (Scope::Admin, hash_token(ADMIN)),
    ]);
    let node = lanebus_node::start(opts).await?;
    let url = node.base_url();
    let run = |args: &'static [&'static str], token: &'static str| {
        let url = url.clone();
        async move {
            cli(
                args,
                &[("LANEBUS_NODE", &url), ("LANEBUS_TOKEN", token)],
                None,
            )
            .await
        }
    };

    let o = run(
        &[
            "events", "publish", "--type", "t", "--id", "e1", "--data", "{}",
        ],
        PUBLISH,
    )
    .await?;
    ensure!(o.status.success(), "{}", stderr(&o));
    let o = run(&["events", "get", "e1"], PUBLISH).await?;
    ensure!(
        o.status.code() == Some(1) && stderr(&o).contains("403"),
        "a publish token read an event: {o:?}"
    );
    let o = run(&["events", "get", "e1", "--output", "json"], ADMIN).await?;
    ensure!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_slice(&o.stdout)?;
    ensure!(v["id"] == "e1" && v["type"] == "t", "{v}");
    let o = run(&["handlers", "list"], "").await?;
    ensure!(
        o.status.code() == Some(1) && stderr(&o).contains("401"),
        "no token: {o:?}"
    );

    stop(db, node).await
}
