//! Webhook requests as docs/design.md section 5 (contract) defines them.
//!
//! ```text
//! POST <handler url>
//! content-type: application/json
//! webhook-id: <event id>                 same on every attempt
//! webhook-timestamp: <unix seconds>      time of this attempt
//! webhook-signature: v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>
//!                    (during a secret rotation's grace period: "v1,<new> v1,<old>")
//! lanebus-key: <key>                     only for keyed events
//! lanebus-sequence: <position within the key>
//! lanebus-attempt: <1, 2, ...>
//! lanebus-lane: <0..255>                 the event's lane
//! lanebus-epoch: <lane epoch>            the owner's fencing token (below)
//! lanebus-replay: true                   only for a recovery (delivered before)
//!
//! {"type":"issues.opened","timestamp":"<published_at, RFC 3339>","data":<payload>}
//! ```
//!
//! Signing follows the Standard Webhooks specification
//! (<https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md>):
//! the secret is `whsec_` + base64 of the key bytes, and the key is the
//! base64-*decoded* part after the prefix. The body is assembled around the
//! stored payload bytes, which are spliced in as they are and never
//! re-serialized, so the receiver sees exactly what the publisher sent.
//! The body does not change between attempts; the timestamp header does.
//!
//! Outcomes ([`classify`]): a 2xx completes; anything else, a timeout or a
//! transport error is a failed attempt; `429`/`503` with `Retry-After` set the
//! next attempt's time (never sooner than the backoff's base delay, see
//! [`crate::retry`]). `410 Gone` ([`AttemptOutcome::Gone`]) is a failed
//! attempt that also disables the handler: the key runner records the
//! attempt, sets the handler `disabled` in the store, and its deliveries are
//! kept without being attempted (on every node, once its catalog reloads)
//! until `POST /v1/handlers/{id}/enable`. Redirects are not followed: a 3xx
//! is a failure.
//!
//! `lanebus-epoch` is the lane's epoch the sending owner claimed the
//! delivery at; it only grows per lane. A receiver that keeps, per lane,
//! the highest epoch it accepted and answers a lower one with a 409 (not
//! 2xx) refuses a deposed owner's late request (docs/api.md, "Receiving
//! webhooks").
//!
//! The SSRF guard ([`lanebus_store::egress`]) is checked again at each send: a
//! literal address in the URL before the request, a name by the client's
//! resolver, whose checked addresses are the ones connected to. A refused
//! target is a failed attempt whose error starts `refused by the ssrf
//! guard:` and names the address and its range. No proxy is used.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Once};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use chrono::{DateTime, SecondsFormat, Utc};
use hmac::{Hmac, Mac};
use lanebus_store::egress::{EgressPolicy, Refused};
use lanebus_store::{AttemptError, Delivery, FailedAttempt, Handler as HandlerConfig};
use sha2::Sha256;

use crate::retry::{parse_retry_after, AttemptOutcome};

/// Prefix of a signing secret ([`lanebus_store::rules::secret::PREFIX`]).
pub const SECRET_PREFIX: &str = lanebus_store::rules::secret::PREFIX;

/// Errors of signing and of building the HTTP client.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The secret is not `whsec_` + base64.
    #[error("signing secret must be \"whsec_\" followed by base64: {0}")]
    BadSecret(String),
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(String),
}

static CRYPTO: Once = Once::new();

