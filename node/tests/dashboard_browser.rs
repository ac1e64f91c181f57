//! The dashboard in a real browser: headless Chromium (Debian's `chromium`
//! package) driven by playwright-core (npm, pinned by
//! `node/tests/browser/package-lock.json`) through `/ui/` of a three-node
//! cluster of `lanebus node` child processes ([`LocalCluster`], SQLite,
//! the short leases of `cluster.rs`):
//!
//! 1. the page shows 256 lanes, every one active, over the three owners;
//! 2. an event of type `push` looked up through the search box shows its
//!    delivery to `all` completed and to `payments` (whose receiver always
//!    answers 500) dead-lettered after 2 attempts, both failed attempts in
//!    its attempt log with status 500;
//! 3. `all`'s page (opened from the lookup) lists its completed deliveries,
//!    50 a page, and the next page with other ones; its deliveries plot has
//!    points above 0 (node 1's own attempts); `payments`' dead letters show
//!    their attempt logs;
//! 4. node 3 is SIGKILLed; within the failover bound (lease + margin + 2 s,
//!    as in `cluster.rs`, plus the page's 1 s refresh) the page shows every
//!    lane owned by nodes 1 and 2.
//!
//! The script (`node/tests/browser/dashboard.mjs`) reads everything from the
//! page's `data-*` attributes and saves screenshots in
//! `$CARGO_TARGET_TMPDIR/dashboard/` (`dashboard-three-nodes.png`,
//! `dashboard-event.png` and `dashboard-handler.png` are committed as
//! `docs/dashboard.png`, `docs/dashboard-event.png` and
//! `docs/dashboard-handler.png`).
//!
//! Needs `scripts/test` (it runs `npm ci` in `node/tests/browser/` and
//! exports `LANEBUS_TEST_NODEJS`) and `/usr/bin/chromium` (`apt-get install
//! chromium`; `.ci/run` does, and `scripts/test` too when run as root);
//! `LANEBUS_TEST_CHROMIUM` names another executable. Without them the test
//! fails and says what is missing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use common::{real_events, samples, Api, Backend, TestDb};
use lanebus_testkit::local_cluster::{LocalCluster, Start};
use lanebus_testkit::receiver::{Action, Receiver, Rule};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};

const LEASE_MS: u64 = 1_500;
const MARGIN_MS: u64 = 500;
/// The dashboard polls once a second.
const PAGE_REFRESH_MS: u64 = 1_000;
const ARGS: &[&str] = &[
    "--lease-ms",
    "1500",
    "--renew-interval-ms",
    "300",
    "--lease-margin-ms",
    "500",
    "--retry-base-ms",
    "50",
    "--poll-interval-ms",
    "50",
];
const BROWSER_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser");

