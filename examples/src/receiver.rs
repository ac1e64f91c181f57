//! A webhook receiver as an application would write one: it verifies the
//! Standard Webhooks signature (docs/design.md section 5: `webhook-id`,
//! `webhook-timestamp`, `webhook-signature` = `v1,` + base64 HMAC-SHA256
//! over `id.timestamp.body` with the decoded `whsec_` secret; several
//! space-separated signatures during a secret rotation, any one verifies),
//! refuses a timestamp more than five minutes from its clock (the
//! specification's replay window), and de-duplicates by `webhook-id`: a
//! delivery is handed over again after a failed attempt or a change of
//! lane owner (docs/design.md invariant 3), with the same id.
//!
//! It also refuses a deposed owner's late request with the fencing token:
//! per lane (`lanebus-lane`) it keeps the highest `lanebus-epoch` of a new,
//! verified request, and answers a lower one `409`. Epochs only grow per
//! lane of one store, so only an owner that lost the lane (a process
//! paused past its lease) sends one; its attempt's outcome is refused by
//! the store too, and the new owner delivers the event. One inbox serves
//! one lanebus store: epochs of another store (or of a recreated one)
//! start again at 1.
//!
//! | answer | when |
//! | --- | --- |
//! | `200` | verified; `{"duplicate": bool}` |
//! | `400` | a header missing |
//! | `401` | the signature does not verify, or the timestamp is outside the window |
//! | `409` | `lanebus-epoch` below the highest seen for its lane |

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};

/// Largest distance between the `webhook-timestamp` and the receiver's
/// clock, in seconds (the Standard Webhooks specification's tolerance).
pub const TOLERANCE_SECS: i64 = 5 * 60;

/// The receiver's state: the signing secret and what it accepted.
pub struct Inbox {
    secret: String,
    seen: Mutex<HashSet<String>>,
    /// Highest `lanebus-epoch` per `lanebus-lane`.
    epochs: Mutex<HashMap<u16, i64>>,
    events: Mutex<Vec<serde_json::Value>>,
}

impl Inbox {
    /// An empty inbox verifying with `secret` (`whsec_...`, as the handler's
    /// registration returned it).
    pub fn new(secret: impl Into<String>) -> Arc<Self> {
        Arc::new(Inbox {
            secret: secret.into(),
            seen: Mutex::default(),
            epochs: Mutex::default(),
            events: Mutex::default(),
        })
    }

    /// Bodies accepted, once per `webhook-id`, in arrival order.
    pub fn events(&self) -> Vec<serde_json::Value> {
        self.events.lock().expect("not poisoned").clone()
    }
}

/// The receiver's routes: `POST /webhook`.
pub fn router(inbox: Arc<Inbox>) -> Router {
    Router::new()
        .route("/webhook", post(receive))
        .with_state(inbox)
}

async fn receive(
    State(inbox): State<Arc<Inbox>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Json<serde_json::Value>) {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let (Some(id), Some(ts), Some(sig)) = (
        header("webhook-id"),
        header("webhook-timestamp"),
        header("webhook-signature"),
    ) else {
        return (
            StatusCode::BAD_REQUEST,
            Json(
                serde_json::json!({"error": "webhook-id, webhook-timestamp and webhook-signature are required"}),
            ),
        );
    };
    // abs_diff: a hostile timestamp cannot overflow the subtraction.
    let fresh = ts
        .parse::<i64>()
        .is_ok_and(|t| chrono::Utc::now().timestamp().abs_diff(t) <= TOLERANCE_SECS.unsigned_abs());
    if !fresh || !lanebus_node::webhook::verify(&inbox.secret, id, ts, sig, &body) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(serde_json::json!({"error": "signature or timestamp does not verify"})),
        );
    }
    // A repeat of an accepted id is answered as one, whatever its epoch:
    // only a new id may move the lane's epoch (the fencing headers are not
    // signed, so a replayed request must not raise it).
    if inbox.seen.lock().expect("not poisoned").contains(id) {
        return (StatusCode::OK, Json(serde_json::json!({"duplicate": true})));
    }
    let lane = header("lanebus-lane").and_then(|v| v.parse::<u16>().ok());
    let epoch = header("lanebus-epoch").and_then(|v| v.parse::<i64>().ok());
    if let (Some(lane), Some(epoch)) = (lane, epoch) {
        let mut epochs = inbox.epochs.lock().expect("not poisoned");
        let highest = epochs.entry(lane).or_insert(epoch);
        if epoch < *highest {
            return (
                StatusCode::CONFLICT,
                Json(serde_json::json!({
                    "error": format!("epoch {epoch} of lane {lane} is below {highest}: sent by a deposed owner"),
                })),
            );
        }
        *highest = epoch;
    }
    let duplicate = !inbox
        .seen
        .lock()
        .expect("not poisoned")
        .insert(id.to_owned());
    if !duplicate {
        let event = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        inbox.events.lock().expect("not poisoned").push(event);
    }
    (
        StatusCode::OK,
        Json(serde_json::json!({"duplicate": duplicate})),
    )
}

/// Serves [`router`] on `127.0.0.1` at a free port; returns the webhook URL.
///
/// # Errors
/// The bind error.
pub async fn serve(inbox: Arc<Inbox>) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router(inbox)).await });
    Ok(format!("http://{addr}/webhook"))
}

/// Runs a node on `store_url` with a webhook handler whose URL is a
/// receiver served here, publishes `orders` orders, and waits up to 60 s
/// until the receiver accepted them all; stops the node. Returns the
/// accepted bodies.
///
/// # Errors
/// The store's or the node's error, or a timeout.
pub async fn run(store_url: &str, orders: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    let store = lanebus_store::open(store_url).await?;
    let secret = lanebus_store::generate_secret();
    let inbox = Inbox::new(secret.clone());
    let url = serve(inbox.clone()).await?;
    store
        .create_handler(lanebus_store::NewHandler {
            name: "orders-webhook".into(),
            url,
            event_types: vec!["order.*".into()],
            max_attempts: 5,
            timeout_ms: 5_000,
            max_in_flight: 16,
            secret,
            rate_limit: None,
            filter: None,
        })
        .await?;
    let mut opts =
        lanebus_node::NodeOptions::new("1", lanebus_node::StoreSource::Opened(store.clone()));
    // The receiver listens on this machine: loopback is refused by default
    // (the SSRF guard).
    opts.egress = lanebus_api::egress::EgressPolicy::allow_loopback();
    let node = lanebus_node::start(opts).await?;
    let events: Vec<lanebus_store::NewEvent> = (0..orders)
        .map(|i| lanebus_store::NewEvent {
            id: None,
            event_type: "order.placed".into(),
            key: Some(format!("customer-{}", i % 3)),
            payload: crate::order_payload(&i.to_string(), "c", 100),
            deliver_at: None,
            expected_seq: None,
        })
        .collect();
    store.publish(events).await?;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    while inbox.events().len() < orders {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the receiver accepted {} of {orders} in 60 s",
            inbox.events().len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    node.shutdown().await?;
    Ok(inbox.events())
}
