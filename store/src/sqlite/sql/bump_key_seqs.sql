-- Raises each key's counter by the batch's count for it; ?1 is a JSON array
-- of [key, count]. Returns the new top per key: the batch's sequence numbers
-- for a key are top - count + 1 ..= top, in batch order. The write lock
-- (BEGIN IMMEDIATE) makes this race-free.
INSERT INTO key_seqs (key, seq)
SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?1) WHERE true
ON CONFLICT (key) DO UPDATE SET seq = key_seqs.seq + excluded.seq
RETURNING key, seq
