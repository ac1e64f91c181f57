// lanebus dashboard: polls the node's admin paths every second and draws the
// lanes, nodes and handlers; `#event=ID` shows an event's deliveries per
// handler, `#handler=ID&state=S` a handler's deliveries (paged) and plots of
// its last 15 minutes on this node (inline SVG). Vanilla JavaScript, no
// dependencies, nothing fetched but this node's own paths (relative, so a
// path prefix works).
// Untrusted strings go through textContent and attributes only.
// On a node that requires tokens, an answer 401/403 shows a token field; the
// token is kept in sessionStorage (this tab only) and sent as
// `authorization: Bearer TOKEN`.
"use strict";

(() => {
  const POLL_MS = 1000;
  const TIMEOUT_MS = 5000;
  const CATALOG_MS = 10000;

  const $ = (id) => document.getElementById(id);
  const lanesEl = $("lanes");
  let cells = [];
  let lanes = [];
  let selected = null; // lane number shown in the detail line
  let timer = null;

  // A stable colour per node id, distinct within the cluster: FNV-1a of the
  // id picks a slot in a palette of ten colours (each at least 3:1 against
  // the white page); ids sorted, a taken slot moves to the next free one. So
  // an id keeps its colour unless another id wants the same slot, and two
  // nodes never share a colour while there are at most ten.
  const PALETTE = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b",
    "#b8467f", "#0f8a99", "#8c8c00", "#c85f00", "#222222",
  ];
  let colours = new Map();
  let colourKey = "";

  function fnv(id) {
    let h = 0x811c9dc5;
    for (let i = 0; i < id.length; i++) {
      h ^= id.charCodeAt(i);
      h = Math.imul(h, 0x01000193) >>> 0;
    }
    return h;
  }

  function assignColours(ids) {
    const sorted = [...new Set(ids)].sort();
    const key = sorted.join("\n");
    if (key === colourKey) return;
    colourKey = key;
    colours = new Map();
    const used = new Set();
    for (const id of sorted) {
      if (used.size >= PALETTE.length) {
        colours.set(id, `hsl(${fnv(id) % 360} 70% 35%)`);
        continue;
      }
      let slot = fnv(id) % PALETTE.length;
      while (used.has(slot)) slot = (slot + 1) % PALETTE.length;
      used.add(slot);
      colours.set(id, PALETTE[slot]);
    }
  }

  function colourOf(id) {
    return colours.get(id) || `hsl(${fnv(id) % 360} 70% 35%)`;
  }

  function el(tag, text, attrs) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }

  function swatch(owner) {
    const s = el("span", null, { class: owner ? "swatch" : "swatch none", "aria-hidden": "true" });
    if (owner) s.style.setProperty("background", colourOf(owner));
    return s;
  }

  const TOKEN_KEY = "lanebus.token";
  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY) || "";
    } catch (_) {
      return "";
    }
  }

  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    try {
      sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    } catch (_) {
      // No storage: the token is not kept.
    }
    $("token").value = "";
    // Poll now unless a poll is under way (it reads the token at its next turn).
    if (timer !== null) {
      clearTimeout(timer);
      poll();
    }
  });

  async function get(path) {
    const ctl = new AbortController();
    const t = setTimeout(() => ctl.abort(), TIMEOUT_MS);
    try {
      const headers = { accept: "application/json" };
      if (token()) headers.authorization = `Bearer ${token()}`;
      const res = await fetch(path, { cache: "no-store", headers, signal: ctl.signal });
      const body = await res.json().catch(() => null);
      if (res.status === 401 || res.status === 403) $("token-form").hidden = false;
      if (!res.ok) {
        const e = body && body.error;
        throw new Error(`${path.replace("../", "/")}: ${res.status}${e ? ` ${e.code}: ${e.message}` : ""}`);
      }
      return body;
    } finally {
      clearTimeout(t);
    }
  }

  // "0–85, 170–171" for a sorted list of lane numbers.
  function ranges(nums) {
    const out = [];
    for (let i = 0; i < nums.length; ) {
      let j = i;
      while (j + 1 < nums.length && nums[j + 1] === nums[j] + 1) j++;
      out.push(i === j ? `${nums[i]}` : `${nums[i]}–${nums[j]}`);
      i = j + 1;
    }
    return out.join(", ");
  }

  function describe(l) {
    const owner = l.owner ? `owner ${l.owner}` : "unassigned";
    const lease = l.lease_expires_in_ms == null ? "" : `, lease ${l.lease_expires_in_ms} ms`;
    return `lane ${l.lane}: ${owner}, epoch ${l.epoch}, ${l.state}, backlog ${l.backlog}, in flight ${l.in_flight}${lease}`;
  }

  function showDetail() {
    const l = lanes.find((x) => x.lane === selected);
    $("lane-detail").textContent = l ? describe(l) : "No lane selected.";
    cells.forEach((c) => c.classList.toggle("selected", Number(c.dataset.lane) === selected));
  }

  function select(lane) {
    selected = lane;
    showDetail();
  }

  function buildCells(n) {
    lanesEl.replaceChildren();
    cells = [];
    for (let i = 0; i < n; i++) {
      const li = el("li", null, { id: `lane-${i}`, "data-lane": String(i), tabindex: i === 0 ? "0" : "-1" });
      cells.push(li);
    }
    lanesEl.append(...cells);
  }

  function columns() {
    return getComputedStyle(lanesEl).gridTemplateColumns.split(" ").filter(Boolean).length || 1;
  }

  // One tab stop for the grid; arrow keys, Home and End move within it.
  lanesEl.addEventListener("keydown", (ev) => {
    const cur = cells.indexOf(document.activeElement);
    if (cur < 0) return;
    const step = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: columns(), ArrowUp: -columns() }[ev.key];
    let next = step === undefined ? null : cur + step;
    if (ev.key === "Home") next = 0;
    if (ev.key === "End") next = cells.length - 1;
    if (next === null || next < 0 || next >= cells.length) return;
    ev.preventDefault();
    cells[cur].tabIndex = -1;
    cells[next].tabIndex = 0;
    cells[next].focus();
  });
  lanesEl.addEventListener("focusin", (ev) => {
    if (ev.target.dataset.lane !== undefined) select(Number(ev.target.dataset.lane));
  });
  lanesEl.addEventListener("mouseover", (ev) => {
    if (ev.target.dataset && ev.target.dataset.lane !== undefined) select(Number(ev.target.dataset.lane));
  });

  function highlight(owner) {
    lanesEl.classList.toggle("highlighting", owner !== null);
    cells.forEach((c) => c.classList.toggle("highlight", owner !== null && c.dataset.owner === owner));
  }

  function renderLanes(list) {
    lanes = list;
    if (cells.length !== list.length) buildCells(list.length);
    $("lane-total").textContent = `(${list.length})`;
    const byOwner = new Map();
    list.forEach((l, i) => {
      const c = cells[i];
      const owner = l.owner || "";
      c.dataset.lane = String(l.lane);
      c.dataset.owner = owner;
      c.dataset.state = l.state;
      c.dataset.epoch = String(l.epoch);
      c.dataset.backlog = String(l.backlog);
      c.dataset.inFlight = String(l.in_flight);
      c.dataset.hasBacklog = String(l.backlog > 0);
      const text = describe(l);
      c.title = text;
      c.setAttribute("aria-label", text);
      if (owner) c.style.setProperty("background", colourOf(owner));
      else c.style.removeProperty("background");
      if (!byOwner.has(owner)) byOwner.set(owner, []);
      byOwner.get(owner).push(l.lane);
    });
    const legend = $("legend");
    legend.replaceChildren();
    const owners = [...byOwner.keys()].sort((a, b) => (a === "" ? 1 : b === "" ? -1 : a.localeCompare(b)));
    for (const owner of owners) {
      const nums = byOwner.get(owner);
      const li = el("li", null, { "data-owner": owner });
      const b = el("button", null, { type: "button", "aria-label": `${owner || "unassigned"}: ${nums.length} lanes, show them` });
      const label = el("span");
      const all = ranges(nums);
      const parts = all.split(", ");
      const shown = parts.length > 8 ? `${parts.slice(0, 8).join(", ")}, … (${parts.length} ranges)` : all;
      const rangeEl = el("span", shown, { class: "ranges", title: all });
      label.append(el("strong", owner || "unassigned"), ` · ${nums.length} ${nums.length === 1 ? "lane" : "lanes"}`, rangeEl);
      b.append(swatch(owner), label);
      const on = () => highlight(owner);
      const off = () => highlight(null);
      b.addEventListener("mouseenter", on);
      b.addEventListener("focus", on);
      b.addEventListener("mouseleave", off);
      b.addEventListener("blur", off);
      li.append(b);
      legend.append(li);
    }
    showDetail();
  }

  function renderCluster(c) {
    const meta = [`answered by ${c.node_id}`, c.leader ? `leader ${c.leader}` : "no leader (election)", `term ${c.term}`];
    $("cluster-meta").textContent = meta.join(" · ");
    const body = $("nodes").tBodies[0];
    body.replaceChildren();
    const nodes = [...c.nodes].sort((a, b) => a.id.localeCompare(b.id));
    for (const n of nodes) {
      const leader = n.id === c.leader;
      const tr = el("tr", null, {
        "data-node": n.id,
        "data-alive": String(n.alive),
        "data-leader": String(leader),
        "data-lanes": String(n.lanes),
      });
      const name = el("th", null, { scope: "row" });
      name.append(swatch(n.id), " ", el("span", n.id, { class: "mono" }));
      if (leader) name.append(el("span", "leader", { class: "badge" }));
      if (n.id === c.node_id) name.append(el("span", "this node", { class: "badge" }));
      tr.append(
        name,
        el("td", n.voter ? "voter" : "learner"),
        el("td", n.alive ? "alive" : "down", { class: n.alive ? "alive" : "down" }),
        el("td", n.lanes, { class: "num" }),
      );
      const http = el("td", null, { class: "mono" });
      if (n.http_addr) {
        const a = el("a", n.http_addr, { href: `http://${n.http_addr}/ui/` });
        http.append(a);
      } else http.textContent = "–";
      tr.append(http, el("td", n.raft_addr || "–", { class: "mono" }));
      body.append(tr);
    }
  }

  // "disabled (gone)", "enabled, failing since 12:00:00", "enabled, 5/s".
  function handlerState(x) {
    let s = x.state;
    if (x.state === "disabled" && x.state_reason) s += ` (${x.state_reason})`;
    if (x.failing_since) s += `, failing since ${new Date(x.failing_since).toLocaleTimeString()}`;
    if (x.rate_limit) s += `, ${x.rate_limit.per_second}/s`;
    return s;
  }

  // A payload filter on one line, "/total ≥ 100 and /cc in ["DE"]"; "–"
  // when the handler has none (it gets every event its routes match).
  const FILTER_OPS = { equals: "=", in: "in", gt: ">", gte: "≥", lt: "<", lte: "≤" };
  function filterText(f) {
    if (f == null) return "–";
    const group = (xs, op) => xs.map((x) => (x.and || x.or ? `(${filterText(x)})` : filterText(x))).join(` ${op} `);
    if (f.and) return group(f.and, "and");
    if (f.or) return group(f.or, "or");
    if (f.not) return `not (${filterText(f.not)})`;
    const op = Object.keys(f).find((k) => k !== "path");
    if (op === "exists") return `${f.path} ${f.exists ? "exists" : "missing"}`;
    return `${f.path} ${FILTER_OPS[op] || op} ${JSON.stringify(f[op])}`;
  }

  function renderHandlers(h) {
    handlers = new Map(h.handlers.map((x) => [x.id, x]));
    if (view.name === "handler") renderHandlerMeta();
    const body = $("handlers").tBodies[0];
    body.replaceChildren();
    $("handlers-empty").hidden = h.handlers.length > 0;
    for (const x of h.handlers) {
      const tr = el("tr", null, {
        "data-handler": x.id,
        "data-state": x.state,
        "data-dead-letters": String(x.dead_letters),
        "data-filter": x.filter == null ? "" : JSON.stringify(x.filter),
      });
      const count = `${h.dead_letters_exact ? "" : "≥"}${x.dead_letters}`;
      const dl = el("td", null, { class: x.dead_letters > 0 ? "num has-dead" : "num" });
      if (x.dead_letters > 0) {
        dl.append(el("a", count, { href: `../admin/dead-letters?handler_id=${encodeURIComponent(x.id)}` }));
      } else dl.textContent = count;
      tr.append(
        cellLink("th", x.name, `#handler=${encodeURIComponent(x.id)}`, { scope: "row" }),
        el("td", x.id, { class: "mono" }),
        el("td", handlerState(x), { class: x.state === "enabled" ? "" : "disabled" }),
        el("td", x.event_types.join(", "), { class: "mono" }),
        el("td", filterText(x.filter), { class: "mono" }),
        dl,
      );
      body.append(tr);
    }
  }

  // Whether a schema marks a personal field: marks count only on
  // properties reached from the root through `properties` (the catalog
  // refuses them elsewhere), so a subject named without marks is not one.
  function marksPersonal(schema) {
    const props = schema && typeof schema === "object" ? schema.properties : null;
    if (!props || typeof props !== "object") return false;
    return Object.values(props).some(
      (p) => p && typeof p === "object" && (p["x-lanebus-personal"] === true || marksPersonal(p)),
    );
  }

  // The event-type catalog: wire names, aliases, schema, personal fields.
  function renderEventTypes(types) {
    const body = $("event-types").tBodies[0];
    body.replaceChildren();
    $("event-types-empty").hidden = types.length > 0;
    for (const t of types) {
      const notes = [
        t.schema ? "schema" : "no schema",
        t.schema && marksPersonal(t.schema) ? "personal fields" : "",
        t.deprecated ? "deprecated" : "",
      ];
      const tr = el("tr", null, { "data-event-type": t.name, "data-deprecated": String(t.deprecated) });
      tr.append(
        el("th", t.name, { scope: "row", class: "mono" }),
        el("td", t.aliases.length ? t.aliases.join(", ") : "–", { class: "mono" }),
        el("td", notes.filter(Boolean).join(" · ")),
        el("td", t.description || ""),
      );
      body.append(tr);
    }
  }

  // The catalog changes rarely: read every CATALOG_MS, not every poll.
  let catalogAt = 0;
  async function pollCatalog() {
    if (Date.now() - catalogAt < CATALOG_MS) return;
    catalogAt = Date.now();
    try {
      renderEventTypes((await get("../v1/event-types")).event_types);
      showError("event-types-error", null);
    } catch (e) {
      showError("event-types-error", e);
    }
  }

  // --- Event lookup and a handler's page -------------------------------

  let handlers = new Map(); // id → summary, from the last poll
  let view = { name: "overview" };
  let plotTimer = null;
  const PLOT_MS = 10_000;
  const WINDOW_MS = 900_000;

  function cellLink(tag, text, href, attrs) {
    const c = el(tag, null, attrs);
    c.append(el("a", text, { href }));
    return c;
  }

  function time(iso) {
    if (!iso) return "–";
    return new Date(iso).toLocaleTimeString();
  }

  function timeEl(iso) {
    const e = el("time", time(iso));
    if (iso) {
      e.setAttribute("datetime", iso);
      e.title = iso;
    }
    return e;
  }

  const STATE_TEXT = { pending: "pending", completed: "completed", dead_lettered: "dead letter" };

  // "next 12:00:01", "completed 12:00:02", "failed 12:00:03".
  function whenCell(d) {
    const td = el("td");
    if (d.state === "pending") td.append("next ", timeEl(d.next_attempt_at));
    else if (d.state === "completed") td.append("completed ", timeEl(d.completed_at));
    else td.append("failed ", timeEl(d.failed_at));
    return td;
  }

  // The attempt log (failed attempts, oldest first) of a delivery: a row
  // under the delivery's, spanning the table, shown by the button in the
  // attempts cell. `null` when nothing failed.
  function logRow(d, span) {
    const log = d.attempt_log || [];
    if (log.length === 0) return null;
    const row = el("tr", null, { class: "log-row" });
    row.hidden = true;
    const td = el("td", null, { colspan: String(span) });
    const t = el("table", null, { class: "attempt-log" });
    const head = el("tr");
    for (const h of ["attempt", "at", "answer", "ms", "body (first 1 KB)"]) head.append(el("th", h, { scope: "col" }));
    t.append(el("thead"), el("tbody"));
    t.tHead.append(head);
    for (const a of log) {
      const answer = a.status != null ? `HTTP ${a.status}` : a.error || "–";
      const tr = el("tr", null, { "data-attempt": String(a.attempt), "data-status": a.status == null ? "" : String(a.status) });
      const at = el("td");
      at.append(timeEl(a.at));
      tr.append(el("td", a.attempt, { class: "num" }), at, el("td", answer), el("td", a.duration_ms, { class: "num" }), el("td", a.body || "", { class: "mono body" }));
      t.tBodies[0].append(tr);
    }
    td.append(t);
    row.append(td);
    return row;
  }

  // The attempts count, with a button that shows `log` (logRow) when
  // there is one.
  function attemptsCell(d, log) {
    const td = el("td", null, { class: "num" });
    if (!log) {
      td.textContent = String(d.attempts);
      return td;
    }
    const b = el("button", `${d.attempts} · log of ${d.attempt_log.length} failed`, { type: "button", class: "log-toggle", "aria-expanded": "false" });
    b.addEventListener("click", () => {
      log.hidden = !log.hidden;
      b.setAttribute("aria-expanded", String(!log.hidden));
    });
    td.append(b);
    return td;
  }

  function showError(id, e) {
    $(id).hidden = !e;
    $(id).textContent = e ? e.message : "";
  }

  // The columns every delivery row ends with (deliveryRows); a table's own
  // first columns are named in its data-columns.
  const TAIL = [["State"], ["Attempts", "num"], ["Next attempt / settled"], ["Last error"]];
  for (const id of ["event-handlers", "deliveries"]) {
    const tr = el("tr");
    for (const [name, cls] of [...$(id).dataset.columns.split(",").map((c) => [c]), ...TAIL]) {
      tr.append(el("th", name, cls ? { scope: "col", class: cls } : { scope: "col" }));
    }
    $(id).tHead.append(tr);
  }

  // The rows of one delivery: `lead` cells, then TAIL's; then its attempt
  // log's row, if any.
  function deliveryRows(attrs, lead, d) {
    const tr = el("tr", null, {
      ...attrs,
      "data-state": d.state,
      "data-attempts": String(d.attempts),
      "data-attempt-log": String((d.attempt_log || []).length),
    });
    const log = logRow(d, lead.length + TAIL.length);
    tr.append(
      ...lead,
      el("td", STATE_TEXT[d.state] || d.state, { class: `state-${d.state}` }),
      attemptsCell(d, log),
      whenCell(d),
      el("td", d.last_error || "–", { class: "error-text" }),
    );
    return log ? [tr, log] : [tr];
  }

  function renderEvent(ev) {
    const meta = $("event-meta");
    meta.replaceChildren();
    const facts = [
      ["type", ev.type],
      ["key", ev.key == null ? "(none)" : ev.key],
      ["sequence", ev.seq == null ? "–" : ev.seq],
      ["lane", ev.lane],
      ["published", new Date(ev.published_at).toLocaleString()],
      ["payload", `${ev.payload_bytes} bytes`],
    ];
    for (const [k, v] of facts) meta.append(el("dt", k), el("dd", v));
    const body = $("event-handlers").tBodies[0];
    body.replaceChildren();
    $("event-no-handlers").hidden = ev.handlers.length > 0;
    for (const d of ev.handlers) {
      const name = cellLink("th", d.handler_name || d.handler_id, `#handler=${encodeURIComponent(d.handler_id)}`, { scope: "row" });
      body.append(...deliveryRows({ "data-event-handler": d.handler_id }, [name], d));
    }
  }

  async function loadEvent() {
    const id = view.id;
    $("event-id").textContent = id;
    try {
      const ev = await get(`../v1/events/${encodeURIComponent(id)}`);
      if (view.name !== "event" || view.id !== id) return;
      showError("event-error", null);
      renderEvent(ev);
      document.body.dataset.event = id;
    } catch (e) {
      if (view.name !== "event" || view.id !== id) return;
      $("event-meta").replaceChildren();
      $("event-handlers").tBodies[0].replaceChildren();
      showError("event-error", e);
      document.body.dataset.event = "";
    }
  }

  function renderHandlerMeta() {
    const h = handlers.get(view.id);
    $("handler-name").textContent = h ? h.name : "";
    $("handler-meta").textContent = h
      ? `${handlerState(h)} · routes ${h.event_types.join(", ")} · filter ${filterText(h.filter)} · ${h.url} · dead letters ${h.dead_letters}`
      : "";
  }

  function renderDeliveries(page) {
    const body = $("deliveries").tBodies[0];
    body.replaceChildren();
    $("deliveries-empty").hidden = page.deliveries.length > 0;
    for (const d of page.deliveries) {
      const keySeq = d.key == null ? "–" : `${d.key}${d.seq == null ? "" : ` · ${d.seq}`}`;
      const lead = [
        cellLink("td", d.event_id, `#event=${encodeURIComponent(d.event_id)}`, { class: "mono" }),
        el("td", d.type || "(pruned)", { class: "mono" }),
        el("td", keySeq, { class: "mono" }),
      ];
      body.append(...deliveryRows({ "data-delivery": d.event_id }, lead, d));
    }
    const p = view.pages.length + 1;
    $("page-info").textContent = `page ${p} · ${page.deliveries.length} ${page.deliveries.length === 1 ? "delivery" : "deliveries"}`;
    $("page-newer").disabled = view.pages.length === 0;
    $("page-older").disabled = page.next_after == null;
  }

  async function loadDeliveries() {
    const v = view;
    const q = new URLSearchParams({ state: v.state, limit: "50" });
    if (v.after != null) q.set("after", v.after);
    try {
      const page = await get(`../v1/handlers/${encodeURIComponent(v.id)}/deliveries?${q}`);
      if (view !== v) return;
      showError("handler-error", null);
      v.next = page.next_after;
      renderDeliveries(page);
      $("deliveries").dataset.loaded = `${v.state}:${v.pages.length}`;
    } catch (e) {
      if (view === v) showError("handler-error", e);
    }
  }

  // One plot: a line over the last 15 minutes (a gap where there is no
  // value), its largest value on the axis. Everything through attributes.
  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  function fmt(v) {
    if (v === 0) return "0";
    if (v >= 100) return v.toFixed(0);
    if (v >= 10) return v.toFixed(1);
    return v.toPrecision(2);
  }

  function plot(name, title, unit, colour, samples, value, end) {
    const W = 300, H = 110, L = 34, R = 4, T = 8, B = 18;
    const pts = samples.map((s) => ({ t: Date.parse(s.at) + s.seconds * 500, v: value(s) }));
    const vals = pts.filter((p) => p.v != null).map((p) => p.v);
    const max = Math.max(0, ...vals);
    const top = max > 0 ? max * 1.1 : 1;
    const x = (t) => L + ((t - (end - WINDOW_MS)) / WINDOW_MS) * (W - L - R);
    const y = (v) => T + (1 - v / top) * (H - T - B);
    const fig = el("figure", null, {
      class: "plot",
      "data-plot": name,
      "data-points": String(vals.length),
      "data-nonzero": String(vals.filter((v) => v > 0).length),
      "data-max": String(max),
    });
    const last = vals.length ? vals[vals.length - 1] : null;
    fig.append(el("figcaption", `${title}: ${last == null ? "–" : fmt(last)} ${unit} now, max ${fmt(max)}`));
    const s = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${title} over the last 15 minutes, at most ${fmt(max)} ${unit}` });
    s.append(
      svg("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), stroke: "#8a929c", "stroke-width": 1 }),
      svg("line", { x1: L, y1: T, x2: L, y2: y(0), stroke: "#8a929c", "stroke-width": 1 }),
      svg("line", { x1: L, y1: y(max || top), x2: W - R, y2: y(max || top), stroke: "#c9ced6", "stroke-dasharray": "3 3" }),
    );
    const label = (tx, ax, ay, anchor) => {
      const t = svg("text", { x: ax, y: ay, "text-anchor": anchor, "font-size": 9, fill: "#4a5360" });
      t.textContent = tx;
      return t;
    };
    s.append(
      label(fmt(max), L - 3, y(max || top) + 3, "end"),
      label("0", L - 3, y(0) + 3, "end"),
      label("−15 min", L, H - 4, "start"),
      label("now", W - R, H - 4, "end"),
    );
    let d = "";
    let pen = false;
    for (const p of pts) {
      if (p.v == null) {
        pen = false;
        continue;
      }
      d += `${pen ? "L" : "M"}${x(p.t).toFixed(1)} ${y(p.v).toFixed(1)} `;
      pen = true;
    }
    if (d) s.append(svg("path", { d: d.trim(), fill: "none", stroke: colour, "stroke-width": 1.5, "stroke-linejoin": "round" }));
    // A lone value between gaps gets a dot.
    pts.forEach((p, i) => {
      const alone = p.v != null && (pts[i - 1] === undefined || pts[i - 1].v == null) && (pts[i + 1] === undefined || pts[i + 1].v == null);
      if (alone) s.append(svg("circle", { cx: x(p.t).toFixed(1), cy: y(p.v).toFixed(1), r: 2, fill: colour }));
    });
    fig.append(s);
    return fig;
  }

  async function loadPlots() {
    const v = view;
    if (plotTimer !== null) clearTimeout(plotTimer);
    plotTimer = null;
    try {
      const a = await get(`../admin/handlers/${encodeURIComponent(v.id)}/activity`);
      if (view !== v) return;
      const last = a.samples[a.samples.length - 1];
      const end = last ? Date.parse(last.at) + last.seconds * 1000 : Date.now();
      $("plots").replaceChildren(
        plot("deliveries", "Deliveries", "/s", "#0b6b2b", a.samples, (s) => s.deliveries_per_s, end),
        plot("failures", "Failures", "/s", "#a4161a", a.samples, (s) => s.failures_per_s, end),
        plot("p99", "p99 attempt duration", "ms", "#0a58ca", a.samples, (s) => s.p99_attempt_ms, end),
      );
      $("plots-scope").textContent =
        `Attempts made by node ${a.node_id} (the node serving this page), one sample per ${a.interval_s} s; ` +
        "each node counts the attempts of the lanes it owns: open another node's dashboard (Nodes table) for its share.";
      $("plots").dataset.updated = new Date().toISOString();
    } catch (e) {
      if (view === v) showError("handler-error", e);
    }
    if (view === v) plotTimer = setTimeout(loadPlots, PLOT_MS);
  }

  // Shows the view the location's hash names: "" (overview),
  // "#event=ID" or "#handler=ID&state=pending|dead|completed".
  function route() {
    const q = new URLSearchParams(location.hash.slice(1));
    const [event, handler, tab] = ["event", "handler", "state"].map((k) => q.get(k));
    if (plotTimer !== null) clearTimeout(plotTimer);
    plotTimer = null;
    if (event) view = { name: "event", id: event };
    else if (handler) {
      const state = ["pending", "dead", "completed"].includes(tab) ? tab : "pending";
      view = { name: "handler", id: handler, state, after: null, next: null, pages: [] };
    } else view = { name: "overview" };
    document.body.dataset.view = view.name;
    $("view-overview").hidden = view.name !== "overview";
    $("view-event").hidden = view.name !== "event";
    $("view-handler").hidden = view.name !== "handler";
    if (view.name === "event") {
      $("lookup").value = view.id;
      loadEvent();
    } else if (view.name === "handler") {
      $("handler-id").textContent = view.id;
      renderHandlerMeta();
      $("plots").replaceChildren();
      $("deliveries").tBodies[0].replaceChildren();
      delete $("deliveries").dataset.loaded;
      for (const b of $("delivery-tabs").querySelectorAll("button")) {
        const on = b.dataset.state === view.state;
        b.setAttribute("aria-selected", String(on));
        b.tabIndex = on ? 0 : -1;
      }
      loadDeliveries();
      loadPlots();
    }
  }

  $("lookup-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const id = $("lookup").value.trim();
    if (!id) return;
    const hash = `#event=${encodeURIComponent(id)}`;
    if (location.hash === hash) route();
    else location.hash = hash;
  });
  $("event-refresh").addEventListener("click", () => loadEvent());
  $("deliveries-refresh").addEventListener("click", () => loadDeliveries());
  $("delivery-tabs").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-state]");
    if (b && view.name === "handler") location.hash = `#handler=${encodeURIComponent(view.id)}&state=${b.dataset.state}`;
  });
  $("page-older").addEventListener("click", () => {
    if (view.name !== "handler" || view.next == null) return;
    view.pages.push(view.after);
    view.after = view.next;
    loadDeliveries();
  });
  $("page-newer").addEventListener("click", () => {
    if (view.name !== "handler" || view.pages.length === 0) return;
    view.after = view.pages.pop();
    loadDeliveries();
  });
  window.addEventListener("hashchange", route);

  function setStatus(state, text) {
    document.body.dataset.status = state;
    $("status").textContent = text;
  }

  async function poll() {
    timer = null;
    if (!document.hidden) {
      try {
        const [l, c, h] = await Promise.all([get("../admin/lanes"), get("../admin/cluster"), get("../admin/handlers")]);
        assignColours([...c.nodes.map((n) => n.id), ...l.lanes.map((x) => x.owner).filter(Boolean)]);
        renderLanes(l.lanes);
        renderCluster(c);
        renderHandlers(h);
        pollCatalog();
        const now = new Date();
        document.body.dataset.updated = now.toISOString();
        setStatus("ok", `live · updated ${now.toLocaleTimeString()}`);
        $("token-form").hidden = true;
      } catch (e) {
        const last = document.body.dataset.updated;
        setStatus("error", `node not answering (${e.message})${last ? ` · showing ${new Date(last).toLocaleTimeString()}` : ""}`);
      }
    }
    timer = setTimeout(poll, POLL_MS);
  }

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && timer !== null) {
      clearTimeout(timer);
      poll();
    }
  });

  route();
  poll();
})();
