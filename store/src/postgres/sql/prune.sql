-- One retention batch, one statement: at most $2 completions (and late
-- completions) completed before $1, and at most $2 events published two
-- minutes or more before $1 that have no pending delivery, no dead letter and
-- no late completion at or after $1. So every completion of a pruned event
-- lies before $1: one within a minute of its publish is before $1, a later
-- one is a late completion (complete.sql). Rows are picked through the BRIN indexes
-- (heap order = time order for these append-only tables) and deleted by
-- ctid; only the deleted rows are locked, and no dispatch statement touches
-- them (claims read pending deliveries' events only, completions append).
-- Runs after the retention lock, so a recovery cannot put a delivery back
-- for an event between the check and the delete; a dead-letter replay
-- turns a dead letter into a delivery in one statement, so this statement's
-- snapshot sees one or the other.
-- The pending-delivery test is uncorrelated by lane on purpose: the planner
-- then hashes `deliveries` once per batch (no event_id index: it would cost
-- WAL per publish) instead of reading a lane's claim index per event.
--   $1 before (timestamptz), $2 batch size
WITH oc AS (
    SELECT ctid FROM completions WHERE completed_at < $1 LIMIT $2
),
dc AS (
    DELETE FROM completions WHERE ctid = ANY (ARRAY(SELECT ctid FROM oc)) RETURNING 1
),
ol AS (
    SELECT ctid FROM late_completions WHERE completed_at < $1 LIMIT $2
),
dl AS (
    DELETE FROM late_completions WHERE ctid = ANY (ARRAY(SELECT ctid FROM ol))
),
oe AS (
    SELECT e.ctid FROM events e
    WHERE e.published_at < $1 - interval '2 minutes'
      AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.event_id = e.id)
      AND NOT EXISTS (SELECT 1 FROM late_completions l WHERE l.event_id = e.id AND l.completed_at >= $1)
      AND NOT EXISTS (SELECT 1 FROM dead_letters x WHERE x.event_id = e.id)
    LIMIT $2
),
de AS (
    DELETE FROM events WHERE ctid = ANY (ARRAY(SELECT ctid FROM oe)) RETURNING 1
)
SELECT (SELECT count(*) FROM dc) AS completions, (SELECT count(*) FROM de) AS events
