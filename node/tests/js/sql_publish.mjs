// Publishes with lanebus.publish() from Node.js (npm `pg`), inside the
// application's own transactions, as node/tests/sql_publish.rs drives it.
//
// Usage: node sql_publish.mjs URL KEY COUNT TAG
//
// Transaction i inserts the application's row app_orders(TAG-i) and
// publishes event type TAG.order on KEY in the same transaction; every third
// one is rolled back, the others committed and followed by lanebus.wake().
// Prints one JSON line per transaction: {"id": event id, "committed": bool}.
import pg from "pg";

const [url, key, count, tag] = process.argv.slice(2);
const client = new pg.Client({ connectionString: url });
await client.connect();
try {
  for (let i = 0; i < Number(count); i++) {
    const commit = i % 3 !== 2;
    await client.query("BEGIN");
    await client.query("INSERT INTO app_orders (id, source) VALUES ($1, $2)", [`${tag}-${i}`, tag]);
    const { rows } = await client.query("SELECT lanebus.publish($1, $2, $3::jsonb) AS id", [
      `${tag}.order`,
      key,
      JSON.stringify({ n: i, from: tag }),
    ]);
    await client.query(commit ? "COMMIT" : "ROLLBACK");
    if (commit) {
      await client.query("SELECT lanebus.wake()");
    }
    console.log(JSON.stringify({ id: rows[0].id, committed: commit }));
  }
} finally {
  await client.end();
}
