-- Deletes the fenced, still pending deliveries of ?1 (JSON array whose
-- items start with [id, lane, epoch, ...]) and returns their ids.
WITH x (id, lane, epoch) AS (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]')
    FROM json_each(?1)
)
DELETE FROM deliveries
WHERE id IN (
    SELECT d.id FROM x
    JOIN deliveries d ON d.id = x.id AND d.lane = x.lane
    JOIN lanes l ON l.lane = x.lane AND l.epoch = x.epoch
)
RETURNING id
