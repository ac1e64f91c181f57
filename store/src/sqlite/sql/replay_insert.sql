-- Puts the selected dead letters back as fresh deliveries (attempts 0, due
-- ?3, new ids so the owner's cursor sees them). ?1: JSON array of dead-letter
-- ids or NULL for all; ?2: handler id or NULL for any. Dead letters of a
-- deleted handler are not replayed.
INSERT INTO deliveries (lane, handler_id, event_id, key, seq, attempts, due_at)
SELECT lane, handler_id, event_id, key, seq, 0, ?3
FROM dead_letters
WHERE (?1 IS NULL OR id IN (SELECT value FROM json_each(?1)))
  AND (?2 IS NULL OR handler_id = ?2)
  AND handler_id IN (SELECT id FROM handlers)
ORDER BY id
