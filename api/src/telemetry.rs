//! The API's metrics, one function per internal event so names and labels
//! live in one place (Vector's "internal events" style).
//!
//! | metric | type | labels | incremented by |
//! | --- | --- | --- | --- |
//! | `lanebus_events_published_total` | counter | | events newly stored by `POST /v1/events` |
//! | `lanebus_events_duplicates_total` | counter | | events of `POST /v1/events` whose id was already stored |
//! | `lanebus_api_errors_total` | counter | `code` ([`crate::ErrorCode`]) | every error answer |
//! | `lanebus_deliveries_discarded_total` | counter | | pending deliveries discarded by `DELETE /v1/handlers/{id}` |
//! | `lanebus_handlers_disabled_total` | counter | `handler`, `reason` = `api` (`POST /v1/handlers/{id}/disable`), `gone` (a `410` answer), `failing` (the node's auto-disable) | enabled handlers disabled ([`lanebus_store::change_state`]: the store reads and writes the state in one step, so a disable of a disabled handler counts nothing and two `410`s at once, on one node or two, count one) |
//! | `lanebus_dead_letters_replayed_total` | counter | | dead letters put back by a replay |
//! | `lanebus_handlers_enabled_total` | counter | | disabled handlers enabled by `POST /v1/handlers/{id}/enable` (an enable of an enabled handler counts nothing; a `410 Gone` disables one: `lanebus_handlers_disabled_total`, from the node) |
//!
//! The node installs the recorder; it may call [`describe_metrics`] once
//! after that to give these metrics their help text.

/// Registers the help text of the API's metrics with the installed recorder.
pub fn describe_metrics() {
    metrics::describe_counter!(
        "lanebus_events_published_total",
        "events accepted by publish"
    );
    metrics::describe_counter!(
        "lanebus_events_duplicates_total",
        "published events whose id was already stored (not delivered again)"
    );
    metrics::describe_counter!(
        "lanebus_api_errors_total",
        "HTTP API error answers by error code"
    );
    metrics::describe_counter!(
        "lanebus_deliveries_discarded_total",
        "pending deliveries discarded because their handler was deleted"
    );
    metrics::describe_counter!(
        "lanebus_dead_letters_replayed_total",
        "dead letters put back as deliveries"
    );
    metrics::describe_counter!(
        "lanebus_handlers_enabled_total",
        "handlers enabled through the API"
    );
    metrics::describe_histogram!(
        "lanebus_publish_group_size",
        "publish calls written together in one store transaction (group commit)"
    );
}

/// A publish committed.
pub(crate) fn events_published(accepted: usize, duplicates: usize) {
    metrics::counter!("lanebus_events_published_total").increment(accepted as u64);
    metrics::counter!("lanebus_events_duplicates_total").increment(duplicates as u64);
    tracing::debug!(accepted, duplicates, "events published");
}

/// An error answer with `code`.
pub(crate) fn api_error(code: &'static str) {
    metrics::counter!("lanebus_api_errors_total", "code" => code).increment(1);
}

/// A handler was deleted, with what was discarded along with it.
pub(crate) fn handler_deleted(handler_id: &str, discarded: lanebus_store::DeletedHandler) {
    metrics::counter!("lanebus_deliveries_discarded_total").increment(discarded.deliveries);
    tracing::info!(
        handler_id,
        discarded_deliveries = discarded.deliveries,
        discarded_dead_letters = discarded.dead_letters,
        "handler deleted"
    );
}

/// Dead letters were replayed (`replayed` of them), asked for by handler
/// and/or ids (the first 20 ids are logged).
pub(crate) fn dead_letters_replayed(handler_id: Option<&str>, ids: &[i64], replayed: u64) {
    metrics::counter!("lanebus_dead_letters_replayed_total").increment(replayed);
    let shown = &ids[..ids.len().min(20)];
    tracing::info!(handler_id, ids = ?shown, asked = ids.len(), replayed, "dead letters replayed");
}
