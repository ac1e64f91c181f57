-- Replays dead letters, one statement: delete them and insert fresh
-- deliveries (attempts 0, due now, new ids; the default xid is this
-- transaction's, so the lane owner's cursor sees them). Dead letters of a
-- deleted handler stay.
--   $1 dead-letter ids bigint[] (NULL: any), $2 handler id (NULL: any),
--   $3 failed at or after (NULL: any time), $4 failed before (NULL: any time)
-- Inserted in (lane, key, seq) order, so where the claim cursor is the
-- delivery id (SQLite, MongoDB) a key's replayed deliveries come back in
-- sequence order even across a claim's limit.
WITH dl AS (
    DELETE FROM dead_letters
    WHERE ($1::bigint[] IS NULL OR id = ANY ($1::bigint[]))
      AND ($2::text IS NULL OR handler_id = $2::text)
      AND ($3::timestamptz IS NULL OR failed_at >= $3::timestamptz)
      AND ($4::timestamptz IS NULL OR failed_at < $4::timestamptz)
      AND handler_id IN (SELECT id FROM handlers)
    RETURNING id, handler_id, event_id, lane, key, seq
),
ins AS (
    INSERT INTO deliveries (lane, handler_id, event_id, key, seq, held)
    SELECT lane, handler_id, event_id, key, seq, true FROM dl ORDER BY lane, key, seq, id
    RETURNING 1
)
SELECT (SELECT count(*) FROM ins) AS replayed,
       (SELECT count(*) FROM (SELECT pg_notify('lanebus', '') FROM (SELECT 1 FROM ins LIMIT 1) AS one) AS n) AS notified
