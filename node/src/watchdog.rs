//! The actor thread's watchdog.
//!
//! Every actor of a node (lane owners, key handlers, the store actor) runs
//! on one thread, while the HTTP API and Raft run on the runtime's workers.
//! If that thread stops running (a blocking call, a lost wake-up such as
//! the one fixed in 198cbc8), the node stops delivering while its API and
//! Raft still say it is fine, and its lanes starve. So a task on the actor
//! thread counts beats ([`BEAT`]), and a task on a worker looks at the count
//! ([`CHECK`]): when it has not moved for [`STALL_CHECKS`] checks in a row
//! (at least 5 s of the checker running), the node is stalled:
//!
//! - an ERROR log ("the actor thread has stopped running"), and the gauge
//!   `lanebus_actor_thread_stalled` at 1;
//! - `/readyz` answers `503 not_ready`, naming the actor thread;
//! - in a cluster, the node withholds its lease renewals
//!   ([`lanebus_cluster::Cluster::withhold_renewals`]): its own lease lapses
//!   and stops its lanes, and the leader moves them to the other nodes after
//!   the lease plus the margin, as a paused process's (so about 23 s after
//!   the thread stopped, with the default 15 s lease and 3 s margin).
//!   Invariant 4 fences its owners if the thread runs again.
//!
//! Once the count has moved at every check for [`STALL_CHECKS`] checks in a
//! row, all three are undone (a WARN log): a thread that runs only now and
//! then stays stalled.
//!
//! Checks are counted, not timed: a paused process (SIGSTOP) or a starved
//! machine delays the checker too, so a pause is never taken for a stall
//! of the actor thread alone. [`StallDetector`] decides; [`beat`] and
//! [`watch`] act.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the actor thread beats.
pub const BEAT: Duration = Duration::from_millis(100);

/// How often a worker looks at the beats.
pub const CHECK: Duration = Duration::from_millis(500);

/// Checks in a row without a beat after which the actor thread counts as
/// stalled (10 checks: at least 5 s). Far above any single poll of an actor,
/// far below the default lease (15 s).
pub const STALL_CHECKS: u32 = 10;

/// What the actor thread shares with its checker.
#[derive(Debug, Default)]
pub struct ActorWatchdog {
    beats: AtomicU64,
    stalled: AtomicBool,
}

impl ActorWatchdog {
    /// Whether the actor thread counts as stalled now.
    pub fn stalled(&self) -> bool {
        self.stalled.load(Ordering::SeqCst)
    }

    /// One beat of the actor thread.
    fn beat(&self) {
        self.beats.fetch_add(1, Ordering::Relaxed);
    }

    fn beats(&self) -> u64 {
        self.beats.load(Ordering::Relaxed)
    }
}

/// A change [`StallDetector::observe`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// No beat for this many checks in a row: stalled from now on.
    Stalled {
        /// Checks in a row without a beat.
        checks: u32,
    },
    /// Beat at every check for as many checks as a stall needs.
    Resumed {
        /// Checks without a beat since the stall began.
        checks: u32,
    },
}

/// Decides from successive beat counts whether the actor thread is
/// stalled (pure: the caller reads the count and acts on the change).
#[derive(Debug, Clone)]
pub struct StallDetector {
    after: u32,
    last: Option<u64>,
    /// Checks in a row without a beat.
    still: u32,
    /// While stalled: checks in a row with a beat.
    moving: u32,
    /// Checks without a beat of the stall, for the report.
    stalled_for: u32,
    stalled: bool,
}

impl StallDetector {
    /// Stalled after `after` checks in a row without a beat, resumed after
    /// `after` checks in a row with one (at least 1).
    pub fn new(after: u32) -> Self {
        StallDetector {
            after: after.max(1),
            last: None,
            still: 0,
            moving: 0,
            stalled_for: 0,
            stalled: false,
        }
    }

    /// One check, with the beat count read now.
    pub fn observe(&mut self, beats: u64) -> Option<Change> {
        let moved = self.last.is_none_or(|l| l != beats);
        self.last = Some(beats);
        if moved {
            self.still = 0;
            if !self.stalled {
                return None;
            }
            self.moving += 1;
            if self.moving < self.after {
                return None;
            }
            self.stalled = false;
            return Some(Change::Resumed {
                checks: std::mem::take(&mut self.stalled_for),
            });
        }
        self.still += 1;
        if self.stalled {
            self.moving = 0;
            self.stalled_for += 1;
            return None;
        }
        if self.still >= self.after {
            self.stalled = true;
            self.moving = 0;
            self.stalled_for = self.still;
            return Some(Change::Stalled { checks: self.still });
        }
        None
    }
}

/// Beats on the current thread every `every` (spawn it on the actor
/// thread). Runs until its runtime or local set ends.
pub async fn beat(dog: Arc<ActorWatchdog>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        dog.beat();
    }
}

