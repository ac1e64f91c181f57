// Peer driver for lanebus-bench: enqueue N jobs of about 200 bytes (100 per
// call), then, when the harness writes "GO" on stdin (after it has read its
// counters), drain them with a no-op handler and report.
//
//   node driver.mjs PEER DATABASE_URL JOBS
//
// PEER: graphile-best (graphile-worker 0.17 at its documented best for this
// machine: concurrency 24, local queue 500, completeJobBatchDelay 0),
// graphile-defaults (its defaults: concurrency 1, poll 2 s), pg-boss-best
// (pg-boss 10: 24 workers, batchSize 100, polling 0.5 s), pg-boss-defaults
// (one worker, batchSize 1, polling 2 s).
// First ONE_JOBS jobs are enqueued one per call by 8 concurrent callers, to
// a task/queue nobody works ("ONE <jobs> <seconds>"); then the drained jobs
// 100 per call ("ENQUEUED <jobs> <seconds>"), and after GO the drain
// ("DRAINED <jobs> <seconds>").
import { createInterface } from "node:readline";

const [peer, url, jobsArg] = process.argv.slice(2);
const jobs = Number(jobsArg);
const body = "x".repeat(160);
const payload = (i) => ({ i, body });
const lines = createInterface({ input: process.stdin });
const go = () => new Promise((resolve) => lines.once("line", resolve));
const now = () => Number(process.hrtime.bigint()) / 1e9;
const ONE_JOBS = 2000;
const ONE_CALLERS = 8;

// Enqueues ONE_JOBS jobs, one per call, from ONE_CALLERS concurrent callers.
async function enqueueOne(add) {
  const t = now();
  let next = 0;
  const caller = async () => {
    while (next < ONE_JOBS) {
      const i = next++;
      await add(i);
    }
  };
  await Promise.all(Array.from({ length: ONE_CALLERS }, caller));
  console.log(`ONE ${ONE_JOBS} ${now() - t}`);
}

async function graphile(best) {
  const { makeWorkerUtils, run } = await import("graphile-worker");
  const utils = await makeWorkerUtils({ connectionString: url });
  await utils.migrate();
  await enqueueOne((i) => utils.addJob("one", payload(i)));
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
  const settings = best
    ? {
        concurrency: 24,
        preset: { worker: { completeJobBatchDelay: 0, failJobBatchDelay: 0, localQueue: { size: 500 } } },
      }
    : {};
  const runner = await run({
    connectionString: url,
    noHandleSignals: true,
    logger: undefined,
    ...settings,
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

async function pgboss(best) {
  const { default: PgBoss } = await import("pg-boss");
  const boss = new PgBoss({ connectionString: url, supervise: false, schedule: false });
  boss.on("error", (e) => console.error(e));
  await boss.start();
  await boss.createQueue("noop");
  await boss.createQueue("one");
  await enqueueOne((i) => boss.send("one", payload(i)));
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
  const work = async (batch) => {
    done += batch.length;
    if (done >= jobs) finish();
  };
  // pg-boss runs one fetch loop per work() call: 24 calls, 24 workers.
  const workers = best ? 24 : 1;
  const options = best ? { batchSize: 100, pollingIntervalSeconds: 0.5 } : {};
  for (let w = 0; w < workers; w++) await boss.work("noop", options, work);
  await finished;
  const secs = now() - t;
  console.log(`DRAINED ${done} ${secs}`);
  await boss.stop({ graceful: false, wait: false });
}

try {
  if (peer === "graphile-best") await graphile(true);
  else if (peer === "graphile-defaults") await graphile(false);
  else if (peer === "pg-boss-best") await pgboss(true);
  else if (peer === "pg-boss-defaults") await pgboss(false);
  else throw new Error(`unknown peer ${peer}`);
  process.exit(0);
} catch (e) {
  console.error(e);
  process.exit(1);
}
