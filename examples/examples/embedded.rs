//! `cargo run -p lanebus-examples --example embedded [STORE_URL]`: a node
//! in the application with an in-process handler (see
//! `lanebus_examples::embedded`).

use lanebus_examples::embedded;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = lanebus_examples::store_url_from_args()?;
    let report = embedded::run(&url, 200, 7).await?;
    let retried = report.booked.iter().filter(|(_, _, a)| *a > 1).count();
    println!(
        "published {} orders of 7 customers; the ledger booked {} ({} on a retry); each customer's in order: {}",
        report.published,
        embedded::distinct(&report.booked),
        retried,
        embedded::in_order(&report)
    );
    Ok(())
}
