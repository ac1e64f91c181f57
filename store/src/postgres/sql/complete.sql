-- Bulk completion, one statement: delete the fenced deliveries and append a
-- completion row for each; a completion more than a minute after its event's
-- publish also appends a late_completions row (rare), so that retention
-- keeps the event for the retention period after this completion (the
-- minute is LATE_COMPLETION in postgres/mod.rs; prune.sql relies on it).
-- Late is told from the delivery row: due more than a minute ago (its due
-- time is its event's publish time unless held), held (deliver_at, a
-- reschedule, a dead-letter replay) or a recovery's replay.
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[]
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
    WHERE d.id = x.id AND d.lane + 0 = x.lane AND f.lane = x.lane AND f.epoch = x.epoch
    RETURNING d.id, d.event_id, d.handler_id, x.attempts, d.due_at, d.held, d.replay
),
ins AS (
    INSERT INTO completions (event_id, handler_id, attempts)
    SELECT event_id, handler_id, attempts FROM del
),
late AS (
    INSERT INTO late_completions (event_id)
    SELECT event_id FROM del
    WHERE due_at < now() - interval '1 minute' OR held OR replay
)
SELECT id FROM del ORDER BY id
