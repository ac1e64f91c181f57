//! `KeyRunner`: one per (handler, key) with work; carries out the attempts
//! of one delivery at a time.
//!
//! ```text
//!  LaneOwner ──Attempt(d)──▶ KeyRunner ──POST / in-process──▶ handler
//!                               │ retry::decide
//!            ┌──────────────────┼─────────────────────┐
//!         Complete          Retry(delay)          DeadLetter
//!            │        RescheduleDelivery, wait        │
//!            │          delay, attempt again          │
//!            ▼                                        ▼
//!  StoreActor acknowledges ──▶ LaneOwner ◀──Settled(id, outcome)
//! ```
//!
//! The key runner reports a delivery settled only after the store
//! acknowledged its completion or dead letter, so the lane owner never hands
//! out the key's next delivery before the previous one is durably done
//! (docs/design.md invariant 2). While it waits for a retry only its own key
//! waits. The attempt count is persisted with every reschedule, so a restart
//! continues the count (and the `lanebus-attempt` header) where it was.
//! Unkeyed deliveries get a short-lived key runner each.
//!
//! Every attempt is bound to the lane owner that handed it out
//! ([`OwnerTie`]): it is sent only while that owner is live and its lease
//! (or drain) leaves room for the handler's timeout, checked again once it
//! holds its handler's permit; once cleared it counts in its lane's attempt
//! count until its outcome is stored. An attempt whose owner stopped is not
//! sent, and its key runner stops: the delivery stays in the store for the
//! lane's next owner.
//!
//! A store call that fails (database unreachable) is repeated with a capped
//! backoff until it succeeds or the lane owner is gone: the attempt's outcome
//! is known and must not be lost, and attempting again would repeat a
//! delivery without a cause.
//!
//! Handlers that change under a delivery:
//! - `410 Gone` ([`Decision::Disable`]): the attempt is recorded as failed
//!   (due at once), the handler is set `disabled` in the store, and the
//!   delivery goes back to the lane owner's queue ([`Parked`]), where it
//!   waits, not attempted, until the handler is enabled again. If the store
//!   cannot disable it, the delivery is retried after the backoff instead.
//! - Disabled meanwhile (before a retry, or while waiting for a permit): no
//!   attempt, [`Parked`] likewise.
//! - Deleted meanwhile: no attempt; the delivery is discarded in the store
//!   (a no-op when the delete removed it already; it removes a row a late
//!   publish left behind) and settled as [`SettledOutcome::HandlerGone`].
//! - Deleted through another node while an attempt was on the wire: the
//!   store refuses its result (the row is gone); the catalog is reloaded
//!   before the delivery is settled as [`SettledOutcome::Refused`], so the
//!   key's next delivery is not sent from a stale catalog.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use chrono::Utc;
use lanebus_store::{
    AttemptError, DeadLetterRequest, Delivery, DeliveryRef, Epoch, FailedAttempt,
    Handler as HandlerConfig, HandlerState, Reschedule,
};

use super::lane_owner::{LaneOwner, Parked, Retrying, Settled, SettledOutcome};
use super::store_actor::{
    CompleteDelivery, DeadLetterDelivery, DiscardDelivery, RescheduleDelivery, StoreActor,
    StoreCallError,
};
use crate::assignment::{OwnerTie, Start, GATE_RECHECK};
use crate::catalog::HandlerCatalog;
use crate::handler::{failed_attempt, AttemptGuard, Dispatcher, NotAttempted};
use crate::metrics;
use crate::retry::{decide, due_at, AttemptOutcome, Decision, RetryPolicy};
use crate::webhook::AttemptDetail;

/// Command: attempt this delivery (the head of the key) until it settles.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Attempt {
    /// The delivery; `attempts` counts the attempts already made.
    pub delivery: Delivery,
    /// Its handler as of dispatch.
    pub handler: Arc<HandlerConfig>,
}

/// What a key runner shares with its lane owner.
#[derive(Clone)]
pub struct KeyRunnerDeps {
    /// The lane's epoch (every store request is fenced with it).
    pub epoch: Epoch,
    /// The lane owner to report to.
    pub owner: Addr<LaneOwner>,
    /// The node's store actor.
    pub store_actor: Addr<StoreActor>,
    /// Hands deliveries over.
    pub dispatcher: Dispatcher,
    /// Handler catalog (re-read before every retry).
    pub catalog: Arc<HandlerCatalog>,
    /// Backoff parameters.
    pub retry: RetryPolicy,
    /// Binds its attempts to the lane owner: an attempt starts only while
    /// the owner's lease (and drain, if any) leaves room for its timeout.
    pub tie: Arc<OwnerTie>,
}

