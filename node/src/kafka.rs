//! Kafka handlers: a handler whose URL is `kafka://HOST[:PORT]/TOPIC`
//! ([`lanebus_store::rules::handler::kafka`]) gets each delivery produced
//! to TOPIC of the cluster HOST:PORT bootstraps, and the broker's
//! acknowledgement (`acks=all`) completes it. The record's key is the
//! event's key (so a key stays on one partition, in order), its value the
//! webhook body ([`crate::webhook::build_body`]), and its headers
//! `lanebus-id` (the event id: consumers drop repeats by it),
//! `lanebus-type`, `lanebus-key`, `lanebus-sequence`, `lanebus-attempt`,
//! `lanebus-lane`, `lanebus-epoch`, `content-type`, and `lanebus-replay`
//! on replays and recovers. Key order, retries, dead letters, disabling and
//! rate limits are the key runners', as for webhooks: a key's next event is
//! produced only after the previous one was acknowledged.
//!
//! The client is librdkafka ([`rdkafka`]) with its idempotent producer
//! (`enable.idempotence`): the producer's own retries of a record are
//! written once. A repeat of an attempt (the acknowledgement lost, the
//! attempt retried, a recover) is a new record: Kafka keeps no id across
//! produce calls, so consumers de-duplicate by `lanebus-id`, as webhook
//! receivers do by `webhook-id`.
//!
//! An attempt ends when librdkafka reports the record's fate: the
//! handler's `timeout_ms` is the producer's `message.timeout.ms`, so a
//! record that timed out is never sent later behind the attempt's back.
//! One producer is kept per bootstrap server and timeout, shared by every
//! handler and lane of the node.
//!
//! The topic is the operator's (partitions, retention): a topic the broker
//! does not hold fails the attempt. Credentials and TLS are the node's
//! settings ([`KafkaSettings`]): `--kafka-servers` lists the bootstrap
//! servers handlers may name, which alone get the credentials. The SSRF
//! guard ([`EgressPolicy`]) checks every address of the bootstrap server
//! before the producer is made, and every broker the cluster's metadata
//! names before the first record; librdkafka may have connected to those
//! brokers by then (it resolves and connects on its own), so only a server
//! list keeps a handler's cluster from naming brokers the guard refuses.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lanebus_store::egress::EgressPolicy;
use lanebus_store::rules::handler::{host_port, kafka, KafkaTarget};
use lanebus_store::{AttemptError, Delivery, Handler as HandlerConfig};
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::ClientConfig;

use crate::handler::failed;
use crate::retry::AttemptOutcome;
use crate::webhook::{build_body, AttemptDetail};

/// Whether a handler URL names a Kafka destination.
pub fn is_kafka(url: &str) -> bool {
    url.starts_with("kafka://")
}

/// SASL mechanisms a node may authenticate with (librdkafka's
/// `sasl.mechanisms` values).
pub const SASL_MECHANISMS: [&str; 3] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];

/// Credentials and TLS for the Kafka clusters a node produces to
/// (`--kafka-sasl-mechanism`, `--kafka-sasl-username`,
/// `--kafka-sasl-password`, `--kafka-servers`, `--kafka-tls`,
/// `--kafka-tls-ca`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KafkaSettings {
    /// SASL mechanism, one of [`SASL_MECHANISMS`].
    pub sasl_mechanism: Option<String>,
    /// SASL user name, with [`sasl_password`](Self::sasl_password).
    pub sasl_username: Option<String>,
    /// SASL password.
    pub sasl_password: Option<String>,
    /// Bootstrap servers (`host:port`, as in handler URLs) handlers may
    /// produce to, and that get the credentials; empty: any server the
    /// SSRF guard allows, without credentials.
    pub servers: Vec<String>,
    /// Connect over TLS (`security.protocol` `ssl` or `sasl_ssl`).
    pub tls: bool,
    /// PEM file of the CA certificates to trust (instead of the system's).
    pub tls_ca: Option<PathBuf>,
}

