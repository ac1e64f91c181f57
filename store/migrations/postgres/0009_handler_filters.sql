-- lanebus PostgreSQL schema: payload filters (store/src/filter.rs). filter
-- is a handler's filter, NULL for none; publish.sql evaluates it with
-- lanebus.filter_payload (sql/functions.sql) for handlers that have one
-- only. Adding a nullable column without a default rewrites nothing.
ALTER TABLE handlers ADD COLUMN IF NOT EXISTS filter jsonb;