/// The key runner actor. See the module docs.
pub struct KeyRunner {
    deps: KeyRunnerDeps,
}

/// The store write an attempt leads to.
enum Record {
    Complete(DeliveryRef),
    Reschedule(Reschedule),
    DeadLetter(DeadLetterRequest),
    /// A `410 Gone`: the failed attempt (written as a reschedule), after
    /// which the handler is disabled and the delivery parked.
    Disable(Reschedule),
}

impl KeyRunner {
    /// A key runner for one lane owner.
    pub fn new(deps: KeyRunnerDeps) -> Self {
        KeyRunner { deps }
    }

    fn run(&mut self, delivery: Delivery, handler: Arc<HandlerConfig>, ctx: &mut Context<Self>) {
        let start = self
            .deps
            .tie
            .start(Duration::from_millis(handler.timeout_ms));
        if start == Start::Lost {
            // The lane owner stopped: the delivery stays in the store for
            // the lane's next owner.
            ctx.stop();
            return;
        }
        if start == Start::Wait {
            // The node's lease lapsed (a pause, a cut), or what is left of
            // it (or of a drain) would not cover the handler's timeout: send
            // nothing. Ask again while the lane owner lives (a renewal makes
            // room again); once it is stopped (the lane moved) this key
            // runner goes too, and the delivery stays in the store for the
            // next owner.
            if self.deps.owner.connected() {
                ctx.run_later(GATE_RECHECK, move |act, ctx| {
                    act.run(delivery, handler, ctx)
                });
            } else {
                ctx.stop();
            }
            return;
        }
        let wait = self.deps.dispatcher.rate_wait(&handler);
        if !wait.is_zero() {
            // Over the handler's rate limit: wait for the token without
            // making an attempt. Reported like a retry, so when the lane's
            // buffer is full the handler's queued deliveries make room for
            // other handlers' (they stay in the store).
            metrics::rate_limited(&handler.id);
            self.deps.owner.do_send(Retrying { id: delivery.id });
            ctx.run_later(wait, move |act, ctx| act.send(delivery, handler, ctx));
            return;
        }
        self.send(delivery, handler, ctx);
    }

    /// Makes the attempt (its rate-limit token taken).
    fn send(&mut self, delivery: Delivery, handler: Arc<HandlerConfig>, ctx: &mut Context<Self>) {
        if !self.deps.owner.connected() {
            ctx.stop();
            return;
        }
        let attempt = delivery.attempts + 1;
        let dispatcher = self.deps.dispatcher.clone();
        let catalog = self.deps.catalog.clone();
        let tie = self.deps.tie.clone();
        let (d, h) = (delivery.clone(), handler.clone());
        // The hand-over (body, signature, HTTP) runs on the tokio workers.
        let send = tokio::spawn(async move {
            dispatcher
                .attempt_checked(&catalog, &tie, &h, &d, attempt)
                .await
        });
        ctx.spawn(send.into_actor(self).map(move |joined, act, ctx| {
            let (outcome, counted, failure) = match joined {
                Ok(Ok(sent)) => (sent.outcome, Some(sent.counted), sent.failure),
                Ok(Err(NotAttempted::OwnerGone)) => return ctx.stop(),
                Ok(Err(NotAttempted::HandlerDeleted)) => return act.gone(delivery, ctx),
                Ok(Err(NotAttempted::HandlerDisabled)) => return act.park(delivery),
                Ok(Err(NotAttempted::Paused)) => {
                    // No room left for it once it had its permit: try again
                    // (run() waits while there is none).
                    ctx.run_later(GATE_RECHECK, move |act, ctx| {
                        act.run(delivery, handler, ctx)
                    });
                    return;
                }
                Err(e) => (
                    AttemptOutcome::Failed {
                        error: format!("attempt task failed: {e}"),
                        retry_after: None,
                    },
                    None,
                    Some(failed_attempt(
                        attempt,
                        Utc::now(),
                        0,
                        AttemptDetail::error(AttemptError::Other),
                    )),
                ),
            };
            act.decided(delivery, handler, attempt, (outcome, failure), counted, ctx);
        }));
    }

