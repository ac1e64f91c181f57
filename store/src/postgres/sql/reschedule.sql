-- Bulk reschedule of fenced deliveries (a HOT update: no indexed column
-- changes). held: its due time is no longer its event's publish time (see
-- complete.sql).
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[],
--   $5 due_at timestamptz[], $6 last_error text[], $7 failure text[] of jsonb (an
--   attempt-log entry or NULL), $8 entries an attempt log keeps.
-- The failure is appended to the delivery's attempt log in this statement;
-- a full log drops its oldest entry (each append drops at most one, so no
-- log grows past $8).
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
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::int[], $5::timestamptz[], $6::text[],
                         $7::text[]::jsonb[])
        AS x (id, lane, epoch, attempts, due_at, last_error, failure)
),
fenced AS MATERIALIZED (
    SELECT l.lane, l.epoch
    FROM lanes l
    JOIN (SELECT DISTINCT lane, epoch FROM x) y ON l.lane = y.lane AND l.epoch = y.epoch
    ORDER BY l.lane
    FOR SHARE OF l
)
UPDATE deliveries d
SET attempts = x.attempts, due_at = x.due_at, last_error = x.last_error, held = true,
    attempt_log = CASE
        WHEN x.failure IS NULL THEN d.attempt_log
        WHEN jsonb_array_length(d.attempt_log) >= $8
            THEN (d.attempt_log - 0) || jsonb_build_array(x.failure)
        ELSE coalesce(d.attempt_log, '[]'::jsonb) || jsonb_build_array(x.failure)
    END
FROM x, fenced f
WHERE d.id = x.id AND d.lane + 0 = x.lane AND f.lane = x.lane AND f.epoch = x.epoch
RETURNING d.id
