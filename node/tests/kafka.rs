//! Kafka handlers (issue 16) against a real Kafka-protocol broker: tansu
//! (crates.io, a Kafka-compatible broker written in Rust, in-memory
//! storage), started per test from `LANEBUS_TEST_KAFKA_BROKER`, which
//! `scripts/test` builds and sets. The records the topic holds are read
//! back with a librdkafka consumer and judged by the test kit's oracle: a
//! key's events in order on one partition across a paused broker, no loss,
//! repeats only as records carrying the same `lanebus-id`; a killed broker
//! retried, then dead-lettered, then replayed to a new one.
//!
//! tansu 0.6 keeps in-memory topics only while it runs, and with its SQLite
//! storage it stopped answering after a SIGSTOP and SIGCONT, so the outage
//! that keeps the topic is a pause and the one that loses it a killed
//! broker replaced by a new one on the same address.

mod common;

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use common::{Api, Backend, TestDb};
use lanebus_store::DeliveryState;
use lanebus_testkit::receiver::{verdict, Expected, Received};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::json;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

/// A throwaway tansu broker on a port of its own, in memory.
struct Broker {
    bin: String,
    port: u16,
    dir: std::path::PathBuf,
    child: Option<tokio::process::Child>,
}

impl Broker {
    async fn start(name: &str) -> anyhow::Result<Broker> {
        let Ok(bin) = std::env::var("LANEBUS_TEST_KAFKA_BROKER") else {
            bail!(
                "LANEBUS_TEST_KAFKA_BROKER is not set: run the tests with scripts/test, which \
                 builds tansu (a Kafka-compatible broker, crates.io) and sets it"
            );
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir = std::env::temp_dir().join(format!("lanebus-kafka-{name}-{port}"));
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

    fn server(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker and creates the topic ([`TOPIC`], [`PARTITIONS`]
    /// partitions), waiting until it answers.
    async fn run(&mut self) -> anyhow::Result<()> {
        let listener = format!("tcp://{}", self.server());
        let child = tokio::process::Command::new(&self.bin)
            .args(["broker", "--listener-url", &listener])
            .args(["--advertised-listener-url", &listener])
            .args(["--storage-engine", "memory://tansu/", "--silent"])
            .current_dir(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", self.bin))?;
        self.child = Some(child);
        let admin: AdminClient<_> = ClientConfig::new()
            .set("bootstrap.servers", self.server())
            .create()?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let topic = NewTopic::new(TOPIC, PARTITIONS, TopicReplication::Fixed(1));
            let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(2)));
            let last = match admin.create_topics([&topic], &options).await {
                Ok(r) => match &r[0] {
                    Ok(_) | Err((_, rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists)) => {
                        return Ok(())
                    }
                    Err((_, code)) => format!("{code:?}"),
                },
                Err(e) => e.to_string(),
            };
            ensure!(
                tokio::time::Instant::now() < deadline,
                "tansu on {} did not create {TOPIC} within 30 s: {last}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self
            .child
            .as_ref()
            .and_then(tokio::process::Child::id)
            .context("broker not running")?;
        let ok = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()?
            .success();
        ensure!(ok, "kill {signal} {pid}");
        Ok(())
    }

    async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill().await?;
        }
        Ok(())
    }

    /// The records the topic holds, partition by partition in offset order,
    /// as the oracle's records (handler `kafka`): read until they hold `n`
    /// distinct event ids and the topic is quiet for a moment, or `secs`
    /// have passed.
    fn records(&self, n: usize, secs: u64) -> anyhow::Result<Vec<Received>> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.server())
            .set("group.id", "lanebus-test-reader")
            .set("enable.auto.commit", "false")
            .create()?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..PARTITIONS {
            tpl.add_partition_offset(TOPIC, p, Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        let mut got: Vec<(i32, i64, Received)> = Vec::new();
        let mut ids = HashSet::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        while std::time::Instant::now() < deadline {
            let Some(m) = consumer.poll(Duration::from_millis(500)) else {
                if ids.len() >= n {
                    break;
                }
                continue;
            };
            // Transient client errors (a broker connection down) pass.
            let Ok(m) = m else {
                continue;
            };
            let mut headers = std::collections::BTreeMap::new();
            if let Some(h) = m.headers() {
                for h in h.iter() {
                    let v = h.value.map(|v| String::from_utf8_lossy(v).into_owned());
                    headers.insert(h.key.to_owned(), v.unwrap_or_default());
                }
            }
            let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
            ensure!(
                key == headers.get("lanebus-key").cloned(),
                "record key {key:?} is not its lanebus-key header {headers:?}"
            );
            headers.insert("partition".into(), m.partition().to_string());
            let id = headers.get("lanebus-id").cloned().context("lanebus-id")?;
            ids.insert(id.clone());
            got.push((
                m.partition(),
                m.offset(),
                Received {
                    handler: "kafka".into(),
                    event_id: id,
                    key,
                    sequence: headers.get("lanebus-sequence").and_then(|s| s.parse().ok()),
                    attempt: headers
                        .get("lanebus-attempt")
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0),
                    arrived_ms: 0.0,
                    answered_ms: 0.0,
                    status: 200,
                    signature_ok: None,
                    body: String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned(),
                    headers: headers.into_iter().collect(),
                    sender: None,
                },
            ));
        }
        got.sort_by_key(|(p, o, _)| (*p, *o));
        Ok(got
            .into_iter()
            .enumerate()
            .map(|(i, (_, _, mut r))| {
                r.arrived_ms = i as f64;
                r.answered_ms = i as f64;
                r
            })
            .collect())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// Waits (up to `secs`) until the node has no delivery left to make; then
/// fails naming the ones of `expected` not completed.
async fn drained(
    node: &lanebus_node::NodeHandle,
    expected: &[Expected],
    secs: u64,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while node.store().counts().await?.deliveries > 0 {
        if tokio::time::Instant::now() > deadline {
            let mut open = Vec::new();
            for e in expected {
                let l = node.store().lookup_event(&e.event_id).await?;
                if let Some(h) = l.as_ref().and_then(|l| l.handlers.first()) {
                    if !matches!(h.state, DeliveryState::Completed { .. }) {
                        open.push(format!("{}: {:?}", e.event_id, h.state));
                    }
                }
            }
            bail!("deliveries not completed: {}", open.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// The records with repeats of an event id dropped, as a consumer keeping
/// the ids it saw does.
fn first_of_each(records: &[Received]) -> Vec<Received> {
    let mut seen = HashSet::new();
    records
        .iter()
        .filter(|r| seen.insert(r.event_id.clone()))
        .cloned()
        .collect()
}

fn events(prefix: &str, n: usize, keys: usize) -> (Vec<serde_json::Value>, Vec<Expected>) {
    let mut json = Vec::new();
    let mut expected = Vec::new();
    for i in 0..n {
        let key = format!("order-{}", i % keys);
        let id = format!("{prefix}-{i}");
        json.push(json!({"id": id, "type": "order.updated", "key": key, "payload": {"i": i}}));
        expected.push(Expected {
            handler: "kafka".into(),
            event_id: id,
            key: Some(key),
        });
    }
    (json, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_keeps_key_order_across_a_paused_broker() -> anyhow::Result<()> {
    let mut broker = Broker::start("outages").await?;
    let db = TestDb::new(Backend::Sqlite, "kafka_paused").await?;
    let node = common::start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let url = format!("kafka://{}/{TOPIC}", broker.server());
    let h = api
        .create_handler_timeout("kafka", &url, &["order.*"], 100, 1_000)
        .await?;

    let (json, expected) = events("p", 150, 3);
    api.publish(&json[..50], 10).await?;
    ensure!(broker.records(20, 30)?.len() >= 20, "first records");
    // The broker stops answering mid-stream: attempts time out meanwhile.
    broker.signal("-STOP")?;
    api.publish(&json[50..100], 10).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.signal("-CONT")?;
    api.publish(&json[100..], 10).await?;
    drained(&node, &expected, 90).await?;
    let records = broker.records(expected.len(), 30)?;
    // Each key on one partition.
    let mut partitions = std::collections::HashMap::new();
    for r in &records {
        let p = partitions
            .entry(r.key.clone())
            .or_insert_with(|| r.headers["partition"].clone());
        ensure!(
            *p == r.headers["partition"],
            "key {:?} on two partitions",
            r.key
        );
    }
    // A timed-out attempt's record may be written when the broker resumes,
    // besides its retry: a repeat with the same lanebus-id, never a loss or
    // disorder of the first records.
    let v = verdict(&records, &expected);
    ensure!(
        v.lost == 0 && v.unexpected == 0 && v.out_of_order == 0,
        "{v:?}"
    );
    let v = verdict(&first_of_each(&records), &expected);
    ensure!(v.exact(), "{v:?}");
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
    ensure!(retried > 0, "no attempt failed while the broker was away");
    let first = &records[0];
    ensure!(
        first.body.contains("\"type\":\"order.updated\"")
            && first.headers["lanebus-type"] == "order.updated"
            && first.headers["content-type"] == "application/json",
        "{first:?}"
    );

    // A recover sends every event again: new records with the same
    // lanebus-id, marked as replays.
    let before = records.len();
    let since = (chrono::Utc::now() - chrono::TimeDelta::minutes(10)).to_rfc3339();
    let (status, body) = api
        .post(
            &format!("/v1/handlers/{}/recover", h.id),
            json!({ "since": since }),
        )
        .await?;
    ensure!(
        status == 200 && body["recovered"] == json!(expected.len()),
        "{status} {body}"
    );
    let records = broker.records(before + expected.len(), 60)?;
    let replays: Vec<_> = records
        .iter()
        .filter(|r| r.headers.get("lanebus-replay").map(String::as_str) == Some("true"))
        .collect();
    ensure!(
        replays.len() == expected.len(),
        "{} replays of {}",
        replays.len(),
        expected.len()
    );
    let v = verdict(&first_of_each(&records), &expected);
    ensure!(v.exact(), "{v:?}");

    node.shutdown().await?;
    db.drop_db().await;
    broker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_kafka_broker_is_retried_then_dead_lettered_then_replayed() -> anyhow::Result<()>
{
    let mut broker = Broker::start("stopped").await?;
    let db = TestDb::new(Backend::Sqlite, "kafka_stopped").await?;
    let node = common::start_node(&db.url).await?;
    let api = Api::new(&node.base_url());
    let url = format!("kafka://{}/{TOPIC}", broker.server());
    // Attempts time out after 2 s: long enough for a first produce on a
    // loaded machine, short enough for 3 attempts well within the wait below.
    let h = api
        .create_handler_timeout("kafka", &url, &["order.*"], 3, 2_000)
        .await?;
    // One event through, so the node's producer is made and connected. Its
    // delivery must be completed before the broker stops, or it would be
    // retried into a dead letter; a timed-out first attempt that the broker
    // still wrote repeats its record.
    let (warm, warm_expected) = events("w", 1, 1);
    api.publish(&warm, 10).await?;
    drained(&node, &warm_expected, 60).await?;
    let warmed = node.store().lookup_event("w-0").await?.context("stored")?;
    ensure!(
        matches!(
            warmed.handlers.first().map(|h| &h.state),
            Some(DeliveryState::Completed { .. })
        ),
        "warm-up event not completed: {:?}",
        warmed.handlers.first()
    );
    let records = broker.records(1, 30)?;
    ensure!(
        first_of_each(&records).len() == 1,
        "first record: {records:?}"
    );
    broker.stop().await?;

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
    ensure!(error.contains("kafka 127.0.0.1"), "{error}");

    // A new broker on the same address (an empty one) takes the replay.
    broker.run().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let replayed = loop {
        api.replay(&h.id).await?;
        let records = broker.records(expected.len(), 2)?;
        let replayed: Vec<_> = first_of_each(&records)
            .into_iter()
            .filter(|r| r.event_id.starts_with("s-"))
            .collect();
        if replayed.len() >= expected.len() {
            break replayed;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "replayed events not in the topic ({} records): {:?}",
            records.len(),
            api.dead_letters(&h.id).await?.first()
        );
    };
    let v = verdict(&replayed, &expected);
    ensure!(v.exact(), "{v:?}");

    node.shutdown().await?;
    db.drop_db().await;
    broker.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_servers_bound_the_clusters_handlers_may_name() -> anyhow::Result<()> {
    let broker = Broker::start("servers").await?;
    let db = TestDb::new(Backend::Sqlite, "kafka_servers").await?;
    let mut opts = common::test_options(&db.url);
    opts.kafka.servers = vec![broker.server()];
    let node = lanebus_node::start(opts).await?;
    let api = Api::new(&node.base_url());
    let listed = api
        .create_handler_timeout(
            "kafka",
            &format!("kafka://{}/{TOPIC}", broker.server()),
            &["order.*"],
            1,
            1_000,
        )
        .await?;
    // The same broker under another name is another server.
    let other = api
        .create_handler_timeout(
            "other",
            &format!("kafka://localhost:{}/{TOPIC}", broker.port),
            &["order.*"],
            1,
            1_000,
        )
        .await?;
    let (json, expected) = events("l", 3, 1);
    api.publish(&json, 10).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let dead = loop {
        let dead = api.dead_letters(&other.id).await?;
        if dead.len() == expected.len() {
            break dead;
        }
        ensure!(tokio::time::Instant::now() < deadline, "no dead letters");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let error = dead[0]["last_error"].as_str().unwrap_or_default();
    ensure!(error.contains("--kafka-servers"), "{error}");
    ensure!(
        api.dead_letters(&listed.id).await?.is_empty(),
        "listed server refused"
    );
    let records = broker.records(expected.len(), 30)?;
    let v = verdict(&first_of_each(&records), &expected);
    ensure!(
        v.exact() && records.len() == expected.len(),
        "{v:?} {}",
        records.len()
    );
    node.shutdown().await?;
    db.drop_db().await;
    Ok(())
}
