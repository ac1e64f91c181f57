-- lanebus SQLite schema, version 1. Times are INTEGER microseconds since the
-- Unix epoch. Applied inside a BEGIN IMMEDIATE transaction by the migrator.

-- Store-wide settings: schema_version, lanes (fixed at creation).
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

-- One row per lane: the fenced owner and its epoch.
CREATE TABLE IF NOT EXISTS lanes (
    lane  INTEGER PRIMARY KEY,
    owner TEXT,
    epoch INTEGER NOT NULL DEFAULT 0
);

-- Handler catalog; rowid order is creation order. event_types is a JSON array.
CREATE TABLE IF NOT EXISTS handlers (
    id            TEXT NOT NULL UNIQUE,
    name          TEXT NOT NULL,
    url           TEXT NOT NULL,
    event_types   TEXT NOT NULL,
    max_attempts  INTEGER NOT NULL,
    timeout_ms    INTEGER NOT NULL,
    max_in_flight INTEGER NOT NULL,
    secret        TEXT NOT NULL,
    state         TEXT NOT NULL,
    created_at    INTEGER NOT NULL
);

-- Per-key sequence counter: the last sequence number handed out.
CREATE TABLE IF NOT EXISTS key_seqs (
    key TEXT PRIMARY KEY,
    seq INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS events (
    id           TEXT PRIMARY KEY,
    type         TEXT NOT NULL,
    key          TEXT,
    lane         INTEGER NOT NULL,
    seq          INTEGER,
    payload      BLOB NOT NULL,
    published_at INTEGER NOT NULL
);

-- Pending deliveries. AUTOINCREMENT: ids are never reused, and because
-- SQLite has one writer at a time they are commit-ordered (the claim cursor).
CREATE TABLE IF NOT EXISTS deliveries (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    lane       INTEGER NOT NULL,
    handler_id TEXT NOT NULL,
    event_id   TEXT NOT NULL,
    key        TEXT,
    seq        INTEGER,
    attempts   INTEGER NOT NULL DEFAULT 0,
    due_at     INTEGER NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS deliveries_claim ON deliveries (lane, id);

-- Append-only completion log: no key, no foreign key.
CREATE TABLE IF NOT EXISTS completions (
    event_id     TEXT NOT NULL,
    handler_id   TEXT NOT NULL,
    attempts     INTEGER NOT NULL,
    completed_at INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS dead_letters (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    handler_id TEXT NOT NULL,
    event_id   TEXT NOT NULL,
    lane       INTEGER NOT NULL,
    key        TEXT,
    seq        INTEGER,
    attempts   INTEGER NOT NULL,
    last_error TEXT NOT NULL,
    failed_at  INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_handler ON dead_letters (handler_id, id);
