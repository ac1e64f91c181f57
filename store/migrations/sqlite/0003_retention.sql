-- lanebus SQLite schema, version 3: delayed delivery, recovery, retention.
-- deliveries.replay: 1 for a delivery put back by a recovery (webhook header
-- lanebus-replay: true), NULL otherwise. Retention keeps every event with a
-- dead letter (looked up by event id); events and completions are pruned in
-- rowid order (append-only, so oldest first), which needs no index.
ALTER TABLE deliveries ADD COLUMN replay INTEGER;
CREATE INDEX IF NOT EXISTS dead_letters_event ON dead_letters (event_id);
