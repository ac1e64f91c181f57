-- The deliveries of handlers with a payload filter whose filter matched
-- (publish.rs), in batch order so that per (handler, key) the delivery ids
-- follow the sequence numbers. ?1: JSON array of [event id, handler id,
-- deliver_at (µs) or null]; ?2: due_at (µs) of those without.
INSERT INTO deliveries (lane, handler_id, event_id, key, seq, attempts, due_at, held)
SELECT e.lane, json_extract(b.value, '$[1]'), e.id, e.key, e.seq, 0,
       coalesce(json_extract(b.value, '$[2]'), ?2),
       CASE WHEN json_extract(b.value, '$[2]') IS NOT NULL THEN 1 END
FROM json_each(?1) AS b
JOIN events e ON e.id = json_extract(b.value, '$[0]')
ORDER BY b.key
