//! The node's cache of the handler catalog.
//!
//! Lane owners look handlers up here for every delivery, so the cache is a
//! snapshot behind a read lock. It is reloaded from the store when the API
//! reports a change (the node's `NodeView::handlers_changed`),
//! periodically (other nodes' APIs change it too), and when a lane meets a
//! handler id it does not know ([`HandlerCatalog::reload_fresh`]).
//!
//! A delivery of an unknown handler is dropped only after a reload that
//! *started after* the delivery was seen: a handler created just before its
//! first delivery is published must not lose that delivery because an older
//! reload finished late. Reloads are numbered for this reason.
//!
//! An attempt about to be sent asks [`HandlerCatalog::current`], which
//! waits for a reload asked for by [`HandlerCatalog::request_reload`] (the
//! API asks after every change) if none has completed since: once
//! `DELETE /v1/handlers/{id}` has answered, no attempt of this node that
//! passes that check is sent to the deleted handler. Other nodes learn of
//! the change at their next periodic reload, or earlier when the store
//! refuses an attempt's result because the delivery's row is gone (the key
//! runner reloads before the key's next delivery is handed out).
//!
//! Metric: `lanebus_handlers_disabled` (gauge), the disabled handlers in
//! the catalog as of the last reload.
//!
//! # Auto-disable
//!
//! Key runners report every attempt's outcome ([`HandlerCatalog::record_outcome`]);
//! [`crate::auto_disable`] decides what it changes: the start of a run of
//! failures kept in the store
//! ([`Handler::failing_since`](lanebus_store::Handler::failing_since)), set
//! and cleared at these changes only, once per catalog reload at most; a
//! failure while it is older than the node's auto-disable period
//! ([`HandlerCatalog::set_auto_disable_after`], default
//! [`DEFAULT_AUTO_DISABLE_AFTER`], 5 days) disables the handler with reason
//! `failing`, like a `410` does with reason `gone`. The catalog writes it.
//!
//! Failed attempts of ordinary events also tell `lanebus.handler.failing`
//! ([`HandlerCatalog::record_attempt`], [`crate::operational`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use lanebus_store::{change_state, StateChange};
use lanebus_store::{Handler as HandlerConfig, HandlerState, Store, StoreError};
use tokio::sync::{watch, Mutex, Notify};

use crate::auto_disable::{self, Step, Written};
use crate::operational::FailingTold;

/// Default auto-disable period: a handler failing without a success for 5
/// days is disabled (issue #4).
pub const DEFAULT_AUTO_DISABLE_AFTER: Duration = Duration::from_secs(5 * 24 * 3600);

/// Cached handler catalog. See the module docs.
pub struct HandlerCatalog {
    /// Auto-disable period, in milliseconds.
    auto_disable_after_ms: AtomicU64,
    /// Per handler: the auto-disable change last asked for, and the
    /// catalog entry it was asked for against.
    failing_written: std::sync::Mutex<Written>,
    /// Per handler, the hour of its run of failures told last.
    failing_told: std::sync::Mutex<FailingTold>,
    store: Arc<dyn Store>,
    handlers: RwLock<Arc<HashMap<String, Arc<HandlerConfig>>>>,
    /// Number of the last reload started (under `lock`).
    started: AtomicU64,
    /// Number of the last reload completed; also published on `version`.
    completed: AtomicU64,
    /// Number of the first reload that answers the last
    /// [`request_reload`](Self::request_reload).
    requested: AtomicU64,
    lock: Mutex<()>,
    version: watch::Sender<u64>,
    changed: Notify,
}

impl HandlerCatalog {
    /// An empty catalog over `store`; call [`reload_fresh`](Self::reload_fresh) to fill it.
    pub fn new(store: Arc<dyn Store>) -> Self {
        HandlerCatalog {
            auto_disable_after_ms: AtomicU64::new(DEFAULT_AUTO_DISABLE_AFTER.as_millis() as u64),
            failing_written: std::sync::Mutex::default(),
            failing_told: std::sync::Mutex::default(),
            store,
            handlers: RwLock::new(Arc::new(HashMap::new())),
            started: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            requested: AtomicU64::new(0),
            lock: Mutex::new(()),
            version: watch::channel(0).0,
            changed: Notify::new(),
        }
    }

    /// The store the catalog reads.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The handler with this id, as of the last reload.
    pub fn get(&self, id: &str) -> Option<Arc<HandlerConfig>> {
        self.handlers.read().expect("not poisoned").get(id).cloned()
    }

