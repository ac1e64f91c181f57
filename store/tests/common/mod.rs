//! Helpers shared by the store's test files.

/// `url` with its database name replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.find('?') {
        Some(i) => (&url[..i], &url[i..]),
        None => (url, ""),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    format!("{}/{db}{query}", &base[..host_end])
}

/// A fresh PostgreSQL database `db` on the server of
/// `LANEBUS_TEST_POSTGRES_URL` (a superuser URL, as `scripts/pg-start`
/// makes), with one handler of every event; returns the admin pool (to drop
/// it), the store and the store's pool.
#[allow(dead_code)]
pub async fn fresh_pg_store(
    db: &str,
) -> (sqlx::PgPool, lanebus_store::postgres::PgStore, sqlx::PgPool) {
    use lanebus_store::Store;
    let admin_url = std::env::var("LANEBUS_TEST_POSTGRES_URL").expect(
        "LANEBUS_TEST_POSTGRES_URL is not set: run the tests with scripts/test, which starts a \
         throwaway PostgreSQL",
    );
    let admin = sqlx::PgPool::connect(&admin_url).await.expect("admin");
    for sql in [
        format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
        format!("CREATE DATABASE {db}"),
    ] {
        sqlx::query(&sql).execute(&admin).await.expect(&sql);
    }
    let store = lanebus_store::postgres::PgStore::connect(&with_database(&admin_url, db))
        .await
        .expect("open store");
    let pool = store.pool().clone();
    store
        .create_handler(new_handler("all", &["*"]))
        .await
        .expect("create handler");
    (admin, store, pool)
}

/// A handler `name` at `http://127.0.0.1:9/{name}` with `routes` and the
/// default policy.
#[allow(dead_code)]
pub fn new_handler(name: &str, routes: &[&str]) -> lanebus_store::NewHandler {
    use lanebus_store::handler_defaults;
    lanebus_store::NewHandler {
        name: name.into(),
        url: format!("http://127.0.0.1:9/{name}"),
        event_types: routes.iter().map(|r| r.to_string()).collect(),
        max_attempts: handler_defaults::MAX_ATTEMPTS,
        timeout_ms: handler_defaults::TIMEOUT_MS,
        max_in_flight: handler_defaults::MAX_IN_FLIGHT,
        secret: String::new(),
        rate_limit: None,
    }
}

/// Closes `pool` and drops database `db` (made by [`fresh_pg_store`]).
#[allow(dead_code)]
pub async fn drop_pg_database(admin: &sqlx::PgPool, pool: sqlx::PgPool, db: &str) {
    pool.close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(admin)
        .await
        .expect("drop database");
}

/// Waits (up to a minute, else panics naming `who`) until a session of
/// `pool`'s database waits for a lock.
#[allow(dead_code)]
pub async fn wait_for_a_lock_wait(pool: &sqlx::PgPool, who: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .expect("pg_stat_activity");
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{who} never waited for a lock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Every delivery a lane owner claims from `store`, lane by lane in claim
/// order: every lane fenced at epoch 1, read from its start (up to 1,000
/// per lane).
#[allow(dead_code)]
pub async fn claim_all(store: &lanebus_store::postgres::PgStore) -> Vec<lanebus_store::Delivery> {
    use lanebus_store::{ClaimCursor, Epoch, LaneClaim, Store};
    let mut claims = Vec::new();
    for lane in 0..store.lanes() {
        assert!(store.fence(lane, "test", Epoch(1)).await.expect("fence"));
        claims.push(LaneClaim {
            lane,
            epoch: Epoch(1),
            after: ClaimCursor::default(),
            limit: 1000,
        });
    }
    let batches = store.claim(&claims).await.expect("claim");
    batches.into_iter().flat_map(|b| b.deliveries).collect()
}
