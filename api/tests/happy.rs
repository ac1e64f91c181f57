//! Happy paths: publish, duplicates, handler CRUD, dead letters, admin,
//! metrics and health, and that the route table is served.

mod common;

use std::sync::atomic::Ordering;

use axum::http::{Method, StatusCode};
use common::{run_configured, run_with, Backend, StubNode, TestApp, TEST_LIMITS};
use lanebus_api::{LaneView, ROUTES};
use lanebus_store::{lane_of_event, Epoch, LaneClaim};
use serde_json::{json, Value};

async fn publish_returns_ids_and_counts(app: TestApp) {
    let res = app
        .post(
            "/v1/events",
            json!({"events": [
                {"id": "evt_1", "type": "issues.opened", "key": "repo-1", "payload": {"n": 1}},
                {"type": "issues.closed", "key": "repo-1", "payload": [1, 2]},
                {"type": "push", "payload": "text"},
            ]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(res.json["accepted"], 3);
    assert_eq!(res.json["duplicates"], 0);
    let ids: Vec<String> = res.json["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_str().expect("id").to_owned())
        .collect();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[0], "evt_1");
    assert!(
        ids[1] != ids[2] && ids[1].len() == 36,
        "generated ids: {ids:?}"
    );
    assert_eq!(app.store.counts().await.expect("counts").events, 3);

    let n = app.store.lanes();
    let mut lanes = vec![
        lane_of_event(Some("repo-1"), "", n),
        lane_of_event(None, &ids[2], n),
    ];
    lanes.sort_unstable();
    lanes.dedup();
    assert_eq!(*app.node.published.lock().expect("lock"), vec![lanes]);
}

async fn duplicates_are_reported_and_not_stored_again(app: TestApp) {
    let body = json!({"events": [{"id": "a", "type": "t", "payload": 1}, {"id": "b", "type": "t", "payload": 2}]});
    let res = app.post("/v1/events", body).await;
    assert_eq!(
        (res.json["accepted"].clone(), res.json["duplicates"].clone()),
        (json!(2), json!(0)),
        "{res:?}"
    );
    let res = app
        .post("/v1/events", json!({"events": [{"id": "a", "type": "t", "payload": 1}, {"id": "c", "type": "t", "payload": 3}]}))
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(res.json["accepted"], 1);
    assert_eq!(res.json["duplicates"], 1);
    assert_eq!(res.json["ids"], json!(["a", "c"]));
    assert_eq!(app.store.counts().await.expect("counts").events, 3);
}

/// Concurrent publishes (written in groups by the store): each caller gets
/// its own ids and counts, and the one with a bad event its own 422 with
/// nothing of its batch stored.
async fn concurrent_publishes_each_get_their_own_answer(app: TestApp) {
    const CALLERS: usize = 24;
    const BAD: usize = 5;
    let calls = (0..CALLERS).map(|c| {
        let mut events = vec![
            json!({"id": format!("e{c}"), "type": "t", "key": format!("k{}", c % 3), "payload": c}),
        ];
        if c == BAD {
            events.push(json!({"id": "has space", "type": "t", "payload": 0}));
        }
        app.post("/v1/events", json!({ "events": events }))
    });
    let answers = futures::future::join_all(calls).await;
    for (c, res) in answers.iter().enumerate() {
        if c == BAD {
            assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY, "{res:?}");
            assert_eq!(res.json["error"]["code"], "invalid_event", "{res:?}");
            continue;
        }
        assert_eq!(res.status, StatusCode::ACCEPTED, "caller {c}: {res:?}");
        assert_eq!(res.json["ids"], json!([format!("e{c}")]), "caller {c}");
        assert_eq!(
            (res.json["accepted"].clone(), res.json["duplicates"].clone()),
            (json!(1), json!(0))
        );
    }
    let stored = app.store.counts().await.expect("counts").events;
    assert_eq!(
        stored,
        (CALLERS - 1) as i64,
        "everyone's event but the refused batch's"
    );
}

async fn payload_is_stored_byte_for_byte(app: TestApp) {
    app.create_handler("all", &["*"]).await;
    let payload = r#"{"z" : 1,"a":[1, 2.50, "é\u00e9"],  "n":null}"#;
    let body = format!(
        r#"{{"events":[{{"id":"raw-1","type":"t.raw","key":"raw","payload":{payload}}}]}}"#
    );
    let res = app
        .call(
            Method::POST,
            "/v1/events",
            Some("application/json"),
            body.into_bytes(),
        )
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    let lane = lane_of_event(Some("raw"), "", app.store.lanes());
    assert!(app
        .store
        .fence(lane, "test", Epoch(1))
        .await
        .expect("fence"));
    let batches = app
        .store
        .claim(&[LaneClaim {
            lane,
            epoch: Epoch(1),
            after: Default::default(),
            limit: 10,
        }])
        .await
        .expect("claim");
    let delivery = batches
        .iter()
        .flat_map(|b| &b.deliveries)
        .next()
        .expect("one delivery");
    assert_eq!(&delivery.payload[..], payload.as_bytes());
}

async fn handler_crud_round_trips(app: TestApp) {
    let secret = format!("whsec_{}", "QUJD".repeat(8)); // base64 of 24 bytes
    let res = app
        .post(
            "/v1/handlers",
            json!({"name": "billing", "url": "https://example.com/hooks?x=1", "event_types": ["invoice.*", "push"],
                   "max_attempts": 3, "timeout_ms": 2500, "max_in_flight": 7, "secret": secret}),
        )
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
    let h = res.json.clone();
    assert!(
        h["id"].as_str().is_some_and(|id| id.starts_with("hdl_")),
        "{h}"
    );
    assert_eq!(h["name"], "billing");
    assert_eq!(h["url"], "https://example.com/hooks?x=1");
    assert_eq!(h["event_types"], json!(["invoice.*", "push"]));
    assert_eq!(
        (
            h["max_attempts"].clone(),
            h["timeout_ms"].clone(),
            h["max_in_flight"].clone()
        ),
        (json!(3), json!(2500), json!(7))
    );
    assert_eq!(h["secret"], secret.as_str());
    assert_eq!(h["state"], "enabled");
    assert!(h["created_at"].is_string(), "{h}");

    let res = app
        .post(
            "/v1/handlers",
            json!({"name": "defaults", "url": "http://203.0.113.10:8080/", "event_types": ["*"]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::CREATED, "{res:?}");
    let d = res.json.clone();
    assert!(
        lanebus_api::handlers::validate_secret(d["secret"].as_str().expect("secret")).is_ok(),
        "{d}"
    );
    assert_eq!(
        (
            d["max_attempts"].clone(),
            d["timeout_ms"].clone(),
            d["max_in_flight"].clone()
        ),
        (json!(8), json!(10_000), json!(64))
    );

    let id = h["id"].as_str().expect("id");
    let got = app.get(&format!("/v1/handlers/{id}")).await;
    assert_eq!((got.status, &got.json), (StatusCode::OK, &h));
    let list = app.get("/v1/handlers").await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(list.json["handlers"], json!([h, d]));

    let del = app.delete(&format!("/v1/handlers/{id}")).await;
    assert_eq!(del.status, StatusCode::OK, "{del:?}");
    assert_eq!(
        del.json,
        json!({"deleted": id, "discarded_deliveries": 0, "discarded_dead_letters": 0})
    );
    let gone = app.get(&format!("/v1/handlers/{id}")).await;
    assert_eq!(
        (gone.status, gone.json["error"]["code"].clone()),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );
    assert_eq!(app.get("/v1/handlers").await.json["handlers"], json!([d]));
    assert_eq!(app.node.handlers_changed.load(Ordering::SeqCst), 3);
}

async fn delete_discards_and_counts_pending_deliveries(app: TestApp) {
    let orders = app.create_handler("orders", &["order.*"]).await;
    let other = app.create_handler("other", &["push"]).await;
    // Two dead letters of `orders` first (made before the other events, so
    // they alone are claimed and dead-lettered).
    assert_eq!(app.make_dead_letters("order.failed", "dl-key", 2).await, 2);
    let events: Vec<Value> = (0..3)
        .map(|i| json!({"type": "order.placed", "key": format!("o{i}"), "payload": i}))
        .chain([json!({"type": "push", "payload": 0})])
        .collect();
    let res = app.post("/v1/events", json!({ "events": events })).await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(app.store.counts().await.expect("counts").deliveries, 4);
    let del = app.delete(&format!("/v1/handlers/{orders}")).await;
    assert_eq!(
        del.json,
        json!({"deleted": orders, "discarded_deliveries": 3, "discarded_dead_letters": 2}),
        "{del:?}"
    );
    let counts = app.store.counts().await.expect("counts");
    assert_eq!(
        (counts.events, counts.deliveries, counts.dead_letters),
        (6, 1, 0)
    );
    let listed = app.get("/admin/dead-letters").await;
    assert_eq!(listed.json["dead_letters"], json!([]), "{listed:?}");
    assert_eq!(
        app.get(&format!("/v1/handlers/{other}")).await.status,
        StatusCode::OK
    );
}

async fn dead_letters_list_page_and_replay(app: TestApp) {
    let hid = app.create_handler("dl", &["dl.*"]).await;
    let other = app.create_handler("dl-other", &["zz.*"]).await;
    assert_eq!(app.make_dead_letters("dl.x", "dl-key", 3).await, 3);

    let all = app.get("/admin/dead-letters").await;
    assert_eq!(all.status, StatusCode::OK, "{all:?}");
    let letters = all.json["dead_letters"]
        .as_array()
        .expect("dead_letters")
        .clone();
    assert_eq!(letters.len(), 3);
    assert_eq!(all.json["next_after"], Value::Null);
    let first = &letters[0];
    assert_eq!(
        (first["handler_id"].as_str(), first["event_type"].as_str()),
        (Some(hid.as_str()), Some("dl.x"))
    );
    assert_eq!(
        (first["attempts"].clone(), first["last_error"].clone()),
        (json!(3), json!("boom"))
    );
    let ids: Vec<i64> = letters
        .iter()
        .map(|l| l["id"].as_i64().expect("id"))
        .collect();

    let page = app.get("/admin/dead-letters?limit=2").await;
    assert_eq!(page.json["dead_letters"].as_array().map(Vec::len), Some(2));
    assert_eq!(page.json["next_after"], json!(ids[1]));
    let rest = app
        .get(&format!("/admin/dead-letters?limit=2&after={}", ids[1]))
        .await;
    assert_eq!(
        rest.json["dead_letters"][0]["id"],
        json!(ids[2]),
        "{rest:?}"
    );
    assert_eq!(rest.json["next_after"], Value::Null);
    let filtered = app
        .get(&format!("/admin/dead-letters?handler_id={other}"))
        .await;
    assert_eq!(filtered.json["dead_letters"], json!([]), "{filtered:?}");
    let filtered = app
        .get(&format!("/admin/dead-letters?handler_id={hid}"))
        .await;
    assert_eq!(
        filtered.json["dead_letters"].as_array().map(Vec::len),
        Some(3)
    );

    let before = app.store.counts().await.expect("counts");
    let one = app
        .call(
            Method::POST,
            &format!("/admin/dead-letters/{}/replay", ids[0]),
            None,
            Vec::new(),
        )
        .await;
    assert_eq!(
        (one.status, one.json.clone()),
        (StatusCode::OK, json!({"replayed": 1})),
        "{one:?}"
    );
    let after = app.store.counts().await.expect("counts");
    assert_eq!(
        (after.dead_letters, after.deliveries),
        (before.dead_letters - 1, before.deliveries + 1)
    );
    let again = app
        .call(
            Method::POST,
            &format!("/admin/dead-letters/{}/replay", ids[0]),
            None,
            Vec::new(),
        )
        .await;
    assert_eq!(
        (again.status, again.json["error"]["code"].clone()),
        (StatusCode::NOT_FOUND, json!("not_found"))
    );

    let by_id = app
        .post(
            "/admin/dead-letters/replay",
            json!({"ids": [ids[1], 999_999]}),
        )
        .await;
    assert_eq!(
        (by_id.status, by_id.json.clone()),
        (StatusCode::OK, json!({"replayed": 1})),
        "{by_id:?}"
    );
    let by_handler = app
        .post("/admin/dead-letters/replay", json!({"handler_id": hid}))
        .await;
    assert_eq!(
        (by_handler.status, by_handler.json.clone()),
        (StatusCode::OK, json!({"replayed": 1})),
        "{by_handler:?}"
    );
    let counts = app.store.counts().await.expect("counts");
    assert_eq!(
        (counts.dead_letters, counts.deliveries),
        (0, before.deliveries + 3)
    );
    assert_eq!(app.node.handlers_changed.load(Ordering::SeqCst), 2 + 3);
}

async fn every_route_in_the_table_is_served(app: TestApp) {
    for spec in ROUTES {
        let path = spec.path.replace("{id}", "1");
        let res = app.call(spec.method.clone(), &path, None, Vec::new()).await;
        let code = res.json["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(
            code != "path_not_found" && code != "method_not_allowed",
            "{} {} ({}) is not served: {res:?}",
            spec.method,
            spec.path,
            spec.operation.id()
        );
    }
}

/// Fences the lane of ordering key `key` at epoch 1 and claims its
/// deliveries: the lane and what the claim returned.
async fn claim_lane_of(
    store: &dyn lanebus_store::Store,
    key: &str,
) -> (lanebus_store::Lane, Vec<lanebus_store::Delivery>) {
    let lane = lane_of_event(Some(key), "", store.lanes());
    assert!(store.fence(lane, "test", Epoch(1)).await.expect("fence"));
    let claimed = store
        .claim(&[LaneClaim {
            lane,
            epoch: Epoch(1),
            after: Default::default(),
            limit: 100,
        }])
        .await
        .expect("claim");
    let deliveries = claimed.into_iter().flat_map(|b| b.deliveries).collect();
    (lane, deliveries)
}

/// `GET /v1/events/{id}`: pending (after a failed attempt), completed and
/// dead-lettered deliveries of one event, and 404 for an unknown id or one
/// that is no event id.
async fn event_lookup_shows_each_handlers_delivery(app: TestApp) {
    use lanebus_store::{DeadLetterRequest, DeliveryRef, Reschedule};
    let waiting = app.create_handler("waiting", &["order.*"]).await;
    let done = app.create_handler("done", &["order.*"]).await;
    let dead = app.create_handler("dead", &["order.paid"]).await;
    app.create_handler("unrelated", &["user.*"]).await;
    let res = app
        .post(
            "/v1/events",
            json!({"events": [{"id": "ord-7", "type": "order.paid", "key": "o7", "payload": {"total": 12}}]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    let store = &app.store;
    let (lane, claimed) = claim_lane_of(&**store, "o7").await;
    let of = |handler: &str| {
        claimed
            .iter()
            .find(|d| d.handler_id == handler)
            .expect("delivery")
            .clone()
    };
    let published_at = of(&waiting).published_at;
    let due = chrono::DateTime::from_timestamp(4_102_444_800, 0).expect("2100-01-01");
    let at = chrono::DateTime::from_timestamp(1_780_000_000, 250_000_000).expect("time");
    let w = of(&waiting);
    let r = Reschedule {
        id: w.id,
        lane,
        epoch: Epoch(1),
        attempts: 1,
        due_at: due,
        last_error: "HTTP 500".into(),
        failure: Some(lanebus_store::FailedAttempt {
            attempt: 1,
            at,
            status: Some(500),
            error: None,
            duration_ms: 31,
            body: Some("{\"error\":\"database down\"}".into()),
            body_withheld: false,
        }),
    };
    assert_eq!(store.reschedule(&[r]).await.expect("reschedule").len(), 1);
    let d = of(&done);
    let r = DeliveryRef {
        id: d.id,
        lane,
        epoch: Epoch(1),
        attempts: 2,
    };
    assert_eq!(store.complete(&[r]).await.expect("complete").len(), 1);
    let x = of(&dead);
    let r = DeadLetterRequest {
        id: x.id,
        lane,
        epoch: Epoch(1),
        attempts: 3,
        last_error: "HTTP 404".into(),
        failure: Some(lanebus_store::FailedAttempt {
            attempt: 3,
            at,
            status: None,
            error: Some(lanebus_store::AttemptError::SsrfGuard),
            duration_ms: 0,
            body: None,
            body_withheld: false,
        }),
    };
    assert_eq!(store.dead_letter(&[r]).await.expect("dead letter").len(), 1);

    let res = app.get("/v1/events/ord-7").await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    let mut body = res.json.clone();
    let time = |v: &Value| {
        chrono::DateTime::parse_from_rfc3339(v.as_str().expect("a time"))
            .expect("RFC 3339")
            .with_timezone(&chrono::Utc)
    };
    assert_eq!(time(&body["published_at"]), published_at);
    for h in body["handlers"].as_array_mut().expect("handlers") {
        let field = match h["state"].as_str() {
            Some("pending") => "next_attempt_at",
            Some("completed") => "completed_at",
            _ => "failed_at",
        };
        let at = time(&h[field]);
        if field == "next_attempt_at" {
            assert_eq!(at, due);
        } else {
            assert!(at >= published_at, "{h}");
        }
        h[field] = json!("checked");
    }
    body["published_at"] = json!("checked");
    let mut want = json!({
        "id": "ord-7", "type": "order.paid", "key": "o7", "seq": 1, "lane": lane,
        "published_at": "checked", "payload_bytes": r#"{"total":12}"#.len(),
        "handlers": [
            {"handler_id": waiting, "handler_name": "waiting", "state": "pending",
             "attempts": 1, "next_attempt_at": "checked", "last_error": "HTTP 500",
             "completed_at": null, "failed_at": null,
             "attempt_log": [{"attempt": 1, "at": "2026-05-28T20:26:40.250Z", "status": 500,
                              "error": null, "duration_ms": 31,
                              "body": "{\"error\":\"database down\"}",
                              "body_withheld": false}]},
            {"handler_id": done, "handler_name": "done", "state": "completed",
             "attempts": 2, "next_attempt_at": null, "last_error": null,
             "completed_at": "checked", "failed_at": null, "attempt_log": []},
            {"handler_id": dead, "handler_name": "dead", "state": "dead_lettered",
             "attempts": 3, "next_attempt_at": null, "last_error": "HTTP 404",
             "completed_at": null, "failed_at": "checked",
             "attempt_log": [{"attempt": 3, "at": "2026-05-28T20:26:40.250Z", "status": null,
                              "error": "ssrf_guard", "duration_ms": 0, "body": null,
                              "body_withheld": false}]},
        ]
    });
    // Entries come by handler id; handler ids are UUIDv7s in creation
    // order, but sort to not depend on it.
    want["handlers"]
        .as_array_mut()
        .expect("handlers")
        .sort_by_key(|h| h["handler_id"].as_str().unwrap_or_default().to_owned());
    assert_eq!(body, want);

    for path in [
        "/v1/events/ord-8",
        "/v1/events/%20spaced",
        "/v1/events/ord%FF",
    ] {
        let res = app.get(path).await;
        let code = if path.ends_with("%FF") {
            "invalid_parameter"
        } else {
            "not_found"
        };
        assert_eq!(res.json["error"]["code"], code, "{path}: {res:?}");
    }
    let res = app.get("/v1/events/ord-8").await;
    assert_eq!(res.status, StatusCode::NOT_FOUND);
    assert_eq!(
        res.json["error"]["message"],
        "event \"ord-8\" not found: never published, or pruned past the retention period; its \
         id carries no time (a UUIDv7, as lanebus generates, does; one the publisher chose does \
         not), so the two cannot be told apart"
    );
}

/// `GET /v1/events/{id}` of an event delivered and pruned: `410 pruned`
/// when its id was generated (a UUIDv7) before the retention period began;
/// `404 not_found` for an id the publisher chose (pruned or never
/// published: cannot be told apart), for a UUIDv7 from within the period
/// (never published), and when the node does not say its retention.
async fn event_lookup_tells_a_pruned_event(app: TestApp) {
    use lanebus_store::DeliveryRef;
    use std::time::Duration;
    app.create_handler("h", &["order.*"]).await;
    let res = app
        .post(
            "/v1/events",
            json!({"events": [
                {"type": "order.paid", "key": "o9", "payload": {}},
                {"id": "ord-9", "type": "order.paid", "key": "o9", "payload": {}},
            ]}),
        )
        .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    let generated = res.json["ids"][0].as_str().expect("id").to_owned();
    let made = lanebus_store::event_id_time(&generated).expect("a UUIDv7");
    let store = &app.store;
    let (lane, claimed) = claim_lane_of(&**store, "o9").await;
    let done: Vec<DeliveryRef> = claimed
        .iter()
        .map(|d| DeliveryRef {
            id: d.id,
            lane,
            epoch: Epoch(1),
            attempts: 1,
        })
        .collect();
    assert_eq!(store.complete(&done).await.expect("complete").len(), 2);
    for id in [generated.as_str(), "ord-9"] {
        let res = app.get(&format!("/v1/events/{id}")).await;
        assert_eq!(res.status, StatusCode::OK, "{id}: {res:?}");
    }
    // Retention of both (the node's pass, by hand; the SQL stores prune
    // only events published two minutes before the cutoff).
    let cutoff = store.now().await.expect("now") + chrono::Duration::minutes(3);
    assert_eq!(store.prune(cutoff, 100).await.expect("prune").events, 2);

    // A node without a retention period: 404, as before.
    let res = app.get(&format!("/v1/events/{generated}")).await;
    assert_eq!(res.status, StatusCode::NOT_FOUND, "{res:?}");
    let message = res.json["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("does not say its retention period"),
        "{message}"
    );

    // A retention period that began after the id was made: 410. (A
    // retention of zero, so that the test need not wait for one to pass.)
    while store.now().await.expect("now") <= made + chrono::Duration::milliseconds(1) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    *app.node.retention.lock().expect("lock") = Some(Duration::ZERO);
    let res = app.get(&format!("/v1/events/{generated}")).await;
    assert_eq!(res.status, StatusCode::GONE, "{res:?}");
    assert_eq!(res.json["error"]["code"], "pruned", "{res:?}");
    let message = res.json["error"]["message"].as_str().expect("message");
    let want = format!(
        "event \"{generated}\" was pruned: its id dates from {}, before the retention period \
         (0 s) began at ",
        made.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    );
    assert!(message.starts_with(&want), "{message}\nwant {want}...");

    // The chosen id, pruned as well: cannot be told from one never
    // published.
    *app.node.retention.lock().expect("lock") = Some(Duration::from_secs(86_400));
    for id in ["ord-9", "ord-never"] {
        let res = app.get(&format!("/v1/events/{id}")).await;
        assert_eq!(res.status, StatusCode::NOT_FOUND, "{res:?}");
        assert_eq!(res.json["error"]["code"], "not_found", "{res:?}");
        let message = res.json["error"]["message"].as_str().expect("message");
        assert!(message.contains("cannot be told apart"), "{message}");
    }
    // A UUIDv7 of now, never published: within the retention period.
    let never = lanebus_store::generate_event_id();
    let res = app.get(&format!("/v1/events/{never}")).await;
    assert_eq!(res.status, StatusCode::NOT_FOUND, "{res:?}");
    let message = res.json["error"]["message"].as_str().expect("message");
    assert!(
        message.contains("never published; its id dates from")
            && message.ends_with("within the retention period (24 h), so it was not pruned"),
        "{message}"
    );
}

/// `GET /v1/handlers/{id}/deliveries`: each state newest first with its
/// fields, paging by `next_after`, the key filter, another handler's rows
/// apart, and the 400s and 404s.
async fn handler_deliveries_page_each_state(app: TestApp) {
    use lanebus_store::{DeadLetterRequest, DeliveryRef};
    let mine = app.create_handler("mine", &["order.*"]).await;
    let other = app.create_handler("other", &["order.*"]).await;
    for (id, key) in [("ord-1", "o1"), ("ord-2", "o2"), ("ord-3", "o1")] {
        let res = app
            .post(
                "/v1/events",
                json!({"events": [{"id": id, "type": "order.paid", "key": key, "payload": {}}]}),
            )
            .await;
        assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    }
    let store = &app.store;
    let mut lanes: Vec<u16> = ["o1", "o2"]
        .iter()
        .map(|k| lane_of_event(Some(k), "", store.lanes()))
        .collect();
    lanes.dedup();
    let mut claims = Vec::new();
    for &lane in &lanes {
        assert!(store.fence(lane, "test", Epoch(1)).await.expect("fence"));
        claims.push(LaneClaim {
            lane,
            epoch: Epoch(1),
            after: Default::default(),
            limit: 100,
        });
    }
    let claimed: Vec<_> = store
        .claim(&claims)
        .await
        .expect("claim")
        .into_iter()
        .flat_map(|b| b.deliveries)
        .collect();
    let of = |event: &str| {
        claimed
            .iter()
            .find(|d| d.handler_id == mine && d.event_id == event)
            .expect("delivery")
            .clone()
    };
    let x = of("ord-1");
    let r = DeadLetterRequest {
        id: x.id,
        lane: x.lane,
        epoch: Epoch(1),
        attempts: 4,
        last_error: "HTTP 404".into(),
        failure: Some(lanebus_store::FailedAttempt {
            attempt: 4,
            at: chrono::DateTime::from_timestamp(1_780_000_000, 0).expect("time"),
            status: Some(404),
            error: None,
            duration_ms: 12,
            body: Some("no such route".into()),
            body_withheld: false,
        }),
    };
    assert_eq!(store.dead_letter(&[r]).await.expect("dead letter").len(), 1);
    let d = of("ord-2");
    let r = DeliveryRef {
        id: d.id,
        lane: d.lane,
        epoch: Epoch(1),
        attempts: 2,
    };
    assert_eq!(store.complete(&[r]).await.expect("complete").len(), 1);
    let p = of("ord-3");
    let base = format!("/v1/handlers/{mine}/deliveries");

    let res = app.get(&base).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    let at = p
        .due_at
        .to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
    let want = json!({"deliveries": [
        {"event_id": "ord-3", "type": "order.paid", "key": "o1", "seq": 2, "lane": p.lane,
         "state": "pending", "attempts": 0, "next_attempt_at": at, "last_error": null,
         "completed_at": null, "failed_at": null, "dead_letter_id": null, "attempt_log": []}
    ], "next_after": null});
    let mut got = res.json.clone();
    let due = chrono::DateTime::parse_from_rfc3339(
        got["deliveries"][0]["next_attempt_at"]
            .as_str()
            .expect("time"),
    )
    .expect("RFC 3339");
    assert_eq!(due, p.due_at);
    got["deliveries"][0]["next_attempt_at"] = json!(at);
    assert_eq!(got, want);

    let res = app.get(&format!("{base}?state=dead")).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    let dead = &res.json["deliveries"];
    assert_eq!(dead.as_array().map(Vec::len), Some(1), "{res:?}");
    let dl = store
        .list_dead_letters(&lanebus_store::DeadLetterFilter {
            handler_id: Some(mine.clone()),
            after_id: None,
            limit: 10,
        })
        .await
        .expect("dead letters");
    assert_eq!(
        (
            &dead[0]["event_id"],
            &dead[0]["state"],
            &dead[0]["attempts"],
            &dead[0]["last_error"],
            &dead[0]["dead_letter_id"],
            &dead[0]["seq"]
        ),
        (
            &json!("ord-1"),
            &json!("dead_lettered"),
            &json!(4),
            &json!("HTTP 404"),
            &json!(dl[0].id),
            &json!(1)
        )
    );
    assert!(dead[0]["failed_at"].is_string() && dead[0]["next_attempt_at"].is_null());
    assert_eq!(
        dead[0]["attempt_log"],
        json!([{"attempt": 4, "at": "2026-05-28T20:26:40Z", "status": 404, "error": null,
                "duration_ms": 12, "body": "no such route", "body_withheld": false}])
    );

    let res = app.get(&format!("{base}?state=completed&limit=1000")).await;
    assert_eq!(res.status, StatusCode::OK, "{res:?}");
    let done = &res.json["deliveries"];
    assert_eq!(done.as_array().map(Vec::len), Some(1), "{res:?}");
    assert_eq!(
        (
            &done[0]["event_id"],
            &done[0]["state"],
            &done[0]["attempts"],
            &done[0]["key"],
            &done[0]["dead_letter_id"]
        ),
        (
            &json!("ord-2"),
            &json!("completed"),
            &json!(2),
            &json!("o2"),
            &Value::Null
        )
    );
    assert!(done[0]["completed_at"].is_string(), "{res:?}");
    assert_eq!(done[0]["attempt_log"], json!([]));

    // The other handler: three pending, two pages of two; then one key.
    let theirs = format!("/v1/handlers/{other}/deliveries");
    let events = |res: &common::Res| -> Vec<String> {
        res.json["deliveries"]
            .as_array()
            .expect("deliveries")
            .iter()
            .map(|d| d["event_id"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let first = app.get(&format!("{theirs}?state=pending&limit=2")).await;
    assert_eq!(events(&first), ["ord-3", "ord-2"], "{first:?}");
    let after = first.json["next_after"]
        .as_str()
        .expect("a cursor")
        .to_owned();
    let second = app.get(&format!("{theirs}?limit=2&after={after}")).await;
    assert_eq!(events(&second), ["ord-1"], "{second:?}");
    assert_eq!(second.json["next_after"], Value::Null);
    let keyed = app.get(&format!("{theirs}?key=o1")).await;
    assert_eq!(events(&keyed), ["ord-3", "ord-1"], "{keyed:?}");

    let unknown = "/v1/handlers/hdl_0123456789abcdef0123456789abcdef/deliveries";
    for (path, status, code) in [
        (format!("{base}?limit=0"), 400, "invalid_parameter"),
        (format!("{base}?limit=1001"), 400, "invalid_parameter"),
        (format!("{base}?state=failed"), 400, "invalid_parameter"),
        (format!("{base}?after=%21%21"), 400, "invalid_parameter"),
        (
            format!("{base}?state=dead&after={after}"),
            400,
            "invalid_parameter",
        ),
        (format!("{base}?page=2"), 400, "invalid_parameter"),
        (format!("{base}?key=a%00b"), 400, "invalid_parameter"),
        (format!("{base}?key="), 400, "invalid_parameter"),
        (unknown.to_owned(), 404, "not_found"),
        ("/v1/handlers/nope/deliveries".to_owned(), 404, "not_found"),
    ] {
        let res = app.get(&path).await;
        assert_eq!(res.status.as_u16(), status, "{path}: {res:?}");
        assert_eq!(res.json["error"]["code"], code, "{path}: {res:?}");
    }
}

async fn health_and_metrics(app: TestApp) {
    let res = app.get("/healthz").await;
    assert_eq!(
        (res.status, res.json.clone()),
        (StatusCode::OK, json!({"status": "ok"}))
    );
    let res = app.get("/readyz").await;
    assert_eq!(
        (res.status, res.json.clone()),
        (StatusCode::OK, json!({"status": "ready"})),
        "{res:?}"
    );
    let res = app.get("/metrics").await;
    assert_eq!(res.status, StatusCode::OK);
    assert_eq!(
        res.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/plain; version=0.0.4")
    );
    assert!(String::from_utf8_lossy(&res.bytes).contains("lanebus_up 1"));

    app.node.not_ready.store(true, Ordering::SeqCst);
    let res = app.get("/readyz").await;
    assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE, "{res:?}");
    assert_eq!(res.json["error"]["code"], "not_ready");
    // The node's reason is in the message.
    let message = res.json["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.ends_with("is not ready: the stub says so"),
        "{message}"
    );
}

/// A key as an event stream: a publish with `expected_seq` is stored only
/// at the key's sequence it expects; otherwise `409 conflict` names where
/// the key stands, and nothing of the batch is stored.
async fn expected_seq_conflicts_answer_where_the_key_stands(app: TestApp) {
    let publish = |events: Value| app.post("/v1/events", json!({ "events": events }));
    let res = publish(json!([
        {"id": "o1", "type": "order.placed", "key": "order-7", "payload": 1, "expected_seq": 0},
        {"id": "o2", "type": "order.paid", "key": "order-7", "payload": 2, "expected_seq": 1},
    ]))
    .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    // A writer that read the stream before o1 and o2.
    let res = publish(json!([
        {"id": "x1", "type": "order.cancelled", "key": "order-7", "payload": 3, "expected_seq": 0},
        {"id": "x2", "type": "other", "key": "other", "payload": 4},
    ]))
    .await;
    assert_eq!(res.status, StatusCode::CONFLICT, "{res:?}");
    let err = &res.json["error"];
    assert_eq!(err["code"], "conflict");
    assert_eq!(
        (
            &err["key"],
            &err["expected_seq"],
            &err["current_seq"],
            &err["event_index"]
        ),
        (&json!("order-7"), &json!(0), &json!(2), &json!(0)),
        "{res:?}"
    );
    assert_eq!(app.store.counts().await.expect("counts").events, 2);
    // Retried at the current sequence: stored as the key's third event.
    let res = publish(json!([
        {"id": "x1", "type": "order.cancelled", "key": "order-7", "payload": 3, "expected_seq": 2},
    ]))
    .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    let res = app.get("/v1/events/x1").await;
    assert_eq!(res.json["seq"], 3, "{res:?}");
    // A retry of a stored event is a duplicate, its expectation not checked.
    let res = publish(json!([
        {"id": "x1", "type": "order.cancelled", "key": "order-7", "payload": 3, "expected_seq": 2},
    ]))
    .await;
    assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
    assert_eq!(res.json["duplicates"], 1);
    // A later event of the batch that expects the key's number before the
    // batch, not after its earlier event: the answer names that event.
    let res = publish(json!([
        {"id": "y1", "type": "order.refunded", "key": "order-7", "payload": 5, "expected_seq": 3},
        {"id": "y2", "type": "order.closed", "key": "order-7", "payload": 6, "expected_seq": 3},
    ]))
    .await;
    assert_eq!(res.status, StatusCode::CONFLICT, "{res:?}");
    let err = &res.json["error"];
    assert_eq!(
        (
            &err["expected_seq"],
            &err["current_seq"],
            &err["event_index"]
        ),
        (&json!(3), &json!(3), &json!(1)),
        "{res:?}"
    );
    let message = err["message"].as_str().unwrap_or_default();
    assert!(message.contains("put the key at 4"), "{message}");
    assert_eq!(app.store.counts().await.expect("counts").events, 3);
    // Without a key there is no sequence to expect; nor below 0.
    for (event, says) in [
        (
            json!({"type": "t", "payload": 1, "expected_seq": 0}),
            "needs a key",
        ),
        (
            json!({"type": "t", "key": "k", "payload": 1, "expected_seq": -1}),
            "0 or more",
        ),
    ] {
        let res = publish(json!([event])).await;
        assert_eq!(res.status, StatusCode::UNPROCESSABLE_ENTITY, "{res:?}");
        assert_eq!(res.json["error"]["code"], "invalid_event");
        let message = res.json["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("events[0]: expected_seq"), "{message}");
        assert!(message.contains(says), "{message}");
    }
}

on_every_backend!(
    expected_seq_conflicts_answer_where_the_key_stands,
    publish_returns_ids_and_counts,
    duplicates_are_reported_and_not_stored_again,
    concurrent_publishes_each_get_their_own_answer,
    payload_is_stored_byte_for_byte,
    handler_crud_round_trips,
    delete_discards_and_counts_pending_deliveries,
    dead_letters_list_page_and_replay,
    every_route_in_the_table_is_served,
    health_and_metrics,
    event_lookup_shows_each_handlers_delivery,
    event_lookup_tells_a_pruned_event,
    handler_deliveries_page_each_state,
);

fn lane(lane: u16, owner: Option<&str>) -> LaneView {
    LaneView {
        lane,
        owner: owner.map(str::to_owned),
        epoch: Epoch(4),
        state: if owner.is_some() {
            "active"
        } else {
            "unassigned"
        }
        .into(),
        lease_expires_in_ms: owner.map(|_| 1_500),
        backlog: 2,
        in_flight: 1,
    }
}

async fn admin_lanes_and_cluster(backend: Backend) {
    let node = StubNode {
        lanes: vec![lane(0, Some("n1")), lane(1, Some("n1")), lane(2, None)],
        ..StubNode::default()
    };
    run_with(backend, TEST_LIMITS, node, |app| async move {
        let res = app.get("/admin/lanes").await;
        assert_eq!(res.status, StatusCode::OK, "{res:?}");
        assert_eq!(
            res.json["lanes"][0],
            json!({"lane": 0, "owner": "n1", "epoch": 4, "state": "active", "lease_expires_in_ms": 1500, "backlog": 2, "in_flight": 1})
        );
        assert_eq!(res.json["lanes"].as_array().map(Vec::len), Some(3));
        let res = app.get("/admin/cluster").await;
        assert_eq!(
            res.json,
            json!({"node_id": "n1", "leader": "n1", "term": 0, "nodes": [
                {"id": "n1", "raft_addr": null, "http_addr": null, "voter": true, "alive": true, "lanes": 2}
            ]})
        );
    })
    .await;
}

/// A lane table read from a store that does not answer is a `503`, not an
/// empty table.
#[tokio::test]
async fn admin_lanes_without_the_store_is_503() {
    let node = StubNode {
        lanes_error: Some("pool timed out".into()),
        ..StubNode::default()
    };
    run_with(Backend::Sqlite, TEST_LIMITS, node, |app| async move {
        let res = app.get("/admin/lanes").await;
        assert_eq!(res.status, StatusCode::SERVICE_UNAVAILABLE, "{res:?}");
        assert_eq!(res.json["error"]["code"], "store_unavailable", "{res:?}");
    })
    .await;
}

/// A store that takes every call and never answers (a stalled server).
mod stalled {
    use async_trait::async_trait;
    use lanebus_store::*;
    use std::future::pending;

    pub struct Stalled;

    #[async_trait]
    impl Store for Stalled {
        fn backend(&self) -> &'static str {
            "stalled"
        }
        fn lanes(&self) -> u16 {
            DEFAULT_LANES
        }
        async fn publish(&self, _: Vec<NewEvent>) -> Result<PublishOutcome> {
            pending().await
        }
        async fn create_event_type(&self, _: NewEventType) -> Result<EventType> {
            pending().await
        }
        async fn list_event_types(&self) -> Result<Vec<EventType>> {
            pending().await
        }
        async fn update_event_type(&self, _: &str, _: &EventTypePatch) -> Result<EventType> {
            pending().await
        }
        async fn catalog_settings(&self) -> Result<CatalogSettings> {
            pending().await
        }
        async fn set_catalog_settings(&self, _: CatalogSettings) -> Result<CatalogSettings> {
            pending().await
        }
        async fn fence(&self, _: Lane, _: &str, _: Epoch) -> Result<bool> {
            pending().await
        }
        async fn claim(&self, _: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
            pending().await
        }
        async fn complete(&self, _: &[DeliveryRef]) -> Result<Vec<i64>> {
            pending().await
        }
        async fn reschedule(&self, _: &[Reschedule]) -> Result<Vec<i64>> {
            pending().await
        }
        async fn dead_letter(&self, _: &[DeadLetterRequest]) -> Result<Vec<i64>> {
            pending().await
        }
        async fn create_handler(&self, _: NewHandler) -> Result<Handler> {
            pending().await
        }
        async fn list_handlers(&self) -> Result<Vec<Handler>> {
            pending().await
        }
        async fn get_handler(&self, _: &str) -> Result<Handler> {
            pending().await
        }
        async fn delete_handler(&self, _: &str) -> Result<DeletedHandler> {
            pending().await
        }
        async fn list_dead_letters(&self, _: &DeadLetterFilter) -> Result<Vec<DeadLetter>> {
            pending().await
        }
        async fn replay_dead_letters(&self, _: &[i64], _: Option<&str>) -> Result<u64> {
            pending().await
        }
        async fn discard(&self, _: &[DeliveryRef]) -> Result<Vec<i64>> {
            pending().await
        }
        async fn change_handler_state(
            &self,
            _: &str,
            _: HandlerState,
            _: &str,
        ) -> Result<StateChange> {
            pending().await
        }
        async fn update_handler(&self, _: &str, _: &HandlerPatch) -> Result<Handler> {
            pending().await
        }
        async fn rotate_handler_secret(
            &self,
            _: &str,
            _: &str,
            _: chrono::DateTime<chrono::Utc>,
        ) -> Result<Handler> {
            pending().await
        }
        async fn mark_handler_failing(
            &self,
            _: &str,
            _: bool,
            _: chrono::DateTime<chrono::Utc>,
        ) -> Result<()> {
            pending().await
        }
        async fn replay_dead_letters_between(
            &self,
            _: &str,
            _: Option<chrono::DateTime<chrono::Utc>>,
            _: Option<chrono::DateTime<chrono::Utc>>,
        ) -> Result<u64> {
            pending().await
        }
        async fn recover(
            &self,
            _: &str,
            _: chrono::DateTime<chrono::Utc>,
        ) -> Result<RecoverOutcome> {
            pending().await
        }
        async fn prune(&self, _: chrono::DateTime<chrono::Utc>, _: u32) -> Result<Pruned> {
            pending().await
        }
        async fn lane_rows(&self) -> Result<Vec<LaneRow>> {
            pending().await
        }
        async fn counts(&self) -> Result<StoreCounts> {
            pending().await
        }
        async fn lookup_event(&self, _: &str) -> Result<Option<EventLookup>> {
            pending().await
        }
        async fn handler_deliveries(
            &self,
            _: &HandlerDeliveriesQuery,
        ) -> Result<Vec<HandlerDeliveryItem>> {
            pending().await
        }
        async fn ping(&self) -> Result<()> {
            pending().await
        }
        async fn now(&self) -> Result<chrono::DateTime<chrono::Utc>> {
            pending().await
        }
        async fn wakeups(&self) -> Result<Wakeups> {
            pending().await
        }
    }
}

/// Catalog reads of a store that does not answer are `503
/// store_unavailable` after the 2 s bound `/readyz` uses, not a wait for
/// the pool's timeout (or for ever).
#[tokio::test]
async fn catalog_reads_of_a_stalled_store_are_503() {
    use std::time::Duration;
    run_configured(
        Backend::Sqlite,
        TEST_LIMITS,
        StubNode::default(),
        |state| state.store = std::sync::Arc::new(stalled::Stalled),
        |app| async move {
            for path in [
                "/v1/handlers",
                "/v1/handlers/hdl_0123456789abcdef0123456789abcdef",
                "/v1/events/evt_1",
                "/v1/handlers/hdl_0123456789abcdef0123456789abcdef/deliveries",
                "/admin/handlers",
                "/readyz",
            ] {
                // A guard against a hang, not a speed check.
                let res = tokio::time::timeout(Duration::from_secs(20), app.get(path))
                    .await
                    .unwrap_or_else(|_| panic!("GET {path} still waits after 20 s"));
                assert_eq!(
                    res.status,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "{path}: {res:?}"
                );
                assert_eq!(
                    res.json["error"]["code"], "store_unavailable",
                    "{path}: {res:?}"
                );
                assert_eq!(
                    res.json["error"]["message"], "stalled store does not answer within 2000 ms",
                    "{path}: {res:?}"
                );
            }
        },
    )
    .await;
}

#[tokio::test]
async fn sqlite_admin_lanes_and_cluster() {
    admin_lanes_and_cluster(Backend::Sqlite).await;
}

#[tokio::test]
async fn postgres_admin_lanes_and_cluster() {
    admin_lanes_and_cluster(Backend::Postgres).await;
}

/// The default limits (8 MiB body, 1 MiB payload) let a 900 KiB payload through.
#[tokio::test]
async fn sqlite_default_limits_accept_large_payloads() {
    run_with(
        Backend::Sqlite,
        lanebus_api::Limits::default(),
        StubNode::default(),
        |app| async move {
            let res = app
                .post(
                    "/v1/events",
                    json!({"events": [{"type": "big", "payload": "x".repeat(900 << 10)}]}),
                )
                .await;
            assert_eq!(res.status, StatusCode::ACCEPTED, "{res:?}");
        },
    )
    .await;
}
