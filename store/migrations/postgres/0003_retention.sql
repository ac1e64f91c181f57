-- lanebus PostgreSQL schema, version 3: delayed delivery, recovery, retention.
--
-- deliveries.replay: true for a delivery put back by a recovery (webhook
-- header lanebus-replay: true); NULL otherwise. A NULL in a row that already
-- has a null bitmap costs no byte, so the dispatch path writes nothing more.
ALTER TABLE deliveries ADD COLUMN IF NOT EXISTS replay boolean;

-- Retention prunes events by publish time, in heap order: a BRIN index
-- (a few pages, no per-row WAL at insert, unlike a b-tree).
CREATE INDEX IF NOT EXISTS events_published_at ON events USING brin (published_at)
    WITH (autosummarize = on);
ALTER INDEX completions_completed_at SET (autosummarize = on);

-- Retention keeps every event with a dead letter; dead letters are rare,
-- so a b-tree on their event id costs nothing on the dispatch path.
CREATE INDEX IF NOT EXISTS dead_letters_event ON dead_letters (event_id);
