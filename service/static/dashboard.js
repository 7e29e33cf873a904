// The /dashboard page: polls the server's JSON routes every 2 s and draws them. No library, no
// build step, nothing fetched from another host (the page's Content-Security-Policy forbids it).
//
// Authentication: on a server with API keys (<meta name="tieredkv-auth" content="keys">) the
// page asks for a key, keeps it in this tab's sessionStorage and sends it as
// `Authorization: Bearer <key>` on every fetch; the routes decide what it may see, as they do for
// any client. Text from the cache (prompt previews) is only ever set as textContent, never HTML.
//
// Every number drawn from a route carries data-k="<route>.<path>" and data-value="<raw value>",
// so a test can compare the page with the JSON it came from.
"use strict";

(() => {
  const POLL_MS = 2000;
  const TREE_EVERY = 2;            // the tree reads the disk's records: every other poll
  const HISTORY = 150;             // samples kept for the chart (5 minutes at 2 s)
  const TIERS = ["device", "host", "disk", "remote"];
  const SOURCES = ["device", "host", "disk", "remote", "miss"];
  const KEY = "tieredkv.dashboard.key";
  const SVG = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);
  const needsKey = document.querySelector('meta[name="tieredkv-auth"]').content === "keys";
  const samples = [];              // {t: seconds, hits: {tier: cumulative hit tokens}}
  let polls = 0;
  let timer = null;

  class AuthError extends Error {}

  // ---- fetching -------------------------------------------------------------------------
  function authHeaders() {
    const key = sessionStorage.getItem(KEY);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  async function getJSON(path) {
    // X-Tieredkv-Client: the server keeps these polls off its request log (DEBUG; serve --log-probes).
    const r = await fetch(path, { headers: { ...authHeaders(), "X-Tieredkv-Client": "dashboard" }, cache: "no-store" });
    let body = null;
    try { body = await r.json(); } catch (_) { /* not JSON: reported below */ }
    const message = body && body.error ? body.error.message : `HTTP ${r.status}`;
    if (r.status === 401) throw new AuthError(message);
    if (!r.ok) throw new Error(`${path}: ${message}`);
    return body;
  }

  async function optionalJSON(path) {
    try { return await getJSON(path); } catch (e) {
      if (e instanceof AuthError) throw e;
      return { unavailable: String(e.message || e) };
    }
  }

  // ---- small DOM helpers ----------------------------------------------------------------
  function el(tag, attrs, ...kids) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null) continue;
      if (k === "class") node.className = v; else node.setAttribute(k, v);
    }
    for (const kid of kids) {
      if (kid === null || kid === undefined) continue;
      node.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  // A number from a route, formatted, with where it came from.
  function num(k, value, fmt) {
    const shown = value === null || value === undefined ? "–" : (fmt || fmtInt)(value);
    return el("span", { class: "num", "data-k": k, "data-value": value === undefined ? "" : JSON.stringify(value) }, shown);
  }

  const fmtInt = (n) => (typeof n === "number" ? n.toLocaleString("en-US") : String(n));

  function fmtBytes(n) {
    if (typeof n !== "number") return String(n);
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
  }

  const fmtMs = (s) => (s === null || s === undefined ? "–" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms");
  const fmtUsd = (x) => "$" + x.toFixed(x !== 0 && Math.abs(x) < 0.01 ? 6 : 2);
  const pct = (a, b) => (b > 0 ? ((100 * a) / b).toFixed(1) + "%" : "–");

  function badge(text, kind) { return el("span", { class: "badge " + (kind || "") }, text); }

  // ---- drawing --------------------------------------------------------------------------
  function tierState(name, t) {
    if (name === "remote") {
      if (!t.enabled) return ["off", "off"];
      return t.breaker === "closed" ? ["breaker closed", "ok"] : ["breaker " + t.breaker, "bad"];
    }
    if (name === "disk") {
      if (t.unavailable) return ["unavailable", "bad"];
      if (t.enabled === false) return ["off", "off"];
      return t.moved_aside ? ["recovered", "warn"] : ["ok", "ok"];
    }
    if (name === "host" && t.enabled === false) return ["off", "off"];
    return ["ok", "ok"];
  }

  function drawTiers(status) {
    const box = $("tiers");
    box.replaceChildren();
    for (const name of TIERS) {
      const t = status.tiers[name] || {};
      const k = (f) => `status.tiers.${name}.${f}`;
      const [state, kind] = tierState(name, t);
      const card = el("div", { class: "card", id: "tier-" + name },
        el("h3", {}, el("span", { class: "swatch t-" + name }), name, " ", badge(state, kind)));
      const rows = el("dl", { class: "kv" });
      const row = (label, ...value) => rows.append(el("dt", {}, label), el("dd", {}, ...value));
      if (name !== "remote") {
        const cap = t.capacity_bytes || 0;
        const fill = el("div", { class: "bar" }, el("div", { class: "fill t-" + name }));
        fill.firstChild.style.width = (cap > 0 ? Math.min(100, (100 * (t.used_bytes || 0)) / cap) : 0).toFixed(1) + "%";
        card.append(fill);
        row("fill", num(k("used_bytes"), t.used_bytes, fmtBytes), " of ", num(k("capacity_bytes"), t.capacity_bytes, fmtBytes),
            el("span", { class: "muted" }, " (" + pct(t.used_bytes || 0, cap) + ")"));
        row("blocks", num(k("blocks"), t.blocks));
      } else {
        row("capacity", el("span", { class: "muted" }, "the store's own (maxmemory)"));
      }
      row("hit tokens", num(k("hit_tokens"), t.hit_tokens));
      row("promotions", num(k("promotions"), t.promotions));
      if (name !== "remote") row("evictions", num(k("evictions"), t.evictions));
      if (name === "disk" && t.enabled !== false) {
        row("compression", num(k("compression_ratio"), t.compression_ratio, (x) => x.toFixed(2) + "x"));
        row("damaged blocks", num(k("corrupt"), t.corrupt));
        row("moved aside", num(k("moved_aside"), t.moved_aside));
        row("read / write errors", num(k("read_errors"), t.read_errors), " / ", num(k("write_errors"), t.write_errors));
        row("pending writes", num(k("pending_writes"), t.pending_writes));
      }
      if (name === "disk" && t.unavailable) row("why", el("span", { class: "error" }, String(t.unavailable)));
      if (name === "remote" && t.enabled) {
        row("breaker", num(k("breaker"), t.breaker, String));
        row("store hits / misses", num(k("store_hits"), t.store_hits), " / ", num(k("misses"), t.misses));
        row("errors / skipped", num(k("errors"), t.errors), " / ", num(k("skipped"), t.skipped));
        row("writes / drops", num(k("writes"), t.writes), " / ", num(k("write_drops"), t.write_drops));
      }
      card.append(rows);
      box.append(card);
    }
  }

  function drawHealth(status) {
    const h = $("health");
    h.replaceChildren();
    const disk = status.tiers.disk || {};
    const remote = status.tiers.remote || {};
    const billing = status.billing || {};
    const [ds, dk] = tierState("disk", disk);
    h.append(badge("disk " + ds, dk));
    if (remote.enabled) {
      const [rs, rk] = tierState("remote", remote);
      h.append(badge("remote " + rs, rk));
    }
    h.append(badge("billing " + (billing.state || "off"), billing.state === "degraded" ? "bad" : billing.state === "ok" ? "ok" : "off"));
  }

  function drawRequests(status) {
    const d = $("requests");
    d.replaceChildren();
    const e = status.engine || {};
    const row = (label, node) => d.append(el("dt", {}, label), el("dd", {}, node));
    row("in flight (admitted)", num("status.service.in_flight", (status.service || {}).in_flight));
    row("running", num("status.engine.running", e.running));
    row("loading (restoring blocks)", num("status.engine.loading", e.loading));
    row("waiting", num("status.engine.waiting", e.waiting));
    row("preemptions", num("status.engine.preemptions", e.preemptions));
  }

  function drawTTFT(status) {
    const body = $("ttft").tBodies[0];
    body.replaceChildren();
    const by = (status.service || {}).ttft_by_source || {};
    for (const s of SOURCES) {
      const r = by[s] || {};
      const k = (f) => `status.service.ttft_by_source.${s}.${f}`;
      body.append(el("tr", {}, el("td", {}, el("span", { class: "swatch t-" + s }), s),
        el("td", {}, num(k("requests"), r.requests)), el("td", {}, num(k("p50_s"), r.p50_s, fmtMs)),
        el("td", {}, num(k("p90_s"), r.p90_s, fmtMs)), el("td", {}, num(k("last_s"), r.last_s, fmtMs)),
        el("td", {}, num(k("p50_per_1k_s"), r.p50_per_1k_s, fmtMs)),
        el("td", {}, num(k("p90_per_1k_s"), r.p90_per_1k_s, fmtMs))));
    }
    // Like with like: a hit against a miss of the same prompt length (the server's buckets).
    const lengths = $("ttft-length").tBodies[0];
    lengths.replaceChildren();
    const byLength = Object.entries((status.service || {}).ttft_by_length || {});
    for (const [label, b] of byLength) {
      const cells = ["miss", "device", "host", "disk", "remote"].map((s) => el("td", { title: `${b.requests[s]} requests` },
        num(`status.service.ttft_by_length.${label}.p50_s.${s}`, b.p50_s[s], fmtMs)));
      lengths.append(el("tr", { "data-length": label }, el("td", {}, label), ...cells));
    }
    if (!byLength.length) {
      lengths.append(el("tr", {}, el("td", { colspan: 6, class: "muted" }, "no prompt length has had both a miss and a hit yet")));
    }
  }

  function drawChart() {
    const chart = $("chart");
    chart.replaceChildren();
    const W = 720, H = 180, L = 48, B = 18, T = 8;
    const rates = [];
    for (let i = 1; i < samples.length; i++) {
      const dt = Math.max(1e-3, samples[i].t - samples[i - 1].t);
      const r = {};
      for (const tier of TIERS) r[tier] = Math.max(0, (samples[i].hits[tier] - samples[i - 1].hits[tier]) / dt);
      rates.push({ t: samples[i].t, r });
    }
    let max = 1;
    for (const p of rates) for (const tier of TIERS) max = Math.max(max, p.r[tier]);
    const top = niceCeil(max);
    for (const f of [0, 0.5, 1]) {
      const y = T + (H - T - B) * (1 - f);
      chart.append(svg("line", { x1: L, x2: W, y1: y, y2: y, class: "grid" }));
      const label = svg("text", { x: L - 6, y: y + 4, class: "axis", "text-anchor": "end" });
      const v = top * f;             // top is 1, 2, 5 x 10^k: its half is distinct from 0 and top
      label.textContent = Number.isInteger(v) ? fmtInt(v) : v.toFixed(1);
      chart.append(label);
    }
    const now = samples.length ? samples[samples.length - 1].t : 0;
    // The x axis is always the heading's window: the last HISTORY samples' span (5 minutes).
    const span = HISTORY * (POLL_MS / 1000);
    const x = (t) => L + (W - L) * (1 - (now - t) / span);
    const y = (v) => T + (H - T - B) * (1 - v / top);
    const xlabel = svg("text", { x: W, y: H - 4, class: "axis", "text-anchor": "end" });
    xlabel.textContent = "now";
    chart.append(xlabel);
    const xstart = svg("text", { x: L + 4, y: H - 4, class: "axis" });
    xstart.textContent = `-${Math.round(span / 60)} min`;
    chart.append(xstart);
    if (rates.length < 1) {
      const wait = svg("text", { x: (W + L) / 2, y: H / 2, class: "axis", "text-anchor": "middle" });
      wait.textContent = "collecting samples…";
      chart.append(wait);
      return;
    }
    for (const tier of TIERS) {
      const pts = rates.map((p) => `${x(p.t).toFixed(1)},${y(p.r[tier]).toFixed(1)}`).join(" ");
      chart.append(svg("polyline", { points: pts, class: "line t-" + tier, "data-tier": tier }));
    }
  }

  function niceCeil(v) {
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function drawLegend() {
    const lg = $("legend");
    lg.replaceChildren(...TIERS.map((t) => el("span", {}, el("span", { class: "swatch t-" + t }), t)));
  }

  function drawTenants(billing, single) {
    const body = $("tenants").tBodies[0];
    body.replaceChildren();
    if (billing.unavailable) {
      body.append(el("tr", {}, el("td", { colspan: 9, class: "muted" }, billing.unavailable)));
      return;
    }
    const rows = single ? [[billing.tenant, billing, "billing"]]
      : Object.entries(billing.tenants || {}).map(([name, b]) => [name, b, `billing.tenants.${name}`]);
    rows.sort((a, b) => b[1].cost_pico - a[1].cost_pico);
    if (!single && billing.total) rows.push(["total", billing.total, "billing.total"]);
    for (const [name, b, base] of rows) {
      const k = (f) => `${base}.${f}`;
      const split = el("td", { class: "split" });
      TIERS.forEach((t, i) => {
        if (i) split.append(" / ");
        split.append(num(`${base}.hit_tokens_by_tier.${t}`, (b.hit_tokens_by_tier || {})[t]));
      });
      body.append(el("tr", { class: name === "total" && !single ? "total" : null, "data-tenant": name },
        el("td", {}, name), el("td", {}, num(k("requests"), b.requests)), el("td", {}, num(k("prompt_tokens"), b.prompt_tokens)),
        el("td", {}, num(k("hit_tokens"), b.hit_tokens)), split, el("td", {}, num(k("miss_tokens"), b.miss_tokens)),
        el("td", {}, num(k("completion_tokens"), b.completion_tokens)), el("td", {}, pct(b.hit_tokens, b.prompt_tokens)),
        el("td", {}, num(k("cost_usd"), b.cost_usd, fmtUsd))));
    }
    if (!rows.length) body.append(el("tr", {}, el("td", { colspan: 9, class: "muted" }, "no usage billed yet")));
  }

  function drawTree(tree) {
    const box = $("tree");
    box.replaceChildren();
    if (tree.unavailable) { $("tree-note").textContent = tree.unavailable; return; }
    $("tree-note").textContent = tree.truncated
      ? "The disk holds more records than one look reads: its part of the tree is incomplete."
      : `Block size ${tree.block_size} tokens. Each line is a run of blocks; its text is the prompt it caches.`;
    const tenants = Object.entries(tree.tenants || {}).sort((a, b) => b[1].blocks - a[1].blocks);
    for (const [tenant, t] of tenants) {
      const label = tenant === "*" ? "all tenants (shared namespace)" : "tenant " + tenant;
      const head = el("h3", { class: "tree-head" }, label, " ", num(`tree.tenants.${tenant}.blocks`, t.blocks), " blocks");
      box.append(head);
      if (!t.tree.length) { box.append(el("p", { class: "muted" }, "nothing cached")); continue; }
      box.append(nodeList(t.tree, t.more_roots));
    }
    if (!tenants.length) box.append(el("p", { class: "muted" }, "nothing cached"));
  }

  function nodeList(nodes, more) {
    const ul = el("ul", { class: "tree" });
    for (const n of nodes) {
      const first = n.first_block;
      const where = first === null ? "?" : n.blocks > 1 ? `${first}–${first + n.blocks - 1}` : `${first}`;
      const chips = el("span", { class: "chips" });
      for (const [tier, count] of Object.entries(n.tiers || {})) chips.append(el("span", { class: "chip t-" + tier }, `${tier} ${count}`));
      const reads = n.reads.reduce((a, b) => a + b, 0);
      const li = el("li", {},
        el("span", { class: "where" }, (n.blocks > 1 ? "blocks " : "block ") + where),
        el("span", { class: "muted" }, ` ${n.tokens} tok`), " ", chips,
        reads ? el("span", { class: "muted" }, ` ${reads} disk reads `) : " ",
        n.orphan ? el("span", { class: "muted" }, "(parent not cached) ") : null,
        el("q", { class: "text" }, n.preview));
      if (n.children.length) li.append(nodeList(n.children, n.more_children));
      else if (n.more_children) li.append(el("div", { class: "muted" }, `… ${n.more_children} branches below`));
      ul.append(li);
    }
    if (more) ul.append(el("li", { class: "muted" }, `… ${more} more`));
    return ul;
  }

  // ---- the poll loop --------------------------------------------------------------------
  async function poll() {
    timer = null;
    try {
      // The first poll also asks for the server's recent hit history: the chart starts filled.
      const status = await getJSON(samples.length ? "/v1/cache/status" : "/v1/cache/status?history=1");
      const admin = Boolean(status.tiers);
      const wantTree = polls % TREE_EVERY === 0;
      const [billing, tree] = await Promise.all([optionalJSON("/v1/cache/billing"),
        wantTree ? optionalJSON("/v1/cache/tree") : Promise.resolve(null)]);
      render(status, admin, billing, tree);
      polls += 1;
      document.body.dataset.polls = String(polls);
      $("error").hidden = true;
      $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      if (e instanceof AuthError) { askForKey(e.message); return; }
      $("error").textContent = "Cannot read the server: " + (e.message || e) + " (retrying)";
      $("error").hidden = false;
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function render(status, admin, billing, tree) {
    $("main").hidden = false;
    $("login").hidden = true;
    for (const node of document.querySelectorAll(".admin")) node.hidden = !admin;
    const note = $("scope-note");
    if (admin) {
      note.hidden = true;
      $("model").textContent = `${status.model} · ${status.dtype} · block ${status.block_size} tokens · ${status.engine.attention}`;
      const now = performance.now() / 1000;
      const past = (status.service || {}).hit_history;
      if (!samples.length && past) {
        for (const [ago, hits] of past.samples) samples.push({ t: now - ago, hits });
      }
      samples.push({ t: now, hits: Object.fromEntries(TIERS.map((t) => [t, status.tiers[t].hit_tokens || 0])) });
      while (samples.length > HISTORY) samples.shift();
      drawHealth(status);
      drawTiers(status);
      drawChart();
      drawRequests(status);
      drawTTFT(status);
    } else {
      note.textContent = `Signed in as tenant ${status.tenant}: ${status.note}.`;
      note.hidden = false;
      $("model").textContent = "tenant " + status.tenant;
    }
    if (billing) drawTenants(billing, !admin || !billing.tenants);
    if (tree) drawTree(tree);
  }

  function askForKey(message) {
    if (timer) { clearTimeout(timer); timer = null; }
    $("main").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = sessionStorage.getItem(KEY) ? message : "";
    $("updated").textContent = "";
    $("key").focus();
  }

  function start() {
    drawLegend();
    $("forget").hidden = !needsKey;
    $("forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); askForKey(""); });
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, $("key").value.trim());
      $("key").value = "";
      $("login").hidden = true;
      poll();
    });
    if (needsKey && !sessionStorage.getItem(KEY)) { askForKey(""); return; }
    // A server without keys puts its status (with the recent hit history) in the page itself, so
    // the first paint shows the cache, not "connecting"; the polls take over from there.
    // Its billing and prefix tree too: the Tenants and Cached prefixes panels are filled at once.
    const initial = $("initial") && $("initial").textContent.trim();
    if (initial) {
      const first = JSON.parse(initial);
      render(first.status, true, first.billing, first.tree);
      $("updated").textContent = "as of " + new Date().toLocaleTimeString();
    }
    poll();
  }

  start();
})();
