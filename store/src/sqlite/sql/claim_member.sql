SELECT ? AS slot, * FROM (
    SELECT d.id, d.lane, d.handler_id, d.event_id, e.type, d.key, d.seq, d.attempts,
           d.due_at, d.last_error, e.payload, e.published_at, d.replay
    FROM deliveries d JOIN events e ON e.id = d.event_id
    WHERE d.lane = ? AND d.id > ?
    ORDER BY d.id
    LIMIT ?
)
