-- lanebus PostgreSQL schema, version 7: the attempt log. A JSON array of
-- the last failed attempts of a delivery (attempt, at, status, error,
-- duration_ms, body; oldest first, at most ATTEMPT_LOG_LEN), written by the
-- reschedule or dead letter that records a failure (reschedule stays a HOT
-- update: the column is not indexed), NULL until one failed: a delivery
-- that succeeds at once writes nothing more (one more bit in the null
-- bitmap, whose bytes do not change). A dead letter keeps its delivery's
-- log. Adding a nullable column without a default rewrites nothing.
ALTER TABLE deliveries ADD COLUMN IF NOT EXISTS attempt_log jsonb;
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS attempt_log jsonb;
