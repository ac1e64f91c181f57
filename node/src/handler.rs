//! Handlers: webhooks and in-process Rust handlers behind one attempt path.
//!
//! A registered handler (the store's [`HandlerConfig`]) whose URL is
//! `http://inproc.invalid/NAME` (or `inproc://NAME`, where the store accepts
//! it) is served by the in-process [`Handler`] registered under `NAME` when
//! the node starts (DESIGN.md section 7); every other URL is a webhook. The
//! `.invalid` top-level domain is reserved (RFC 2606) and never resolves, so
//! such a handler cannot be sent over the network by a node that lacks it:
//! those attempts fail and end as dead letters, with the reason kept. Both go through the same key handlers, ordering, retries and
//! dead letters: only the final hand-over differs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lanebus_store::{Delivery, Handler as HandlerConfig};
use tokio::sync::Semaphore;

use crate::retry::AttemptOutcome;
use crate::webhook::WebhookSender;

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
/// owner (DESIGN.md invariant 3): de-duplicate by `delivery.event_id`.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Takes one delivery.
    ///
    /// # Errors
    /// A [`HandlerError`] makes this a failed attempt.
    async fn handle(&self, delivery: &Delivery) -> Result<(), HandlerError>;
}

/// Hands a delivery over to its handler: webhook or in-process.
///
/// A handler's `max_in_flight` bounds its concurrent attempts on this node:
/// an attempt waits for one of the handler's permits before it is sent (the
/// delivery counts as in flight meanwhile; its timeout starts with the send).
#[derive(Clone)]
pub struct Dispatcher {
    webhook: WebhookSender,
    in_process: Arc<HashMap<String, Arc<dyn Handler>>>,
    permits: Arc<Mutex<Permits>>,
}

/// Per handler id: its `max_in_flight` and the semaphore enforcing it.
type Permits = HashMap<String, (u32, Arc<Semaphore>)>;

impl Dispatcher {
    /// A dispatcher with the given in-process handlers, by name.
    pub fn new(webhook: WebhookSender, in_process: HashMap<String, Arc<dyn Handler>>) -> Self {
        Dispatcher {
            webhook,
            in_process: Arc::new(in_process),
            permits: Arc::default(),
        }
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

    /// Makes attempt number `attempt` (1, 2, ...) of `delivery`.
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
        if let Some(name) = in_process_name(&handler.url) {
            let Some(h) = self.in_process.get(name) else {
                return AttemptOutcome::Failed {
                    error: format!("no in-process handler named {name:?} on this node"),
                    retry_after: None,
                };
            };
            let timeout = Duration::from_millis(handler.timeout_ms.max(1));
            return match tokio::time::timeout(timeout, h.handle(delivery)).await {
                Ok(Ok(())) => AttemptOutcome::Delivered,
                Ok(Err(e)) => AttemptOutcome::Failed {
                    error: e.message,
                    retry_after: e.retry_after,
                },
                Err(_) => AttemptOutcome::Failed {
                    error: format!("timeout after {} ms", handler.timeout_ms),
                    retry_after: None,
                },
            };
        }
        self.webhook.send(handler, delivery, attempt).await
    }
}
