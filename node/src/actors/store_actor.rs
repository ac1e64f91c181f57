//! `StoreActor`: one per node; turns many small requests into few statements.
//!
//! ```text
//!  LaneOwner ──ClaimLane──┐                      ┌─ complete([...])     one call
//!  KeyRunner ──Complete───┤  pending, per tick   ├─ reschedule([...])   one call
//!  KeyRunner ──Reschedule─┼──────────────────────┼─ dead_letter([...])  one call
//!  KeyRunner ──DeadLetter─┤  (size or interval)  ├─ discard([...])     one call
//!  LaneOwner ──Discard────┘                      └─ claim([lanes...])   one call
//! ```
//!
//! Two tracks, each in ticks: *writes* (completions, reschedules, dead
//! letters, discards) and *claims*. A writes tick starts when the first
//! write arrives and fires after [`StoreActorConfig::flush_interval`], or at
//! once when [`StoreActorConfig::max_batch`] writes are waiting. A claim
//! goes at once when no claim call is under way (a wake-up on an idle store
//! waits for no tick); claims that arrive during a call go together as the
//! next tick, right after it. A writes tick runs its calls one after
//! another; the claims tick runs beside it, so a write that waits (a row
//! lock, a slow statement) does not hold claims behind it. A track's next
//! tick starts when its previous one finished. The lane owners'
//! de-duplication (see [`crate::ordering`]) needs only this: a claim issued
//! after a completion was acknowledged runs after that completion
//! committed, which holds because the acknowledgement is sent after the
//! commit.
//!
//! A claims tick asks for each lane once: a second claim of a lane in the
//! same tick (an old owner stopping while a new one starts, at a higher
//! epoch) waits for the next tick, so each gets its own answer from the
//! store.
//!
//! Every store call is bounded by [`StoreActorConfig::call_timeout`] (the
//! backends bound their statements too: PostgreSQL's statement and lock
//! timeouts); a call past it is answered as failed.
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
    /// Longest wait between the first write of a writes tick and its flush
    /// (default 2 ms); claims do not wait for it.
    pub flush_interval: Duration,
    /// Writes that trigger a flush at once (default 512).
    pub max_batch: usize,
    /// Longest wait for one store call before its requesters are answered
    /// with an error (default 60 s; the call's outcome is then unknown, as
    /// after a lost connection).
    pub call_timeout: Duration,
}

