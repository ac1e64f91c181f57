//! The oracle: judges one scenario's record against docs/design.md section 2,
//! once its faults have stopped. Pure: it reads plain logs (what publishers
//! had acknowledged, what the receiver got, what the admin API showed) and
//! returns a [`Report`]; the unit tests feed it synthetic logs that break
//! each invariant.
//!
//! ```text
//! published (acked / in doubt) ─┐
//! receiver requests ────────────┼─▶ judge ─▶ Report { lost, repeats by cause,
//! lane samples (owner, epoch) ──┤                    out of order, corrupted,
//! dead letters, recovery time ──┘                    two owners, ... }
//! ```
//!
//! What each invariant becomes here:
//! 1. **No loss**: every (acked event, matching handler) was answered 2xx or
//!    is a dead letter (dead letters count as lost where the scenario does
//!    not expect them).
//! 2. **One at a time, in order**: per (handler, key) (or unkeyed
//!    delivery), no request arrives while an earlier one is in flight at
//!    the receiver (from its arrival until the receiver ended it, at the
//!    latest until the handler's timeout; [`OVERLAP_TOLERANCE_MS`] of
//!    slack): an *overlap*. The first arrival of the event at
//!    publish position i comes after every earlier position was answered 2xx
//!    (or dead-lettered); a repeat of an earlier event after a later one
//!    arrived is a rewind, allowed only after an owner change; the
//!    `lanebus-sequence` header grows with the publish position.
//! 3. **Repeats** are attributed to a cause, in this order: the previous
//!    attempt failed as the receiver saw it (non-2xx, reset, no answer, or an
//!    answer later than the handler's timeout); the node saw it fail
//!    (`lanebus-attempt` grew although the receiver answered 2xx in time,
//!    e.g. a paused node whose timer fired); the lane changed owner between
//!    the two attempts: the two came from different nodes, or the lane's
//!    epoch grew, or the sender no longer owned the lane. Anything else is
//!    unattributed.
//! 4. **Fencing**: one epoch of a lane has one owner, in every sample from
//!    every node; a node never shows a lane's epoch going back.
//! 5. **Atomic publish**: a batch whose publisher died before the answer is
//!    all delivered or not at all.
//!
//! Loss, order, repeats and overlaps are judged by the one checker
//! ([`crate::invariants`], publish positions as [`Earlier::Listed`]); this
//! module supplies its causes (senders, attempt numbers, lane samples) and
//! judges the rest.
//!
//! Also: payload bytes as published (the `data` member of the webhook body,
//! spliced unchanged by the node), valid signatures, nothing unexpected, and
//! recovery within the bound.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::invariants::{
    self, Cause, Causes, Delivery, Disorder, Earlier, HandOver, Model, Repeat,
};

/// One published event, in publish order per publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Event id.
    pub id: String,
    /// Event type.
    pub event_type: String,
    /// Key, if any.
    pub key: Option<String>,
    /// The payload's JSON text as published.
    pub payload: String,
    /// Whether the publish was acknowledged (`false`: the publisher died
    /// before the answer; the batch may or may not exist).
    pub acked: bool,
    /// The publish call it belonged to (publisher name and call number).
    pub batch: String,
}

/// A handler as registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerSpec {
    /// Name (the receiver's URL segment).
    pub name: String,
    /// Event type patterns (exact, or a trailing `*`).
    pub patterns: Vec<String>,
    /// The handler's timeout, in milliseconds.
    pub timeout_ms: u64,
    /// Whether dead letters are expected for it in this scenario.
    pub dead_letters_expected: bool,
}

impl HandlerSpec {
    /// Whether the handler's route matches `event_type`.
    pub fn matches(&self, event_type: &str) -> bool {
        self.patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => event_type.starts_with(prefix),
            None => p == event_type,
        })
    }
}

/// One request as the receiver logged it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Request {
    /// Handler name.
    pub handler: String,
    /// `webhook-id`.
    pub event_id: String,
    /// `lanebus-key`.
    pub key: Option<String>,
    /// `lanebus-sequence`.
    pub sequence: Option<i64>,
    /// `lanebus-attempt`.
    pub attempt: u32,
    /// Arrival, milliseconds since the run started.
    pub arrived_ms: f64,
    /// When the answer was about to be written, if one was (`None`: reset
    /// or dropped).
    pub answered_ms: Option<f64>,
    /// Status answered (`None`: reset or dropped without an answer).
    pub status: Option<u16>,
    /// When the receiver ended the exchange, milliseconds since the run
    /// started: the answer about to be written, the connection reset, or
    /// closed after a hold; `None`: not known (the request then counts as
    /// in flight until its timeout).
    pub ended_ms: Option<f64>,
    /// The `data` member of the body as bytes (`None`: body unreadable).
    pub data: Option<String>,
    /// Whether the signature verified.
    pub signature_ok: bool,
    /// The node that sent it (its `--id`), when the receiver could tell.
    pub sender: Option<String>,
}

impl Request {
    fn accepted(&self) -> bool {
        matches!(self.status, Some(s) if (200..300).contains(&s))
    }

    /// The end of the request's time in flight at the receiver: when the
    /// receiver ended the exchange, at the latest when the sender's timeout
    /// ran out (it has given up then), in milliseconds since the run
    /// started.
    fn in_flight_until(&self, timeout_ms: u64) -> f64 {
        let end = self.ended_ms.or(self.answered_ms).unwrap_or(f64::INFINITY);
        end.min(self.arrived_ms + timeout_ms as f64)
    }

    /// Whether the node could have seen this attempt succeed.
    fn succeeded_in_time(&self, timeout_ms: u64) -> bool {
        self.accepted()
            && self
                .answered_ms
                .is_some_and(|a| a - self.arrived_ms < timeout_ms as f64)
    }
}

/// One lane as one node's admin API showed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneSample {
    /// When, milliseconds since the run started.
    pub at_ms: u64,
    /// Which node answered.
    pub node: String,
    /// Lane.
    pub lane: u16,
    /// Owner.
    pub owner: Option<String>,
    /// Epoch.
    pub epoch: i64,
}

