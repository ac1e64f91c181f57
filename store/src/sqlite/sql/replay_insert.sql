-- Puts the selected dead letters back as fresh deliveries (attempts 0, due
-- ?3, new ids so the owner's cursor sees them). ?1: JSON array of dead-letter
-- ids or NULL for all; ?2: handler id or NULL for any; ?4, ?5: failed at or
-- after, failed before (µs, NULL: any time). Dead letters of a deleted
-- handler are not replayed. Inserted in (lane, key, seq) order: the cursor
-- is the delivery id, so a key's replays are claimed in sequence order.
INSERT INTO deliveries (lane, handler_id, event_id, key, seq, attempts, due_at, held)
SELECT lane, handler_id, event_id, key, seq, 0, ?3, 1
FROM dead_letters
WHERE (?1 IS NULL OR id IN (SELECT value FROM json_each(?1)))
  AND (?2 IS NULL OR handler_id = ?2)
  AND (?4 IS NULL OR failed_at >= ?4)
  AND (?5 IS NULL OR failed_at < ?5)
  AND handler_id IN (SELECT id FROM handlers)
ORDER BY lane, key, seq, id
