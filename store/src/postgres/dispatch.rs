//! Dispatch: fencing, claims, completions, reschedules, dead letters, replay.
//! Each is one statement whatever the batch size; the batch travels as
//! arrays (`unnest`), and every write joins `lanes` on (lane, epoch).

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgListener;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use super::error::map_err;
use super::CHANNEL;
use crate::common::{epoch_from_db, epoch_to_db, to_u32};
use crate::wake::{WakeSender, Woken};
use crate::*;

pub(super) async fn fence(pool: &PgPool, lane: Lane, owner: &str, epoch: Epoch) -> Result<bool> {
    let row: Option<(Option<String>, i64)> = sqlx::query_as(
        "WITH u AS (UPDATE lanes SET epoch = $3, owner = $2 WHERE lane = $1 AND epoch < $3 RETURNING owner, epoch) \
         SELECT owner, epoch FROM u \
         UNION ALL \
         SELECT owner, epoch FROM lanes WHERE lane = $1 AND NOT EXISTS (SELECT 1 FROM u)",
    )
    .bind(i32::from(lane))
    .bind(owner)
    .bind(epoch_to_db(epoch)?)
    .fetch_optional(pool)
    .await
    .map_err(map_err)?;
    Ok(match row {
        Some((Some(o), e)) => o == owner && epoch_from_db(e)? == epoch,
        _ => false,
    })
}

pub(super) async fn claim(pool: &PgPool, claims: &[LaneClaim]) -> Result<Vec<LaneBatch>> {
    if claims.is_empty() {
        return Ok(Vec::new());
    }
    let lanes: Vec<i32> = claims.iter().map(|c| i32::from(c.lane)).collect();
    let epochs: Vec<i64> = claims
        .iter()
        .map(|c| epoch_to_db(c.epoch))
        .collect::<Result<_>>()?;
    let positions: Vec<i64> = claims.iter().map(|c| c.after.pos).collect();
    let limits: Vec<i32> = claims
        .iter()
        .map(|c| i32::try_from(c.limit).unwrap_or(i32::MAX))
        .collect();
    // The cursors' open transactions as (claim ordinal, xid) pairs.
    let (open_ords, open_xids): (Vec<i32>, Vec<i64>) = claims
        .iter()
        .zip(1..)
        .flat_map(|(c, ord)| c.after.open.iter().map(move |&x| (ord, x)))
        .unzip();
    let rows = sqlx::query(include_str!("sql/claim.sql"))
        .bind(&lanes)
        .bind(&epochs)
        .bind(&positions)
        .bind(&limits)
        .bind(&open_ords)
        .bind(&open_xids)
        .fetch_all(pool)
        .await
        .map_err(map_err)?;

    let mut batches: Vec<LaneBatch> = claims
        .iter()
        .map(|c| LaneBatch {
            lane: c.lane,
            owned: false,
            deliveries: Vec::new(),
            next_after: c.after.clone(),
        })
        .collect();
    let mut snapshot: Option<Snapshot> = None;
    // Per lane: rows of the ranged part, and the largest xid among them.
    let mut ranged = vec![0usize; claims.len()];
    let mut top: Vec<Option<i64>> = vec![None; claims.len()];
    for row in &rows {
        let ord: i64 = row.try_get("ord").map_err(map_err)?;
        let i = usize::try_from(ord - 1)
            .ok()
            .filter(|&i| i < batches.len())
            .ok_or_else(|| StoreError::Database(format!("claim returned lane position {ord}")))?;
        batches[i].owned = row.try_get("owned").map_err(map_err)?;
        if snapshot.is_none() {
            let xmax: Option<i64> = row.try_get("xmax").map_err(map_err)?;
            let xip: Option<Vec<i64>> = row.try_get("xip").map_err(map_err)?;
            if let (Some(xmax), Some(xip)) = (xmax, xip) {
                snapshot = Some(Snapshot { xmax, xip });
            }
        }
        let xid: Option<i64> = row.try_get("xid").map_err(map_err)?;
        let Some(xid) = xid else { continue };
        if row.try_get::<Option<bool>, _>("ranged").map_err(map_err)? == Some(true) {
            ranged[i] += 1;
            top[i] = Some(top[i].map_or(xid, |m| m.max(xid)));
        }
        // A row may come in both parts of its lane's claim; the rows are
        // ordered by (lane position, xid, id), so the copies are adjacent.
        let id: Option<i64> = row.try_get("id").map_err(map_err)?;
        if batches[i].deliveries.last().map(|d| Some(d.id)) == Some(id) {
            continue;
        }
        batches[i]
            .deliveries
            .push(delivery_from_row(row, claims[i].lane, claims[i].epoch)?);
    }
    let snapshot =
        snapshot.ok_or_else(|| StoreError::Database("claim returned no snapshot".into()))?;
    for (i, (b, c)) in batches.iter_mut().zip(claims).enumerate() {
        if b.owned {
            b.next_after = next_cursor(&c.after, c.limit, ranged[i], top[i], &snapshot);
        }
    }
    Ok(batches)
}