/// Everything the oracle reads.
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// Number of lanes.
    pub lanes: u16,
    /// Published events, each publisher's in its publish order.
    pub published: Vec<Published>,
    /// Handlers.
    pub handlers: Vec<HandlerSpec>,
    /// Receiver log (any order: judged in arrival order).
    pub requests: Vec<Request>,
    /// Admin API samples.
    pub samples: Vec<LaneSample>,
    /// Dead letters as (handler name, event id).
    pub dead_letters: Vec<(String, String)>,
    /// Milliseconds from the end of the slowest fault (restart, SIGCONT,
    /// heal) until full health (every node ready, every lane owned and
    /// active); `None` if a fault or the final heal was not followed by
    /// health within the bound.
    pub recovered_ms: Option<u64>,
    /// How far a lane sample may lag the request it explains, in
    /// milliseconds (the sampling interval plus slack).
    pub sample_slack_ms: u64,
}

/// Repeats by cause.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Repeats {
    /// The previous attempt failed as the receiver saw it.
    pub failed: usize,
    /// The node saw the previous attempt fail (attempt number grew).
    pub node_timeout: usize,
    /// The lane changed owner between the two attempts.
    pub owner_change: usize,
    /// No cause found: a violation.
    pub unattributed: usize,
}

/// The verdict over one scenario.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// Acknowledged events.
    pub events: usize,
    /// Events whose publish was in doubt (publisher killed).
    pub in_doubt: usize,
    /// Expected (event, handler) deliveries.
    pub expected: usize,
    /// Requests the receiver got.
    pub requests: usize,
    /// Expected deliveries answered 2xx.
    pub delivered: usize,
    /// Expected deliveries dead-lettered (and not delivered).
    pub dead_lettered: usize,
    /// Expected deliveries neither delivered nor (where allowed) dead-lettered.
    pub lost: usize,
    /// Deliveries dead-lettered although an attempt had succeeded in time:
    /// a delivery ends once, completed or dead-lettered (invariant 1; what a
    /// deposed owner's unfenced dead letter would leave).
    pub completed_and_dead: usize,
    /// Repeats by cause.
    pub repeats: Repeats,
    /// Order violations.
    pub out_of_order: usize,
    /// Rewinds of a key after an owner change (allowed, counted).
    pub rewinds: usize,
    /// Payloads not byte-identical to what was published.
    pub corrupted: usize,
    /// Bad signatures.
    pub bad_signatures: usize,
    /// Accepted deliveries nobody published or no route matches.
    pub unexpected: usize,
    /// In-doubt batches delivered in part.
    pub torn_batches: usize,
    /// Lane epochs seen with two owners, or epochs going back.
    pub two_owners: usize,
    /// Requests a deposed owner sent beyond the one per (handler, key) it
    /// may have had in flight when its lane moved (invariant 3: a repeat
    /// after an owner change is allowed only for a delivery in flight at
    /// the change; invariant 4: a deposed owner's completions touch
    /// nothing, so it cannot go on to the key's next delivery).
    pub deposed_sends: usize,
    /// Requests that arrived while an earlier request of the same
    /// (handler, key), or of the same unkeyed delivery, was still in flight
    /// at the receiver (see [`OVERLAP_TOLERANCE_MS`]): two attempts of one
    /// key processed at once, e.g. a deposed owner's attempt outliving its
    /// lease while the new owner sends the key's next delivery.
    pub overlaps: usize,
    /// Milliseconds to recover (see [`Record::recovered_ms`]).
    pub recovered_ms: Option<u64>,
    /// The first problems found, for the log.
    pub problems: Vec<String>,
}

impl Report {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.lost == 0
            && self.repeats.unattributed == 0
            && self.out_of_order == 0
            && self.corrupted == 0
            && self.bad_signatures == 0
            && self.unexpected == 0
            && self.torn_batches == 0
            && self.two_owners == 0
            && self.deposed_sends == 0
            && self.completed_and_dead == 0
            && self.overlaps == 0
            && self.recovered_ms.is_some()
    }

    fn problem(&mut self, p: String) {
        if self.problems.len() < 12 {
            self.problems.push(p);
        }
    }
}

/// How much earlier than the end of the previous request's time in flight
/// a request of the same (handler, key) may arrive before it counts as an
/// overlap, in milliseconds. Both ends are the receiver's clock, but the
/// sender sees them later than they are stamped: the arrival is stamped
/// once the head was read (late when the receiver's task is slow to run),
/// and the sender's timeout starts when it sends, before the arrival. On a
/// loaded 2-core machine tasks wait tens of milliseconds; 250 ms covers
/// that, and is far below the overlaps that matter (seconds: an attempt
/// outliving its owner's lease by up to the handler timeout).
pub const OVERLAP_TOLERANCE_MS: f64 = 250.0;

/// One sample of a lane: (at_ms, epoch, owner).
type Seen<'a> = (u64, i64, Option<&'a str>);

/// Epochs and owners per lane over time, from the samples.
struct Epochs<'a> {
    /// lane -> samples, sorted by time.
    by_lane: HashMap<u16, Vec<Seen<'a>>>,
}

