//! Handlers: webhooks, NATS JetStream subjects ([`crate::nats`]), Kafka
//! topics ([`crate::kafka`]) and
//! in-process Rust handlers behind one attempt path.
//!
//! A registered handler (the store's [`HandlerConfig`]) whose URL is
//! `http://inproc.invalid/NAME` (or `inproc://NAME`, where the store accepts
//! it) is served by the in-process [`Handler`] registered under `NAME` when
//! the node starts (docs/design.md section 7); every other URL is a webhook. The
//! `.invalid` top-level domain is reserved (RFC 2606) and never resolves, so
//! such a handler cannot be sent over the network by a node that lacks it:
//! those attempts fail and end as dead letters, with the reason kept. Both go through the same key runners, ordering, retries and
//! dead letters: only the final hand-over differs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lanebus_store::{
    AttemptError, Delivery, FailedAttempt, Handler as HandlerConfig, HandlerState,
};
use tokio::sync::Semaphore;

use crate::activity::HandlerActivity;
use crate::assignment::{OwnerTie, Start};
use crate::catalog::HandlerCatalog;
use crate::kafka::{KafkaSender, KafkaSettings};
use crate::nats::{NatsSender, NatsSettings};
use crate::retry::AttemptOutcome;
use crate::webhook::{AttemptDetail, WebhookSender};

/// URL prefix of in-process handlers: `http://inproc.invalid/NAME`.
pub const IN_PROCESS_PREFIX: &str = "http://inproc.invalid/";
/// Alternative URL scheme of in-process handlers: `inproc://NAME`.
pub const IN_PROCESS_SCHEME: &str = "inproc://";

/// The in-process handler name of a handler URL, if it names one.
pub fn in_process_name(url: &str) -> Option<&str> {
    url.strip_prefix(IN_PROCESS_PREFIX)
        .or_else(|| url.strip_prefix(IN_PROCESS_SCHEME))
}

/// A failed in-process hand-over; it counts as a failed attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    /// Kept as the delivery's `last_error`.
    pub message: String,
    /// Asks for the next attempt no earlier than this (like `Retry-After`).
    pub retry_after: Option<Duration>,
}

impl HandlerError {
    /// A failure with a message.
    pub fn new(message: impl Into<String>) -> Self {
        HandlerError {
            message: message.into(),
            retry_after: None,
        }
    }
}

/// An in-process handler. `handle` returning `Ok` completes the delivery;
/// `Err` is a failed attempt, retried with backoff like a webhook's.
/// A delivery may be handed over again after a failure or a change of lane
/// owner (docs/design.md invariant 3): de-duplicate by `delivery.event_id`.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Takes one delivery.
    ///
    /// # Errors
    /// A [`HandlerError`] makes this a failed attempt.
    async fn handle(&self, delivery: &Delivery) -> Result<(), HandlerError>;
}

/// Why [`Dispatcher::attempt_checked`] sent nothing (no attempt was made,
/// nothing is to be recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotAttempted {
    /// The handler was deleted while the attempt waited for its permit.
    HandlerDeleted,
    /// The handler was disabled while the attempt waited for its permit.
    HandlerDisabled,
    /// Once the attempt held its permit, its owner's lease or drain no
    /// longer left room for it (the gate closed, e.g. the process was
    /// paused, or less remains than the handler's timeout plus the slack,
    /// see [`crate::assignment::attempt_may_start`]): nothing was sent; ask
    /// again later.
    Paused,
    /// Once the attempt held its permit, its lane owner had stopped (the
    /// lane moved, its lease lapsed, or it was fenced out): nothing was
    /// sent, and nothing is to be sent by this owner; the delivery stays in
    /// the store for the lane's next owner.
    OwnerGone,
}

/// An attempt made by [`Dispatcher::attempt_checked`].
#[derive(Debug)]
pub struct Sent {
    /// What the handler answered.
    pub outcome: AttemptOutcome,
    /// The attempt's entry for the delivery's attempt log when it failed;
    /// `None` when it was delivered.
    pub failure: Option<FailedAttempt>,
    /// Keeps the attempt counted in the per-lane count
    /// ([`Dispatcher::lane_attempts_in_flight`]): hold it until the
    /// outcome is stored, then drop it.
    pub counted: AttemptGuard,
}

