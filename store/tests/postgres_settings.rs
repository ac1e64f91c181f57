//! Session settings of the store's own PostgreSQL connections. JIT is off
//! (`PgStore::connect`: compiling the claim at every execution once its
//! estimated cost passes `jit_above_cost` cost 200-600 ms per claim), unless
//! the URL sets it. Needs `LANEBUS_TEST_POSTGRES_URL` (a superuser URL; a
//! database is created and dropped).

mod common;

use lanebus_store::postgres::PgStore;

#[tokio::test]
async fn the_store_turns_jit_off_unless_the_url_sets_it() {
    let admin_url = std::env::var("LANEBUS_TEST_POSTGRES_URL").expect(
        "LANEBUS_TEST_POSTGRES_URL is not set: run the tests with scripts/test, which starts a \
         throwaway PostgreSQL",
    );
    let db = format!("lanebus_jit_{}", std::process::id());
    let admin = sqlx::PgPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(&format!("CREATE DATABASE {db}"))
        .execute(&admin)
        .await
        .unwrap();
    let url = common::with_database(&admin_url, &db);
    let jit = |store: &PgStore| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, String>("SHOW jit")
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let store = PgStore::connect(&url).await.unwrap();
    assert_eq!(jit(&store).await, "off");
    let sep = if url.contains('?') { '&' } else { '?' };
    let store = PgStore::connect(&format!("{url}{sep}options=-c%20jit%3Don"))
        .await
        .unwrap();
    assert_eq!(jit(&store).await, "on");
    drop(store);
    sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .execute(&admin)
        .await
        .unwrap();
}