impl<'a> Epochs<'a> {
    fn new(samples: &'a [LaneSample]) -> Epochs<'a> {
        let mut by_lane: HashMap<u16, Vec<Seen>> = HashMap::new();
        for s in samples {
            by_lane
                .entry(s.lane)
                .or_default()
                .push((s.at_ms, s.epoch, s.owner.as_deref()));
        }
        for v in by_lane.values_mut() {
            v.sort_unstable();
        }
        Epochs { by_lane }
    }

    /// The highest epoch seen for `lane` at or before `at_ms`, with its owner.
    fn latest(&self, lane: u16, at_ms: f64) -> Option<(i64, Option<&'a str>)> {
        self.by_lane.get(&lane).and_then(|v| {
            v.iter()
                .take_while(|(t, _, _)| (*t as f64) <= at_ms)
                .map(|(_, e, o)| (*e, *o))
                .max_by_key(|(e, _)| *e)
        })
    }

    /// The highest epoch seen for `lane` at or before `at_ms`.
    fn at(&self, lane: u16, at_ms: f64) -> Option<i64> {
        self.latest(lane, at_ms).map(|(e, _)| e)
    }

    /// Whether the lane had changed owner at least once by `at_ms`: two
    /// epochs seen, or an epoch above 1 (the epoch counts owner changes,
    /// some of which may predate the first sample).
    fn changed_by(&self, lane: u16, at_ms: f64) -> bool {
        self.by_lane.get(&lane).is_some_and(|v| {
            let mut seen = v.iter().take_while(|(t, _, _)| (*t as f64) <= at_ms);
            seen.next()
                .is_some_and(|(_, first, _)| *first > 1 || seen.any(|(_, e, _)| e != first))
        })
    }

    /// The epoch at which `sender` had certainly lost `lane` by `at_ms`, if
    /// it had: the samples show `sender` owning an epoch E0 and, by
    /// `at_ms`, a later epoch E of another owner; and every epoch after E0
    /// seen up to `at_ms + guard_ms` was sampled (epochs count owner
    /// changes and restarts one by one, so a gap could hide a regain) and
    /// none is `sender`'s. `None`: it may have been the owner (never seen
    /// owning the lane, seen owning it again, or a gap in the samples).
    fn deposed(&self, lane: u16, sender: &str, at_ms: f64, guard_ms: f64) -> Option<i64> {
        let mine = |o: Option<&str>| o.is_some_and(|o| o.split('/').next() == Some(sender));
        let (epoch, _) = self.latest(lane, at_ms)?;
        let mut owners: BTreeMap<i64, Option<&str>> = BTreeMap::new();
        for (t, e, o) in self.by_lane.get(&lane)? {
            if (*t as f64) > at_ms + guard_ms {
                break;
            }
            owners.entry(*e).or_insert(*o);
        }
        let e0 = owners
            .range(..=epoch)
            .rev()
            .find(|(_, o)| mine(**o))
            .map(|(e, _)| *e)?;
        if e0 == epoch {
            return None;
        }
        let last = *owners.keys().next_back()?;
        ((e0 + 1)..=last)
            .all(|e| owners.get(&e).is_some_and(|o| !mine(*o)))
            .then_some(epoch)
    }

    /// Whether `q` was sent by a node that no longer owned its lane: a
    /// delivery in flight on a deposed owner (e.g. frozen mid-send) that
    /// went out after the lane changed owner. Owners read `<id>` or
    /// `<id>/<incarnation>`.
    fn stale_sender(&self, lane: u16, q: &Request, at_ms: f64) -> bool {
        let Some(sender) = q.sender.as_deref() else {
            return false;
        };
        matches!(self.latest(lane, at_ms), Some((_, Some(owner)))
            if owner.split('/').next() != Some(sender))
    }
}

/// Judges one scenario.
pub fn judge(rec: &Record) -> Report {
    // The receiver logs a request when it is answered; judge in arrival
    // order.
    let mut requests: Vec<&Request> = rec.requests.iter().collect();
    requests.sort_by(|a, b| a.arrived_ms.total_cmp(&b.arrived_ms));
    let mut r = Report {
        requests: rec.requests.len(),
        recovered_ms: rec.recovered_ms,
        ..Report::default()
    };
    if rec.recovered_ms.is_none() {
        r.problem("cluster not back to health within the bound".into());
    }
    let handlers: HashMap<&str, &HandlerSpec> =
        rec.handlers.iter().map(|h| (h.name.as_str(), h)).collect();
    let events: HashMap<&str, &Published> =
        rec.published.iter().map(|p| (p.id.as_str(), p)).collect();
    r.events = rec.published.iter().filter(|p| p.acked).count();
    r.in_doubt = rec.published.len() - r.events;
    let dead: HashSet<(&str, &str)> = rec
        .dead_letters
        .iter()
        .map(|(h, e)| (h.as_str(), e.as_str()))
        .collect();

    // The model of the one checker: expected deliveries (with their
    // position in the key's publish order) and the requests as hand-overs,
    // indexed as `requests` (in arrival order).
    let mut position: HashMap<(&str, &str), i64> = HashMap::new(); // (key, id) -> position
    let mut per_key: HashMap<&str, i64> = HashMap::new();
    for p in &rec.published {
        if let Some(k) = p.key.as_deref() {
            let n = per_key.entry(k).or_default();
            position.insert((k, p.id.as_str()), *n);
            *n += 1;
        }
    }
    let accepted: HashSet<(&str, &str)> = requests
        .iter()
        .filter(|q| q.accepted())
        .map(|q| (q.handler.as_str(), q.event_id.as_str()))
        .collect();

    // Pairs with an attempt the node could have seen succeed.
    let in_time: HashSet<(&str, &str)> = requests
        .iter()
        .filter(|q| {
            handlers
                .get(q.handler.as_str())
                .is_some_and(|h| q.succeeded_in_time(h.timeout_ms))
        })
        .map(|q| (q.handler.as_str(), q.event_id.as_str()))
        .collect();
    for pair in &dead {
        if in_time.contains(pair) {
            r.completed_and_dead += 1;
            r.problem(format!(
                "completed and dead-lettered: {} {} is a dead letter, yet an attempt of it was answered 2xx in time",
                pair.0, pair.1
            ));
        }
    }

    // 5. in-doubt batches: all or nothing.
    let mut committed_batches: HashSet<&str> = HashSet::new();
    for q in &requests {
        if let Some(p) = events.get(q.event_id.as_str()) {
            if !p.acked {
                committed_batches.insert(p.batch.as_str());
            }
        }
    }
    // 1. no loss: every acknowledged (event, matching handler), every one
    // of a batch that arrived in part, and every dead letter (its delivery
    // existed).
    let mut expected: Vec<Delivery> = Vec::new();
    for p in &rec.published {
        let must = p.acked || committed_batches.contains(p.batch.as_str());
        for h in rec.handlers.iter().filter(|h| h.matches(&p.event_type)) {
            let pair = (h.name.as_str(), p.id.as_str());
            let dead_lettered = dead.contains(&pair);
            if p.acked {
                r.expected += 1;
                if accepted.contains(&pair) {
                    r.delivered += 1;
                } else if dead_lettered {
                    r.dead_lettered += 1;
                }
            }
            if must || dead_lettered {
                expected.push(Delivery {
                    handler: h.name.clone(),
                    event: p.id.clone(),
                    key: p.key.clone(),
                    position: p
                        .key
                        .as_deref()
                        .and_then(|k| position.get(&(k, p.id.as_str())).copied()),
                    dead_lettered,
                    dead_letter_allowed: h.dead_letters_expected,
                });
            }
        }
    }
    let observed: Vec<HandOver> = requests
        .iter()
        .map(|q| {
            let handler = handlers.get(q.handler.as_str());
            HandOver {
                handler: q.handler.clone(),
                event: q.event_id.clone(),
                key: q.key.clone(),
                position: q
                    .key
                    .as_deref()
                    .filter(|_| handler.is_some())
                    .and_then(|k| position.get(&(k, q.event_id.as_str())).copied()),
                attempt: q.attempt,
                sender: q.sender.clone(),
                arrived_ms: q.arrived_ms,
                accepted_ms: q.accepted().then(|| q.answered_ms.unwrap_or(q.arrived_ms)),
                until_ms: handler.map_or(q.arrived_ms, |h| q.in_flight_until(h.timeout_ms)),
            }
        })
        .collect();
    let model = Model {
        expected,
        observed,
        earlier: Earlier::Listed,
    };
    for i in invariants::lost(&model) {
        let d = &model.expected[i];
        let p = events[d.event.as_str()];
        r.lost += 1;
        if d.dead_lettered {
            r.problem(format!(
                "dead-lettered unexpectedly: {} {}",
                d.handler, d.event
            ));
        } else if p.acked {
            r.problem(format!("lost: {} {}", d.handler, d.event));
        } else {
            r.torn_batches += 1;
            r.problem(format!(
                "torn batch {}: {} {} missing while others arrived",
                p.batch, d.handler, d.event
            ));
        }
    }

    // Corrupted, bad signatures, unexpected.
    for q in &requests {
        if !q.signature_ok {
            r.bad_signatures += 1;
            r.problem(format!("bad signature: {} {}", q.handler, q.event_id));
        }
        let known = events.get(q.event_id.as_str());
        let routed = match (known, handlers.get(q.handler.as_str())) {
            (Some(p), Some(h)) => h.matches(&p.event_type),
            _ => false,
        };
        if let (true, Some(p)) = (routed, known) {
            if q.data.as_deref() != Some(p.payload.as_str()) {
                r.corrupted += 1;
                r.problem(format!(
                    "payload differs: {} {} ({} bytes published, {:?} received)",
                    q.handler,
                    q.event_id,
                    p.payload.len(),
                    q.data.as_ref().map(String::len)
                ));
            }
        }
    }
    for i in invariants::unexpected(&model) {
        let q = requests[i];
        r.unexpected += 1;
        r.problem(format!("unexpected: {} {}", q.handler, q.event_id));
    }

    let epochs = Epochs::new(&rec.samples);
    let slack = rec.sample_slack_ms as f64;
    let causes = OracleCauses {
        requests: &requests,
        handlers: &handlers,
        events: &events,
        epochs: &epochs,
        lanes: rec.lanes,
        slack,
    };

    // 3. repeats, each attributed to a cause (see `OracleCauses`).
    let repeats = invariants::repeats(&model, &causes);
    r.repeats.failed = repeats.with(Cause::Failed);
    r.repeats.node_timeout = repeats.with(Cause::NodeSawFailure);
    r.repeats.owner_change = repeats.with(Cause::OwnerChange);
    r.repeats.unattributed = repeats.unattributed.len();
    for x in &repeats.unattributed {
        let (prev, q) = (requests[x.prev], requests[x.q]);
        let lane = lane_of_request(q, &events, rec.lanes);
        r.problem(format!(
            "repeat without a cause: {} {} attempt {} at {:.0} ms after attempt {} answered {:?} at {:.0} ms, lane {lane} epoch {:?} -> {:?}",
            q.handler, q.event_id, q.attempt, q.arrived_ms, prev.attempt, prev.status,
            prev.arrived_ms, epochs.at(lane, prev.arrived_ms), epochs.at(lane, q.arrived_ms + slack)
        ));
    }
    // 3 and 4. A deposed owner sends at most what it had in flight when
    // its lane moved: one delivery per (handler, key), or per unkeyed
    // delivery. More means it went on working for a lane it had lost.
    // Only senders the receiver knows count, and only while they had
    // certainly lost the lane (see `Epochs::deposed`; guard: the sampling
    // slack plus 3 s).
    let mut deposed_seen: HashMap<(&str, &str, &str, u16, i64), usize> = HashMap::new();
    for q in &requests {
        let Some(sender) = q.sender.as_deref() else {
            continue;
        };
        let lane = lane_of_request(q, &events, rec.lanes);
        let Some(epoch) = epochs.deposed(lane, sender, q.arrived_ms, slack + 3_000.0) else {
            continue;
        };
        let stream = q.key.as_deref().unwrap_or(q.event_id.as_str());
        let n = deposed_seen
            .entry((q.handler.as_str(), stream, sender, lane, epoch))
            .or_default();
        *n += 1;
        if *n > 1 {
            r.deposed_sends += 1;
            r.problem(format!(
                "deposed owner kept sending: node {sender} sent {} {} (attempt {}) at {:.0} ms, request {n} of {} {stream} since lane {lane} moved to epoch {epoch}",
                q.handler, q.event_id, q.attempt, q.arrived_ms, q.handler
            ));
        }
    }

    // 2. one request of a (handler, key) in flight at a time: a request
    // (the key's next delivery, or a repeat) must not arrive while an
    // earlier one of the same (handler, key), or of the same unkeyed
    // delivery, is still in flight at the receiver: from its arrival until
    // the receiver ended it, at the latest until the handler's timeout (a
    // retry after a timeout is no overlap: the sender has given up).
    for x in invariants::overlaps(&model, OVERLAP_TOLERANCE_MS) {
        let (prev, q) = (requests[x.prev], requests[x.q]);
        let stream = q.key.as_deref().unwrap_or(q.event_id.as_str());
        r.overlaps += 1;
        r.problem(format!(
            "overlap: {} {stream}: {} (attempt {}, node {}) arrived at {:.0} ms while {} (attempt {}, node {}, arrived at {:.0} ms) was in flight until {:.0} ms",
            q.handler,
            q.event_id,
            q.attempt,
            q.sender.as_deref().unwrap_or("?"),
            q.arrived_ms,
            prev.event_id,
            prev.attempt,
            prev.sender.as_deref().unwrap_or("?"),
            prev.arrived_ms,
            model.observed[x.prev].until_ms,
        ));
    }

    // 2. order per (handler, key): the first arrival at publish position i
    // after every earlier position was answered 2xx or dead-lettered (and
    // after no later one); a rewind only after an owner change.
    let order = invariants::order(&model, &causes);
    r.rewinds = order.rewinds;
    let event_at: HashMap<(&str, i64), &str> = model
        .expected
        .iter()
        .filter_map(|d| Some(((d.key.as_deref()?, d.position?), d.event.as_str())))
        .collect();
    for x in &order.disorder {
        r.out_of_order += 1;
        let (q, what) = match *x {
            Disorder::Early { q, missing } => {
                let key = requests[q].key.as_deref().unwrap_or_default();
                let earlier = event_at.get(&(key, missing)).copied().unwrap_or("?");
                (q, format!("sent before {earlier} was done"))
            }
            Disorder::AfterLater { q, later } => {
                let key = requests[q].key.as_deref().unwrap_or_default();
                let later = event_at.get(&(key, later)).copied().unwrap_or("?");
                (q, format!("first sent after the later {later}"))
            }
            Disorder::Rewind(x) => (x.q, "repeated after a later event, no owner change".into()),
        };
        let pos = model.observed[q].position;
        let q = requests[q];
        r.problem(format!(
            "order: {} key {}: {} (position {pos:?}) at {:.0} ms {what}",
            q.handler,
            q.key.as_deref().unwrap_or_default(),
            q.event_id,
            q.arrived_ms
        ));
    }

    // 2. the `lanebus-sequence` header grows with the publish position.
    let mut seq_at: HashMap<(&str, &str), BTreeMap<i64, i64>> = HashMap::new();
    for (q, h) in requests.iter().zip(&model.observed) {
        let (Some(key), Some(pos), Some(seq)) = (q.key.as_deref(), h.position, q.sequence) else {
            continue;
        };
        let s = seq_at.entry((q.handler.as_str(), key)).or_default();
        match s.get(&pos) {
            Some(&old) if old != seq => {
                r.out_of_order += 1;
                r.problem(format!(
                    "sequence: {} key {key}: {} came with sequence {seq}, earlier {old}",
                    q.handler, q.event_id
                ));
            }
            Some(_) => {}
            None => {
                let below = s.range(..pos).next_back().map(|(_, v)| *v);
                let above = s.range(pos + 1..).next().map(|(_, v)| *v);
                if below.is_some_and(|b| b >= seq) || above.is_some_and(|a| a <= seq) {
                    r.out_of_order += 1;
                    r.problem(format!(
                        "sequence: {} key {key}: {} has sequence {seq} out of publish order",
                        q.handler, q.event_id
                    ));
                }
                s.insert(pos, seq);
            }
        }
    }
    // 4. one owner per (lane, epoch); epochs never go back on a node.
    let mut owners: HashMap<(u16, i64), HashSet<&str>> = HashMap::new();
    let mut last_epoch: HashMap<(&str, u16), (u64, i64)> = HashMap::new();
    let mut samples: Vec<&LaneSample> = rec.samples.iter().collect();
    samples.sort_by_key(|s| s.at_ms);
    for s in samples {
        if let Some(o) = s.owner.as_deref() {
            let set = owners.entry((s.lane, s.epoch)).or_default();
            if set.insert(o) && set.len() == 2 {
                r.two_owners += 1;
                r.problem(format!(
                    "lane {} epoch {} has two owners: {:?}",
                    s.lane, s.epoch, set
                ));
            }
        }
        let k = (s.node.as_str(), s.lane);
        if let Some(&(at, e)) = last_epoch.get(&k) {
            if s.epoch < e {
                r.two_owners += 1;
                r.problem(format!(
                    "lane {} epoch went back from {e} (at {at} ms) to {} (at {} ms) on node {}",
                    s.lane, s.epoch, s.at_ms, s.node
                ));
            }
        }
        last_epoch.insert(k, (s.at_ms, s.epoch));
    }
    r
}

/// The oracle's causes for the one checker's repeats and rewinds.
struct OracleCauses<'a> {
    /// The requests, as indexed in the model.
    requests: &'a [&'a Request],
    handlers: &'a HashMap<&'a str, &'a HandlerSpec>,
    events: &'a HashMap<&'a str, &'a Published>,
    epochs: &'a Epochs<'a>,
    lanes: u16,
    /// The sampling slack, in milliseconds.
    slack: f64,
}

