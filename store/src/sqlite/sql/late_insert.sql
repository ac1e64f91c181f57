-- Appends a late_completions row per fenced, still pending delivery of ?1
-- (JSON array of [id, lane, epoch, attempts]) that completes more than a
-- minute (60,000,000 µs) after its event's publish, told from the delivery
-- row alone: due more than a minute before ?2 (completed_at, µs; the due time
-- is the publish time unless held), held, or a replay. Rare: nearly every
-- completion appends nothing. Runs before the fenced delete.
WITH x (id, lane, epoch) AS (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]')
    FROM json_each(?1)
)
INSERT INTO late_completions (event_id, completed_at)
SELECT d.event_id, ?2
FROM x
JOIN deliveries d ON d.id = x.id AND d.lane = x.lane
JOIN lanes l ON l.lane = x.lane AND l.epoch = x.epoch
WHERE d.due_at < ?2 - 60000000 OR d.held IS NOT NULL OR d.replay IS NOT NULL
