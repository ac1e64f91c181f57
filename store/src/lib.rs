//! lanebus storage: domain types, the [`Store`] trait, and one module per
//! backend, each behind the cargo feature of its name: `sqlite` (the
//! default), `postgres`, `mongodb`.
//!
//! Every backend has the same files: `mod.rs` (the choices, the store type,
//! its constructors and the [`Store`] impl, which forwards to functions of
//! the other files named after the trait's methods), `catalog.rs`
//! (handlers, dead-letter listing, lane rows, counts), `dispatch.rs`
//! (fencing, claims, completions, reschedules, dead letters, replays,
//! recovery, retention, wake-ups), `publish.rs` (`publish` in a transaction
//! of its own, `publish_in` in the caller's), `migrate.rs` (schema and
//! lanes of a new store) and `error.rs` (its driver's errors mapped to
//! [`StoreError`] kinds).
//!
//! # Design (see `docs/design.md` section 3)
//!
//! ```text
//!  publish (one transaction)            dispatch (one fenced owner per lane)
//!  ─────────────────────────            ────────────────────────────────────
//!  key_seqs  +n per key (row lock)      claim:   read due deliveries of many
//!  events    one row per new event               lanes in one statement; no
//!  deliveries one row per (event,                row is updated by a claim
//!             matching handler)         complete: one bulk DELETE of the
//!  NOTIFY    at most one per tx (for             deliveries + one append-only
//!            publish_in: after the caller's)     INSERT of completion rows
//! ```
//!
//! A delivery row is inserted once and deleted once (delete-on-complete, the
//! reference's measured baseline, seed `000_…`); claims change no row, because
//! exactly one fenced owner reads a lane. Every claim, completion, reschedule
//! and dead letter is conditioned on the lane's epoch in the `lanes` table, so
//! a deposed owner changes nothing ([`Store::fence`]).
//!
//! ## Claim cursor
//!
//! A lane owner keeps a per-lane cursor ([`ClaimCursor`]) so a claim does
//! not re-read what the owner already holds. A cursor on an id sequence would
//! skip a row whose transaction commits late, so the cursor is
//! commit-ordered and backend-specific:
//! - PostgreSQL: each delivery row records the inserting transaction's id
//!   (`pg_current_xact_id()`; for a keyed row, at least the key's previous
//!   value, so a key's rows are read in sequence order). The cursor is a
//!   position and the transactions that were still in progress below it
//!   when the previous claim took its snapshot ([`ClaimCursor::open`]): a
//!   claim reads rows with `xid >= pos` and every row of an open
//!   transaction, and moves the position past everything its snapshot saw.
//!   So a transaction left open elsewhere on the server costs one index
//!   probe per claim, not a re-read of all rows published since it began.
//!   Rows read twice are de-duplicated by the owner by [`Delivery::id`]. A
//!   claim cut by its limit returns the rest of the last transaction's rows
//!   too, so the cursor can move past that transaction (see the `postgres`
//!   module docs).
//! - SQLite: one writer at a time, so `AUTOINCREMENT` ids are commit-ordered
//!   and the cursor is the last id read.
//! - MongoDB: a per-lane position taken from a counter document inside the
//!   publish transaction; publishers into one lane write-conflict, so the
//!   positions of a lane become visible in order and the cursor is the last
//!   position read (see the `mongodb` module docs).
//!
//! The owner must therefore keep every delivery id it has seen until the
//! completion (or reschedule, or dead letter) that removes it has been
//! acknowledged by the store.

#![warn(missing_docs)]

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

mod common;
pub use common::MAX_BATCH;
mod group;
pub use group::{GroupStats, GROUP_EVENTS, GROUP_PAYLOAD_BYTES};
pub mod egress;
pub mod event_types;
pub use event_types::{CatalogSettings, EventType, EventTypePatch, NewEventType};
pub mod filter;
pub use filter::Filter;
mod json_span;
pub mod operational;
pub mod personal;
mod state;
pub use state::change_state;
pub mod lane;
#[cfg(feature = "mongodb")]
pub mod mongodb;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod route;
pub mod rules;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod wake;

pub use lane::{lane_of_event, lane_of_key, DEFAULT_LANES};

pub use rules::event::{
    MAX_DELIVER_AHEAD, MAX_ID_LEN as MAX_EVENT_ID_LEN, MAX_KEY_LEN, MAX_PAYLOAD_DEPTH,
};

/// Lane number, `0..lanes`.
pub type Lane = u16;
pub use lanebus_types::{Epoch, EpochOutOfRange};

/// What went wrong in a store call, by kind: the one error type of every
/// backend. Each backend maps its driver's errors to these kinds in its own
/// `error` module; the API maps the kinds to HTTP statuses. The string is
/// the message for people (the driver's, or the rule broken).
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The caller's input breaks a rule (bad id, unknown handler field...),
    /// or the store URL names a backend this build does not include.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// A referenced thing does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// A unique constraint was hit that the operation does not absorb, or a
    /// concurrent write won (retry the call).
    #[error("conflict: {0}")]
    Conflict(String),
    /// The database could not be reached, refused the connection, or is
    /// shutting down or failing over: the call may succeed if retried.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The database did not finish in time: no pooled connection came free,
    /// a lock stayed taken (PostgreSQL `lock_timeout`, SQLite's busy
    /// timeout) or a statement ran out its time (PostgreSQL
    /// `statement_timeout`, MongoDB `maxTimeMS`). The call may have changed
    /// nothing or, for a lost answer, everything; it may be retried.
    #[error("store timeout: {0}")]
    Timeout(String),
    /// Any other database error (a fault to look into, not the caller's).
    #[error("store error: {0}")]
    Database(String),
    /// A publish's [`NewEvent::expected_seq`] did not hold: nothing of the
    /// batch was stored. Not retried by the store: the publisher reads
    /// `current` (or its stream) again and decides.
    #[error(
        "conflict: event key {key:?} is at sequence {current}; events[{index}] expected {expected}{}",
        batch_note(.current, .at)
    )]
    SeqConflict {
        /// The event key.
        key: String,
        /// The expectation that failed (the first one found).
        expected: i64,
        /// The key's last sequence number when the publish was checked
        /// (before the batch; 0 for a key without events).
        current: i64,
        /// Position of the event with that expectation in the caller's batch
        /// (0-based).
        index: usize,
        /// The key's sequence just before that event: `current` plus the
        /// batch's earlier new events of the key (what `expected` had to be).
        at: i64,
    },
}

/// The tail of a [`StoreError::SeqConflict`] message when the failed
/// expectation was on a later event of the key in the batch.
fn batch_note(current: &i64, at: &i64) -> String {
    if at == current {
        String::new()
    } else {
        format!(", where the batch's earlier events put the key at {at}")
    }
}