/// What a claim's snapshot says about transactions: every xid below `xmax`
/// that is not in `xip` had ended when it was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    xmax: i64,
    /// Xids in progress, ascending.
    xip: Vec<i64>,
}

/// The cursor after a claim from `after` that returned `ranged` rows of its
/// `xid >= pos` part (`top` the largest of their xids) and every row of the
/// cursor's open transactions visible to `snap`.
///
/// Not cut by the limit: every row visible to the snapshot was read, so the
/// position moves to `xmax`, and the transactions still in progress that may
/// hold unread rows stay open (those past the old position, and those open
/// before). Cut at xid `top`: the position moves just past `top` (its rows
/// all came back, WITH TIES), and the open set keeps the transactions in
/// progress up to `top`; those past it are read by position.
fn next_cursor(
    after: &ClaimCursor,
    limit: u32,
    ranged: usize,
    top: Option<i64>,
    snap: &Snapshot,
) -> ClaimCursor {
    if limit == 0 {
        // A zero limit read nothing: keep the cursor.
        return after.clone();
    }
    let was_open = |x: i64| after.open.binary_search(&x).is_ok();
    let (pos, upto) = match top {
        Some(top) if ranged >= limit as usize => (after.pos.max(top.saturating_add(1)), top),
        _ => (after.pos.max(snap.xmax), i64::MAX),
    };
    let open: Vec<i64> = snap
        .xip
        .iter()
        .copied()
        .filter(|&x| was_open(x) || (x >= after.pos && x <= upto))
        .collect();
    ClaimCursor {
        pos,
        open: open.into(),
    }
}

fn delivery_from_row(row: &PgRow, lane: Lane, epoch: Epoch) -> Result<Delivery> {
    let need = |what: &str| StoreError::Database(format!("claim row without {what}"));
    let attempts: Option<i32> = row.try_get("attempts").map_err(map_err)?;
    let payload: Option<Vec<u8>> = row.try_get("payload").map_err(map_err)?;
    let due_at: Option<DateTime<Utc>> = row.try_get("due_at").map_err(map_err)?;
    let published_at: Option<DateTime<Utc>> = row.try_get("published_at").map_err(map_err)?;
    Ok(Delivery {
        id: row
            .try_get::<Option<i64>, _>("id")
            .map_err(map_err)?
            .ok_or_else(|| need("id"))?,
        lane,
        epoch,
        handler_id: row
            .try_get::<Option<String>, _>("handler_id")
            .map_err(map_err)?
            .ok_or_else(|| need("handler_id"))?,
        event_id: row
            .try_get::<Option<String>, _>("event_id")
            .map_err(map_err)?
            .ok_or_else(|| need("event_id"))?,
        event_type: row
            .try_get::<Option<String>, _>("type")
            .map_err(map_err)?
            .ok_or_else(|| need("type"))?,
        key: row.try_get("key").map_err(map_err)?,
        seq: row.try_get("seq").map_err(map_err)?,
        attempts: to_u32(i64::from(attempts.ok_or_else(|| need("attempts"))?)),
        due_at: due_at.ok_or_else(|| need("due_at"))?,
        last_error: row.try_get("last_error").map_err(map_err)?,
        payload: payload.ok_or_else(|| need("payload"))?.into(),
        published_at: published_at.ok_or_else(|| need("published_at"))?,
        replay: row
            .try_get::<Option<bool>, _>("replay")
            .map_err(map_err)?
            .unwrap_or(false),
    })
}

