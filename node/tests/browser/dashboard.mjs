// Drives headless Chromium (Debian's `chromium`) through the dashboard of a
// live cluster with playwright-core; node/tests/dashboard_browser.rs runs it
// and talks to it over stdin/stdout, one JSON object per line:
//
//   this script                                   the Rust test
//   ── {"step":"balanced", owners, ms, screenshot} ─▶  checks
//   ── {"step":"lookup", handlers, screenshot} ─────▶  checks the states
//   ── {"step":"handler", pages, plots, dead, ...} ─▶  checks, SIGKILLs the victim
//   ◀─ "killed\n" ──────────────────────────────────
//   ── {"step":"failover", owners, ms, screenshot} ─▶  checks, exits 0
//   (or {"step":"failed", error, screenshot} and exit 1)
//
// What it waits for is read from the page only (the `data-*` attributes
// documented in api/src/ui.rs): 256 `li#lane-N` cells, each with a live
// owner and state `active`, over the expected owners. Between the two lane
// views it looks EVENT up through the search box (until no handler's
// delivery is pending), opens HANDLER's page from the lookup (completed
// deliveries, two pages, the plots) and DEAD's dead letters.
//
// usage: node dashboard.mjs URL OUT_DIR OWNERS_BEFORE OWNERS_AFTER BOUND_MS EVENT HANDLER DEAD
//   e.g. node dashboard.mjs http://127.0.0.1:8080/ui/ /tmp/shots 1,2,3 1,2 4000 evt-1 hdl_... hdl_...
import { mkdtempSync, mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const CHROMIUM = process.env.LANEBUS_TEST_CHROMIUM || "/usr/bin/chromium";
const LANES = 256;
const FIRST_VIEW_MS = 60_000;

const SETTLE_MS = 60_000;
const PAGE = 50;

const [url, outDir, before, after, boundArg, eventId, handlerId, deadId] = process.argv.slice(2);
if (!url || !outDir || !before || !after || !boundArg || !eventId || !handlerId || !deadId) {
  console.error("usage: node dashboard.mjs URL OUT_DIR OWNERS_BEFORE OWNERS_AFTER BOUND_MS EVENT HANDLER DEAD");
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

// What the page shows now, for a failure message.
async function viewText(page) {
  return page.evaluate(() => {
    const view = document.body.dataset.view;
    const err = [...document.querySelectorAll(".error:not([hidden])")].map((e) => e.textContent).join("; ");
    return `view=${view} error=${err || "none"} rows=${document.querySelectorAll("tr[data-event-handler], tr[data-delivery]").length}`;
  });
}

async function waitFor(page, what, fn, arg, timeout) {
  await page.waitForFunction(fn, arg, { timeout, polling: 100 }).catch(async (e) => {
    throw new Error(`${what} within ${timeout} ms: ${await viewText(page)} (${e.message.split("\n")[0]})`);
  });
}

// The event's rows: handler, state, attempts and its attempt log's statuses
// (in the row after the delivery's).
function eventRows() {
  const logOf = (tr) => {
    const next = tr.nextElementSibling;
    return next && next.classList.contains("log-row") ? [...next.querySelectorAll(".attempt-log tbody tr")] : [];
  };
  return [...document.querySelectorAll("#event-handlers tr[data-event-handler]")].map((tr) => ({
    handler: tr.dataset.eventHandler,
    name: tr.querySelector("th").textContent,
    state: tr.dataset.state,
    attempts: Number(tr.dataset.attempts),
    log: logOf(tr).map((a) => Number(a.dataset.status) || a.children[2].textContent),
    bodies: logOf(tr).map((a) => a.querySelector(".body").textContent),
  }));
}

// Looks the event up with the search box, then refreshes until none of its
// deliveries is pending.
async function lookup(page) {
  await page.fill("#lookup", eventId);
  await page.press("#lookup", "Enter");
  const deadline = Date.now() + SETTLE_MS;
  for (;;) {
    await waitFor(page, `the event ${eventId}`, (id) => document.body.dataset.event === id, eventId, 10_000);
    const rows = await page.evaluate(eventRows);
    if (rows.length > 0 && rows.every((r) => r.state !== "pending")) break;
    if (Date.now() > deadline) throw new Error(`the event's deliveries did not settle: ${JSON.stringify(rows)}`);
    await page.evaluate(() => delete document.body.dataset.event);
    await page.waitForTimeout(500);
    await page.click("#event-refresh");
  }
  // Unfold the attempt logs for the screenshot.
  await page.evaluate(() => document.querySelectorAll("#event-handlers .log-toggle").forEach((b) => b.click()));
  const shot = join(outDir, "dashboard-event.png");
  await page.screenshot({ path: shot, fullPage: true });
  return { handlers: await page.evaluate(eventRows), screenshot: shot };
}

function plots() {
  const out = {};
  for (const f of document.querySelectorAll("#plots figure[data-plot]")) {
    out[f.dataset.plot] = { points: Number(f.dataset.points), nonzero: Number(f.dataset.nonzero), max: Number(f.dataset.max), paths: f.querySelectorAll("path, circle").length };
  }
  return out;
}

// From the lookup to HANDLER's page: completed deliveries, a page, the next
// page, the plots; then DEAD's dead letters with their attempt logs.
async function handlerPage(page) {
  await page.click(`#event-handlers tr[data-event-handler="${handlerId}"] th a`);
  await waitFor(page, "the handler's page", () => document.body.dataset.view === "handler", null, 10_000);
  await page.click('#delivery-tabs button[data-state="completed"]');
  await waitFor(page, "the completed deliveries", () => document.querySelector("#deliveries").dataset.loaded === "completed:0", null, 10_000);
  // Until a whole page has completed (the events were published just now).
  const deadline = Date.now() + SETTLE_MS;
  while ((await page.$$("#deliveries tr[data-delivery]")).length < PAGE && Date.now() < deadline) {
    await page.waitForTimeout(500);
    await page.evaluate(() => delete document.querySelector("#deliveries").dataset.loaded);
    await page.click("#deliveries-refresh");
    await waitFor(page, "the completed deliveries", () => document.querySelector("#deliveries").dataset.loaded === "completed:0", null, 10_000);
  }
  const first = await page.$$eval("#deliveries tr[data-delivery]", (rs) => rs.map((r) => [r.dataset.delivery, r.dataset.state]));
  // The plots: the deliveries plot with a value above 0 (they refresh every 10 s).
  await waitFor(
    page,
    "a deliveries plot with a point above 0",
    () => Number(document.querySelector('#plots figure[data-plot="deliveries"]')?.dataset.nonzero) > 0,
    null,
    30_000,
  );
  // The top of the page: the plots and the first deliveries.
  const shot = join(outDir, "dashboard-handler.png");
  await page.screenshot({ path: shot });
  const shownPlots = await page.evaluate(plots);
  let second = [];
  if (await page.isEnabled("#page-older")) {
    await page.click("#page-older");
    await waitFor(page, "the second page", () => document.querySelector("#deliveries").dataset.loaded === "completed:1", null, 10_000);
    second = await page.$$eval("#deliveries tr[data-delivery]", (rs) => rs.map((r) => r.dataset.delivery));
  }
  await page.evaluate((id) => (location.hash = `#handler=${encodeURIComponent(id)}&state=dead`), deadId);
  await waitFor(page, "the dead letters", () => document.querySelector("#deliveries").dataset.loaded === "dead:0", null, 10_000);
  const dead = await page.$$eval("#deliveries tr[data-delivery]", (rs) =>
    rs.map((r) => ({
      event: r.dataset.delivery,
      state: r.dataset.state,
      attempts: Number(r.dataset.attempts),
      log: r.nextElementSibling?.classList.contains("log-row")
        ? [...r.nextElementSibling.querySelectorAll(".attempt-log tbody tr")].map((a) => Number(a.dataset.status))
        : [],
    })),
  );
  return { first, second, plots: shownPlots, dead, page: PAGE, screenshot: shot };
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

  say({ step: "lookup", ...(await lookup(page)) });
  say({ step: "handler", ...(await handlerPage(page)) });
  // Back to the lanes.
  await page.evaluate(() => (location.hash = ""));
  await waitFor(page, "the overview", () => document.body.dataset.view === "overview", null, 10_000);

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