/// Result alias for store operations.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// An event as a publisher hands it over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewEvent {
    /// Client-supplied id (1 to 128 printable ASCII characters); a UUIDv7 is
    /// generated when `None`.
    pub id: Option<String>,
    /// Dotted type name such as `issues.opened`.
    pub event_type: String,
    /// Ordering key (up to 256 bytes); `None` means unordered.
    pub key: Option<String>,
    /// The payload: one JSON value, stored and sent byte for byte.
    pub payload: Vec<u8>,
    /// Not to be delivered before this time (delayed delivery); `None` or a
    /// past time: at once. At most [`MAX_DELIVER_AHEAD`] from now. A keyed
    /// event's later events wait behind it (per-key order holds).
    pub deliver_at: Option<DateTime<Utc>>,
    /// Optimistic concurrency on the key as an event stream: the key's last
    /// sequence number the publisher saw (0: the key has no event yet).
    /// The publish stores the batch only if, for every event that sets it,
    /// the key's last sequence just before that event equals it, counting
    /// the batch's earlier new events of the key (so a batch sets it on its
    /// first event of the key, and on later ones the next values or
    /// nothing); otherwise nothing of the batch is stored and the publish
    /// fails with [`StoreError::SeqConflict`], which names the key's
    /// current sequence. Checked in the transaction that assigns the key's
    /// sequence numbers, so of concurrent publishers expecting the same
    /// value exactly one succeeds. Needs a [`key`](Self::key) and is 0 or
    /// more ([`rules::event::expected_seq`]). An event whose id is a
    /// duplicate (already stored, or earlier in the batch) is answered as a
    /// duplicate, its expectation not checked: its first publish passed
    /// its check (a retry of a stored batch is answered as before).
    pub expected_seq: Option<i64>,
}

/// What a publish did, in the order of the input batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublishOutcome {
    /// Events newly stored.
    pub accepted: usize,
    /// Events whose id was already stored; not delivered again.
    pub duplicates: usize,
    /// The id of every input event (generated ones included), input order.
    pub ids: Vec<String>,
    /// The lanes of the events this publish wrote or tried to write (those
    /// already stored left out where the store knew them beforehand),
    /// ascending, each once: what `PgStore::wake_after_commit` wakes.
    #[serde(default)]
    pub lanes: Vec<Lane>,
}

/// Lifecycle of a handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandlerState {
    /// Deliveries are attempted.
    Enabled,
    /// Deliveries are kept but not attempted.
    Disabled,
}

impl HandlerState {
    /// The string stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            HandlerState::Enabled => "enabled",
            HandlerState::Disabled => "disabled",
        }
    }

    /// Parses the stored string; unknown values read as `Disabled` (fail safe).
    pub fn parse(s: &str) -> Self {
        if s == "enabled" {
            HandlerState::Enabled
        } else {
            HandlerState::Disabled
        }
    }
}

/// What [`Store::change_handler_state`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct StateChange {
    /// The handler as stored after the call.
    pub handler: Handler,
    /// Its state before the call, read atomically with the write.
    pub was: HandlerState,
}

impl StateChange {
    /// The call changed the handler's state (it was not already the state
    /// asked for).
    pub fn changed(&self) -> bool {
        self.was != self.handler.state
    }
}

/// Defaults of a handler's delivery policy.
pub mod handler_defaults {
    /// Attempts before a delivery becomes a dead letter.
    pub const MAX_ATTEMPTS: u32 = 8;
    /// Per-attempt HTTP timeout, in milliseconds.
    pub const TIMEOUT_MS: u64 = 10_000;
    /// Concurrent attempts to this handler per node.
    pub const MAX_IN_FLIGHT: u32 = 64;
}

/// A handler registration request (API `POST /v1/handlers`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewHandler {
    /// Human-readable name.
    pub name: String,
    /// Webhook URL (`http` or `https`).
    pub url: String,
    /// Routes: exact event types or patterns with a trailing `*`.
    pub event_types: Vec<String>,
    /// Attempts before dead letter (>= 1).
    pub max_attempts: u32,
    /// Per-attempt timeout, in milliseconds.
    pub timeout_ms: u64,
    /// Concurrent attempts per node.
    pub max_in_flight: u32,
    /// Signing secret, `whsec_` + base64 of 24 to 64 bytes.
    pub secret: String,
    /// Requests per second per node, or `None` for no limit.
    pub rate_limit: Option<RateLimit>,
    /// Payload filter ([`filter`]): the handler gets only the events whose
    /// payload matches it (decided at publish); `None` for every event its
    /// routes match.
    pub filter: Option<Filter>,
}

/// A registered handler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handler {
    /// Stable id, `hdl_` + 32 lowercase hex digits (a UUIDv7 in simple form).
    pub id: String,
    /// Human-readable name.
    pub name: String,
    /// Webhook URL.
    pub url: String,
    /// Routes.
    pub event_types: Vec<String>,
    /// Attempts before dead letter.
    pub max_attempts: u32,
    /// Per-attempt timeout, in milliseconds.
    pub timeout_ms: u64,
    /// Concurrent attempts per node.
    pub max_in_flight: u32,
    /// Signing secret (`whsec_` + base64).
    pub secret: String,
    /// Enabled or disabled.
    pub state: HandlerState,
    /// Registration time.
    pub created_at: DateTime<Utc>,
    /// Requests per second this handler accepts, if limited.
    pub rate_limit: Option<RateLimit>,
    /// The secret replaced by the last rotation, still signing (next to
    /// [`secret`](Self::secret)) until
    /// [`previous_secret_until`](Self::previous_secret_until).
    pub previous_secret: Option<String>,
    /// End of the previous secret's grace period; after it the previous
    /// secret signs nothing (checked at send time).
    pub previous_secret_until: Option<DateTime<Utc>>,
    /// When [`state`](Self::state) last changed (`None`: never since creation).
    pub state_changed_at: Option<DateTime<Utc>>,
    /// Why it last changed: `gone` (a `410` answer), `failing` (failed
    /// without a success for the node's auto-disable period), `api` (an
    /// operator), or what the caller of [`Store::change_handler_state`] gave.
    pub state_reason: Option<String>,
    /// Start of the current run of failed attempts without a success, as
    /// nodes record it ([`Store::mark_handler_failing`]); `None` when the
    /// last recorded outcome was a success.
    pub failing_since: Option<DateTime<Utc>>,
    /// Payload filter ([`filter`]), or `None`: every event its routes match.
    #[serde(default)]
    pub filter: Option<Filter>,
}

impl Handler {
    /// A newly registered handler: `id`, the registration's settings,
    /// enabled, no rate limit, no rotation or state history.
    pub fn registered(id: String, h: NewHandler, created_at: DateTime<Utc>) -> Handler {
        Handler {
            id,
            name: h.name,
            url: h.url,
            event_types: h.event_types,
            max_attempts: h.max_attempts,
            timeout_ms: h.timeout_ms,
            max_in_flight: h.max_in_flight,
            secret: h.secret,
            state: HandlerState::Enabled,
            created_at,
            rate_limit: h.rate_limit,
            previous_secret: None,
            previous_secret_until: None,
            state_changed_at: None,
            state_reason: None,
            failing_since: None,
            filter: h.filter,
        }
    }

    /// The secrets that sign a request sent at `now`: the current one, then
    /// the previous one while its grace period lasts.
    pub fn signing_secrets(&self, now: DateTime<Utc>) -> Vec<&str> {
        let mut secrets = vec![self.secret.as_str()];
        if let (Some(old), Some(until)) = (&self.previous_secret, self.previous_secret_until) {
            if now < until {
                secrets.push(old.as_str());
            }
        }
        secrets
    }
}

/// A per-handler rate limit: a token bucket refilled at `per_second`
/// tokens a second, holding at most `burst` (each request takes one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateLimit {
    /// Requests per second, 1 to 100,000.
    pub per_second: u32,
    /// Requests that may go at once after an idle period, 1 to 100,000.
    pub burst: u32,
}

/// A change of a handler's settings ([`Store::update_handler`]); `None`
/// leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerPatch {
    /// New name.
    pub name: Option<String>,
    /// New webhook URL.
    pub url: Option<String>,
    /// New routes (apply to events published after the change).
    pub event_types: Option<Vec<String>>,
    /// New attempts before dead letter.
    pub max_attempts: Option<u32>,
    /// New per-attempt timeout, in milliseconds.
    pub timeout_ms: Option<u64>,
    /// New concurrent attempts per node.
    pub max_in_flight: Option<u32>,
    /// `Some(None)` removes the rate limit; `Some(Some(r))` sets it.
    pub rate_limit: Option<Option<RateLimit>>,
    /// `Some(None)` removes the payload filter; `Some(Some(f))` sets it
    /// (applies to events published after the change).
    pub filter: Option<Option<Filter>>,
}

