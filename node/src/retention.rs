//! Retention: completed events are kept for a period (`--retention-secs`,
//! default 24 h, so `POST /v1/handlers/{id}/recover` can deliver them again)
//! and then pruned in small, paced batches.
//!
//! ```text
//!  every prune interval, on the node that owns lane 0 (one node at a time):
//!    loop { Store::prune(store now - retention, size)   one short statement
//!           pause max(MIN_PAUSE, PAUSE_FACTOR x its time) leaves the store
//!                                                       to dispatch
//!           size = next_batch(size, its time)           1x to 16x the batch
//!    } until a batch removes less than a full batch
//! ```
//!
//! Each batch is one statement (PostgreSQL: through the BRIN indexes on
//! `completions.completed_at` and `events.published_at`, deleting by ctid)
//! that locks only the rows it removes; no claim, completion or publish
//! waits for those rows. The pause after each batch keeps the pruner to at
//! most a tenth of one connection's time (a fifth cost dispatch 24-46 % in
//! the test below on this 2-core machine under load), so a large backlog of
//! expired rows (after a long outage, or a retention shortened) is worked
//! off without taking the store from dispatch: measured by the test
//! `node/tests/retention.rs`. Events that still have a pending delivery or a
//! dead letter are never pruned, whatever their age.
//!
//! A batch has a fixed cost besides its rows: PostgreSQL's anti-join builds
//! one hash of every pending delivery (no index on `deliveries.event_id`:
//! it would cost WAL on every publish), about 55 ms for 166,000 pending
//! deliveries here. With 1,000 rows per batch and the pause, that capped
//! pruning near 1,700 events a second, below a sustained completion rate.
//! So the batch grows (doubling, up to [`MAX_BATCH_FACTOR`] times the
//! configured size) while a full batch takes under [`BATCH_TARGET`], and
//! halves (not below the configured size) when one takes over twice that:
//! the lock a batch holds (SQLite's one writer) stays near the target.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use lanebus_store::{Pruned, Store};

use crate::actors::{LaneBoard, LaneState};

/// Default retention of completed events: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);
/// Default time between two pruning passes: one minute.
pub const DEFAULT_PRUNE_INTERVAL: Duration = Duration::from_secs(60);
/// Rows of each kind (completions, events) one batch removes at most.
pub const DEFAULT_PRUNE_BATCH: u32 = 1_000;
/// Shortest pause between two batches.
pub const MIN_PAUSE: Duration = Duration::from_millis(10);
/// Pause after a batch, as a multiple of the batch's own time (9: the
/// pruner takes at most a tenth of one connection's time).
pub const PAUSE_FACTOR: u32 = 9;
/// A full batch quicker than this doubles the next batch's size; one
/// slower than twice this halves it ([`next_batch`]).
pub const BATCH_TARGET: Duration = Duration::from_millis(100);
/// The largest batch, as a multiple of [`RetentionConfig::batch`].
pub const MAX_BATCH_FACTOR: u32 = 16;

/// How retention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionConfig {
    /// Completed events are kept this long (counted from publish for an
    /// event, from completion for a completion record).
    pub retention: Duration,
    /// Time between two pruning passes.
    pub interval: Duration,
    /// Rows of each kind one batch removes at most.
    pub batch: u32,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            retention: DEFAULT_RETENTION,
            interval: DEFAULT_PRUNE_INTERVAL,
            batch: DEFAULT_PRUNE_BATCH,
        }
    }
}

