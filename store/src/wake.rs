//! Wake-ups a store pushes to the lane owners ([`crate::Wakeups::Push`]):
//! which lanes got new deliveries, so that a node claims those lanes and
//! not every lane it owns.
//!
//! The channel merges what it queues and never drops a lane: when its queue
//! is full, the receiver's next wake-up names every lane.
//!
//! A receiver may tell its store which lanes its node runs
//! ([`WakeReceiver::set_runs`]). A store that supports it (PostgreSQL) then
//! wakes those lanes of its own publishes through the channel, in process,
//! right after the commit, and sends no NOTIFY for a write whose lanes all
//! run in process ([`InProcess`]): a NOTIFY takes PostgreSQL's
//! database-wide notify lock through the commit, so notifying commits run
//! one at a time.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use futures::FutureExt;
use tokio::sync::mpsc;

use crate::Lane;

/// The most lanes a notification names; past it, it names none (every
/// lane). The same bound is in `postgres/sql/publish.sql`; 512 lanes keep a
/// payload far below NOTIFY's 8,000 bytes.
pub const NAMED_LANES_MAX: usize = 512;

/// What a wake-up names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Woken {
    /// Every lane: the store cannot say which (a notification that names
    /// none, notifications lost while reconnecting, a full queue).
    All,
    /// These lanes got new deliveries.
    Lanes(BTreeSet<Lane>),
}

impl Woken {
    /// Adds what `other` names to `self`.
    pub fn merge(&mut self, other: Woken) {
        match (&mut *self, other) {
            (Woken::All, _) => {}
            (_, Woken::All) => *self = Woken::All,
            (Woken::Lanes(a), Woken::Lanes(b)) => a.extend(b),
        }
    }

    /// The wake-up of `lanes`; of every lane when `lanes` is empty.
    pub fn of_lanes(lanes: &[Lane]) -> Woken {
        if lanes.is_empty() {
            Woken::All
        } else {
            Woken::Lanes(lanes.iter().copied().collect())
        }
    }

    /// The notification payload that [`Woken::parse`] reads back: lane
    /// numbers separated by commas, or the empty payload (every lane) for
    /// [`Woken::All`] and for more than [`NAMED_LANES_MAX`] lanes.
    pub fn payload(&self) -> String {
        match self {
            Woken::Lanes(l) if !l.is_empty() && l.len() <= NAMED_LANES_MAX => {
                l.iter().map(Lane::to_string).collect::<Vec<_>>().join(",")
            }
            _ => String::new(),
        }
    }

    /// Parses a notification payload: lane numbers separated by commas;
    /// anything else (the empty payload among it) is [`Woken::All`].
    pub fn parse(payload: &str) -> Woken {
        let lanes: Option<BTreeSet<Lane>> = payload
            .split(',')
            .map(|l| l.trim().parse::<Lane>().ok())
            .collect();
        match lanes {
            Some(lanes) if !lanes.is_empty() => Woken::Lanes(lanes),
            _ => Woken::All,
        }
    }
}

/// Creates a wake-up channel that queues up to `capacity` wake-ups
/// (at least 1).
pub fn channel(capacity: usize) -> (WakeSender, WakeReceiver) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let overflow = Arc::new(AtomicBool::new(false));
    (
        WakeSender {
            tx,
            overflow: Arc::clone(&overflow),
        },
        WakeReceiver {
            rx,
            overflow,
            runs: None,
        },
    )
}

/// Whether the node runs a lane (has a lane owner for it that claims), as
/// a receiver tells its store ([`WakeReceiver::set_runs`]). Called on the
/// store's publish path: it must be quick and must not block.
pub type RunsLane = Arc<dyn Fn(Lane) -> bool + Send + Sync>;

/// The wake-up channels a store handed out whose receivers said which
/// lanes they run: the store's own publishes wake those lanes through them.
/// Shared by a store and its clones.
#[derive(Default)]
pub(crate) struct InProcess {
    subscribers: Mutex<Vec<Subscriber>>,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.lock().len();
        f.debug_struct("InProcess")
            .field("subscribers", &n)
            .finish()
    }
}