    /// Every cached handler.
    pub fn all(&self) -> Arc<HashMap<String, Arc<HandlerConfig>>> {
        self.handlers.read().expect("not poisoned").clone()
    }

    /// The longest `timeout_ms` of the handlers as last loaded (0 with
    /// none), in milliseconds.
    pub fn longest_timeout_ms(&self) -> u64 {
        self.all().values().map(|h| h.timeout_ms).max().unwrap_or(0)
    }

    /// Watch of the number of completed reloads: changes after every reload.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Asks the background refresher for a reload soon (does not wait).
    /// Until a reload started after this call completes,
    /// [`current`](Self::current) waits for one.
    pub fn request_reload(&self) {
        let wanted = self.started.load(Ordering::SeqCst) + 1;
        self.requested.fetch_max(wanted, Ordering::SeqCst);
        self.changed.notify_one();
    }

    /// The handler with this id as of a reload that started after the last
    /// [`request_reload`](Self::request_reload): waits for one if needed
    /// (one store read, shared). If that reload fails (store unreachable),
    /// answers from the cache as it is.
    pub async fn current(&self, id: &str) -> Option<Arc<HandlerConfig>> {
        let wanted = self.requested.load(Ordering::SeqCst);
        if self.completed.load(Ordering::SeqCst) < wanted {
            if let Err(e) = self.reload_at_least(wanted).await {
                tracing::warn!(error = %e, "handler catalog reload failed; using the cached one");
            }
        }
        self.get(id)
    }

    /// Sets a handler's state in the store by hand (reason `api`, like
    /// [`set_state_because`](Self::set_state_because): counted, logged and
    /// told) and reloads the catalog, so this node's lanes see the change
    /// at once. Returns the handler as stored.
    ///
    /// # Errors
    /// The store's error ([`StoreError::NotFound`] if the handler is gone).
    pub async fn set_state(
        &self,
        id: &str,
        state: HandlerState,
    ) -> Result<HandlerConfig, StoreError> {
        Ok(self.set_state_because(id, state, "api").await?.handler)
    }

    /// Sets a handler's state in the store, recording `reason` (`gone`,
    /// `failing`, `api`) in the handler's `state_reason`, through
    /// [`lanebus_store::change_state`]: a disable is counted
    /// (`lanebus_handlers_disabled_total{reason}`) and logged only by the
    /// call that changed the state ([`StateChange::changed`]), and its
    /// operational event published; then reloads the catalog.
    ///
    /// # Errors
    /// The store's error ([`StoreError::NotFound`] if the handler is gone).
    pub async fn set_state_because(
        &self,
        id: &str,
        state: HandlerState,
        reason: &'static str,
    ) -> Result<StateChange, StoreError> {
        let change = change_state(self.store.as_ref(), id, state, reason).await?;
        self.reload_fresh().await?;
        Ok(change)
    }

    /// Sets the auto-disable period (see the module docs).
    pub fn set_auto_disable_after(&self, after: Duration) {
        self.auto_disable_after_ms
            .store(after.as_millis() as u64, Ordering::SeqCst);
    }

    /// The auto-disable period.
    pub fn auto_disable_after(&self) -> Duration {
        Duration::from_millis(self.auto_disable_after_ms.load(Ordering::SeqCst))
    }

    /// Records the outcome of an attempt to deliver an event of type
    /// `event_type`: [`record_outcome`](Self::record_outcome), and for a
    /// failure of an ordinary (not operational) event, the
    /// `lanebus.handler.failing` event of its hour of the handler's run of
    /// failures ([`crate::operational`]).
    pub fn record_attempt(self: &Arc<Self>, handler_id: &str, event_type: &str, success: bool) {
        let tell = !success && !lanebus_store::operational::is_operational(event_type);
        if tell {
            if let Some(h) = self.get(handler_id) {
                if let Some(since) = h.failing_since {
                    self.tell_failing(&h, since, chrono::Utc::now());
                }
            }
        }
        self.record(handler_id, success, tell);
    }

    /// Records an attempt's outcome for auto-disable (see the module docs):
    /// cheap when nothing is to be written; store writes run in a spawned
    /// task (needs a tokio runtime).
    pub fn record_outcome(self: &Arc<Self>, handler_id: &str, success: bool) {
        self.record(handler_id, success, false);
    }

