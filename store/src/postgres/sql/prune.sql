-- One retention batch, one statement: at most $2 completions completed
-- before $1, and at most $2 events published before $1 that have no pending
-- delivery and no dead letter. Rows are picked through the BRIN indexes
-- (heap order = time order for these append-only tables) and deleted by
-- ctid; only the deleted rows are locked, and no dispatch statement touches
-- them (claims read pending deliveries' events only, completions append).
-- Runs after the retention lock, so a recovery cannot put a delivery back
-- for an event between the check and the delete; a dead-letter replay
-- turns a dead letter into a delivery in one statement, so this statement's
-- snapshot sees one or the other.
--   $1 before (timestamptz), $2 batch size
WITH oc AS (
    SELECT ctid FROM completions WHERE completed_at < $1 LIMIT $2
),
dc AS (
    DELETE FROM completions WHERE ctid = ANY (ARRAY(SELECT ctid FROM oc)) RETURNING 1
),
oe AS (
    SELECT e.ctid FROM events e
    WHERE e.published_at < $1
      AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.lane = e.lane AND d.event_id = e.id)
      AND NOT EXISTS (SELECT 1 FROM dead_letters x WHERE x.event_id = e.id)
    LIMIT $2
),
de AS (
    DELETE FROM events WHERE ctid = ANY (ARRAY(SELECT ctid FROM oe)) RETURNING 1
)
SELECT (SELECT count(*) FROM dc) AS completions, (SELECT count(*) FROM de) AS events
