//! The node's cache of the handler catalog.
//!
//! Lane owners look handlers up here for every delivery, so the cache is a
//! snapshot behind a read lock. It is reloaded from the store when the API
//! reports a change ([`NodeView::handlers_changed`](lanebus_api::NodeView)),
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
//! the change at their next periodic reload.
//!
//! Metric: `lanebus_handlers_disabled` (gauge), the disabled handlers in
//! the catalog as of the last reload.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use lanebus_store::{Handler as HandlerConfig, HandlerState, Store, StoreError};
use tokio::sync::{watch, Mutex, Notify};

/// Cached handler catalog. See the module docs.
pub struct HandlerCatalog {
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

    /// The handler with this id, as of the last reload.
    pub fn get(&self, id: &str) -> Option<Arc<HandlerConfig>> {
        self.handlers.read().expect("not poisoned").get(id).cloned()
    }

    /// Every cached handler.
    pub fn all(&self) -> Arc<HashMap<String, Arc<HandlerConfig>>> {
        self.handlers.read().expect("not poisoned").clone()
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

    /// Sets a handler's state in the store (a `410 Gone` disables it) and
    /// reloads the catalog, so this node's lanes see the change at once.
    /// Returns the handler as stored.
    ///
    /// # Errors
    /// The store's error ([`StoreError::NotFound`] if the handler is gone).
    pub async fn set_state(
        &self,
        id: &str,
        state: HandlerState,
    ) -> Result<HandlerConfig, StoreError> {
        let handler = self.store.set_handler_state(id, state).await?;
        self.reload_fresh().await?;
        Ok(handler)
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