/// Keeps the first occurrence of each id.
fn first_by_id<T, F: Fn(&T) -> i64>(items: &[T], id: F) -> Vec<&T> {
    let mut seen = HashSet::with_capacity(items.len());
    items.iter().filter(|i| seen.insert(id(i))).collect()
}

fn i32_of(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

pub(super) async fn complete(pool: &PgPool, done: &[DeliveryRef]) -> Result<Vec<i64>> {
    let refs = first_by_id(done, |r| r.id);
    let ids: Vec<i64> = refs.iter().map(|r| r.id).collect();
    let lanes: Vec<i32> = refs.iter().map(|r| i32::from(r.lane)).collect();
    let epochs: Vec<i64> = refs
        .iter()
        .map(|r| epoch_to_db(r.epoch))
        .collect::<Result<_>>()?;
    let attempts: Vec<i32> = refs.iter().map(|r| i32_of(r.attempts)).collect();
    sqlx::query_scalar(include_str!("sql/complete.sql"))
        .bind(&ids)
        .bind(&lanes)
        .bind(&epochs)
        .bind(&attempts)
        .fetch_all(pool)
        .await
        .map_err(map_err)
}

pub(super) async fn discard(pool: &PgPool, refs: &[DeliveryRef]) -> Result<Vec<i64>> {
    let refs = first_by_id(refs, |r| r.id);
    let ids: Vec<i64> = refs.iter().map(|r| r.id).collect();
    let lanes: Vec<i32> = refs.iter().map(|r| i32::from(r.lane)).collect();
    let epochs: Vec<i64> = refs
        .iter()
        .map(|r| epoch_to_db(r.epoch))
        .collect::<Result<_>>()?;
    sqlx::query_scalar(include_str!("sql/discard.sql"))
        .bind(&ids)
        .bind(&lanes)
        .bind(&epochs)
        .fetch_all(pool)
        .await
        .map_err(map_err)
}

pub(super) async fn reschedule(pool: &PgPool, items: &[Reschedule]) -> Result<Vec<i64>> {
    let items = first_by_id(items, |r| r.id);
    let ids: Vec<i64> = items.iter().map(|r| r.id).collect();
    let lanes: Vec<i32> = items.iter().map(|r| i32::from(r.lane)).collect();
    let epochs: Vec<i64> = items
        .iter()
        .map(|r| epoch_to_db(r.epoch))
        .collect::<Result<_>>()?;
    let attempts: Vec<i32> = items.iter().map(|r| i32_of(r.attempts)).collect();
    let due: Vec<DateTime<Utc>> = items.iter().map(|r| r.due_at).collect();
    let errors: Vec<&str> = items.iter().map(|r| r.last_error.as_str()).collect();
    let failures = failures(items.iter().map(|r| r.failure.as_ref()))?;
    let mut out: Vec<i64> = sqlx::query_scalar(include_str!("sql/reschedule.sql"))
        .bind(&ids)
        .bind(&lanes)
        .bind(&epochs)
        .bind(&attempts)
        .bind(&due)
        .bind(&errors)
        .bind(&failures)
        .bind(ATTEMPT_LOG_LEN as i32)
        .fetch_all(pool)
        .await
        .map_err(map_err)?;
    out.sort_unstable();
    Ok(out)
}

pub(super) async fn dead_letter(pool: &PgPool, items: &[DeadLetterRequest]) -> Result<Vec<i64>> {
    let items = first_by_id(items, |r| r.id);
    let ids: Vec<i64> = items.iter().map(|r| r.id).collect();
    let lanes: Vec<i32> = items.iter().map(|r| i32::from(r.lane)).collect();
    let epochs: Vec<i64> = items
        .iter()
        .map(|r| epoch_to_db(r.epoch))
        .collect::<Result<_>>()?;
    let attempts: Vec<i32> = items.iter().map(|r| i32_of(r.attempts)).collect();
    let errors: Vec<&str> = items.iter().map(|r| r.last_error.as_str()).collect();
    let failures = failures(items.iter().map(|r| r.failure.as_ref()))?;
    sqlx::query_scalar(include_str!("sql/dead_letter.sql"))
        .bind(&ids)
        .bind(&lanes)
        .bind(&epochs)
        .bind(&attempts)
        .bind(&errors)
        .bind(&failures)
        .bind(ATTEMPT_LOG_LEN as i32)
        .fetch_all(pool)
        .await
        .map_err(map_err)
}

/// The failed attempts of a batch as JSON texts (NULL: none), bound as
/// `text[]` and cast to `jsonb[]` in the statement.
fn failures<'a>(
    items: impl Iterator<Item = Option<&'a FailedAttempt>>,
) -> Result<Vec<Option<String>>> {
    items.map(crate::common::failure_json).collect()
}

