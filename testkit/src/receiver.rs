//! A webhook receiver for tests, the demo and chaos runs (modelled on Svix's
//! `TestReceiver`): an HTTP server on `127.0.0.1:0` that records every
//! request, verifies its signature, answers as the test tells it, and checks
//! the invariants of docs/design.md section 2 over what it received.
//!
//! Webhook URLs are `{base}/hook/{name}`; `name` identifies the handler.
//!
//! ```text
//!  POST /hook/{name} ──▶ rules (first match by handler/key) ──▶ delay? status
//!                     └─▶ record {handler, event id, key, sequence, attempt,
//!                                 arrival, answer, body, headers, signature ok}
//! ```
//!
//! [`Receiver::verdict`] compares the record with what was published: lost,
//! duplicated (sent again after it was accepted), out of order per
//! (handler, key), bad signatures, judged by [`crate::invariants`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use serde::Serialize;
use tokio::sync::Notify;

use crate::invariants::{
    self, Cause, Causes, Delivery, Disorder, Earlier, HandOver, Model, Repeat,
};
use crate::signature;

/// What the receiver does with matching requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Answer `status` to the first `n` attempts of each event, then 200.
    FailFirst {
        /// Failing attempts per event.
        n: u32,
        /// Status of the failures.
        status: u16,
        /// `Retry-After` value of the failures, in seconds.
        retry_after: Option<u64>,
    },
    /// Always answer `status` (with `retry_after` as `Retry-After` if set).
    Status {
        /// The status.
        status: u16,
        /// `Retry-After` value, in seconds.
        retry_after: Option<u64>,
    },
    /// Wait, then answer 200.
    Delay(Duration),
    /// Answer `status` with the request's body echoed back as the answer's
    /// body (a receiver that quotes what it got in its error).
    Echo {
        /// The status.
        status: u16,
    },
    /// Wait, then answer `status` (requests arriving meanwhile are all
    /// answered so: e.g. a `410` for several keys at once).
    DelayedStatus {
        /// The wait.
        delay: Duration,
        /// The status.
        status: u16,
    },
}

/// A behaviour for requests of a handler and/or key (`None` matches any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Handler name (the URL's last segment), or any.
    pub handler: Option<String>,
    /// Event key (`lanebus-key`), or any.
    pub key: Option<String>,
    /// What to do.
    pub action: Action,
}

/// One recorded request.
#[derive(Debug, Clone, Serialize)]
pub struct Received {
    /// Handler name from the URL.
    pub handler: String,
    /// `webhook-id`.
    pub event_id: String,
    /// `lanebus-key`.
    pub key: Option<String>,
    /// `lanebus-sequence`.
    pub sequence: Option<i64>,
    /// `lanebus-attempt`.
    pub attempt: u32,
    /// Milliseconds since the receiver started, at arrival.
    pub arrived_ms: f64,
    /// Milliseconds since the receiver started, when answered.
    pub answered_ms: f64,
    /// The status answered.
    pub status: u16,
    /// Whether the signature verified (`None`: no secret known for the handler).
    pub signature_ok: Option<bool>,
    /// The body as received (UTF-8, lossy).
    pub body: String,
    /// All headers, lower-case names.
    pub headers: BTreeMap<String, String>,
    /// The sending node's IP (the connection's peer address): nodes of a
    /// local cluster send from their own loopback address
    /// (`--webhook-source-ip`, see [`crate::local_cluster`]).
    pub sender: Option<String>,
}