impl OracleCauses<'_> {
    /// Whether the lane changed owner between the repeat's previous
    /// hand-over and the repeat: the two came from different nodes, the
    /// lane's epoch grew, the sender no longer owned the lane, or an
    /// attempt number lower than one already seen (one owner only counts
    /// up) comes after an owner change (a deposed owner's send, e.g. one
    /// frozen mid-send).
    fn owner_changed(&self, x: &Repeat) -> bool {
        let (prev, q) = (self.requests[x.prev], self.requests[x.q]);
        let lane = lane_of_request(q, self.events, self.lanes);
        let after = q.arrived_ms + self.slack;
        other_sender(prev, q)
            || owner_changed(
                self.epochs.at(lane, prev.arrived_ms),
                self.epochs.at(lane, after),
            )
            || self.epochs.stale_sender(lane, q, after)
            || (q.attempt < x.max_attempt && self.epochs.changed_by(lane, after))
    }
}

impl Causes for OracleCauses<'_> {
    fn repeat(&self, _: &Model, x: &Repeat) -> Option<Cause> {
        let (prev, q) = (self.requests[x.prev], self.requests[x.q]);
        let timeout = self
            .handlers
            .get(q.handler.as_str())
            .map_or(u64::MAX, |h| h.timeout_ms);
        if !prev.succeeded_in_time(timeout) {
            Some(Cause::Failed)
        } else if q.attempt > prev.attempt {
            Some(Cause::NodeSawFailure)
        } else {
            self.owner_changed(x).then_some(Cause::OwnerChange)
        }
    }

    fn rewind(&self, _: &Model, x: &Repeat) -> bool {
        self.owner_changed(x)
    }
}

