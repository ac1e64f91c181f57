-- Bulk completion, one statement: delete the fenced deliveries and append a
-- completion row for each.
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[]
WITH x AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::int[]) AS x (id, lane, epoch, attempts)
),
del AS (
    DELETE FROM deliveries d
    USING x, lanes l
    WHERE d.id = x.id AND d.lane = x.lane AND l.lane = x.lane AND l.epoch = x.epoch
    RETURNING d.id, d.event_id, d.handler_id, x.attempts
),
ins AS (
    INSERT INTO completions (event_id, handler_id, attempts)
    SELECT event_id, handler_id, attempts FROM del
)
SELECT id FROM del ORDER BY id
