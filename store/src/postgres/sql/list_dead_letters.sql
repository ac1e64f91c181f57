--   $1 handler id (NULL: any), $2 after id, $3 limit
SELECT dl.id, dl.handler_id, dl.event_id, coalesce(e.type, '') AS type, dl.key, dl.seq,
       dl.attempts, dl.last_error, dl.failed_at
FROM dead_letters dl
LEFT JOIN events e ON e.id = dl.event_id
WHERE ($1::text IS NULL OR dl.handler_id = $1::text) AND dl.id > $2
ORDER BY dl.id
LIMIT $3
