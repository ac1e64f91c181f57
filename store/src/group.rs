//! Group commit for [`Store::publish`](crate::Store::publish), shared by the
//! backends.
//!
//! Each store has one [`Grouper`]. A publish validates its batch
//! ([`PublishPlan::new`]) before it queues, so a refused batch never joins a
//! group. While one group is being written, later publishes queue; the
//! writer then takes every queued batch (up to [`GROUP_EVENTS`] events and
//! [`GROUP_PAYLOAD_BYTES`] of payloads) and
//! writes them as one plan in one transaction ([`GroupWriter::write_plan`]),
//! in arrival order: per-key sequence numbers follow that order, and an id
//! repeated by a later caller is that caller's duplicate, as if the
//! publishes had run one after the other. Each caller is answered after the
//! commit, with its own ids and counts. When the group's write fails with an
//! error that could come from one caller's events, each batch is written
//! again on its own, so each caller gets its own verdict: a batch whose
//! expected sequence ([`crate::NewEvent::expected_seq`]) does not hold
//! fails the group's write ([`StoreError::SeqConflict`]), and only its
//! caller gets the conflict. A batch that expects a sequence of a key that
//! an earlier batch of the forming group writes starts the next group
//! instead ([`PublishPlan::expects_after`]): it was formed without those
//! events, so it would fail the group. The writer runs in a task of its
//! own: a caller that goes away does not cancel the others' write. After a
//! small group the writer may wait up to [`REGROUP_WAIT`] for its callers
//! to publish again, so that callers publishing one event at a time are
//! written in one group rather than two taking turns ([`Regroup`]).
//!
//! Source of the method: group commit as in seed 003 (the appends that queue
//! behind a write are written together in the next one).

// A build without a backend (the domain types only) uses none of it.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mongodb")),
    allow(dead_code)
)]

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use futures::FutureExt;
use tokio::sync::oneshot;

use crate::common::{PublishPlan, MAX_BATCH};
use crate::{PublishOutcome, Result, StoreError};

/// Most events written in one group (the sum of its batches; a single batch
/// of [`MAX_BATCH`] events always fits). Queued batches beyond it wait for
/// the next group.
pub const GROUP_EVENTS: usize = 4 * MAX_BATCH;

/// Most payload bytes written in one group, likewise (a single batch always
/// fits): one statement's parameters or one transaction's documents stay
/// moderate.
pub const GROUP_PAYLOAD_BYTES: usize = 16 << 20;

/// A backend's write of one plan.
#[async_trait]
pub(crate) trait GroupWriter: Clone + Send + Sync + 'static {
    /// Writes `plan.fresh` in one transaction and commits (retrying lost
    /// races as the backend does). Returns the ids of `plan.fresh` that were
    /// already stored, and so not written. `plan.fresh` has no id twice and
    /// may hold up to [`GROUP_EVENTS`] events.
    async fn write_plan(&self, plan: &PublishPlan) -> Result<HashSet<String>>;

    /// As [`write_plan`](Self::write_plan), for a group: a backend whose
    /// writes wait for row locks (PostgreSQL) waits only briefly and answers
    /// [`StoreError::Timeout`], so that a lock held elsewhere does not hold
    /// the whole queue; its batches are then written alone. What the write
    /// leaves to do after its commit (wake-ups) may come back in
    /// [`Written::then`], run once the group's callers are answered.
    async fn write_group(&self, plan: &PublishPlan) -> Result<Written> {
        self.write_plan(plan)
            .await
            .map(|stored| Written { stored, then: None })
    }

    /// The writer task ends: the queue is empty. A backend that keeps
    /// something for the writer between groups (PostgreSQL: its
    /// connection) may let go of it (PostgreSQL: once no write came for
    /// `PING_IDLE`).
    fn idle(&self) {}
}

/// A group's write ([`GroupWriter::write_group`]).
pub(crate) struct Written {
    /// The ids of the plan found already stored (not written).
    pub(crate) stored: HashSet<String>,
    /// Run after the group's callers were answered: the backend's wake-ups
    /// of the lanes the write gave deliveries (off the answers' path).
    pub(crate) then: Option<futures::future::BoxFuture<'static, ()>>,
}

/// Publishes and writes counted by a store's group commit since it was
/// opened: `publishes / writes` is the mean group size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupStats {
    /// [`Store::publish`](crate::Store::publish) calls that reached the
    /// store (valid batches).
    pub publishes: u64,
    /// Publish transactions run for them (groups, and batches written alone
    /// after a failed group).
    pub writes: u64,
}

struct Job {
    plan: PublishPlan,
    answer: oneshot::Sender<Answer>,
}

/// A batch's answer: its outcome, or the error with the batch's plan when
/// nothing of it was written ([`Grouper::publish_or_back`]).
type Answer = std::result::Result<PublishOutcome, (StoreError, Option<Box<PublishPlan>>)>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Whether a writer task is running (it drains the queue before it ends).
    writing: bool,
    /// Whether the writer waits for its callers (kept across writer tasks).
    regroup: Regroup,
}

