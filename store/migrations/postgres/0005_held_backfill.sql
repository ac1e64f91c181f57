-- lanebus PostgreSQL schema, version 5: deliveries pending when version 4
-- was applied count as held. Version 4 added deliveries.held (NULL on every
-- existing row), so a delivery rescheduled or delayed before the upgrade
-- and completed promptly after its due time wrote no late_completions row,
-- and retention could prune its event while a recovery still needed it.
-- Marking every such row held is conservative: a completion of one appends
-- a late row at most. On a new store the table is empty.
UPDATE deliveries SET held = true WHERE held IS NULL;
