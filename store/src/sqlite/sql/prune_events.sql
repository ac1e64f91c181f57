-- One retention batch of events: at most ?2 events published before ?1
-- (µs) without a pending delivery or a dead letter, oldest rowid first
-- (events are append-only, so rowid order is publish order).
DELETE FROM events WHERE rowid IN (
    SELECT e.rowid FROM events e
    WHERE e.published_at < ?1
      AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.lane = e.lane AND d.event_id = e.id)
      AND NOT EXISTS (SELECT 1 FROM dead_letters x WHERE x.event_id = e.id)
    ORDER BY e.rowid
    LIMIT ?2
)