impl Queue {
    /// The next group: how many of the queued batches it takes, in order
    /// (the first always; then while the group stays within
    /// [`GROUP_EVENTS`] and [`GROUP_PAYLOAD_BYTES`], up to a batch that
    /// starts a group of its own, [`PublishPlan::expects_after`]), and
    /// whether it is closed: a queued batch is left out, or it is at a bound,
    /// so a batch queued later could not join it.
    fn next_group(&self) -> (usize, bool) {
        let (mut events, mut bytes) = (0, 0);
        for (i, job) in self.jobs.iter().enumerate() {
            let n = job.plan.fresh.len();
            let b: usize = job.plan.fresh.iter().map(|e| e.payload.len()).sum();
            if i > 0
                && (events + n > GROUP_EVENTS
                    || bytes + b > GROUP_PAYLOAD_BYTES
                    || job
                        .plan
                        .expects_after(self.jobs.iter().take(i).map(|j| &j.plan)))
            {
                return (i, true);
            }
            events += n;
            bytes += b;
        }
        let at_bound = events >= GROUP_EVENTS || bytes >= GROUP_PAYLOAD_BYTES;
        (self.jobs.len(), at_bound)
    }

    /// Whether the queued batches already make a whole group, or more:
    /// waiting for more would not bring them into the next group.
    fn fills_group(&self) -> bool {
        self.next_group().1
    }
}

/// A store's publish queue and group writer.
#[derive(Default)]
pub(crate) struct Grouper {
    queue: Mutex<Queue>,
    publishes: AtomicU64,
    writes: AtomicU64,
    /// Signalled when a batch queues behind a running writer.
    arrived: tokio::sync::Notify,
}

