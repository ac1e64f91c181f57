//! NATS JetStream handlers (issue 16) against a real `nats-server` with
//! JetStream, started per test (`LANEBUS_TEST_NATS_SERVER`, which
//! `scripts/test` sets; the Debian package `nats-server`): a key's events
//! reach the stream in order across a broker restart, with no loss and no
//! repeat (the test kit's oracle judges the messages the stream holds), a
//! repeat is dropped by its `Nats-Msg-Id` (event and handler), two
//! handlers on one stream each get their messages, and a stopped broker is retried,
//! then dead-lettered, then replayed once it is back.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use async_nats::jetstream;
use common::{Api, Backend, TestDb};
use lanebus_store::DeliveryState;
use lanebus_testkit::receiver::{verdict, Expected, Received};
use serde_json::json;

/// A throwaway nats-server with JetStream on a port of its own, its store
/// in a temporary directory kept across restarts.
struct Broker {
    bin: String,
    port: u16,
    dir: PathBuf,
    child: Option<tokio::process::Child>,
}

impl Broker {
    async fn start(name: &str) -> anyhow::Result<Broker> {
        let Ok(bin) = std::env::var("LANEBUS_TEST_NATS_SERVER") else {
            bail!(
                "LANEBUS_TEST_NATS_SERVER is not set: run the tests with scripts/test, which \
                 finds nats-server (Debian package nats-server) and sets it"
            );
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir = std::env::temp_dir().join(format!("lanebus-nats-{name}-{port}"));
        std::fs::create_dir_all(&dir)?;
        let mut b = Broker {
            bin,
            port,
            dir,
            child: None,
        };
        b.run().await?;
        Ok(b)
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server and waits until JetStream answers (with the
    /// stream, [`Broker::stream`]).
    async fn run(&mut self) -> anyhow::Result<()> {
        let child = tokio::process::Command::new(&self.bin)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.dir)
            .arg("-l")
            .arg(self.dir.join("server.log"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", self.bin))?;
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let last = match async_nats::connect(self.url()).await {
                Ok(client) => match self.stream_on(client).await {
                    Ok(_) => return Ok(()),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            ensure!(
                tokio::time::Instant::now() < deadline,
                "nats-server on {} did not answer within 30 s: {last}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().await?;
        }
        Ok(())
    }

    /// The stream ORDERS (subjects `orders.>`, file storage, duplicate
    /// window 2 minutes), created if missing.
    async fn stream(&self) -> anyhow::Result<jetstream::stream::Stream> {
        self.stream_on(async_nats::connect(self.url()).await?).await
    }

    async fn stream_on(
        &self,
        client: async_nats::Client,
    ) -> anyhow::Result<jetstream::stream::Stream> {
        Ok(jetstream::new(client)
            .get_or_create_stream(jetstream::stream::Config {
                name: "ORDERS".into(),
                subjects: vec!["orders.>".into()],
                storage: jetstream::stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await?)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The messages the stream holds, in stream order, as the oracle's records
/// (handler `nats`; arrival = stream sequence).
async fn held(stream: &mut jetstream::stream::Stream) -> anyhow::Result<Vec<Received>> {
    let last = stream.info().await?.state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let m = stream.get_raw_message(seq).await?;
        let h = |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned());
        out.push(Received {
            handler: "nats".into(),
            event_id: h("lanebus-id").context("lanebus-id")?,
            key: h("lanebus-key"),
            sequence: h("lanebus-sequence").and_then(|s| s.parse().ok()),
            attempt: h("lanebus-attempt")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0),
            arrived_ms: seq as f64,
            answered_ms: seq as f64,
            status: 200,
            signature_ok: None,
            body: String::from_utf8_lossy(&m.payload).into_owned(),
            headers: [
                ("subject".to_owned(), m.subject.to_string()),
                (
                    "Nats-Msg-Id".to_owned(),
                    h("Nats-Msg-Id").unwrap_or_default(),
                ),
            ]
            .into(),
            sender: None,
        });
    }
    Ok(out)
}

/// Waits (up to `secs`) until the stream holds `n` messages.
async fn wait_held(
    stream: &mut jetstream::stream::Stream,
    n: u64,
    secs: u64,
) -> anyhow::Result<u64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let got = stream.info().await.map(|i| i.state.messages).unwrap_or(0);
        if got >= n || tokio::time::Instant::now() > deadline {
            return Ok(got);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn events(prefix: &str, n: usize, keys: usize) -> (Vec<serde_json::Value>, Vec<Expected>) {
    let mut json = Vec::new();
    let mut expected = Vec::new();
    for i in 0..n {
        let key = format!("order-{}", i % keys);
        let id = format!("{prefix}-{i}");
        json.push(json!({"id": id, "type": "order.updated", "key": key, "payload": {"i": i}}));
        expected.push(Expected {
            handler: "nats".into(),
            event_id: id,
            key: Some(key),
        });
    }
    (json, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_keeps_key_order_across_a_broker_restart_and_drops_repeats() -> anyhow::Result<()> {
    let mut broker = Broker::start("restart").await?;
    let mut stream = broker.stream().await?;
    let db = TestDb::new(Backend::Sqlite, "nats_restart").await?;
    let node = common::start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let url = format!("{}/orders.{{type}}", broker.url());
    let h = api
        .create_handler_timeout("nats", &url, &["order.*"], 100, 1_000)
        .await?;

    let (json, expected) = events("r", 150, 3);
    api.publish(&json[..50], 10).await?;
    ensure!(
        wait_held(&mut stream, 20, 30).await? >= 20,
        "first messages"
    );
    // The broker goes away mid-stream and comes back with its store.
    broker.stop().await?;
    api.publish(&json[50..], 10).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.run().await?;
    let mut stream = broker.stream().await?;
    let n = expected.len() as u64;
    let got = wait_held(&mut stream, n, 90).await?;
    ensure!(got == n, "the stream holds {got} of {n} messages");
    let log = held(&mut stream).await?;
    let v = verdict(&log, &expected);
    ensure!(v.exact(), "{v:?}");
    // Attempts failed while the broker was away (their messages, buffered
    // by the client or sent again, are in the stream once).
    let mut retried = 0;
    for e in &expected {
        let lookup = node
            .store()
            .lookup_event(&e.event_id)
            .await?
            .context("stored")?;
        if let Some(DeliveryState::Completed { attempts, .. }) =
            lookup.handlers.first().map(|h| &h.state)
        {
            retried += usize::from(*attempts > 1);
        }
    }
    ensure!(retried > 0, "no attempt failed while the broker was down");
    let first = &log[0];
    ensure!(
        first.body.contains("\"type\":\"order.updated\""),
        "{}",
        first.body
    );

    // A repeat (recover sends every completed event again) is dropped by
    // its Nats-Msg-Id, and its acknowledgement completes it.
    let since = (chrono::Utc::now() - chrono::TimeDelta::minutes(10)).to_rfc3339();
    let (status, body) = api
        .post(
            &format!("/v1/handlers/{}/recover", h.id),
            json!({ "since": since }),
        )
        .await?;
    ensure!(
        status == 200 && body["recovered"] == json!(n),
        "{status} {body}"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while node.store().counts().await?.deliveries > 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "recovered deliveries not completed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let messages = stream.info().await?.state.messages;
    ensure!(
        messages == n,
        "{messages} messages after the repeats, expected {n}"
    );

    node.shutdown().await?;
    db.drop_db().await;
    broker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_broker_is_retried_then_dead_lettered_then_replayed() -> anyhow::Result<()> {
    let mut broker = Broker::start("stopped").await?;
    broker.stop().await?;
    let db = TestDb::new(Backend::Sqlite, "nats_stopped").await?;
    let node = common::start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let url = format!("{}/orders.{{type}}.{{key}}", broker.url());
    let h = api
        .create_handler_timeout("nats", &url, &["order.*"], 3, 500)
        .await?;
    let (json, expected) = events("s", 4, 2);
    api.publish(&json, 10).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let dead = loop {
        let dead = api.dead_letters(&h.id).await?;
        if dead.len() == expected.len() {
            break dead;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no dead letters: {dead:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let first = &dead[0];
    ensure!(first["attempts"] == json!(3), "{first}");
    let error = first["last_error"].as_str().unwrap_or_default();
    ensure!(error.contains("nats 127.0.0.1"), "{error}");

    broker.run().await?;
    let mut stream = broker.stream().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while (stream.info().await?.state.messages as usize) < expected.len() {
        api.replay(&h.id).await?;
        ensure!(
            tokio::time::Instant::now() < deadline,
            "replayed events not in the stream"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let log = held(&mut stream).await?;
    let v = verdict(&log, &expected);
    ensure!(
        v.lost == 0 && v.out_of_order == 0 && v.unexpected == 0,
        "{v:?}"
    );
    for r in &log {
        let want = format!("orders.order.updated.{}", r.key.as_deref().unwrap_or(""));
        ensure!(
            r.headers["subject"] == want,
            "{:?} published to {want}",
            r.headers
        );
    }

    node.shutdown().await?;
    db.drop_db().await;
    broker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handlers_on_one_stream_each_get_their_messages() -> anyhow::Result<()> {
    let mut broker = Broker::start("shared").await?;
    let mut stream = broker.stream().await?;
    let db = TestDb::new(Backend::Sqlite, "nats_shared").await?;
    let node = common::start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let a = api
        .create_handler_timeout(
            "a",
            &format!("{}/orders.a", broker.url()),
            &["order.*"],
            10,
            1_000,
        )
        .await?;
    let b = api
        .create_handler_timeout(
            "b",
            &format!("{}/orders.b", broker.url()),
            &["order.*"],
            10,
            1_000,
        )
        .await?;
    let (json, _) = events("two", 6, 2);
    api.publish(&json, 10).await?;
    let got = wait_held(&mut stream, 12, 30).await?;
    ensure!(got == 12, "the stream holds {got} of 12 messages");
    for r in held(&mut stream).await? {
        let handler = if r.headers["subject"] == "orders.a" {
            &a.id
        } else {
            &b.id
        };
        let msg_id = &r.headers["Nats-Msg-Id"];
        ensure!(
            *msg_id == format!("{}:{handler}", r.event_id),
            "{msg_id} for {} to {handler}",
            r.event_id
        );
    }
    node.shutdown().await?;
    db.drop_db().await;
    broker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_is_not_published_later_behind_its_back() -> anyhow::Result<()> {
    let mut broker = Broker::start("late").await?;
    let mut stream = broker.stream().await?;
    let db = TestDb::new(Backend::Sqlite, "nats_late").await?;
    let node = common::start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let url = format!("{}/orders.{{type}}", broker.url());
    let h = api
        .create_handler_timeout("nats", &url, &["order.*"], 1, 500)
        .await?;
    // One message through, so the node's connection is up.
    let (warm, _) = events("warm", 1, 1);
    api.publish(&warm, 10).await?;
    ensure!(wait_held(&mut stream, 1, 30).await? == 1, "first message");
    broker.stop().await?;
    // Attempts while the broker is away fail (one attempt: dead letters).
    let (json, expected) = events("late", 4, 2);
    api.publish(&json, 10).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while api.dead_letters(&h.id).await?.len() < expected.len() {
        ensure!(tokio::time::Instant::now() < deadline, "no dead letters");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Once the broker is back, the client reconnects: a failed attempt's
    // message must not reach the stream then, or the dead letter lies.
    broker.run().await?;
    let mut stream = broker.stream().await?;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let held_now = stream.info().await?.state.messages;
    ensure!(
        held_now == 1,
        "the stream holds {held_now} messages: failed attempts were published later"
    );
    node.shutdown().await?;
    db.drop_db().await;
    broker.stop().await?;
    Ok(())
}
