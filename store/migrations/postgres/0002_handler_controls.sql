-- Handler controls (issue #4): rate limit, secret rotation, state history,
-- start of a run of failures (auto-disable).
ALTER TABLE handlers
    ADD COLUMN IF NOT EXISTS rate_limit_per_s      int,
    ADD COLUMN IF NOT EXISTS rate_limit_burst      int,
    ADD COLUMN IF NOT EXISTS previous_secret       text,
    ADD COLUMN IF NOT EXISTS previous_secret_until timestamptz,
    ADD COLUMN IF NOT EXISTS state_changed_at      timestamptz,
    ADD COLUMN IF NOT EXISTS state_reason          text,
    ADD COLUMN IF NOT EXISTS failing_since         timestamptz;
