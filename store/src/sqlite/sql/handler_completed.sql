-- ?1 handler id, ?2 completed at or after (micros), ?3/?4 cursor
-- (completed_at, event_id): items strictly before it, ?5 key (NULL: any),
-- ?6 limit. A scan of the completion log (no index) and a sort.
SELECT c.event_id, e.type, e.key, e.seq, e.lane, c.attempts, c.completed_at
FROM completions c
LEFT JOIN events e ON e.id = c.event_id
WHERE c.handler_id = ?1 AND c.completed_at >= ?2
  AND (c.completed_at < ?3 OR (c.completed_at = ?3 AND c.event_id < ?4))
  AND (?5 IS NULL OR e.key = ?5)
ORDER BY c.completed_at DESC, c.event_id DESC
LIMIT ?6
