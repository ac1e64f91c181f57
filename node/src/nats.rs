//! NATS JetStream handlers: a handler whose URL is
//! `nats://HOST[:PORT]/SUBJECT` ([`lanebus_store::rules::handler::nats`])
//! gets each delivery published to SUBJECT (`{type}` and `{key}` replaced by
//! the event's) on that server, and the stream's publish acknowledgement
//! completes it. The message carries the webhook body
//! ([`crate::webhook::build_body`]), `Nats-Msg-Id` = `EVENT_ID:HANDLER_ID`
//! (so the stream drops a repeat of a delivery within its duplicate window,
//! and an acknowledged repeat counts as delivered), and the headers
//! `lanebus-id` (the event id), `lanebus-type`,
//! `lanebus-key`, `lanebus-sequence`, `lanebus-attempt`, `lanebus-lane` and
//! `lanebus-epoch`. Key order, retries, dead letters, disabling and rate
//! limits are the key runners', as for webhooks: a key's next event is
//! published only after the previous one was acknowledged.
//!
//! The stream itself is the operator's (subjects, storage, duplicate
//! window): a publish to a subject no stream holds fails the attempt
//! ("no stream"). Credentials and TLS are the node's settings
//! ([`NatsSettings`]); credentials go only to the servers they are given
//! for. The SSRF guard
//! ([`EgressPolicy`]) checks every address of the host before the first
//! connection. One connection per server is kept, shared by every handler
//! and lane of the node; it reconnects by itself after a broker restart.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use lanebus_store::egress::EgressPolicy;
use lanebus_store::rules::handler::{nats, NatsTarget};
use lanebus_store::{AttemptError, Delivery, Handler as HandlerConfig};

use crate::handler::failed;
use crate::retry::AttemptOutcome;
use crate::webhook::{build_body, AttemptDetail};

/// Whether a handler URL names a NATS JetStream destination.
pub fn is_nats(url: &str) -> bool {
    url.starts_with("nats://")
}

/// Credentials and TLS for the NATS servers a node publishes to
/// (`--nats-user`, `--nats-password`, `--nats-token`,
/// `--nats-credential-servers`, `--nats-tls-ca`, `--nats-tls-required`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsSettings {
    /// User, with [`password`](Self::password).
    pub user: Option<String>,
    /// Password of [`user`](Self::user).
    pub password: Option<String>,
    /// Token (instead of a user and password).
    pub token: Option<String>,
    /// Servers (`host:port`, as in handler URLs) that get the credentials;
    /// a handler naming another server connects without them.
    pub credential_servers: Vec<String>,
    /// PEM file of the CA certificates to trust (besides the system's).
    pub tls_ca: Option<PathBuf>,
    /// Refuse servers that do not offer TLS.
    pub tls_required: bool,
}

/// Publishes deliveries to NATS JetStream (see the module docs). Cheap to
/// clone; clones share their connections.
#[derive(Clone)]
pub struct NatsSender {
    policy: EgressPolicy,
    settings: NatsSettings,
    /// JetStream contexts by `host:port`.
    contexts: Arc<Mutex<HashMap<String, jetstream::Context>>>,
    /// Per server, the lock an attempt connecting to it holds.
    connecting: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    /// Handler URLs parsed once ([`nats`]), by URL.
    targets: Arc<Mutex<HashMap<String, Arc<NatsTarget>>>>,
}

impl NatsSender {
    /// A sender to the servers `policy` allows, with `settings`.
    pub fn new(policy: EgressPolicy, settings: NatsSettings) -> Self {
        NatsSender {
            policy,
            settings,
            contexts: Arc::default(),
            connecting: Arc::default(),
            targets: Arc::default(),
        }
    }

    /// Makes attempt number `attempt` of `delivery` to the NATS handler
    /// `handler`, within its `timeout_ms` (connecting included).
    pub async fn send(
        &self,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
        redacted: &[String],
    ) -> (AttemptOutcome, AttemptDetail) {
        let timeout = Duration::from_millis(handler.timeout_ms.max(1));
        let target = match self.target(&handler.url) {
            Ok(t) => t,
            Err(b) => return failed(AttemptError::Other, b.to_string()),
        };
        let subject = match target.subject_for(&delivery.event_type, delivery.key.as_deref()) {
            Ok(s) => s,
            Err(e) => return failed(AttemptError::Other, e),
        };
        match tokio::time::timeout(
            timeout,
            self.publish(&target, subject, delivery, attempt, redacted),
        )
        .await
        {
            Ok(Ok(())) => (AttemptOutcome::Delivered, AttemptDetail::default()),
            Ok(Err((class, error))) => failed(class, error),
            Err(_) => failed(
                AttemptError::Timeout,
                format!(
                    "no publish acknowledgement from nats {} within {} ms",
                    target.server(),
                    handler.timeout_ms
                ),
            ),
        }
    }

