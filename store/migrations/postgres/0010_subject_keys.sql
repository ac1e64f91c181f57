-- lanebus PostgreSQL schema: subjects' data keys (store/src/personal.rs),
-- one row per subject, wrapped (AES-256-GCM, nonce || ciphertext || tag) by
-- the master key whose id is key_id. Deleting a row destroys the subject's
-- key (crypto-shredding). The master key is never stored.
CREATE TABLE IF NOT EXISTS subject_keys (
    subject text PRIMARY KEY,
    key_id text NOT NULL,
    wrapped bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
