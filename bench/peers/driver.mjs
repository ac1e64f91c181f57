// Peer driver for lanebus-bench: enqueue N jobs of about 200 bytes (100 per
// call), then, when the harness writes "GO" on stdin (after it has read its
// counters), drain them with a no-op handler and report.
//
//   node driver.mjs PEER DATABASE_URL JOBS
//   node driver.mjs PEER DATABASE_URL 0 RATE     (mixed load)
//
// PEER: graphile-best (graphile-worker 0.17 at its documented best for this
// machine: concurrency 24, local queue 500, completeJobBatchDelay 0, a pool
// of 32),
// graphile-defaults (its defaults: concurrency 1, poll 2 s), pg-boss-best
// (pg-boss 10: 24 workers, batchSize 100, polling 0.5 s), pg-boss-defaults
// (one worker, batchSize 1, polling 2 s).
// First ONE_JOBS jobs are enqueued one per call by 8 concurrent callers, to
// a task/queue nobody works ("ONE <jobs> <seconds>"); then the drained jobs
// 100 per call ("ENQUEUED <jobs> <seconds>"), and after GO the drain
// ("DRAINED <jobs> <seconds>").
// With RATE, the mixed load of our `pg-mixed-*` cells instead: workers
// running (in a child process), 32 callers enqueue one job per call at
// RATE jobs/s in all (2 s warm-up, 8 s steady window), and each job's
// latency runs from its enqueue call's return to its handler's start. Prints
// "MIXED <jobs accepted in the window> <window seconds> <p50 ms> <p99 ms>
// <max ms> <jobs measured>" once every job enqueued has been handled (or
// 15 s after the window).
import { createInterface } from "node:readline";

const [peer, url, jobsArg, rateArg] = process.argv.slice(2);
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

const MIXED_CALLERS = 32;
const WARMUP_S = 2;
const STEADY_S = 8;
const sleep = (s) => new Promise((r) => setTimeout(r, Math.max(0, s * 1000)));
// Wall-clock seconds, comparable between the enqueuing and the working
// process (hrtime is per process).
const wall = () => (performance.timeOrigin + performance.now()) / 1000;

// The mixed load. The workers run in a child process (as an application's
// worker process would; one Node.js thread for both capped graphile-worker
// at about 700 jobs/s here): `startWorkers(handled)` runs there and returns
// a stop function; `handled(i)` marks job i as started. This process
// enqueues through `enqueuer.add(i)`.
async function mixed(rate, enqueuer, startWorkers) {
  if (process.argv[6] === "worker") {
    const seen = new Map();
    const stop = await startWorkers((i) => {
      if (!seen.has(i)) seen.set(i, wall());
    });
    process.send({ ready: true });
    const { stopAfter } = await new Promise((r) => process.once("message", r));
    const deadline = wall() + 15;
    while (seen.size < stopAfter && wall() < deadline) await sleep(0.05);
    await stop();
    process.send({ seen: [...seen] }, () => process.exit(0));
    return new Promise(() => {});
  }
  const { fork } = await import("node:child_process");
  const child = fork(new URL(import.meta.url).pathname, [...process.argv.slice(2, 6), "worker"], {
    stdio: ["ignore", "ignore", "inherit", "ipc"],
  });
  const message = () =>
    new Promise((resolve, reject) => {
      child.once("message", resolve);
      child.once("exit", (code) => reject(new Error(`worker process exited with ${code}`)));
    });
  await message();
  const committed = new Map();
  const t0 = wall();
  const steadyFrom = t0 + WARMUP_S;
  const steadyTo = steadyFrom + STEADY_S;
  const period = MIXED_CALLERS / rate;
  let next = 0;
  let inWindow = 0;
  const caller = async (c) => {
    // Ticks every `period` s, skipping ticks missed (as tokio's
    // MissedTickBehavior::Skip in our publishers).
    let tick = t0 + (c * period) / MIXED_CALLERS;
    while (wall() < steadyTo) {
      await sleep(tick - wall());
      const i = next++;
      await enqueuer.add(i);
      const t = wall();
      committed.set(i, t);
      if (t >= steadyFrom && t < steadyTo) inWindow += 1;
      tick += period;
      if (t > tick) tick += Math.ceil((t - tick) / period) * period;
    }
  };
  await Promise.all(Array.from({ length: MIXED_CALLERS }, (_, c) => caller(c)));
  const done = message();
  child.send({ stopAfter: committed.size });
  const seen = new Map((await done).seen);
  await enqueuer.close();
  const lat = [];
  for (const [i, c] of committed) {
    const h = seen.get(i);
    if (h !== undefined) lat.push(Math.max(0.001, (h - c) * 1000));
  }
  lat.sort((a, b) => a - b);
  const q = (p) => (lat.length ? lat[Math.min(lat.length - 1, Math.ceil(p * lat.length) - 1)] : NaN);
  console.log(`MIXED ${inWindow} ${STEADY_S} ${q(0.5)} ${q(0.99)} ${lat[lat.length - 1]} ${lat.length}`);
}

