-- The handlers with a payload filter, in creation order (their deliveries
-- are inserted by publish.rs, not by insert_deliveries.sql). '+rowid' keeps
-- the planner on the partial index handlers_filtered (an empty one when no
-- handler has a filter) rather than a scan of the table in rowid order.
SELECT id, event_types, filter FROM handlers WHERE filter IS NOT NULL ORDER BY +rowid
