-- lanebus SQLite schema, version 7: the event-type catalog
-- (store/src/event_types.rs). One row per type, keyed by its wire name;
-- aliases as a JSON array of strings; schema as JSON text (NULL: none).
-- event_type_names holds every wire name and alias once, so that a name is
-- never two types' (the store also checks it before writing). The catalog
-- row holds the version raised by every catalog change (a publish compares
-- it with its cached catalog inside its write transaction) and the
-- store-wide strict setting.
CREATE TABLE event_types (
    name TEXT PRIMARY KEY,
    description TEXT NOT NULL,
    schema TEXT,
    aliases TEXT NOT NULL,
    deprecated INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE event_type_names (
    name TEXT PRIMARY KEY,
    wire TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE catalog (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    version INTEGER NOT NULL,
    strict INTEGER NOT NULL
);
INSERT INTO catalog (id, version, strict) VALUES (0, 0, 0);
