//! The SQL interface on PostgreSQL (`lanebus.publish`, `publish_batch`,
//! `wake`; store/src/postgres/sql/functions.sql), called as an application
//! in another language calls it: inside its own transaction, on its own
//! connection. Its lanes, ids, rules, sequence numbers, duplicates, expected
//! sequences and wake-ups are checked against the Rust publish path. Needs
//! `LANEBUS_TEST_POSTGRES_URL` (a superuser URL, as `scripts/pg-start` makes;
//! a database is created and dropped per test).

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use lanebus_store::postgres::{PgStore, CHANNEL};
use lanebus_store::{event_id_time, lane_of_key, NewEvent, Store};
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Row};

fn event(event_type: &str, key: Option<&str>, payload: &str) -> NewEvent {
    NewEvent {
        id: None,
        event_type: event_type.into(),
        key: key.map(Into::into),
        payload: payload.as_bytes().to_vec(),
        deliver_at: None,
        expected_seq: None,
    }
}

/// `lanebus.publish(type, key, payload)` on `conn`: the event id, or the
/// database error's SQLSTATE and message.
async fn sql_publish(
    conn: &mut PgConnection,
    event_type: &str,
    key: Option<&str>,
    payload: &str,
) -> Result<String, (String, String)> {
    sqlx::query_scalar("SELECT lanebus.publish($1, $2, $3::jsonb)")
        .bind(event_type)
        .bind(key)
        .bind(payload)
        .fetch_one(conn)
        .await
        .map_err(db_error)
}

fn db_error(e: sqlx::Error) -> (String, String) {
    match e {
        sqlx::Error::Database(d) => (
            d.code().unwrap_or_default().into_owned(),
            d.message().to_owned(),
        ),
        other => panic!("not a database error: {other}"),
    }
}

/// Every delivery a lane owner claims, in claim order per lane: (event id,
/// key, seq).
async fn claimed(store: &PgStore) -> Vec<(String, Option<String>, Option<i64>)> {
    common::claim_all(store)
        .await
        .into_iter()
        .map(|d| (d.event_id, d.key, d.seq))
        .collect()
}

/// The next notification's payload on `listener` (within a minute).
async fn next(listener: &mut PgListener) -> String {
    tokio::time::timeout(Duration::from_secs(60), listener.recv())
        .await
        .expect("a notification within a minute")
        .expect("notification")
        .payload()
        .to_owned()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// `lanebus.lane_of` is `lane_of_key` (FNV-1a of the UTF-8 bytes), for
/// ASCII, multi-byte and long keys and several lane counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_lanes_are_the_rust_lanes() {
    let db = format!("lanebus_sqlfn_lanes_{}", std::process::id());
    let (admin, _store, pool) = common::fresh_pg_store(&db).await;
    let mut keys: Vec<String> = (0..300).map(|i| format!("repo-{i}")).collect();
    keys.extend(["", "é", "日本語のキー", "🦀 crab", "a\u{7f}b"].map(String::from));
    keys.push("x".repeat(256));
    for lanes in [1u16, 7, 256, 65_535] {
        let got: Vec<i32> =
            sqlx::query_scalar("SELECT lanebus.lane_of(k, $2) FROM unnest($1::text[]) AS k")
                .bind(&keys)
                .bind(i32::from(lanes))
                .fetch_all(&pool)
                .await
                .expect("lane_of");
        let want: Vec<i32> = keys
            .iter()
            .map(|k| i32::from(lane_of_key(k, lanes)))
            .collect();
        assert_eq!(got, want, "{lanes} lanes");
    }
    common::drop_pg_database(&admin, pool, &db).await;
}