/// One delivery as a claim returns it: the (event, handler) pair with what is
/// needed to send it.
#[derive(Clone, PartialEq, Eq)]
pub struct Delivery {
    /// Store-assigned delivery id (unique, never reused).
    pub id: i64,
    /// Lane of the event.
    pub lane: Lane,
    /// The lane's epoch the delivery was claimed at: the owner's fencing
    /// token (webhook header `lanebus-epoch`). It only grows per lane, so
    /// a receiver that refuses an epoch below the highest it saw for the
    /// lane refuses a deposed owner's late request.
    pub epoch: Epoch,
    /// Handler to deliver to.
    pub handler_id: String,
    /// Event id (the `webhook-id`).
    pub event_id: String,
    /// Event type.
    pub event_type: String,
    /// Ordering key.
    pub key: Option<String>,
    /// Position of the event within its key (1, 2, ...); `None` when unkeyed.
    pub seq: Option<i64>,
    /// Attempts already made (0 for a fresh delivery).
    pub attempts: u32,
    /// Not to be attempted before this time.
    pub due_at: DateTime<Utc>,
    /// Last error of a failed attempt, if any.
    pub last_error: Option<String>,
    /// Payload bytes as published.
    pub payload: bytes::Bytes,
    /// Commit time of the publish (approximately: the publish transaction's clock).
    pub published_at: DateTime<Utc>,
    /// A recovery put it back ([`Store::recover`]): the event was delivered
    /// to this handler before (webhook header `lanebus-replay: true`).
    pub replay: bool,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("id", &self.id)
            .field("lane", &self.lane)
            .field("handler_id", &self.handler_id)
            .field("event_id", &self.event_id)
            .field("key", &self.key)
            .field("seq", &self.seq)
            .field("attempts", &self.attempts)
            .field("replay", &self.replay)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

/// Where a lane's next claim reads from: commit-ordered and
/// backend-specific (module docs). [`ClaimCursor::default`] reads the lane
/// from its start.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimCursor {
    /// Commit-ordered position. PostgreSQL: the first `xid` not read;
    /// SQLite: the last delivery id read; MongoDB: the last lane position
    /// read.
    pub pos: i64,
    /// PostgreSQL only (empty elsewhere): ids of the transactions that were
    /// in progress below [`pos`](Self::pos) when the claim that set this
    /// cursor took its snapshot, ascending; the next claim reads their rows
    /// again, wherever their `xid`.
    pub open: Arc<[i64]>,
}

impl Default for ClaimCursor {
    fn default() -> Self {
        ClaimCursor::at(0)
    }
}

impl From<i64> for ClaimCursor {
    fn from(pos: i64) -> Self {
        ClaimCursor::at(pos)
    }
}

impl ClaimCursor {
    /// A cursor at `pos` with no open transaction.
    pub fn at(pos: i64) -> Self {
        ClaimCursor {
            pos,
            open: Arc::from(Vec::new()),
        }
    }

    /// A cursor from which a claim reads everything that a claim from
    /// `self` or from `other` would read (a rescan from the earlier of two
    /// cursors).
    pub fn earliest(&self, other: &ClaimCursor) -> ClaimCursor {
        let pos = self.pos.min(other.pos);
        // Open transactions at or past `pos` are read by position anyway
        // (a row's xid is at least its transaction's id).
        let mut open: Vec<i64> = self
            .open
            .iter()
            .chain(other.open.iter())
            .copied()
            .filter(|&x| x < pos)
            .collect();
        open.sort_unstable();
        open.dedup();
        ClaimCursor {
            pos,
            open: open.into(),
        }
    }

    /// Whether a claim from `self` reads less than one from `earlier`: the
    /// position moved on, or an open transaction was passed.
    pub fn passed(&self, earlier: &ClaimCursor) -> bool {
        self.pos > earlier.pos || (self.pos == earlier.pos && self.open.len() < earlier.open.len())
    }
}

/// One lane's part of a batched claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneClaim {
    /// The lane.
    pub lane: Lane,
    /// The epoch the caller owns the lane at; a claim at any other epoch
    /// returns nothing.
    pub epoch: Epoch,
    /// Cursor from the previous [`LaneBatch::next_after`];
    /// [`ClaimCursor::default`] reads the lane from its start.
    pub after: ClaimCursor,
    /// Most deliveries to return for this lane. PostgreSQL may return more:
    /// the rest of the last publishing transaction's rows in the lane (so a
    /// transaction larger than the limit cannot stall the cursor), and every
    /// row of the cursor's open transactions that committed since.
    pub limit: u32,
}

/// One lane's result of a batched claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneBatch {
    /// The lane.
    pub lane: Lane,
    /// `false` when the lane's epoch in the store is not the claimed one: the
    /// caller is fenced out and must stop the lane.
    pub owned: bool,
    /// Deliveries in commit order (per key: sequence order). May repeat ones
    /// returned before (see the module docs); callers de-duplicate by id.
    pub deliveries: Vec<Delivery>,
    /// Cursor for the next claim of this lane.
    pub next_after: ClaimCursor,
}

/// Fenced reference to a delivery, for completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryRef {
    /// Delivery id.
    pub id: i64,
    /// Its lane.
    pub lane: Lane,
    /// The epoch the caller owns the lane at.
    pub epoch: Epoch,
    /// Attempts made, including the successful one.
    pub attempts: u32,
}

/// Failed attempts a delivery's attempt log keeps: the last ones, older
/// ones dropped as new ones come ([`FailedAttempt`]).
pub const ATTEMPT_LOG_LEN: usize = 5;

/// Bytes of a response body a [`FailedAttempt`] keeps, at most: the first
/// 1 KiB ([`FailedAttempt::body_prefix`]).
pub const ATTEMPT_BODY_BYTES: usize = 1024;

/// Why an attempt failed when it got no HTTP status, or lost the response
/// body after one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptError {
    /// The connection was refused (nothing listens at the address).
    Refused,
    /// The connection was reset or closed before the answer was complete.
    Reset,
    /// No complete answer within the handler's timeout (or the connect
    /// timeout).
    Timeout,
    /// The host name did not resolve.
    Dns,
    /// The TLS handshake or certificate check failed.
    Tls,
    /// The SSRF guard refused the target address or URL scheme.
    SsrfGuard,
    /// An in-process handler returned an error.
    Handler,
    /// Anything else (a bad URL, a protocol error, the node shutting down).
    Other,
}

impl AttemptError {
    /// The name in the API and in stored attempt logs (`ssrf_guard`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptError::Refused => "refused",
            AttemptError::Reset => "reset",
            AttemptError::Timeout => "timeout",
            AttemptError::Dns => "dns",
            AttemptError::Tls => "tls",
            AttemptError::SsrfGuard => "ssrf_guard",
            AttemptError::Handler => "handler",
            AttemptError::Other => "other",
        }
    }
}