/// Checks the beats every `every` and acts on a change: the log, the
/// gauge, the flag [`ActorWatchdog::stalled`], and `on_change(stalled)`
/// (the cluster's renewals). Ends when `stop` is sent or dropped.
pub async fn watch(
    dog: Arc<ActorWatchdog>,
    every: Duration,
    after: u32,
    on_change: impl Fn(bool) + Send + 'static,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut detector = StallDetector::new(after);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let set = |stalled: bool| {
        dog.stalled.store(stalled, Ordering::SeqCst);
        crate::metrics::actor_thread_stalled(stalled);
        on_change(stalled);
    };
    crate::metrics::actor_thread_stalled(false);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut stop => return,
        }
        match detector.observe(dog.beats()) {
            Some(Change::Stalled { checks }) => {
                set(true);
                tracing::error!(
                    checks,
                    seconds = (every * checks).as_secs_f64(),
                    "the actor thread has stopped running: this node's lane owners, key \
                     handlers and store actor do nothing. /readyz answers 503 and, in a \
                     cluster, lease renewals are withheld so that its lanes move"
                );
            }
            Some(Change::Resumed { checks }) => {
                set(false);
                tracing::warn!(
                    checks,
                    seconds_without_a_beat = (every * checks).as_secs_f64(),
                    "the actor thread runs again after a stall: ready again, lease renewals resume"
                );
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_that_stays_still_for_enough_checks_is_a_stall() {
        let mut d = StallDetector::new(3);
        assert_eq!(d.observe(5), None, "the first count is a baseline");
        assert_eq!(d.observe(5), None);
        assert_eq!(d.observe(5), None);
        assert_eq!(d.observe(5), Some(Change::Stalled { checks: 3 }));
        assert_eq!(d.observe(5), None, "reported once");
        // Resumed only after beats at 3 checks in a row.
        assert_eq!(d.observe(6), None);
        assert_eq!(d.observe(7), None);
        assert_eq!(d.observe(8), Some(Change::Resumed { checks: 4 }));
        assert_eq!(d.observe(9), None);
        assert_eq!(d.observe(9), None);
    }

    #[test]
    fn a_thread_that_runs_only_now_and_then_stays_stalled() {
        let mut d = StallDetector::new(3);
        d.observe(0);
        for _ in 0..3 {
            d.observe(0);
        }
        assert!(d.stalled, "stalled");
        // A beat now and then (two checks with one, one without) never
        // makes three in a row.
        let mut beats = 0;
        for round in 0..20 {
            beats += 1;
            assert_eq!(d.observe(beats), None, "round {round}");
            beats += 1;
            assert_eq!(d.observe(beats), None, "round {round}");
            assert_eq!(d.observe(beats), None, "round {round}");
        }
        assert!(d.stalled, "still stalled");
    }

    #[test]
    fn gaps_shorter_than_the_bound_are_not_stalls() {
        let mut d = StallDetector::new(3);
        for beats in 0..20 {
            // Two checks without a beat, then a beat: a slow actor, or a
            // checker that ran twice while the thread was busy.
            assert_eq!(d.observe(beats), None, "beat {beats}");
            assert_eq!(d.observe(beats), None, "beat {beats}");
        }
    }

    /// The watchdog as the node runs it: beats on a thread whose local set
    /// `block_on` drives (the actor thread), checks on a worker of a
    /// multi-thread runtime. A local task that blocks that thread is a
    /// stall; the flag clears once it runs again.
    #[test]
    fn a_blocked_local_thread_is_reported_and_its_recovery_too() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let dog = Arc::new(ActorWatchdog::default());
        let changes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let c = changes.clone();
        rt.spawn(watch(
            dog.clone(),
            Duration::from_millis(20),
            5,
            move |s| c.lock().expect("not poisoned").push(s),
            stop_rx,
        ));
        let local = tokio::task::LocalSet::new();
        let (d, seen) = (dog.clone(), changes.clone());
        local.block_on(&rt, async move {
            tokio::task::spawn_local(beat(d.clone(), Duration::from_millis(5)));
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!d.stalled(), "a beating thread is not stalled");
            // Blocks the thread: no beat for 600 ms (30 checks).
            tokio::task::spawn_local(async { std::thread::sleep(Duration::from_millis(600)) })
                .await
                .expect("blocking task");
            // The checker ran meanwhile and saw it (and may have seen the
            // first beat after it too).
            assert_eq!(seen.lock().expect("not poisoned").first(), Some(&true));
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while d.stalled() || seen.lock().expect("not poisoned").len() < 2 {
                assert!(std::time::Instant::now() < deadline, "never resumed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // Stopped while the thread still beats.
            let _ = stop_tx.send(());
        });
        assert_eq!(*changes.lock().expect("not poisoned"), vec![true, false]);
    }
}