/// A publish in the caller's transaction exists if and only if it commits;
/// committed events share their keys' sequences with `Store::publish`'s,
/// get a delivery per matching handler, a UUIDv7 id and the store's lane,
/// and are claimed in sequence order, interleaved with the Rust ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_publishes_commit_or_leave_nothing_and_share_key_order() {
    let db = format!("lanebus_sqlfn_commit_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let mut conn = pool.acquire().await.expect("conn");
    let mut want: Vec<String> = Vec::new();
    for round in 0..5 {
        let rust = store
            .publish(vec![event(
                "order.rust",
                Some("k"),
                &format!("{{\"r\":{round}}}"),
            )])
            .await
            .expect("publish");
        want.extend(rust.ids);

        sqlx::query("BEGIN")
            .execute(&mut *conn)
            .await
            .expect("begin");
        let id = sql_publish(
            &mut conn,
            "order.sql",
            Some("k"),
            &format!("{{\"s\":{round}}}"),
        )
        .await
        .expect("sql publish");
        sqlx::query("COMMIT")
            .execute(&mut *conn)
            .await
            .expect("commit");
        want.push(id);

        sqlx::query("BEGIN")
            .execute(&mut *conn)
            .await
            .expect("begin");
        sql_publish(&mut conn, "order.gone", Some("k"), "{}")
            .await
            .expect("sql publish");
        sqlx::query("ROLLBACK")
            .execute(&mut *conn)
            .await
            .expect("rollback");
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM events WHERE type = 'order.gone'"
        )
        .await,
        0,
        "rolled back"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM deliveries").await,
        10,
        "one delivery per committed event (one handler)"
    );
    let claimed = claimed(&store).await;
    let ids: Vec<String> = claimed.iter().map(|(id, _, _)| id.clone()).collect();
    assert_eq!(ids, want, "claimed in publish order");
    let seqs: Vec<Option<i64>> = claimed.iter().map(|(_, _, s)| *s).collect();
    assert_eq!(seqs, (1..=10).map(Some).collect::<Vec<_>>(), "no gap");
    for id in want.iter().skip(1).step_by(2) {
        let e = store
            .lookup_event(id)
            .await
            .expect("lookup")
            .expect("stored");
        assert_eq!(e.event_type, "order.sql");
        assert_eq!(e.lane, lane_of_key("k", store.lanes()));
        assert!(event_id_time(id).is_some(), "{id} is a UUIDv7");
    }
    drop(conn);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// The functions refuse what the rulebook (`rules::event`) refuses, naming
