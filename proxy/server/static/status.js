// kvroute's live status page: renders the snapshots and decisions of /kvroute/events.
// Everything from the server goes into the page as text (textContent), never as markup.
"use strict";

const MAX_DECISIONS = 100;
let decisions = [];
let snapshots = 0;

function el(tag, cls, ...children) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  for (const c of children) {
    node.append(c instanceof Node ? c : document.createTextNode(c === null || c === undefined ? "" : String(c)));
  }
  return node;
}

function td(value, cls) { return el("td", cls, value); }
function num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
function hhmmss(unix) { return new Date(unix * 1000).toLocaleTimeString("en-GB"); }

function pill(text, kind) {
  const p = el("span", "pill " + kind, text);
  p.dataset.state = text;
  return p;
}

function routerOf(body, name) {
  for (const pool of body.pools) {
    const b = pool.router.backends[name];
    if (b) return b;
  }
  return null;
}

function breaker(state) {
  if (!state) return "–";
  const kind = state.breaker === "closed" ? "ok" : state.breaker === "open" ? "bad" : "warn";
  const cell = el("span", null, pill(String(state.breaker), kind));
  if (state.trips) cell.append(" " + num(state.trips) + " trips");
  if (state.last_error) cell.title = String(state.last_error);
  return cell;
}

function renderBackends(body) {
  const rows = body.backends.map((b) => {
    const r = routerOf(body, b.name);
    const tr = el("tr", null,
      td(b.name), td(b.pool), td(b.kind + (b.managed ? " (managed)" : "")),
      td(pill(String(b.state), b.state === "ready" ? "ok" : b.crash_loop ? "bad" : "warn")),
      td(pill(b.healthy ? "healthy" : "down", b.healthy ? "ok" : "bad")),
      td(b.routed ? "yes" : "no"),
      td(breaker(b.proxy)),
      td(b.model), td(b.memory), td(num(b.n_slots), "num"),
      td(r ? num(r.inflight) : "–", "num"), td(r ? num(r.prefill_tps) : "–", "num"),
      td(num(b.restarts), "num"), td(b.last_error || ""));
    tr.dataset.backend = b.name;
    return tr;
  });
  document.querySelector("#backends tbody").replaceChildren(...rows);
}

// A backend in a crash loop: what died, the likely fix, its command line and log's tail.
function crashCard(b) {
  const c = b.crash_loop;
  const card = el("div", "card crash", el("h3", null, b.name + " is in a crash loop"),
    el("div", null, c.died + " (" + num(c.deaths) + " deaths within " + c.window_s + " s)"),
    el("div", null, "likely fix: " + c.fix),
    el("div", "meta", (b.state === "held" ? "held out of routing until " :
      "next restart at ") + (c.until ? hhmmss(c.until) : "–")),
    el("div", "meta", "model: " + c.model),
    el("div", "meta", "command: " + c.command),
    el("div", "meta", "last lines of " + c.log + ":"),
    el("pre", null, c.log_tail.join("\n")));
  card.dataset.backend = b.name;
  return card;
}

function renderCrashLoops(body) {
  const cards = body.backends.filter((b) => b.crash_loop).map(crashCard);
  document.getElementById("crashes").replaceChildren(...cards);
  document.getElementById("crash-loops").hidden = cards.length === 0;
}

function slotRow(slot, ctx) {
  const fill = el("div");
  fill.style.width = Math.min(100, ctx ? (100 * slot.tokens) / ctx : 0).toFixed(1) + "%";
  const row = el("div", "slot" + (slot.busy ? " busy" : ""),
    el("span", null, "#" + slot.id), el("span", "state", slot.busy ? "busy" : "idle"),
    el("div", "bar", fill));
  row.title = num(slot.tokens) + " tokens" + (ctx ? " of " + num(ctx) : "");
  row.append(el("span", "session", num(slot.tokens) + " tok" +
    (slot.session ? " · session " + slot.session : "")));
  row.dataset.slot = String(slot.id);
  row.dataset.tokens = String(slot.tokens);
  return row;
}

