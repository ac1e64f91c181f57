-- One retention batch of events: at most ?2 events published two minutes or
-- more (120,000,000 µs) before ?1 (µs) without a pending delivery, a dead
-- letter or a late completion at or after ?1, oldest rowid first (events are
-- append-only, so rowid order is publish order). So every completion of a
-- pruned event lies before ?1: one within a minute of its publish (plus the
-- few ms between an event's and its deliveries' clock reads) is before ?1, a
-- later one is a late completion (sql/late_insert.sql).
--
-- The statement holds SQLite's only write lock, so it must not scan much:
-- the scan stops at the first event young enough to keep (a rowid bound:
-- without it every pass read the whole table, 0.5-1.9 s at 1 M events), and
-- the pending-delivery test is one `NOT IN` over deliveries, which SQLite
-- answers from one temporary index per statement (a per-event `NOT EXISTS`
-- read every delivery of the event's lane: 34.7 s with 100,000 old events
-- still pending). An event published out of rowid order is only pruned later.
DELETE FROM events WHERE rowid IN (
    SELECT e.rowid FROM events e
    WHERE e.rowid < coalesce(
            (SELECT y.rowid FROM events y WHERE y.published_at >= ?1 - 120000000 ORDER BY y.rowid LIMIT 1),
            9223372036854775807)
      AND e.published_at < ?1 - 120000000
      AND e.id NOT IN (SELECT d.event_id FROM deliveries d)
      AND NOT EXISTS (SELECT 1 FROM dead_letters x WHERE x.event_id = e.id)
      AND NOT EXISTS (SELECT 1 FROM late_completions l WHERE l.event_id = e.id AND l.completed_at >= ?1)
    ORDER BY e.rowid
    LIMIT ?2
)