impl KafkaSettings {
    /// librdkafka's configuration for bootstrap server `server`:
    /// credentials only if `server` is one of
    /// [`servers`](Self::servers).
    fn client_config(&self, server: &str, timeout_ms: u64) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", server)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", timeout_ms.to_string())
            .set(
                "request.timeout.ms",
                timeout_ms.clamp(100, 30_000).to_string(),
            )
            .set("socket.connection.setup.timeout.ms", "10000")
            .set("reconnect.backoff.max.ms", "1000");
        let sasl = self.sasl_mechanism.is_some() && self.servers.iter().any(|s| s == server);
        let protocol = match (sasl, self.tls) {
            (false, false) => "plaintext",
            (false, true) => "ssl",
            (true, false) => "sasl_plaintext",
            (true, true) => "sasl_ssl",
        };
        c.set("security.protocol", protocol);
        if sasl {
            if let Some(m) = &self.sasl_mechanism {
                c.set("sasl.mechanisms", m);
            }
            if let Some(u) = &self.sasl_username {
                c.set("sasl.username", u);
            }
            if let Some(p) = &self.sasl_password {
                c.set("sasl.password", p);
            }
        }
        if let Some(ca) = &self.tls_ca {
            c.set("ssl.ca.location", ca.display().to_string());
        }
        c
    }
}

/// The node's producers.
type Producer = FutureProducer<Quiet>;

/// A producer's slot: bootstrap `host:port` and `message.timeout.ms`.
type Slot = (String, u64);

/// Why an attempt failed: its class and message.
type Failure = (AttemptError, String);

/// A producer kept for its slot.
struct Kept {
    producer: Producer,
    /// When it was made.
    made: Instant,
    /// When an attempt last took it.
    used: Instant,
}

/// The node's producers by slot. Producers no attempt took for
/// [`IDLE`] are dropped (a sweep at most once per [`IDLE`] / 10).
struct Producers {
    kept: HashMap<Slot, Kept>,
    swept: Instant,
}

impl Default for Producers {
    fn default() -> Self {
        Producers {
            kept: HashMap::new(),
            swept: Instant::now(),
        }
    }
}

impl Producers {
    /// The producer of `slot`, marked used at `now`, and the producers
    /// idle for `idle` that a sweep due at `now` took out (to drop off the
    /// runtime threads).
    fn take(
        &mut self,
        slot: &Slot,
        now: Instant,
        idle: Duration,
    ) -> (Option<Producer>, Vec<Producer>) {
        let mut idled = Vec::new();
        if now.saturating_duration_since(self.swept) >= idle / 10 {
            self.swept = now;
            self.kept.retain(|s, k| {
                let keep = s == slot || now.saturating_duration_since(k.used) < idle;
                if !keep {
                    idled.push(k.producer.clone());
                }
                keep
            });
        }
        let found = self.kept.get_mut(slot).map(|k| {
            k.used = now;
            k.producer.clone()
        });
        (found, idled)
    }
}

/// How long a producer no attempt takes is kept (its handlers deleted,
/// their timeouts changed).
const IDLE: Duration = Duration::from_secs(600);

/// Drops producers off the runtime threads: librdkafka's teardown may
/// block.
fn drop_off_runtime(producers: Vec<Producer>) {
    if !producers.is_empty() {
        tokio::task::spawn_blocking(move || drop(producers));
    }
}

/// Produces deliveries to Kafka (see the module docs). Cheap to clone;
/// clones share their producers.
#[derive(Clone)]
pub struct KafkaSender {
    policy: EgressPolicy,
    settings: KafkaSettings,
    producers: Arc<Mutex<Producers>>,
    /// Per slot, the lock an attempt making its producer holds.
    making: Arc<Mutex<HashMap<Slot, Arc<tokio::sync::Mutex<()>>>>>,
    /// Per slot, the last failure to make its producer, and when.
    failures: Arc<Mutex<HashMap<Slot, (Instant, Failure)>>>,
    /// Handler URLs parsed once ([`kafka`]), by URL.
    targets: Arc<Mutex<HashMap<String, Arc<KafkaTarget>>>>,
}

/// How long metadata may take to arrive when a producer is made (at most;
/// the handler's `timeout_ms` when shorter).
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// After a failure to make a producer, attempts to the same slot fail with
/// its error for this long instead of each making one (a dead broker would
/// otherwise cost a librdkafka client, with its threads, per attempt).
const FAILED_FOR: Duration = Duration::from_secs(2);

/// A producer whose records time out or find no broker is replaced by a
/// new one once it is this old: an idempotent producer that timed out must
/// bump its epoch, which some Kafka-protocol brokers refuse (tansu 0.6),
/// and a new producer also reconnects at once.
const REPLACE_AFTER: Duration = Duration::from_secs(5);

