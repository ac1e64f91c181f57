-- lanebus SQLite schema: subjects' data keys (store/src/personal.rs), one
-- row per subject, wrapped (AES-256-GCM, nonce || ciphertext || tag) by the
-- master key whose id is key_id. Deleting a row destroys the subject's key
-- (crypto-shredding). The master key is never stored.
CREATE TABLE subject_keys (
    subject TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    wrapped BLOB NOT NULL,
    created_at INTEGER NOT NULL
) WITHOUT ROWID;
