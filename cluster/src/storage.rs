//! Raft log and state machine storage on disk, in one redb file
//! (`<data_dir>/raft.redb`).
//!
//! ```text
//! raft.redb
//! ├── log   u64 index → bincode(Entry)        append: durable commit, then ack
//! └── meta  "vote"        → bincode(Vote)      durable before it is answered
//!           "committed"   → bincode(LogId)
//!           "last_purged" → bincode(LogId)
//!           "sm"          → bincode(StateMachineData)  after every apply batch
//!           "snapshot"    → bincode(StoredSnapshot)    durable
//! ```
//!
//! Durability: log appends, the vote, purges and snapshots are committed with
//! redb's default (fsync) durability before openraft is told they are done.
//! The state machine is written after every apply batch with *eventual*
//! durability: a crash may lose the last few applies, which is safe because
//! openraft re-applies committed entries from the log at start (the committed
//! log id is saved, and the log is only purged up to a durable snapshot). At
//! start the newer of the saved state machine and the snapshot wins.
//!
//! Snapshots ([`openraft::Config::snapshot_policy`]) bound the log: after one
//! is built openraft purges the log up to it, keeping
//! `max_in_snapshot_log_to_keep` entries for slow followers.
//!
//! redb calls are synchronous and short (one small transaction each); they run
//! on the calling task, which is acceptable for the few writes per second that
//! lease renewals cause.

// openraft's StorageError (and redb's Error) are large by design; the traits
// require returning them.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::state::{ClusterState, Command, CommandResult};
use crate::{NodeId, TypeConfig};

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

type StorageResult<T> = Result<T, StorageError<NodeId>>;

/// Encodes a value for the disk and the wire (bincode 2, standard config).
pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, bincode::error::EncodeError> {
    bincode::serde::encode_to_vec(v, bincode::config::standard())
}

/// Decodes what [`encode`] wrote.
pub(crate) fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, bincode::error::DecodeError> {
    bincode::serde::decode_from_slice(b, bincode::config::standard()).map(|(v, _)| v)
}

fn any<E: std::error::Error + 'static>(e: E) -> AnyError {
    AnyError::new(&e)
}

/// Opens (or creates) the database file and its tables.
pub(crate) fn open_db(data_dir: &Path) -> Result<Arc<Database>, redb::Error> {
    let db = Database::create(data_dir.join("raft.redb"))?;
    let tx = db.begin_write()?;
    tx.open_table(LOG)?;
    tx.open_table(META)?;
    tx.commit()?;
    Ok(Arc::new(db))
}

fn read_meta<T: DeserializeOwned>(db: &Database, key: &str) -> Result<Option<T>, AnyError> {
    let tx = db.begin_read().map_err(any)?;
    let t = tx.open_table(META).map_err(any)?;
    match t.get(key).map_err(any)? {
        Some(v) => Ok(Some(decode(v.value()).map_err(any)?)),
        None => Ok(None),
    }
}

fn write_meta<T: Serialize>(
    db: &Database,
    key: &str,
    v: &T,
    durability: Durability,
) -> Result<(), AnyError> {
    let bytes = encode(v).map_err(any)?;
    let mut tx = db.begin_write().map_err(any)?;
    tx.set_durability(durability);
    {
        let mut t = tx.open_table(META).map_err(any)?;
        t.insert(key, bytes.as_slice()).map_err(any)?;
    }
    tx.commit().map_err(any)?;
    Ok(())
}

/// The Raft log and vote, in the `log` and `meta` tables.
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Database>,
}

impl LogStore {
    pub(crate) fn new(db: Arc<Database>) -> Self {
        LogStore { db }
    }

    fn last_purged(&self) -> StorageResult<Option<LogId<NodeId>>> {
        read_meta(&self.db, "last_purged").map_err(|e| StorageIOError::read_logs(e).into())
    }