/// Hands a delivery over to its handler: webhook or in-process.
///
/// A handler's `max_in_flight` bounds its concurrent attempts on this node
/// (one semaphore per handler, shared by all clones of the node's
/// dispatcher and so by all its lanes): an attempt waits for one of the
/// handler's permits before it is sent (the delivery counts as in flight
/// meanwhile; its timeout starts with the send). A handler's rate limit is
/// one token bucket per handler on this node ([`Dispatcher::rate_wait`]).
/// [`attempt_checked`](Self::attempt_checked) looks the handler up again
/// once it holds the permit, so attempts queued behind a slow handler are
/// not sent after it was deleted or disabled, and asks its owner's
/// [`OwnerTie`] whether it may still start.
#[derive(Clone)]
pub struct Dispatcher {
    webhook: WebhookSender,
    nats: NatsSender,
    kafka: KafkaSender,
    in_process: Arc<HashMap<String, Arc<dyn Handler>>>,
    permits: Arc<Mutex<Permits>>,
    rates: Arc<crate::rate::RateLimiter>,
    /// Hand-overs under way on this node, whatever their lane's owner does
    /// meanwhile (see [`Dispatcher::attempts_in_flight`]).
    in_flight: Arc<AttemptCounter>,
    /// Each handler's recent attempts on this node (the dashboard's plots).
    activity: Arc<HandlerActivity>,
    /// The store whose subject keys open personal fields before a send
    /// ([`lanebus_store::personal::open_via`]); `None`: payloads go as
    /// stored.
    keys: Option<Arc<dyn lanebus_store::Store>>,
}

/// Attempts under way on a node, in all and per lane: each from the moment
/// it is cleared to be sent (its permit held, about to ask its owner's
/// [`OwnerTie`]) until its outcome is stored (see [`Sent::counted`]).
///
/// One atomic per lane of the store (`0..lanes`, allocated once), so an
/// attempt takes no lock to be counted. Shared by all clones of a
/// [`Dispatcher`] ([`Dispatcher::attempt_counter`]); the node's graceful
/// stop reads it without the dispatcher.
#[derive(Debug)]
pub struct AttemptCounter {
    total: AtomicUsize,
    /// Indexed by lane; its length is the store's lane count.
    lanes: Box<[AtomicUsize]>,
}