/// One failed attempt of a delivery, as its attempt log keeps it (the last
/// [`ATTEMPT_LOG_LEN`], oldest first). Written only with the reschedule or
/// dead letter that records the failure: a successful attempt writes none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedAttempt {
    /// Attempt number (1 for the first).
    pub attempt: u32,
    /// When the attempt started.
    pub at: DateTime<Utc>,
    /// HTTP status of the answer; `None` when none came.
    pub status: Option<u16>,
    /// Transport error, when no status came or the body was cut after one.
    pub error: Option<AttemptError>,
    /// Time from the start of the attempt to its outcome, in milliseconds.
    pub duration_ms: u64,
    /// The first bytes of the response body ([`FailedAttempt::body_prefix`]),
    /// or of an in-process handler's error message; `None` when empty or
    /// withheld.
    pub body: Option<String>,
    /// Whether the body (or an in-process handler's error message) was not
    /// kept because the payload sent had personal fields decrypted
    /// ([`personal`]): a receiver quoting them would leave them in the store
    /// past the subject's erasure.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_withheld: bool,
}

impl FailedAttempt {
    /// The text kept of a response body: its first [`ATTEMPT_BODY_BYTES`]
    /// bytes at most, cut back to the start of a UTF-8 character, decoded
    /// as lossy UTF-8 (an invalid byte becomes U+FFFD, so the text may
    /// exceed the byte count). `None` for an empty body.
    pub fn body_prefix(body: &[u8]) -> Option<String> {
        if body.is_empty() {
            return None;
        }
        let mut end = body.len().min(ATTEMPT_BODY_BYTES);
        if end < body.len() {
            // Back off continuation bytes (10xxxxxx): at most three.
            let mut back = 0;
            while back < 3 && end > 0 && body[end] & 0xC0 == 0x80 {
                end -= 1;
                back += 1;
            }
        }
        Some(String::from_utf8_lossy(&body[..end]).into_owned())
    }

    /// Appends `self` to an attempt log, keeping its last
    /// [`ATTEMPT_LOG_LEN`] entries.
    pub fn push_onto(self, log: &mut Vec<FailedAttempt>) {
        log.push(self);
        if log.len() > ATTEMPT_LOG_LEN {
            log.drain(..log.len() - ATTEMPT_LOG_LEN);
        }
    }
}

/// A failed attempt to record: next try at `due_at`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reschedule {
    /// Delivery id.
    pub id: i64,
    /// Its lane.
    pub lane: Lane,
    /// The epoch the caller owns the lane at.
    pub epoch: Epoch,
    /// Attempts made so far.
    pub attempts: u32,
    /// Earliest time of the next attempt.
    pub due_at: DateTime<Utc>,
    /// Error of the last attempt.
    pub last_error: String,
    /// The failed attempt for the delivery's attempt log (appended, the
    /// last [`ATTEMPT_LOG_LEN`] kept); `None` leaves the log as it is.
    pub failure: Option<FailedAttempt>,
}

/// A delivery that exhausted its retry policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterRequest {
    /// Delivery id.
    pub id: i64,
    /// Its lane.
    pub lane: Lane,
    /// The epoch the caller owns the lane at.
    pub epoch: Epoch,
    /// Attempts made.
    pub attempts: u32,
    /// Error of the last attempt.
    pub last_error: String,
    /// The last failed attempt: appended to the delivery's attempt log,
    /// which the dead letter keeps; `None`: the log as it is.
    pub failure: Option<FailedAttempt>,
}

/// A stored dead letter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    /// Dead-letter id.
    pub id: i64,
    /// Handler it was meant for.
    pub handler_id: String,
    /// Event id.
    pub event_id: String,
    /// Event type.
    pub event_type: String,
    /// Ordering key.
    pub key: Option<String>,
    /// Sequence within the key.
    pub seq: Option<i64>,
    /// Attempts made.
    pub attempts: u32,
    /// Error of the last attempt.
    pub last_error: String,
    /// When it became a dead letter.
    pub failed_at: DateTime<Utc>,
}

/// Filter for listing dead letters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only this handler's.
    pub handler_id: Option<String>,
    /// Only ids greater than this (keyset pagination).
    pub after_id: Option<i64>,
    /// Most to return.
    pub limit: u32,
}

/// A lane as the store sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaneRow {
    /// Lane number.
    pub lane: Lane,
    /// Node id of the last fenced owner, if any.
    pub owner: Option<String>,
    /// Current epoch.
    pub epoch: Epoch,
    /// Delivery rows of the lane: every delivery stored and not yet
    /// completed or dead-lettered, whether due, waiting or in flight.
    pub backlog: i64,
}

/// What [`Store::recover`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoverOutcome {
    /// Events put back as deliveries to the handler (marked as replays).
    pub recovered: u64,
    /// Events completed in the window that already have a pending delivery
    /// to the handler (a recovery or replay not yet delivered): not doubled.
    pub already_pending: u64,
    /// Completions in the window whose event is no longer stored (pruned by
    /// retention): they cannot be delivered again.
    pub pruned: u64,
}

/// What [`Store::delete_handler`] removed with the handler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeletedHandler {
    /// Pending deliveries discarded.
    pub deliveries: u64,
    /// Dead letters discarded (their events are then pruned by retention
    /// like any other event without a pending delivery or dead letter).
    pub dead_letters: u64,
}

/// What one [`Store::prune`] batch removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pruned {
    /// Completion rows removed.
    pub completions: u64,
    /// Event rows removed.
    pub events: u64,
}

/// Totals for exactness checks and benchmarks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreCounts {
    /// Events stored.
    pub events: i64,
    /// Deliveries pending.
    pub deliveries: i64,
    /// Completion rows.
    pub completions: i64,
    /// Dead letters.
    pub dead_letters: i64,
}

/// What the store holds about one event ([`Store::lookup_event`]): the
/// event and the state of its delivery to each handler that has a record
/// of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventLookup {
    /// Event id.
    pub id: String,
    /// Event type.
    pub event_type: String,
    /// Ordering key.
    pub key: Option<String>,
    /// Position of the event within its key (1, 2, ...); `None` when unkeyed.
    pub seq: Option<i64>,
    /// Lane of the event.
    pub lane: Lane,
    /// Publish time (the publishing transaction's clock).
    pub published_at: DateTime<Utc>,
    /// Payload size, in bytes.
    pub payload_bytes: u64,
    /// One entry per handler with a pending delivery, a completion or a dead
    /// letter of the event, by handler id ([`HandlerDelivery::state`] says
    /// which record wins when there are several).
    pub handlers: Vec<HandlerDelivery>,
}

/// The delivery of one event to one handler, as [`EventLookup`] shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerDelivery {
    /// Handler id.
    pub handler_id: String,
    /// The handler's name; `None` when the handler no longer exists (its
    /// pending deliveries and dead letters went with it; completions stay).
    pub handler_name: Option<String>,
    /// A pending delivery if there is one (a replay or recovery after a
    /// completion or dead letter is pending again); otherwise the latest
    /// of the completions and dead letters.
    pub state: DeliveryState,
}

/// State of the delivery of an event to a handler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum DeliveryState {
    /// Waiting for its next attempt (or in flight).
    Pending {
        /// Failed attempts so far (0: not attempted yet).
        attempts: u32,
        /// Earliest time of the next attempt.
        due_at: DateTime<Utc>,
        /// Error of the last failed attempt, if any.
        last_error: Option<String>,
        /// The last failed attempts, oldest first ([`ATTEMPT_LOG_LEN`]).
        #[serde(default)]
        attempt_log: Vec<FailedAttempt>,
    },
    /// Delivered.
    Completed {
        /// Time of the completion (the completing store write's clock).
        completed_at: DateTime<Utc>,
        /// Attempts made, the successful one included.
        attempts: u32,
    },
    /// Out of attempts: a dead letter.
    DeadLettered {
        /// When it became a dead letter.
        failed_at: DateTime<Utc>,
        /// Attempts made.
        attempts: u32,
        /// Error of the last attempt.
        last_error: String,
        /// The last failed attempts, oldest first ([`ATTEMPT_LOG_LEN`]).
        #[serde(default)]
        attempt_log: Vec<FailedAttempt>,
    },
}

