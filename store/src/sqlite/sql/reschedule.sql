-- Records failed attempts of fenced deliveries; ?1: JSON array of
-- [id, lane, epoch, attempts, due_at (µs), last_error, failure (an
-- attempt-log entry or null)]; ?2: entries an attempt log keeps. The
-- failure is appended to the delivery's attempt log in this statement; a
-- full log drops its oldest entry (each append drops at most one, so no
-- log grows past ?2).
WITH x (id, lane, epoch, attempts, due_at, last_error, failure) AS (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
           json_extract(value, '$[3]'), json_extract(value, '$[4]'), json_extract(value, '$[5]'),
           json_extract(value, '$[6]')
    FROM json_each(?1)
)
UPDATE deliveries
SET attempts = x.attempts, due_at = x.due_at, last_error = x.last_error, held = 1,
    attempt_log = CASE
        WHEN x.failure IS NULL THEN attempt_log
        WHEN json_array_length(attempt_log) >= ?2
            THEN json_insert(json_remove(attempt_log, '$[0]'), '$[#]', json(x.failure))
        ELSE json_insert(coalesce(attempt_log, '[]'), '$[#]', json(x.failure))
    END
FROM x JOIN lanes l ON l.lane = x.lane AND l.epoch = x.epoch
WHERE deliveries.id = x.id AND deliveries.lane = x.lane
RETURNING deliveries.id
