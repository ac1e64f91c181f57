-- Recovery, one statement: one fresh delivery (replay = true) per event
-- whose delivery to the handler completed at or after $2 and that is still
-- stored, unless one is already pending. Runs after the retention lock
-- (pg_advisory_xact_lock) in the same transaction, so a prune batch cannot
-- remove an event between this read and the insert.
--   $1 handler id, $2 completed at or after (timestamptz)
-- Returns the completed events found in the window, those still stored,
-- and the deliveries created.
WITH c AS (
    -- The BRIN index on completed_at narrows the scan to the window.
    SELECT DISTINCT event_id FROM completions
    WHERE handler_id = $1 AND completed_at >= $2
),
found AS (
    SELECT e.id, e.lane, e.key, e.seq,
           EXISTS (SELECT 1 FROM deliveries d
                   WHERE d.lane = e.lane AND d.event_id = e.id AND d.handler_id = $1) AS pending
    FROM c JOIN events e ON e.id = c.event_id
),
ins AS (
    -- (lane, key, seq) order: a key's recovered deliveries in sequence order.
    INSERT INTO deliveries (lane, handler_id, event_id, key, seq, replay)
    SELECT lane, $1, id, key, seq, true FROM found WHERE NOT pending
    ORDER BY lane, key, seq, id
    RETURNING 1
)
SELECT (SELECT count(*) FROM c) AS completed,
       (SELECT count(*) FROM found) AS found,
       (SELECT count(*) FROM ins) AS recovered,
       (SELECT count(*) FROM (SELECT pg_notify('lanebus', '') FROM (SELECT 1 FROM ins LIMIT 1) AS one) AS n) AS notified