pub(super) async fn replay_dead_letters(
    pool: &PgPool,
    ids: &[i64],
    handler_id: Option<&str>,
    failed_since: Option<DateTime<Utc>>,
    failed_until: Option<DateTime<Utc>>,
) -> Result<u64> {
    let ids: Option<&[i64]> = if ids.is_empty() { None } else { Some(ids) };
    let (replayed, _notified): (i64, i64) = sqlx::query_as(include_str!("sql/replay.sql"))
        .bind(ids)
        .bind(handler_id)
        .bind(failed_since)
        .bind(failed_until)
        .fetch_one(pool)
        .await
        .map_err(map_err)?;
    Ok(u64::try_from(replayed).unwrap_or_default())
}

/// Advisory lock key that serializes retention batches and recoveries
/// (`lanebus/r` in ASCII), so a prune never removes an event a recovery is
/// putting back.
const RETENTION_LOCK: i64 = 0x6c61_6e65_6275_732f;

/// A transaction holding [`RETENTION_LOCK`]; without the session's
/// statement and lock timeouts if `unbounded` (a recovery may insert a
/// handler's whole history and wait for a prune batch).
async fn retention_tx(
    pool: &PgPool,
    unbounded: bool,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool.begin().await.map_err(map_err)?;
    if unbounded {
        super::migrate::lift_timeouts(&mut tx).await?;
    }
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(RETENTION_LOCK)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    Ok(tx)
}

pub(super) async fn recover(
    pool: &PgPool,
    handler_id: &str,
    since: DateTime<Utc>,
) -> Result<RecoverOutcome> {
    let mut tx = retention_tx(pool, true).await?;
    let (completed, found, recovered, _notified): (i64, i64, i64, i64) =
        sqlx::query_as(include_str!("sql/recover.sql"))
            .bind(handler_id)
            .bind(since)
            .fetch_one(&mut *tx)
            .await
            .map_err(map_err)?;
    tx.commit().await.map_err(map_err)?;
    let n = |v: i64| u64::try_from(v).unwrap_or_default();
    Ok(RecoverOutcome {
        recovered: n(recovered),
        already_pending: n(found - recovered),
        pruned: n(completed - found),
    })
}

