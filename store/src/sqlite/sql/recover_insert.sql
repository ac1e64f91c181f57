-- Recovery: one fresh delivery (replay = 1, attempts 0, due ?3) per event
-- whose delivery to handler ?1 completed at or after ?2 (µs) and that is
-- still stored, unless one is already pending; in (lane, key, seq) order so
-- a key's recovered deliveries are claimed in sequence order.
INSERT INTO deliveries (lane, handler_id, event_id, key, seq, attempts, due_at, replay)
SELECT e.lane, ?1, e.id, e.key, e.seq, 0, ?3, 1
FROM (SELECT DISTINCT event_id FROM completions WHERE handler_id = ?1 AND completed_at >= ?2) c
JOIN events e ON e.id = c.event_id
WHERE NOT EXISTS (
    SELECT 1 FROM deliveries d WHERE d.lane = e.lane AND d.event_id = e.id AND d.handler_id = ?1
)
ORDER BY e.lane, e.key, e.seq, e.id
