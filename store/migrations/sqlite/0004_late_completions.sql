-- lanebus SQLite schema, version 4: retention counts from an event's last
-- completion, not its publish. A completion more than a minute after its
-- event's publish (rare: a backlog or outage, a disabled handler, retries,
-- deliver_at, a replay) also appends a late_completions row, and retention
-- keeps an event with a late completion at or after the cutoff (a recovery
-- needs the event). The completion tells a late one from the delivery row
-- alone: due more than a minute ago, held, or a replay.
-- deliveries.held: 1 once a delivery's due time no longer is its event's
-- publish time (deliver_at, a reschedule) or it was made for an old event (a
-- dead-letter replay); NULL otherwise.
ALTER TABLE deliveries ADD COLUMN held INTEGER;
CREATE TABLE IF NOT EXISTS late_completions (
    event_id     TEXT NOT NULL,
    completed_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS late_completions_event ON late_completions (event_id, completed_at);
