//! Measures a store's publish and drain (claim + bulk complete) rates and,
//! on PostgreSQL, WAL bytes and full-page images per delivery, the way
//! docs/design.md section 3 counts them. Not the benchmark harness (see bench/):
//! a quick probe for store changes.
//!
//! ```text
//! cargo run --release -p lanebus-store --example store_probe -- \
//!     URL [events] [fan_out] [keys] [payload_bytes]
//! ```
//! `URL` is `postgres://...` (a scratch database `lanebus_probe_<random>` is
//! created and dropped; WAL counters are cluster-wide, so use a server nobody
//! else is using, e.g. `scripts/pg-start DIR`) or `sqlite://PATH` (a new file
//! is created at PATH and left there).

use std::sync::Arc;
use std::time::Instant;

use lanebus_store::postgres::PgStore;
use lanebus_store::sqlite::SqliteStore;
use lanebus_store::*;
use sqlx::Connection as _;

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

struct Shape {
    events: usize,
    fan_out: usize,
    keys: usize,
    payload_len: usize,
}

/// The WAL insert position (bytes) and full-page images written so far.
async fn wal(conn: &mut Option<sqlx::PgConnection>) -> anyhow::Result<(i64, i64)> {
    let Some(conn) = conn.as_mut() else {
        return Ok((0, 0));
    };
    Ok(sqlx::query_as(
        "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, (SELECT wal_fpi FROM pg_stat_wal)",
    )
    .fetch_one(conn)
    .await?)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::args().nth(1).ok_or_else(|| {
        anyhow::anyhow!("usage: store_probe URL [events] [fan_out] [keys] [payload_bytes]")
    })?;
    let shape = Shape {
        events: arg(2, 20_000),
        fan_out: arg(3, 1),
        keys: arg(4, 1_000),
        payload_len: arg(5, 2_000),
    };
    if url.starts_with("sqlite:") {
        let store = Arc::new(SqliteStore::connect(&url).await?);
        return run(store, None, &shape).await;
    }
    let db = format!("lanebus_probe_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(&url).await?;
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&mut admin)
        .await?;
    let db_url = match url.rfind('/') {
        Some(i) => format!("{}/{db}", &url[..i]),
        None => anyhow::bail!("url without a database part"),
    };
    let result = async {
        let store = Arc::new(PgStore::connect(&db_url).await?);
        let probe = sqlx::PgConnection::connect(&db_url).await?;
        run(store, Some(probe), &shape).await
    }
    .await;
    sqlx::query(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .execute(&mut admin)
        .await?;
    result
}

async fn run(
    store: Arc<dyn Store>,
    mut probe: Option<sqlx::PgConnection>,
    shape: &Shape,
) -> anyhow::Result<()> {
    let Shape {
        events,
        fan_out,
        keys,
        payload_len,
    } = *shape;
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
                rate_limit: None,
                filter: None,
            })
            .await?;
    }
    // A JSON object of about `payload_len` bytes, not compressible (hex noise).
    let noise: String = (0..payload_len.saturating_sub(40) / 2)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect();
    let payload = format!(r#"{{"action":"opened","body":"{noise}"}}"#).into_bytes();

    if let Some(p) = probe.as_mut() {
        sqlx::query("CHECKPOINT").execute(p).await?;
    }
    let w0 = wal(&mut probe).await?;
    let t0 = Instant::now();
    for chunk in 0..events.div_ceil(100) {
        let batch: Vec<NewEvent> = (0..100.min(events - chunk * 100))
            .map(|i| NewEvent {
                id: None,
                event_type: "issues.opened".into(),
                key: Some(format!("repo-{}", (chunk * 100 + i) % keys)),
                payload: payload.clone(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect();
        store.publish(batch).await?;
    }
    let publish_time = t0.elapsed();
    let w1 = wal(&mut probe).await?;
    let deliveries = (events * fan_out) as f64;

    let t1 = Instant::now();
    let mut cursors: Vec<ClaimCursor> = vec![ClaimCursor::default(); usize::from(store.lanes())];
    let mut done = 0usize;
    while done < events * fan_out {
        let claims: Vec<LaneClaim> = (0..store.lanes())
            .map(|lane| LaneClaim {
                lane,
                epoch: Epoch(0),
                after: cursors[usize::from(lane)].clone(),
                limit: 50,
            })
            .collect();
        let batches = store.claim(&claims).await?;
        let mut refs = Vec::new();
        for b in &batches {
            cursors[usize::from(b.lane)] = b.next_after.clone();
            refs.extend(b.deliveries.iter().map(|d| DeliveryRef {
                id: d.id,
                lane: d.lane,
                epoch: Epoch(0),
                attempts: 1,
            }));
        }
        for chunk in refs.chunks(200) {
            done += store.complete(chunk).await?.len();
        }
    }
    let drain_time = t1.elapsed();
    let w2 = wal(&mut probe).await?;
    println!(
        "{}: events {events}, fan-out {fan_out}, keys {keys}, payload {} B",
        store.backend(),
        payload.len()
    );
    let has_wal = probe.is_some();
    let wal_note = |from: (i64, i64), to: (i64, i64), per: f64| {
        if has_wal {
            format!(
                ", WAL {:.0} B/delivery, {} full-page images",
                (to.0 - from.0) as f64 / per,
                to.1 - from.1
            )
        } else {
            String::new()
        }
    };
    println!(
        "publish: {:.0} events/s{}",
        events as f64 / publish_time.as_secs_f64(),
        wal_note(w0, w1, deliveries)
    );
    println!(
        "drain:   {:.0} deliveries/s (claim + complete){}",
        deliveries / drain_time.as_secs_f64(),
        wal_note(w1, w2, deliveries)
    );
    let c = store.counts().await?;
    anyhow::ensure!(
        c.deliveries == 0 && c.completions as f64 == deliveries,
        "exactness: {c:?}"
    );
    Ok(())
}
