-- lanebus SQLite schema, version 5: deliveries pending when version 4 was
-- applied count as held (see migrations/postgres/0005_held_backfill.sql:
-- version 4 left held NULL on existing rows, so a delivery rescheduled or
-- delayed before the upgrade could complete without a late_completions row
-- and its event be pruned while a recovery still needed it).
UPDATE deliveries SET held = 1 WHERE held IS NULL;
