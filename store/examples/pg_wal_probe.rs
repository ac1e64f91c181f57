//! Measures the PostgreSQL store's WAL bytes and time per delivery for a
//! publish phase and a drain phase (claim + bulk complete), the way DESIGN.md
//! section 3 counts them. Not a benchmark harness (see bench/): a quick probe
//! for store changes.
//!
//! ```text
//! cargo run --release -p lanebus-store --example pg_wal_probe -- \
//!     postgres://postgres@127.0.0.1:55432/postgres [events] [fan_out] [keys] [payload_bytes]
//! ```
//! Creates and drops a scratch database `lanebus_probe_<random>`.

use std::time::Instant;

use lanebus_store::postgres::PgStore;
use lanebus_store::*;
use sqlx::Connection as _;

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// The WAL insert position (bytes) and full-page images written so far.
/// Both are cluster-wide: run the probe on a server nobody else uses.
async fn wal_lsn(conn: &mut sqlx::PgConnection) -> anyhow::Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, (SELECT wal_fpi FROM pg_stat_wal)",
    )
    .fetch_one(conn)
    .await?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let admin_url = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("LANEBUS_TEST_POSTGRES_URL").ok())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "usage: pg_wal_probe POSTGRES_URL [events] [fan_out] [keys] [payload_bytes]"
            )
        })?;
    let events = arg(2, 20_000);
    let fan_out = arg(3, 1);
    let keys = arg(4, 1_000);
    let payload_len = arg(5, 2_000);

    let db = format!("lanebus_probe_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&admin_url).await?;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&mut admin)
        .await?;
    let url = match admin_url.rfind('/') {
        Some(i) => format!("{}/{db}", &admin_url[..i]),
        None => anyhow::bail!("url without a database part"),
    };
    let result = run(&url, events, fan_out, keys, payload_len).await;
    admin.close().await?;
    let mut admin = sqlx::PgConnection::connect(&admin_url).await?;
    sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    result
}

async fn run(
    url: &str,
    events: usize,
    fan_out: usize,
    keys: usize,
    payload_len: usize,
) -> anyhow::Result<()> {
    let store = PgStore::connect(url).await?;
    let mut probe = sqlx::PgConnection::connect(url).await?;
    for i in 0..fan_out {
        store
            .create_handler(NewHandler {
                name: format!("h{i}"),
                url: "http://127.0.0.1:9/".into(),
                event_types: vec!["*".into()],
                max_attempts: 8,
                timeout_ms: 1000,
                max_in_flight: 64,
                secret: String::new(),
            })
            .await?;
    }
    // A JSON object of about `payload_len` bytes, not compressible (hex noise).
    let noise: String = (0..payload_len.saturating_sub(40) / 2)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let payload = format!(r#"{{"action":"opened","body":"{noise}"}}"#).into_bytes();

    sqlx::query("CHECKPOINT").execute(&mut probe).await?;
    let w0 = wal_lsn(&mut probe).await?;
    let t0 = Instant::now();
    for chunk in 0..events.div_ceil(100) {
        let batch: Vec<NewEvent> = (0..100.min(events - chunk * 100))
            .map(|i| NewEvent {
                id: None,
                event_type: "issues.opened".into(),
                key: Some(format!("repo-{}", (chunk * 100 + i) % keys)),
                payload: payload.clone(),
            })
            .collect();
        store.publish(batch).await?;
    }
    let publish_time = t0.elapsed();
    let w1 = wal_lsn(&mut probe).await?;
    let deliveries = (events * fan_out) as f64;

    let t1 = Instant::now();
    let mut cursors: Vec<i64> = vec![0; usize::from(store.lanes())];
    let mut done = 0usize;
    while done < events * fan_out {
        let claims: Vec<LaneClaim> = (0..store.lanes())
            .map(|lane| LaneClaim {
                lane,
                epoch: 0,
                after: cursors[usize::from(lane)],
                limit: 50,
            })
            .collect();
        let batches = store.claim(&claims).await?;
        let mut refs = Vec::new();
        for b in &batches {
            cursors[usize::from(b.lane)] = b.next_after;
            refs.extend(b.deliveries.iter().map(|d| DeliveryRef {
                id: d.id,
                lane: d.lane,
                epoch: 0,
                attempts: 1,
            }));
        }
        for chunk in refs.chunks(200) {
            done += store.complete(chunk).await?.len();
        }
    }
    let drain_time = t1.elapsed();
    let w2 = wal_lsn(&mut probe).await?;
    println!(
        "events {events}, fan-out {fan_out}, keys {keys}, payload {} B",
        payload.len()
    );
    println!(
        "publish: {:.0} events/s, WAL {:.0} B/event, {:.0} B/delivery, {} full-page images",
        events as f64 / publish_time.as_secs_f64(),
        (w1.0 - w0.0) as f64 / events as f64,
        (w1.0 - w0.0) as f64 / deliveries,
        w1.1 - w0.1
    );
    println!(
        "drain:   {:.0} deliveries/s, WAL {:.0} B/delivery (claim + complete), {} full-page images",
        deliveries / drain_time.as_secs_f64(),
        (w2.0 - w1.0) as f64 / deliveries,
        w2.1 - w1.1
    );
    let c = store.counts().await?;
    anyhow::ensure!(
        c.deliveries == 0 && c.completions as f64 == deliveries,
        "exactness: {c:?}"
    );
    Ok(())
}