function renderCaches(body) {
  const ctxOf = Object.fromEntries(body.backends.map((b) => [b.name, b.slot_ctx]));
  const cards = [];
  for (const pool of body.pools) {
    for (const [name, b] of Object.entries(pool.router.backends)) {
      const card = el("div", "card", el("h3", null, name + (pool.name ? "  ·  " + pool.name : "")));
      card.dataset.backend = name;
      for (const slot of b.slots) card.append(slotRow(slot, ctxOf[name]));
      const ramTokens = b.ram_entries.reduce((s, e) => s + e.tokens, 0);
      const ramFill = el("div");
      ramFill.style.width = (b.ram_cache_bytes ? Math.min(100, (100 * b.ram_bytes) / b.ram_cache_bytes) : 0).toFixed(1) + "%";
      card.append(el("div", "meta", "RAM tier: " + num(b.ram_entries.length) + " entries, " +
        num(ramTokens) + " tokens, " + (b.ram_bytes / 1048576).toFixed(1) + " of " +
        (b.ram_cache_bytes / 1048576).toFixed(0) + " MiB"), el("div", "bar", ramFill));
      card.append(el("div", "meta", "work " + num(b.work_tokens) + " tokens · " +
        num(b.inflight) + " in flight · prefill " + num(b.prefill_tps) + " tok/s"));
      cards.push(card);
    }
  }
  document.getElementById("caches").replaceChildren(...cards);
}

// One directory of the disk tier: its files, this run's saves, failures and removals, the
// files put aside, and the last failure with its reason and fix.
function diskDirectory(dir) {
  const node = el("div", null, el("div", null, dir.path + ": " + num(dir.files) +
    " files, " + num(dir.tokens) + " tokens"));
  node.dataset.path = dir.path;
  const failed = dir.save_failed + dir.restore_failed + dir.remove_failed + dir.index_failed;
  node.append(el("div", "meta", num(dir.saved) + " saved · " + num(dir.save_failed) +
    " saves failed · " + num(dir.restore_failed) + " restores failed · " + num(dir.removed) +
    " removed · " + num(dir.quarantined) + " quarantined"),
  failed ? pill(num(failed) + " failed", "bad") : "");
  const last = dir.last_failure;
  if (last) {
    node.append(el("div", "meta", "last failure (" + last.what + ", " +
      hhmmss(last.at) + "): " + last.reason), el("div", "meta", "fix: " + last.fix));
  }
  return node;
}

function renderSide(body) {
  const d = body.kv_disk;
  document.getElementById("disk").replaceChildren(...(d ? [
    el("div", null, num(d.files) + " saved slots, " + num(d.tokens) + " tokens, budget " +
      d.max_gib + " GiB per directory"), ...d.directories.map(diskDirectory)] :
    [el("div", "meta", "off (no kv_disk configured)")]));
  const a = body.admission;
  document.getElementById("admission").replaceChildren(el("div", null,
    num(a.in_flight) + " of " + num(a.max_in_flight) + " in flight, " + num(a.queued) +
    " of " + num(a.max_queue) + " queued"));
  document.getElementById("summary").textContent = "policy " + body.policy + " · " +
    body.backends.filter((b) => b.routed).length + "/" + body.backends.length + " backends routed";
}

function sum(series, key) { return series.reduce((s, b) => s + (b[key] || 0), 0); }

function renderTotals(series) {
  const parts = [];
  for (const [label, n] of [["last minute", 6], ["last 10 minutes", series.length]]) {
    const part = series.slice(-n);
    const prompt = sum(part, "prompt_tokens");
    const ttftN = part.filter((b) => b.ttft_mean_ms !== null);
    const mean = ttftN.length ? ttftN.reduce((s, b) => s + b.ttft_mean_ms * b.requests, 0) /
      ttftN.reduce((s, b) => s + b.requests, 0) : null;
    parts.push(label + ": " + num(sum(part, "requests")) + " requests, reuse " +
      (prompt ? ((100 * sum(part, "reused")) / prompt).toFixed(1) + "%" : "–") +
      ", TTFT " + (mean === null ? "–" : mean.toFixed(0) + " ms"));
  }
  document.getElementById("totals").textContent = parts.join("   |   ");
}