    async fn publish(
        &self,
        target: &NatsTarget,
        subject: String,
        delivery: &Delivery,
        attempt: u32,
        redacted: &[String],
    ) -> Result<(), (AttemptError, String)> {
        let js = self.context(target).await?;
        // The client queues a publish while it reconnects and sends it
        // once back, after this attempt counted as failed (a dead letter
        // of a delivered event, or a repeat past the duplicate window): an
        // attempt without a connection fails before it is queued.
        if js.client().connection_state() != async_nats::connection::State::Connected {
            return Err((
                AttemptError::Refused,
                format!("nats {}: not connected (reconnecting)", target.server()),
            ));
        }
        let mut headers = async_nats::HeaderMap::new();
        // One id per delivery (event and handler): the stream drops a
        // repeat of it, not another handler's message of the same event.
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("{}:{}", delivery.event_id, delivery.handler_id).as_str(),
        );
        headers.insert("lanebus-id", delivery.event_id.as_str());
        headers.insert("content-type", "application/json");
        headers.insert("lanebus-type", delivery.event_type.as_str());
        if let Some(key) = &delivery.key {
            headers.insert("lanebus-key", key.as_str());
        }
        if let Some(seq) = delivery.seq {
            headers.insert("lanebus-sequence", seq.to_string().as_str());
        }
        headers.insert("lanebus-attempt", attempt.to_string().as_str());
        headers.insert("lanebus-lane", delivery.lane.to_string().as_str());
        headers.insert("lanebus-epoch", delivery.epoch.to_string().as_str());
        if delivery.replay {
            headers.insert("lanebus-replay", "true");
        }
        if let Some(r) = crate::handler::redacted_header(redacted) {
            headers.insert("lanebus-redacted", r.as_str());
        }
        let body = build_body(
            &delivery.event_type,
            delivery.published_at,
            &delivery.payload,
        );
        let server = target.server();
        let ack = js
            .publish_with_headers(subject.clone(), headers, body.into())
            .await
            .map_err(|e| publish_error(&server, &subject, &e))?;
        ack.await
            .map_err(|e| publish_error(&server, &subject, &e))?;
        Ok(())
    }

    /// The parsed handler URL `url`, parsed on its first attempt only.
    fn target(&self, url: &str) -> Result<Arc<NatsTarget>, lanebus_store::rules::Broken> {
        if let Some(t) = self.targets.lock().expect("nats targets").get(url) {
            return Ok(t.clone());
        }
        let t = Arc::new(nats(url)?);
        let mut targets = self.targets.lock().expect("nats targets");
        Ok(targets.entry(url.to_owned()).or_insert(t).clone())
    }

    /// The JetStream context of `target`'s server, connecting on first use
    /// (one attempt connects, the others wait for it).
    async fn context(
        &self,
        target: &NatsTarget,
    ) -> Result<jetstream::Context, (AttemptError, String)> {
        let server = target.server();
        if let Some(js) = self.contexts.lock().expect("nats contexts").get(&server) {
            return Ok(js.clone());
        }
        // One attempt per server connects; the others wait for it.
        let connecting = self
            .connecting
            .lock()
            .expect("nats connecting")
            .entry(server.clone())
            .or_default()
            .clone();
        let _one = connecting.lock().await;
        if let Some(js) = self.contexts.lock().expect("nats contexts").get(&server) {
            return Ok(js.clone());
        }
        crate::handler::check_server(&self.policy, &format!("nats {server}"), &server).await?;
        let s = &self.settings;
        // Only the server the SSRF guard checked: servers it advertises
        // would get the node's credentials unchecked.
        let mut options = async_nats::ConnectOptions::new()
            .require_tls(s.tls_required)
            .ignore_discovered_servers();
        if s.credential_servers.contains(&server) {
            if let (Some(user), Some(password)) = (&s.user, &s.password) {
                options = options.user_and_password(user.clone(), password.clone());
            }
            if let Some(token) = &s.token {
                options = options.token(token.clone());
            }
        }
        if let Some(ca) = &s.tls_ca {
            options = options.add_root_certificates(ca.clone());
        }
        let client = options
            .connect(format!("nats://{server}"))
            .await
            .map_err(|e| {
                use async_nats::ConnectErrorKind as K;
                let class = match e.kind() {
                    K::Dns => AttemptError::Dns,
                    K::Tls => AttemptError::Tls,
                    K::TimedOut => AttemptError::Timeout,
                    K::Io => AttemptError::Refused,
                    _ => AttemptError::Other,
                };
                (class, format!("nats {server}: {e}"))
            })?;
        // The handler's timeout bounds each publish (send): the context's
        // own acknowledgement timeout only backs it up.
        let js = jetstream::ContextBuilder::new()
            .timeout(Duration::from_millis(
                *lanebus_store::rules::handler::TIMEOUT_MS.end(),
            ))
            .build(client);
        let mut contexts = self.contexts.lock().expect("nats contexts");
        Ok(contexts.entry(server).or_insert(js).clone())
    }
}

/// A publish error as an attempt-log class and message.
fn publish_error(
    server: &str,
    subject: &str,
    e: &jetstream::context::PublishError,
) -> (AttemptError, String) {
    use jetstream::context::PublishErrorKind as K;
    let class = match e.kind() {
        K::TimedOut => AttemptError::Timeout,
        K::BrokenPipe => AttemptError::Reset,
        _ => AttemptError::Other,
    };
    let hint = if e.kind() == K::StreamNotFound {
        " (no JetStream stream holds this subject: create one)"
    } else {
        ""
    };
    (
        class,
        format!("nats {server} subject {subject:?}: {e}{hint}"),
    )
}