impl KafkaSender {
    /// A sender to the clusters `policy` allows, with `settings`.
    pub fn new(policy: EgressPolicy, settings: KafkaSettings) -> Self {
        KafkaSender {
            policy,
            settings,
            producers: Arc::default(),
            making: Arc::default(),
            failures: Arc::default(),
            targets: Arc::default(),
        }
    }

    /// Makes attempt number `attempt` of `delivery` to the Kafka handler
    /// `handler`: its `timeout_ms` bounds the record's time in the
    /// producer, and making a producer for a new cluster adds at most as
    /// long again (its metadata fetch).
    pub async fn send(
        &self,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
        redacted: &[String],
    ) -> (AttemptOutcome, AttemptDetail) {
        let target = match self.target(&handler.url) {
            Ok(t) => t,
            Err(b) => return failed(AttemptError::Other, b.to_string()),
        };
        let timeout_ms = handler.timeout_ms.max(1);
        let producer = match self.producer(&target, timeout_ms).await {
            Ok(p) => p,
            Err((class, e)) => return failed(class, e),
        };
        let mut headers = OwnedHeaders::new_with_capacity(9)
            .insert(header("lanebus-id", &delivery.event_id))
            .insert(header("lanebus-type", &delivery.event_type))
            .insert(header("content-type", "application/json"));
        if let Some(key) = &delivery.key {
            headers = headers.insert(header("lanebus-key", key));
        }
        if let Some(seq) = delivery.seq {
            headers = headers.insert(header("lanebus-sequence", &seq.to_string()));
        }
        headers = headers
            .insert(header("lanebus-attempt", &attempt.to_string()))
            .insert(header("lanebus-lane", &delivery.lane.to_string()))
            .insert(header("lanebus-epoch", &delivery.epoch.to_string()));
        if delivery.replay {
            headers = headers.insert(header("lanebus-replay", "true"));
        }
        let redacted = crate::handler::redacted_header(redacted);
        if let Some(r) = &redacted {
            headers = headers.insert(header("lanebus-redacted", r));
        }
        let body = build_body(
            &delivery.event_type,
            delivery.published_at,
            &delivery.payload,
        );
        let mut record = FutureRecord::<str, [u8]>::to(&target.topic)
            .payload(&body[..])
            .headers(headers);
        if let Some(key) = &delivery.key {
            record = record.key(key.as_str());
        }
        let server = target.server();
        // librdkafka ends the record itself after message.timeout.ms; the
        // queue wait (a full local queue) counts against the same bound.
        match producer
            .send(record, Duration::from_millis(timeout_ms))
            .await
        {
            Ok(_) => (AttemptOutcome::Delivered, AttemptDetail::default()),
            Err((e, _)) => {
                // A producer the broker no longer takes (its id unknown
                // or fenced, e.g. after a broker restart or an epoch bump
                // the broker refused) or that failed fatally is replaced:
                // the next attempt makes a new one, and records still in
                // flight on this one end on it.
                let gone = producer.client().fatal_error().is_some() || producer_gone(&e);
                let stuck = matches!(
                    e.rdkafka_error_code(),
                    Some(
                        RDKafkaErrorCode::MessageTimedOut
                            | RDKafkaErrorCode::AllBrokersDown
                            | RDKafkaErrorCode::BrokerTransportFailure
                            | RDKafkaErrorCode::Unknown
                    )
                );
                if gone || stuck {
                    let slot = (server.clone(), timeout_ms);
                    let mut producers = self.producers.lock().expect("kafka producers");
                    if producers.kept.get(&slot).is_some_and(|k| {
                        k.producer.client().native_ptr() == producer.client().native_ptr()
                            && (gone || k.made.elapsed() >= REPLACE_AFTER)
                    }) {
                        producers.kept.remove(&slot);
                    }
                }
                // librdkafka's teardown may block: not on a runtime thread.
                tokio::task::spawn_blocking(move || drop(producer));
                let (class, e) = produce_error(&server, &target.topic, &e);
                failed(class, e)
            }
        }
    }

    /// The parsed handler URL `url`, parsed on its first attempt only.
    fn target(&self, url: &str) -> Result<Arc<KafkaTarget>, lanebus_store::rules::Broken> {
        if let Some(t) = self.targets.lock().expect("kafka targets").get(url) {
            return Ok(t.clone());
        }
        let t = Arc::new(kafka(url)?);
        let mut targets = self.targets.lock().expect("kafka targets");
        Ok(targets.entry(url.to_owned()).or_insert(t).clone())
    }