function chart(id, series, value, max, tick) {
  const c = document.getElementById(id);
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  const w = c.width / series.length;
  const top = Math.max(max(series), 1);
  g.fillStyle = "#dde1e6";
  g.fillRect(0, c.height - 1, c.width, 1);
  series.forEach((b, i) => {
    const v = value(b);
    if (v !== null) {
      g.fillStyle = "#2d6cdf";
      const h = ((c.height - 14) * v) / top;
      g.fillRect(i * w + 1, c.height - h, Math.max(1, w - 2), h);
    }
    const t = tick ? tick(b) : null;
    if (t !== null) {
      g.fillStyle = "#c0392b";
      g.fillRect(i * w + 1, c.height - ((c.height - 14) * t) / top - 1, Math.max(1, w - 2), 2);
    }
  });
  g.fillStyle = "#6b7480";
  g.font = "10px sans-serif";
  g.fillText(String(Math.round(top)), 2, 10);
}

function renderCharts(series) {
  const reuse = (b) => (b.prompt_tokens ? (100 * b.reused) / b.prompt_tokens : null);
  chart("reuse-chart", series, reuse, () => 100, null);
  chart("ttft-chart", series, (b) => b.ttft_mean_ms,
    (s) => Math.max(...s.map((b) => b.ttft_max_ms || 0)), (b) => b.ttft_max_ms);
}

function decisionRow(d, fresh) {
  const tr = el("tr", "tier-" + d.tier + (fresh ? " fresh" : ""),
    td(hhmmss(d.at)), td(d.request_id, "num"), td(d.endpoint), td(d.backend),
    td(d.slot === null ? "–" : d.slot + (d.pinned ? "" : " (server)"), "num"),
    td(d.tier, "tier"), td(num(d.prompt_tokens), "num"), td(num(d.predicted_cached), "num"),
    td(num(d.reported_cached), "num"), td(num(d.ttft_ms), "num"), td(d.status),
    td((d.why || "") + (d.queued ? " (queued)" : "") +
      (d.head_tokens ? " (on a head of " + d.head_tokens + " tokens)" : ""), "why"));
  tr.dataset.requestId = String(d.request_id);
  tr.dataset.backend = d.backend;
  return tr;
}

function renderDecisions(freshId) {
  const rows = decisions.map((d) => decisionRow(d, d.request_id === freshId));
  document.querySelector("#decisions tbody").replaceChildren(...rows);
}

function onSnapshot(body) {
  renderBackends(body);
  renderCrashLoops(body);
  renderCaches(body);
  renderSide(body);
  renderTotals(body.series);
  renderCharts(body.series);
  if (body.decisions) {
    decisions = body.decisions.slice(-MAX_DECISIONS).reverse();
    renderDecisions(null);
  }
  snapshots += 1;
  const updated = document.getElementById("updated");
  updated.dataset.snapshots = String(snapshots);
  updated.textContent = "updated " + hhmmss(body.time);
}

function onDecision(d) {
  decisions.unshift(d);
  decisions.length = Math.min(decisions.length, MAX_DECISIONS);
  renderDecisions(d.request_id);
}

function setConn(text, kind) {
  const c = document.getElementById("conn");
  c.className = "pill " + kind;
  c.textContent = text;
  c.dataset.state = text;
}

function connect() {
  const source = new EventSource("/kvroute/events");
  source.addEventListener("open", () => setConn("live", "ok"));
  source.addEventListener("error", () => setConn("reconnecting", "warn"));
  source.addEventListener("snapshot", (e) => onSnapshot(JSON.parse(e.data)));
  source.addEventListener("decision", (e) => onDecision(JSON.parse(e.data)));
}

connect();