/// `node`, Chromium and the installed playwright-core, or a clear error.
fn tools() -> anyhow::Result<(String, PathBuf)> {
    let Ok(node) = std::env::var("LANEBUS_TEST_NODEJS") else {
        bail!(
            "LANEBUS_TEST_NODEJS is not set: run the tests with scripts/test, which runs `npm ci` in \
             node/tests/browser and sets it to the node executable (or run `npm ci` there yourself and \
             set LANEBUS_TEST_NODEJS=$(command -v node))"
        );
    };
    let module = Path::new(BROWSER_DIR).join("node_modules/playwright-core/package.json");
    ensure!(
        module.exists(),
        "{} is missing: run `npm ci` in {BROWSER_DIR} (scripts/test does)",
        module.display()
    );
    let chromium = PathBuf::from(
        std::env::var("LANEBUS_TEST_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()),
    );
    ensure!(
        chromium.exists(),
        "{} is missing: install Debian's chromium package (`apt-get install chromium`; .ci/run \
         does, and scripts/test when run as root), or set LANEBUS_TEST_CHROMIUM",
        chromium.display()
    );
    Ok((node, chromium))
}

/// Next JSON line of the script, within `timeout`.
async fn next_step(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    timeout: Duration,
) -> anyhow::Result<Value> {
    let line = tokio::time::timeout(timeout, lines.next_line())
        .await
        .context("the browser script said nothing in time")??
        .context("the browser script ended without a word (see its stderr above)")?;
    serde_json::from_str(&line).with_context(|| format!("browser script said: {line}"))
}

/// Next JSON line of the script, which must be step `name`; else its error.
async fn expect_step(
    lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    name: &str,
    timeout: Duration,
    logs: &Path,
) -> anyhow::Result<Value> {
    let step = next_step(lines, timeout).await?;
    ensure!(
        step["step"] == name,
        "{name}: {} (logs in {})",
        step["error"].as_str().unwrap_or(&step.to_string()),
        logs.display()
    );
    Ok(step)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_three_owners_then_the_failover() -> anyhow::Result<()> {
    let (node_bin, chromium) = tools()?;
    let db = TestDb::new(Backend::Sqlite, "dashboard").await?;
    // Migrates the store before three processes open it.
    let _store = lanebus_store::open(&db.url).await?;
    let dir = std::env::temp_dir().join(format!(
        "lanebus-dashboard-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir)?;
    let mut cluster = LocalCluster::new(env!("CARGO_BIN_EXE_lanebus"), &dir, &db.url, ARGS);
    cluster.spawn(1, Start::Bootstrap)?;
    cluster.wait_ready(1, Duration::from_secs(30)).await?;
    let join = cluster.url(1);
    for id in [2, 3] {
        cluster.spawn(id, Start::Join(join.clone()))?;
    }
    for id in [1, 2, 3] {
        cluster.wait_ready(id, Duration::from_secs(30)).await?;
    }
    cluster
        .wait_balanced(1, &[1, 2, 3], Duration::from_secs(30))
        .await?;

    // Something for the handler table: two handlers that take their events
    // and one whose receiver always fails (dead letters).
    let rx = Receiver::start().await?;
    rx.add_rule(Rule {
        handler: Some("payments".into()),
        key: None,
        action: Action::Status {
            status: 500,
            retry_after: None,
        },
    });
    let api = Api::new(&cluster.url(1));
    let mut n_handlers = 0;
    let mut ids = std::collections::HashMap::new();
    for (name, routes, attempts) in [
        ("issues", vec!["issues.*"], 8),
        ("all", vec!["*"], 8),
        ("payments", vec!["push"], 2),
    ] {
        let h = api
            .create_handler_timeout(name, &rx.url(name), &routes, attempts, LEASE_MS - 500)
            .await?;
        rx.set_secret(name, &h.secret);
        ids.insert(name, h.id);
        n_handlers += 1;
    }
    let (events, tracked) = real_events(&samples(), 300, 40, "dash");
    api.publish(&events, 100).await?;
    let push = tracked
        .iter()
        .find(|e| e.event_type == "push")
        .context("the samples have no push event")?;

    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    let bound = LEASE_MS + MARGIN_MS + 2_000 + PAGE_REFRESH_MS;
    let mut script = tokio::process::Command::new(&node_bin)
        .current_dir(BROWSER_DIR)
        .arg("dashboard.mjs")
        .arg(format!("{}/ui/", cluster.url(1)))
        .arg(&shots)
        .arg("1,2,3")
        .arg("1,2")
        .arg(bound.to_string())
        .arg(&push.id)
        .arg(&ids["all"])
        .arg(&ids["payments"])
        .env("LANEBUS_TEST_CHROMIUM", &chromium)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot run {node_bin} dashboard.mjs"))?;
    let mut stdin = script.stdin.take().context("stdin")?;
    let mut lines = BufReader::new(script.stdout.take().context("stdout")?).lines();

    let step = expect_step(&mut lines, "balanced", Duration::from_secs(120), &dir).await?;
    let counts: Vec<u64> = ["1", "2", "3"]
        .iter()
        .map(|o| step["owners"][o].as_u64().unwrap_or(0))
        .collect();
    ensure!(
        counts.iter().sum::<u64>() == 256 && counts.iter().all(|&c| (85..=86).contains(&c)),
        "page showed {}",
        step["owners"]
    );
    println!(
        "page shows 256 lanes over three owners {} after {} ms; screenshot {}",
        step["owners"], step["ms"], step["screenshot"]
    );

    // The event lookup.
    let step = expect_step(&mut lines, "lookup", Duration::from_secs(120), &dir).await?;
    let rows = step["handlers"].as_array().context("handlers")?;
    let row = |id: &str| rows.iter().find(|r| r["handler"] == id);
    let all = row(&ids["all"]).context("no row for handler all")?;
    ensure!(
        all["state"] == "completed" && all["attempts"] == 1 && all["log"] == serde_json::json!([]),
        "all: {all}"
    );
    let payments = row(&ids["payments"]).context("no row for handler payments")?;
    ensure!(
        payments["state"] == "dead_lettered"
            && payments["attempts"] == 2
            && payments["log"] == serde_json::json!([500, 500]),
        "payments: {payments}"
    );
    ensure!(
        row(&ids["issues"]).is_none() && rows.len() == 2,
        "a push event matches all and payments only: {rows:?}"
    );
    println!(
        "lookup of {} shows {}; screenshot {}",
        push.id, step["handlers"], step["screenshot"]
    );

    // The handler's page.
    let step = expect_step(&mut lines, "handler", Duration::from_secs(120), &dir).await?;
    let first = step["first"].as_array().context("first")?;
    let second: Vec<&str> = step["second"]
        .as_array()
        .context("second")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        first.len() == 50 && first.iter().all(|r| r[1] == "completed"),
        "first page of all's completed deliveries: {first:?}"
    );
    ensure!(
        !second.is_empty() && second.iter().all(|id| !first.iter().any(|r| r[0] == *id)),
        "the second page repeats or is empty: {second:?}"
    );
    let plots = &step["plots"];
    ensure!(
        plots["deliveries"]["nonzero"].as_u64() > Some(0)
            && plots["deliveries"]["paths"].as_u64() > Some(0)
            && plots["p99"]["points"].as_u64() > Some(0)
            && plots["failures"]["points"].as_u64() > Some(0),
        "plots: {plots}"
    );
    let dead = step["dead"].as_array().context("dead")?;
    ensure!(
        !dead.is_empty()
            && dead.iter().all(|d| d["state"] == "dead_lettered"
                && d["attempts"] == 2
                && d["log"] == serde_json::json!([500, 500])),
        "payments' dead letters: {dead:?}"
    );
    println!(
        "handler page: {} + {} completed deliveries on two pages, plots {plots}, {} dead letters of \
         payments with their attempt logs; screenshot {}",
        first.len(),
        second.len(),
        dead.len(),
        step["screenshot"]
    );

    cluster.kill(3)?;
    stdin.write_all(b"killed\n").await?;
    stdin.flush().await?;
    let step = expect_step(
        &mut lines,
        "failover",
        Duration::from_millis(bound + 30_000),
        &dir,
    )
    .await?;
    let moved = step["ms"].as_u64().context("ms")?;
    ensure!(moved <= bound, "page showed the failover after {moved} ms");
    let status = tokio::time::timeout(Duration::from_secs(30), script.wait())
        .await
        .context("the browser script did not exit")??;
    ensure!(status.success(), "browser script: {status}");
    println!(
        "page shows every lane on nodes 1 and 2 {} {moved} ms after SIGKILL of node 3 (bound {bound} ms); \
         node 3 shown down: {}; {n_handlers} handlers; screenshot {}",
        step["owners"], step["shown_down"], step["screenshot"]
    );
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
    Ok(())
}