struct Subscriber {
    tx: WakeSender,
    runs: Arc<OnceLock<RunsLane>>,
}

impl InProcess {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Subscriber>> {
        self.subscribers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A channel of `capacity` wake-ups ([`channel`]) whose receiver may
    /// say which lanes it runs; `tx` also feeds it in process from then on.
    pub(crate) fn channel(&self, capacity: usize) -> (WakeSender, WakeReceiver) {
        let (tx, mut rx) = channel(capacity);
        let runs = Arc::new(OnceLock::new());
        rx.runs = Some(Arc::clone(&runs));
        let mut subs = self.lock();
        subs.retain(|s| !s.tx.is_closed());
        subs.push(Subscriber {
            tx: tx.clone(),
            runs,
        });
        (tx, rx)
    }

    /// Whether every lane of `lanes` runs in process (at a receiver that
    /// said so); `false` for no lanes.
    pub(crate) fn runs_all(&self, lanes: &[Lane]) -> bool {
        if lanes.is_empty() {
            return false;
        }
        let subs = self.lock();
        let runs: Vec<&RunsLane> = subs.iter().filter_map(Subscriber::runs).collect();
        !runs.is_empty() && lanes.iter().all(|&l| runs.iter().any(|r| r(l)))
    }

    /// Wakes, through each receiver that said which lanes it runs, those it
    /// runs of `lanes`, and says whether every lane of `lanes` was woken so
    /// (looked at and sent under one lock); `false` for no lanes.
    pub(crate) fn wake(&self, lanes: &[Lane]) -> bool {
        let subs = self.lock();
        let mut covered = BTreeSet::new();
        for s in subs.iter() {
            let Some(runs) = s.runs() else { continue };
            let mine: BTreeSet<Lane> = lanes.iter().copied().filter(|&l| runs(l)).collect();
            if !mine.is_empty() {
                covered.extend(mine.iter().copied());
                s.tx.send(Woken::Lanes(mine));
            }
        }
        !lanes.is_empty() && lanes.iter().all(|l| covered.contains(l))
    }
}

impl Subscriber {
    /// What the receiver said it runs, while it is there.
    fn runs(&self) -> Option<&RunsLane> {
        if self.tx.is_closed() {
            None
        } else {
            self.runs.get()
        }
    }
}

/// The store's side of a wake-up channel.
#[derive(Debug, Clone)]
pub struct WakeSender {
    tx: mpsc::Sender<Woken>,
    overflow: Arc<AtomicBool>,
}

impl WakeSender {
    /// Queues `w` without waiting. On a full queue the receiver's next
    /// wake-up names every lane instead (nothing is lost: a full queue
    /// holds a wake-up the receiver has yet to take).
    pub fn send(&self, w: Woken) {
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send(w) {
            self.overflow.store(true, Ordering::SeqCst);
            // The receiver may have emptied the queue between the two
            // steps; then this one goes in and carries the overflow.
            let _ = self.tx.try_send(Woken::All);
        }
    }

    /// Whether the receiver is gone.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Completes when the receiver is gone.
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// The lane owners' side of a wake-up channel.
pub struct WakeReceiver {
    rx: mpsc::Receiver<Woken>,
    overflow: Arc<AtomicBool>,
    /// Set by [`WakeReceiver::set_runs`] for a store that wakes its own
    /// publishes in process.
    runs: Option<Arc<OnceLock<RunsLane>>>,
}

impl std::fmt::Debug for WakeReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeReceiver")
            .field("queued", &self.rx.len())
            .field("runs_told", &self.runs.as_ref().map(|r| r.get().is_some()))
            .finish()
    }
}

