//! Publishing from any language inside its own transaction (issue 16):
//! Python (psycopg 3, `tests/sql_publish.py`) and Node.js (npm `pg`,
//! `tests/js/sql_publish.mjs`) call `lanebus.publish()` in transactions that
//! also write the application's own rows, committing some and rolling back
//! others, while the test publishes to the same key over the HTTP API. A
//! running node on the PostgreSQL store delivers every committed event once,
//! in the key's order, with no gap in its sequence numbers, and none of a
//! rolled-back transaction; `lanebus.wake()` after a commit wakes its lane
//! owners (the node polls only every 600 s here).
//!
//! `scripts/test` installs psycopg in its virtualenv (`LANEBUS_TEST_PYTHON`)
//! and `pg` in `node/tests/js` (`npm ci`, `LANEBUS_TEST_NODEJS`); without
//! them this test fails and says so.

mod common;

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use common::{Api, Backend, TestDb};
use lanebus_testkit::receiver::{Expected, Receiver};
use serde::Deserialize;

const PY_SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/sql_publish.py");
const JS_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/js");
const KEY: &str = "order-7";
/// Transactions per client, and HTTP publishes.
const N: usize = 30;

/// The Python and `node` executables, or a clear error.
fn clients() -> anyhow::Result<(String, String)> {
    let (Ok(python), Ok(nodejs)) = (
        std::env::var("LANEBUS_TEST_PYTHON"),
        std::env::var("LANEBUS_TEST_NODEJS"),
    ) else {
        bail!(
            "LANEBUS_TEST_PYTHON and LANEBUS_TEST_NODEJS must be set: run the tests with \
             scripts/test, which installs psycopg and the npm package pg and sets them"
        );
    };
    let pg = Path::new(JS_DIR).join("node_modules/pg/package.json");
    ensure!(
        pg.exists(),
        "{} is missing: run `npm ci` in {JS_DIR} (scripts/test does)",
        pg.display()
    );
    Ok((python, nodejs))
}

/// One transaction of a client script.
#[derive(Debug, Deserialize)]
struct Tx {
    id: String,
    committed: bool,
}

/// Runs a client script to its end; its transactions, in order.
async fn run_client(program: &str, args: &[&str]) -> anyhow::Result<Vec<Tx>> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .with_context(|| format!("cannot run {program} {args:?}"))?;
    ensure!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)?
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("line {l:?}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_publishes_from_python_and_node_are_delivered_in_key_order() -> anyhow::Result<()> {
    let (python, nodejs) = clients()?;
    let js_script = format!("{JS_DIR}/sql_publish.mjs");
    let db = TestDb::new(Backend::Postgres, "sql_publish").await?;
    let rx = Receiver::start().await?;
    // Wake-ups only: a poll interval longer than the test.
    let mut options = common::test_options(&db.url);
    options.poll_interval = Some(Duration::from_secs(600));
    let node = lanebus_node::start(options).await?;
    let api = Api::new(&node.base_url());
    let h = api.create_handler("all", &rx.url("all"), &["*"], 8).await?;
    rx.set_secret("all", &h.secret);
    let app = sqlx::PgPool::connect(&db.url).await?;
    sqlx::query("CREATE TABLE app_orders (id text PRIMARY KEY, source text NOT NULL)")
        .execute(&app)
        .await?;

    let count = N.to_string();
    let http = async {
        for i in 0..N {
            let e = serde_json::json!({
                "id": format!("http-{i}"), "type": "http.order", "key": KEY, "payload": {"n": i}
            });
            api.publish(&[e], 1).await?;
        }
        anyhow::Ok(())
    };
    let py_args = [PY_SCRIPT, &db.url, KEY, &count, "py"];
    let js_args = [&js_script, &db.url, KEY, &count, "js"];
    let (py, js, http) = tokio::join!(
        run_client(&python, &py_args),
        run_client(&nodejs, &js_args),
        http
    );
    let (py, js) = (py?, js?);
    http?;

    let mut committed: Vec<String> = (0..N).map(|i| format!("http-{i}")).collect();
    let mut rolled_back = Vec::new();
    for tx in py.iter().chain(&js) {
        if tx.committed {
            committed.push(tx.id.clone());
        } else {
            rolled_back.push(tx.id.clone());
        }
    }
    ensure!(rolled_back.len() == 2 * (N / 3), "{rolled_back:?}");
    let expected: Vec<Expected> = committed
        .iter()
        .map(|id| Expected {
            handler: "all".into(),
            event_id: id.clone(),
            key: Some(KEY.into()),
        })
        .collect();
    ensure!(
        rx.wait_accepted(expected.len(), Duration::from_secs(60))
            .await,
        "{} of {} committed events delivered",
        rx.accepted_distinct(),
        expected.len()
    );
    let verdict = rx.verdict(&expected);
    ensure!(verdict.exact(), "{verdict:?}");
    let mut sequences: Vec<i64> = rx
        .requests()
        .iter()
        .filter(|r| r.accepted())
        .filter_map(|r| r.sequence)
        .collect();
    ensure!(
        sequences.windows(2).all(|w| w[0] < w[1]),
        "delivered out of sequence order: {sequences:?}"
    );
    sequences.dedup();
    ensure!(
        sequences == (1..=expected.len() as i64).collect::<Vec<_>>(),
        "the key's sequence has gaps: {sequences:?}"
    );
    for id in &rolled_back {
        ensure!(
            node.store().lookup_event(id).await?.is_none(),
            "rolled-back event {id} is stored"
        );
    }
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM app_orders")
        .fetch_one(&app)
        .await?;
    ensure!(
        orders as usize == committed.len() - N,
        "{orders} application rows for {} committed transactions",
        committed.len() - N
    );

    // A key nothing else publishes into: only lanebus.wake() can get it
    // claimed before the 600 s poll.
    let alone = run_client(&python, &[PY_SCRIPT, &db.url, "order-alone", "2", "py2"]).await?;
    let ids: Vec<String> = alone.into_iter().map(|t| t.id).collect();
    ensure!(
        rx.wait_until(Duration::from_secs(30), |log| ids
            .iter()
            .all(|id| log.iter().any(|r| &r.event_id == id && r.accepted())))
            .await,
        "events published with lanebus.publish() and woken by lanebus.wake() not delivered \
         within 30 s"
    );

    app.close().await;
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
