-- lanebus PostgreSQL schema, version 4: retention counts from an event's
-- last completion, not its publish.
--
-- A completion more than a minute after its event's publish also appends a
-- late_completions row (rare: a backlog or outage, a disabled handler,
-- retries, deliver_at, a replay), and retention keeps an event with a late
-- completion at or after the cutoff (a recovery needs the event). The
-- completion statement tells a late one from the delivery row alone, without
-- reading the event: due more than a minute ago, or `held`.
--
-- deliveries.held: true once a delivery's due time no longer is its event's
-- publish time (deliver_at, a reschedule) or it was made for an old event (a
-- dead-letter replay); NULL otherwise, which costs no byte in a row that
-- already has a null bitmap, so the dispatch path writes nothing more.
ALTER TABLE deliveries ADD COLUMN IF NOT EXISTS held boolean;
CREATE TABLE IF NOT EXISTS late_completions (
    event_id     text NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS late_completions_event ON late_completions (event_id, completed_at);
CREATE INDEX IF NOT EXISTS late_completions_completed_at ON late_completions (completed_at);
