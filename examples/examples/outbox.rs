//! `cargo run -p lanebus-examples --example outbox [STORE_URL]`: an order
//! and its event committed together, and a failed one leaving neither
//! (see `lanebus_examples::outbox`).

use lanebus_examples::outbox::{Order, OutboxStore};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = lanebus_examples::store_url_from_args()?;
    let store = OutboxStore::open(&url).await?;
    let stamp = chrono::Utc::now().timestamp_millis();
    let paid = Order {
        id: format!("{stamp}-1"),
        customer: "alice".into(),
        amount_cents: 4_200,
    };
    let failed = Order {
        id: format!("{stamp}-2"),
        customer: "alice".into(),
        amount_cents: 1_300,
    };
    store.place(&paid, false).await?;
    store.place(&failed, true).await?;
    for (what, order) in [("committed", &paid), ("rolled back", &failed)] {
        let (row, event) = store.stored(order).await?;
        println!(
            "{what} order {}: row stored {row}, event stored {event}",
            order.id
        );
    }
    Ok(())
}
