-- One delivery per (new event, handler whose route matches; disabled ones
-- too: their deliveries are kept until they are enabled), in batch order so
-- that per key the delivery ids follow the sequence numbers. Routes are
-- matched here, in SQL, so a handler registered by another process is
-- seen without a cache: exact type, or a pattern ending in '*' whose prefix
-- starts the type (a reserved 'lanebus.' type only for a pattern that starts
-- with 'lanebus.' too: route.rs); a cataloged type's aliases match as its
-- type does (event_types.rs). Handlers with a payload filter are left to
-- publish.rs (insert_filtered.sql). ?1: JSON array of [event id,
-- deliver_at (µs) or null, aliases or null] for the new events in batch
-- order; ?2: due_at (µs) of those without.
INSERT INTO deliveries (lane, handler_id, event_id, key, seq, attempts, due_at, held)
SELECT e.lane, h.id, e.id, e.key, e.seq, 0, coalesce(json_extract(b.value, '$[1]'), ?2),
       CASE WHEN json_extract(b.value, '$[1]') IS NOT NULL THEN 1 END
FROM json_each(?1) AS b
JOIN events e ON e.id = json_extract(b.value, '$[0]')
JOIN handlers h ON h.filter IS NULL AND (EXISTS (
        SELECT 1 FROM json_each(h.event_types) AS p
        WHERE p.value = e.type
           OR (substr(p.value, -1) = '*'
               AND substr(e.type, 1, length(p.value) - 1) = substr(p.value, 1, length(p.value) - 1)
               AND (substr(e.type, 1, 8) <> 'lanebus.' OR substr(p.value, 1, 8) = 'lanebus.'))
    ) OR (json_type(b.value, '$[2]') = 'array' AND EXISTS (
        -- Aliases are never reserved types (rules.rs).
        SELECT 1 FROM json_each(h.event_types) AS p, json_each(b.value, '$[2]') AS a
        WHERE p.value = a.value
           OR (substr(p.value, -1) = '*'
               AND substr(a.value, 1, length(p.value) - 1) = substr(p.value, 1, length(p.value) - 1))
    )))
ORDER BY b.key, h.rowid
