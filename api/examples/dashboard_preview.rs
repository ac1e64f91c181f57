//! Serves the API with a made-up three-node cluster, to look at the
//! dashboard without running one:
//!
//! ```text
//! cargo run -p lanebus-api --example dashboard_preview -- 127.0.0.1:8088
//! # then open http://127.0.0.1:8088/ui/
//! ```
//!
//! The store is a fresh SQLite file in the temp directory holding two
//! handlers, one with dead letters. The node view is a stub: 256 lanes over
//! `n1`, `n2`, `n3`, a few with a backlog or in a non-active state; after 5
//! seconds `n3` "dies" and its lanes move to the others (what the failover
//! looks like on the page). Every handler's plots show a made-up 15 minutes
//! of attempts (a wave of deliveries, a burst of failures).

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use lanebus_api::{router, ApiState, ClusterNodeView, ClusterView, LaneView, Limits, NodeView};
use lanebus_store::{DeadLetterRequest, Epoch, Lane, LaneClaim, NewEvent, NewHandler};

struct Preview {
    started: Instant,
}

impl Preview {
    fn n3_dead(&self) -> bool {
        self.started.elapsed().as_secs() >= 5
    }

    fn owner(&self, lane: u16) -> &'static str {
        match (lane % 3, self.n3_dead()) {
            (0, _) => "n1",
            (1, _) => "n2",
            (_, false) => "n3",
            (_, true) if lane & 1 == 0 => "n1",
            (_, true) => "n2",
        }
    }
}

#[async_trait]
impl NodeView for Preview {
    fn node_id(&self) -> String {
        "n1".into()
    }

    async fn lanes(&self) -> Result<Vec<LaneView>, lanebus_store::StoreError> {
        Ok((0..256u16)
            .map(|lane| {
                let moved = self.n3_dead() && lane % 3 == 2;
                LaneView {
                    lane,
                    owner: (lane != 255).then(|| self.owner(lane).to_owned()),
                    epoch: Epoch(if moved { 2 } else { 1 }),
                    state: match lane {
                        255 => "unassigned",
                        _ if lane % 41 == 7 => "starting",
                        _ => "active",
                    }
                    .into(),
                    lease_expires_in_ms: (lane != 255).then_some(1_500),
                    backlog: if lane % 17 == 3 { 12 } else { 0 },
                    in_flight: if lane % 17 == 3 { 2 } else { 0 },
                }
            })
            .collect())
    }

    fn published(&self, _lanes: &[Lane]) {}

    fn handlers_changed(&self) {}

    async fn ready(&self) -> Result<(), String> {
        Ok(())
    }

    fn render_metrics(&self) -> String {
        String::new()
    }

    fn handler_activity(&self, _handler_id: &str) -> Vec<lanebus_api::ActivitySample> {
        let now = chrono::Utc::now();
        (0..90i64)
            .map(|i| {
                let x = i as f64;
                let deliveries = (60.0 + 40.0 * (x / 9.0).sin()).round() as u64;
                let failures = if (55..65).contains(&i) {
                    12
                } else {
                    i as u64 % 3
                };
                lanebus_api::ActivitySample {
                    at: now - chrono::Duration::seconds(10 * (90 - i)),
                    seconds: 10.0,
                    deliveries,
                    failures,
                    deliveries_per_s: deliveries as f64 / 10.0,
                    failures_per_s: failures as f64 / 10.0,
                    p99_attempt_ms: Some(if failures > 5 {
                        950.0
                    } else {
                        40.0 + x % 7.0 * 3.0
                    }),
                }
            })
            .collect()
    }

    async fn cluster(&self) -> ClusterView {
        let lanes = self.lanes().await.unwrap_or_default();
        let nodes = ["n1", "n2", "n3"]
            .iter()
            .enumerate()
            .map(|(i, id)| ClusterNodeView {
                id: (*id).to_owned(),
                raft_addr: Some(format!("127.0.0.1:{}", 7001 + i)),
                http_addr: Some(format!("127.0.0.1:{}", 8081 + i)),
                voter: true,
                alive: !(*id == "n3" && self.n3_dead()),
                lanes: lanes
                    .iter()
                    .filter(|l| l.owner.as_deref() == Some(id))
                    .count() as u32,
            })
            .collect();
        ClusterView {
            node_id: "n1".into(),
            leader: Some("n1".into()),
            term: 3,
            nodes,
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8088".into());
    let path = std::env::temp_dir().join(format!("lanebus-preview-{}.db", std::process::id()));
    let store = lanebus_store::open(&format!("sqlite://{}", path.display())).await?;
    let handler = |name: &str, routes: &[&str]| NewHandler {
        name: name.into(),
        url: "http://127.0.0.1:9/hook".into(),
        event_types: routes.iter().map(|r| (*r).to_owned()).collect(),
        max_attempts: 8,
        timeout_ms: 10_000,
        max_in_flight: 64,
        secret: lanebus_store::generate_secret(),
        rate_limit: None,
        filter: None,
    };
    store
        .create_handler(handler("billing", &["invoice.*"]))
        .await?;
    store
        .create_handler(handler("github mirror", &["issues.*", "push"]))
        .await?;
    // Three dead letters for "billing": publish, claim as a fenced owner,
    // give up on them.
    let events = (0..3)
        .map(|i| NewEvent {
            id: Some(format!("evt_{i}")),
            event_type: "invoice.paid".into(),
            key: Some("acct-1".into()),
            payload: b"{}".to_vec(),
            deliver_at: None,
            expected_seq: None,
        })
        .collect();
    store.publish(events).await?;
    let lane = lanebus_store::lane_of_event(Some("acct-1"), "", store.lanes());
    store.fence(lane, "preview", Epoch(1)).await?;
    let claimed = store
        .claim(&[LaneClaim {
            lane,
            epoch: Epoch(1),
            after: Default::default(),
            limit: 10,
        }])
        .await?;
    let dead: Vec<DeadLetterRequest> = claimed
        .iter()
        .flat_map(|b| &b.deliveries)
        .map(|d| DeadLetterRequest {
            id: d.id,
            lane,
            epoch: Epoch(1),
            attempts: 8,
            last_error: "503 from http://127.0.0.1:9/hook".into(),
            failure: None,
        })
        .collect();
    store.dead_letter(&dead).await?;

    let app = router(ApiState {
        store,
        node: Arc::new(Preview {
            started: Instant::now(),
        }),
        limits: Limits::default(),
        egress: lanebus_api::egress::EgressPolicy::default(),
        auth: lanebus_api::auth::Auth::open(),
    });
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("dashboard: http://{addr}/ui/");
    axum::serve(listener, app).await?;
    Ok(())
}
