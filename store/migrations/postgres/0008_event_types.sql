-- lanebus PostgreSQL schema, version 8: the event-type catalog
-- (store/src/event_types.rs). One row per type, keyed by its wire name.
-- event_type_names holds every wire name and alias once, so that a name is
-- never two types' (the store also checks it before writing). The catalog
-- row holds the version raised by every catalog change (the publish
-- statement compares it with the version its batch was checked against)
-- and the store-wide strict setting; catalog changes lock it, so they are
-- serialized.
CREATE TABLE IF NOT EXISTS event_types (
    name text PRIMARY KEY,
    description text NOT NULL,
    schema jsonb,
    aliases text[] NOT NULL,
    deprecated boolean NOT NULL,
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS event_type_names (
    name text PRIMARY KEY,
    wire text NOT NULL
);
CREATE TABLE IF NOT EXISTS catalog (
    id int PRIMARY KEY CHECK (id = 0),
    version bigint NOT NULL,
    strict boolean NOT NULL
);
INSERT INTO catalog (id, version, strict) VALUES (0, 0, false) ON CONFLICT (id) DO NOTHING;