impl std::fmt::Debug for Grouper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grouper")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Grouper {
    /// The counts so far.
    pub(crate) fn stats(&self) -> GroupStats {
        GroupStats {
            publishes: self.publishes.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
        }
    }

    /// Queues a validated batch, starts a writer if none runs, and waits for
    /// this batch's answer (given after its commit).
    pub(crate) async fn publish<W: GroupWriter>(
        self: &Arc<Self>,
        writer: &W,
        plan: PublishPlan,
    ) -> Result<PublishOutcome> {
        self.publish_or_back(writer, plan).await.map_err(|(e, _)| e)
    }

    /// As [`publish`](Self::publish), an error coming with the plan when
    /// the write refused it (nothing of it written), so that the caller
    /// may write it again.
    pub(crate) async fn publish_or_back<W: GroupWriter>(
        self: &Arc<Self>,
        writer: &W,
        plan: PublishPlan,
    ) -> Answer {
        self.publishes.fetch_add(1, Ordering::Relaxed);
        if plan.fresh.is_empty() {
            return Ok(answer(plan, 0, 0, 0));
        }
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            q.jobs.push_back(Job { plan, answer: tx });
            !std::mem::replace(&mut q.writing, true)
        };
        if start {
            // Armed before the spawn: a task dropped unpolled (its runtime
            // shutting down) still clears `writing`.
            let running = Running {
                grouper: Arc::clone(self),
                armed: true,
            };
            tokio::spawn(Arc::clone(self).drain(writer.clone(), running));
        } else {
            self.arrived.notify_one();
        }
        rx.await.unwrap_or_else(|_| {
            Err((
                StoreError::Database("the publish writer stopped before answering".into()),
                None,
            ))
        })
    }

    /// Batches waiting for the writer.
    fn queued(&self) -> usize {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .jobs
            .len()
    }

    /// Writes groups until the queue is empty.
    async fn drain<W: GroupWriter>(self: Arc<Self>, writer: W, mut running: Running) {
        // Batches of the last group answered in place (0 after a failed
        // group), and the batches queued just before they were answered:
        // any queued since are callers back or new ones.
        let (mut last, mut before) = (0usize, 0usize);
        loop {
            let wait = {
                let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                let queued = q.jobs.len();
                // Walks the queue only when the last group could be waited for.
                let full = (2..REGROUP_BELOW).contains(&last) && q.fills_group();
                q.regroup.wait_for(queued, last, full)
            };
            if let Some(want) = wait {
                let start = tokio::time::Instant::now();
                let came = loop {
                    let arrived = self.arrived.notified();
                    tokio::pin!(arrived);
                    arrived.as_mut().enable();
                    let came = self.queued().saturating_sub(before);
                    if came >= want {
                        break came;
                    }
                    if tokio::time::timeout_at(start + REGROUP_WAIT, arrived)
                        .await
                        .is_err()
                    {
                        break self.queued().saturating_sub(before);
                    }
                };
                let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                q.regroup.waited(came, want);
            }
            let jobs = {
                let mut q = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
                let (take, _) = q.next_group();
                if take == 0 {
                    q.writing = false;
                    running.armed = false;
                    drop(q);
                    writer.idle();
                    return;
                }
                q.jobs.drain(..take).collect::<Vec<_>>()
            };
            let batches = jobs.len();
            // A panic drops the group's answer senders (their callers get an
            // error) and must not stop the writer.
            let answered = std::panic::AssertUnwindSafe(self.write(&writer, jobs))
                .catch_unwind()
                .await
                .unwrap_or(None);
            (last, before) = match answered {
                Some(queued) => (batches, queued),
                None => (0, 0),
            };
        }
    }

    /// Writes one group and answers its callers. When the group's write
    /// fails with an error that could come from one batch, or waited too
    /// long for a lock, each batch is written alone in a task of its own,
    /// which answers its caller: the writer goes on with the next group, so
    /// a key whose counter is held elsewhere holds back only its own
    /// publishers. Returns, when the group's callers were answered here
    /// (its write succeeded), the batches queued just before they were
    /// (0 for a group of one, which no wait follows).
    async fn write<W: GroupWriter>(
        self: &Arc<Self>,
        writer: &W,
        mut jobs: Vec<Job>,
    ) -> Option<usize> {
        metrics::histogram!("lanebus_publish_group_size").record(jobs.len() as f64);
        self.writes.fetch_add(1, Ordering::Relaxed);
        let written = if jobs.len() == 1 {
            // One batch: its own plan, nothing to merge.
            // No wait follows a group of one, so the queue is not counted.
            writer.write_group(&jobs[0].plan).await.map(|w| {
                let job = jobs.pop().expect("one job");
                let _ = job.answer.send(Ok(answer_alone(job.plan, &w.stored)));
                (0, w.then)
            })
        } else {
            let (merged, owners, repeated) = merge(jobs.iter().map(|j| &j.plan));
            writer.write_group(&merged).await.map(|w| {
                let stored = w.stored;
                let mut accepted = vec![0; jobs.len()];
                let mut written = vec![0; jobs.len()];
                for (e, &owner) in merged.fresh.iter().zip(&owners) {
                    written[owner] += 1;
                    if !stored.contains(&e.id) {
                        accepted[owner] += 1;
                    }
                }
                let queued = self.queued();
                for (i, job) in jobs.drain(..).enumerate() {
                    let out = answer(job.plan, written[i], accepted[i], repeated[i]);
                    let _ = job.answer.send(Ok(out));
                }
                (queued, w.then)
            })
        };
        match written {
            Ok((queued, then)) => {
                if let Some(then) = then {
                    then.await;
                }
                Some(queued)
            }
            Err(e) if retry_alone(&e, jobs.len()) => {
                tracing::debug!(error = %e, batches = jobs.len(),
                    "publish group failed; writing its batches one by one");
                for job in jobs {
                    let (grouper, writer) = (Arc::clone(self), writer.clone());
                    tokio::spawn(async move {
                        let result = grouper.write_alone(&writer, &job.plan).await;
                        let _ = job.answer.send(match result {
                            Ok(stored) => Ok(answer_alone(job.plan, &stored)),
                            Err(e) => Err((e, Some(Box::new(job.plan)))),
                        });
                    });
                }
                None
            }
            Err(e) => {
                for job in jobs {
                    let _ = job.answer.send(Err((e.clone(), Some(Box::new(job.plan)))));
                }
                None
            }
        }
    }

    async fn write_alone<W: GroupWriter>(
        &self,
        writer: &W,
        plan: &PublishPlan,
    ) -> Result<HashSet<String>> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        writer.write_plan(plan).await
    }
}

/// Longest wait of [`Regroup`] for the callers of the last group. Tokio's
/// timer ends it at its next millisecond tick after this, so a wait that
/// runs out lasts 1 to 2 ms.
pub(crate) const REGROUP_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

/// Batches (not events) in a group, or queued, from which the writer does
/// not wait: the statement's cost is spread over enough events, and
/// waiting for the slowest of many callers cost more than it gained (4 %
/// fewer events/s at 64 HTTP publishers when it waited after every group).
pub(crate) const REGROUP_BELOW: usize = 16;

