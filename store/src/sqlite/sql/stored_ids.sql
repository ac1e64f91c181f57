-- Which of the batch's client-supplied ids (?1, a JSON array) are stored.
SELECT id FROM events WHERE id IN (SELECT value FROM json_each(?1))
