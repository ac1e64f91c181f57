-- pgbench floor: one single-row insert transaction (autocommit, 200-byte payload).
INSERT INTO floor_rows (payload) VALUES (repeat('x', 200));
