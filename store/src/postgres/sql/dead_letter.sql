-- Bulk dead letter, one statement: delete the fenced deliveries and insert
-- their dead-letter rows.
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[], $5 last_error text[]
WITH x AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::int[], $5::text[])
        AS x (id, lane, epoch, attempts, last_error)
),
del AS (
    DELETE FROM deliveries d
    USING x, lanes l
    WHERE d.id = x.id AND d.lane = x.lane AND l.lane = x.lane AND l.epoch = x.epoch
    RETURNING d.id, d.handler_id, d.event_id, d.lane, d.key, d.seq, x.attempts, x.last_error
),
ins AS (
    INSERT INTO dead_letters (handler_id, event_id, lane, key, seq, attempts, last_error)
    SELECT handler_id, event_id, lane, key, seq, attempts, last_error FROM del ORDER BY id
)
SELECT id FROM del ORDER BY id
