-- One chunk of a handler delete (postgres/catalog.rs delete_handler): the
-- deliveries of a handler in one lane with lo <= xid < hi, where hi is the
-- xid of the lane's ($4 + 1)-th row (of any handler) from lo on, in the
-- order of deliveries_claim (lane, xid); lo + 1 if the rows up to it all
-- have xid lo, so every chunk moves on.
--   $1 lane int, $2 lo bigint, $3 handler id text, $4 rows per chunk bigint
-- Returns hi (NULL: the chunk ran to the lane's end; the next chunk starts
-- there) and how many deliveries went. Both scans are ranges of the claim
-- index, so the chunks of a lane read each of its rows once between them:
-- no index on handler_id, which would cost WAL at every publish.
WITH bound AS (
    SELECT xid FROM deliveries
    WHERE lane = $1 AND xid >= $2
    ORDER BY xid
    OFFSET $4 LIMIT 1
),
hi AS (
    SELECT greatest(xid, $2 + 1) AS hi FROM bound
),
gone AS (
    DELETE FROM deliveries
    WHERE lane = $1 AND xid >= $2
      AND xid < coalesce((SELECT hi FROM hi), 9223372036854775807)
      AND handler_id = $3
    RETURNING 1
)
SELECT (SELECT hi FROM hi), (SELECT count(*) FROM gone);