/// Whether two attempts of one delivery came from different nodes: a node
/// sends only for lanes it owns (or owned, when its send was in flight as
/// the lane moved), so the lane changed owner between them. Sound only when
/// the receiver knows each sender for certain (each node sends from its own
/// address, see `sandbox::source_ip`).
fn other_sender(prev: &Request, q: &Request) -> bool {
    matches!((&prev.sender, &q.sender), (Some(a), Some(b)) if a != b)
}

fn owner_changed(before: Option<i64>, after: Option<i64>) -> bool {
    matches!((before, after), (Some(b), Some(a)) if a > b) || (before.is_none() && after.is_some())
}

fn lane_of_request(q: &Request, events: &HashMap<&str, &Published>, lanes: u16) -> u16 {
    let key = q.key.as_deref().or_else(|| {
        events
            .get(q.event_id.as_str())
            .and_then(|p| p.key.as_deref())
    });
    crate::lane::lane_of(key, &q.event_id, lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LANES: u16 = 8;

    fn ev(id: &str, key: &str) -> Published {
        Published {
            id: id.into(),
            event_type: "order.created".into(),
            key: Some(key.into()),
            payload: format!("{{\"id\":\"{id}\"}}"),
            acked: true,
            batch: format!("p/{id}"),
        }
    }

    fn req(id: &str, key: &str, seq: i64, attempt: u32, at: f64, status: Option<u16>) -> Request {
        Request {
            handler: "h".into(),
            event_id: id.into(),
            key: Some(key.into()),
            sequence: Some(seq),
            attempt,
            arrived_ms: at,
            answered_ms: status.map(|_| at + 1.0),
            status,
            ended_ms: None,
            data: Some(format!("{{\"id\":\"{id}\"}}")),
            signature_ok: true,
            sender: Some("1".into()),
        }
    }

    fn sample(at: u64, key: &str, owner: &str, epoch: i64) -> LaneSample {
        LaneSample {
            at_ms: at,
            node: "1".into(),
            lane: crate::lane::lane_of(Some(key), "", LANES),
            owner: Some(owner.into()),
            epoch,
        }
    }

    fn base() -> Record {
        Record {
            lanes: LANES,
            published: vec![ev("a", "k"), ev("b", "k"), ev("c", "k")],
            handlers: vec![HandlerSpec {
                name: "h".into(),
                patterns: vec!["order.*".into()],
                timeout_ms: 1_000,
                dead_letters_expected: false,
            }],
            requests: vec![
                req("a", "k", 1, 1, 10.0, Some(500)),
                req("a", "k", 1, 2, 20.0, Some(200)),
                req("b", "k", 2, 1, 30.0, Some(200)),
                req("c", "k", 3, 1, 40.0, Some(200)),
            ],
            samples: vec![sample(0, "k", "1", 1), sample(100, "k", "1", 1)],
            dead_letters: vec![],
            recovered_ms: Some(5),
            sample_slack_ms: 0,
        }
    }

    #[test]
    fn an_exact_run_passes_and_counts_the_failed_attempt() {
        let r = judge(&base());
        assert!(r.passed(), "{r:#?}");
        assert_eq!((r.events, r.expected, r.delivered), (3, 3, 3));
        assert_eq!(r.repeats.failed, 1);
    }

    #[test]
    fn a_lost_delivery_fails() {
        let mut rec = base();
        rec.requests.pop();
        let r = judge(&rec);
        assert_eq!(r.lost, 1);
        assert!(!r.passed());
    }

    #[test]
    fn an_unexpected_dead_letter_is_lost_an_expected_one_is_not() {
        let mut rec = base();
        rec.requests.pop();
        rec.dead_letters.push(("h".into(), "c".into()));
        assert_eq!(judge(&rec).lost, 1);
        rec.handlers[0].dead_letters_expected = true;
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.dead_lettered, 1);
    }

    #[test]
    fn a_changed_payload_fails() {
        let mut rec = base();
        rec.requests[2].data = Some("{\"id\":\"B\"}".into());
        let r = judge(&rec);
        assert_eq!(r.corrupted, 1);
        assert!(!r.passed());
    }

    #[test]
    fn next_event_before_the_previous_completed_is_out_of_order() {
        let mut rec = base();
        // b arrives while a has only failed so far.
        rec.requests.swap(1, 2);
        rec.requests[1].arrived_ms = 15.0;
        let r = judge(&rec);
        assert!(r.out_of_order >= 1, "{r:#?}");
        assert!(!r.passed());
    }

    #[test]
    fn a_sequence_header_against_publish_order_fails() {
        let mut rec = base();
        rec.requests[3].sequence = Some(2);
        let r = judge(&rec);
        assert_eq!(r.out_of_order, 1, "{r:#?}");
    }

    #[test]
    fn a_repeat_after_success_without_owner_change_is_unattributed() {
        let mut rec = base();
        rec.requests.push(req("c", "k", 3, 1, 50.0, Some(200)));
        let r = judge(&rec);
        assert_eq!(r.repeats.unattributed, 1, "{r:#?}");
        assert!(!r.passed());
    }

    #[test]
    fn a_repeat_after_an_epoch_change_is_an_owner_change_and_a_rewind_is_allowed() {
        let mut rec = base();
        // The node died after b and c were answered but before completing
        // them: the new owner (epoch 2) sends b and c again.
        rec.requests.push(req("b", "k", 2, 1, 60.0, Some(200)));
        rec.requests.push(req("c", "k", 3, 1, 70.0, Some(200)));
        rec.samples = vec![sample(0, "k", "1", 1), sample(55, "k", "1", 2)];
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!((r.repeats.owner_change, r.rewinds), (2, 1));
        // Without the epoch change the same log fails.
        rec.samples.pop();
        let r = judge(&rec);
        assert_eq!(r.repeats.unattributed, 2);
        assert_eq!(r.out_of_order, 1);
    }

    #[test]
    fn a_repeat_from_a_deposed_owner_is_an_owner_change() {
        let mut rec = base();
        // Node 2 took the lane over at epoch 2 (sampled at 45 ms) and sent
        // c; node 1, frozen mid-send before, sends c again at 60 ms.
        rec.samples = vec![sample(0, "k", "1", 1), sample(45, "k", "2/7", 2)];
        rec.requests[3].sender = Some("2".into());
        rec.requests[3].arrived_ms = 50.0;
        rec.requests.push(req("c", "k", 3, 1, 60.0, Some(200)));
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.repeats.owner_change, 1);
        // The same repeat from the current owner has no cause.
        rec.requests[4].sender = Some("2".into());
        assert_eq!(judge(&rec).repeats.unattributed, 1);
    }

    #[test]
    fn a_repeat_from_another_node_is_an_owner_change_even_unsampled() {
        let mut rec = base();
        // b and c answered to node 1; node 2 sends them again (the lane
        // moved between two samples and back, or faster than sampling):
        // two nodes sent one delivery, so the lane changed owner.
        let mut b = req("b", "k", 2, 1, 60.0, Some(200));
        b.sender = Some("2".into());
        let mut c = req("c", "k", 3, 1, 70.0, Some(200));
        c.sender = Some("2".into());
        rec.requests.extend([b, c]);
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!((r.repeats.owner_change, r.rewinds), (2, 1));
        // From the same node, with no epoch change seen, it has no cause.
        rec.requests[4].sender = Some("1".into());
        rec.requests[5].sender = Some("1".into());
        let r = judge(&rec);
        assert_eq!(r.repeats.unattributed, 2);
        assert_eq!(r.out_of_order, 1);
        // Nor when the receiver could not tell the sender.
        rec.requests[4].sender = None;
        assert_eq!(judge(&rec).repeats.unattributed, 2);
    }

    #[test]
    fn a_deposed_owner_may_send_what_it_had_in_flight_but_no_more() {
        let mut rec = base();
        // Node 2 owns the lane from epoch 2 (sampled at 35 ms) and sends c;
        // node 1 sends b again at 50 ms: its one delivery of key k in flight
        // at the change.
        rec.samples = vec![sample(0, "k", "1", 1), sample(35, "k", "2", 2)];
        rec.requests[3].sender = Some("2".into());
        rec.requests.push(req("b", "k", 2, 1, 50.0, Some(200)));
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.deposed_sends, 0);
        // Then it goes on to c: it worked on a lane it had lost.
        rec.requests.push(req("c", "k", 3, 1, 60.0, Some(200)));
        let r = judge(&rec);
        assert_eq!(r.deposed_sends, 1, "{r:#?}");
        assert!(!r.passed());
        // Unless it owned the lane again (epoch 3, sampled a little late).
        rec.samples.push(sample(900, "k", "1/2", 3));
        assert_eq!(judge(&rec).deposed_sends, 0);
    }

    #[test]
    fn a_lower_attempt_after_an_owner_change_is_a_deposed_owners_send() {
        let mut rec = base();
        rec.samples = vec![sample(0, "k", "1", 1), sample(25, "k", "2", 2)];
        // c: attempt 2 from the new owner, then the old owner's attempt 1
        // (sender unknown), frozen mid-send before the change.
        rec.requests[2].sender = Some("2".into());
        rec.requests[3].sender = Some("2".into());
        rec.requests[3].attempt = 2;
        let mut stale = req("c", "k", 3, 1, 60.0, Some(200));
        stale.sender = None;
        rec.requests.push(stale);
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.repeats.owner_change, 1);
        // Without any owner change it has no cause.
        rec.samples = vec![sample(0, "k", "1", 1)];
        assert_eq!(judge(&rec).repeats.unattributed, 1);
    }

    #[test]
    fn late_answers_and_grown_attempt_numbers_are_causes() {
        let mut rec = base();
        // c answered 200 but after the 1 s timeout, then sent again.
        rec.requests[3].answered_ms = Some(40.0 + 1_500.0);
        rec.requests.push(req("c", "k", 3, 2, 2_000.0, Some(200)));
        let r = judge(&rec);
        assert_eq!(r.repeats.failed, 2, "{r:#?}");
        // answered in time, but the node says the attempt failed.
        let mut rec = base();
        rec.requests.push(req("c", "k", 3, 2, 2_000.0, Some(200)));
        let r = judge(&rec);
        assert_eq!(r.repeats.node_timeout, 1, "{r:#?}");
        assert!(r.passed());
    }

    #[test]
    fn a_dead_letter_of_a_delivery_that_succeeded_in_time_fails() {
        let mut rec = base();
        rec.handlers[0].dead_letters_expected = true;
        rec.dead_letters.push(("h".into(), "b".into()));
        let r = judge(&rec);
        assert_eq!(r.completed_and_dead, 1, "{r:#?}");
        assert!(!r.passed());
        // Answered 2xx only after the timeout: the dead letter is legitimate.
        rec.requests[2].answered_ms = Some(5_000.0);
        rec.requests[2].arrived_ms = 30.0;
        let r = judge(&rec);
        assert_eq!(r.completed_and_dead, 0, "{r:#?}");
    }

    #[test]
    fn a_deposed_owners_unfenced_final_dead_letter_fails() {
        // stale-final-attempt: node 1 makes both attempts of b (the last
        // is answered 500 while it is frozen, its lane moved to node 2 at
        // epoch 2), node 2 sends b again and it is accepted in time.
        let mut rec = base();
        rec.handlers[0].timeout_ms = 4_000;
        rec.samples = vec![sample(0, "k", "1", 1), sample(2_000, "k", "2", 2)];
        rec.requests = vec![
            req("a", "k", 1, 1, 10.0, Some(200)),
            req("b", "k", 2, 1, 20.0, Some(500)),
            req("b", "k", 2, 2, 100.0, Some(500)),
        ];
        rec.requests[2].answered_ms = Some(9_000.0);
        let mut again = req("b", "k", 2, 2, 8_000.0, Some(200));
        again.sender = Some("2".into());
        again.answered_ms = Some(9_500.0);
        let mut c = req("c", "k", 3, 1, 9_600.0, Some(200));
        c.sender = Some("2".into());
        rec.requests.extend([again, c]);
        // Fenced: node 1's dead letter was refused.
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.repeats.failed, 2);
        // Unfenced: it moved the delivery node 2 was completing.
        rec.dead_letters.push(("h".into(), "b".into()));
        let r = judge(&rec);
        assert_eq!((r.completed_and_dead, r.lost), (1, 0), "{r:#?}");
        assert!(r.problems[0].starts_with("completed and dead-lettered: h b"));
        assert!(!r.passed());
    }

    #[test]
    fn a_log_in_answer_order_is_judged_in_arrival_order() {
        let mut rec = base();
        // c's first attempt is answered after the timeout, after its second
        // attempt was answered: logged second, arrived first.
        rec.requests[3].answered_ms = Some(2_100.0);
        rec.requests.push(req("c", "k", 3, 2, 1_200.0, Some(200)));
        rec.requests.swap(3, 4);
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.repeats.failed, 2);
    }

    #[test]
    fn two_owners_of_one_epoch_or_an_epoch_going_back_fail() {
        let mut rec = base();
        rec.samples.push(sample(50, "k", "2", 1));
        let r = judge(&rec);
        assert_eq!(r.two_owners, 1, "{r:#?}");
        let mut rec = base();
        rec.samples.push(sample(200, "k", "1", 3));
        rec.samples.push(sample(300, "k", "1", 2));
        assert_eq!(judge(&rec).two_owners, 1);
    }

    #[test]
    fn a_torn_in_doubt_batch_fails_an_absent_one_passes() {
        let mut rec = base();
        let mut x = ev("x", "z");
        let mut y = ev("y", "z");
        x.acked = false;
        y.acked = false;
        x.batch = "child/9".into();
        y.batch = "child/9".into();
        rec.published.extend([x, y]);
        assert!(judge(&rec).passed(), "nothing of the batch arrived: fine");
        rec.requests.push(req("x", "z", 1, 1, 80.0, Some(200)));
        let r = judge(&rec);
        assert_eq!(r.torn_batches, 1, "{r:#?}");
        rec.requests.push(req("y", "z", 2, 1, 90.0, Some(200)));
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.in_doubt, 2);
    }

    /// `base()` with a 10 s timeout; b's first attempt, from node 1, held
    /// 8 s by the receiver and answered 200 (in time).
    fn held_b() -> Record {
        let mut rec = base();
        rec.handlers[0].timeout_ms = 10_000;
        rec.requests = vec![
            req("a", "k", 1, 1, 10.0, Some(200)),
            req("b", "k", 2, 1, 1_000.0, Some(200)),
        ];
        rec.requests[1].answered_ms = Some(9_000.0);
        rec
    }

    #[test]
    fn a_request_while_the_keys_previous_one_is_in_flight_is_an_overlap() {
        // The lane moved to node 2 (epoch 2) while node 1's attempt of b
        // was held: node 2 sends b again, answered at once, then c, both
        // while node 1's b is still in flight.
        let mut rec = held_b();
        rec.samples = vec![sample(0, "k", "1", 1), sample(4_000, "k", "2", 2)];
        let mut b2 = req("b", "k", 2, 1, 5_000.0, Some(200));
        b2.sender = Some("2".into());
        let mut c = req("c", "k", 3, 1, 5_100.0, Some(200));
        c.sender = Some("2".into());
        rec.requests.extend([b2, c]);
        let r = judge(&rec);
        assert_eq!(r.overlaps, 2, "{r:#?}");
        assert!(r.problems[0].starts_with("overlap: h k: b (attempt 1, node 2)"));
        assert!(!r.passed());
        // Everything else holds: a repeat from another node is an owner
        // change, c came after b was accepted.
        assert_eq!((r.repeats.owner_change, r.repeats.unattributed), (1, 0));
        assert_eq!((r.out_of_order, r.lost), (0, 0));
        // Sent after node 1's b was answered, both pass.
        rec.requests[2].arrived_ms = 9_001.0;
        rec.requests[2].answered_ms = Some(9_002.0);
        rec.requests[3].arrived_ms = 9_005.0;
        rec.requests[3].answered_ms = Some(9_006.0);
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
    }

    #[test]
    fn the_next_delivery_right_after_the_answer_is_no_overlap() {
        let mut rec = held_b();
        // c 2 ms after b's answer; an unrelated key in between.
        rec.requests.push(req("c", "k", 3, 1, 9_002.0, Some(200)));
        rec.published.push(ev("z", "other"));
        rec.requests
            .push(req("z", "other", 1, 1, 2_000.0, Some(200)));
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!(r.overlaps, 0);
        // c a second before b's answer: b was still in flight.
        rec.requests[2].arrived_ms = 8_000.0;
        rec.requests[2].answered_ms = Some(8_001.0);
        assert_eq!(judge(&rec).overlaps, 1);
        // Within the tolerance: a stamping delay, not an overlap.
        rec.requests[2].arrived_ms = 9_000.0 - OVERLAP_TOLERANCE_MS + 10.0;
        rec.requests[2].answered_ms = Some(9_000.0);
        assert_eq!(judge(&rec).overlaps, 0);
    }

    #[test]
    fn a_retry_after_a_timeout_or_a_reset_is_no_overlap() {
        let mut rec = held_b();
        // b held without an answer past the 10 s timeout, retried 50 ms
        // after the timeout, then c.
        rec.requests[1].status = None;
        rec.requests[1].answered_ms = None;
        rec.requests[1].ended_ms = Some(12_000.0);
        rec.requests.push(req("b", "k", 2, 2, 11_050.0, Some(200)));
        rec.requests.push(req("c", "k", 3, 1, 11_100.0, Some(200)));
        let r = judge(&rec);
        assert!(r.passed(), "{r:#?}");
        assert_eq!((r.overlaps, r.repeats.failed), (0, 1));
        // The same retry 2 s before the timeout ran out overlaps.
        rec.requests[2].arrived_ms = 9_000.0;
        rec.requests[2].answered_ms = Some(9_001.0);
        assert_eq!(judge(&rec).overlaps, 1);
        // b reset by the receiver at once: the retry 50 ms later is fine;
        // without the end of the exchange known, it counts as in flight.
        rec.requests[1].ended_ms = Some(1_001.0);
        rec.requests[2].arrived_ms = 1_050.0;
        rec.requests[2].answered_ms = Some(1_051.0);
        assert_eq!(judge(&rec).overlaps, 0);
        rec.requests[1].ended_ms = None;
        assert_eq!(judge(&rec).overlaps, 1, "the retry");
    }

    #[test]
    fn two_attempts_of_an_unkeyed_delivery_at_once_overlap() {
        let mut rec = base();
        rec.handlers[0].timeout_ms = 10_000;
        let mut u = ev("u", "x");
        u.key = None;
        rec.published.push(u);
        let mut u1 = req("u", "x", 1, 1, 100.0, Some(200));
        u1.key = None;
        u1.sequence = None;
        u1.answered_ms = Some(6_000.0);
        let mut u2 = u1.clone();
        u2.arrived_ms = 3_000.0;
        u2.answered_ms = Some(3_001.0);
        u2.sender = Some("2".into());
        rec.requests.extend([u1, u2]);
        let r = judge(&rec);
        assert_eq!(r.overlaps, 1, "{r:#?}");
        assert!(r.problems[0].starts_with("overlap: h u: u"), "{r:#?}");
    }

    #[test]
    fn unexpected_bad_signature_and_no_recovery_fail() {
        let mut rec = base();
        rec.requests.push(req("zzz", "k", 9, 1, 99.0, Some(200)));
        assert_eq!(judge(&rec).unexpected, 1);
        let mut rec = base();
        rec.requests[0].signature_ok = false;
        assert_eq!(judge(&rec).bad_signatures, 1);
        let mut rec = base();
        rec.recovered_ms = None;
        assert!(!judge(&rec).passed());
    }
}
