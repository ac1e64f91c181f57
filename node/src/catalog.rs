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

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use lanebus_store::{Handler as HandlerConfig, Store, StoreError};
use tokio::sync::{watch, Mutex, Notify};

/// Cached handler catalog. See the module docs.
pub struct HandlerCatalog {
    store: Arc<dyn Store>,
    handlers: RwLock<Arc<HashMap<String, Arc<HandlerConfig>>>>,
    /// Number of the last reload started (under `lock`).
    started: AtomicU64,
    /// Number of the last reload completed; also published on `version`.
    completed: AtomicU64,
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
    pub fn request_reload(&self) {
        self.changed.notify_one();
    }

    /// Waits until a reload that started after this call has completed
    /// (sharing one with concurrent callers where possible).
    ///
    /// # Errors
    /// The store's error if the reload failed.
    pub async fn reload_fresh(&self) -> Result<(), StoreError> {
        let wanted = self.started.load(Ordering::SeqCst) + 1;
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