impl DeliveryState {
    /// Time of the record: due, completion or failure time.
    fn at(&self) -> DateTime<Utc> {
        match self {
            DeliveryState::Pending { due_at, .. } => *due_at,
            DeliveryState::Completed { completed_at, .. } => *completed_at,
            DeliveryState::DeadLettered { failed_at, .. } => *failed_at,
        }
    }
}

impl EventLookup {
    /// Adds one record of the event for a handler, keeping one entry per
    /// handler as [`HandlerDelivery::state`] says, sorted by handler id.
    pub fn add(&mut self, handler_id: String, handler_name: Option<String>, state: DeliveryState) {
        let pos = self
            .handlers
            .binary_search_by(|h| h.handler_id.as_str().cmp(&handler_id));
        match pos {
            Err(i) => self.handlers.insert(
                i,
                HandlerDelivery {
                    handler_id,
                    handler_name,
                    state,
                },
            ),
            Ok(i) => {
                let had = &mut self.handlers[i];
                let replaces = match (&had.state, &state) {
                    (DeliveryState::Pending { .. }, DeliveryState::Pending { .. }) => {
                        state.at() < had.state.at()
                    }
                    (DeliveryState::Pending { .. }, _) => false,
                    (_, DeliveryState::Pending { .. }) => true,
                    (old, new) => new.at() > old.at(),
                };
                if replaces {
                    had.state = state;
                }
                if had.handler_name.is_none() {
                    had.handler_name = handler_name;
                }
            }
        }
    }
}

/// Which of a handler's deliveries [`Store::handler_deliveries`] lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryListState {
    /// Pending deliveries (waiting, due or in flight), by delivery id.
    Pending,
    /// Dead letters, by dead-letter id.
    Dead,
    /// Completions, by completion time.
    Completed,
}

/// Where a page of [`Store::handler_deliveries`] starts: strictly after
/// (older than) the last item of the previous page
/// ([`HandlerDeliveryItem::cursor`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeliveriesCursor {
    /// Pending or dead: items with a smaller delivery or dead-letter id.
    Id(i64),
    /// Completed: items completed before `at`, or at `at` with a smaller
    /// event id.
    Completed {
        /// Completion time of the last item.
        at: DateTime<Utc>,
        /// Event id of the last item.
        event_id: String,
    },
}

/// A page request of [`Store::handler_deliveries`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerDeliveriesQuery {
    /// The handler (an unknown one has no items).
    pub handler_id: String,
    /// Which records.
    pub state: DeliveryListState,
    /// Only events of this ordering key.
    pub key: Option<String>,
    /// Start after this item; `None`: the newest.
    pub after: Option<DeliveriesCursor>,
    /// Most items to return (at least 1).
    pub limit: u32,
    /// `Completed` only: completions before this time are not read (the
    /// retention window's start; older ones are pruned or about to be).
    pub completed_since: DateTime<Utc>,
}

/// One item of [`Store::handler_deliveries`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandlerDeliveryItem {
    /// Event id.
    pub event_id: String,
    /// Event type; `None` only for a completion whose event was pruned.
    pub event_type: Option<String>,
    /// Ordering key.
    pub key: Option<String>,
    /// Position of the event within its key; `None` when unkeyed.
    pub seq: Option<i64>,
    /// Lane of the event; `None` only for a completion whose event was
    /// pruned.
    pub lane: Option<Lane>,
    /// Pending: the delivery id; dead: the dead-letter id (for replay);
    /// completed: `None` (completions have no id).
    pub id: Option<i64>,
    /// The record: pending, completed or dead-lettered.
    pub state: DeliveryState,
}

impl HandlerDeliveryItem {
    /// The cursor of the page that follows this item.
    pub fn cursor(&self) -> DeliveriesCursor {
        match (&self.state, self.id) {
            (DeliveryState::Completed { completed_at, .. }, _) => DeliveriesCursor::Completed {
                at: *completed_at,
                event_id: self.event_id.clone(),
            },
            (_, id) => DeliveriesCursor::Id(id.unwrap_or(0)),
        }
    }
}

/// Which wake-up mechanism a store offers.
#[derive(Debug)]
pub enum Wakeups {
    /// The store pushes a wake-up per publishing transaction, naming the
    /// lanes that got deliveries where it can (merged while queued).
    Push(wake::WakeReceiver),
    /// No push mechanism: poll.
    Poll,
}

/// The error of a [`Store`] that keeps no subject keys.
fn no_subject_keys() -> StoreError {
    StoreError::Invalid("this store keeps no subject keys (personal fields)".into())
}

