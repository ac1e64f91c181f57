-- ?1 handler id, ?2 ids below this, ?3 key (NULL: any), ?4 limit, ?5 1:
-- pending deliveries, 0: dead letters. Pending: the rowid walked backward,
-- filtered by handler (no handler index on deliveries), up to the ?4-th
-- match. Dead letters: index dead_letters_handler (handler_id, id).
SELECT r.kind, r.id, r.event_id, e.type, r.key, r.seq, r.lane, r.attempts, r.at, r.last_error,
       r.attempt_log
FROM (
    SELECT * FROM (
        SELECT 'pending' AS kind, id, event_id, key, seq, lane, attempts, due_at AS at,
               last_error, attempt_log
        FROM deliveries
        WHERE ?5 AND handler_id = ?1 AND id < ?2 AND (?3 IS NULL OR key = ?3)
        ORDER BY id DESC
        LIMIT ?4)
    UNION ALL
    SELECT * FROM (
        SELECT 'dead_lettered', id, event_id, key, seq, lane, attempts, failed_at, last_error,
               attempt_log
        FROM dead_letters
        WHERE NOT ?5 AND handler_id = ?1 AND id < ?2 AND (?3 IS NULL OR key = ?3)
        ORDER BY id DESC
        LIMIT ?4)
) r
LEFT JOIN events e ON e.id = r.event_id
ORDER BY r.id DESC
