//! `StoreActor`: one per node; turns many small requests into few statements.
//!
//! ```text
//!  LaneOwner ──ClaimLane──┐                      ┌─ complete([...])     one call
//!  KeyHandler ─Complete───┤  pending, per tick   ├─ reschedule([...])   one call
//!  KeyHandler ─Reschedule─┼──────────────────────┼─ dead_letter([...])  one call
//!  KeyHandler ─DeadLetter─┤  (size or interval)  ├─ discard([...])     one call
//!  LaneOwner ──Discard────┘                      └─ claim([lanes...])   one call
//! ```
//!
//! A tick starts when the first request arrives and fires after
//! [`StoreActorConfig::flush_interval`], or at once when
//! [`StoreActorConfig::max_batch`] requests are waiting. One tick runs its
//! calls one after another, completions before claims, and the next tick
//! starts only when the previous one finished. That order matters for the
//! lane owners' de-duplication (see [`crate::ordering`]): a claim issued
//! after a completion was acknowledged runs after that completion committed.
//!
//! Every requester gets its own part of the answer. Items refused by fencing
//! (the store did not act on them) are counted in
//! `lanebus_store_fenced_out_total`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use lanebus_store::{
    DeadLetterRequest, DeliveryRef, LaneBatch, LaneClaim, Reschedule, Store, StoreError,
};
use tokio::sync::oneshot;

use crate::metrics;

/// Why a request to the store actor got no answer from the store.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreCallError {
    /// The store call failed (the whole batch it was part of).
    #[error("{0}")]
    Store(String),
    /// The store actor stopped before answering.
    #[error("store actor stopped")]
    Stopped,
}

impl From<&StoreError> for StoreCallError {
    fn from(e: &StoreError) -> Self {
        StoreCallError::Store(e.to_string())
    }
}

/// Tuning of the store actor.
#[derive(Debug, Clone, Copy)]
pub struct StoreActorConfig {
    /// Longest wait between the first request of a tick and its flush
    /// (default 2 ms).
    pub flush_interval: Duration,
    /// Requests that trigger a flush at once (default 512).
    pub max_batch: usize,
}

impl Default for StoreActorConfig {
    fn default() -> Self {
        StoreActorConfig {
            flush_interval: Duration::from_millis(2),
            max_batch: 512,
        }
    }
}

/// Command: read due and waiting deliveries of one lane (batched with other
/// lanes' claims). Answers the lane's part; `owned == false` means fenced out.
#[derive(Debug, Message)]
#[rtype(result = "Result<LaneBatch, StoreCallError>")]
pub struct ClaimLane(pub LaneClaim);

/// Command: record a completion. Answers `true` if the store removed the
/// delivery, `false` if it refused (fenced out, or the row is gone).
#[derive(Debug, Message)]
#[rtype(result = "Result<bool, StoreCallError>")]
pub struct CompleteDelivery(pub DeliveryRef);

/// Command: record a failed attempt and the next due time. Answers `true` if
/// the store updated the delivery.
#[derive(Debug, Message)]
#[rtype(result = "Result<bool, StoreCallError>")]
pub struct RescheduleDelivery(pub Reschedule);

/// Command: discard a delivery whose handler is gone (no completion row,
/// [`Store::discard`]). Answers `true` if the store deleted it.
#[derive(Debug, Message)]
#[rtype(result = "Result<bool, StoreCallError>")]
pub struct DiscardDelivery(pub DeliveryRef);

/// Command: move a delivery to the dead letters. Answers `true` if moved.
#[derive(Debug, Message)]
#[rtype(result = "Result<bool, StoreCallError>")]
pub struct DeadLetterDelivery(pub DeadLetterRequest);

type Reply<T> = oneshot::Sender<Result<T, StoreCallError>>;

#[derive(Default)]
struct Pending {
    claims: Vec<(LaneClaim, Reply<LaneBatch>)>,
    completes: Vec<(DeliveryRef, Reply<bool>)>,
    reschedules: Vec<(Reschedule, Reply<bool>)>,
    dead_letters: Vec<(DeadLetterRequest, Reply<bool>)>,
    discards: Vec<(DeliveryRef, Reply<bool>)>,
}

impl Pending {
    fn len(&self) -> usize {
        self.claims.len()
            + self.completes.len()
            + self.reschedules.len()
            + self.dead_letters.len()
            + self.discards.len()
    }
}

/// The store actor. See the module docs.
pub struct StoreActor {
    store: Arc<dyn Store>,
    config: StoreActorConfig,
    pending: Pending,
    busy: bool,
    timer: Option<SpawnHandle>,
}

impl StoreActor {
    /// A store actor over `store`.
    pub fn new(store: Arc<dyn Store>, config: StoreActorConfig) -> Self {
        StoreActor {
            store,
            config,
            pending: Pending::default(),
            busy: false,
            timer: None,
        }
    }