/// Whether the writer waits before its next group (pure; the writer acts).
///
/// Callers that publish one event per call and wait for their answer
/// (request handlers, a worker pool) come back right after it. Under such
/// load the writer would split them into two groups that take turns: those
/// answered go on while the others' group is written, and each group has
/// half of the callers. So after a group of 2 to [`REGROUP_BELOW`] - 1
/// batches that was answered, the writer waits until as many batches as
/// that group had have queued besides those queued before its answers
/// went out (on a multi-thread runtime, callers may publish again before
/// the writer looks at the queue), for at most [`REGROUP_WAIT`], and
/// writes them all together. It does not wait when the queued batches
/// already make a whole group (by events, bytes or a batch that must start
/// one).
///
/// A wait counts as paid off when at least 3 in 4 of them came before it
/// ran out (the slowest of a group's callers is often late). Otherwise
/// (callers that do not come back together, such as a steady rate of
/// independent publishes) the writer does not wait for its next 4
/// chances, then 8 after the next such wait, up to 1,024; a wait that paid
/// off resets that. The count is kept while the writer task stops and
/// starts. Independent publishes frequent enough to fill such a wait (two
/// or more per millisecond after a group of two) do wait for it, up to
/// [`REGROUP_WAIT`] each, and are written in fewer, larger groups.
///
/// Source of the method: group commit with a commit delay, as PostgreSQL's
/// `commit_delay` (taken only when `commit_siblings` other transactions are
/// active) and Kafka's producer `linger.ms`; waiting for the callers just
/// answered, and the back-off, are ours.
#[derive(Debug, Default)]
struct Regroup {
    /// Chances left to skip.
    skip: u32,
    /// Chances skipped after the last wait that did not pay off.
    backoff: u32,
}

impl Regroup {
    /// With `queued` batches waiting after a group of `last` answered
    /// (`full`: the queued batches make a whole group): how many batches
    /// queued after its answers to wait for (`None`: write now).
    fn wait_for(&mut self, queued: usize, last: usize, full: bool) -> Option<usize> {
        if !(2..REGROUP_BELOW).contains(&last) || queued >= REGROUP_BELOW || full {
            return None;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return None;
        }
        Some(last)
    }

    /// A wait for `want` batches ended with `came` of them queued.
    fn waited(&mut self, came: usize, want: usize) {
        if 4 * came >= 3 * want {
            self.backoff = 0;
        } else {
            self.backoff = (self.backoff * 2).clamp(4, 1024);
            self.skip = self.backoff;
        }
    }
}

/// A running writer task. Dropped while armed (its runtime shut down with
/// the task unfinished), it fails the queued publishes and lets the next
/// publish start a writer.
struct Running {
    grouper: Arc<Grouper>,
    armed: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.armed {
            let mut q = self
                .grouper
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            q.writing = false;
            q.jobs.clear();
        }
    }
}

/// One plan of `plans`' fresh events in order, an id already taken by an
/// earlier batch of the group left out. Also returns, per merged event, the
/// index of its batch, and per batch the number of events left out.
fn merge<'a>(
    plans: impl ExactSizeIterator<Item = &'a PublishPlan>,
) -> (PublishPlan, Vec<usize>, Vec<usize>) {
    let mut repeated = vec![0; plans.len()];
    let mut seen = HashSet::new();
    let mut fresh = Vec::new();
    let mut owners = Vec::new();
    let mut plans_versions = Vec::with_capacity(plans.len());
    let mut sealed = true;
    for (i, plan) in plans.enumerate() {
        plans_versions.push(plan.catalog_version);
        sealed &= plan.sealed;
        for e in &plan.fresh {
            if seen.insert(e.id.as_str()) {
                fresh.push(e.clone());
                owners.push(i);
            } else {
                repeated[i] += 1;
            }
        }
    }
    let mut versions = plans_versions.into_iter();
    let first = versions.next().flatten();
    let merged = PublishPlan {
        ids: Vec::new(),
        fresh,
        duplicates: 0,
        // Checked against one catalog, or checked again by the write.
        catalog_version: first.filter(|_| versions.all(|v| v == first)),
        sealed,
    };
    (merged, owners, repeated)
}

/// The answer for `plan` when `written` of its fresh events went to the
/// store, which accepted `accepted` of them, and `repeated` were left out
/// as ids of earlier batches of the group.
fn answer(plan: PublishPlan, written: usize, accepted: usize, repeated: usize) -> PublishOutcome {
    PublishOutcome {
        accepted,
        duplicates: plan.duplicates + repeated + (written - accepted),
        lanes: plan.lanes(),
        ids: plan.ids,
    }
}

fn answer_alone(plan: PublishPlan, stored: &HashSet<String>) -> PublishOutcome {
    let written = plan.fresh.len();
    let accepted = plan
        .fresh
        .iter()
        .filter(|e| !stored.contains(&e.id))
        .count();
    answer(plan, written, accepted, 0)
}