impl Received {
    /// Whether the answer completed the delivery.
    pub fn accepted(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// An event the receiver should get, for [`Receiver::verdict`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// Handler name.
    pub handler: String,
    /// Event id.
    pub event_id: String,
    /// Event key.
    pub key: Option<String>,
}

/// The exactness check over what was received.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// Expected deliveries.
    pub expected: usize,
    /// Distinct expected deliveries accepted.
    pub delivered: usize,
    /// Expected but never accepted.
    pub lost: usize,
    /// Requests of a delivery sent again after an accepted request of it
    /// (repeats whose previous attempt had not failed; in arrival order).
    pub duplicated: usize,
    /// Accepted although not expected.
    pub unexpected: usize,
    /// (handler, key) orders broken: a delivery's first arrival after a
    /// higher sequence, or before every lower sequence seen so far was
    /// accepted; or a repeat after a higher sequence that is no rewind.
    pub out_of_order: usize,
    /// Repeats of an already accepted delivery that arrived after a higher
    /// sequence of its key sent by another node (a stale attempt of a
    /// deposed owner, written after the new owner went on; from the same
    /// node it is disorder): not disorder of the first deliveries,
    /// which is what docs/design.md invariant 2 orders; they are repeats
    /// (counted in `duplicated` too), which invariant 3 requires a cause
    /// for (callers check that, e.g. `local_cluster::repeats`).
    pub rewinds: usize,
    /// Requests whose signature did not verify.
    pub bad_signatures: usize,
    /// Examples of problems, for messages.
    pub problems: Vec<String>,
}

impl Verdict {
    /// No loss, no duplicate, nothing unexpected, order kept, signatures fine.
    pub fn exact(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.unexpected == 0
            && self.out_of_order == 0
            && self.bad_signatures == 0
    }
}

#[derive(Default)]
struct Inner {
    rules: Vec<Rule>,
    secrets: HashMap<String, String>,
    log: Vec<Received>,
    /// Attempts seen per (handler, event id), for `FailFirst`.
    seen: HashMap<(String, String), u32>,
    /// Distinct (handler, event id) pairs accepted, kept up to date so that
    /// waiting for a count costs nothing per request.
    accepted: std::collections::HashSet<(String, String)>,
}

struct Shared {
    inner: Mutex<Inner>,
    changed: Notify,
    start: Instant,
}

/// The receiver. Cheap to clone; the server stops when the runtime it was
/// started on ends.
#[derive(Clone)]
pub struct Receiver {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl Receiver {
    /// Starts a receiver on `127.0.0.1:0` (on the current tokio runtime).
    ///
    /// # Errors
    /// The bind error.
    pub async fn start() -> std::io::Result<Receiver> {
        let shared = Arc::new(Shared {
            inner: Mutex::default(),
            changed: Notify::new(),
            start: Instant::now(),
        });
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let app = Router::new()
            .route("/hook/{name}", post(hook))
            .with_state(shared.clone());
        tokio::spawn(async move {
            let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver { shared, addr })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The webhook URL for handler `name`.
    pub fn url(&self, name: &str) -> String {
        format!("http://{}/hook/{name}", self.addr)
    }

    /// Sets the signing secret of handler `name`, to verify its requests.
    pub fn set_secret(&self, name: &str, secret: &str) {
        self.lock()
            .secrets
            .insert(name.to_string(), secret.to_string());
    }

    /// Adds a rule (later rules are looked at after earlier ones).
    pub fn add_rule(&self, rule: Rule) {
        self.lock().rules.push(rule);
    }

    /// Removes every rule: from now on every request gets 200.
    pub fn clear_rules(&self) {
        self.lock().rules.clear();
    }

    /// Milliseconds since the receiver started (the time base of
    /// [`Received::arrived_ms`]).
    pub fn now_ms(&self) -> f64 {
        self.shared.start.elapsed().as_secs_f64() * 1e3
    }

    /// A copy of every request recorded so far, in arrival order.
    pub fn requests(&self) -> Vec<Received> {
        self.lock().log.clone()
    }

    /// Distinct (handler, event id) pairs accepted so far.
    pub fn accepted_distinct(&self) -> usize {
        self.lock().accepted.len()
    }

    /// Waits until `cond` holds over the log, or `timeout` passes; returns
    /// whether it held.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut cond: impl FnMut(&[Received]) -> bool,
    ) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            if cond(&self.lock().log) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return cond(&self.lock().log);
            }
        }
    }

    /// Waits until `n` distinct (handler, event id) pairs were accepted.
    pub async fn wait_accepted(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.changed.notified();
            if self.accepted_distinct() >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.accepted_distinct() >= n;
            }
        }
    }

    /// Checks the record against what should have arrived.
    pub fn verdict(&self, expected: &[Expected]) -> Verdict {
        verdict(&self.lock().log, expected)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.shared.inner.lock().expect("not poisoned")
    }
}