    /// The producer to `target`'s cluster with `timeout_ms`, made on first
    /// use once the SSRF guard passed the bootstrap server and every
    /// broker its metadata names.
    async fn producer(
        &self,
        target: &KafkaTarget,
        timeout_ms: u64,
    ) -> Result<Producer, (AttemptError, String)> {
        let server = target.server();
        let slot = (server.clone(), timeout_ms);
        let (found, idled) =
            self.producers
                .lock()
                .expect("kafka producers")
                .take(&slot, Instant::now(), IDLE);
        drop_off_runtime(idled);
        if let Some(p) = found {
            return Ok(p);
        }
        let what = format!("kafka {server}");
        if !self.settings.servers.is_empty() && !self.settings.servers.contains(&server) {
            return Err((
                AttemptError::SsrfGuard,
                format!("{what} is not one of the node's --kafka-servers"),
            ));
        }
        // One attempt per slot makes the producer; the others wait for it,
        // and within FAILED_FOR of a failure they fail with its error.
        let making = self
            .making
            .lock()
            .expect("kafka making")
            .entry(slot.clone())
            .or_default()
            .clone();
        let _one = making.lock().await;
        if let Some(k) = self
            .producers
            .lock()
            .expect("kafka producers")
            .kept
            .get(&slot)
        {
            return Ok(k.producer.clone());
        }
        if let Some((at, e)) = self.failures.lock().expect("kafka failures").get(&slot) {
            if at.elapsed() < FAILED_FOR {
                return Err(e.clone());
            }
        }
        match self.make(target, &server, timeout_ms).await {
            Ok(producer) => {
                self.failures.lock().expect("kafka failures").remove(&slot);
                let now = Instant::now();
                let mut producers = self.producers.lock().expect("kafka producers");
                Ok(producers
                    .kept
                    .entry(slot)
                    .or_insert(Kept {
                        producer,
                        made: now,
                        used: now,
                    })
                    .producer
                    .clone())
            }
            Err(e) => {
                self.failures
                    .lock()
                    .expect("kafka failures")
                    .insert(slot, (Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// A new producer to `target`'s cluster, once the SSRF guard passed
    /// the bootstrap server and every broker its metadata names (fetched
    /// within `timeout_ms`, at most [`METADATA_TIMEOUT`]).
    async fn make(
        &self,
        target: &KafkaTarget,
        server: &str,
        timeout_ms: u64,
    ) -> Result<Producer, (AttemptError, String)> {
        let what = format!("kafka {server}");
        crate::handler::check_server(&self.policy, &what, server).await?;
        let producer: Producer = self
            .settings
            .client_config(server, timeout_ms)
            .create_with_context(Quiet)
            .map_err(|e| (AttemptError::Other, format!("{what}: {e}")))?;
        let p = producer.clone();
        let topic = target.topic.clone();
        let wait = Duration::from_millis(timeout_ms).min(METADATA_TIMEOUT);
        let brokers = tokio::task::spawn_blocking(move || {
            let m = p.client().fetch_metadata(Some(&topic), wait)?;
            Ok::<_, KafkaError>(
                m.brokers()
                    .iter()
                    .map(|b| host_port(b.host(), b.port() as u16))
                    .collect::<Vec<_>>(),
            )
        })
        .await
        .map_err(|e| (AttemptError::Other, format!("{what}: {e}")))
        .and_then(|m| m.map_err(|e| produce_error(server, &target.topic, &e)));
        let checked = match brokers {
            Ok(brokers) => {
                let mut checked = Ok(());
                for at in brokers {
                    let named = format!("{what}: broker {at}");
                    checked = crate::handler::check_server(&self.policy, &named, &at).await;
                    if checked.is_err() {
                        break;
                    }
                }
                checked
            }
            Err(e) => Err(e),
        };
        match checked {
            Ok(()) => Ok(producer),
            Err(e) => {
                // librdkafka's teardown may block: not on a runtime thread.
                tokio::task::spawn_blocking(move || drop(producer));
                Err(e)
            }
        }
    }
}

/// The librdkafka client context of the node's producers: librdkafka's
/// errors and logs at debug level, since each attempt's outcome already
/// says what failed (a dead broker would otherwise log thousands of
/// `AllBrokersDown` lines a second).
#[derive(Clone, Copy, Debug)]
pub struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        tracing::debug!(target: "librdkafka", ?level, "{fac} {log_message}");
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!(target: "librdkafka", "{error}: {reason}");
    }
}

/// Whether `e` says the broker refuses the producer's id or epoch.
fn producer_gone(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::ProducerFenced
                | C::InvalidProducerEpoch
                | C::UnknownProducerId
                | C::OutOfOrderSequenceNumber
                | C::InvalidProducerIdMapping
                | C::Fatal
        )
    )
}

fn header<'a>(key: &'a str, value: &'a str) -> Header<'a, &'a str> {
    Header {
        key,
        value: Some(value),
    }
}