    /// Removes log entries in `range` (used by truncate and purge).
    fn remove_range(&self, range: impl RangeBounds<u64>) -> Result<(), AnyError> {
        let tx = self.db.begin_write().map_err(any)?;
        {
            let mut t = tx.open_table(LOG).map_err(any)?;
            t.retain_in(range, |_, _| false).map_err(any)?;
        }
        tx.commit().map_err(any)?;
        Ok(())
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> StorageResult<Vec<Entry<TypeConfig>>> {
        let read = || -> Result<Vec<Entry<TypeConfig>>, AnyError> {
            let tx = self.db.begin_read().map_err(any)?;
            let t = tx.open_table(LOG).map_err(any)?;
            let mut out = Vec::new();
            for item in t.range(range).map_err(any)? {
                let (_, v) = item.map_err(any)?;
                out.push(decode(v.value()).map_err(any)?);
            }
            Ok(out)
        };
        read().map_err(|e| StorageIOError::read_logs(e).into())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> StorageResult<LogState<TypeConfig>> {
        let last_purged = self.last_purged()?;
        let last = || -> Result<Option<LogId<NodeId>>, AnyError> {
            let tx = self.db.begin_read().map_err(any)?;
            let t = tx.open_table(LOG).map_err(any)?;
            let last = match t.last().map_err(any)? {
                Some((_, v)) => Some(decode::<Entry<TypeConfig>>(v.value()).map_err(any)?.log_id),
                None => None,
            };
            Ok(last)
        };
        let last = last().map_err(StorageIOError::read_logs)?.or(last_purged);
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> StorageResult<()> {
        write_meta(&self.db, "vote", vote, Durability::Immediate)
            .map_err(|e| StorageIOError::write_vote(e).into())
    }

    async fn read_vote(&mut self) -> StorageResult<Option<Vote<NodeId>>> {
        read_meta(&self.db, "vote").map_err(|e| StorageIOError::read_vote(e).into())
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> StorageResult<()> {
        // Eventual: a lost committed id only means re-applying less at start;
        // openraft learns the real commit index from the leader.
        write_meta(&self.db, "committed", &committed, Durability::Eventual)
            .map_err(|e| StorageIOError::write(e).into())
    }

    async fn read_committed(&mut self) -> StorageResult<Option<LogId<NodeId>>> {
        read_meta::<Option<LogId<NodeId>>>(&self.db, "committed")
            .map(Option::flatten)
            .map_err(|e| StorageIOError::read(e).into())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> StorageResult<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
    {
        let write = || -> Result<(), AnyError> {
            let tx = self.db.begin_write().map_err(any)?;
            {
                let mut t = tx.open_table(LOG).map_err(any)?;
                for entry in entries {
                    let bytes = encode(&entry).map_err(any)?;
                    t.insert(entry.log_id.index, bytes.as_slice())
                        .map_err(any)?;
                }
            }
            tx.commit().map_err(any)?;
            Ok(())
        };
        match write() {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let err = std::io::Error::other(e.to_string());
                callback.log_io_completed(Err(err));
                Err(StorageIOError::write_logs(e).into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> StorageResult<()> {
        tracing::debug!(index = log_id.index, "truncating raft log");
        self.remove_range(log_id.index..)
            .map_err(|e| StorageIOError::write_logs(e).into())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> StorageResult<()> {
        tracing::debug!(index = log_id.index, "purging raft log");
        write_meta(&self.db, "last_purged", &log_id, Durability::Immediate)
            .and_then(|()| self.remove_range(..=log_id.index))
            .map_err(|e| StorageIOError::write_logs(e).into())
    }
}

/// The state machine as saved and as carried in snapshots.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StateMachineData {
    pub last_applied: Option<LogId<NodeId>>,
    pub last_membership: StoredMembership<NodeId, BasicNode>,
    pub state: ClusterState,
}

#[derive(Debug, Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

/// What the rest of the crate reads from the state machine: the applied
/// state, and *when* this node applied each member's last renewal (its own
/// monotonic clock; never replicated).
#[derive(Debug, Clone)]
pub(crate) struct Applied {
    pub data: Arc<StateMachineData>,
    pub renewed_at: Arc<HashMap<NodeId, Instant>>,
}

struct SmInner {
    db: Arc<Database>,
    data: Mutex<StateMachineData>,
    renewed_at: Mutex<HashMap<NodeId, Instant>>,
    snapshot_idx: AtomicU64,
    tx: watch::Sender<Applied>,
}

/// The state machine store: [`ClusterState`] plus Raft's applied log id and
/// membership. Cheap to clone.
#[derive(Clone)]
pub struct StateMachineStore {
    inner: Arc<SmInner>,
}

impl StateMachineStore {
    /// Loads the newer of the saved state machine and the snapshot, or an
    /// empty state with `lanes` lanes.
    pub(crate) fn open(db: Arc<Database>, lanes: u16) -> Result<Self, AnyError> {
        let saved: Option<StateMachineData> = read_meta(&db, "sm")?;
        let snap: Option<StoredSnapshot> = read_meta(&db, "snapshot")?;
        let from_snap = match snap {
            Some(s) => Some(decode::<StateMachineData>(&s.data).map_err(any)?),
            None => None,
        };
        let data = match (saved, from_snap) {
            (Some(a), Some(b)) if b.last_applied > a.last_applied => b,
            (Some(a), _) => a,
            (None, Some(b)) => b,
            (None, None) => StateMachineData {
                last_applied: None,
                last_membership: StoredMembership::default(),
                state: ClusterState::new(lanes),
            },
        };
        let (tx, _) = watch::channel(Applied {
            data: Arc::new(data.clone()),
            renewed_at: Arc::default(),
        });
        Ok(StateMachineStore {
            inner: Arc::new(SmInner {
                db,
                data: Mutex::new(data),
                renewed_at: Mutex::default(),
                snapshot_idx: AtomicU64::new(0),
                tx,
            }),
        })
    }

    /// Watches the applied state.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Applied> {
        self.inner.tx.subscribe()
    }

    /// The applied state now.
    pub(crate) fn current(&self) -> Applied {
        self.inner.tx.borrow().clone()
    }

    fn lock_data(&self) -> std::sync::MutexGuard<'_, StateMachineData> {
        self.inner
            .data
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn publish(&self, data: &StateMachineData) {
        let renewed_at = self
            .inner
            .renewed_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        self.inner.tx.send_replace(Applied {
            data: Arc::new(data.clone()),
            renewed_at: Arc::new(renewed_at),
        });
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> StorageResult<Snapshot<TypeConfig>> {
        let data = self.lock_data().clone();
        let bytes = encode(&data).map_err(|e| StorageIOError::read_state_machine(any(e)))?;
        let idx = self.inner.snapshot_idx.fetch_add(1, Ordering::Relaxed) + 1;
        let snapshot_id = match data.last_applied {
            Some(l) => format!("{}-{}-{idx}", l.leader_id, l.index),
            None => format!("--{idx}"),
        };
        let meta = SnapshotMeta {
            last_log_id: data.last_applied,
            last_membership: data.last_membership.clone(),
            snapshot_id,
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: bytes.clone(),
        };
        write_meta(&self.inner.db, "snapshot", &stored, Durability::Immediate)
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), e))?;
        tracing::info!(snapshot_id = %meta.snapshot_id, bytes = bytes.len(), "raft snapshot built");
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = StateMachineStore;

    async fn applied_state(
        &mut self,
    ) -> StorageResult<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>)> {
        let d = self.lock_data();
        Ok((d.last_applied, d.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> StorageResult<Vec<CommandResult>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
    {
        let mut results = Vec::new();
        let snapshot = {
            let mut d = self.lock_data();
            for entry in entries {
                d.last_applied = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Blank => results.push(CommandResult::default()),
                    EntryPayload::Normal(cmd) => {
                        let r = d.state.apply(entry.log_id.index, &cmd);
                        if let (Command::RenewLease { node }, true) = (&cmd, r.ok) {
                            self.inner
                                .renewed_at
                                .lock()
                                .unwrap_or_else(std::sync::PoisonError::into_inner)
                                .insert(*node, Instant::now());
                        }
                        if !r.ok {
                            tracing::debug!(command = ?cmd, reason = ?r.reason, "command refused");
                        }
                        results.push(r);
                    }
                    EntryPayload::Membership(m) => {
                        d.last_membership = StoredMembership::new(Some(entry.log_id), m);
                        results.push(CommandResult::default());
                    }
                }
            }
            d.clone()
        };
        write_meta(&self.inner.db, "sm", &snapshot, Durability::Eventual)
            .map_err(StorageIOError::write_state_machine)?;
        self.publish(&snapshot);
        Ok(results)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> StorageResult<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> StorageResult<()> {
        let bytes = snapshot.into_inner();
        let mut data: StateMachineData = decode(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), any(e)))?;
        data.last_applied = meta.last_log_id;
        data.last_membership = meta.last_membership.clone();
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: bytes,
        };
        write_meta(&self.inner.db, "snapshot", &stored, Durability::Immediate)
            .and_then(|()| write_meta(&self.inner.db, "sm", &data, Durability::Immediate))
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), e))?;
        *self.lock_data() = data.clone();
        tracing::info!(snapshot_id = %meta.snapshot_id, "raft snapshot installed");
        self.publish(&data);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> StorageResult<Option<Snapshot<TypeConfig>>> {
        let stored: Option<StoredSnapshot> = read_meta(&self.inner.db, "snapshot")
            .map_err(|e| StorageIOError::read_snapshot(None, e))?;
        Ok(stored.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use openraft::testing::{StoreBuilder, Suite};

    use super::*;

    /// A fresh database in a temp dir per test case; the guard keeps the dir.
    struct Builder;

    impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, tempfile::TempDir> for Builder {
        async fn build(&self) -> StorageResult<(tempfile::TempDir, LogStore, StateMachineStore)> {
            let dir = tempfile::tempdir().map_err(|e| StorageIOError::write(any(e)))?;
            let db = open_db(dir.path()).map_err(|e| StorageIOError::write(any(e)))?;
            let sm = StateMachineStore::open(db.clone(), 8).map_err(StorageIOError::write)?;
            Ok((dir, LogStore::new(db), sm))
        }
    }

    /// The Raft log and snapshots hold epochs as [`crate::Epoch`]; before it
    /// they held `u64`. Data dirs written either way must read the same:
    /// every carrier encodes to the same bytes and decodes across.
    #[test]
    fn epochs_encode_as_the_u64_they_replaced() {
        use crate::assignment::{Change, LaneEntry, LaneState};
        use crate::Epoch;

        /// [`LaneEntry`] and [`Change::Assign`] (variant 0) as they were.
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct OldLaneEntry {
            owner: Option<NodeId>,
            epoch: u64,
            state: LaneState,
        }
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        enum OldChange {
            Assign { lane: u16, to: NodeId, epoch: u64 },
        }

        fn same<N, O>(new: N, old: O)
        where
            N: Serialize + DeserializeOwned + PartialEq + Debug,
            O: Serialize + DeserializeOwned + PartialEq + Debug,
        {
            let bytes = encode(&new).unwrap();
            assert_eq!(bytes, encode(&old).unwrap(), "{new:?}");
            assert_eq!(decode::<O>(&bytes).unwrap(), old);
            assert_eq!(decode::<N>(&bytes).unwrap(), new);
        }

        let values = [0, 1, 250, 251, 65_536, 1 << 32, i64::MAX as u64, u64::MAX];
        for v in values {
            same(Epoch(v), v);
            same(
                LaneEntry {
                    owner: Some(3),
                    epoch: Epoch(v),
                    state: LaneState::Releasing { to: 2 },
                },
                OldLaneEntry {
                    owner: Some(3),
                    epoch: v,
                    state: LaneState::Releasing { to: 2 },
                },
            );
            same(
                Change::Assign {
                    lane: 7,
                    to: 1,
                    epoch: Epoch(v),
                },
                OldChange::Assign {
                    lane: 7,
                    to: 1,
                    epoch: v,
                },
            );
            // `Command::Refence`'s report.
            same(vec![(9u16, Epoch(v), Epoch(1))], vec![(9u16, v, 1u64)]);
        }
    }

    /// openraft's storage conformance suite against the redb store.
    #[test]
    fn openraft_storage_suite() -> StorageResult<()> {
        Suite::test_all(Builder)
    }

    #[tokio::test]
    async fn log_vote_and_state_machine_survive_reopening() {
        let dir = tempfile::tempdir().expect("temp dir");
        let vote = Vote::new(3, 1);
        {
            let db = open_db(dir.path()).expect("open");
            let mut log = LogStore::new(db.clone());
            log.save_vote(&vote).await.expect("vote");
            let mut sm = StateMachineStore::open(db, 8).expect("sm");
            let entry = Entry::<TypeConfig> {
                log_id: LogId::new(openraft::CommittedLeaderId::new(3, 1), 1),
                payload: EntryPayload::Normal(Command::AddNode {
                    node: 1,
                    raft_addr: "a".into(),
                    http_addr: "b".into(),
                }),
            };
            sm.apply([entry]).await.expect("apply");
        }
        let db = open_db(dir.path()).expect("reopen");
        let mut log = LogStore::new(db.clone());
        assert_eq!(log.read_vote().await.expect("read"), Some(vote));
        let sm = StateMachineStore::open(db, 8).expect("sm");
        assert!(sm.current().data.state.members.contains_key(&1));
    }
}