/// the same `events[i].field`, and store nothing of a refused batch; they
/// accept what it accepts at the limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_rules_are_the_rulebook() {
    let db = format!("lanebus_sqlfn_rules_{}", std::process::id());
    let (admin, _store, pool) = common::fresh_pg_store(&db).await;
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let cases: Vec<(&str, NewEvent, Option<&str>)> = vec![
        ("type", event("a b", None, "{}"), None),
        ("type", event("", None, "{}"), None),
        ("type", event(&"t".repeat(129), None, "{}"), None),
        ("type", event("lanebus.handler.disabled", None, "{}"), None),
        ("key", event("t", Some(""), "{}"), None),
        ("key", event("t", Some(&"k".repeat(257)), "{}"), None),
        ("key", event("t", Some("a\u{1}b"), "{}"), None),
        ("key", event("t", Some("a\u{85}b"), "{}"), None),
        ("payload", event("t", None, &deep(129)), None),
        // Break-it (issue 15): a string delivery would open as a personal
        // field's envelope (jsonb keeps no escapes, so written escaped too).
        (
            "payload",
            event("t", None, r#"{"note":["lbenc:v1:YQ:AAAA"]}"#),
            None,
        ),
        ("payload", event("t", None, r#""lbenc:v1::""#), None),
        ("id", event("t", None, "{}"), Some("has space")),
        ("id", event("t", None, "{}"), Some("")),
        (
            "ok",
            event("t.x:y/z-1_2", Some(&"k".repeat(256)), &deep(128)),
            None,
        ),
        (
            "ok",
            event("t", Some("日本"), &format!("[\"{}\"]", "[".repeat(200))),
            Some("!~"),
        ),
    ];
    for (field, mut e, id) in cases {
        e.id = id.map(Into::into);
        let rust = lanebus_store::rules::event::batch(std::slice::from_ref(&e), chrono::Utc::now());
        let sql = sqlx::query_scalar::<_, String>("SELECT lanebus.publish($1, $2, $3::jsonb, $4)")
            .bind(&e.event_type)
            .bind(&e.key)
            .bind(String::from_utf8(e.payload.clone()).expect("utf-8"))
            .bind(&e.id)
            .fetch_one(&pool)
            .await
            .map_err(db_error);
        match (field, rust, sql) {
            ("ok", Ok(()), Ok(_)) => {}
            (field, Err(r), Err((code, message))) => {
                assert_eq!(code, "22023", "{field}: {message}");
                let at = format!("events[0].{field}: ");
                assert!(message.starts_with(&at), "{message:?} names {at}");
                assert!(
                    r.to_string().contains(&message[at.len()..at.len() + 10]),
                    "same rule: rust {r:?}, sql {message:?}"
                );
            }
            (field, rust, sql) => panic!("{field}: rust {rust:?}, sql {sql:?}"),
        }
    }
    // Escaped, it is the same string to jsonb, which stores it plain.
    let (code, message) = sql_publish(
        &mut pool.acquire().await.expect("connection"),
        "t",
        None,
        r#"{"n":"\u006cbenc:v1:YQ:AAAA"}"#,
    )
    .await
    .expect_err("an escaped envelope");
    assert_eq!(code, "22023", "{message}");
    assert!(
        message.starts_with("events[0].payload: the string"),
        "{message}"
    );
    // A batch with one bad event stores nothing.
    let refused = sqlx::query("SELECT * FROM lanebus.publish_batch($1, $2, $3::jsonb[])")
        .bind(vec!["good", "bad type"])
        .bind(vec![Some("k"), None])
        .bind(vec!["{}", "{}"])
        .fetch_all(&pool)
        .await
        .map_err(db_error)
        .expect_err("refused");
    assert!(refused.1.starts_with("events[1].type: "), "{refused:?}");
    // Times and arrays the rulebook never sees from Rust: a delivery time
    // that is not finite, arrays not starting at index 1.
    for (sql, says) in [
        (
            "SELECT lanebus.publish('t', 'k', '{}', deliver_at => '-infinity')",
            "events[0].deliver_at: deliver_at must be a finite time",
        ),
        (
            "SELECT * FROM lanebus.publish_batch('[0:0]={t}', '[0:0]={k}', '{\"{}\"}')",
            "events: the arrays must be one-dimensional and start at index 1",
        ),
    ] {
        let (code, message) = sqlx::query(sql)
            .fetch_all(&pool)
            .await
            .map_err(db_error)
            .expect_err(sql);
        assert_eq!(code, "22023", "{message}");
        assert!(message.starts_with(says), "{message}");
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM events").await,
        2,
        "only the two ok cases"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM key_seqs WHERE key = 'k'").await,
        0
    );
    common::drop_pg_database(&admin, pool, &db).await;
}

/// The functions ignore the caller's search_path: a temporary table named
/// `events` or `handlers`, an `events` table in a schema named after the
/// caller (`"$user"`) and a caller's path with `pg_temp` first change
/// nothing; the event is in the store's tables, routed by its handlers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_functions_ignore_the_callers_search_path() {
    let db = format!("lanebus_sqlfn_path_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let mut conn = pool.acquire().await.expect("conn");
    for sql in [
        "CREATE SCHEMA AUTHORIZATION CURRENT_USER",
        "CREATE TABLE \"$user\".events (LIKE public.events)",
        "CREATE TEMP TABLE events (LIKE public.events)",
        "CREATE TEMP TABLE handlers (LIKE public.handlers)",
    ] {
        let sql = sql.replace("\"$user\"", "current_user_schema");
        let sql = if sql.contains("current_user_schema") {
            let user: String = sqlx::query_scalar("SELECT quote_ident(current_user)")
                .fetch_one(&mut *conn)
                .await
                .expect("user");
            sql.replace("current_user_schema", &user)
        } else {
            sql
        };
        sqlx::query(&sql).execute(&mut *conn).await.expect(&sql);
    }
    for path in ["pg_temp, public", "\"$user\", public"] {
        sqlx::query(&format!("SET search_path = {path}"))
            .execute(&mut *conn)
            .await
            .expect("path");
        let id = sql_publish(&mut conn, "t", Some("k"), "{}")
            .await
            .expect("publish");
        let elsewhere: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM pg_temp.events) \
                    + (SELECT count(*) FROM pg_temp.handlers)",
        )
        .fetch_one(&mut *conn)
        .await
        .expect("temp tables");
        assert_eq!(
            elsewhere, 0,
            "{path}: nothing in the caller's temporary tables"
        );
        // The store's own tables, named in full: the store's pool has the
        // default path, which the caller's "$user" schema now shadows too.
        let (events, deliveries): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM public.events WHERE id = $1), \
                    (SELECT count(*) FROM public.deliveries WHERE event_id = $1)",
        )
        .bind(&id)
        .fetch_one(&pool)
        .await
        .expect("store tables");
        assert_eq!((events, deliveries), (1, 1), "{path}: stored and routed");
    }
    let user_events: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid \
         WHERE n.nspname = current_user AND c.relname = 'events'",
    )
    .fetch_one(&mut *conn)
    .await
    .expect("user schema");
    assert_eq!(user_events, 1, "the caller's own events table exists");
    drop(conn);
    drop(store);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// Client ids are idempotent (an id already stored, or repeated in the