pub(super) async fn prune(pool: &PgPool, before: DateTime<Utc>, limit: u32) -> Result<Pruned> {
    let mut tx = retention_tx(pool, false).await?;
    let (completions, events): (i64, i64) = sqlx::query_as(include_str!("sql/prune.sql"))
        .bind(before)
        .bind(i64::from(limit))
        .fetch_one(&mut *tx)
        .await
        .map_err(map_err)?;
    tx.commit().await.map_err(map_err)?;
    Ok(Pruned {
        completions: u64::try_from(completions).unwrap_or_default(),
        events: u64::try_from(events).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor(pos: i64, open: &[i64]) -> ClaimCursor {
        ClaimCursor {
            pos,
            open: open.into(),
        }
    }

    fn snap(xmax: i64, xip: &[i64]) -> Snapshot {
        Snapshot {
            xmax,
            xip: xip.to_vec(),
        }
    }

    #[test]
    fn an_open_transaction_does_not_hold_the_position_back() {
        // Transaction 100 stays open (an idle session): the position moves
        // past everything the snapshot saw, and only 100 is read again.
        let c = next_cursor(
            &cursor(90, &[]),
            256,
            10,
            Some(140),
            &snap(150, &[100, 145]),
        );
        assert_eq!(c, cursor(150, &[100, 145]));
        let c = next_cursor(&c, 256, 3, Some(170), &snap(180, &[100]));
        assert_eq!(c, cursor(180, &[100]), "145 ended: its rows were read");
    }

    #[test]
    fn transactions_below_the_old_position_stay_open_only_if_they_were() {
        // 95 is in progress but below the position and not open: it ended
        // before the cursor passed it... unless it was open; a snapshot
        // cannot show a transaction below an earlier xmax that was not
        // then in progress, so only the open ones are kept.
        let c = next_cursor(&cursor(100, &[95]), 10, 0, None, &snap(120, &[95, 110]));
        assert_eq!(c, cursor(120, &[95, 110]));
        let c = next_cursor(&cursor(100, &[]), 10, 0, None, &snap(120, &[95, 110]));
        assert_eq!(c, cursor(120, &[110]));
    }

    #[test]
    fn a_limit_cut_moves_just_past_the_last_xid_read() {
        // Cut at xid 130: in-progress transactions up to it stay open, those
        // past it are read by position.
        let c = next_cursor(
            &cursor(100, &[90]),
            5,
            5,
            Some(130),
            &snap(200, &[90, 120, 150]),
        );
        assert_eq!(c, cursor(131, &[90, 120]));
        // A zero limit reads nothing and keeps the cursor.
        let before = cursor(100, &[90]);
        assert_eq!(next_cursor(&before, 0, 0, None, &snap(200, &[])), before);
    }

    #[test]
    fn the_cursor_never_goes_back() {
        let c = next_cursor(&cursor(300, &[]), 10, 0, None, &snap(250, &[]));
        assert_eq!(c.pos, 300);
    }
}

/// [`Store::wakeups`](crate::Store::wakeups): a `LISTEN` on [`CHANNEL`],
/// fed to the receiver by a task until the receiver is dropped, and, once
/// the receiver says which lanes it runs, the store's own publishes into
/// them ([`crate::wake::InProcess`]).
pub(super) async fn wakeups(pool: &PgPool, in_process: &crate::wake::InProcess) -> Result<Wakeups> {
    // Subscribe before answering, so a publish right after this returns
    // is not missed.
    let listener = subscribe(pool).await.map_err(map_err)?;
    let (tx, rx) = in_process.channel(WAKE_QUEUE);
    tokio::spawn(listen_loop(pool.clone(), tx, Some(listener)));
    Ok(Wakeups::Push(rx))
}

/// Notifications queued for the node before they are merged into one
/// wake-up of every lane ([`crate::wake`]).
const WAKE_QUEUE: usize = 256;

/// Feeds `tx` from a `LISTEN lanebus` connection (`listener`, or a new one)
/// until the receiver is dropped: each notification wakes the lanes its
/// payload names (publish.sql), or every lane. After a lost connection is
/// re-established, every lane is woken, since notifications sent meanwhile
/// are lost.
async fn listen_loop(pool: PgPool, tx: WakeSender, mut listener: Option<PgListener>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        if tx.is_closed() {
            return;
        }
        let l = match listener.as_mut() {
            Some(l) => l,
            None => {
                match subscribe(&pool).await {
                    Ok(l) => {
                        backoff = Duration::from_millis(100);
                        // Anything published while we were not listening.
                        tx.send(Woken::All);
                        listener.insert(l)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "postgres LISTEN failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = tx.closed() => return,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        continue;
                    }
                }
            }
        };
        let received = tokio::select! {
            r = l.try_recv() => r,
            _ = tx.closed() => return,
        };
        match received {
            Ok(Some(n)) => tx.send(Woken::parse(n.payload())),
            // Connection lost; the listener reconnected (eagerly) and
            // re-subscribed: wake up for what was missed.
            Ok(None) => {
                tracing::info!("postgres LISTEN connection lost and re-established");
                tx.send(Woken::All);
            }
            Err(e) => {
                tracing::warn!(error = %e, "postgres LISTEN connection failed; reconnecting");
                listener = None;
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = tx.closed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn subscribe(pool: &PgPool) -> Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.listen(CHANNEL).await?;
    Ok(l)
}
