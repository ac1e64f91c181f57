-- The same selection as replay_insert.sql, removed.
DELETE FROM dead_letters
WHERE (?1 IS NULL OR id IN (SELECT value FROM json_each(?1)))
  AND (?2 IS NULL OR handler_id = ?2)
  AND handler_id IN (SELECT id FROM handlers)
