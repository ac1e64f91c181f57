//! Which lanes this node owns, at which epoch: the seam between lane
//! ownership (Raft, with the cluster issue) and the lane owners.
//!
//! A [`LaneAssignment`] yields the set of `(lane, epoch)` the node owns as a
//! [`tokio::sync::watch`] channel; the node starts a
//! [`LaneOwner`](crate::actors::LaneOwner) for every lane that appears and
//! stops the ones that disappear or change epoch. Before a lane appears the
//! assignment has fenced it in the store ([`Store::fence`]), so a deposed
//! owner of an older epoch changes nothing any more (DESIGN.md invariant 4).
//!
//! [`LocalAssignment`] is the single-node implementation: it owns every lane
//! and raises each lane's epoch by one at start, so a restarted node never
//! reuses the epoch of its previous life. The Raft-based assignment replaces
//! it behind the same trait.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use futures::{stream, StreamExt, TryStreamExt};
use lanebus_store::{Epoch, Lane, LaneRow, Store, StoreError};
use tokio::sync::watch;

/// Lanes owned by this node and the epoch of each.
pub type OwnedLanes = BTreeMap<Lane, Epoch>;

/// Why an assignment could not start.
#[derive(Debug, thiserror::Error)]
pub enum AssignmentError {
    /// The store failed while reading or fencing lanes.
    #[error("lane assignment: {0}")]
    Store(#[from] StoreError),
    /// Another node kept raising a lane's epoch concurrently.
    #[error("lane {lane} could not be fenced at epoch {epoch}: another owner raced")]
    Raced {
        /// The lane.
        lane: Lane,
        /// The epoch we tried.
        epoch: Epoch,
    },
}

/// Source of this node's lane ownership.
#[async_trait]
pub trait LaneAssignment: Send + Sync + 'static {
    /// Starts the assignment and returns the watch of owned lanes. The value
    /// changes whenever ownership changes; every lane in it is already fenced
    /// at its epoch.
    ///
    /// # Errors
    /// [`AssignmentError`] when the initial fencing fails.
    async fn start(&self) -> Result<watch::Receiver<OwnedLanes>, AssignmentError>;
}

/// Single-node assignment: owns every lane, fenced at `current epoch + 1`.
pub struct LocalAssignment {
    store: Arc<dyn Store>,
    node_id: String,
    sender: std::sync::Mutex<Option<watch::Sender<OwnedLanes>>>,
}

impl LocalAssignment {
    /// An assignment of every lane of `store` to `node_id`.
    pub fn new(store: Arc<dyn Store>, node_id: impl Into<String>) -> Self {
        LocalAssignment {
            store,
            node_id: node_id.into(),
            sender: std::sync::Mutex::new(None),
        }
    }
}

/// The epochs a new owner of every lane takes: one above the stored epoch.
pub fn next_epochs(rows: &[LaneRow]) -> Vec<(Lane, Epoch)> {
    rows.iter().map(|r| (r.lane, r.epoch + 1)).collect()
}

#[async_trait]
impl LaneAssignment for LocalAssignment {
    async fn start(&self) -> Result<watch::Receiver<OwnedLanes>, AssignmentError> {
        let mut owned = OwnedLanes::new();
        let mut todo = next_epochs(&self.store.lane_rows().await?);
        // A lane fenced concurrently by someone else is re-read and retried a
        // few times; a single node only races with its own previous life.
        for _round in 0..5 {
            let store = &self.store;
            let node_id = &self.node_id;
            let results: Vec<(Lane, Epoch, bool)> = stream::iter(todo.iter().copied())
                .map(|(lane, epoch)| async move {
                    let ok = store.fence(lane, node_id, epoch).await?;
                    Ok::<_, StoreError>((lane, epoch, ok))
                })
                .buffer_unordered(16)
                .try_collect()
                .await?;
            let failed: Vec<Lane> = results
                .iter()
                .filter_map(|&(lane, epoch, ok)| {
                    if ok {
                        owned.insert(lane, epoch);
                        None
                    } else {
                        Some(lane)
                    }
                })
                .collect();
            if failed.is_empty() {
                let (tx, rx) = watch::channel(owned);
                *self.sender.lock().expect("not poisoned") = Some(tx);
                return Ok(rx);
            }
            let rows = self.store.lane_rows().await?;
            todo = next_epochs(&rows)
                .into_iter()
                .filter(|(l, _)| failed.contains(l))
                .collect();
        }
        let (lane, epoch) = todo.first().copied().unwrap_or((0, 0));
        Err(AssignmentError::Raced { lane, epoch })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_owner_takes_the_next_epoch_of_every_lane() {
        let rows = vec![
            LaneRow {
                lane: 0,
                owner: None,
                epoch: 0,
                backlog: 0,
            },
            LaneRow {
                lane: 1,
                owner: Some("n1".into()),
                epoch: 7,
                backlog: 3,
            },
        ];
        assert_eq!(next_epochs(&rows), vec![(0, 1), (1, 8)]);
    }
}