/// Installs rustls' `ring` crypto provider as the process default, once.
/// reqwest is built with the `*-no-provider` rustls features, so this must
/// run before the first HTTP client is built.
pub fn install_crypto_provider() {
    CRYPTO.call_once(|| {
        // Another library may have installed one already: that is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The key bytes of a `whsec_...` secret.
///
/// # Errors
/// [`WebhookError::BadSecret`] if the prefix is missing or the rest is not base64.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, WebhookError> {
    let b64 = secret
        .strip_prefix(SECRET_PREFIX)
        .ok_or_else(|| WebhookError::BadSecret("missing whsec_ prefix".into()))?;
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| WebhookError::BadSecret(e.to_string()))
}

/// The request body: `{"type":...,"timestamp":...,"data":<payload>}`, with
/// the payload bytes spliced in unchanged.
pub fn build_body(event_type: &str, published_at: DateTime<Utc>, payload: &[u8]) -> Vec<u8> {
    let type_json = serde_json::to_string(event_type).expect("a string serializes");
    let ts = published_at.to_rfc3339_opts(SecondsFormat::Micros, true);
    let mut body = Vec::with_capacity(payload.len() + type_json.len() + ts.len() + 40);
    body.extend_from_slice(b"{\"type\":");
    body.extend_from_slice(type_json.as_bytes());
    body.extend_from_slice(b",\"timestamp\":\"");
    body.extend_from_slice(ts.as_bytes());
    body.extend_from_slice(b"\",\"data\":");
    body.extend_from_slice(payload);
    body.push(b'}');
    body
}

/// The `webhook-signature` value: `v1,` + base64(HMAC-SHA256(key,
/// "{msg_id}.{timestamp}.{body}")), `key` being the decoded secret.
pub fn sign_with_key(key: &[u8], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("hmac takes any key length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let sig = mac.finalize().into_bytes();
    format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(sig)
    )
}

/// [`sign_with_key`] for a `whsec_...` secret.
///
/// # Errors
/// [`WebhookError::BadSecret`] for a malformed secret.
pub fn sign(
    secret: &str,
    msg_id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<String, WebhookError> {
    Ok(sign_with_key(
        &decode_secret(secret)?,
        msg_id,
        timestamp,
        body,
    ))
}

/// The `webhook-signature` value for `handler` of a request sent at
/// `sent_at` (signed with its unix seconds, the `webhook-timestamp`):
/// `v1,<sig>` with the current secret, followed, while the previous
/// secret's grace period lasts at `sent_at`, by a space and `v1,<sig>` with
/// the previous one. Standard Webhooks allows several space-separated
/// signatures; a receiver knowing either secret verifies ([`verify`]).
///
/// # Errors
/// [`WebhookError::BadSecret`] for a malformed secret.
pub fn signature_header(
    handler: &HandlerConfig,
    msg_id: &str,
    sent_at: DateTime<Utc>,
    body: &[u8],
) -> Result<String, WebhookError> {
    let mut signatures = Vec::with_capacity(2);
    for secret in handler.signing_secrets(sent_at) {
        signatures.push(sign(secret, msg_id, sent_at.timestamp(), body)?);
    }
    Ok(signatures.join(" "))
}

/// Verifies a `webhook-signature` header (space-separated list of
/// `v1,<sig>` entries; any match verifies) in constant time per entry.
/// Does not check the timestamp's age; receivers that want replay
/// protection compare it with their clock.
pub fn verify(
    secret: &str,
    msg_id: &str,
    timestamp: &str,
    signature_header: &str,
    body: &[u8],
) -> bool {
    let Ok(key) = decode_secret(secret) else {
        return false;
    };
    let mut signed = Vec::with_capacity(msg_id.len() + timestamp.len() + body.len() + 2);
    signed.extend_from_slice(msg_id.as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(timestamp.as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(body);
    signature_header.split(' ').any(|entry| {
        let Some(b64) = entry.strip_prefix("v1,") else {
            return false;
        };
        let Ok(sig) = base64::engine::general_purpose::STANDARD.decode(b64) else {
            return false;
        };
        let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("hmac takes any key length");
        mac.update(&signed);
        mac.verify_slice(&sig).is_ok()
    })
}

/// Classifies an HTTP answer. `retry_after` is the raw `Retry-After` header;
/// it only counts on 429 and 503. `410 Gone` is [`AttemptOutcome::Gone`].
pub fn classify(status: u16, retry_after: Option<&str>, now: SystemTime) -> AttemptOutcome {
    if (200..300).contains(&status) {
        return AttemptOutcome::Delivered;
    }
    if status == 410 {
        return AttemptOutcome::Gone {
            error: "http 410".into(),
        };
    }
    let retry_after = if status == 429 || status == 503 {
        retry_after.and_then(|v| parse_retry_after(v, now))
    } else {
        None
    };
    AttemptOutcome::Failed {
        error: format!("http {status}"),
        retry_after,
    }
}

/// What a failed attempt's log entry keeps besides its number, time and
/// duration ([`FailedAttempt`]): the HTTP status, the transport error
/// class, the first bytes of the response body. Empty for a success.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptDetail {
    /// HTTP status of the answer, if one came.
    pub status: Option<u16>,
    /// Transport error class, if the attempt got no answer or lost its body.
    pub error: Option<AttemptError>,
    /// [`FailedAttempt::body_prefix`] of the response body (non-2xx only).
    pub body: Option<String>,
    /// Whether `body` was dropped ([`withhold`](Self::withhold)).
    pub body_withheld: bool,
}

impl AttemptDetail {
    /// A failure without an HTTP answer.
    pub fn error(class: AttemptError) -> Self {
        AttemptDetail {
            error: Some(class),
            ..AttemptDetail::default()
        }
    }

    /// `sent` with nothing kept that the receiver answered: the outcome of
    /// an attempt whose payload held personal values in clear. A receiver
    /// (or an in-process handler's error) may quote them, and the attempt
    /// log and `last_error` outlive the subject's erasure, so the body and
    /// a handler's message are replaced by the fact that they were
    /// withheld. Statuses, error classes and transport errors are kept.
    pub fn withhold(sent: (AttemptOutcome, AttemptDetail)) -> (AttemptOutcome, AttemptDetail) {
        let (mut outcome, mut detail) = sent;
        if detail.body.take().is_some() || detail.error == Some(AttemptError::Handler) {
            detail.body_withheld = true;
        }
        if detail.error == Some(AttemptError::Handler) {
            match &mut outcome {
                AttemptOutcome::Failed { error, .. } | AttemptOutcome::Gone { error } => {
                    *error = WITHHELD.into();
                }
                _ => {}
            }
        }
        (outcome, detail)
    }
}

/// `last_error` of an in-process handler's failure whose message was
/// withheld ([`AttemptDetail::withhold`]).
pub const WITHHELD: &str = "handler error (message withheld: the payload had personal fields)";

/// Sends webhooks over one pooled HTTP client (keep-alive, no redirects, no
/// proxy), to the addresses its [`EgressPolicy`] allows (the SSRF guard).
#[derive(Clone)]
pub struct WebhookSender {
    client: reqwest::Client,
    policy: EgressPolicy,
}

/// The HTTP client's DNS resolver: resolves with the system resolver
/// (`getaddrinfo`, as reqwest's default does) and refuses the name when any
/// address it resolves to is refused by the policy. The client connects only
/// to the addresses returned here, so the address checked is the address
/// connected to (no DNS rebinding between check and connect).
struct GuardedResolver {
    policy: EgressPolicy,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            for a in &addrs {
                policy
                    .check_ip(a.ip())
                    .map_err(|e| Refused(format!("host {host:?} resolves to {e}")))?;
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Largest part of a response body read (and discarded) so the connection
/// can be reused, in bytes.
const MAX_DRAIN_BYTES: usize = 64 * 1024;

impl WebhookSender {
    /// A sender with its own connection pool.
    ///
    /// # Errors
    /// [`WebhookError::Client`] if the TLS setup fails.
    pub fn new(policy: EgressPolicy) -> Result<Self, WebhookError> {
        Self::with_source_ip(policy, None)
    }

    /// A sender with its own connection pool whose connections are bound to
    /// the local address `source` (reqwest's `ClientBuilder::local_address`;
    /// `None`: the OS picks). Pins the egress address a receiver sees; the
    /// chaos suite gives each node its own loopback address so its receiver
    /// knows the sender from the peer address.
    ///
    /// # Errors
    /// [`WebhookError::Client`] if the TLS setup fails.
    pub fn with_source_ip(
        policy: EgressPolicy,
        source: Option<std::net::IpAddr>,
    ) -> Result<Self, WebhookError> {
        install_crypto_provider();
        let client = reqwest::Client::builder()
            .local_address(source)
            .redirect(reqwest::redirect::Policy::none())
            // A proxy would be resolved and connected to instead of the
            // target, and the guard would check the proxy.
            .no_proxy()
            .dns_resolver(Arc::new(GuardedResolver {
                policy: policy.clone(),
            }))
            .pool_max_idle_per_host(256)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("lanebus/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| WebhookError::Client(e.to_string()))?;
        Ok(WebhookSender { client, policy })
    }

    /// The SSRF guard this sender connects under.
    pub fn policy(&self) -> &EgressPolicy {
        &self.policy
    }

    /// Makes attempt number `attempt` (1, 2, ...) of `delivery` to the webhook
    /// of `handler`, within the handler's `timeout_ms`; for a failed attempt,
    /// also what its attempt log keeps ([`AttemptDetail`]; the first
    /// [`ATTEMPT_BODY_BYTES`](lanebus_store::ATTEMPT_BODY_BYTES) of the
    /// body of a non-2xx answer are kept while it is drained).
    pub async fn send(
        &self,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
        redacted: &[String],
    ) -> (AttemptOutcome, AttemptDetail) {
        let body = build_body(
            &delivery.event_type,
            delivery.published_at,
            &delivery.payload,
        );
        let sent_at = Utc::now();
        let now = sent_at.timestamp();
        let signature = match signature_header(handler, &delivery.event_id, sent_at, &body) {
            Ok(s) => s,
            Err(e) => {
                let failed = AttemptOutcome::Failed {
                    error: e.to_string(),
                    retry_after: None,
                };
                return (failed, AttemptDetail::error(AttemptError::Other));
            }
        };
        let url = match self.target(&handler.url) {
            Ok(u) => u,
            Err((class, error)) => {
                let failed = AttemptOutcome::Failed {
                    error,
                    retry_after: None,
                };
                return (failed, AttemptDetail::error(class));
            }
        };
        let mut req = self
            .client
            .post(url)
            .timeout(Duration::from_millis(handler.timeout_ms.max(1)))
            .header("content-type", "application/json")
            .header("webhook-id", &delivery.event_id)
            .header("webhook-timestamp", now.to_string())
            .header("webhook-signature", signature)
            .header("lanebus-attempt", attempt.to_string())
            .header("lanebus-lane", delivery.lane.to_string())
            .header("lanebus-epoch", delivery.epoch.to_string());
        if let Some(key) = &delivery.key {
            req = req.header("lanebus-key", key);
        }
        if let Some(seq) = delivery.seq {
            req = req.header("lanebus-sequence", seq.to_string());
        }
        if delivery.replay {
            req = req.header("lanebus-replay", "true");
        }
        if let Some(r) = crate::handler::redacted_header(redacted) {
            req = req.header("lanebus-redacted", r);
        }
        let mut resp = match req.body(body).send().await {
            Ok(r) => r,
            Err(e) => {
                let failed = AttemptOutcome::Failed {
                    error: transport_error(&e, handler.timeout_ms),
                    retry_after: None,
                };
                return (failed, AttemptDetail::error(error_class(&e)));
            }
        };
        let status = resp.status().as_u16();
        let success = (200..300).contains(&status);
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // The start of a failure's body, for its attempt log.
        let mut kept: Vec<u8> = Vec::new();
        let mut drained = 0;
        while drained < MAX_DRAIN_BYTES {
            match resp.chunk().await {
                Ok(Some(c)) => {
                    drained += c.len();
                    if !success && kept.len() <= lanebus_store::ATTEMPT_BODY_BYTES {
                        let room = lanebus_store::ATTEMPT_BODY_BYTES + 1 - kept.len();
                        kept.extend_from_slice(&c[..c.len().min(room)]);
                    }
                }
                Ok(None) => break,
                Err(e) if success => {
                    // The status counts: the handler answered 2xx.
                    tracing::debug!(error = %e, "response body cut short after 2xx");
                    break;
                }
                Err(e) => {
                    let failed = AttemptOutcome::Failed {
                        error: format!(
                            "http {status}, then {}",
                            transport_error(&e, handler.timeout_ms)
                        ),
                        retry_after: None,
                    };
                    let detail = AttemptDetail {
                        status: Some(status),
                        error: Some(error_class(&e)),
                        body: FailedAttempt::body_prefix(&kept),
                        body_withheld: false,
                    };
                    return (failed, detail);
                }
            }
        }
        let outcome = classify(status, retry_after.as_deref(), SystemTime::now());
        let detail = if success {
            AttemptDetail::default()
        } else {
            AttemptDetail {
                status: Some(status),
                error: None,
                body: FailedAttempt::body_prefix(&kept),
                body_withheld: false,
            }
        };
        (outcome, detail)
    }
}

impl WebhookSender {
    /// The parsed URL of a handler, if the SSRF guard lets it through: scheme
    /// `http` or `https`, and a literal IP address allowed by the policy
    /// (names are checked by [`GuardedResolver`] when connecting, since
    /// reqwest does not resolve literal addresses).
    fn target(&self, raw: &str) -> Result<reqwest::Url, (AttemptError, String)> {
        let url = reqwest::Url::parse(raw)
            .map_err(|e| (AttemptError::Other, format!("url {raw:?}: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err((
                AttemptError::SsrfGuard,
                format!(
                    "refused by the ssrf guard: url scheme {:?} is not http or https",
                    url.scheme()
                ),
            ));
        }
        let literal = match url.host() {
            Some(url::Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
            Some(url::Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
            _ => None,
        };
        if let Some(ip) = literal {
            self.policy.check_ip(ip).map_err(|e| {
                let error = format!("refused by the ssrf guard: the url points to {e}");
                (AttemptError::SsrfGuard, error)
            })?;
        }
        Ok(url)
    }
}

/// A transport error as kept in `last_error`: the error and its causes; a
/// refusal of the SSRF guard's resolver is named as such.
fn transport_error(e: &reqwest::Error, timeout_ms: u64) -> String {
    if e.is_timeout() {
        return format!("timeout after {timeout_ms} ms");
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<Refused>() {
            return format!("refused by the ssrf guard: {r}");
        }
        source = s.source();
    }
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// The class of a transport error ([`AttemptError`]), from the error and
/// its causes: the SSRF guard's refusal, then the I/O error kind (refused,
/// reset, timed out), a rustls error (TLS), the connector's `dns error`,
/// hyper's closed connection (reset).
fn error_class(e: &reqwest::Error) -> AttemptError {
    if e.is_timeout() {
        return AttemptError::Timeout;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.downcast_ref::<Refused>().is_some() {
            return AttemptError::SsrfGuard;
        }
        if s.downcast_ref::<rustls::Error>().is_some() {
            return AttemptError::Tls;
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind as K;
            // An io::Error's source() skips the error it wraps: look at it.
            if let Some(inner) = io.get_ref() {
                if inner.downcast_ref::<Refused>().is_some() {
                    return AttemptError::SsrfGuard;
                }
                if inner.downcast_ref::<rustls::Error>().is_some() {
                    return AttemptError::Tls;
                }
            }
            match io.kind() {
                K::ConnectionRefused => return AttemptError::Refused,
                K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe | K::UnexpectedEof => {
                    return AttemptError::Reset
                }
                K::TimedOut => return AttemptError::Timeout,
                _ => {}
            }
        }
        let msg = s.to_string();
        if msg == "dns error" || msg.starts_with("dns error:") {
            return AttemptError::Dns;
        }
        if msg.contains("connection closed before message completed")
            || msg.contains("connection reset")
        {
            return AttemptError::Reset;
        }
        source = s.source();
    }
    AttemptError::Other
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanebus_store::Epoch;

    // Test vector of the Standard Webhooks reference libraries
    // (standard-webhooks/libraries, `python/tests/test_webhooks.py` and the
    // spec's example): secret, id, timestamp, payload and expected signature.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const MSG_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const TS: i64 = 1614265330;
    const PAYLOAD: &[u8] = br#"{"test": 2432232314}"#;
    const EXPECTED: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn withhold_drops_bodies_and_handler_messages_only() {
        let failed = |e: &str| AttemptOutcome::Failed {
            error: e.into(),
            retry_after: None,
        };
        let answered = AttemptDetail {
            status: Some(500),
            body: Some("echo: alice@example.org".into()),
            ..AttemptDetail::default()
        };
        let (o, d) = AttemptDetail::withhold((failed("http 500"), answered));
        assert_eq!(o, failed("http 500"));
        assert_eq!((d.status, d.body, d.body_withheld), (Some(500), None, true));
        let handler = AttemptDetail {
            body: Some("bad alice@example.org".into()),
            ..AttemptDetail::error(AttemptError::Handler)
        };
        let (o, d) = AttemptDetail::withhold((failed("bad alice@example.org"), handler));
        assert_eq!(o, failed(WITHHELD));
        assert!(d.body.is_none() && d.body_withheld);
        let timeout = AttemptDetail::error(AttemptError::Timeout);
        let (o, d) = AttemptDetail::withhold((failed("timeout after 5 ms"), timeout.clone()));
        assert_eq!((o, d), (failed("timeout after 5 ms"), timeout));
    }

    /// A fresh delivery of event `evt_1` (payload `{}`) to `handler_id`.
    fn test_delivery(handler_id: &str) -> Delivery {
        Delivery {
            id: 1,
            lane: 0,
            epoch: Epoch(1),
            handler_id: handler_id.into(),
            event_id: "evt_1".into(),
            event_type: "a.b".into(),
            key: None,
            seq: None,
            attempts: 0,
            due_at: Utc::now(),
            last_error: None,
            payload: bytes::Bytes::from_static(b"{}"),
            published_at: Utc::now(),
            replay: false,
        }
    }

    /// `with_source_ip` binds every connection to the given local address:
    /// the receiver sees it as the peer (Linux routes all of 127.0.0.0/8 to
    /// loopback).
    #[tokio::test]
    async fn requests_leave_from_the_source_ip() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let peer = tokio::spawn(async move {
            let (mut sock, peer) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 64 << 10];
            let _ = sock.read(&mut buf).await.unwrap();
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            peer
        });
        let handler: HandlerConfig = serde_json::from_value(serde_json::json!({
            "id": "hdl_00000000000000000000000000000001",
            "name": "h",
            "url": format!("http://127.0.0.1:{port}/hook"),
            "event_types": ["*"],
            "max_attempts": 1,
            "timeout_ms": 5000,
            "max_in_flight": 1,
            "secret": SECRET,
            "state": "enabled",
            "created_at": "2026-01-01T00:00:00Z",
        }))
        .unwrap();
        let delivery = test_delivery(&handler.id);
        let sender = WebhookSender::with_source_ip(
            EgressPolicy::allow_loopback(),
            Some([127, 0, 0, 7].into()),
        )
        .unwrap();
        let (out, detail) = sender.send(&handler, &delivery, 1, &[]).await;
        assert!(matches!(out, AttemptOutcome::Delivered), "{out:?}");
        assert_eq!(detail, AttemptDetail::default(), "a success keeps nothing");
        assert_eq!(peer.await.unwrap().ip().to_string(), "127.0.0.7");
    }

    /// Transport failures are classed for the attempt log: the SSRF
    /// guard's refusal, a refused connection, a timeout.
    #[tokio::test]
    async fn transport_failures_are_classed() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        // Accepts and never answers.
        let _hold = tokio::spawn(async move {
            let mut socks = Vec::new();
            while let Ok((sock, _)) = silent.accept().await {
                socks.push(sock);
            }
        });
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let closed_port = closed.local_addr().unwrap().port();
        drop(closed);
        let delivery = test_delivery("hdl_x");
        let handler = |port: u16| {
            lanebus_store::Handler::registered(
                "hdl_x".into(),
                lanebus_store::NewHandler {
                    name: "n".into(),
                    url: format!("http://127.0.0.1:{port}/hook"),
                    event_types: vec!["*".into()],
                    max_attempts: 1,
                    timeout_ms: 300,
                    max_in_flight: 1,
                    secret: SECRET.into(),
                    rate_limit: None,
                    filter: None,
                },
                Utc::now(),
            )
        };
        let guarded = WebhookSender::new(EgressPolicy::default()).unwrap();
        let open = WebhookSender::new(EgressPolicy::allow_loopback()).unwrap();
        for (sender, port, class) in [
            (&guarded, closed_port, AttemptError::SsrfGuard),
            (&open, closed_port, AttemptError::Refused),
            (&open, silent_port, AttemptError::Timeout),
        ] {
            let (out, detail) = sender.send(&handler(port), &delivery, 1, &[]).await;
            assert!(matches!(out, AttemptOutcome::Failed { .. }), "{out:?}");
            assert_eq!(detail, AttemptDetail::error(class), "{out:?}");
        }
    }

    #[test]
    fn during_a_rotation_both_secrets_sign_then_only_the_new_one() {
        let new = lanebus_store::generate_secret();
        let sent_at = DateTime::from_timestamp(TS, 500_000_000).expect("time");
        let mut h = lanebus_store::Handler::registered(
            "hdl_x".into(),
            lanebus_store::NewHandler {
                name: "n".into(),
                url: "http://h/".into(),
                event_types: vec!["*".into()],
                max_attempts: 1,
                timeout_ms: 1,
                max_in_flight: 1,
                secret: new.clone(),
                rate_limit: None,
                filter: None,
            },
            sent_at,
        );
        h.previous_secret = Some(SECRET.into());
        // Still in the grace period half a second after the timestamp's
        // whole second: checked against the send time, not the header.
        h.previous_secret_until = Some(sent_at + chrono::Duration::milliseconds(1));
        let header = signature_header(&h, MSG_ID, sent_at, PAYLOAD).expect("sign");
        let (first, second) = header.split_once(' ').expect("two signatures");
        assert_eq!(second, EXPECTED, "the old secret's signature second");
        assert_eq!(first, sign(&new, MSG_ID, TS, PAYLOAD).expect("sign"));
        for secret in [SECRET, new.as_str()] {
            assert!(verify(secret, MSG_ID, &TS.to_string(), &header, PAYLOAD));
        }
        let later = sent_at + chrono::Duration::milliseconds(1);
        let header = signature_header(&h, MSG_ID, later, PAYLOAD).expect("sign");
        assert!(!header.contains(' '), "{header}");
        assert!(!verify(SECRET, MSG_ID, &TS.to_string(), &header, PAYLOAD));
        assert!(verify(&new, MSG_ID, &TS.to_string(), &header, PAYLOAD));
    }

    #[test]
    fn signature_matches_the_standard_webhooks_test_vector() {
        assert_eq!(sign(SECRET, MSG_ID, TS, PAYLOAD).unwrap(), EXPECTED);
        assert!(verify(SECRET, MSG_ID, &TS.to_string(), EXPECTED, PAYLOAD));
        assert!(verify(
            SECRET,
            MSG_ID,
            &TS.to_string(),
            &format!("v1,bogus {EXPECTED}"),
            PAYLOAD
        ));
        assert!(!verify(SECRET, MSG_ID, &TS.to_string(), EXPECTED, b"{}"));
        assert!(!verify(SECRET, MSG_ID, "1614265331", EXPECTED, PAYLOAD));
        assert!(!verify(
            "whsec_!!",
            MSG_ID,
            &TS.to_string(),
            EXPECTED,
            PAYLOAD
        ));
    }

    #[test]
    fn bad_secrets_are_rejected_with_the_reason() {
        assert!(matches!(
            decode_secret("MfKQ9r8G"),
            Err(WebhookError::BadSecret(_))
        ));
        assert!(matches!(
            decode_secret("whsec_***"),
            Err(WebhookError::BadSecret(_))
        ));
    }

    #[test]
    fn body_splices_the_payload_bytes_unchanged() {
        let at = DateTime::parse_from_rfc3339("2026-11-30T13:00:00.5Z")
            .unwrap()
            .with_timezone(&Utc);
        // Whitespace, key order and number formatting survive as published.
        let payload = br#"{ "b":1.50, "a" : [1,2] }"#;
        let body = build_body("issues.opened", at, payload);
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"type":"issues.opened","timestamp":"2026-11-30T13:00:00.500000Z","data":{ "b":1.50, "a" : [1,2] }}"#
        );
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["data"]["b"], serde_json::json!(1.5));
    }

    #[test]
    fn answers_are_classified_as_the_contract_says() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(classify(200, None, now), AttemptOutcome::Delivered);
        assert_eq!(classify(204, Some("5"), now), AttemptOutcome::Delivered);
        assert_eq!(
            classify(503, Some("7"), now),
            AttemptOutcome::Failed {
                error: "http 503".into(),
                retry_after: Some(Duration::from_secs(7))
            }
        );
        assert_eq!(
            classify(429, Some("nonsense"), now),
            AttemptOutcome::Failed {
                error: "http 429".into(),
                retry_after: None
            }
        );
        // Retry-After only counts on 429 and 503.
        assert_eq!(
            classify(500, Some("7"), now),
            AttemptOutcome::Failed {
                error: "http 500".into(),
                retry_after: None
            }
        );
        // 410 Gone disables the handler (docs/design.md section 5), Retry-After or not.
        assert_eq!(
            classify(410, None, now),
            AttemptOutcome::Gone {
                error: "http 410".into()
            }
        );
        assert_eq!(
            classify(410, Some("7"), now),
            AttemptOutcome::Gone {
                error: "http 410".into()
            }
        );
        assert_eq!(
            classify(302, None, now),
            AttemptOutcome::Failed {
                error: "http 302".into(),
                retry_after: None
            }
        );
    }
}
