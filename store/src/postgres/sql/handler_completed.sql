-- $1 handler id, $2 window start (inclusive), $3 window end (exclusive;
-- NULL: none), $4/$5 cursor (completed_at, event_id), items strictly
-- before it (NULL: none), $6 key (NULL: any), $7 limit. A BRIN range scan
-- of completions_completed_at over the window, every handler's rows read.
SELECT c.event_id, e.type, e.key, e.seq, e.lane, c.attempts, c.completed_at
FROM completions c
LEFT JOIN events e ON e.id = c.event_id
WHERE c.completed_at >= $2
  AND ($3::timestamptz IS NULL OR c.completed_at < $3::timestamptz)
  AND c.handler_id = $1
  AND ($4::timestamptz IS NULL OR c.completed_at < $4::timestamptz
       OR (c.completed_at = $4::timestamptz AND c.event_id < $5::text))
  AND ($6::text IS NULL OR e.key = $6::text)
ORDER BY c.completed_at DESC, c.event_id DESC
LIMIT $7
