-- Bulk completion, one statement: delete the fenced deliveries and append a
-- completion row for each.
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[]
-- The lane rows are locked FOR SHARE at the claimed epoch, so a fence (an
-- UPDATE of the lane row) either waits for this statement's transaction or,
-- if it committed first, makes the re-checked row fail the epoch test: a
-- deposed owner changes nothing even when its statement started before the
-- fence committed (invariant 4).
WITH x AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::int[]) AS x (id, lane, epoch, attempts)
),
fenced AS MATERIALIZED (
    SELECT l.lane, l.epoch
    FROM lanes l
    JOIN (SELECT DISTINCT lane, epoch FROM x) y ON l.lane = y.lane AND l.epoch = y.epoch
    ORDER BY l.lane
    FOR SHARE OF l
),
del AS (
    DELETE FROM deliveries d
    USING x, fenced f
    WHERE d.id = x.id AND d.lane = x.lane AND f.lane = x.lane AND f.epoch = x.epoch
    RETURNING d.id, d.event_id, d.handler_id, x.attempts
),
ins AS (
    INSERT INTO completions (event_id, handler_id, attempts)
    SELECT event_id, handler_id, attempts FROM del
)
SELECT id FROM del ORDER BY id
