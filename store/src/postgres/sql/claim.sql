-- Batched claim: many lanes, one statement, no row updated.
--   $1 lanes int[], $2 epochs bigint[], $3 cursor positions bigint[],
--   $4 limits int[]; the cursors' open transactions as (claim ordinal,
--   xid) pairs: $5 ords int[], $6 xids bigint[].
-- Per lane, nothing if the lane's epoch differs; else
--   ranged: the deliveries with xid >= pos in (xid, id) order, at most
--     `limit` rows plus the rest of the last xid's rows (WITH TIES), so the
--     next cursor can be set past that xid;
--   reopened: every delivery of a transaction in the cursor's open set,
--     found by its xid, or by txid where a key raised its xid (publish.sql).
-- A row may come in both parts; the caller keeps one.
-- The first row carries this statement's snapshot: xmax (every xid below
-- it not in xip had ended when the snapshot was taken) and xip (the xids
-- in progress), from which the caller computes the next cursors.
WITH snap AS MATERIALIZED (
    SELECT pg_snapshot_xmax(s)::text::bigint AS xmax,
           ARRAY(SELECT x::text::bigint FROM pg_snapshot_xip(s) AS x ORDER BY 1) AS xip
    FROM pg_current_snapshot() AS s
),
o AS MATERIALIZED (
    SELECT * FROM unnest($5::int[], $6::bigint[]) AS o (ord, xid)
)
SELECT c.ord, (l.epoch IS NOT DISTINCT FROM c.epoch) AS owned,
       CASE WHEN row_number() OVER (ORDER BY c.ord, d.xid, d.id) = 1 THEN snap.xmax END AS xmax,
       CASE WHEN row_number() OVER (ORDER BY c.ord, d.xid, d.id) = 1 THEN snap.xip END AS xip,
       d.ranged, d.id, d.xid, d.handler_id, d.event_id, d.type, d.key, d.seq, d.attempts,
       d.due_at, d.last_error, d.payload, d.published_at, d.replay
FROM unnest($1::int[], $2::bigint[], $3::bigint[], $4::int[]) WITH ORDINALITY AS c (lane, epoch, pos, lim, ord)
CROSS JOIN snap
LEFT JOIN lanes l ON l.lane = c.lane
LEFT JOIN LATERAL (
    (SELECT true AS ranged, d.id, d.xid, d.handler_id, d.event_id, e.type, d.key, d.seq, d.attempts,
            d.due_at, d.last_error, e.payload, e.published_at, d.replay
     FROM deliveries d
     JOIN events e ON e.id = d.event_id
     WHERE d.lane = c.lane AND d.xid >= c.pos AND l.epoch = c.epoch
     ORDER BY d.xid
     FETCH FIRST (c.lim) ROWS WITH TIES)
    UNION ALL
    SELECT false, d.id, d.xid, d.handler_id, d.event_id, e.type, d.key, d.seq, d.attempts,
           d.due_at, d.last_error, e.payload, e.published_at, d.replay
    FROM deliveries d
    JOIN events e ON e.id = d.event_id
    WHERE d.lane = c.lane AND l.epoch = c.epoch AND c.lim > 0
      AND (d.xid = ANY (ARRAY(SELECT o.xid FROM o WHERE o.ord = c.ord))
           OR (d.txid IS NOT NULL AND d.txid = ANY (ARRAY(SELECT o.xid FROM o WHERE o.ord = c.ord))))
) d ON true
ORDER BY c.ord, d.xid, d.id
