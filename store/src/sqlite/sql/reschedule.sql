-- Records failed attempts of fenced deliveries; ?1: JSON array of
-- [id, lane, epoch, attempts, due_at (µs), last_error].
WITH x (id, lane, epoch, attempts, due_at, last_error) AS (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
           json_extract(value, '$[3]'), json_extract(value, '$[4]'), json_extract(value, '$[5]')
    FROM json_each(?1)
)
UPDATE deliveries
SET attempts = x.attempts, due_at = x.due_at, last_error = x.last_error, held = 1
FROM x JOIN lanes l ON l.lane = x.lane AND l.epoch = x.epoch
WHERE deliveries.id = x.id AND deliveries.lane = x.lane
RETURNING deliveries.id
