//! Runnable examples of lanebus as a library, each a module here (tested by
//! `tests/examples.rs`) and a thin `main` under `examples/`:
//!
//! | module | `cargo run -p lanebus-examples --example ...` | shows |
//! | --- | --- | --- |
//! | [`outbox`] | `outbox [STORE_URL]` | publishing inside the application's own transaction: the order row and its event commit together or not at all |
//! | [`embedded`] | `embedded [STORE_URL]` | a node inside the application, with an in-process handler that gets each customer's events in order |
//! | [`receiver`] | `receiver` | a webhook receiver that verifies Standard Webhooks signatures and de-duplicates by `webhook-id`, fed by an embedded node |
//!
//! The store URL defaults to a SQLite file in a temporary directory, so
//! every example runs without services; pass `postgres://...` to run the
//! outbox on PostgreSQL.

pub mod embedded;
pub mod outbox;
pub mod receiver;

/// The payload of the examples' `order.placed` event: an order of a
/// customer, amounts in cents.
pub fn order_payload(order_id: &str, customer: &str, amount_cents: i64) -> Vec<u8> {
    serde_json::json!({"order_id": order_id, "customer": customer, "amount_cents": amount_cents})
        .to_string()
        .into_bytes()
}

/// The store URL of an example's run: its first argument, else a SQLite
/// file in a new directory under the system's temporary directory.
///
/// # Errors
/// The directory cannot be created.
pub fn store_url_from_args() -> anyhow::Result<String> {
    if let Some(url) = std::env::args().nth(1) {
        return Ok(url);
    }
    let dir = std::env::temp_dir().join(format!("lanebus-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(format!("sqlite://{}", dir.join("lanebus.db").display()))
}