/// The exactness check of [`Receiver::verdict`] over a log, by the one
/// checker ([`crate::invariants`]): the expected deliveries, the requests
/// as hand-overs judged in arrival order with their `lanebus-sequence` as
/// position ([`Earlier::Observed`]), and the receiver's causes: a repeat
/// is explained when its previous attempt failed; a rewind when another
/// node sent the higher sequence.
pub fn verdict(log: &[Received], expected: &[Expected]) -> Verdict {
    let model = Model {
        expected: expected
            .iter()
            .map(|e| Delivery {
                handler: e.handler.clone(),
                event: e.event_id.clone(),
                key: e.key.clone(),
                ..Delivery::default()
            })
            .collect(),
        observed: log.iter().map(hand_over).collect(),
        earlier: Earlier::Observed,
    };
    let mut v = Verdict {
        expected: expected.len(),
        ..Verdict::default()
    };
    let problem = |v: &mut Verdict, p: String| {
        if v.problems.len() < 10 {
            v.problems.push(p);
        }
    };
    for r in log.iter().filter(|r| r.signature_ok == Some(false)) {
        v.bad_signatures += 1;
        problem(
            &mut v,
            format!("bad signature: {} {}", r.handler, r.event_id),
        );
    }
    let lost = invariants::lost(&model);
    v.lost = lost.len();
    let accepted: HashSet<(&str, &str)> = log
        .iter()
        .filter(|r| r.accepted())
        .map(|r| (r.handler.as_str(), r.event_id.as_str()))
        .collect();
    v.delivered = expected
        .iter()
        .map(|e| (e.handler.as_str(), e.event_id.as_str()))
        .collect::<HashSet<_>>()
        .intersection(&accepted)
        .count();
    for i in invariants::unexpected(&model) {
        v.unexpected += 1;
        let r = &log[i];
        problem(&mut v, format!("unexpected: {} {}", r.handler, r.event_id));
    }
    let repeats = invariants::repeats(&model, &ReceiverCauses);
    v.duplicated = repeats.unattributed.len();
    for x in &repeats.unattributed {
        let r = &log[x.q];
        problem(
            &mut v,
            format!(
                "accepted before and sent again: {} {}",
                r.handler, r.event_id
            ),
        );
    }
    for &i in &lost {
        let e = &expected[i];
        problem(&mut v, format!("lost: {} {}", e.handler, e.event_id));
    }
    let order = invariants::order(&model, &ReceiverCauses);
    v.rewinds = order.rewinds;
    v.out_of_order = order.disorder.len();
    for x in &order.disorder {
        let (q, what) = match *x {
            Disorder::Early { q, missing } => (q, format!("before {missing} was accepted")),
            Disorder::AfterLater { q, later } => (q, format!("first after {later}")),
            Disorder::Rewind(x) => (x.q, "again after a later sequence".to_string()),
        };
        let r = &log[q];
        problem(
            &mut v,
            format!(
                "order: {} key {}: sequence {} {what}",
                r.handler,
                r.key.as_deref().unwrap_or_default(),
                r.sequence.unwrap_or_default()
            ),
        );
    }
    v
}

/// A request as the invariant checker sees it.
pub(crate) fn hand_over(r: &Received) -> HandOver {
    HandOver {
        handler: r.handler.clone(),
        event: r.event_id.clone(),
        key: r.key.clone(),
        position: r.key.as_ref().and(r.sequence),
        attempt: r.attempt,
        sender: r.sender.clone(),
        arrived_ms: r.arrived_ms,
        accepted_ms: r.accepted().then_some(r.answered_ms),
        until_ms: r.answered_ms,
    }
}

