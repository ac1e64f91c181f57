-- Copies fenced deliveries into dead_letters; ?1: JSON array of
-- [id, lane, epoch, attempts, last_error, failure (an attempt-log entry or
-- null)]; ?2: failed_at (µs); ?3: entries an attempt log keeps. The dead
-- letter keeps the delivery's attempt log with the failure appended (as
-- reschedule.sql appends). Not for a deleted handler (a publish that read
-- it before the delete left it a delivery): its delivery is removed
-- without a dead letter, which nobody could replay and which would keep
-- its event from being pruned.
WITH x (id, lane, epoch, attempts, last_error, failure) AS (
    SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'),
           json_extract(value, '$[3]'), json_extract(value, '$[4]'), json_extract(value, '$[5]')
    FROM json_each(?1)
)
INSERT INTO dead_letters (handler_id, event_id, lane, key, seq, attempts, last_error, failed_at,
                          attempt_log)
SELECT d.handler_id, d.event_id, d.lane, d.key, d.seq, x.attempts, x.last_error, ?2,
       CASE
           WHEN x.failure IS NULL THEN d.attempt_log
           WHEN json_array_length(d.attempt_log) >= ?3
               THEN json_insert(json_remove(d.attempt_log, '$[0]'), '$[#]', json(x.failure))
           ELSE json_insert(coalesce(d.attempt_log, '[]'), '$[#]', json(x.failure))
       END
FROM x
JOIN deliveries d ON d.id = x.id AND d.lane = x.lane
JOIN lanes l ON l.lane = x.lane AND l.epoch = x.epoch
JOIN handlers h ON h.id = d.handler_id
ORDER BY d.id
