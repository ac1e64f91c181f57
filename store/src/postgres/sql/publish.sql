-- One publish, one statement (docs/design.md section 3: one statement per
-- publish). Parameters, one array element per event not repeated within the
-- batch, in batch order:
--   $1 ids text[], $2 types text[], $3 keys text[] (NULL = unkeyed),
--   $4 lanes int[], $5 payloads bytea[], $6 client-supplied id? bool[],
--   $7 deliver_at timestamptz[] (NULL = at once: the deliveries' first due_at)
--   $8 notify bool: send the wake-up (false inside a caller's transaction,
--      whose commit must not take the NOTIFY lock; see PgStore::wake_after_commit)
--   $9 seqs bool: return the sequence numbers (for the caller to check
--      expected sequences before it commits; publish.rs)
--   $10 catalog bigint: the catalog version the batch was checked against
--      (store/src/event_types.rs); when the stored one differs, nothing is
--      written (the caller checks again and reruns); NULL: no check
--   $11 aliases text[]: per event, its cataloged type's aliases joined by
--      ' ' (NULL: none), which routes match as they match the type
-- Returns accepted (new events), deliveries (rows created), notified,
-- stored: the client-supplied ids found already stored (NULL when none),
-- seqs: with $9, each written event's sequence number (NULL unkeyed),
-- in batch order (NULL without $9 or when nothing was written),
-- lanes: the lanes that got deliveries (NULL when none), for a wake-up
-- sent by the caller instead of the NOTIFY, and catalog: the stored catalog
-- version (when it is not $10, nothing was written).
WITH input AS (
    -- Ids already stored are duplicates. Only client-supplied ids are looked
    -- up (generated UUIDv7s are new). A concurrent publisher of the same id
    -- makes the events insert fail with a unique violation; the caller
    -- retries the whole statement, which then sees the stored row.
    SELECT i.*
    FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::bytea[], $6::bool[], $7::timestamptz[], $11::text[])
         WITH ORDINALITY AS i (id, type, key, lane, payload, client, deliver_at, aliases, ord)
    WHERE NOT (i.client AND EXISTS (SELECT 1 FROM events x WHERE x.id = i.id))
      AND ($10::bigint IS NULL OR $10::bigint = (SELECT c.version FROM catalog c WHERE c.id = 0))
),
ks AS (
    -- Raise each key's counter by its count in the batch, locking the key
    -- rows in key order (no deadlock between publishers). A rollback gives
    -- the numbers back. xid: the key's cursor value, never lower than a
    -- previous transaction's for the same key (claim order = seq order).
    INSERT INTO key_seqs AS k (key, seq, xid)
    SELECT key, count(*), pg_current_xact_id()::text::bigint
    FROM input
    WHERE key IS NOT NULL
    GROUP BY key
    ORDER BY key
    ON CONFLICT (key) DO UPDATE SET seq = k.seq + excluded.seq, xid = greatest(k.xid, excluded.xid)
    RETURNING k.key, k.seq, k.xid
),
numbered AS (
    -- The batch's numbers for a key are seq - count + 1 ..= seq, in batch
    -- order: counted back from the key's last event in the batch, which
    -- takes the counter's new value (one window, one sort).
    SELECT i.id, i.type, i.key, i.lane, i.payload, i.deliver_at, i.aliases, i.ord, ks.xid,
           ks.seq + 1 - row_number() OVER (PARTITION BY i.key ORDER BY i.ord DESC) AS seq
    FROM input i
    LEFT JOIN ks ON ks.key = i.key
),
ev AS (
    INSERT INTO events (id, type, key, lane, seq, payload)
    SELECT id, type, key, lane, seq, payload
    FROM numbered
    ORDER BY id
    RETURNING 1
),
routed AS (
    -- One row per event and handler whose route matches: the exact type, or
    -- a pattern ending in '*' whose prefix starts the type (a reserved
    -- 'lanebus.' type only for a pattern starting with 'lanebus.' too:
    -- route.rs). Disabled handlers count too (their deliveries are kept
    -- until they are enabled). Matched here so handlers registered by other
    -- nodes count without a cache. Read from numbered, not from ev's rows:
    -- every numbered row is inserted (or the statement fails). No payload
    -- here: a pair's row stays small.
    SELECT n.id, n.key, n.lane, n.seq, n.deliver_at, n.xid, n.ord, h.id AS handler_id, h.pos, h.filter
    FROM numbered n
    JOIN handlers h
      ON EXISTS (
            SELECT 1 FROM unnest(h.event_types) AS p
            WHERE p = n.type
               OR (right(p, 1) = '*' AND starts_with(n.type, left(p, -1))
                   AND (NOT starts_with(n.type, 'lanebus.') OR starts_with(p, 'lanebus.')))
         )
      -- A cataloged type's aliases (never reserved) match as the type does.
      OR (n.aliases IS NOT NULL AND EXISTS (
            SELECT 1 FROM unnest(h.event_types) AS p, unnest(string_to_array(n.aliases, ' ')) AS a
            WHERE p = a OR (right(p, 1) = '*' AND starts_with(a, left(p, -1)))
         ))
),
docs AS MATERIALIZED (
    -- The payload parsed for filters (lanebus.filter_doc, functions.sql),
    -- once per event that a routed handler with a filter awaits: no other
    -- event's payload is parsed, and no filter runs for an unrouted handler.
    SELECT n.ord, lanebus.filter_doc(n.payload) AS doc
    FROM numbered n
    WHERE n.ord IN (SELECT r.ord FROM routed r WHERE r.filter IS NOT NULL)
),
dl AS (
    -- One delivery per routed handler, and for a handler with a payload
    -- filter only when the payload matches it (a payload it cannot parse
    -- matches no filter); one without costs the IS NULL test. Inserted in
    -- sequence order so a key's delivery ids follow its sequence numbers. A
    -- delayed event's deliveries are due at its deliver_at (and held: see
    -- complete.sql); the lane owner keeps a keyed one at the head of its
    -- key until then. txid: this transaction's id where the key raised xid
    -- above it (the claim reads a transaction that was in progress by
    -- either; 0006).
    INSERT INTO deliveries (xid, txid, lane, handler_id, event_id, key, seq, due_at, held)
    SELECT coalesce(r.xid, pg_current_xact_id()::text::bigint),
           CASE WHEN r.xid > pg_current_xact_id()::text::bigint THEN pg_current_xact_id()::text::bigint END,
           r.lane, r.handler_id, r.id, r.key, r.seq,
           coalesce(r.deliver_at, now()), CASE WHEN r.deliver_at IS NOT NULL THEN true END
    FROM routed r
    LEFT JOIN docs d ON r.filter IS NOT NULL AND d.ord = r.ord
    WHERE r.filter IS NULL OR lanebus.filter_matches(r.filter, d.doc)
    ORDER BY r.seq, r.id, r.pos
    RETURNING lane
)
SELECT
    (SELECT count(*) FROM ev) AS accepted,
    (SELECT count(*) FROM dl) AS deliveries,
    -- One wake-up per transaction at most (and none when nothing is to
    -- deliver), naming the lanes that got deliveries ("3,17"), so that
    -- listeners claim those lanes only (store/src/wake.rs); past 512 lanes
    -- it names none, which wakes every lane (a payload stays far below
    -- NOTIFY's 8,000 bytes).
    (SELECT count(*) FROM (
        SELECT pg_notify('lanebus', CASE WHEN count(DISTINCT lane) <= 512
                                         THEN string_agg(DISTINCT lane::text, ',') ELSE '' END)
        FROM dl HAVING count(*) > 0 AND $8) AS n) AS notified,
    (SELECT array_agg(x.id)
     FROM unnest($1::text[], $6::bool[]) AS x (id, client)
     WHERE x.client AND NOT EXISTS (SELECT 1 FROM input i WHERE i.id = x.id)) AS stored,
    (SELECT array_agg(n.seq ORDER BY n.ord) FROM numbered n WHERE $9) AS seqs,
    (SELECT array_agg(DISTINCT lane::int) FROM dl) AS lanes,
    (SELECT c.version FROM catalog c WHERE c.id = 0) AS catalog
