-- Handler controls (issue #4): rate limit, secret rotation, state history,
-- start of a run of failures (auto-disable). Times in microseconds since
-- the Unix epoch, like the other columns.
ALTER TABLE handlers ADD COLUMN rate_limit_per_s INTEGER;
ALTER TABLE handlers ADD COLUMN rate_limit_burst INTEGER;
ALTER TABLE handlers ADD COLUMN previous_secret TEXT;
ALTER TABLE handlers ADD COLUMN previous_secret_until INTEGER;
ALTER TABLE handlers ADD COLUMN state_changed_at INTEGER;
ALTER TABLE handlers ADD COLUMN state_reason TEXT;
ALTER TABLE handlers ADD COLUMN failing_since INTEGER;
