// Peer driver for lanebus-bench: enqueue N jobs of about 200 bytes (100 per
// call), then, when the harness writes "GO" on stdin (after it has read its
// counters), drain them with a no-op handler and report.
//
//   node driver.mjs PEER DATABASE_URL JOBS
//
// PEER: graphile-batched (graphile-worker 0.17, batched completion and a
// local queue), graphile (its defaults), pg-boss (pg-boss 10, batchSize 100).
// Output lines: "ENQUEUED <jobs> <seconds>", "DRAINED <jobs> <seconds>".
import { createInterface } from "node:readline";

const [peer, url, jobsArg] = process.argv.slice(2);
const jobs = Number(jobsArg);
const body = "x".repeat(160);
const payload = (i) => ({ i, body });
const lines = createInterface({ input: process.stdin });
const go = () => new Promise((resolve) => lines.once("line", resolve));
const now = () => Number(process.hrtime.bigint()) / 1e9;

async function graphile(batched) {
  const { makeWorkerUtils, run } = await import("graphile-worker");
  const utils = await makeWorkerUtils({ connectionString: url });
  await utils.migrate();
  let t = now();
  for (let i = 0; i < jobs; i += 100) {
    const spec = [];
    for (let j = i; j < Math.min(jobs, i + 100); j++) spec.push({ identifier: "noop", payload: payload(j) });
    await utils.addJobs(spec);
  }
  console.log(`ENQUEUED ${jobs} ${now() - t}`);
  await utils.release();
  await go();
  let done = 0;
  let finish;
  const finished = new Promise((r) => (finish = r));
  t = now();
  const preset = batched
    ? { worker: { completeJobBatchDelay: 0, failJobBatchDelay: 0, localQueue: { size: 500 } } }
    : undefined;
  const runner = await run({
    connectionString: url,
    concurrency: 10,
    noHandleSignals: true,
    pollInterval: 1000,
    logger: undefined,
    preset,
    taskList: {
      noop: async () => {
        done += 1;
        if (done === jobs) finish();
      },
    },
  });
  await finished;
  const secs = now() - t;
  await runner.stop();
  console.log(`DRAINED ${done} ${secs}`);
}

async function pgboss() {
  const { default: PgBoss } = await import("pg-boss");
  const boss = new PgBoss({ connectionString: url, supervise: false, schedule: false });
  boss.on("error", (e) => console.error(e));
  await boss.start();
  await boss.createQueue("noop");
  let t = now();
  for (let i = 0; i < jobs; i += 100) {
    const spec = [];
    for (let j = i; j < Math.min(jobs, i + 100); j++) spec.push({ name: "noop", data: payload(j) });
    await boss.insert(spec);
  }
  console.log(`ENQUEUED ${jobs} ${now() - t}`);
  await go();
  let done = 0;
  let finish;
  const finished = new Promise((r) => (finish = r));
  t = now();
  await boss.work("noop", { batchSize: 100, pollingIntervalSeconds: 0.5 }, async (batch) => {
    done += batch.length;
    if (done >= jobs) finish();
  });
  await finished;
  const secs = now() - t;
  console.log(`DRAINED ${done} ${secs}`);
  await boss.stop({ graceful: false, wait: false });
}

try {
  if (peer === "graphile-batched") await graphile(true);
  else if (peer === "graphile") await graphile(false);
  else if (peer === "pg-boss") await pgboss();
  else throw new Error(`unknown peer ${peer}`);
  process.exit(0);
} catch (e) {
  console.error(e);
  process.exit(1);
}