/// A produce or metadata error as an attempt-log class and message.
fn produce_error(server: &str, topic: &str, e: &KafkaError) -> (AttemptError, String) {
    use RDKafkaErrorCode as C;
    let class = match e.rdkafka_error_code() {
        Some(C::MessageTimedOut | C::RequestTimedOut | C::OperationTimedOut) => {
            AttemptError::Timeout
        }
        Some(C::AllBrokersDown | C::BrokerTransportFailure | C::BrokerNotAvailable) => {
            AttemptError::Refused
        }
        Some(C::Resolve) => AttemptError::Dns,
        Some(C::SSL) => AttemptError::Tls,
        _ => AttemptError::Other,
    };
    let hint = match e.rdkafka_error_code() {
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => {
            " (the cluster holds no such topic: create it)"
        }
        _ => "",
    };
    (class, format!("kafka {server} topic {topic:?}: {e}{hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn producers_no_attempt_takes_are_dropped() {
        let made = |server: &str| -> Producer {
            KafkaSettings::default()
                .client_config(server, 1_000)
                .create_with_context(Quiet)
                .expect("producer")
        };
        let t0 = Instant::now();
        let idle = Duration::from_secs(600);
        let mut p = Producers {
            kept: HashMap::new(),
            swept: t0,
        };
        for s in ["a:9092", "b:9092"] {
            p.kept.insert(
                (s.into(), 1_000),
                Kept {
                    producer: made(s),
                    made: t0,
                    used: t0,
                },
            );
        }
        let a = ("a:9092".to_owned(), 1_000);
        let b = ("b:9092".to_owned(), 1_000);
        // `a` is taken at 5 min, `b` never again.
        let (found, idled) = p.take(&a, t0 + Duration::from_secs(300), idle);
        assert!(found.is_some() && idled.is_empty());
        let (found, idled) = p.take(&a, t0 + Duration::from_secs(601), idle);
        assert!(found.is_some());
        assert_eq!(idled.len(), 1, "b idle for 10 min is dropped");
        assert!(!p.kept.contains_key(&b) && p.kept.contains_key(&a));
        // No sweep again within a minute, and `a` was used at 10 min.
        let (_, idled) = p.take(&b, t0 + Duration::from_secs(1_250), idle);
        assert_eq!(idled.len(), 1, "a idle since 601 s is dropped at 1,250 s");
        tokio::task::spawn_blocking(move || drop((found, idled, p.kept)))
            .await
            .expect("dropped");
    }

    #[test]
    fn credentials_go_only_to_their_servers() {
        let s = KafkaSettings {
            sasl_mechanism: Some("SCRAM-SHA-256".into()),
            sasl_username: Some("u".into()),
            sasl_password: Some("p".into()),
            servers: vec!["kafka.internal:9092".into()],
            tls: true,
            tls_ca: None,
        };
        let own = s.client_config("kafka.internal:9092", 5_000);
        assert_eq!(own.get("sasl.username"), Some("u"));
        assert_eq!(own.get("sasl.password"), Some("p"));
        assert_eq!(own.get("security.protocol"), Some("sasl_ssl"));
        let other = s.client_config("elsewhere.example:9092", 5_000);
        assert_eq!(other.get("sasl.username"), None);
        assert_eq!(other.get("sasl.password"), None);
        assert_eq!(other.get("security.protocol"), Some("ssl"));
        assert_eq!(other.get("message.timeout.ms"), Some("5000"));
        assert_eq!(other.get("enable.idempotence"), Some("true"));
    }
}