    /// Records the outcome of an attempt (with its attempt log entry when
    /// it failed); `counted` keeps the attempt in its lane's count until
    /// the store answered.
    fn decided(
        &mut self,
        delivery: Delivery,
        handler: Arc<HandlerConfig>,
        attempt: u32,
        (outcome, failure): (AttemptOutcome, Option<FailedAttempt>),
        counted: Option<AttemptGuard>,
        ctx: &mut Context<Self>,
    ) {
        let lane = delivery.lane;
        let epoch = self.deps.epoch;
        let decision = decide(
            &self.deps.retry,
            attempt,
            handler.max_attempts,
            &outcome,
            rand::random::<f64>(),
        );
        self.deps.catalog.record_attempt(
            &handler.id,
            &delivery.event_type,
            matches!(decision, Decision::Complete),
        );
        let record = match decision {
            Decision::Complete => {
                metrics::delivery_outcome(&handler.id, "completed");
                let latency = (Utc::now() - delivery.published_at)
                    .num_microseconds()
                    .unwrap_or(0) as f64
                    / 1e6;
                metrics::commit_to_handler(&handler.id, latency);
                Record::Complete(DeliveryRef {
                    id: delivery.id,
                    lane,
                    epoch,
                    attempts: attempt,
                })
            }
            Decision::Retry { delay, error } => {
                metrics::delivery_outcome(&handler.id, "failed");
                tracing::debug!(delivery = delivery.id, handler = %handler.id, attempt, error = %error, delay_ms = delay.as_millis() as u64, "attempt failed, retrying");
                let due_at = due_at(Utc::now(), delay);
                Record::Reschedule(Reschedule {
                    id: delivery.id,
                    lane,
                    epoch,
                    attempts: attempt,
                    due_at,
                    last_error: error,
                    failure,
                })
            }
            Decision::Disable { error } => {
                metrics::delivery_outcome(&handler.id, "failed");
                tracing::info!(delivery = delivery.id, handler = %handler.id, attempt, error = %error, "410 Gone: the handler is to be disabled");
                Record::Disable(Reschedule {
                    id: delivery.id,
                    lane,
                    epoch,
                    attempts: attempt,
                    due_at: Utc::now(),
                    last_error: format!("{error} (handler disabled)"),
                    failure,
                })
            }
            Decision::DeadLetter { error } => {
                metrics::delivery_outcome(&handler.id, "dead_lettered");
                tracing::info!(delivery = delivery.id, handler = %handler.id, attempt, error = %error, "dead letter");
                Record::DeadLetter(DeadLetterRequest {
                    id: delivery.id,
                    lane,
                    epoch,
                    attempts: attempt,
                    last_error: error,
                    failure,
                })
            }
        };
        self.record(delivery, record, counted, Duration::from_millis(50), ctx);
    }

