-- $1 event id, $2 its lane, $3 a minute before its publish. Pending
-- deliveries: the lane's rows (index deliveries_claim); completions: those
-- since $3 (BRIN completions_completed_at); dead letters: index
-- dead_letters_event. One statement, so one snapshot.
SELECT r.kind, r.handler_id, h.name AS handler_name, r.attempts, r.at, r.last_error,
       r.attempt_log::text
FROM (
    SELECT 'pending' AS kind, handler_id, attempts, due_at AS at, last_error, attempt_log
    FROM deliveries WHERE lane = $2 AND event_id = $1
    UNION ALL
    SELECT 'completed', handler_id, attempts, completed_at, NULL, NULL::jsonb
    FROM completions WHERE completed_at >= $3 AND event_id = $1
    UNION ALL
    SELECT 'dead_lettered', handler_id, attempts, failed_at, last_error, attempt_log
    FROM dead_letters WHERE event_id = $1
) r
LEFT JOIN handlers h ON h.id = r.handler_id
