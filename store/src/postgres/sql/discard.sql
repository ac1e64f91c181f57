-- Fenced discard, one statement: delete the deliveries WITHOUT completion
-- rows (their handler is gone, so nothing was delivered).
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[]
-- The lane rows are locked FOR SHARE at the claimed epoch, as in
-- complete.sql, so a fence that commits meanwhile still wins (invariant 4).
-- `d.lane + 0`: the lane test is a filter, not an index condition, so the
-- planner finds each row by the primary key on id. With `d.lane = x.lane`
-- and a row estimate of 1 for `fenced` it chose deliveries_claim (lane,
-- xid) and read every delivery of the lane per batch: seconds per batch on
-- a lane with a large backlog (seen on a fresh cluster, auto_explain).
WITH x AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[]) AS x (id, lane, epoch)
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
    RETURNING d.id
)
SELECT id FROM del ORDER BY id