impl AttemptCounter {
    /// A counter for lanes `0..lanes` (the store's
    /// [`lanes`](lanebus_store::Store::lanes)), all at 0.
    pub fn new(lanes: lanebus_store::Lane) -> Self {
        AttemptCounter {
            total: AtomicUsize::new(0),
            lanes: (0..lanes).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// Hand-overs under way, all lanes together.
    pub fn total(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// Hand-overs under way for `lane`; 0 for a lane outside `0..lanes`
    /// (none is ever counted there).
    pub fn lane(&self, lane: lanebus_store::Lane) -> usize {
        self.lanes
            .get(usize::from(lane))
            .map_or(0, |n| n.load(Ordering::SeqCst))
    }
}

/// Per handler id: its `max_in_flight` and the semaphore enforcing it.
type Permits = HashMap<String, (u32, Arc<Semaphore>)>;

impl Dispatcher {
    /// A dispatcher with the given in-process handlers, by name, for a
    /// store of `lanes` lanes (the store's
    /// [`lanes`](lanebus_store::Store::lanes); it sizes the per-lane
    /// attempt counts).
    pub fn new(
        webhook: WebhookSender,
        in_process: HashMap<String, Arc<dyn Handler>>,
        lanes: lanebus_store::Lane,
    ) -> Self {
        Dispatcher {
            nats: NatsSender::new(webhook.policy().clone(), NatsSettings::default()),
            kafka: KafkaSender::new(webhook.policy().clone(), KafkaSettings::default()),
            webhook,
            in_process: Arc::new(in_process),
            permits: Arc::default(),
            rates: Arc::default(),
            in_flight: Arc::new(AttemptCounter::new(lanes)),
            activity: Arc::new(HandlerActivity::new(std::time::Instant::now())),
            keys: None,
        }
    }

    /// This dispatcher, decrypting personal fields with `store`'s subject
    /// keys before every send (to any destination): a field whose key is
    /// gone is sent as `null` and named in the `lanebus-redacted` header.
    pub fn with_keys(mut self, store: Arc<dyn lanebus_store::Store>) -> Self {
        self.keys = Some(store);
        self
    }

    /// This dispatcher, its NATS handlers published to with `settings`
    /// (credentials, TLS) under the webhooks' SSRF guard.
    pub fn with_nats(mut self, settings: NatsSettings) -> Self {
        self.nats = NatsSender::new(self.webhook.policy().clone(), settings);
        self
    }

    /// This dispatcher, its Kafka handlers produced to with `settings`
    /// (credentials, TLS) under the webhooks' SSRF guard.
    pub fn with_kafka(mut self, settings: KafkaSettings) -> Self {
        self.kafka = KafkaSender::new(self.webhook.policy().clone(), settings);
        self
    }

    /// Each handler's attempts on this node over the last 15 minutes
    /// (counted by [`attempt_checked`](Self::attempt_checked)).
    pub fn activity(&self) -> Arc<HandlerActivity> {
        self.activity.clone()
    }

    /// Attempts being sent (or run, in process) by this node right now, or
    /// whose outcome is being stored. A lane owner stopped at once (its
    /// lease lapsed) leaves its attempts running: this count still has them.
    pub fn attempts_in_flight(&self) -> usize {
        self.in_flight.total()
    }

    /// The shared counter behind [`attempts_in_flight`](Self::attempts_in_flight)
    /// and [`lane_attempts_in_flight`](Self::lane_attempts_in_flight).
    pub fn attempt_counter(&self) -> Arc<AttemptCounter> {
        self.in_flight.clone()
    }

    /// As [`attempts_in_flight`](Self::attempts_in_flight), for one lane: a
    /// lane owner started again on this node (its lease came back at the
    /// same epoch) waits for its predecessor's attempts before it claims,
    /// or it would send the same rows again next to them. Attempts of the
    /// predecessor not counted yet (waiting for a permit, or for a retry)
    /// are never sent: its [`OwnerTie`] ended before the new owner started.
    pub fn lane_attempts_in_flight(&self, lane: lanebus_store::Lane) -> usize {
        self.in_flight.lane(lane)
    }

    /// The handler's semaphore, re-created when its limit changed (attempts
    /// holding permits of the old one finish under the old limit).
    fn semaphore(&self, handler: &HandlerConfig) -> Arc<Semaphore> {
        let limit = handler.max_in_flight.max(1);
        let mut permits = self.permits.lock().expect("not poisoned");
        match permits.get(&handler.id) {
            Some((l, sem)) if *l == limit => sem.clone(),
            _ => {
                let sem = Arc::new(Semaphore::new(limit as usize));
                permits.insert(handler.id.clone(), (limit, sem.clone()));
                sem
            }
        }
    }

    /// Forgets a deleted handler's semaphore (attempts still holding or
    /// waiting for one of its permits keep their own reference).
    fn forget(&self, handler_id: &str) {
        self.permits
            .lock()
            .expect("not poisoned")
            .remove(handler_id);
    }

    /// Forgets the semaphores of handlers not in `known` (deleted ones),
    /// and the rate buckets of those without a rate limit.
    pub fn retain_known(&self, known: &HashMap<String, Arc<HandlerConfig>>) {
        self.permits
            .lock()
            .expect("not poisoned")
            .retain(|id, _| known.contains_key(id));
        self.activity.retain(|id| known.contains_key(id));
        self.rates
            .retain(|id| known.get(id).is_some_and(|h| h.rate_limit.is_some()));
    }

    /// Takes one token of the handler's rate limit on this node, if it
    /// has one, and answers how long to wait before sending (zero: at
    /// once). See [`crate::rate`]: waiting makes no attempt.
    pub fn rate_wait(&self, handler: &HandlerConfig) -> Duration {
        match handler.rate_limit {
            Some(limit) => self.rates.reserve(&handler.id, limit),
            None => Duration::ZERO,
        }
    }

    /// Number of handlers with a semaphore (tests).
    pub fn semaphores(&self) -> usize {
        self.permits.lock().expect("not poisoned").len()
    }

    /// Makes attempt number `attempt` (1, 2, ...) of `delivery`, first
    /// waiting for one of the handler's permits; then looks the handler up
    /// in `catalog` ([`HandlerCatalog::current`]: after a change made through
    /// this node's API, a fresh read) and sends with its current settings,
    /// or sends nothing if it was deleted or disabled meanwhile, or if its
    /// owner's `tie` ended or leaves no room for its timeout (an attempt
    /// that waited for a permit through a pause of the process, a change of
    /// owner, or until close to the end of the lease or of a drain, must not
    /// outlive its owner). The attempt is counted for its lane from before
    /// that check; the count goes with [`Sent::counted`].
    ///
    /// # Errors
    /// [`NotAttempted`] when nothing was sent; the delivery is untouched.
    pub async fn attempt_checked(
        &self,
        catalog: &HandlerCatalog,
        tie: &OwnerTie,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
    ) -> Result<Sent, NotAttempted> {
        let semaphore = self.semaphore(handler);
        let Ok(permit) = semaphore.acquire_owned().await else {
            let detail = AttemptDetail::error(AttemptError::Other);
            return Ok(Sent {
                outcome: AttemptOutcome::Failed {
                    error: "node shutting down".into(),
                    retry_after: None,
                },
                failure: Some(failed_attempt(attempt, chrono::Utc::now(), 0, detail)),
                counted: AttemptGuard::enter(&self.in_flight, delivery.lane),
            });
        };
        match catalog.current(&handler.id).await {
            None => {
                drop(permit);
                self.forget(&handler.id);
                Err(NotAttempted::HandlerDeleted)
            }
            Some(h) if h.state != HandlerState::Enabled => Err(NotAttempted::HandlerDisabled),
            Some(h) => {
                // Counted before the owner is asked: an owner ended after
                // this check finds the attempt counted.
                let counted = AttemptGuard::enter(&self.in_flight, delivery.lane);
                match tie.start(Duration::from_millis(h.timeout_ms)) {
                    Start::Go => {
                        let at = chrono::Utc::now();
                        let started = std::time::Instant::now();
                        let (outcome, detail) = self.hand_over(&h, delivery, attempt).await;
                        let took = started.elapsed();
                        self.activity.record(
                            &h.id,
                            started + took,
                            outcome == AttemptOutcome::Delivered,
                            took,
                        );
                        let ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX);
                        let failure = (outcome != AttemptOutcome::Delivered)
                            .then(|| failed_attempt(attempt, at, ms, detail));
                        Ok(Sent {
                            outcome,
                            failure,
                            counted,
                        })
                    }
                    Start::Wait => Err(NotAttempted::Paused),
                    Start::Lost => Err(NotAttempted::OwnerGone),
                }
            }
        }
    }

    /// Makes attempt number `attempt` (1, 2, ...) of `delivery`, after
    /// waiting for one of the handler's permits, without looking the
    /// handler up again (see [`attempt_checked`](Self::attempt_checked)).
    pub async fn attempt(
        &self,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
    ) -> AttemptOutcome {
        let Ok(_permit) = self.semaphore(handler).acquire_owned().await else {
            return AttemptOutcome::Failed {
                error: "node shutting down".into(),
                retry_after: None,
            };
        };
        let _counted = AttemptGuard::enter(&self.in_flight, delivery.lane);
        self.hand_over(handler, delivery, attempt).await.0
    }

    /// The hand-over itself, the permit already held: the outcome and, for
    /// a failure, what its attempt log keeps (an in-process handler's
    /// error: class `handler`, its message as the body). When the payload
    /// sent had personal fields decrypted, no body or handler message is
    /// kept ([`AttemptDetail::withhold`]).
    async fn hand_over(
        &self,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
    ) -> (AttemptOutcome, AttemptDetail) {
        match self.open(delivery).await {
            Ok(None) => self.send(handler, delivery, attempt, &[]).await,
            Ok(Some(o)) => {
                let mut d = delivery.clone();
                d.payload = o.payload;
                let sent = self.send(handler, &d, attempt, &o.redacted).await;
                if o.decrypted == 0 {
                    sent
                } else {
                    AttemptDetail::withhold(sent)
                }
            }
            Err(e) => {
                let failed = AttemptOutcome::Failed {
                    error: format!("personal fields: {e}"),
                    retry_after: None,
                };
                (failed, AttemptDetail::error(AttemptError::Other))
            }
        }
    }

    /// Sends `delivery` (its personal fields opened; `redacted`: those
    /// sent as `null`) to `handler`'s destination.
    async fn send(
        &self,
        handler: &HandlerConfig,
        delivery: &Delivery,
        attempt: u32,
        redacted: &[String],
    ) -> (AttemptOutcome, AttemptDetail) {
        if let Some(name) = in_process_name(&handler.url) {
            let Some(h) = self.in_process.get(name) else {
                let failed = AttemptOutcome::Failed {
                    error: format!("no in-process handler named {name:?} on this node"),
                    retry_after: None,
                };
                return (failed, AttemptDetail::error(AttemptError::Other));
            };
            let timeout = Duration::from_millis(handler.timeout_ms.max(1));
            return match tokio::time::timeout(timeout, h.handle(delivery)).await {
                Ok(Ok(())) => (AttemptOutcome::Delivered, AttemptDetail::default()),
                Ok(Err(e)) => {
                    let detail = AttemptDetail {
                        body: FailedAttempt::body_prefix(e.message.as_bytes()),
                        ..AttemptDetail::error(AttemptError::Handler)
                    };
                    let failed = AttemptOutcome::Failed {
                        error: e.message,
                        retry_after: e.retry_after,
                    };
                    (failed, detail)
                }
                Err(_) => {
                    let failed = AttemptOutcome::Failed {
                        error: format!("timeout after {} ms", handler.timeout_ms),
                        retry_after: None,
                    };
                    (failed, AttemptDetail::error(AttemptError::Timeout))
                }
            };
        }
        if crate::nats::is_nats(&handler.url) {
            return self.nats.send(handler, delivery, attempt, redacted).await;
        }
        if crate::kafka::is_kafka(&handler.url) {
            return self.kafka.send(handler, delivery, attempt, redacted).await;
        }
        self.webhook
            .send(handler, delivery, attempt, redacted)
            .await
    }

    /// `delivery`'s payload with its personal fields decrypted; `None`
    /// when it has none to open (or no keys are configured).
    async fn open(
        &self,
        delivery: &Delivery,
    ) -> Result<Option<lanebus_store::personal::Opened>, lanebus_store::StoreError> {
        let Some(store) = &self.keys else {
            return Ok(None);
        };
        lanebus_store::personal::open_via(store, &delivery.event_id, &delivery.payload).await
    }
}

/// The value of header `lanebus-redacted`: the pointers of personal fields
/// sent as `null` (their subject's key was deleted), comma-separated;
/// `None` when there are none. Each pointer is percent-encoded (its UTF-8
/// bytes, as in a URI fragment, RFC 6901 section 6) where it is not
/// visible ASCII, and at `%` and `,`: always a valid header value, one
/// that splits at its commas. Types created since control characters in
/// personal names are refused only need it for non-ASCII names, `%`, `,`
/// and spaces.
pub(crate) fn redacted_header(redacted: &[String]) -> Option<String> {
    use std::fmt::Write as _;
    if redacted.is_empty() {
        return None;
    }
    let mut out = String::new();
    for (i, p) in redacted.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        for b in p.bytes() {
            if b.is_ascii_graphic() && b != b'%' && b != b',' {
                out.push(char::from(b));
            } else {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    Some(out)
}

/// A failed broker attempt (NATS, Kafka): its outcome, with `error` as the
/// delivery's `last_error`, and its attempt-log detail of class `class`.
pub(crate) fn failed(class: AttemptError, error: String) -> (AttemptOutcome, AttemptDetail) {
    (
        AttemptOutcome::Failed {
            error,
            retry_after: None,
        },
        AttemptDetail::error(class),
    )
}

/// Refuses broker `addr` (`host:port`; `what` names it in messages) unless
/// every address it resolves to passes the SSRF guard `policy`.
pub(crate) async fn check_server(
    policy: &lanebus_store::egress::EgressPolicy,
    what: &str,
    addr: &str,
) -> Result<(), (AttemptError, String)> {
    let found = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| (AttemptError::Dns, format!("{what}: {e}")))?;
    for a in found {
        policy.check_ip(a.ip()).map_err(|e| {
            (
                AttemptError::SsrfGuard,
                format!("refused by the ssrf guard: {what} points to {e}"),
            )
        })?;
    }
    Ok(())
}

/// The attempt log entry of failed attempt number `attempt`, started at
/// `at`, after `duration_ms`.
pub fn failed_attempt(
    attempt: u32,
    at: chrono::DateTime<chrono::Utc>,
    duration_ms: u64,
    detail: AttemptDetail,
) -> FailedAttempt {
    FailedAttempt {
        attempt,
        at,
        status: detail.status,
        error: detail.error,
        duration_ms,
        body: detail.body,
        body_withheld: detail.body_withheld,
    }
}

/// One attempt counted in [`Dispatcher::attempts_in_flight`] (and its
/// lane's count) while it lives; dropped also when the attempt's future,
/// or whoever holds it until the outcome is stored, is dropped.
#[derive(Debug)]
pub struct AttemptGuard {
    counter: Arc<AttemptCounter>,
    /// The lane's index; `None` for a lane outside the store's (not counted
    /// per lane).
    lane: Option<usize>,
}

impl AttemptGuard {
    fn enter(counter: &Arc<AttemptCounter>, lane: lanebus_store::Lane) -> Self {
        counter.total.fetch_add(1, Ordering::SeqCst);
        let lane = usize::from(lane);
        let lane = counter.lanes.get(lane).map(|n| {
            n.fetch_add(1, Ordering::SeqCst);
            lane
        });
        AttemptGuard {
            counter: counter.clone(),
            lane,
        }
    }
}

impl Drop for AttemptGuard {
    fn drop(&mut self) {
        if let Some(n) = self.lane.and_then(|l| self.counter.lanes.get(l)) {
            n.fetch_sub(1, Ordering::SeqCst);
        }
        self.counter.total.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanebus_store::Epoch;
    use tokio::sync::Notify;

    /// Issue 15 finding: a pointer with CR/LF (a property name with a
    /// control character, stored before such marks were refused) broke
    /// the header. Every value is a valid header value, each pointer
    /// percent-encoded where it is not visible ASCII, or `%` or `,`.
    #[test]
    fn the_redacted_header_is_always_a_valid_header_value() {
        let pointers: Vec<String> = [
            "/email",
            "/e\r\nmail",
            "/a,b",
            "/50%",
            "/caf\u{e9}",
            "/t\tx y",
            "/\u{7f}",
        ]
        .iter()
        .map(|p| p.to_string())
        .collect();
        let value = redacted_header(&pointers).expect("a value");
        assert_eq!(
            value,
            "/email,/e%0D%0Amail,/a%2Cb,/50%25,/caf%C3%A9,/t%09x%20y,/%7F"
        );
        assert!(reqwest::header::HeaderValue::from_str(&value).is_ok());
        assert_eq!(redacted_header(&[]), None);
    }

    /// Counts calls and holds each until released.
    struct Gate {
        calls: AtomicUsize,
        release: Notify,
    }

    #[async_trait]
    impl Handler for Gate {
        async fn handle(&self, _: &Delivery) -> Result<(), HandlerError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.release.notified().await;
            Ok(())
        }
    }

    /// Holds each delivery until its own release (by event id).
    struct HeldEach {
        calls: AtomicUsize,
        release: HashMap<String, Notify>,
    }

    #[async_trait]
    impl Handler for HeldEach {
        async fn handle(&self, d: &Delivery) -> Result<(), HandlerError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.release[&d.event_id].notified().await;
            Ok(())
        }
    }

    /// Registration of the in-process handler `name`: every event type, a
    /// 60 s timeout, `max_in_flight` concurrent attempts.
    fn in_process_handler(name: &str, max_in_flight: u32) -> lanebus_store::NewHandler {
        lanebus_store::NewHandler {
            name: name.into(),
            url: format!("{IN_PROCESS_PREFIX}{name}"),
            event_types: vec!["*".into()],
            max_attempts: 3,
            timeout_ms: 60_000,
            max_in_flight,
            secret: lanebus_store::generate_secret(),
            rate_limit: None,
            filter: None,
        }
    }

    fn delivery(id: i64, handler_id: &str) -> Delivery {
        delivery_on(id, 0, handler_id)
    }

    fn delivery_on(id: i64, lane: lanebus_store::Lane, handler_id: &str) -> Delivery {
        Delivery {
            id,
            lane,
            epoch: Epoch(1),
            handler_id: handler_id.into(),
            event_id: format!("e{id}"),
            event_type: "t.x".into(),
            key: None,
            seq: None,
            attempts: 0,
            due_at: chrono::Utc::now(),
            last_error: None,
            payload: bytes::Bytes::from_static(b"{}"),
            published_at: chrono::Utc::now(),
            replay: false,
        }
    }

    /// A store with the in-process handler "gate" (`max_in_flight` 1), its
    /// catalog, and a dispatcher serving it with a [`Gate`].
    struct Gated {
        store: Arc<dyn lanebus_store::Store>,
        catalog: Arc<HandlerCatalog>,
        gate: Arc<Gate>,
        dispatcher: Dispatcher,
        config: Arc<HandlerConfig>,
    }

    async fn gated() -> Gated {
        let store = lanebus_store::open("sqlite::memory:").await.expect("store");
        let h = store
            .create_handler(in_process_handler("gate", 1))
            .await
            .expect("handler");
        let catalog = Arc::new(HandlerCatalog::new(store.clone()));
        catalog.reload_fresh().await.expect("reload");
        let gate = Arc::new(Gate {
            calls: AtomicUsize::new(0),
            release: Notify::new(),
        });
        let mut in_process: HashMap<String, Arc<dyn Handler>> = HashMap::new();
        in_process.insert("gate".into(), gate.clone());
        let dispatcher = Dispatcher::new(
            WebhookSender::new(lanebus_store::egress::EgressPolicy::default()).expect("sender"),
            in_process,
            store.lanes(),
        );
        let config = catalog.get(&h.id).expect("cached");
        Gated {
            store,
            catalog,
            gate,
            dispatcher,
            config,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attempt_waiting_for_a_slot_is_not_sent_after_its_handler_is_deleted() {
        let Gated {
            store,
            catalog,
            gate,
            dispatcher,
            config,
        } = gated().await;

        let tie = Arc::new(OwnerTie::new(
            0,
            Epoch(1),
            crate::assignment::WorkGate::default(),
        ));
        let (d1, c1, h1, t1) = (
            dispatcher.clone(),
            catalog.clone(),
            config.clone(),
            tie.clone(),
        );
        let first = tokio::spawn(async move {
            d1.attempt_checked(&c1, &t1, &h1, &delivery(1, &h1.id), 1)
                .await
        });
        while gate.calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // The second waits for the only slot.
        let (d2, c2, h2, t2) = (dispatcher.clone(), catalog.clone(), config.clone(), tie);
        let second = tokio::spawn(async move {
            d2.attempt_checked(&c2, &t2, &h2, &delivery(2, &h2.id), 1)
                .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(dispatcher.semaphores(), 1);
        assert_eq!(
            dispatcher.attempts_in_flight(),
            1,
            "the one being handed over, not the one waiting for a slot"
        );
        assert_eq!(dispatcher.lane_attempts_in_flight(0), 1);
        assert_eq!(dispatcher.lane_attempts_in_flight(1), 0);

        // Deleted (through the API: store, then a reload asked for).
        store.delete_handler(&config.id).await.expect("delete");
        catalog.request_reload();
        gate.release.notify_one();
        let sent = first.await.expect("first").expect("sent");
        assert_eq!(
            sent.outcome,
            AttemptOutcome::Delivered,
            "the attempt in flight finishes"
        );
        assert_eq!(
            second.await.expect("second").map(|s| s.outcome),
            Err(NotAttempted::HandlerDeleted)
        );
        assert_eq!(
            dispatcher.lane_attempts_in_flight(0),
            1,
            "counted until its outcome is stored"
        );
        drop(sent);
        assert_eq!(
            gate.calls.load(Ordering::SeqCst),
            1,
            "sent after the delete"
        );
        assert_eq!(
            dispatcher.semaphores(),
            0,
            "the deleted handler's semaphore is kept"
        );
        assert_eq!(dispatcher.attempts_in_flight(), 0);
        assert_eq!(dispatcher.lane_attempts_in_flight(0), 0);
    }

    /// Fails its first call, then takes every delivery.
    struct FailOnce {
        calls: AtomicUsize,
    }

    #[async_trait]
    impl Handler for FailOnce {
        async fn handle(&self, _: &Delivery) -> Result<(), HandlerError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(HandlerError::new("inventory service down"));
            }
            Ok(())
        }
    }

    /// A failed attempt carries its attempt log entry (an in-process
    /// handler's error: class `handler`, its message as the body); a
    /// successful one carries none, so nothing is written for it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_a_failed_attempt_carries_an_attempt_log_entry() {
        let store = lanebus_store::open("sqlite::memory:").await.expect("store");
        let h = store
            .create_handler(in_process_handler("once", 1))
            .await
            .expect("handler");
        let catalog = HandlerCatalog::new(store.clone());
        catalog.reload_fresh().await.expect("reload");
        let mut in_process: HashMap<String, Arc<dyn Handler>> = HashMap::new();
        let once = Arc::new(FailOnce {
            calls: AtomicUsize::new(0),
        });
        in_process.insert("once".into(), once);
        let dispatcher = Dispatcher::new(
            WebhookSender::new(lanebus_store::egress::EgressPolicy::default()).expect("sender"),
            in_process,
            store.lanes(),
        );
        let config = catalog.get(&h.id).expect("cached");
        let tie = OwnerTie::new(0, Epoch(1), crate::assignment::WorkGate::default());
        let d = delivery(1, &h.id);
        let first = dispatcher
            .attempt_checked(&catalog, &tie, &config, &d, 1)
            .await
            .expect("sent");
        assert!(
            matches!(first.outcome, AttemptOutcome::Failed { .. }),
            "{first:?}"
        );
        let f = first.failure.clone().expect("a log entry");
        assert_eq!(
            (f.attempt, f.status, f.error, f.body.as_deref()),
            (
                1,
                None,
                Some(AttemptError::Handler),
                Some("inventory service down")
            )
        );
        drop(first);
        let second = dispatcher
            .attempt_checked(&catalog, &tie, &config, &d, 2)
            .await
            .expect("sent");
        assert_eq!(second.outcome, AttemptOutcome::Delivered);
        assert_eq!(second.failure, None, "a success has no log entry");
    }

    /// An attempt waiting for its handler's permit when its lane owner
    /// stops is never sent, and is not counted once it gave up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_attempt_waiting_for_a_slot_is_not_sent_after_its_owner_stopped() {
        let Gated {
            catalog,
            gate,
            dispatcher,
            config,
            ..
        } = gated().await;
        // Two owners of two lanes share the handler's one permit.
        let ties = [0, 1].map(|lane| {
            Arc::new(OwnerTie::new(
                lane,
                Epoch(1),
                crate::assignment::WorkGate::default(),
            ))
        });
        let spawn = |id: i64, lane| {
            let (d, c, h, t) = (
                dispatcher.clone(),
                catalog.clone(),
                config.clone(),
                ties[usize::from(lane)].clone(),
            );
            tokio::spawn(async move {
                d.attempt_checked(&c, &t, &h, &delivery_on(id, lane, &h.id), 1)
                    .await
            })
        };
        let first = spawn(1, 0);
        while gate.calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let second = spawn(2, 1);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(dispatcher.lane_attempts_in_flight(1), 0, "waiting");
        // Lane 1's owner stops while its attempt waits for the permit.
        ties[1].end();
        gate.release.notify_one();
        let sent = first.await.expect("first").expect("sent");
        assert_eq!(sent.outcome, AttemptOutcome::Delivered);
        assert_eq!(
            second.await.expect("second").map(|s| s.outcome),
            Err(NotAttempted::OwnerGone)
        );
        assert_eq!(gate.calls.load(Ordering::SeqCst), 1, "sent without owner");
        assert_eq!(dispatcher.lane_attempts_in_flight(1), 0);
        assert_eq!(dispatcher.lane_attempts_in_flight(0), 1);
        drop(sent);
        assert_eq!(dispatcher.attempts_in_flight(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn per_lane_attempt_counts_go_up_and_down_on_two_lanes() {
        let held = Arc::new(HeldEach {
            calls: AtomicUsize::new(0),
            release: (1..=4).map(|i| (format!("e{i}"), Notify::new())).collect(),
        });
        let mut in_process: HashMap<String, Arc<dyn Handler>> = HashMap::new();
        in_process.insert("held".into(), held.clone());
        let dispatcher = Dispatcher::new(
            WebhookSender::new(lanebus_store::egress::EgressPolicy::default()).expect("sender"),
            in_process,
            256,
        );
        let handler = HandlerConfig::registered(
            "h1".into(),
            in_process_handler("held", 8),
            chrono::Utc::now(),
        );
        let counter = dispatcher.attempt_counter();
        // Two on lane 3, one on lane 255 (the last), one on a lane outside
        // the store's 256: counted in the total only.
        let mut tasks = HashMap::new();
        for (id, lane) in [(1, 3), (2, 3), (3, 255), (4, 300)] {
            let (d, h) = (dispatcher.clone(), handler.clone());
            tasks.insert(
                id,
                tokio::spawn(async move { d.attempt(&h, &delivery_on(id, lane, "h1"), 1).await }),
            );
        }
        while held.calls.load(Ordering::SeqCst) < 4 {
            tokio::task::yield_now().await;
        }
        let lanes = |d: &Dispatcher| [0, 3, 255, 300].map(|l| d.lane_attempts_in_flight(l));
        assert_eq!(dispatcher.attempts_in_flight(), 4);
        assert_eq!(lanes(&dispatcher), [0, 2, 1, 0]);

        let finish = |id: i64, tasks: &mut HashMap<i64, tokio::task::JoinHandle<_>>| {
            held.release[&format!("e{id}")].notify_one();
            tasks.remove(&id).expect("task")
        };
        let t = finish(2, &mut tasks);
        assert_eq!(t.await.expect("join"), AttemptOutcome::Delivered);
        assert_eq!(lanes(&dispatcher), [0, 1, 1, 0], "one left on lane 3");
        assert_eq!(counter.total(), 3);

        let t = finish(3, &mut tasks);
        assert_eq!(t.await.expect("join"), AttemptOutcome::Delivered);
        assert_eq!(lanes(&dispatcher), [0, 1, 0, 0], "lane 255 done");

        // A dropped attempt (its future cancelled) is uncounted as well.
        tasks.remove(&1).expect("task").abort();
        while counter.lane(3) > 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(counter.total(), 1, "the out-of-range one is still running");
        let t = finish(4, &mut tasks);
        assert_eq!(t.await.expect("join"), AttemptOutcome::Delivered);
        assert_eq!(counter.total(), 0);
        assert_eq!(lanes(&dispatcher), [0; 4]);
    }
}
