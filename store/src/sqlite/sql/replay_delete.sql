-- The same selection as replay_insert.sql, removed (?3 is not used).
DELETE FROM dead_letters
WHERE (?1 IS NULL OR id IN (SELECT value FROM json_each(?1)))
  AND (?2 IS NULL OR handler_id = ?2)
  AND (?4 IS NULL OR failed_at >= ?4)
  AND (?5 IS NULL OR failed_at < ?5)
  AND handler_id IN (SELECT id FROM handlers)