/// Whether the batches of a group of `batches` whose write failed with `e`
/// are written again, each alone: after a wait for a lock (a group waits
/// only briefly, see [`GroupWriter::write_group`]), and, for a group of
/// several, after an error that may come from one batch's events; not when
/// the store is unreachable.
fn retry_alone(e: &StoreError, batches: usize) -> bool {
    match e {
        StoreError::Unavailable(_) => false,
        StoreError::Timeout(_) => true,
        _ => batches > 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NewEvent;
    use std::time::Duration;

    fn plan(events: &[(Option<&str>, Option<&str>)]) -> PublishPlan {
        let events = events
            .iter()
            .map(|(id, key)| NewEvent {
                id: id.map(Into::into),
                event_type: "t".into(),
                key: key.map(Into::into),
                payload: b"{}".to_vec(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect();
        PublishPlan::new(events, 16).expect("valid")
    }

    #[test]
    fn merge_keeps_arrival_order_and_leaves_out_ids_of_earlier_batches() {
        let a = plan(&[(Some("x"), Some("k")), (Some("y"), Some("k"))]);
        let b = plan(&[(Some("x"), Some("j")), (None, Some("k"))]);
        let (merged, owners, repeated) = merge([&a, &b].into_iter());
        let ids: Vec<&str> = merged.fresh.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(&ids[..2], ["x", "y"]);
        assert_eq!(owners, vec![0, 0, 1]);
        assert_eq!(repeated, vec![0, 1]);
        // Key k: a's two events, then b's one, in that order.
        assert_eq!(merged.seq_offsets(), vec![2, 1, 0]);
        let out = answer(b, 1, 1, 1);
        assert_eq!((out.accepted, out.duplicates, out.ids.len()), (1, 1, 2));
    }

    /// A store that fails a write holding `poison` and records the ids of
    /// each write that committed; it numbers keyed events per key and
    /// checks their expected sequences as the backends do.
    #[derive(Clone, Default)]
    struct Fake {
        committed: Arc<Mutex<Vec<Vec<String>>>>,
        stored: Arc<Mutex<HashSet<String>>>,
        seqs: Arc<Mutex<std::collections::HashMap<String, i64>>>,
    }

    #[async_trait]
    impl GroupWriter for Fake {
        async fn write_plan(&self, plan: &PublishPlan) -> Result<HashSet<String>> {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            let ids: Vec<String> = plan.fresh.iter().map(|e| e.id.clone()).collect();
            if ids.iter().any(|id| id == "poison") {
                return Err(StoreError::Database("poison".into()));
            }
            let mut stored = self.stored.lock().expect("lock");
            let found: HashSet<String> = ids
                .iter()
                .filter(|id| stored.contains(*id))
                .cloned()
                .collect();
            let mut seqs = self.seqs.lock().expect("lock");
            let mut next = seqs.clone();
            let written: Vec<_> = plan
                .fresh
                .iter()
                .filter(|e| !found.contains(&e.id))
                .map(|e| {
                    let seq = e.key.as_ref().map(|k| {
                        let n = next.entry(k.clone()).or_default();
                        *n += 1;
                        *n
                    });
                    (e, seq)
                })
                .collect();
            crate::common::check_expected(written)?;
            *seqs = next;
            stored.extend(ids.iter().cloned());
            self.committed.lock().expect("lock").push(ids);
            Ok(found)
        }
    }

    #[test]
    fn regroup_waits_after_small_groups_and_backs_off_when_callers_stay_away() {
        let mut r = Regroup::default();
        // A lone batch, a large group or queue, a queue that fills a group:
        // write at once.
        assert_eq!(r.wait_for(0, 1, false), None);
        assert_eq!(r.wait_for(0, REGROUP_BELOW, false), None);
        assert_eq!(r.wait_for(REGROUP_BELOW, 4, false), None);
        assert_eq!(r.wait_for(3, 8, true), None);
        // After a group of 8, with 3 queued: wait for 8 queued after it.
        assert_eq!(r.wait_for(3, 8, false), Some(8));
        r.waited(8, 8);
        assert_eq!(r.wait_for(0, 8, false), Some(8));
        // Not paid off (5 of 8 came): skip 4 chances, then 8 after the next.
        r.waited(5, 8);
        for _ in 0..4 {
            assert_eq!(r.wait_for(0, 8, false), None);
        }
        assert_eq!(r.wait_for(0, 8, false), Some(8));
        r.waited(0, 8);
        for _ in 0..8 {
            assert_eq!(r.wait_for(0, 8, false), None);
        }
        // 6 of 8 (3 in 4) pays off and resets the back-off.
        assert_eq!(r.wait_for(0, 8, false), Some(8));
        r.waited(6, 8);
        assert_eq!(r.wait_for(0, 8, false), Some(8));
        // Up to 1,024 (1 of 2 does not pay off), and a wait that paid off
        // resets it.
        for _ in 0..20 {
            while r.wait_for(0, 2, false).is_none() {}
            r.waited(1, 2);
        }
        assert_eq!(r.backoff, 1024);
        while r.wait_for(0, 2, false).is_none() {}
        r.waited(2, 2);
        assert_eq!(r.wait_for(0, 2, false), Some(2));
    }

    /// Eight callers that publish one event `rounds` times, each again as
    /// soon as it is answered, half of them a little later than the others
    /// (a few scheduler turns), the last one `straggler` later. Returns the
    /// grouper's counts and the groups written (their event ids), in order.
    async fn closed_loop(rounds: usize, straggler: Duration) -> (GroupStats, Vec<Vec<String>>) {
        let grouper = Arc::new(Grouper::default());
        let fake = Fake::default();
        let mut tasks = Vec::new();
        for c in 0..8 {
            let (g, w) = (grouper.clone(), fake.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..rounds {
                    if i > 0 && c == 7 && !straggler.is_zero() {
                        tokio::time::sleep(straggler).await;
                    }
                    if c >= 4 {
                        for _ in 0..3 {
                            tokio::task::yield_now().await;
                        }
                    }
                    let id = format!("c{c}-{i}");
                    g.publish(&w, plan(&[(Some(id.as_str()), None)]))
                        .await
                        .expect("publish");
                }
            }));
        }
        for t in tasks {
            t.await.expect("task");
        }
        let groups = fake.committed.lock().expect("lock").clone();
        (grouper.stats(), groups)
    }

    // The writer waits for the late half instead of writing the early half
    // alone, so the callers stay in one group rather than two taking turns
    // (without the wait: 40 writes, groups of 4). The clock is paused: it
    // moves only when every task waits, so the timing is exact.
    #[tokio::test(start_paused = true)]
    async fn callers_publishing_again_at_once_stay_in_one_group() {
        let (stats, _) = closed_loop(20, Duration::ZERO).await;
        assert_eq!(stats.publishes, 160);
        assert!(
            stats.writes <= 22,
            "{} writes for 160 publishes: groups of {:.1}",
            stats.writes,
            160.0 / stats.writes as f64
        );
    }

    // One of the eight callers comes back 3 ms after its answer, later than
    // the wait (writes take 5 ms): the wait still pays off with the other
    // seven, so groups of 7 and 8 take turns while all eight publish (when
    // a wait needed every caller: 7 then 1, 32 writes).
    #[tokio::test(start_paused = true)]
    async fn one_late_caller_does_not_stop_the_regrouping() {
        let (stats, groups) = closed_loop(20, Duration::from_millis(3)).await;
        assert_eq!(stats.publishes, 160);
        // The late caller is behind; its last rounds are written alone.
        let together = 1 + groups
            .iter()
            .rposition(|g| g.iter().any(|id| id.starts_with("c0-")))
            .expect("written");
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        assert!(
            together <= 22,
            "{together} writes while all eight published: {sizes:?}"
        );
    }

    // On a multi-thread runtime, callers answered on the other worker
    // publish again before the writer looks at the queue. The writer used
    // to count them as already waiting and wait for as many more, which
    // never came: its waits ran out, and groups of 1 and 7 took turns (164
    // to 169 writes for these 800 publishes, in every run). It counts from
    // the queue as it was before its answers went out (101). Real time on
    // real threads: a thread held off the CPU past a wait also costs
    // writes, so the best of three runs is asserted.
    #[test]
    fn callers_answered_on_a_multi_thread_runtime_come_back_into_one_group() {
        let mut runs = Vec::new();
        for _ in 0..3 {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            let (stats, groups) = rt.block_on(closed_loop(100, Duration::ZERO));
            assert_eq!(stats.publishes, 800);
            runs.push((
                stats.writes,
                groups.iter().map(Vec::len).collect::<Vec<_>>(),
            ));
        }
        let (writes, sizes) = runs.iter().min_by_key(|r| r.0).expect("three runs");
        assert!(*writes <= 130, "{writes} writes at best: {sizes:?}");
    }

    #[test]
    fn a_queue_fills_a_group_by_events_bytes_or_a_batch_that_starts_one() {
        let queue = |plans: Vec<PublishPlan>| Queue {
            jobs: plans
                .into_iter()
                .map(|plan| Job {
                    plan,
                    answer: oneshot::channel().0,
                })
                .collect(),
            ..Queue::default()
        };
        assert!(!queue(Vec::new()).fills_group());
        let small = || {
            (0..3)
                .map(|c| sized(&format!("s{c}"), 10, 2))
                .collect::<Vec<_>>()
        };
        assert!(!queue(small()).fills_group());
        // Events: four full batches are a group.
        let full = |n: usize| {
            (0..n)
                .map(|c| sized(&format!("f{c}"), MAX_BATCH, 2))
                .collect()
        };
        assert!(!queue(full(3)).fills_group());
        assert!(queue(full(4)).fills_group());
        // Bytes.
        let big = GROUP_PAYLOAD_BYTES / 20;
        assert!(!queue(vec![sized("b0", 11, big)]).fills_group());
        assert!(queue(vec![sized("b0", 11, big), sized("b1", 11, big)]).fills_group());
        // A batch expecting a key that an earlier queued batch writes.
        let mut plans = small();
        plans.push(expecting("e0", "k", None));
        assert!(!queue(plans.clone()).fills_group());
        plans.push(expecting("e1", "k", Some(1)));
        assert!(queue(plans).fills_group());
    }

    // On one thread every caller queues before the writer task first runs:
    // one group of 16, which fails, then each batch alone.
    #[tokio::test]
    async fn a_failed_group_is_written_batch_by_batch_and_each_caller_answered() {
        let grouper = Arc::new(Grouper::default());
        let fake = Fake::default();
        fake.stored.lock().expect("lock").insert("old".into());
        let mut tasks = Vec::new();
        for c in 0..16 {
            let (g, w) = (grouper.clone(), fake.clone());
            tasks.push(tokio::spawn(async move {
                let events: Vec<(Option<String>, Option<&str>)> = match c {
                    3 => vec![(Some("c3".into()), None), (Some("poison".into()), None)],
                    4 => vec![(Some("old".into()), None), (Some("c4".into()), None)],
                    _ => vec![(Some(format!("c{c}")), Some("k"))],
                };
                let events: Vec<(Option<&str>, Option<&str>)> =
                    events.iter().map(|(id, k)| (id.as_deref(), *k)).collect();
                g.publish(&w, plan(&events)).await
            }));
        }
        for (c, t) in tasks.into_iter().enumerate() {
            let result = t.await.expect("task");
            match c {
                3 => assert!(matches!(result, Err(StoreError::Database(_))), "{result:?}"),
                4 => {
                    let out = result.expect("publish");
                    assert_eq!((out.accepted, out.duplicates), (1, 1));
                }
                _ => {
                    let out = result.expect("publish");
                    assert_eq!(
                        (out.accepted, out.duplicates, out.ids),
                        (1, 0, vec![format!("c{c}")])
                    );
                }
            }
        }
        let committed = fake.committed.lock().expect("lock").clone();
        let all: Vec<&String> = committed.iter().flatten().collect();
        assert!(
            !all.iter().any(|id| *id == "c3"),
            "nothing of the refused batch"
        );
        assert_eq!(all.len(), 16, "every other event once, and old again");
        assert_eq!(
            grouper.stats(),
            GroupStats {
                publishes: 16,
                writes: 1 + 16
            }
        );
    }

    /// Publishes each plan from a task of its own, all queued before the
    /// writer first runs (on one thread), and returns their answers in
    /// order.
    async fn publish_all(
        grouper: &Arc<Grouper>,
        fake: &Fake,
        plans: Vec<PublishPlan>,
    ) -> Vec<Result<PublishOutcome>> {
        let tasks: Vec<_> = plans
            .into_iter()
            .map(|p| {
                let (g, w) = (grouper.clone(), fake.clone());
                tokio::spawn(async move { g.publish(&w, p).await })
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.expect("task"));
        }
        results
    }

    /// A batch of one event of `key` with id `id`, expecting `expected`.
    fn expecting(id: &str, key: &str, expected: Option<i64>) -> PublishPlan {
        let e = NewEvent {
            id: Some(id.into()),
            event_type: "t".into(),
            key: Some(key.into()),
            payload: b"{}".to_vec(),
            deliver_at: None,
            expected_seq: expected,
        };
        PublishPlan::new(vec![e], 16).expect("valid")
    }

    // On one thread every caller queues before the writer task first runs.
    // Callers 0 to 5 form one group (other keys, right expectations, and
    // caller 3's wrong one), which fails on caller 3 and is written batch
    // by batch; callers 6 and 7 expect key k where an earlier batch of the
    // group writes it, so each starts a group of its own: 6 wins k's 4th
    // sequence, 7 is told k is at 4 (3 is told 3, or 4 when its batch was
    // written alone after 6's).
    #[tokio::test]
    async fn a_broken_expectation_fails_only_its_caller() {
        let grouper = Arc::new(Grouper::default());
        let fake = Fake::default();
        fake.seqs.lock().expect("lock").insert("k".into(), 3);
        let plans = vec![
            expecting("c0", "j0", None),
            expecting("c1", "j1", Some(0)),
            expecting("c2", "j2", None),
            expecting("c3", "k", Some(2)),
            expecting("c4", "j4", Some(0)),
            expecting("c5", "j0", None),
            expecting("c6", "k", Some(3)),
            expecting("c7", "k", Some(3)),
        ];
        let results = publish_all(&grouper, &fake, plans).await;
        for (c, result) in results.into_iter().enumerate() {
            match c {
                3 => assert!(
                    matches!(&result, Err(StoreError::SeqConflict { key, expected: 2, current: 3 | 4, .. })
                        if key == "k"),
                    "{result:?}"
                ),
                7 => assert!(
                    matches!(
                        &result,
                        Err(StoreError::SeqConflict {
                            expected: 3,
                            current: 4,
                            ..
                        })
                    ),
                    "{result:?}"
                ),
                _ => assert_eq!(result.expect("stored").accepted, 1, "caller {c}"),
            }
        }
        let seqs = fake.seqs.lock().expect("lock").clone();
        assert_eq!(
            (seqs["k"], seqs["j0"], seqs["j1"], seqs["j4"]),
            (4, 2, 1, 1)
        );
        // The group of six, each of its batches alone, then 6's and 7's.
        assert_eq!(
            grouper.stats(),
            GroupStats {
                publishes: 8,
                writes: 1 + 6 + 2
            }
        );
    }

    #[test]
    fn a_writer_dropped_with_its_runtime_lets_the_next_publish_start_one() {
        let grouper = Arc::new(Grouper::default());
        let fake = Fake::default();
        {
            let rt = timed_runtime();
            let (g, w) = (grouper.clone(), fake.clone());
            // The caller gives up before the writer's write ends; the
            // runtime then ends with the writer task unfinished.
            let result = rt.block_on(async move {
                let call = g.publish(&w, plan(&[(Some("a"), None)]));
                tokio::time::timeout(std::time::Duration::from_millis(1), call).await
            });
            assert!(result.is_err(), "no answer before the write ends");
        }
        let rt = timed_runtime();
        next_publish_is_served(&rt, &grouper, &fake);
    }

    fn timed_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    }

    /// Asserts that a publish on `rt` is written and answered (a writer
    /// starts for it).
    fn next_publish_is_served(rt: &tokio::runtime::Runtime, grouper: &Arc<Grouper>, fake: &Fake) {
        // A generous bound: without a new writer the call would never end.
        let call = grouper.publish(fake, plan(&[(Some("b"), None)]));
        let out = rt
            .block_on(async {
                tokio::time::timeout(std::time::Duration::from_secs(30), call).await
            })
            .expect("a new writer serves the next publish")
            .expect("publish");
        assert_eq!(out.accepted, 1);
    }

    // tokio drops a task spawned onto a runtime that has shut down without
    // polling it: the writer's guard must still clear `writing`, or every
    // later publish would queue behind a writer that never runs.
    #[test]
    fn a_writer_spawned_onto_a_stopped_runtime_lets_the_next_publish_start_one() {
        use std::future::Future as _;
        let grouper = Arc::new(Grouper::default());
        let fake = Fake::default();
        let stopped = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let stopped_handle = stopped.handle().clone();
        drop(stopped);
        let rt = timed_runtime();
        let first = rt.block_on(async {
            let mut call = std::pin::pin!(grouper.publish(&fake, plan(&[(Some("a"), None)])));
            // The first poll queues the batch and spawns its writer, onto
            // the stopped runtime.
            let polled = {
                let _stopped = stopped_handle.enter();
                std::future::poll_fn(|cx| std::task::Poll::Ready(call.as_mut().poll(cx))).await
            };
            match polled {
                std::task::Poll::Ready(result) => Ok(result),
                std::task::Poll::Pending => {
                    tokio::time::timeout(std::time::Duration::from_secs(5), call).await
                }
            }
        });
        let first = first.expect("the caller is answered, not left waiting");
        assert!(first.is_err(), "no writer ran: {first:?}");
        next_publish_is_served(&rt, &grouper, &fake);
    }

    /// A batch of `n` events with client ids `{tag}-{i}`, payloads of
    /// `bytes` bytes each.
    fn sized(tag: &str, n: usize, bytes: usize) -> PublishPlan {
        let payload = format!("\"{}\"", "a".repeat(bytes - 2)).into_bytes();
        let events = (0..n)
            .map(|i| NewEvent {
                id: Some(format!("{tag}-{i}")),
                event_type: "t".into(),
                key: None,
                payload: payload.clone(),
                deliver_at: None,
                expected_seq: None,
            })
            .collect();
        PublishPlan::new(events, 16).expect("valid")
    }

    // On one thread every caller queues before the writer task first runs.
    #[tokio::test]
    async fn a_group_stops_at_its_event_and_payload_bounds() {
        let grouper = Arc::new(Grouper::default());
        let fake = Fake::default();
        let mut plans: Vec<PublishPlan> = (0..5)
            .map(|c| sized(&format!("n{c}"), MAX_BATCH, 2))
            .collect();
        let big = GROUP_PAYLOAD_BYTES / 20;
        plans.push(sized("b0", 11, big));
        plans.push(sized("b1", 11, big));
        plans.push(sized("s", 1, 2));
        for result in publish_all(&grouper, &fake, plans).await {
            result.expect("publish");
        }
        let sizes: Vec<usize> = fake
            .committed
            .lock()
            .expect("lock")
            .iter()
            .map(Vec::len)
            .collect();
        // Four full batches; the fifth and the first big one; the second big
        // one (both would pass the payload bound) and the small one.
        assert_eq!(sizes, vec![4 * MAX_BATCH, MAX_BATCH + 11, 11 + 1]);
    }
}
