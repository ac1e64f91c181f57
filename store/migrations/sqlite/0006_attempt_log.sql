-- lanebus SQLite schema, version 6: the attempt log. A JSON array of the
-- last failed attempts of a delivery (attempt, at, status, error,
-- duration_ms, body; oldest first, at most ATTEMPT_LOG_LEN), written by the
-- reschedule or dead letter that records a failure, NULL until one failed.
-- A dead letter keeps its delivery's log. Nothing is written when an
-- attempt succeeds.
ALTER TABLE deliveries ADD COLUMN attempt_log TEXT;
ALTER TABLE dead_letters ADD COLUMN attempt_log TEXT;