/// The storage contract every backend implements and the conformance suite
/// checks. All methods are safe to call concurrently.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Backend name, for logs and metrics (`postgres`, `sqlite`, ...).
    fn backend(&self) -> &'static str;

    /// Number of lanes, fixed when the store was created.
    fn lanes(&self) -> u16;

    /// Publishes a batch in one transaction: events plus one delivery per
    /// matching handler (enabled or disabled: a disabled handler's are kept
    /// until it is enabled); keyed events get the next sequence numbers
    /// of their key in batch order. Ids already stored (or repeated within the
    /// batch) count as duplicates and create nothing.
    ///
    /// The backends write concurrent calls together (group commit,
    /// [`GroupStats`]): a valid batch that arrives while another is being
    /// written shares the next transaction with the others queued, in
    /// arrival order, as if the calls had run one after the other; each call
    /// returns after that commit with its own outcome.
    ///
    /// An event's [`NewEvent::expected_seq`] is checked against its key's
    /// sequence in the same transaction (in a group, after the group's
    /// earlier batches, as if the calls had run one after the other; a
    /// batch that expects a sequence of a key an earlier batch of the
    /// forming group writes waits for the next group). A group whose write
    /// fails on one batch's expectation is written again batch by batch, so
    /// only that caller gets [`StoreError::SeqConflict`].
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for an event breaking [`NewEvent::validate`]
    /// (nothing is written); [`StoreError::SeqConflict`] for an expectation
    /// that did not hold (nothing is written);
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`].
    async fn publish(&self, events: Vec<NewEvent>) -> Result<PublishOutcome>;

    /// Publishes lanebus's own operational events ([`operational`]) as
    /// [`publish`](Self::publish) does (one transaction, group commit,
    /// idempotent ids), with the reverse type rule: every event's type must
    /// start with the reserved `lanebus.` prefix, which `publish` refuses.
    /// Only lanebus itself calls it.
    ///
    /// Provided: refuses everything, for stores (wrappers, test doubles)
    /// that do not publish operational events.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for an event breaking
    /// [`rules::event::check_operational`] (nothing is written);
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`].
    async fn publish_operational(&self, events: Vec<NewEvent>) -> Result<PublishOutcome> {
        let _ = events;
        Err(StoreError::Invalid(format!(
            "the {} store does not publish operational events",
            self.backend()
        )))
    }

    /// Raises `lane`'s epoch to `epoch` and records `owner`, if the stored
    /// epoch is lower. Returns `true` when the caller now holds `epoch`.
    async fn fence(&self, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool>;

    /// Reads due and not-yet-due deliveries of many lanes in one statement.
    /// Lanes whose epoch differs come back with `owned == false` and nothing.
    async fn claim(&self, lanes: &[LaneClaim]) -> Result<Vec<LaneBatch>>;

    /// Completes deliveries: deletes them and appends completion rows, in one
    /// statement (or one transaction). Fenced-out refs change nothing.
    /// Returns the ids actually completed.
    async fn complete(&self, done: &[DeliveryRef]) -> Result<Vec<i64>>;

    /// Discards deliveries: deletes them WITHOUT completion rows, fenced
    /// like [`complete`](Self::complete) (refs whose lane is not at the
    /// given epoch, or whose row is gone, change nothing; `attempts` is
    /// ignored). For deliveries whose handler no longer exists, such as
    /// those a publish that read the handler before
    /// [`delete_handler`](Self::delete_handler) committed after it: nothing
    /// was delivered, so nothing is recorded as completed. Callers must
    /// make sure the handler is gone first (this removes any delivery it is
    /// given). Returns the ids actually deleted, in ascending order.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`]; nothing is
    /// deleted then.
    async fn discard(&self, refs: &[DeliveryRef]) -> Result<Vec<i64>>;

    /// Records failed attempts (attempt count, next due time, last error)
    /// and appends each [`Reschedule::failure`] to its delivery's attempt
    /// log, keeping the last [`ATTEMPT_LOG_LEN`], in the same statement (or
    /// document replacement): a failed attempt costs no write more than
    /// before. Returns the ids actually updated.
    async fn reschedule(&self, items: &[Reschedule]) -> Result<Vec<i64>>;

    /// Moves deliveries to the dead letters, each with its delivery's
    /// attempt log and [`DeadLetterRequest::failure`] appended (the last
    /// [`ATTEMPT_LOG_LEN`]). A completion keeps no attempt log (its
    /// attempt count says how many were made); a replayed dead letter is a
    /// fresh delivery with an empty log. Returns the ids actually moved.
    async fn dead_letter(&self, items: &[DeadLetterRequest]) -> Result<Vec<i64>>;

    /// Registers a handler. Its routes are validated by [`route::validate_pattern`].
    async fn create_handler(&self, handler: NewHandler) -> Result<Handler>;
    /// All handlers, by creation order.
    async fn list_handlers(&self) -> Result<Vec<Handler>>;
    /// One handler; [`StoreError::NotFound`] if absent.
    async fn get_handler(&self, id: &str) -> Result<Handler>;
    /// Enables or disables a handler (a `410 Gone` answer disables it), and
    /// returns it, recording the reason `api`. Disabling keeps its pending
    /// deliveries, and publishes made while it is disabled create
    /// deliveries for it as for an enabled one: they are kept, not
    /// attempted, until it is enabled.
    ///
    /// Provided: [`change_handler_state`](Self::change_handler_state) with
    /// the reason `api`.
    /// Publishes the change's operational event as
    /// [`change_handler_state`](Self::change_handler_state) does; the
    /// node's enables and disables go through [`change_state`], which also
    /// counts and logs them.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] if absent.
    async fn set_handler_state(&self, id: &str, state: HandlerState) -> Result<Handler> {
        Ok(self.change_handler_state(id, state, "api").await?.handler)
    }
    /// As [`set_handler_state`](Self::set_handler_state), recording `reason`
    /// and the time in [`Handler::state_reason`] and
    /// [`Handler::state_changed_at`] when the state changes (setting the
    /// state it has already changes nothing). Enabling clears
    /// [`Handler::failing_since`]. Answers the handler after the call and
    /// the state it had before, read in the same atomic step as the write
    /// (a row lock, the write transaction, or one `findOneAndUpdate`): of
    /// concurrent calls setting the same state, on any node, exactly one
    /// sees [`StateChange::changed`]. The call that changed the state
    /// also publishes the change's operational event
    /// ([`operational::state_changed`]): SQLite and PostgreSQL in the same
    /// transaction, MongoDB right after its single-document update.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] if absent.
    async fn change_handler_state(
        &self,
        id: &str,
        state: HandlerState,
        reason: &str,
    ) -> Result<StateChange>;
    /// Changes a handler's settings (see [`HandlerPatch`]), checked like a
    /// registration ([`Handler::patched`]), and returns it. Route changes
    /// apply to events published after the change; deliveries already
    /// created keep going to the handler.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] if absent; [`StoreError::Invalid`] for a bad
    /// field (nothing is changed).
    async fn update_handler(&self, id: &str, patch: &HandlerPatch) -> Result<Handler>;
    /// Rotates a handler's signing secret: `secret` becomes the current one
    /// and the current one becomes [`Handler::previous_secret`], signing
    /// too until `previous_until`. A secret still in a previous grace period
    /// is dropped (two secrets sign at most).
    ///
    /// # Errors
    /// [`StoreError::NotFound`] if absent; [`StoreError::Invalid`] for a
    /// secret that is not `whsec_` + base64 of 24 to 64 bytes.
    async fn rotate_handler_secret(
        &self,
        id: &str,
        secret: &str,
        previous_until: DateTime<Utc>,
    ) -> Result<Handler>;
    /// Records the start of a run of failures (`failing == true`: sets
    /// [`Handler::failing_since`] to `at` unless it is set) or its end
    /// (`false`: clears it). Nodes call it only when the value they see in
    /// their catalog is to change, so it is rare.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] if absent.
    async fn mark_handler_failing(&self, id: &str, failing: bool, at: DateTime<Utc>) -> Result<()>;
    /// Removes a handler and discards its pending deliveries and its dead
    /// letters, returning how many of each were discarded;
    /// [`StoreError::NotFound`] if absent. Nothing is routed to the handler
    /// once the call has started removing it. SQLite and MongoDB do it in
    /// one transaction; PostgreSQL removes the handler first and then its
    /// rows in short batches, so the delete of a large backlog holds up no
    /// other handler's dispatch (an interrupted one leaves the rest to the
    /// lane owners, which discard deliveries of an unknown handler, and a
    /// repeated call sweeps it before answering `NotFound`).
    async fn delete_handler(&self, id: &str) -> Result<DeletedHandler>;

    /// Adds a type to the event-type catalog ([`event_types`]) and raises
    /// the catalog version, so every node's next publish honours it.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] for a broken [`rules::event_type`] rule (a
    /// schema that is not a valid draft 2020-12 JSON Schema included);
    /// [`StoreError::Conflict`] when its name or an alias is already a
    /// type's wire name or alias.
    async fn create_event_type(&self, new: NewEventType) -> Result<EventType>;

    /// Every cataloged type, by wire name.
    async fn list_event_types(&self) -> Result<Vec<EventType>>;

    /// The type whose wire name or alias is `name`;
    /// [`StoreError::NotFound`] if none.
    async fn get_event_type(&self, name: &str) -> Result<EventType> {
        self.list_event_types()
            .await?
            .into_iter()
            .find(|t| t.names().any(|n| n == name))
            .ok_or_else(|| event_types::not_found(name))
    }

    /// Changes the type whose wire name or alias is `name`
    /// ([`EventTypePatch`]; a new name renames it, the old wire name
    /// becoming an alias) and raises the catalog version.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown name; otherwise as
    /// [`create_event_type`](Self::create_event_type).
    async fn update_event_type(&self, name: &str, patch: &EventTypePatch) -> Result<EventType>;

    /// Marks the type whose wire name or alias is `name` deprecated: its
    /// events are still accepted (as in Svix), and it is shown deprecated.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown name.
    async fn deprecate_event_type(&self, name: &str) -> Result<EventType> {
        let patch = EventTypePatch {
            deprecated: Some(true),
            ..EventTypePatch::default()
        };
        self.update_event_type(name, &patch).await
    }

    /// The store-wide catalog setting (stored, so every node agrees).
    async fn catalog_settings(&self) -> Result<CatalogSettings>;

    /// Stores the catalog setting and raises the catalog version, so every
    /// node's next publish honours it. Returns it.
    async fn set_catalog_settings(&self, settings: CatalogSettings) -> Result<CatalogSettings>;

    /// The node's master key and cache of data keys ([`personal`]). The
    /// default: a keyring without a master key, shared by every store that
    /// keeps no subject keys.
    fn keyring(&self) -> &personal::Keyring {
        static NONE: std::sync::LazyLock<personal::Keyring> =
            std::sync::LazyLock::new(personal::Keyring::default);
        &NONE
    }

    /// The stored (wrapped) data keys of `subjects` that exist, in no
    /// particular order.
    ///
    /// # Errors
    /// [`StoreError::Invalid`] on a store that keeps no subject keys.
    async fn subject_keys(&self, subjects: &[String]) -> Result<Vec<personal::WrappedKey>> {
        let _ = subjects;
        Err(no_subject_keys())
    }

    /// Stores each of `keys` whose subject has none yet (a key already
    /// stored wins: read them back with [`subject_keys`](Self::subject_keys)).
    ///
    /// # Errors
    /// As [`subject_keys`](Self::subject_keys).
    async fn insert_subject_keys(&self, keys: &[personal::WrappedKey]) -> Result<()> {
        let _ = keys;
        Err(no_subject_keys())
    }

    /// Deletes `subject`'s data key; whether there was one. Use
    /// [`personal::forget_subject`], which also drops it from the cache.
    ///
    /// # Errors
    /// As [`subject_keys`](Self::subject_keys).
    async fn delete_subject_key(&self, subject: &str) -> Result<bool> {
        let _ = subject;
        Err(no_subject_keys())
    }

    /// Every stored data key (master key rotation, [`personal::rotate`]).
    ///
    /// # Errors
    /// As [`subject_keys`](Self::subject_keys).
    async fn all_subject_keys(&self) -> Result<Vec<personal::WrappedKey>> {
        Err(no_subject_keys())
    }

    /// Replaces the stored key `old` by `new` (same subject) when it is
    /// still stored as `old`; whether it was.
    ///
    /// # Errors
    /// As [`subject_keys`](Self::subject_keys).
    async fn replace_subject_key(
        &self,
        old: &personal::WrappedKey,
        new: &personal::WrappedKey,
    ) -> Result<bool> {
        let _ = (old, new);
        Err(no_subject_keys())
    }

    /// Lists dead letters, oldest first.
    async fn list_dead_letters(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>>;
    /// Puts dead letters back as fresh deliveries (attempts reset) and
    /// removes them from the dead letters; returns how many were replayed.
    /// `ids` empty with `handler_id` set replays all of that handler's.
    async fn replay_dead_letters(&self, ids: &[i64], handler_id: Option<&str>) -> Result<u64>;

    /// Replays the dead letters of `handler_id` that failed at or after
    /// `failed_since` and before `failed_until` (each bound optional), as
    /// [`replay_dead_letters`](Self::replay_dead_letters) does: fresh
    /// deliveries (attempts reset), which a key's lane owner hands out in
    /// sequence order. Returns how many were replayed (0 for an unknown
    /// handler).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`]; nothing is
    /// replayed then.
    async fn replay_dead_letters_between(
        &self,
        handler_id: &str,
        failed_since: Option<DateTime<Utc>>,
        failed_until: Option<DateTime<Utc>>,
    ) -> Result<u64>;

    /// Recovery: delivers again to `handler_id` every event whose delivery
    /// to it completed at or after `since` and that is still stored (see
    /// [`prune`](Self::prune)): one fresh delivery per event (several
    /// completions of one event count once), marked
    /// [`Delivery::replay`], with the event's id, key and sequence, so a
    /// key's recovered events are handed out in sequence order. Events that
    /// already have a pending delivery to the handler are skipped.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] for an unknown handler;
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`] (nothing is
    /// recovered then).
    async fn recover(&self, handler_id: &str, since: DateTime<Utc>) -> Result<RecoverOutcome>;

    /// Retention: removes one batch of at most `limit` completion rows
    /// completed before `before`, and at most `limit` events published
    /// before `before` that have no pending delivery and no dead letter
    /// (those are kept, whatever their age). Short: one statement (or one
    /// transaction) touching only the removed rows, so it holds no lock that
    /// claims, completions or publishes wait for. Call it again while it
    /// removes a full batch.
    ///
    /// Backends differ at the edge: SQLite and PostgreSQL remove only events
    /// published two minutes or more before `before` (so that every
    /// completion of a removed event lies before `before`: see
    /// `postgres/sql/prune.sql`); MongoDB removes those published before
    /// `before`. A caller that must see an event gone passes a `before` at
    /// least two minutes past its publish.
    ///
    /// An event id removed here may be published again as new (idempotent
    /// publish holds within the retention period).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`]; nothing is
    /// removed then.
    async fn prune(&self, before: DateTime<Utc>, limit: u32) -> Result<Pruned>;

    /// Every lane with owner, epoch and backlog, by lane number.
    async fn lane_rows(&self) -> Result<Vec<LaneRow>>;

    /// Totals (events, pending deliveries, completions, dead letters).
    async fn counts(&self) -> Result<StoreCounts>;

    /// The event `id` and, per handler with a record of it, its delivery
    /// state ([`EventLookup`]): pending deliveries, completions and dead
    /// letters of the event, read in one snapshot (one statement on the SQL
    /// backends, one snapshot transaction on MongoDB). `None` when no event
    /// `id` is stored: never published, or pruned by retention
    /// ([`prune`](Self::prune)), which removes completed events (and their
    /// completions) past the retention period, so the two cannot be told
    /// apart. Reads only, and no index was added for it (the dispatch path
    /// writes nothing more); the cost per backend:
    /// - the event: its primary key (MongoDB reads the payload to measure
    ///   it; the SQL backends measure it in the statement);
    /// - pending: the event's lane's delivery rows (claim index on the
    ///   lane; no event index on deliveries);
    /// - completions: PostgreSQL, those completed since a minute before the
    ///   event's publish (BRIN range on `completed_at`); MongoDB, index
    ///   `(event_id, completed_at)`; SQLite, a scan of the completion log
    ///   (kept short by retention);
    /// - dead letters: index on `event_id` (every backend);
    /// - handler names: primary key of each handler listed.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`].
    async fn lookup_event(&self, id: &str) -> Result<Option<EventLookup>>;

    /// One page of a handler's deliveries in one state, newest first: at
    /// most `q.limit` items after `q.after`, only events of `q.key` when
    /// set. Empty for an unknown handler (callers check it). Reads only, no
    /// index of its own (the dispatch path writes nothing more); the cost
    /// per state and backend, `n` being the limit:
    /// - `Pending`, by delivery id descending. PostgreSQL and SQLite: a
    ///   backward walk of the primary key filtered by handler (and key),
    ///   which stops at the `n`-th match: it reads every other handler's
    ///   pending rows newer than that match, and the whole table when the
    ///   handler has fewer than `n` (no handler index on deliveries).
    ///   MongoDB: the handler's pending deliveries through index
    ///   `by_handler` and a sort, or the `_id` index walked backward as
    ///   above, whichever the planner picks; its delivery ids are `(lane
    ///   position, lane)`, so the order is newest first within a lane, only
    ///   roughly across lanes.
    /// - `Dead`, by dead-letter id descending: index `(handler_id, id)`
    ///   walked backward (every backend); a key filter reads the handler's
    ///   dead letters newer than the `n`-th match.
    /// - `Completed`, by `(completed_at, event_id)` descending, from
    ///   `q.completed_since` on. PostgreSQL: BRIN range scans of
    ///   `completed_at` over windows going back from the cursor (1 minute,
    ///   then doubling) until `n` items or `completed_since`: each reads
    ///   every handler's completions in its window (and the block ranges
    ///   BRIN has not summarized yet, the newest until autosummarize or a
    ///   vacuum), so a page costs about the completions since its `n`-th
    ///   item (up to twice), and the whole retention window for a handler
    ///   with fewer. MongoDB: index
    ///   `retention` (`completed_at`) walked backward, filtered by handler:
    ///   the completions since the `n`-th match. SQLite: a scan of the
    ///   completion log (retention keeps it short) and a sort.
    /// - the event's type, key, sequence and lane (completed; type also for
    ///   pending and dead): the event's primary key per item.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`].
    async fn handler_deliveries(
        &self,
        q: &HandlerDeliveriesQuery,
    ) -> Result<Vec<HandlerDeliveryItem>>;

    /// Checks that the store answers (for `/readyz`).
    async fn ping(&self) -> Result<()>;

    /// The time on the clock the store's timestamps are written by (publish
    /// times, fresh deliveries' due times, completion times), so that
    /// cutoffs compared with them (retention, the recover window) do not mix
    /// in a node's clock: PostgreSQL's `now()`; SQLite's is the host's (the
    /// store is a file of this process); MongoDB's documents carry their
    /// writers' clocks, so there it is this node's.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`]/[`StoreError::Timeout`]/[`StoreError::Database`].
    async fn now(&self) -> Result<DateTime<Utc>>;

    /// Subscribes to publish wake-ups.
    async fn wakeups(&self) -> Result<Wakeups>;
}

