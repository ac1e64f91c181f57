-- Appends a completion row per fenced, still pending delivery of ?1 (JSON
-- array of [id, lane, epoch, attempts]); ?2: completed_at (µs).
WITH x (id, lane, epoch, attempts) AS (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'),
           json_extract(value, '$[2]'), json_extract(value, '$[3]')
    FROM json_each(?1)
)
INSERT INTO completions (event_id, handler_id, attempts, completed_at)
SELECT d.event_id, d.handler_id, x.attempts, ?2
FROM x
JOIN deliveries d ON d.id = x.id AND d.lane = x.lane
JOIN lanes l ON l.lane = x.lane AND l.epoch = x.epoch
