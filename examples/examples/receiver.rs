//! `cargo run -p lanebus-examples --example receiver`: an embedded node
//! sends signed webhooks to a receiver that verifies them (see
//! `lanebus_examples::receiver`).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = lanebus_examples::store_url_from_args()?;
    let events = lanebus_examples::receiver::run(&url, 20).await?;
    println!(
        "the receiver verified and accepted {} webhooks; first: {}",
        events.len(),
        events[0]
    );
    Ok(())
}
