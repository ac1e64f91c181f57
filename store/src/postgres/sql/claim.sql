-- Batched claim: many lanes, one statement, no row updated.
--   $1 lanes int[], $2 epochs bigint[], $3 afters bigint[], $4 limits int[]
-- Per lane: the deliveries with xid >= after, in (xid, id) order, at most
-- `limit` rows plus the rest of the last xid's rows (WITH TIES), so the next
-- cursor can be set past that xid; nothing if the lane's epoch differs.
-- xmin: the oldest transaction still running when this statement's snapshot
-- was taken; everything with a smaller xid is visible to this statement.
WITH snap AS MATERIALIZED (
    SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin
)
SELECT c.ord, (l.epoch IS NOT DISTINCT FROM c.epoch) AS owned, snap.xmin,
       d.id, d.xid, d.handler_id, d.event_id, d.type, d.key, d.seq, d.attempts,
       d.due_at, d.last_error, d.payload, d.published_at, d.replay
FROM unnest($1::int[], $2::bigint[], $3::bigint[], $4::int[]) WITH ORDINALITY AS c (lane, epoch, after, lim, ord)
CROSS JOIN snap
LEFT JOIN lanes l ON l.lane = c.lane
LEFT JOIN LATERAL (
    SELECT d.id, d.xid, d.handler_id, d.event_id, e.type, d.key, d.seq, d.attempts,
           d.due_at, d.last_error, e.payload, e.published_at, d.replay
    FROM deliveries d
    JOIN events e ON e.id = d.event_id
    WHERE d.lane = c.lane AND d.xid >= c.after AND l.epoch = c.epoch
    ORDER BY d.xid
    FETCH FIRST (c.lim) ROWS WITH TIES
) d ON true
ORDER BY c.ord, d.xid, d.id