impl Default for StoreActorConfig {
    fn default() -> Self {
        StoreActorConfig {
            flush_interval: Duration::from_millis(2),
            max_batch: 512,
            call_timeout: Duration::from_secs(60),
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

/// Command: start no more store calls and answer once the calls under way
/// have ended (each is bounded by [`StoreActorConfig::call_timeout`]; the
/// node waits for the answer until its drain deadline, at least 5 s).
/// Requests waiting for a tick, and those arriving later, are answered
/// [`StoreCallError::Stopped`] without reaching the store. The node sends it
/// before its runtime goes: a call cut off there would leave its outcome
/// unknown and, on MongoDB, its transaction open on the server (the
/// driver's abort of a dropped session runs as a task of that runtime).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Quiesce;

type Reply<T> = oneshot::Sender<Result<T, StoreCallError>>;

#[derive(Default)]
struct Writes {
    completes: Vec<(DeliveryRef, Reply<bool>)>,
    reschedules: Vec<(Reschedule, Reply<bool>)>,
    dead_letters: Vec<(DeadLetterRequest, Reply<bool>)>,
    discards: Vec<(DeliveryRef, Reply<bool>)>,
}

impl Writes {
    fn len(&self) -> usize {
        self.completes.len()
            + self.reschedules.len()
            + self.dead_letters.len()
            + self.discards.len()
    }
}

type Claims = Vec<(LaneClaim, Reply<LaneBatch>)>;

/// The store actor. See the module docs.
pub struct StoreActor {
    store: Arc<dyn Store>,
    config: StoreActorConfig,
    claims: Claims,
    writes: Writes,
    claims_busy: bool,
    writes_busy: bool,
    timer: Option<SpawnHandle>,
    /// [`Quiesce`]d: no store call starts any more.
    stopping: bool,
    /// Answered once no call is under way (see [`Quiesce`]).
    idle: Vec<oneshot::Sender<()>>,
}

impl StoreActor {
    /// A store actor over `store`.
    pub fn new(store: Arc<dyn Store>, config: StoreActorConfig) -> Self {
        StoreActor {
            store,
            config,
            claims: Vec::new(),
            writes: Writes::default(),
            claims_busy: false,
            writes_busy: false,
            timer: None,
            stopping: false,
            idle: Vec::new(),
        }
    }

    fn enqueued(&mut self, ctx: &mut Context<Self>) {
        if self.stopping {
            // Dropping the replies answers `Stopped`.
            self.claims.clear();
            self.writes = Writes::default();
            return;
        }
        // No-op while a claim call is under way: its end starts the next.
        self.flush_claims(ctx);
        let waiting = if self.writes_busy {
            0
        } else {
            self.writes.len()
        };
        if waiting == 0 {
            return;
        }
        if waiting >= self.config.max_batch {
            if let Some(t) = self.timer.take() {
                ctx.cancel_future(t);
            }
            self.flush_writes(ctx);
        } else if self.timer.is_none() {
            self.timer = Some(ctx.run_later(self.config.flush_interval, |act, ctx| {
                act.timer = None;
                act.flush_writes(ctx);
            }));
        }
    }

    /// Answers the [`Quiesce`] waiters once no call is under way.
    fn check_idle(&mut self) {
        if !self.claims_busy && !self.writes_busy {
            for tx in self.idle.drain(..) {
                let _ = tx.send(());
            }
        }
    }

    fn flush_writes(&mut self, ctx: &mut Context<Self>) {
        if self.writes_busy || self.writes.len() == 0 {
            return;
        }
        self.writes_busy = true;
        let batch = std::mem::take(&mut self.writes);
        let (store, limit) = (self.store.clone(), self.config.call_timeout);
        ctx.spawn(
            run_writes(store, limit, batch)
                .into_actor(self)
                .map(|(), act, ctx| {
                    act.writes_busy = false;
                    act.check_idle();
                    // These waited for a whole tick already: go at once.
                    act.flush_writes(ctx);
                }),
        );
    }

    fn flush_claims(&mut self, ctx: &mut Context<Self>) {
        if self.claims_busy || self.claims.is_empty() {
            return;
        }
        self.claims_busy = true;
        let (batch, repeated) = one_per_lane(std::mem::take(&mut self.claims));
        self.claims = repeated;
        let (store, limit) = (self.store.clone(), self.config.call_timeout);
        ctx.spawn(
            run_claims(store, limit, batch)
                .into_actor(self)
                .map(|(), act, ctx| {
                    act.claims_busy = false;
                    act.check_idle();
                    act.flush_claims(ctx);
                }),
        );
    }
}

/// Splits `claims` into the first claim of each lane, in arrival order, and
/// the repeats, which wait for the next tick.
fn one_per_lane(claims: Claims) -> (Claims, Claims) {
    let mut seen = HashSet::new();
    claims.into_iter().partition(|(c, _)| seen.insert(c.lane))
}

/// `call`, or [`StoreError::Unavailable`] once `limit` has passed.
async fn bounded<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(StoreError::Unavailable(format!(
            "no answer from the store within {limit:?}"
        )))
    })
}

async fn run_writes(store: Arc<dyn Store>, limit: Duration, batch: Writes) {
    let Writes {
        completes,
        reschedules,
        dead_letters,
        discards,
    } = batch;
    if !completes.is_empty() {
        let refs: Vec<DeliveryRef> = completes.iter().map(|(r, _)| *r).collect();
        let done = bounded(limit, store.complete(&refs)).await;
        answer_items(done, completes, |r| r.id, "complete");
    }
    if !reschedules.is_empty() {
        let items: Vec<Reschedule> = reschedules.iter().map(|(r, _)| r.clone()).collect();
        let done = bounded(limit, store.reschedule(&items)).await;
        answer_items(done, reschedules, |r| r.id, "reschedule");
    }
    if !dead_letters.is_empty() {
        let items: Vec<DeadLetterRequest> = dead_letters.iter().map(|(r, _)| r.clone()).collect();
        let done = bounded(limit, store.dead_letter(&items)).await;
        answer_items(done, dead_letters, |r| r.id, "dead_letter");
    }
    if !discards.is_empty() {
        let refs: Vec<DeliveryRef> = discards.iter().map(|(r, _)| *r).collect();
        let done = bounded(limit, store.discard(&refs)).await;
        answer_items(done, discards, |r| r.id, "discard");
    }
}