/// The receiver's causes: a repeat is explained when the previous attempt
/// failed (not answered 2xx); a repeat of an accepted delivery after a
/// higher sequence of its key is a rewind when another node sent the
/// higher sequence (a deposed owner's stale attempt; the cause of the
/// repeat itself is for callers to check, e.g. `local_cluster::repeats`).
struct ReceiverCauses;

impl Causes for ReceiverCauses {
    fn repeat(&self, m: &Model, x: &Repeat) -> Option<Cause> {
        m.observed[x.prev]
            .accepted_ms
            .is_none()
            .then_some(Cause::Failed)
    }

    fn rewind(&self, m: &Model, x: &Repeat) -> bool {
        let latest = x.latest.map(|i| m.observed[i].sender.as_deref());
        x.accepted_before
            && matches!((latest, m.observed[x.q].sender.as_deref()), (Some(Some(a)), Some(b)) if a != b)
    }
}

async fn hook(
    State(shared): State<Arc<Shared>>,
    axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<std::net::SocketAddr>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, HeaderMap, Bytes) {
    let arrived = shared.start.elapsed();
    let h = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let event_id = h("webhook-id").unwrap_or_default();
    let key = h("lanebus-key");
    let (action, signature_ok) = {
        let mut inner = shared.inner.lock().expect("not poisoned");
        let n = inner
            .seen
            .entry((name.clone(), event_id.clone()))
            .or_default();
        *n += 1;
        let attempt_here = *n;
        let action = inner
            .rules
            .iter()
            .find(|r| {
                r.handler.as_ref().is_none_or(|x| *x == name)
                    && r.key.as_ref().is_none_or(|k| Some(k) == key.as_ref())
            })
            .map(|r| (r.action.clone(), attempt_here));
        let signature_ok = inner.secrets.get(&name).map(|secret| {
            signature::valid(
                secret,
                &event_id,
                &h("webhook-timestamp").unwrap_or_default(),
                &h("webhook-signature").unwrap_or_default(),
                &body,
            )
        });
        (action, signature_ok)
    };
    let mut out_headers = HeaderMap::new();
    let echo = matches!(action, Some((Action::Echo { .. }, _)));
    let status = match action {
        None => 200,
        Some((
            Action::FailFirst {
                n,
                status,
                retry_after,
            },
            seen,
        )) if seen <= n => {
            if let Some(s) = retry_after {
                out_headers.insert("retry-after", s.to_string().parse().expect("digits"));
            }
            status
        }
        Some((Action::FailFirst { .. }, _)) => 200,
        Some((
            Action::Status {
                status,
                retry_after,
            },
            _,
        )) => {
            if let Some(s) = retry_after {
                out_headers.insert("retry-after", s.to_string().parse().expect("digits"));
            }
            status
        }
        Some((Action::Delay(d), _)) => {
            tokio::time::sleep(d).await;
            200
        }
        Some((Action::DelayedStatus { delay, status }, _)) => {
            tokio::time::sleep(delay).await;
            status
        }
        Some((Action::Echo { status }, _)) => status,
    };
    let answer = if echo { body.clone() } else { Bytes::new() };
    let rec = Received {
        handler: name,
        event_id,
        key,
        sequence: h("lanebus-sequence").and_then(|s| s.parse().ok()),
        attempt: h("lanebus-attempt")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0),
        arrived_ms: arrived.as_secs_f64() * 1e3,
        answered_ms: shared.start.elapsed().as_secs_f64() * 1e3,
        status,
        signature_ok,
        body: String::from_utf8_lossy(&body).into_owned(),
        headers: headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        sender: Some(peer.ip().to_string()),
    };
    {
        let mut inner = shared.inner.lock().expect("not poisoned");
        if rec.accepted() {
            inner
                .accepted
                .insert((rec.handler.clone(), rec.event_id.clone()));
        }
        inner.log.push(rec);
    }
    shared.changed.notify_waiters();
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        out_headers,
        answer,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(handler: &str, id: &str, key: &str, seq: i64, status: u16) -> Received {
        from("127.0.0.1", handler, id, key, seq, status)
    }

    fn from(sender: &str, handler: &str, id: &str, key: &str, seq: i64, status: u16) -> Received {
        Received {
            sender: Some(sender.into()),
            handler: handler.into(),
            event_id: id.into(),
            key: Some(key.into()),
            sequence: Some(seq),
            attempt: 1,
            arrived_ms: 0.0,
            answered_ms: 0.0,
            status,
            signature_ok: Some(true),
            body: String::new(),
            headers: BTreeMap::new(),
        }
    }

    /// `log` in arrival order: 10 ms apart, each answered 1 ms after it
    /// arrived.
    fn timed(mut log: Vec<Received>) -> Vec<Received> {
        for (i, r) in log.iter_mut().enumerate() {
            r.arrived_ms = i as f64 * 10.0;
            r.answered_ms = r.arrived_ms + 1.0;
        }
        log
    }

    fn exp(handler: &str, id: &str) -> Expected {
        Expected {
            handler: handler.into(),
            event_id: id.into(),
            key: Some("k".into()),
        }
    }

    #[test]
    fn an_exact_run_passes() {
        let log = timed(vec![
            rec("h", "a", "k", 1, 500),
            rec("h", "a", "k", 1, 200),
            rec("h", "b", "k", 2, 200),
        ]);
        let v = verdict(&log, &[exp("h", "a"), exp("h", "b")]);
        assert!(v.exact(), "{v:?}");
        assert_eq!(v.delivered, 2);
    }

    #[test]
    fn loss_duplicates_and_disorder_are_counted() {
        let log = timed(vec![
            rec("h", "b", "k", 2, 200),
            rec("h", "a", "k", 1, 200),
            rec("h", "a", "k", 1, 200),
        ]);
        let v = verdict(&log, &[exp("h", "a"), exp("h", "b"), exp("h", "c")]);
        // a's first arrival after b is disorder, and so is its repeat from
        // the same sender.
        assert_eq!(
            (v.lost, v.duplicated, v.out_of_order, v.rewinds),
            (1, 1, 2, 0),
            "{v:?}"
        );
        assert!(!v.exact());
    }

    #[test]
    fn a_stale_repeat_after_the_next_delivery_is_a_rewind_not_disorder() {
        // a accepted, then b from the new owner; the old owner's stale
        // attempt of a arrives last.
        let log = timed(vec![
            from("127.0.0.3", "h", "a", "k", 1, 200),
            from("127.0.0.1", "h", "b", "k", 2, 200),
            from("127.0.0.3", "h", "a", "k", 1, 200),
        ]);
        let v = verdict(&log, &[exp("h", "a"), exp("h", "b")]);
        assert_eq!(
            (v.out_of_order, v.rewinds, v.duplicated),
            (0, 1, 1),
            "{v:?}"
        );
        // The node that sent b sends a again: disorder (it went on to b
        // while a was not done, as far as it knew).
        let log = timed(vec![
            from("127.0.0.3", "h", "a", "k", 1, 200),
            from("127.0.0.1", "h", "b", "k", 2, 200),
            from("127.0.0.1", "h", "a", "k", 1, 200),
        ]);
        let v = verdict(&log, &[exp("h", "a"), exp("h", "b")]);
        assert_eq!((v.out_of_order, v.rewinds), (1, 0), "{v:?}");
        // Not accepted before: the same arrival order is disorder.
        let log = timed(vec![
            rec("h", "a", "k", 1, 500),
            rec("h", "b", "k", 2, 200),
            rec("h", "a", "k", 1, 200),
        ]);
        let v = verdict(&log, &[exp("h", "a"), exp("h", "b")]);
        assert_eq!((v.out_of_order, v.rewinds), (2, 0), "{v:?}");
    }

    #[test]
    fn next_sequence_before_the_previous_was_accepted_is_disorder() {
        let log = timed(vec![
            rec("h", "a", "k", 1, 500),
            rec("h", "b", "k", 2, 200),
            rec("h", "a", "k", 1, 200),
        ]);
        let v = verdict(&log, &[exp("h", "a"), exp("h", "b")]);
        assert_eq!(v.out_of_order, 2, "{v:?}");
    }
}
