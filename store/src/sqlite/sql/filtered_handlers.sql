-- The handlers with a payload filter, in creation order (their deliveries
-- are inserted by publish.rs, not by insert_deliveries.sql).
SELECT id, event_types, filter FROM handlers WHERE filter IS NOT NULL ORDER BY rowid