/// Claims of distinct lanes ([`one_per_lane`]), one store call.
async fn run_claims(store: Arc<dyn Store>, limit: Duration, claims: Claims) {
    let lanes: Vec<LaneClaim> = claims.iter().map(|(c, _)| c.clone()).collect();
    match bounded(limit, store.claim(&lanes)).await {
        Ok(batches) => {
            let mut by_lane: std::collections::HashMap<_, _> =
                batches.into_iter().map(|b| (b.lane, b)).collect();
            let fenced = by_lane.values().filter(|b| !b.owned).count() as u64;
            metrics::fenced_out("claim", fenced);
            for (c, reply) in claims {
                let part = by_lane.remove(&c.lane).ok_or_else(|| {
                    StoreCallError::Store(format!("the store did not answer lane {}", c.lane))
                });
                let _ = reply.send(part);
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

impl Handler<Quiesce> for StoreActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Quiesce, ctx: &mut Self::Context) -> Self::Result {
        self.stopping = true;
        if let Some(t) = self.timer.take() {
            ctx.cancel_future(t);
        }
        self.enqueued(ctx);
        let (tx, rx) = oneshot::channel();
        self.idle.push(tx);
        self.check_idle();
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

impl Handler<ClaimLane> for StoreActor {
    type Result = ResponseFuture<Result<LaneBatch, StoreCallError>>;

    fn handle(&mut self, msg: ClaimLane, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.claims.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<CompleteDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: CompleteDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.writes.completes.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<RescheduleDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: RescheduleDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.writes.reschedules.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<DeadLetterDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: DeadLetterDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.writes.dead_letters.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

impl Handler<DiscardDelivery> for StoreActor {
    type Result = ResponseFuture<Result<bool, StoreCallError>>;

    fn handle(&mut self, msg: DiscardDelivery, ctx: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        self.writes.discards.push((msg.0, tx));
        self.enqueued(ctx);
        waiter(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lanebus_store::Epoch;
    use lanebus_store::{lane_of_key, Lane, NewEvent, NewHandler};

    async fn sqlite_store(url: &str) -> Arc<dyn Store> {
        Arc::new(
            lanebus_store::sqlite::SqliteStore::connect(url)
                .await
                .expect("store"),
        )
    }

    async fn one_handler_one_event(store: &dyn Store) -> Lane {
        store
            .create_handler(NewHandler {
                name: "h".into(),
                url: "http://127.0.0.1:9/h".into(),
                event_types: vec!["*".into()],
                max_attempts: 3,
                timeout_ms: 1_000,
                max_in_flight: 8,
                secret: lanebus_store::generate_secret(),
                rate_limit: None,
                filter: None,
            })
            .await
            .expect("handler");
        store
            .publish(vec![NewEvent {
                id: Some("e1".into()),
                event_type: "t.x".into(),
                key: Some("k".into()),
                payload: b"{}".to_vec(),
                deliver_at: None,
                expected_seq: None,
            }])
            .await
            .expect("publish");
        lane_of_key("k", store.lanes())
    }

    /// Issue 18 item 4: a completion that waits (here for SQLite's write
    /// lock, held by another connection) does not hold a claim behind it:
    /// the claim sent after it is answered while the completion still
    /// waits, and the completion is answered once the lock is released.
    /// Before, one tick ran the completion and then the claim.
    #[actix_rt::test]
    async fn a_claim_is_answered_while_a_completion_waits() {
        use sqlx::Connection as _;
        let dir = std::env::temp_dir().join(format!(
            "lanebus-store-actor-{}-{}",
            std::process::id(),
            line!()
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        let url = format!("sqlite://{}", dir.join("lanebus.db").display());
        let store = sqlite_store(&url).await;
        let lane = one_handler_one_event(&*store).await;
        assert!(store.fence(lane, "n1", Epoch(1)).await.expect("fence"));
        let claim = LaneClaim {
            lane,
            epoch: Epoch(1),
            after: Default::default(),
            limit: 10,
        };
        let delivery = store.claim(&[claim.clone()]).await.expect("claim")[0].deliveries[0].clone();
        let mut other = sqlx::SqliteConnection::connect(&url)
            .await
            .expect("connect");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .expect("take the write lock");
        let actor = StoreActor::new(store.clone(), StoreActorConfig::default()).start();
        let complete = actor.send(CompleteDelivery(DeliveryRef {
            id: delivery.id,
            lane,
            epoch: Epoch(1),
            attempts: 1,
        }));
        tokio::pin!(complete);
        // Let the completion's tick start and meet the lock.
        tokio::select! {
            r = &mut complete => panic!("completed under another writer's lock: {r:?}"),
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        let claimed = tokio::select! {
            r = actor.send(ClaimLane(claim)) => r.expect("mailbox").expect("claim"),
            r = &mut complete => panic!("the completion ended first: {r:?}"),
        };
        assert!(claimed.owned, "{claimed:?}");
        assert_eq!(
            claimed.deliveries.len(),
            1,
            "not completed yet: {claimed:?}"
        );
        sqlx::query("ROLLBACK")
            .execute(&mut other)
            .await
            .expect("release the lock");
        assert!(complete.await.expect("mailbox").expect("complete"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Two claims of one lane in one tick: an old owner's (epoch 1) and the
    /// new owner's (epoch 2, fenced in the store). Each gets the store's
    /// answer for its own epoch: the old one is fenced out, the new one owns
    /// the lane and gets its delivery. Before, the second of the two got an
    /// empty answer marked owned, whichever it was.
    #[actix_rt::test]
    async fn two_claims_of_one_lane_in_a_tick_each_get_their_own_answer() {
        let store = sqlite_store("sqlite::memory:").await;
        let lane = one_handler_one_event(&*store).await;
        assert!(store.fence(lane, "old", Epoch(1)).await.expect("fence 1"));
        assert!(store.fence(lane, "new", Epoch(2)).await.expect("fence 2"));
        let actor = StoreActor::new(store.clone(), StoreActorConfig::default()).start();
        let claim = |lane, epoch| LaneClaim {
            lane,
            epoch,
            after: Default::default(),
            limit: 10,
        };
        let other = (lane + 1) % store.lanes();
        for order in [[2, 1], [1, 2]] {
            // The first claim (of another lane) goes at once; the two of
            // `lane` arrive while it is under way and share the next tick.
            let (_, a, b) = futures::join!(
                actor.send(ClaimLane(claim(other, Epoch(1)))),
                actor.send(ClaimLane(claim(lane, Epoch(order[0])))),
                actor.send(ClaimLane(claim(lane, Epoch(order[1]))))
            );
            for (epoch, answer) in [(order[0], a), (order[1], b)] {
                let batch = answer.expect("mailbox").expect("claim");
                if epoch == 2 {
                    assert!(batch.owned, "epoch 2 (order {order:?}): {batch:?}");
                    assert_eq!(batch.deliveries.len(), 1, "epoch 2 (order {order:?})");
                } else {
                    assert!(!batch.owned, "epoch 1 (order {order:?}): {batch:?}");
                    assert!(batch.deliveries.is_empty(), "epoch 1 (order {order:?})");
                }
            }
        }
    }

    /// A claim on an idle store goes at once, not at the end of a writes
    /// tick: with a flush interval of 60 s it is answered all the same.
    #[actix_rt::test]
    async fn a_claim_waits_for_no_tick() {
        let store = sqlite_store("sqlite::memory:").await;
        let lane = one_handler_one_event(&*store).await;
        assert!(store.fence(lane, "me", Epoch(1)).await.expect("fence"));
        let actor = StoreActor::new(
            store.clone(),
            StoreActorConfig {
                flush_interval: Duration::from_secs(60),
                ..StoreActorConfig::default()
            },
        )
        .start();
        let claim = actor.send(ClaimLane(LaneClaim {
            lane,
            epoch: Epoch(1),
            after: Default::default(),
            limit: 10,
        }));
        let batch = tokio::time::timeout(Duration::from_secs(20), claim)
            .await
            .expect("answered before the 60 s tick")
            .expect("mailbox")
            .expect("claim");
        assert_eq!(batch.deliveries.len(), 1);
    }
}
