-- Bulk dead letter, one statement: delete the fenced deliveries and insert
-- their dead-letter rows.
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[], $5 last_error text[],
--   $6 failure text[] of jsonb (an attempt-log entry or NULL), $7 entries an attempt log keeps.
-- The dead letter keeps the delivery's attempt log with the failure
-- appended (as reschedule.sql appends).
-- The lane rows are locked FOR SHARE at the claimed epoch, so a fence (an
-- UPDATE of the lane row) either waits for this statement's transaction or,
-- if it committed first, makes the re-checked row fail the epoch test: a
-- deposed owner changes nothing even when its statement started before the
-- fence committed (invariant 4).
-- `d.lane + 0`: the lane test is a filter, not an index condition, so the
-- planner finds each row by the primary key on id. With `d.lane = x.lane`
-- and a row estimate of 1 for `fenced` it chose deliveries_claim (lane,
-- xid) and read every delivery of the lane per batch: seconds per batch on
-- a lane with a large backlog (seen on a fresh cluster, auto_explain).
WITH x AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::int[], $5::text[], $6::text[]::jsonb[])
        AS x (id, lane, epoch, attempts, last_error, failure)
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
    WHERE d.id = x.id AND d.lane + 0 = x.lane AND f.lane = x.lane AND f.epoch = x.epoch
    RETURNING d.id, d.handler_id, d.event_id, d.lane, d.key, d.seq, x.attempts, x.last_error,
        CASE
            WHEN x.failure IS NULL THEN d.attempt_log
            WHEN jsonb_array_length(d.attempt_log) >= $7
                THEN (d.attempt_log - 0) || jsonb_build_array(x.failure)
            ELSE coalesce(d.attempt_log, '[]'::jsonb) || jsonb_build_array(x.failure)
        END AS attempt_log
),
-- Not for a deleted handler (a publish that read it before the delete left
-- it a delivery): the delivery goes without a dead letter, which nobody
-- could replay and which would keep its event from being pruned. A handler
-- DELETE in progress waits for this statement's delivery rows and then
-- deletes what it inserted (postgres/catalog.rs delete_handler).
ins AS (
    INSERT INTO dead_letters (handler_id, event_id, lane, key, seq, attempts, last_error,
                              attempt_log)
    SELECT handler_id, event_id, lane, key, seq, attempts, last_error, attempt_log FROM del
    WHERE EXISTS (SELECT 1 FROM handlers h WHERE h.id = del.handler_id)
    ORDER BY id
)
SELECT id FROM del ORDER BY id
