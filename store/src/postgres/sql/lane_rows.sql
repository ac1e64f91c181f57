SELECT l.lane, l.owner, l.epoch, coalesce(b.n, 0) AS backlog
FROM lanes l
LEFT JOIN (SELECT lane, count(*) AS n FROM deliveries GROUP BY lane) b ON b.lane = l.lane
ORDER BY l.lane