/// Opens a store from a URL: `postgres://...` or `postgresql://...`
/// (feature `postgres`), `mongodb://...` (feature `mongodb`; a replica set)
/// or `sqlite://PATH` (feature `sqlite`, the default; created if missing),
/// applying migrations.
///
/// # Errors
/// [`StoreError::Invalid`] for an unknown scheme, or one whose backend this
/// build of `lanebus-store` does not include (its cargo feature is off);
/// connection errors otherwise.
pub async fn open(url: &str) -> Result<std::sync::Arc<dyn Store>> {
    let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        "postgres"
    } else if url.starts_with("mongodb://") {
        "mongodb"
    } else if url.starts_with("sqlite:") {
        "sqlite"
    } else {
        return Err(StoreError::Invalid(format!(
            "store url {url:?} must start with postgres://, postgresql://, mongodb:// or sqlite://"
        )));
    };
    match backend {
        #[cfg(feature = "postgres")]
        "postgres" => Ok(std::sync::Arc::new(postgres::PgStore::connect(url).await?)),
        #[cfg(feature = "mongodb")]
        "mongodb" => Ok(std::sync::Arc::new(
            mongodb::MongoStore::connect(url).await?,
        )),
        #[cfg(feature = "sqlite")]
        "sqlite" => Ok(std::sync::Arc::new(
            sqlite::SqliteStore::connect(url).await?,
        )),
        _ => Err(StoreError::Invalid(format!(
            "store url {url:?} needs the {backend} backend, which this build does not include \
             (lanebus-store's cargo feature `{backend}` is off)"
        ))),
    }
}

