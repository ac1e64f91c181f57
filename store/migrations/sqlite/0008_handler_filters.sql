-- lanebus SQLite schema: payload filters (store/src/filter.rs). filter is
-- a handler's filter as compact JSON, NULL for none. The delivery insert of
-- a publish skips handlers with a filter; publish.rs evaluates their
-- filters in the same transaction and inserts their deliveries. The
-- partial index makes "the handlers with a filter" one read of an empty
-- index in a store without any.
ALTER TABLE handlers ADD COLUMN filter TEXT;
CREATE INDEX IF NOT EXISTS handlers_filtered ON handlers (id) WHERE filter IS NOT NULL;
