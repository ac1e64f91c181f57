-- $1 handler id, $2 ids below this, $3 key (NULL: any), $4 limit, $5 true:
-- pending deliveries, false: dead letters (the other branch is skipped by
-- a one-time filter). Pending: the primary key walked backward, filtered
-- by handler (no handler index on deliveries), up to the $4-th match. Dead
-- letters: index dead_letters_handler (handler_id, id) walked backward.
SELECT r.kind, r.id, r.event_id, e.type, r.key, r.seq, r.lane::bigint, r.attempts::bigint, r.at,
       r.last_error, r.attempt_log::text
FROM (
    (SELECT 'pending' AS kind, id, event_id, key, seq, lane, attempts, due_at AS at, last_error,
            attempt_log
     FROM deliveries
     WHERE $5 AND handler_id = $1 AND id < $2 AND ($3::text IS NULL OR key = $3::text)
     ORDER BY id DESC
     LIMIT $4)
    UNION ALL
    (SELECT 'dead_lettered', id, event_id, key, seq, lane, attempts, failed_at, last_error,
            attempt_log
     FROM dead_letters
     WHERE NOT $5 AND handler_id = $1 AND id < $2 AND ($3::text IS NULL OR key = $3::text)
     ORDER BY id DESC
     LIMIT $4)
) r
LEFT JOIN events e ON e.id = r.event_id
ORDER BY r.id DESC
