-- One retention batch of events: at most ?2 events published two minutes or
-- more (120,000,000 µs) before ?1 (µs) without a pending delivery, a dead
-- letter or a late completion at or after ?1, oldest rowid first (events are
-- append-only, so rowid order is publish order). So every completion of a
-- pruned event lies before ?1: one within a minute of its publish (plus the
-- few ms between an event's and its deliveries' clock reads) is before ?1, a
-- later one is a late completion (sql/late_insert.sql).
DELETE FROM events WHERE rowid IN (
    SELECT e.rowid FROM events e
    WHERE e.published_at < ?1 - 120000000
      AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.lane = e.lane AND d.event_id = e.id)
      AND NOT EXISTS (SELECT 1 FROM dead_letters x WHERE x.event_id = e.id)
      AND NOT EXISTS (SELECT 1 FROM late_completions l WHERE l.event_id = e.id AND l.completed_at >= ?1)
    ORDER BY e.rowid
    LIMIT ?2
)
