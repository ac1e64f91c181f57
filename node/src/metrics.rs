//! Metrics: names, labels and the Prometheus recorder.
//!
//! One function per internal event emits its metric (Vector's "internal
//! events" style), so names and labels live in one place. The recorder is
//! process-wide (the `metrics` crate has one global recorder): it is
//! installed once, without the exporter's own HTTP listener, and rendered by
//! `GET /metrics` through [`NodeView::render_metrics`](lanebus_api::NodeView).
//!
//! | metric | type | labels |
//! | --- | --- | --- |
//! | `lanebus_deliveries_total` | counter | `handler`, `outcome` = `completed`, `failed`, `dead_lettered` |
//! | `lanebus_commit_to_handler_seconds` | histogram | `handler` (published_at to the 2xx) |
//! | `lanebus_lane_queued` | gauge | `lane` (deliveries this node claimed into memory for the lane and has not handed out yet; at most `--lane-buffer`) |
//! | `lanebus_lane_backlog` | gauge | `lane`: the same value as `lanebus_lane_queued`, kept under its old name for existing dashboards; it is *not* the lane's backlog in the store, which `GET /admin/lanes` reports as `backlog` |
//! | `lanebus_lane_in_flight` | gauge | `lane` (deliveries of the lane being attempted on this node) |
//! | `lanebus_store_fenced_out_total` | counter | `op` = `claim`, `complete`, `reschedule`, `dead_letter`, `discard` (items the store did not act on: fenced out, or the row was gone) |
//! | `lanebus_store_errors_total` | counter | `op` |
//! | `lanebus_handlers_disabled_total` | counter | `handler`, `reason` = `gone` (a `410` answer disabled it here), `failing` (no success for `--auto-disable-after-s`), `api` (`POST /v1/handlers/{id}/disable` on this node); counted only by the call that changed the state (two `410`s at once, on one node or two, count one), by `lanebus_store::change_state` |
//! | `lanebus_handlers_disabled` | gauge | disabled handlers in the catalog as this node last read it |
//! | `lanebus_orphan_deliveries_discarded_total` | counter | `handler` (deliveries of a deleted handler found after the delete, discarded) |
//! | `lanebus_retention_pruned_total` | counter | `kind` = `events`, `completions` (rows removed by retention, [`crate::retention`]) |
//! | `lanebus_buffered_payload_bytes` | gauge | payload bytes of the deliveries held in memory (queued + in flight), see `--buffer-bytes` |
//! | `lanebus_claim_reserved_bytes` | gauge | bytes the node's claims under way reserved in the `--buffer-bytes` budget (rows asked for times the estimate of bytes per delivery); 0 when no claim is under way |
//! | `lanebus_rate_limited_total` | counter | `handler` (deliveries that waited for a rate-limit token) |
//! | `lanebus_claim_horizon_age_seconds` | gauge | how long the oldest database transaction left open below a claim cursor of this node's lanes had held it at that lane's last claim (PostgreSQL; 0 when none) |
//! | `lanebus_actor_thread_stalled` | gauge | 1 while the thread of this node's actors has not run for 5 s or more ([`crate::watchdog`]), else 0 |
//!
//! The API's own metrics (`lanebus_events_published_total`, ...) are listed
//! in `lanebus_api::telemetry`; they go to the same recorder.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (once) and returns its handle.
pub fn install_recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                    &[
                        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                        10.0, 30.0,
                    ],
                )
                .expect("buckets are not empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!(
                    "a metrics recorder was already installed; lanebus metrics go there"
                );
            }
            describe();
            lanebus_api::describe_metrics();
            handle
        })
        .clone()
}

