-- lanebus PostgreSQL schema, version 1. Applied by the migrator inside one
-- transaction holding an advisory lock, so concurrent nodes are safe.
-- See store/src/postgres/mod.rs for why each table looks the way it does.

-- Store-wide settings: schema_version, lanes (fixed at creation).
CREATE TABLE IF NOT EXISTS meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);

-- One row per lane: the fenced owner and its epoch. Updated only by fence.
CREATE TABLE IF NOT EXISTS lanes (
    lane  int PRIMARY KEY,
    owner text,
    epoch bigint NOT NULL DEFAULT 0
) WITH (fillfactor = 50);

-- Handler catalog; pos is the creation order.
CREATE TABLE IF NOT EXISTS handlers (
    pos           bigint GENERATED ALWAYS AS IDENTITY,
    id            text PRIMARY KEY,
    name          text NOT NULL,
    url           text NOT NULL,
    event_types   text[] NOT NULL,
    max_attempts  int NOT NULL,
    timeout_ms    bigint NOT NULL,
    max_in_flight int NOT NULL,
    secret        text NOT NULL,
    state         text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

-- Per-key counter: the last sequence number handed out, and the cursor value
-- (xid) of the key's last deliveries, which keeps the claim order of a key's
-- deliveries equal to their sequence order (see postgres/mod.rs). Updated in
-- place (HOT: no indexed column changes) once per publishing transaction.
CREATE TABLE IF NOT EXISTS key_seqs (
    key text PRIMARY KEY,
    seq bigint NOT NULL,
    xid bigint NOT NULL DEFAULT 0
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.02);

CREATE TABLE IF NOT EXISTS events (
    id           text PRIMARY KEY,
    type         text NOT NULL,
    key          text,
    lane         int NOT NULL,
    seq          bigint,
    payload      bytea NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);

-- Pending deliveries: inserted at publish, deleted at completion or dead
-- letter; claims update nothing. xid is the commit-ordered claim cursor
-- (see postgres/mod.rs). Two indexes only: the primary key (complete,
-- reschedule, dead letter by id) and the claim index.
CREATE TABLE IF NOT EXISTS deliveries (
    id         bigserial PRIMARY KEY,
    xid        bigint NOT NULL DEFAULT (pg_current_xact_id()::text::bigint),
    lane       int NOT NULL,
    handler_id text NOT NULL,
    event_id   text NOT NULL,
    key        text,
    seq        bigint,
    attempts   int NOT NULL DEFAULT 0,
    due_at     timestamptz NOT NULL DEFAULT now(),
    last_error text
) WITH (autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.02);
CREATE INDEX IF NOT EXISTS deliveries_claim ON deliveries (lane, xid);

-- Append-only completion log: no primary key, no foreign key (each would
-- cost WAL per delivery, docs/design.md section 3); BRIN for retention by time.
CREATE TABLE IF NOT EXISTS completions (
    event_id     text NOT NULL,
    handler_id   text NOT NULL,
    attempts     int NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS completions_completed_at ON completions USING brin (completed_at);

CREATE TABLE IF NOT EXISTS dead_letters (
    id         bigserial PRIMARY KEY,
    handler_id text NOT NULL,
    event_id   text NOT NULL,
    lane       int NOT NULL,
    key        text,
    seq        bigint,
    attempts   int NOT NULL,
    last_error text NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS dead_letters_handler ON dead_letters (handler_id, id);