/// A new random signing secret: `whsec_` + base64 of 32 random bytes.
pub fn generate_secret() -> String {
    use base64::Engine as _;
    let bytes: [u8; 32] = rand::random();
    format!(
        "whsec_{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

/// A new handler id: `hdl_` + a UUIDv7 in simple form.
pub fn generate_handler_id() -> String {
    format!("hdl_{}", uuid::Uuid::now_v7().simple())
}

/// A new event id: a UUIDv7 (hyphenated), whose creation time
/// [`event_id_time`] reads back.
pub fn generate_event_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// The creation time an event id carries, to the millisecond: `Some` for a
/// UUIDv7 (as [`generate_event_id`] makes at publish, on the publishing
/// node's clock), `None` for any other id. An id the publisher chose
/// carries no time unless it is a UUIDv7 too (then it carries the time the
/// publisher gave it).
pub fn event_id_time(id: &str) -> Option<DateTime<Utc>> {
    let uuid = uuid::Uuid::try_parse(id).ok()?;
    if uuid.get_version() != Some(uuid::Version::SortRand) {
        return None;
    }
    let (secs, nanos) = uuid.get_timestamp()?.to_unix();
    DateTime::from_timestamp(i64::try_from(secs).ok()?, nanos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_event_id_carries_its_creation_time() {
        let before = Utc::now() - chrono::TimeDelta::milliseconds(1);
        let id = generate_event_id();
        let after = Utc::now();
        let at = event_id_time(&id).expect("a UUIDv7 carries a time");
        assert!(before <= at && at <= after, "{before} <= {at} <= {after}");
        // The time of a known UUIDv7 (RFC 9562, appendix A.6).
        assert_eq!(
            event_id_time("017f22e2-79b0-7cc3-98c4-dc0c0c07398f"),
            DateTime::from_timestamp_millis(0x017f_22e2_79b0)
        );
        // Other ids carry none: chosen ones, other UUID versions.
        for id in [
            "ord-7",
            "",
            "017f22e2-79b0-7cc3-98c4",
            "f81d4fae-7dec-11d0-a765-00a0c91e6bf6", // v1
            "c232ab00-9414-11ec-b3c8-9f6bdeced846", // v6
            "919108f7-52d1-4320-9bac-f847db4148a8", // v4
        ] {
            assert_eq!(event_id_time(id), None, "{id:?}");
        }
    }

    #[test]
    fn a_body_prefix_is_cut_on_a_character_boundary() {
        assert_eq!(FailedAttempt::body_prefix(b""), None);
        assert_eq!(FailedAttempt::body_prefix(b"oops").as_deref(), Some("oops"));
        // 1,023 ASCII bytes, then a 3-byte character across the limit:
        // the whole character goes.
        let mut body = vec![b'a'; ATTEMPT_BODY_BYTES - 1];
        body.extend_from_slice("€ and more".as_bytes());
        let kept = FailedAttempt::body_prefix(&body).expect("kept");
        assert_eq!(kept.len(), ATTEMPT_BODY_BYTES - 1);
        assert!(kept.bytes().all(|b| b == b'a'));
        // Exactly the limit, ending on a whole character: kept whole.
        let mut body = vec![b'a'; ATTEMPT_BODY_BYTES - 3];
        body.extend_from_slice("€".as_bytes());
        body.extend_from_slice(b"tail");
        let kept = FailedAttempt::body_prefix(&body).expect("kept");
        assert_eq!(kept.len(), ATTEMPT_BODY_BYTES);
        assert!(kept.ends_with('€'));
        // Bytes that are not UTF-8 become U+FFFD.
        let kept = FailedAttempt::body_prefix(b"\xff\xfebin").expect("kept");
        assert_eq!(kept, "\u{FFFD}\u{FFFD}bin");
    }

    #[test]
    fn an_attempt_log_keeps_the_last_entries() {
        let entry = |attempt| FailedAttempt {
            attempt,
            at: DateTime::<Utc>::default(),
            status: Some(500),
            error: None,
            duration_ms: 1,
            body: None,
            body_withheld: false,
        };
        let mut log = Vec::new();
        for n in 1..=7 {
            entry(n).push_onto(&mut log);
        }
        let kept: Vec<u32> = log.iter().map(|f| f.attempt).collect();
        let first = 8 - ATTEMPT_LOG_LEN as u32;
        assert_eq!(kept, (first..=7).collect::<Vec<_>>());
    }
}
