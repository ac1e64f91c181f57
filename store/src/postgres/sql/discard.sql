-- Fenced discard, one statement: delete the deliveries WITHOUT completion
-- rows (their handler is gone, so nothing was delivered).
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[]
-- The lane rows are locked FOR SHARE at the claimed epoch, as in
-- complete.sql, so a fence that commits meanwhile still wins (invariant 4).
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
    WHERE d.id = x.id AND d.lane = x.lane AND f.lane = x.lane AND f.epoch = x.epoch
    RETURNING d.id
)
SELECT id FROM del ORDER BY id