/// One pruning pass: batches of [`Store::prune`] with a pause after each,
/// until a batch removes less than a full batch of both kinds or `go_on`
/// answers `false` (checked before each batch). Returns the totals.
///
/// # Errors
/// The store's error of the failing batch (what earlier batches removed
/// stays removed).
pub async fn prune_pass(
    store: &dyn Store,
    config: RetentionConfig,
    go_on: impl Fn() -> bool,
) -> lanebus_store::Result<Pruned> {
    let retention = chrono::TimeDelta::from_std(config.retention).unwrap_or(chrono::TimeDelta::MAX);
    let mut total = Pruned::default();
    let mut size = config.batch.max(1);
    while go_on() {
        // The cutoff on the store's clock, which wrote the completion times.
        let before = store
            .now()
            .await?
            .checked_sub_signed(retention)
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        let started = Instant::now();
        let p = store.prune(before, size).await?;
        let took = started.elapsed();
        total.completions += p.completions;
        total.events += p.events;
        crate::metrics::pruned(p.completions, p.events);
        let full = u64::from(size);
        if p.completions < full && p.events < full {
            break;
        }
        tokio::time::sleep((took * PAUSE_FACTOR).max(MIN_PAUSE)).await;
        size = next_batch(size, took, config.batch);
    }
    Ok(total)
}

/// The size of the batch after a full batch of `size` rows that took
/// `took`: doubled when it took under [`BATCH_TARGET`], halved when it took
/// over twice that, otherwise the same; always within `configured` (at
/// least 1) and [`MAX_BATCH_FACTOR`] times it.
pub fn next_batch(size: u32, took: Duration, configured: u32) -> u32 {
    let min = configured.max(1);
    let max = min.saturating_mul(MAX_BATCH_FACTOR);
    let next = if took < BATCH_TARGET {
        size.saturating_mul(2)
    } else if took > BATCH_TARGET * 2 {
        size / 2
    } else {
        size
    };
    next.clamp(min, max)
}

/// Runs a pruning pass every [`RetentionConfig::interval`] while this node
/// owns lane 0 (so one node of a cluster prunes); ends when the node's lane
/// board is gone (the node stopped) or `stop` fires (between two of the
/// pass's statements).
pub async fn run(
    store: Arc<dyn Store>,
    board: Weak<LaneBoard>,
    config: RetentionConfig,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let stopped = AtomicBool::new(false);
    let mut stop = stop;
    let owns_lane_0 = |board: &Weak<LaneBoard>| {
        board.upgrade().is_some_and(|b| {
            b.snapshot()
                .get(&0)
                .is_some_and(|s| s.state == LaneState::Active)
        })
    };
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.interval) => {}
            _ = &mut stop => return,
        }
        if board.strong_count() == 0 {
            return;
        }
        if !owns_lane_0(&board) {
            continue;
        }
        let started = Instant::now();
        // A stop ends the pass between its statements.
        let pass = prune_pass(store.as_ref(), config, || {
            !stopped.load(Relaxed) && owns_lane_0(&board)
        });
        tokio::pin!(pass);
        let outcome = loop {
            tokio::select! {
                out = &mut pass => break out,
                _ = &mut stop, if !stopped.load(Relaxed) => {
                    stopped.store(true, Relaxed);
                }
            }
        };
        match outcome {
            Ok(p) if p.completions > 0 || p.events > 0 => tracing::info!(
                completions = p.completions,
                events = p.events,
                took_ms = started.elapsed().as_millis() as u64,
                "retention pruned completed events"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "retention pruning failed; next pass retries"),
        }
        if stopped.load(Relaxed) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_quick_batch_doubles_up_to_the_cap() {
        assert_eq!(next_batch(1_000, 60 * MS, 1_000), 2_000);
        assert_eq!(next_batch(8_000, 60 * MS, 1_000), 16_000);
        assert_eq!(next_batch(16_000, 60 * MS, 1_000), 16_000);
    }

    #[test]
    fn a_slow_batch_halves_down_to_the_configured_size() {
        assert_eq!(next_batch(16_000, 250 * MS, 1_000), 8_000);
        assert_eq!(next_batch(1_000, 900 * MS, 1_000), 1_000);
        // Between the target and twice it, the size holds.
        assert_eq!(next_batch(4_000, 150 * MS, 1_000), 4_000);
    }

    #[test]
    fn a_configured_size_of_zero_still_prunes() {
        assert_eq!(next_batch(0, 500 * MS, 0), 1);
        assert_eq!(next_batch(u32::MAX, 10 * MS, u32::MAX), u32::MAX);
    }
}
