-- lanebus PostgreSQL schema, version 6: the claim cursor keeps the
-- transactions that were in progress when a claim took its snapshot and
-- reads their rows again by transaction id. A keyed delivery's xid may be
-- raised above its transaction's id (to the key's previous value, see
-- publish.sql); such a row records its transaction's id in txid (NULL when
-- xid is the transaction's id, the common case: no index entry, no WAL).
ALTER TABLE deliveries ADD COLUMN IF NOT EXISTS txid bigint;
CREATE INDEX IF NOT EXISTS deliveries_reopen ON deliveries (lane, txid) WHERE txid IS NOT NULL;