    /// Publishes (in a spawned task) the `lanebus.handler.failing` event of
    /// `h`'s run of failures started at `since`, for a failure at `now`,
    /// unless this node told that hour already.
    fn tell_failing(
        self: &Arc<Self>,
        h: &HandlerConfig,
        since: chrono::DateTime<chrono::Utc>,
        now: chrono::DateTime<chrono::Utc>,
    ) {
        let due = self
            .failing_told
            .lock()
            .expect("not poisoned")
            .due(&h.id, since, now);
        if let Some(hour) = due {
            let event = lanebus_store::operational::failing(h, since, hour, now);
            let store = self.store.clone();
            tokio::spawn(async move {
                lanebus_store::operational::publish(store.as_ref(), event).await
            });
        }
    }

    /// [`record_outcome`](Self::record_outcome); `tell`: a failure that
    /// marks the start of a run tells it once the mark is written.
    fn record(self: &Arc<Self>, handler_id: &str, success: bool, tell: bool) {
        let Some(h) = self.get(handler_id) else {
            return;
        };
        let now = chrono::Utc::now();
        let step = auto_disable::step(h.state, h.failing_since, success, now, || {
            self.auto_disable_after()
        });
        if step == Step::Nothing {
            return;
        }
        // Once per catalog entry: until a reload, every outcome asks again.
        let entry = Arc::as_ptr(&h) as usize;
        if !self
            .failing_written
            .lock()
            .expect("not poisoned")
            .first(handler_id, step, entry)
        {
            return;
        }
        let (me, id) = (self.clone(), handler_id.to_owned());
        if let Step::Mark { failing } = step {
            tokio::spawn(async move {
                match me.store.mark_handler_failing(&id, failing, now).await {
                    Ok(()) if failing && tell => {
                        me.changed.notify_one();
                        // The mark as stored (another node's may have won).
                        if let Ok(h) = me.store.get_handler(&id).await {
                            if let Some(since) = h.failing_since {
                                me.tell_failing(&h, since, now);
                            }
                        }
                    }
                    Ok(()) => me.changed.notify_one(),
                    Err(e) => {
                        tracing::debug!(handler = %id, error = %e, "could not record the handler's failure run")
                    }
                }
            });
            return;
        }
        let Step::Disable { since } = step else {
            return;
        };
        tokio::spawn(async move {
            match me
                .set_state_because(&id, HandlerState::Disabled, "failing")
                .await
            {
                // Counted and logged (warn) by `change_state`; the why here.
                Ok(change) if change.changed() => {
                    tracing::info!(handler = %id, failing_since = %since, after_s = me.auto_disable_after().as_secs(), "auto-disable: the handler failed without a success for the auto-disable period");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(handler = %id, error = %e, "could not auto-disable the handler")
                }
            }
        });
    }

    /// Waits until a reload that started after this call has completed
    /// (sharing one with concurrent callers where possible).
    ///
    /// # Errors
    /// The store's error if the reload failed.
    pub async fn reload_fresh(&self) -> Result<(), StoreError> {
        let wanted = self.started.load(Ordering::SeqCst) + 1;
        self.reload_at_least(wanted).await
    }

    /// Waits until reload number `wanted` (or a later one) has completed,
    /// starting one if needed.
    async fn reload_at_least(&self, wanted: u64) -> Result<(), StoreError> {
        let _guard = self.lock.lock().await;
        if self.completed.load(Ordering::SeqCst) >= wanted {
            return Ok(());
        }
        let n = self.started.fetch_add(1, Ordering::SeqCst) + 1;
        let list = self.store.list_handlers().await?;
        let map: HashMap<String, Arc<HandlerConfig>> = list
            .into_iter()
            .map(|h| (h.id.clone(), Arc::new(h)))
            .collect();
        let disabled = map
            .values()
            .filter(|h| h.state != HandlerState::Enabled)
            .count();
        crate::metrics::handlers_disabled(disabled);
        *self.handlers.write().expect("not poisoned") = Arc::new(map);
        self.completed.store(n, Ordering::SeqCst);
        self.version.send_replace(n);
        Ok(())
    }

    /// Reloads on every [`request_reload`](Self::request_reload) and every
    /// `every`; runs until the process ends (spawn it).
    pub async fn refresh_loop(self: Arc<Self>, every: std::time::Duration) {
        loop {
            tokio::select! {
                _ = self.changed.notified() => {}
                _ = tokio::time::sleep(every) => {}
            }
            if let Err(e) = self.reload_fresh().await {
                tracing::warn!(error = %e, "handler catalog reload failed");
            }
        }
    }
}
