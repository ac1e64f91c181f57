-- Bulk reschedule of fenced deliveries (a HOT update: no indexed column changes).
--   $1 ids bigint[], $2 lanes int[], $3 epochs bigint[], $4 attempts int[],
--   $5 due_at timestamptz[], $6 last_error text[]
UPDATE deliveries d
SET attempts = x.attempts, due_at = x.due_at, last_error = x.last_error
FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::int[], $5::timestamptz[], $6::text[])
         AS x (id, lane, epoch, attempts, due_at, last_error),
     lanes l
WHERE d.id = x.id AND d.lane = x.lane AND l.lane = x.lane AND l.epoch = x.epoch
RETURNING d.id