impl WakeReceiver {
    /// Tells the store which lanes this receiver's node runs. From then on
    /// the store's own publishes (through this store value or its clones)
    /// wake the lanes it runs through this channel right after their
    /// commit, and a write whose lanes all run here sends no wake-up to
    /// other processes. Other processes' publishes still arrive as before.
    ///
    /// Returns `false`, and changes nothing, when the store does not do
    /// this (the node must then wake its own publishes itself) or when it
    /// was told already.
    pub fn set_runs(&self, runs: RunsLane) -> bool {
        self.runs.as_ref().is_some_and(|r| r.set(runs).is_ok())
    }

    /// The next wake-up merged with every other one queued; `None` once the
    /// store's side is gone.
    pub async fn recv(&mut self) -> Option<Woken> {
        let first = self.rx.recv().await?;
        Some(self.merged(first))
    }

    /// As [`WakeReceiver::recv`], without waiting: `None` when nothing is
    /// ready.
    pub fn try_recv(&mut self) -> Option<Woken> {
        let first = self.rx.recv().now_or_never().flatten()?;
        Some(self.merged(first))
    }

    /// `w` merged with what else is ready. Polled once each, never with
    /// tokio's `Receiver::try_recv`: while a sender on another thread is
    /// half-way through its send, that parks the calling thread on the
    /// parker `block_on` sleeps on, and on a node's actor thread (a
    /// `LocalSet` driven by `block_on`) a wake-up arriving meanwhile is
    /// consumed there and the thread is never woken again.
    fn merged(&mut self, mut w: Woken) -> Woken {
        while let Some(Some(more)) = self.rx.recv().now_or_never() {
            w.merge(more);
        }
        if self.overflow.swap(false, Ordering::SeqCst) {
            w = Woken::All;
        }
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(l: &[Lane]) -> Woken {
        Woken::Lanes(l.iter().copied().collect())
    }

    #[test]
    fn payloads_read_back_what_they_name() {
        for w in [lanes(&[0]), lanes(&[3, 17, 255]), Woken::All] {
            assert_eq!(Woken::parse(&w.payload()), w);
        }
        let many: Vec<Lane> = (0..=NAMED_LANES_MAX as Lane).collect();
        assert_eq!(Woken::of_lanes(&many).payload(), "", "too many to name");
        assert_eq!(Woken::of_lanes(&[]), Woken::All);
        assert_eq!(Woken::of_lanes(&[9, 2]).payload(), "2,9");
    }

    /// A node receives its wake-ups on the thread that drives its actors:
    /// a `LocalSet` run by `block_on` on a multi-thread runtime, woken by
    /// the runtime's workers (timers, sockets, other tasks). Receiving must
    /// never park that thread: tokio's `Receiver::try_recv` does, when a
    /// sender on another thread is half-way through its send, on the same
    /// thread parker `block_on` sleeps on, so a wake-up of the `LocalSet`
    /// arriving meanwhile is consumed there and the thread is never woken
    /// again. Senders on plain threads, preempted mid-send on a busy
    /// machine, make that half-way state frequent; a local timer task is
    /// the heartbeat that must keep beating.
    #[test]
    fn receiving_never_stalls_the_thread_of_a_local_set() {
        use std::sync::atomic::AtomicU64;
        use std::time::{Duration, Instant};

        let rt = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime"),
        );
        let (tx, mut rx) = channel(4096);
        let beats = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let owner = {
            let (rt, beats, stop) = (Arc::clone(&rt), Arc::clone(&beats), Arc::clone(&stop));
            std::thread::spawn(move || {
                let local = tokio::task::LocalSet::new();
                rt.block_on(local.run_until(async move {
                    tokio::task::spawn_local(async move { while rx.recv().await.is_some() {} });
                    while !stop.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        beats.fetch_add(1, Ordering::SeqCst);
                    }
                }));
            })
        };
        let senders: Vec<_> = (0..8u16)
            .map(|i| {
                let (tx, stop) = (tx.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        tx.send(Woken::of_lanes(&[i]));
                    }
                })
            })
            .collect();
        let started = Instant::now();
        let (mut last, mut moved) = (0, Instant::now());
        let mut stalled = None;
        while started.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
            let now = beats.load(Ordering::SeqCst);
            if now != last {
                (last, moved) = (now, Instant::now());
            } else if moved.elapsed() > Duration::from_secs(2) {
                stalled = Some(started.elapsed());
                break;
            }
        }
        stop.store(true, Ordering::SeqCst);
        for s in senders {
            s.join().expect("sender");
        }
        if let Some(after) = stalled {
            // The owner thread cannot be woken any more: leave it behind.
            panic!("the local set's thread stopped after {after:?} ({last} beats)");
        }
        owner.join().expect("owner");
    }

    #[test]
    fn payloads_name_lanes_or_all() {
        assert_eq!(Woken::parse("3,17,3"), lanes(&[3, 17]));
        assert_eq!(Woken::parse("255"), lanes(&[255]));
        for all in ["", "x", "3,", "3,-1", "70000"] {
            assert_eq!(Woken::parse(all), Woken::All, "{all:?}");
        }
    }

    #[test]
    fn in_process_receivers_get_their_own_lanes_and_cover_only_while_there() {
        let here = InProcess::default();
        let (_a_tx, mut a) = here.channel(8);
        let (_b_tx, mut b) = here.channel(8);
        let (_c_tx, mut c) = here.channel(8);
        assert!(!here.runs_all(&[1]), "nobody said which lanes it runs");
        assert!(a.set_runs(Arc::new(|l| l < 10)));
        assert!(b.set_runs(Arc::new(|l| l >= 10 && l < 20)));
        // Between them they run 0..20; c said nothing and gets nothing.
        assert!(here.runs_all(&[1, 15]));
        assert!(!here.runs_all(&[1, 25]));
        assert!(!here.runs_all(&[]), "no lanes: nothing to leave out");
        assert!(here.wake(&[1, 2, 15]));
        assert_eq!(a.try_recv(), Some(lanes(&[1, 2])));
        assert_eq!(b.try_recv(), Some(lanes(&[15])));
        assert_eq!(c.try_recv(), None);
        // A lane nobody here runs: the others are still woken, and the
        // caller hears that a NOTIFY is needed.
        assert!(!here.wake(&[3, 25]));
        assert_eq!(a.try_recv(), Some(lanes(&[3])));
        assert_eq!(b.try_recv(), None);
        // A receiver that is gone runs nothing.
        drop(b);
        assert!(!here.runs_all(&[15]));
        assert!(!here.wake(&[15]));
        assert!(here.runs_all(&[4]));
        // A channel of a store that does not wake in process refuses.
        let (_tx, plain) = channel(8);
        assert!(!plain.set_runs(Arc::new(|_| true)));
    }

    #[tokio::test]
    async fn queued_wake_ups_are_merged() {
        let (tx, mut rx) = channel(8);
        tx.send(lanes(&[1, 2]));
        tx.send(lanes(&[2, 5]));
        assert_eq!(rx.recv().await, Some(lanes(&[1, 2, 5])));
        assert_eq!(rx.try_recv(), None);
        tx.send(lanes(&[1]));
        tx.send(Woken::All);
        tx.send(lanes(&[4]));
        assert_eq!(rx.try_recv(), Some(Woken::All));
        drop(tx);
        assert_eq!(rx.recv().await, None);
    }

    #[tokio::test]
    async fn a_full_queue_wakes_every_lane_and_loses_nothing() {
        let (tx, mut rx) = channel(2);
        tx.send(lanes(&[1]));
        tx.send(lanes(&[2]));
        tx.send(lanes(&[3]));
        assert_eq!(rx.recv().await, Some(Woken::All));
        assert_eq!(rx.try_recv(), None, "the overflow is taken once");
        tx.send(lanes(&[4]));
        assert_eq!(rx.recv().await, Some(lanes(&[4])));
    }
}
