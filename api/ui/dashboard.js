// lanebus dashboard: polls the node's admin paths every second and draws the
// lanes, nodes and handlers. Vanilla JavaScript, no dependencies, nothing
// fetched but this node's own paths (relative, so a path prefix works).
// Untrusted strings go through textContent and attributes only.
// On a node that requires tokens, an answer 401/403 shows a token field; the
// token is kept in sessionStorage (this tab only) and sent as
// `authorization: Bearer TOKEN`.
"use strict";

(() => {
  const POLL_MS = 1000;
  const TIMEOUT_MS = 5000;

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

  function renderHandlers(h) {
    const body = $("handlers").tBodies[0];
    body.replaceChildren();
    $("handlers-empty").hidden = h.handlers.length > 0;
    for (const x of h.handlers) {
      const tr = el("tr", null, { "data-handler": x.id, "data-state": x.state, "data-dead-letters": String(x.dead_letters) });
      const count = `${h.dead_letters_exact ? "" : "≥"}${x.dead_letters}`;
      const dl = el("td", null, { class: x.dead_letters > 0 ? "num has-dead" : "num" });
      if (x.dead_letters > 0) {
        dl.append(el("a", count, { href: `../admin/dead-letters?handler_id=${encodeURIComponent(x.id)}` }));
      } else dl.textContent = count;
      tr.append(
        el("th", x.name, { scope: "row" }),
        el("td", x.id, { class: "mono" }),
        el("td", handlerState(x), { class: x.state === "enabled" ? "" : "disabled" }),
        el("td", x.event_types.join(", "), { class: "mono" }),
        dl,
      );
      body.append(tr);
    }
  }

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

  poll();
})();