// graphile-worker's default logger prints a line per job on stdout; keep
// its warnings and errors only (on stderr), as a production deployment would.
async function graphileLogger() {
  const { Logger } = await import("graphile-worker");
  return new Logger(() => (level, message) => {
    if (level === "error" || level === "warning") console.error(message);
  });
}

const graphileSettings = (best) =>
  best
    ? {
        concurrency: 24,
        // Its warning asks for a pool at least as large as concurrency.
        maxPoolSize: 32,
        preset: { worker: { completeJobBatchDelay: 0, failJobBatchDelay: 0, localQueue: { size: 500 } } },
      }
    : {};

async function graphileMixed(best, rate) {
  const { makeWorkerUtils, run } = await import("graphile-worker");
  const utils = await makeWorkerUtils({ connectionString: url, maxPoolSize: MIXED_CALLERS });
  await utils.migrate();
  await mixed(
    rate,
    { add: (i) => utils.addJob("mixed", payload(i)), close: () => utils.release() },
    async (handled) => {
      const runner = await run({
        connectionString: url,
        noHandleSignals: true,
        logger: await graphileLogger(),
        ...graphileSettings(best),
        taskList: { mixed: async (p) => handled(p.i) },
      });
      return () => runner.stop();
    },
  );
}

async function pgbossMixed(best, rate) {
  const { default: PgBoss } = await import("pg-boss");
  const start = async () => {
    const boss = new PgBoss({ connectionString: url, supervise: false, schedule: false });
    boss.on("error", (e) => console.error(e));
    await boss.start();
    await boss.createQueue("mixed");
    return boss;
  };
  const boss = await start();
  await mixed(
    rate,
    { add: (i) => boss.send("mixed", payload(i)), close: () => boss.stop({ graceful: false, wait: false }) },
    async (handled) => {
      const worker = await start();
      const workers = best ? 24 : 1;
      const options = best ? { batchSize: 100, pollingIntervalSeconds: 0.5 } : {};
      const work = async (batch) => {
        for (const j of batch) handled(j.data.i);
      };
      for (let w = 0; w < workers; w++) await worker.work("mixed", options, work);
      return () => worker.stop({ graceful: false, wait: false });
    },
  );
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
  const settings = graphileSettings(best);
  const runner = await run({
    connectionString: url,
    noHandleSignals: true,
    logger: await graphileLogger(),
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
  const rate = Number(rateArg);
  if (rateArg && !(rate > 0)) throw new Error(`RATE must be a positive number, not ${rateArg}`);
  if (rateArg && peer.startsWith("graphile-")) await graphileMixed(peer === "graphile-best", rate);
  else if (rateArg && peer.startsWith("pg-boss-")) await pgbossMixed(peer === "pg-boss-best", rate);
  else if (peer === "graphile-best") await graphile(true);
  else if (peer === "graphile-defaults") await graphile(false);
  else if (peer === "pg-boss-best") await pgboss(true);
  else if (peer === "pg-boss-defaults") await pgboss(false);
  else throw new Error(`unknown peer ${peer}`);
  process.exit(0);
} catch (e) {
  console.error(e);
  process.exit(1);
}
