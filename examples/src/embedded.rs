//! A node inside the application: in-process handlers on the same lanes,
//! key runners, retries and dead letters as webhooks (docs/design.md section
//! 7), without an HTTP hop.
//!
//! A handler whose URL is `http://inproc.invalid/NAME` is served by the
//! [`Handler`] registered under `NAME` in [`NodeOptions::in_process`]. Here
//! `Ledger` books each `order.placed` event; it fails the first attempt of
//! every tenth order, which the node retries with backoff, and each
//! customer's orders still arrive in the order they were placed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lanebus_node::{Handler, HandlerError, NodeOptions, StoreSource};
use lanebus_store::{Delivery, NewEvent, NewHandler};

/// One delivery the ledger took: `(customer, event id, attempt)`.
pub type Booked = (String, String, u32);

/// The in-process handler: records every delivery it accepts.
#[derive(Default)]
pub struct Ledger {
    booked: Mutex<Vec<Booked>>,
}

impl Ledger {
    /// Deliveries accepted so far, in the order they arrived.
    pub fn booked(&self) -> Vec<Booked> {
        self.booked.lock().expect("not poisoned").clone()
    }
}

#[async_trait]
impl Handler for Ledger {
    async fn handle(&self, d: &Delivery) -> Result<(), HandlerError> {
        let customer = d.key.clone().unwrap_or_default();
        // Every tenth order fails its first attempt: a retry, in order.
        if d.attempts == 0 && d.seq.is_some_and(|s| s % 10 == 0) {
            return Err(HandlerError::new("ledger busy, try again"));
        }
        // Idempotent: a delivery can come again after a failed attempt or a
        // change of lane owner (docs/design.md invariant 3), with the same event
        // id; a real ledger books once per id (here: a look at what is
        // booked; in a database, a unique key on the event id).
        let mut booked = self.booked.lock().expect("not poisoned");
        if !booked.iter().any(|(_, id, _)| *id == d.event_id) {
            booked.push((customer, d.event_id.clone(), d.attempts + 1));
        }
        Ok(())
    }
}

/// What [`run`] saw.
#[derive(Debug)]
pub struct Report {
    /// Events published.
    pub published: usize,
    /// Deliveries the ledger accepted, in arrival order.
    pub booked: Vec<Booked>,
    /// Event ids published per customer, in publish order.
    pub published_by_customer: HashMap<String, Vec<String>>,
}

/// Starts a node on `store_url` with the ledger as in-process handler
/// `ledger`, publishes `orders` orders of `customers` customers, waits up
/// to 60 s until the ledger booked them all, and stops the node
/// gracefully.
///
/// # Errors
/// The store's or the node's error, or a timeout.
pub async fn run(store_url: &str, orders: usize, customers: usize) -> anyhow::Result<Report> {
    let store = lanebus_store::open(store_url).await?;
    if !store
        .list_handlers()
        .await?
        .iter()
        .any(|h| h.name == "ledger")
    {
        store
            .create_handler(NewHandler {
                name: "ledger".into(),
                url: "http://inproc.invalid/ledger".into(),
                event_types: vec!["order.*".into()],
                max_attempts: 5,
                timeout_ms: 5_000,
                max_in_flight: 16,
                secret: lanebus_store::generate_secret(),
                rate_limit: None,
                filter: None,
            })
            .await?;
    }
    let ledger = Arc::new(Ledger::default());
    let mut opts = NodeOptions::new("1", StoreSource::Opened(store.clone()));
    opts.in_process.insert("ledger".into(), ledger.clone());
    // Retries come quickly in an example (the default first delay is 500 ms).
    opts.lane.retry.base = Duration::from_millis(50);
    let node = lanebus_node::start(opts).await?;

    // Ids of this run: an id already stored is a duplicate and is not
    // delivered again, so a second run on the same store needs its own.
    let run = chrono::Utc::now().timestamp_millis();
    let mut published_by_customer: HashMap<String, Vec<String>> = HashMap::new();
    let events: Vec<NewEvent> = (0..orders)
        .map(|i| {
            let customer = format!("customer-{run}-{}", i % customers);
            let id = format!("order-{run}-{i}");
            published_by_customer
                .entry(customer.clone())
                .or_default()
                .push(id.clone());
            NewEvent {
                id: Some(id),
                event_type: "order.placed".into(),
                key: Some(customer.clone()),
                payload: crate::order_payload(&i.to_string(), &customer, 100 * i as i64),
                deliver_at: None,
                expected_seq: None,
            }
        })
        .collect();
    for batch in events.chunks(100) {
        let out = store.publish(batch.to_vec()).await?;
        anyhow::ensure!(
            out.duplicates == 0,
            "{} of the example's event ids were stored already",
            out.duplicates
        );
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while distinct(&ledger.booked()) < orders {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the ledger booked {} of {orders} orders in 60 s",
            distinct(&ledger.booked())
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.shutdown().await?;
    Ok(Report {
        published: orders,
        booked: ledger.booked(),
        published_by_customer,
    })
}

/// Distinct event ids among `booked`.
pub fn distinct(booked: &[Booked]) -> usize {
    booked
        .iter()
        .map(|(_, id, _)| id.as_str())
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// Whether every customer's orders were booked in publish order (first
/// bookings; a repeat of an already booked event is skipped, as a
/// de-duplicating consumer would).
pub fn in_order(report: &Report) -> bool {
    let mut seen = std::collections::HashSet::new();
    let mut by_customer: HashMap<&str, Vec<&str>> = HashMap::new();
    for (customer, id, _) in &report.booked {
        if seen.insert(id.as_str()) {
            by_customer.entry(customer).or_default().push(id);
        }
    }
    report.published_by_customer.iter().all(|(c, ids)| {
        by_customer
            .get(c.as_str())
            .is_some_and(|got| got.iter().copied().eq(ids.iter().map(String::as_str)))
    })
}