fn describe() {
    metrics::describe_counter!("lanebus_deliveries_total", "attempt outcomes by handler");
    metrics::describe_counter!(
        "lanebus_retention_pruned_total",
        "events and completion records removed by retention"
    );
    metrics::describe_histogram!(
        "lanebus_commit_to_handler_seconds",
        metrics::Unit::Seconds,
        "time from publish commit to the handler's acceptance"
    );
    metrics::describe_gauge!(
        "lanebus_lane_queued",
        "deliveries claimed into this node's memory per lane, not yet handed out"
    );
    metrics::describe_gauge!(
        "lanebus_lane_backlog",
        "old name of lanebus_lane_queued (deliveries claimed into this node's memory per \
         lane, not yet handed out); not the store's backlog of the lane, which GET \
         /admin/lanes reports"
    );
    metrics::describe_gauge!(
        "lanebus_lane_in_flight",
        "deliveries being attempted per lane"
    );
    metrics::describe_counter!(
        "lanebus_store_fenced_out_total",
        "store calls or items refused because the lane's epoch moved on"
    );
    metrics::describe_counter!(
        "lanebus_store_errors_total",
        "failed store calls by operation"
    );
    metrics::describe_counter!(
        "lanebus_handlers_disabled_total",
        "handlers disabled by this node, by reason (gone: a 410 answer)"
    );
    metrics::describe_gauge!(
        "lanebus_handlers_disabled",
        "disabled handlers in the handler catalog as last read"
    );
    metrics::describe_counter!(
        "lanebus_orphan_deliveries_discarded_total",
        "deliveries of a deleted handler found after the delete and discarded"
    );
    metrics::describe_gauge!(
        "lanebus_buffered_payload_bytes",
        metrics::Unit::Bytes,
        "payload bytes of the deliveries held in memory by this node's lanes"
    );
    metrics::describe_gauge!(
        "lanebus_claim_reserved_bytes",
        metrics::Unit::Bytes,
        "bytes of the payload budget reserved by this node's claims under way (0 when no \
         claim is)"
    );
    metrics::describe_gauge!(
        "lanebus_claim_horizon_age_seconds",
        metrics::Unit::Seconds,
        "how long the oldest database transaction open below a claim cursor of this node's \
         lanes had held it at that lane's last claim (PostgreSQL; 0 when none): a session \
         left idle in a transaction shows here"
    );
    metrics::describe_gauge!(
        "lanebus_actor_thread_stalled",
        "1 while the thread of this node's actors has not run for 5 s or more (its lanes \
         starve; see the ERROR log), else 0"
    );
}

/// Whether the actor thread counts as stalled ([`crate::watchdog`]).
pub fn actor_thread_stalled(stalled: bool) {
    metrics::gauge!("lanebus_actor_thread_stalled").set(if stalled { 1.0 } else { 0.0 });
}

/// The claim horizon's age (see `lanebus_store::ClaimCursor::open`).
pub fn claim_horizon_age(age: Option<std::time::Duration>) {
    metrics::gauge!("lanebus_claim_horizon_age_seconds").set(age.map_or(0.0, |a| a.as_secs_f64()));
}

/// An attempt finished: `outcome` is `completed`, `failed` or `dead_lettered`.
pub fn delivery_outcome(handler_id: &str, outcome: &'static str) {
    metrics::counter!("lanebus_deliveries_total", "handler" => handler_id.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// A delivery completed `seconds` after its publish committed.
pub fn commit_to_handler(handler_id: &str, seconds: f64) {
    metrics::histogram!("lanebus_commit_to_handler_seconds", "handler" => handler_id.to_owned())
        .record(seconds.max(0.0));
}

/// A lane's queued (claimed into memory, not handed out) and in-flight
/// counts on this node.
pub fn lane_depth(lane: u16, queued: usize, in_flight: usize) {
    metrics::gauge!("lanebus_lane_queued", "lane" => lane.to_string()).set(queued as f64);
    metrics::gauge!("lanebus_lane_backlog", "lane" => lane.to_string()).set(queued as f64);
    metrics::gauge!("lanebus_lane_in_flight", "lane" => lane.to_string()).set(in_flight as f64);
}

/// `n` items (or a whole claim) of `op` were refused by fencing.
pub fn fenced_out(op: &'static str, n: u64) {
    if n > 0 {
        metrics::counter!("lanebus_store_fenced_out_total", "op" => op).increment(n);
    }
}

/// A store call of `op` failed.
pub fn store_error(op: &'static str) {
    metrics::counter!("lanebus_store_errors_total", "op" => op).increment(1);
}

/// A delivery of `handler_id` waits for its rate limit's next token (no
/// attempt is made meanwhile).
pub fn rate_limited(handler_id: &str) {
    metrics::counter!("lanebus_rate_limited_total", "handler" => handler_id.to_owned())
        .increment(1);
}

/// Disabled handlers in the catalog, as of the last reload.
pub fn handlers_disabled(n: usize) {
    metrics::gauge!("lanebus_handlers_disabled").set(n as f64);
}

/// `n` deliveries of the deleted handler `handler_id` were discarded.
pub fn orphans_discarded(handler_id: &str, n: usize) {
    if n > 0 {
        metrics::counter!("lanebus_orphan_deliveries_discarded_total", "handler" => handler_id.to_owned())
            .increment(n as u64);
    }
}

/// Rows removed by one retention batch.
/// Both series exist from the first batch on, zeros included.
pub fn pruned(completions: u64, events: u64) {
    metrics::counter!("lanebus_retention_pruned_total", "kind" => "completions")
        .increment(completions);
    metrics::counter!("lanebus_retention_pruned_total", "kind" => "events").increment(events);
}

/// Sets the budget bytes reserved by the node's claims under way.
pub fn claim_reserved_bytes(n: usize) {
    metrics::gauge!("lanebus_claim_reserved_bytes").set(n as f64);
}

/// Sets the payload bytes the node's lanes hold.
pub fn buffered_bytes(n: usize) {
    metrics::gauge!("lanebus_buffered_payload_bytes").set(n as f64);
}
