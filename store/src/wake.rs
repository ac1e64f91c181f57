//! Wake-ups a store pushes to the lane owners ([`crate::Wakeups::Push`]):
//! which lanes got new deliveries, so that a node claims those lanes and
//! not every lane it owns.
//!
//! The channel merges what it queues and never drops a lane: when its queue
//! is full, the receiver's next wake-up names every lane.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

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
        WakeReceiver { rx, overflow },
    )
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
#[derive(Debug)]
pub struct WakeReceiver {
    rx: mpsc::Receiver<Woken>,
    overflow: Arc<AtomicBool>,
}

impl WakeReceiver {
    /// The next wake-up merged with every other one queued; `None` once the
    /// store's side is gone.
    pub async fn recv(&mut self) -> Option<Woken> {
        let first = self.rx.recv().await?;
        Some(self.merged(first))
    }

    /// As [`WakeReceiver::recv`], without waiting: `None` when nothing is
    /// queued.
    pub fn try_recv(&mut self) -> Option<Woken> {
        let first = self.rx.try_recv().ok()?;
        Some(self.merged(first))
    }

    fn merged(&mut self, mut w: Woken) -> Woken {
        while let Ok(more) = self.rx.try_recv() {
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

    #[test]
    fn payloads_name_lanes_or_all() {
        assert_eq!(Woken::parse("3,17,3"), lanes(&[3, 17]));
        assert_eq!(Woken::parse("255"), lanes(&[255]));
        for all in ["", "x", "3,", "3,-1", "70000"] {
            assert_eq!(Woken::parse(all), Woken::All, "{all:?}");
        }
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