/// batch, is a duplicate and stores nothing more), and an expected sequence
/// that does not hold fails the batch (SQLSTATE LB409) with nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_duplicates_and_expected_sequences() {
    let db = format!("lanebus_sqlfn_dups_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let batch = |ids: Vec<Option<&'static str>>, expected: Vec<Option<i64>>| {
        let n = ids.len();
        sqlx::query(
            "SELECT id, seq, duplicate FROM lanebus.publish_batch($1, $2, $3::jsonb[], $4, \
             NULL, $5)",
        )
        .bind(vec!["t"; n])
        .bind(vec!["k"; n])
        .bind(vec!["{}"; n])
        .bind(ids)
        .bind(expected)
    };
    let rows = batch(vec![Some("a"), Some("b"), Some("a")], vec![None; 3])
        .fetch_all(&pool)
        .await
        .expect("first");
    let got: Vec<(String, Option<i64>, bool)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![
            ("a".into(), Some(1), false),
            ("b".into(), Some(2), false),
            ("a".into(), None, true)
        ]
    );
    let rows = batch(vec![Some("b"), Some("c")], vec![None, Some(2)])
        .fetch_all(&pool)
        .await
        .expect("second");
    let dup: Vec<bool> = rows.iter().map(|r| r.get(2)).collect();
    assert_eq!(
        dup,
        vec![true, false],
        "b stored already; c expects 2 and gets 3"
    );
    let seq: Option<i64> = rows[1].get(1);
    assert_eq!(seq, Some(3));

    let (code, message) = batch(vec![Some("d"), Some("e")], vec![None, Some(1)])
        .fetch_all(&pool)
        .await
        .map_err(db_error)
        .expect_err("conflict");
    assert_eq!(code, "LB409", "{message}");
    assert!(message.starts_with("events[1].expected_seq: "), "{message}");
    assert!(message.contains("at sequence 3"), "{message}");
    assert!(
        store.lookup_event("d").await.expect("lookup").is_none(),
        "nothing stored"
    );
    assert_eq!(count(&pool, "SELECT max(seq) FROM key_seqs").await, 3);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// The caller's commit sends no NOTIFY; `lanebus.wake()` after it sends one