    fn record(
        &mut self,
        mut delivery: Delivery,
        record: Record,
        counted: Option<AttemptGuard>,
        store_backoff: Duration,
        ctx: &mut Context<Self>,
    ) {
        let sa = self.deps.store_actor.clone();
        let fut = async move {
            let res = match &record {
                Record::Complete(r) => sa.send(CompleteDelivery(*r)).await,
                Record::Reschedule(r) | Record::Disable(r) => {
                    sa.send(RescheduleDelivery(r.clone())).await
                }
                Record::DeadLetter(r) => sa.send(DeadLetterDelivery(r.clone())).await,
            };
            (record, res.unwrap_or(Err(StoreCallError::Stopped)), counted)
        };
        ctx.spawn(fut.into_actor(self).map(move |(record, res, counted), act, ctx| {
            // `counted` goes when this ends, unless the write is repeated.
            let id = delivery.id;
            match res {
                Ok(true) => match record {
                    Record::Complete(_) => act.settle(id, SettledOutcome::Completed, ctx),
                    Record::DeadLetter(r) => {
                        crate::operational::tell_dead_letter(
                            act.deps.catalog.store(),
                            &delivery,
                            &r,
                        );
                        act.settle(id, SettledOutcome::DeadLettered, ctx)
                    }
                    Record::Reschedule(r) => {
                        delivery.attempts = r.attempts;
                        delivery.due_at = r.due_at;
                        delivery.last_error = Some(r.last_error);
                        let wait = (r.due_at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
                        // Only this key waits: the owner may leave the key's
                        // queued deliveries in the store meanwhile.
                        act.deps.owner.do_send(Retrying { id });
                        ctx.run_later(wait, move |act, ctx| act.retry(delivery, ctx));
                    }
                    Record::Disable(r) => {
                        delivery.attempts = r.attempts;
                        delivery.due_at = r.due_at;
                        delivery.last_error = Some(r.last_error);
                        act.disable(delivery, ctx);
                    }
                },
                // Fenced out, or the row is gone (handler deleted).
                Ok(false) => act.refused(id, ctx),
                Err(StoreCallError::Stopped) => ctx.stop(),
                Err(e) => {
                    if !act.deps.owner.connected() {
                        ctx.stop();
                        return;
                    }
                    tracing::warn!(delivery = id, error = %e, retry_in_ms = store_backoff.as_millis() as u64, "store write failed, will repeat it");
                    let next = (store_backoff * 2).min(Duration::from_secs(5));
                    ctx.run_later(store_backoff, move |act, ctx| {
                        act.record(delivery, record, counted, next, ctx)
                    });
                }
            }
        }));
    }

    fn retry(&mut self, delivery: Delivery, ctx: &mut Context<Self>) {
        if !self.deps.owner.connected() {
            ctx.stop();
            return;
        }
        match self.deps.catalog.get(&delivery.handler_id) {
            Some(h) if h.state == HandlerState::Enabled => self.run(delivery, h, ctx),
            // Disabled while waiting (a 410 elsewhere, or by hand): keep it.
            Some(_) => self.park(delivery),
            // Deleted while waiting.
            None => self.gone(delivery, ctx),
        }
    }

    /// After a `410` was recorded: disables the handler, then parks the
    /// delivery. If the store cannot disable it, retries after the backoff
    /// (the next attempt, or the next `410`, tries again).
    fn disable(&mut self, delivery: Delivery, ctx: &mut Context<Self>) {
        let catalog = self.deps.catalog.clone();
        let id = delivery.handler_id.clone();
        let fut = async move {
            catalog
                .set_state_because(&id, HandlerState::Disabled, "gone")
                .await
        };
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| match res {
            // Counted and logged by the call that changed the state.
            Ok(_) => act.park(delivery),
            Err(lanebus_store::StoreError::NotFound(_)) => act.gone(delivery, ctx),
            Err(e) => {
                let wait = act
                    .deps
                    .retry
                    .backoff(delivery.attempts.max(1), rand::random::<f64>())
                    .max(act.deps.retry.base);
                tracing::warn!(delivery = delivery.id, handler = %delivery.handler_id, error = %e, retry_in_ms = wait.as_millis() as u64, "could not disable the handler after a 410; retrying the delivery");
                act.deps.owner.do_send(Retrying { id: delivery.id });
                ctx.run_later(wait, move |act, ctx| act.retry(delivery, ctx));
            }
        }));
    }

    /// The handler is disabled: hands the delivery back to the lane owner,
    /// which keeps it queued, not attempted, until the handler is enabled.
    fn park(&mut self, delivery: Delivery) {
        self.deps.owner.do_send(Parked { delivery });
    }

    /// The handler is deleted: discards the delivery's row (if a late
    /// publish left one; the delete removed the others) and settles it.
    fn gone(&mut self, delivery: Delivery, ctx: &mut Context<Self>) {
        let sa = self.deps.store_actor.clone();
        let r = DeliveryRef {
            id: delivery.id,
            lane: delivery.lane,
            epoch: self.deps.epoch,
            attempts: delivery.attempts,
        };
        let handler_id = delivery.handler_id.clone();
        let fut = async move { sa.send(DiscardDelivery(r)).await };
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            match res {
                Ok(Ok(true)) => {
                    metrics::orphans_discarded(&handler_id, 1);
                    tracing::info!(delivery = r.id, handler = %handler_id, "discarded a delivery of a deleted handler");
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => {
                    tracing::warn!(delivery = r.id, handler = %handler_id, error = %e, "could not discard a delivery of a deleted handler");
                }
                Err(_) => {}
            }
            act.settle(r.id, SettledOutcome::HandlerGone, ctx);
        }));
    }

    /// The store refused the attempt's result: the lane was fenced away, or
    /// the delivery's row is gone, as when its handler was deleted through
    /// another node whose change this node's catalog has not seen yet.
    /// Reloads the catalog before settling, so the lane owner does not hand
    /// the key's next delivery out from a stale catalog (a deleted handler's
    /// queued deliveries are then held, and dropped by the reload).
    fn refused(&mut self, id: i64, ctx: &mut Context<Self>) {
        let catalog = self.deps.catalog.clone();
        let fut = async move { catalog.reload_fresh().await };
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            if let Err(e) = res {
                tracing::warn!(delivery = id, error = %e, "handler catalog reload after a refused write failed");
            }
            act.settle(id, SettledOutcome::Refused, ctx);
        }));
    }

    fn settle(&mut self, id: i64, outcome: SettledOutcome, _ctx: &mut Context<Self>) {
        self.deps.owner.do_send(Settled { id, outcome });
    }
}

impl Actor for KeyRunner {
    type Context = Context<Self>;
}

impl Handler<Attempt> for KeyRunner {
    type Result = ();

    fn handle(&mut self, msg: Attempt, ctx: &mut Self::Context) {
        self.run(msg.delivery, msg.handler, ctx);
    }
}
