//! The `lanebus` binary as a child process, killed with SIGKILL mid-run and
//! restarted on the same store: nothing is lost, per-key order holds, and
//! the only repeats are of deliveries that were in flight at the kill (at
//! most one per (handler, key), accepted before the kill and again after).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{ensure, Context as _};
use common::{expected, real_events, Backend, Registered, TestDb};
use lanebus_store::{handler_defaults, NewEvent, NewHandler};
use lanebus_testkit::local_cluster;
use lanebus_testkit::receiver::{Action, Receiver, Rule};

fn spawn_node(url: &str, dir: &std::path::Path, life: u32) -> anyhow::Result<Child> {
    let log = std::fs::File::create(dir.join(format!("node-{life}.log")))?;
    Command::new(env!("CARGO_BIN_EXE_lanebus"))
        .args([
            "node",
            "--id",
            "1",
            "--http-addr",
            "127.0.0.1:0",
            "--raft-addr",
            "127.0.0.1:0",
            "--single",
        ])
        .arg("--data-dir")
        .arg(dir)
        .args([
            "--store",
            url,
            "--retry-base-ms",
            "50",
            "--poll-interval-ms",
            "50",
        ])
        .env_remove("LANEBUS_CONFIG")
        .env(
            "LANEBUS_WEBHOOK_ALLOW_CIDRS",
            lanebus_testkit::local_cluster::LOOPBACK_CIDRS,
        )
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("spawn lanebus node")
}

async fn killed_and_restarted(backend: Backend) -> anyhow::Result<()> {
    let db = TestDb::new(backend, "kill").await?;
    let dir = std::env::temp_dir().join(format!("lanebus-kill-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir)?;
    let rx = Receiver::start().await?;
    // A little work per request so the run lasts long enough to be cut.
    rx.add_rule(Rule {
        handler: None,
        key: None,
        action: Action::Delay(Duration::from_millis(2)),
    });

    // Handlers and events go straight into the store: the node starts later
    // and finds a backlog.
    let store = lanebus_store::open(&db.url).await?;
    let mut handlers = Vec::new();
    for (name, routes) in [("issues", vec!["issues.*"]), ("all", vec!["*"])] {
        let h = store
            .create_handler(NewHandler {
                name: name.into(),
                url: rx.url(name),
                event_types: routes.iter().map(|s| s.to_string()).collect(),
                max_attempts: handler_defaults::MAX_ATTEMPTS,
                timeout_ms: 5_000,
                max_in_flight: handler_defaults::MAX_IN_FLIGHT,
                secret: lanebus_store::generate_secret(),
                rate_limit: None,
                filter: None,
            })
            .await?;
        rx.set_secret(name, &h.secret);
        handlers.push(Registered {
            id: h.id,
            name: name.into(),
            secret: h.secret,
            routes: h.event_types,
        });
    }
    let (_, events) = real_events(&common::samples(), 1_500, 20, "kill");
    for chunk in events.chunks(100) {
        let batch = chunk
            .iter()
            .map(|e| NewEvent {
                id: Some(e.id.clone()),
                event_type: e.event_type.clone(),
                key: e.key.clone(),
                payload: e.payload.clone().into_bytes(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect();
        store.publish(batch).await?;
    }
    let exp = expected(&events, &handlers);

    let mut child = spawn_node(&db.url, &dir, 1)?;
    let third = exp.len() / 3;
    let cut = rx.wait_accepted(third, Duration::from_secs(240)).await;
    child.kill()?; // SIGKILL
    let kill_ms = rx.now_ms();
    child.wait()?;
    if backend == Backend::Mongodb {
        end_dead_transactions(&db.url).await?;
    }
    ensure!(
        cut,
        "the first life delivered only {} of {}",
        rx.accepted_distinct(),
        exp.len()
    );
    let before = rx.accepted_distinct();
    ensure!(
        before < exp.len(),
        "the run finished before the kill; nothing was cut"
    );

    // A request the first life wrote just before the SIGKILL can still be
    // read by the receiver after `kill_ms` (its arrival is stamped when the
    // body has been read): its answer reached nobody, so the second life
    // sends it again, and both acceptances fall after `kill_ms`. The lives
    // are told apart by the second one's start instead, once the receiver
    // has had time to read what the first one wrote.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let restart_ms = rx.now_ms();
    let mut child = spawn_node(&db.url, &dir, 2)?;
    let done = rx.wait_accepted(exp.len(), Duration::from_secs(480)).await;
    // The last completions are written a tick after the last answers.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut pending = store.counts().await?.deliveries;
    while pending > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        pending = store.counts().await?.deliveries;
    }
    child.kill()?;
    child.wait()?;
    let v = rx.verdict(&exp);
    ensure!(
        done,
        "after restart only {} of {} arrived: {v:?} (logs in {})",
        rx.accepted_distinct(),
        exp.len(),
        dir.display()
    );
    ensure!(
        pending == 0,
        "store still has {pending} deliveries 10 s after everything arrived"
    );
    ensure!(
        v.lost == 0 && v.out_of_order == 0 && v.bad_signatures == 0 && v.unexpected == 0,
        "{v:?}"
    );

    // Repeats: only deliveries in flight at the kill, at most one per
    // (handler, key), first accepted from the first life (before the
    // second started), again from the second.
    let r = local_cluster::repeats(&rx.requests(), &[restart_ms]);
    ensure!(
        r.unexplained.is_empty(),
        "repeats without the kill in between (killed at {kill_ms:.1} ms, restarted at {restart_ms:.1} ms): {:?}",
        &r.unexplained[..r.unexplained.len().min(10)]
    );
    println!(
        "{backend:?}: killed after {before} of {} deliveries; {} repeated (in flight at the kill); none lost, order kept",
        exp.len(),
        v.duplicated
    );
    let _ = std::fs::remove_dir_all(&dir);
    db.drop_db().await;
    Ok(())
}

/// Aborts the killed node's open transaction, if the kill cut one. mongod
/// does so after `transactionLifetimeLimitSeconds` (60 s) with a background
/// reaper, and until then the second life's fence (a plain write to the
/// lane documents that transaction wrote) waits. The test server reaps only
/// when a transaction is next touched, which the fence never does, so it
/// would wait for ever: `killAllSessions` (a real admin command, the same
/// on mongod) ends the dead process's sessions and their transactions now.
async fn end_dead_transactions(url: &str) -> anyhow::Result<()> {
    let client = mongodb::Client::with_uri_str(url).await?;
    client
        .database("admin")
        .run_command(mongodb::bson::doc! { "killAllSessions": [] })
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_sqlite() {
    killed_and_restarted(Backend::Sqlite).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_postgres() {
    killed_and_restarted(Backend::Postgres).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_mongodb() {
    killed_and_restarted(Backend::Mongodb).await.unwrap();
}
