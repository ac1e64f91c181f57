// Drives headless Chromium (Debian's `chromium`) through the dashboard of a
// live cluster with playwright-core; node/tests/dashboard_browser.rs runs it
// and talks to it over stdin/stdout, one JSON object per line:
//
//   this script                                   the Rust test
//   ── {"step":"balanced", owners, ms, screenshot} ─▶  SIGKILLs the victim
//   ◀─ "killed\n" ──────────────────────────────────
//   ── {"step":"failover", owners, ms, screenshot} ─▶  checks, exits 0
//   (or {"step":"failed", error, screenshot} and exit 1)
//
// What it waits for is read from the page only (the `data-*` attributes
// documented in api/src/ui.rs): 256 `li#lane-N` cells, each with a live
// owner and state `active`, over the expected owners.
//
// usage: node dashboard.mjs URL OUT_DIR OWNERS_BEFORE OWNERS_AFTER BOUND_MS
//   e.g. node dashboard.mjs http://127.0.0.1:8080/ui/ /tmp/shots 1,2,3 1,2 4000
import { mkdtempSync, mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const CHROMIUM = process.env.LANEBUS_TEST_CHROMIUM || "/usr/bin/chromium";
const LANES = 256;
const FIRST_VIEW_MS = 60_000;

const [url, outDir, before, after, boundArg] = process.argv.slice(2);
if (!url || !outDir || !before || !after || !boundArg) {
  console.error("usage: node dashboard.mjs URL OUT_DIR OWNERS_BEFORE OWNERS_AFTER BOUND_MS");
  process.exit(2);
}
const ownersBefore = before.split(",");
const ownersAfter = after.split(",");
const boundMs = Number(boundArg);
mkdirSync(outDir, { recursive: true });

const say = (obj) => process.stdout.write(`${JSON.stringify(obj)}\n`);
const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

// Runs in the page: whether the grid shows every lane active, owned by
// exactly `owners`; and what it shows (for the failure message).
function laneView([lanes, owners]) {
  const cells = [...document.querySelectorAll("#lanes > li[id^='lane-']")];
  const counts = {};
  let inactive = 0;
  for (const c of cells) {
    const o = c.dataset.owner || "(none)";
    counts[o] = (counts[o] || 0) + 1;
    if (c.dataset.state !== "active") inactive++;
  }
  const seen = Object.keys(counts).sort();
  const ok =
    document.body.dataset.status === "ok" &&
    cells.length === lanes &&
    inactive === 0 &&
    seen.length === owners.length &&
    owners.every((o) => counts[o] > 0);
  return ok ? { counts } : null;
}

async function describe(page) {
  return page.evaluate(() => {
    const counts = {};
    const states = {};
    for (const c of document.querySelectorAll("#lanes > li")) {
      const o = c.dataset.owner || "(none)";
      counts[o] = (counts[o] || 0) + 1;
      states[c.dataset.state] = (states[c.dataset.state] || 0) + 1;
    }
    const nodes = [...document.querySelectorAll("tr[data-node]")].map(
      (tr) => `${tr.dataset.node}:${tr.dataset.alive === "true" ? "alive" : "down"}`,
    );
    return `status=${document.body.dataset.status} owners=${JSON.stringify(counts)} states=${JSON.stringify(states)} nodes=${nodes.join(",")}`;
  });
}

const profile = mkdtempSync(join(tmpdir(), "lanebus-chromium-"));
let context;
let page;
try {
  context = await chromium.launchPersistentContext(profile, {
    executablePath: CHROMIUM,
    headless: true,
    // Without the background-networking flags Chromium reaches for Google's
    // services, which this machine's closed network refuses.
    args: [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
    viewport: { width: 1280, height: 900 },
  });
  page = context.pages()[0] || (await context.newPage());
  page.on("pageerror", (e) => console.error(`page error: ${e.message}`));

  const t0 = Date.now();
  await page.goto(url);
  await page
    .waitForFunction(laneView, [LANES, ownersBefore], { timeout: FIRST_VIEW_MS, polling: 100 })
    .catch(async (e) => {
      throw new Error(
        `the page did not show ${LANES} active lanes over owners ${before} within ${FIRST_VIEW_MS} ms: ${await describe(page)} (${e.message.split("\n")[0]})`,
      );
    });
  // Every node row is alive.
  await page.waitForFunction(
    (ids) => ids.every((id) => document.querySelector(`tr[data-node="${id}"][data-alive="true"]`)),
    ownersBefore,
    { timeout: 10_000, polling: 100 },
  );
  const shotBefore = join(outDir, "dashboard-three-nodes.png");
  await page.screenshot({ path: shotBefore, fullPage: true });
  const balanced = await page.evaluate(laneView, [LANES, ownersBefore]);
  say({ step: "balanced", owners: balanced.counts, ms: Date.now() - t0, screenshot: shotBefore });

  const reply = await lines.next();
  if (reply.done || reply.value.trim() !== "killed") {
    throw new Error(`expected "killed" on stdin, got ${JSON.stringify(reply.value)}`);
  }
  const killedAt = Date.now();
  await page
    .waitForFunction(laneView, [LANES, ownersAfter], { timeout: boundMs, polling: 100 })
    .catch(async (e) => {
      throw new Error(
        `the page did not show every lane owned by ${after} within ${boundMs} ms of the kill: ${await describe(page)} (${e.message.split("\n")[0]})`,
      );
    });
  const moved = Date.now() - killedAt;
  const shotAfter = join(outDir, "dashboard-after-kill.png");
  await page.screenshot({ path: shotAfter, fullPage: true });
  const done = await page.evaluate(laneView, [LANES, ownersAfter]);
  const victims = ownersBefore.filter((o) => !ownersAfter.includes(o));
  const down = await page.evaluate(
    (ids) => ids.filter((id) => document.querySelector(`tr[data-node="${id}"][data-alive="false"]`)),
    victims,
  );
  say({ step: "failover", owners: done.counts, ms: moved, shown_down: down, screenshot: shotAfter });
} catch (e) {
  let shot = null;
  if (page) {
    shot = join(outDir, "dashboard-failure.png");
    await page.screenshot({ path: shot, fullPage: true }).catch(() => (shot = null));
  }
  say({ step: "failed", error: String(e && e.message ? e.message : e), screenshot: shot });
  process.exitCode = 1;
} finally {
  if (context) await context.close().catch(() => {});
  rmSync(profile, { recursive: true, force: true });
  process.stdin.destroy();
}