    fn enqueued(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        if self.pending.len() >= self.config.max_batch {
            if let Some(t) = self.timer.take() {
                ctx.cancel_future(t);
            }
            self.flush(ctx);
        } else if self.timer.is_none() {
            self.timer = Some(ctx.run_later(self.config.flush_interval, |act, ctx| {
                act.timer = None;
                act.flush(ctx);
            }));
        }
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        if self.busy || self.pending.len() == 0 {
            return;
        }
        self.busy = true;
        let batch = std::mem::take(&mut self.pending);
        let store = self.store.clone();
        ctx.spawn(run_tick(store, batch).into_actor(self).map(|(), act, ctx| {
            act.busy = false;
            if act.pending.len() > 0 {
                // These waited for a whole tick already: go at once.
                act.flush(ctx);
            }
        }));
    }
}

async fn run_tick(store: Arc<dyn Store>, batch: Pending) {
    let Pending {
        claims,
        completes,
        reschedules,
        dead_letters,
        discards,
    } = batch;
    if !completes.is_empty() {
        let refs: Vec<DeliveryRef> = completes.iter().map(|(r, _)| *r).collect();
        answer_items(store.complete(&refs).await, completes, |r| r.id, "complete");
    }
    if !reschedules.is_empty() {
        let items: Vec<Reschedule> = reschedules.iter().map(|(r, _)| r.clone()).collect();
        answer_items(
            store.reschedule(&items).await,
            reschedules,
            |r| r.id,
            "reschedule",
        );
    }
    if !dead_letters.is_empty() {
        let items: Vec<DeadLetterRequest> = dead_letters.iter().map(|(r, _)| r.clone()).collect();
        answer_items(
            store.dead_letter(&items).await,
            dead_letters,
            |r| r.id,
            "dead_letter",
        );
    }
    if !discards.is_empty() {
        let refs: Vec<DeliveryRef> = discards.iter().map(|(r, _)| *r).collect();
        answer_items(store.discard(&refs).await, discards, |r| r.id, "discard");
    }
    if !claims.is_empty() {
        // One lane once per call; a repeated lane (not expected) gets an
        // empty answer that keeps its cursor.
        let mut seen = HashSet::new();
        let mut lanes = Vec::with_capacity(claims.len());
        for (c, _) in &claims {
            if seen.insert(c.lane) {
                lanes.push(c.clone());
            }
        }
        match store.claim(&lanes).await {
            Ok(batches) => {
                let mut by_lane: std::collections::HashMap<_, _> =
                    batches.into_iter().map(|b| (b.lane, b)).collect();
                let fenced = by_lane.values().filter(|b| !b.owned).count() as u64;
                metrics::fenced_out("claim", fenced);
                for (c, reply) in claims {
                    let part = by_lane.remove(&c.lane).unwrap_or(LaneBatch {
                        lane: c.lane,
                        owned: true,
                        deliveries: Vec::new(),
                        next_after: c.after.clone(),
                    });
                    let _ = reply.send(Ok(part));
                }
            }
            Err(e) => {
                metrics::store_error("claim");
                tracing::warn!(error = %e, lanes = lanes.len(), "claim failed");
                let err = StoreCallError::from(&e);
                for (_, reply) in claims {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
}

fn answer_items<T>(
    result: Result<Vec<i64>, StoreError>,
    items: Vec<(T, Reply<bool>)>,
    id_of: impl Fn(&T) -> i64,
    op: &'static str,
) {
    match result {
        Ok(done) => {
            let done: HashSet<i64> = done.into_iter().collect();
            let refused = items
                .iter()
                .filter(|(t, _)| !done.contains(&id_of(t)))
                .count() as u64;
            metrics::fenced_out(op, refused);
            for (t, reply) in items {
                let _ = reply.send(Ok(done.contains(&id_of(&t))));
            }
        }
        Err(e) => {
            metrics::store_error(op);
            tracing::warn!(error = %e, op, items = items.len(), "store call failed");
            let err = StoreCallError::from(&e);
            for (_, reply) in items {
                let _ = reply.send(Err(err.clone()));
            }
        }
    }
}

impl Actor for StoreActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Requests arrive in bursts from many lanes; let the mailbox hold them.
        ctx.set_mailbox_capacity(usize::MAX >> 4);
    }
}

fn waiter<T: Send + 'static>(
    rx: oneshot::Receiver<Result<T, StoreCallError>>,
) -> ResponseFuture<Result<T, StoreCallError>> {
    Box::pin(async move { rx.await.unwrap_or(Err(StoreCallError::Stopped)) })
}

impl Handler<ClaimLane> for StoreActor {
    type Result = ResponseFuture<Result<LaneBatch, StoreCallError>>;

    fn handle(&mut self, msg: ClaimLane, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.pending.claims.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<CompleteDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: CompleteDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.pending.completes.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<RescheduleDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: RescheduleDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.pending.reschedules.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<DeadLetterDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: DeadLetterDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.pending.dead_letters.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<DiscardDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: DiscardDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.pending.discards.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}