/// naming the lanes the session published into; a rolled-back publish
/// leaves nothing to wake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_wake_after_commit_names_the_lanes() {
    let db = format!("lanebus_sqlfn_wake_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let mut listener = PgListener::connect_with(&pool).await.expect("listener");
    listener.listen(CHANNEL).await.expect("listen");
    let mut conn = pool.acquire().await.expect("conn");
    sqlx::query("BEGIN")
        .execute(&mut *conn)
        .await
        .expect("begin");
    for key in ["k1", "k2"] {
        sql_publish(&mut conn, "t", Some(key), "{}")
            .await
            .expect("publish");
    }
    sqlx::query("COMMIT")
        .execute(&mut *conn)
        .await
        .expect("commit");
    sqlx::query("BEGIN")
        .execute(&mut *conn)
        .await
        .expect("begin");
    sql_publish(&mut conn, "t", Some("rolled-back-key"), "{}")
        .await
        .expect("publish");
    sqlx::query("ROLLBACK")
        .execute(&mut *conn)
        .await
        .expect("rollback");
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(CHANNEL)
        .execute(&pool)
        .await
        .expect("marker");
    assert_eq!(
        next(&mut listener).await,
        "marker",
        "no NOTIFY from the commit"
    );

    sqlx::query("SELECT lanebus.wake()")
        .execute(&mut *conn)
        .await
        .expect("wake");
    let lanes: BTreeSet<u16> = ["k1", "k2"]
        .iter()
        .map(|k| lane_of_key(k, store.lanes()))
        .collect();
    let want: Vec<String> = lanes.iter().map(u16::to_string).collect();
    assert_eq!(next(&mut listener).await, want.join(","));

    // Nothing left to wake: a second call sends nothing.
    sqlx::query("SELECT lanebus.wake()")
        .execute(&mut *conn)
        .await
        .expect("wake");
    sqlx::query("SELECT pg_notify($1, 'marker2')")
        .bind(CHANNEL)
        .execute(&pool)
        .await
        .expect("marker");
    assert_eq!(next(&mut listener).await, "marker2", "nothing pending");
    drop(conn);
    drop(listener);
    common::drop_pg_database(&admin, pool, &db).await;
}

/// The event-type catalog through the SQL functions: an alias is stored as
/// the wire name and routed as the Rust path routes it (a route naming the
/// alias matches); a type with a JSON Schema is refused (the functions
/// cannot validate it); with the strict setting, so is an uncataloged type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_functions_honour_the_event_type_catalog() {
    use lanebus_store::{CatalogSettings, NewEventType};
    let db = format!("lanebus_sqlfn_catalog_{}", std::process::id());
    let (admin, store, pool) = common::fresh_pg_store(&db).await;
    let by_alias = store
        .create_handler(common::new_handler("old", &["payment.done"]))
        .await
        .expect("handler");
    store
        .create_event_type(NewEventType {
            name: "order.paid".into(),
            aliases: vec!["payment.done".into()],
            ..NewEventType::default()
        })
        .await
        .expect("type");
    store
        .create_event_type(NewEventType {
            name: "order.checked".into(),
            schema: Some(serde_json::json!({"type": "object"})),
            ..NewEventType::default()
        })
        .await
        .expect("type with schema");
    let mut conn = pool.acquire().await.expect("conn");
    let id = sql_publish(&mut conn, "payment.done", None, "{}")
        .await
        .expect("alias");
    let e = store
        .lookup_event(&id)
        .await
        .expect("lookup")
        .expect("stored");
    assert_eq!(e.event_type, "order.paid");
    let ds = common::claim_all(&store).await;
    assert!(
        ds.iter().any(|d| d.event_id == id
            && d.handler_id == by_alias.id
            && d.event_type == "order.paid"),
        "{ds:?}"
    );
    let (code, message) = sql_publish(&mut conn, "order.checked", None, "{}")
        .await
        .expect_err("a type with a schema");
    assert_eq!(code, "22023");
    assert!(message.contains("JSON Schema"), "{message}");
    sql_publish(&mut conn, "else.where", None, "{}")
        .await
        .expect("not strict");
    store
        .set_catalog_settings(CatalogSettings { strict: true })
        .await
        .expect("strict");
    let (code, message) = sql_publish(&mut conn, "else.where", None, "{}")
        .await
        .expect_err("strict");
    assert_eq!(code, "22023");
    assert!(message.contains("not in the catalog"), "{message}");
    drop(conn);
    common::drop_pg_database(&admin, pool, &db).await;
}
