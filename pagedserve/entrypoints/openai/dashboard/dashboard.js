// pagedserve live dashboard: polls /debug/stats, /v1/requests and /debug/memory and draws them
// as SVG. No framework, no external resources. The API key (if the server has one) is sent as a
// bearer header; it comes from a form, or from #key=... in the URL, and stays in sessionStorage.
"use strict";

const KEY_STORAGE = "pagedserve.apiKey";
const SVG_NS = "http://www.w3.org/2000/svg";
const POLL_MS = { stats: 1000, requests: 1500, memory: 5000, detail: 2000 };
const GANTT_MAX_ROWS = 40;
const GANTT_MAX_SPAN_S = 180;
const SEGMENT_KINDS = [
  ["queued", "queued", "var(--queued)"],
  ["admission_wait", "admission wait", "var(--admission)"],
  ["prefill", "prefill chunk", "var(--prefill)"],
  ["decode", "decode run", "var(--decode)"],
  ["preempted", "preempted", "var(--preempted)"],
];

const state = {
  key: null,
  authBlocked: false,  // a data call got 401: polling waits for a key
  clockOffset: 0,      // server unix time - browser unix time
  requests: [],
  selected: null,      // sequence id shown in the drawer
};

// ---- small helpers ---------------------------------------------------------------------------

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const serverNow = () => Date.now() / 1000 + state.clockOffset;

function svgEl(name, attrs, parent) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function htmlEl(name, attrs, text) {
  const el = document.createElement(name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function fmtNum(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return (v / 1000).toFixed(1) + "k";
  return v.toFixed(Math.abs(v) >= 100 ? 0 : digits);
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : s < 0.1 ? 1 : 0) + " ms";
  if (s < 60) return s.toFixed(2) + " s";
  return (s / 60).toFixed(1) + " min";
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Math.abs(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (n < 0 ? "-" : "") + v.toFixed(i === 0 ? 0 : 1) + " " + units[i];
}

const fmtPct = (v) => (v === null || v === undefined ? "–" : (v * 100).toFixed(1) + "%");

// ---- the API key and data calls ---------------------------------------------------------------

class AuthError extends Error {}

function loadKey() {
  const match = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (match) {
    sessionStorage.setItem(KEY_STORAGE, decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);  // off the address bar
  }
  state.key = sessionStorage.getItem(KEY_STORAGE);
}

async function api(path) {
  const headers = { Accept: "application/json" };
  if (state.key) headers.Authorization = "Bearer " + state.key;
  const response = await fetch(path, { headers, cache: "no-store" });
  document.body.dataset.lastStatus = String(response.status);
  if (response.status === 401) throw new AuthError("401 Unauthorized");
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message || message; } catch (_) { /* keep */ }
    const error = new Error(message);
    error.status = response.status;
    throw error;
  }
  return response.json();
}

function showKeyPrompt() {
  const wrongKey = Boolean(state.key);
  state.authBlocked = true;
  setConnection(false, wrongKey ? "API key rejected" : "API key required");
  const message = $("key-message");
  if (wrongKey) {
    message.textContent = "The server rejected this key (401 Unauthorized). Check the key the " +
      "server was started with (--api-key or PAGEDSERVE_API_KEY) and try again.";
    message.className = "bad";
  }
  document.body.dataset.auth = wrongKey ? "rejected" : "required";
  if ($("key-prompt").hidden) {
    $("key-prompt").hidden = false;
    $("key-input").value = "";
    $("key-input").focus();
  }
}

function submitKey(event) {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  state.key = key;
  sessionStorage.setItem(KEY_STORAGE, key);
  $("key-prompt").hidden = true;
  document.body.dataset.auth = "checking";
  state.authBlocked = false;
  pollOnce("stats", pollStats);  // at once: says right away whether the key works
}

function setConnection(ok, text) {
  $("conn-dot").className = "dot " + (ok ? "ok" : "bad");
  $("conn-text").textContent = text;
}

const pollErrors = {};

async function pollOnce(name, fn) {
  if (state.authBlocked) return;
  try {
    await fn();
    delete pollErrors[name];
    document.body.dataset.auth = "ok";
    if (!Object.keys(pollErrors).length) {
      setConnection(true, "live · " + new Date().toLocaleTimeString());
    }
  } catch (error) {
    if (error instanceof AuthError) { showKeyPrompt(); return; }
    pollErrors[name] = error.message;
    if (error.status === undefined) setConnection(false, "server unreachable");
  }
}

async function pollLoop(name, fn, ms) {
  for (;;) {
    await pollOnce(name, fn);
    await sleep(ms);
  }
}

// ---- line charts -------------------------------------------------------------------------------

const CHARTS = {
  throughput: { unit: " tok/s", series: [
    ["prompt", "prompt_tokens_per_s", "#3b82f6"], ["output", "generation_tokens_per_s", "#10b981"]] },
  ttft: { seconds: true, series: [
    ["p50", "ttft_p50_s", "#10b981"], ["p90", "ttft_p90_s", "#f59e0b"], ["p99", "ttft_p99_s", "#ef4444"]] },
  itl: { seconds: true, series: [
    ["p50", "itl_p50_s", "#10b981"], ["p90", "itl_p90_s", "#f59e0b"], ["p99", "itl_p99_s", "#ef4444"]] },
  requests: { integer: true, series: [
    ["running", "num_running", "#2563eb"], ["waiting", "num_waiting", "#f59e0b"]] },
  kv: { percent: true, fixedMax: 1, markPreemptions: true, series: [
    ["used (peak per second)", "kv_cache_usage", "#8b5cf6"]] },
  prefix: { percent: true, fixedMax: 1, series: [["hit rate", "prefix_cache_hit_rate", "#0ea5e9"]] },
};

function formatValue(chart, v) {
  if (v === null || v === undefined) return "–";
  if (chart.seconds) return fmtSeconds(v);
  if (chart.percent) return fmtPct(v);
  if (chart.integer) return String(Math.round(v));
  return fmtNum(v) + (chart.unit || "");
}

function formatAxis(chart, v) {
  if (chart.seconds) return v >= 1 ? `${+v.toFixed(2)}s` : `${+(v * 1000).toFixed(1)}ms`;
  if (chart.percent) return `${Math.round(v * 100)}%`;
  return v >= 1000 ? `${+(v / 1000).toFixed(1)}k` : String(+v.toFixed(2));
}

function niceMax(v) {
  if (v <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function chartSpan(points, windowS, now) {
  // A fresh server has little history: zoom to it (at least 30 s) rather than squeeze it right.
  if (!points.length) return windowS;
  return Math.min(windowS, Math.max(30, now - points[0].t + 2));
}

function drawChart(name, points, windowS, now) {
  const chart = CHARTS[name];
  const svg = document.querySelector(`svg[data-chart="${name}"]`);
  const width = svg.clientWidth || 400;
  const height = svg.clientHeight || 150;
  const pad = { left: 44, right: 8, top: 8, bottom: 18 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.replaceChildren();

  let max = 0;
  for (const p of points) {
    for (const [, key] of chart.series) if (p[key] !== null && p[key] > max) max = p[key];
  }
  svg.dataset.points = String(points.length);
  svg.dataset.max = String(max);
  const yMax = chart.fixedMax
    || (chart.integer ? Math.max(4, Math.ceil((max * 1.1) / 4) * 4) : niceMax(max * 1.1));
  const t0 = now - windowS;
  const x = (t) => pad.left + ((t - t0) / windowS) * plotW;
  const y = (v) => pad.top + plotH - (v / yMax) * plotH;

  const grid = svgEl("g", { class: "grid" }, svg);
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    svgEl("line", { x1: pad.left, x2: width - pad.right, y1: y(v), y2: y(v) }, grid);
    svgEl("text", { x: pad.left - 6, y: y(v) + 3, "text-anchor": "end" }, svg).textContent =
      formatAxis(chart, v);
  }
  const tick = [5, 10, 15, 30, 60].find((s) => windowS / s <= 6) || 60;
  for (let ago = 0; ago <= windowS; ago += tick) {
    const label = ago === 0 ? "now" : ago % 60 ? `-${ago}s` : `-${ago / 60}m`;
    svgEl("text", { x: x(now - ago), y: height - 4,
      "text-anchor": ago === 0 ? "end" : "middle" }, svg).textContent = label;
  }
  if (chart.markPreemptions) {
    for (const p of points) {
      if (p.num_preemptions > 0) {
        const line = svgEl("line", { x1: x(p.t), x2: x(p.t), y1: pad.top, y2: pad.top + plotH,
          stroke: "#ef4444", "stroke-dasharray": "2 2", class: "preemption-mark" }, svg);
        svgEl("title", {}, line).textContent = `${p.num_preemptions} preemption(s)`;
      }
    }
  }
  for (const [label, key, color] of chart.series) {
    let d = "";
    let pen = false;
    const present = (p) => p && p[key] !== null && p[key] !== undefined && p.t >= t0;
    points.forEach((p, i) => {
      if (!present(p)) { pen = false; return; }
      d += (pen ? "L" : "M") + x(p.t).toFixed(1) + " " + y(p[key]).toFixed(1);
      if (!pen && !present(points[i + 1])) {  // an isolated point: a dot, not an empty path
        svgEl("circle", { cx: x(p.t), cy: y(p[key]), r: 2.2, fill: color }, svg);
      }
      pen = true;
    });
    if (d) svgEl("path", { d, fill: "none", stroke: color, "stroke-width": 1.8,
      "stroke-linejoin": "round", "data-series": label }, svg);
  }

  const legend = document.querySelector(`[data-legend="${name}"]`);
  legend.replaceChildren();
  const last = points.length ? points[points.length - 1] : null;
  for (const [label, key, color] of chart.series) {
    const item = htmlEl("span");
    item.appendChild(htmlEl("span", { class: "sw", style: `background:${color}` }));
    item.appendChild(document.createTextNode(label + " "));
    item.appendChild(htmlEl("b", {}, last ? formatValue(chart, last[key]) : "–"));
    legend.appendChild(item);
  }
}

async function pollStats() {
  let data;
  try {
    data = await api("/debug/stats");
  } catch (error) {
    if (!(error instanceof AuthError)) {
      $("stats-note").textContent = "Live stats unavailable: " + error.message;
      $("stats-note").className = "note bad";
    }
    throw error;
  }
  state.clockOffset = data.now - Date.now() / 1000;
  $("stats-note").textContent = `One point per ~${data.bucket_s} s over the last ` +
    `${Math.round(data.window_s / 60)} min; latency percentiles over the last ` +
    `${data.latency_window_s} s; gauges are each second's peak.`;
  $("stats-note").className = "note";
  const span = chartSpan(data.points, data.window_s, data.now);
  for (const name of Object.keys(CHARTS)) drawChart(name, data.points, span, data.now);
  const last = data.points.length ? data.points[data.points.length - 1] : {};
  const latest = data.latest || {};
  $("tile-gen").textContent = fmtNum(last.generation_tokens_per_s);
  $("tile-prompt").textContent = fmtNum(last.prompt_tokens_per_s);
  $("tile-reqs").textContent = latest.num_running === undefined ? "–"
    : `${latest.num_running} / ${latest.num_waiting}`;
  $("tile-kv").textContent = fmtPct(latest.kv_cache_usage);
  $("tile-ttft").textContent = `${fmtSeconds(last.ttft_p50_s)} / ${fmtSeconds(last.ttft_p99_s)}`;
  $("tile-itl").textContent = `${fmtSeconds(last.itl_p50_s)} / ${fmtSeconds(last.itl_p99_s)}`;
}

// ---- memory ---------------------------------------------------------------------------------

const MEMORY_COLORS = ["#2563eb", "#10b981", "#8b5cf6", "#f59e0b", "#0ea5e9", "#ec4899",
  "#14b8a6", "#a3a3a3"];

function stackBar(container, parts) {
  container.replaceChildren();
  const total = parts.reduce((sum, p) => sum + Math.max(p.value, 0), 0) || 1;
  for (const part of parts) {
    if (part.value <= 0) continue;
    const div = htmlEl("div", { style: `width:${(100 * part.value) / total}%;background:${part.color}`,
      title: `${part.label}: ${part.text}`, "data-part": part.label });
    container.appendChild(div);
  }
}

async function pollMemory() {
  let data;
  try {
    data = await api("/debug/memory");
  } catch (error) {
    if (!(error instanceof AuthError)) {
      $("memory-note").textContent = "Memory breakdown unavailable: " + error.message;
      $("memory-note").className = "note bad";
    }
    throw error;
  }
  $("memory-note").textContent = "";
  const components = Object.entries(data.components || {}).filter(([, v]) => v > 0)
    .sort((a, b) => b[1] - a[1]);
  const parts = components.map(([name, bytes], i) => ({ label: name, value: bytes,
    text: fmtBytes(bytes), color: MEMORY_COLORS[i % (MEMORY_COLORS.length - 1)] }));
  if (data.unattributed_bytes > 0) {
    parts.push({ label: "unattributed", value: data.unattributed_bytes,
      text: fmtBytes(data.unattributed_bytes), color: MEMORY_COLORS[MEMORY_COLORS.length - 1] });
  }
  stackBar($("memory-bar"), parts);
  const total = parts.reduce((s, p) => s + p.value, 0) || 1;
  const table = $("memory-table");
  table.replaceChildren();
  const head = table.insertRow();
  for (const [text, cls] of [["component", ""], ["bytes", "num"], ["share", "num"]]) {
    head.appendChild(htmlEl("th", { class: cls }, text));
  }
  for (const part of parts) {
    const row = table.insertRow();
    row.dataset.component = part.label;
    const cell = row.insertCell();
    cell.appendChild(htmlEl("span", { class: "sw", style: `display:inline-block;width:10px;` +
      `height:10px;border-radius:2px;margin-right:6px;background:${part.color}` }));
    cell.appendChild(document.createTextNode(part.label));
    row.appendChild(htmlEl("td", { class: "num" }, part.text));
    row.appendChild(htmlEl("td", { class: "num" }, ((100 * part.value) / total).toFixed(1) + "%"));
  }
  const weights = components.filter(([n]) => n.startsWith("weights")).reduce((s, [, v]) => s + v, 0);
  const card = $("memory");
  card.dataset.weightsBytes = String(weights);
  card.dataset.kvBytes = String((data.components || {}).kv_pool || 0);
  const proc = data.process || {};
  $("memory-rss").textContent = `RSS ${fmtBytes(proc.rss_bytes)} (+${fmtBytes(proc.rss_growth_bytes)}` +
    ` since start) · attributed ${fmtBytes(data.attributed_bytes)}`;

  const pool = data.kv_pool;
  if (pool) {
    stackBar($("kv-pool-bar"), [
      { label: "used", value: pool.used_blocks, text: `${pool.used_blocks} blocks`, color: "#8b5cf6" },
      { label: "cached (free)", value: pool.cached_free_blocks,
        text: `${pool.cached_free_blocks} blocks`, color: "#c4b5fd" },
      { label: "free", value: pool.free_blocks, text: `${pool.free_blocks} blocks`, color: "#e5e7eb" },
    ]);
    $("kv-pool-text").textContent = `${pool.used_blocks} used · ${pool.cached_free_blocks} cached ` +
      `(reusable) · ${pool.free_blocks} free of ${pool.num_blocks} blocks × ${pool.block_size} ` +
      `tokens (${fmtBytes(pool.bytes_per_block)} each)`;
  }
  const capacity = $("capacity-table");
  capacity.replaceChildren();
  const capHead = capacity.insertRow();
  capHead.appendChild(htmlEl("th", {}, "context length"));
  capHead.appendChild(htmlEl("th", { class: "num" }, "max concurrent requests"));
  for (const row of data.capacity || []) {
    const tr = capacity.insertRow();
    tr.appendChild(htmlEl("td", {}, `${row.context_len} tokens`));
    tr.appendChild(htmlEl("td", { class: "num" }, String(row.max_requests)));
  }
}

// ---- the Gantt chart of recent requests -------------------------------------------------------

function segmentEnd(timeline, segment, now) {
  if (segment.end !== null && segment.end !== undefined) return timeline.arrival_time + segment.end;
  return now;  // still open
}

function drawGantt() {
  const svg = $("gantt");
  const now = serverNow();
  const rows = state.requests.slice(0, GANTT_MAX_ROWS).reverse();  // oldest on top
  const width = svg.clientWidth || 1000;
  const labelW = 250;
  const rowH = 20;
  const axisH = 20;
  const height = axisH + rows.length * rowH + 4;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("height", height);
  svg.replaceChildren();
  svg.dataset.rows = String(rows.length);
  if (!rows.length) {
    $("gantt-note").textContent = "No requests yet: send some load to the server.";
    return;
  }
  $("gantt-note").textContent = "";
  const t0 = Math.max(Math.min(...rows.map((r) => r.arrival_time)), now - GANTT_MAX_SPAN_S);
  const span = Math.max(now - t0, 5);
  const plotW = width - labelW - 10;
  const x = (t) => labelW + Math.max(0, Math.min(1, (t - (now - span)) / span)) * plotW;

  // time axis: ~8 ticks at round seconds
  const step = [0.5, 1, 2, 5, 10, 15, 30, 60, 120].find((s) => span / s <= 8) || 300;
  const grid = svgEl("g", { class: "grid" }, svg);
  for (let ago = 0; ago <= span; ago += step) {
    const xt = x(now - ago);
    svgEl("line", { x1: xt, x2: xt, y1: axisH - 4, y2: height }, grid);
    svgEl("text", { x: xt, y: axisH - 8, "text-anchor": ago === 0 ? "end" : "middle" }, svg)
      .textContent = ago === 0 ? "now" : `-${ago}s`;
  }
  rows.forEach((timeline, i) => {
    const y = axisH + i * rowH;
    const g = svgEl("g", { class: "gantt-row", "data-request-id": timeline.request_id,
      "data-sequence-id": timeline.sequence_id, "data-state": timeline.state }, svg);
    if (timeline.sequence_id === state.selected) g.classList.add("selected");
    svgEl("rect", { class: "row-bg", x: 0, y, width, height: rowH, fill: i % 2 ? "#fafafa" : "#fff" }, g);
    const shortId = timeline.sequence_id.length > 18
      ? timeline.sequence_id.slice(0, 9) + "…" + timeline.sequence_id.slice(-6) : timeline.sequence_id;
    svgEl("text", { class: "label mono", x: 6, y: y + 14 }, g).textContent = shortId;
    svgEl("text", { class: "sub", x: labelW - 8, y: y + 14, "text-anchor": "end" }, g).textContent =
      `${timeline.num_prompt_tokens}→${timeline.num_output_tokens} tok · ${timeline.state}`;
    for (const segment of timeline.segments) {
      if (segment.start === null || segment.start === undefined) continue;
      const start = timeline.arrival_time + segment.start;
      const end = segmentEnd(timeline, segment, now);
      if (end < now - span) continue;
      const x1 = x(start);
      const open = segment.end === null || segment.end === undefined;
      const rect = svgEl("rect", { class: `seg ${segment.kind}${open ? " open" : ""}`, x: x1,
        y: y + 3, width: Math.max(x(end) - x1, 1.5), height: rowH - 6, rx: 2,
        "data-kind": segment.kind }, g);
      const tokens = segment.num_tokens !== undefined ? `, ${segment.num_tokens} tokens` : "";
      const steps = segment.num_steps ? `, ${segment.num_steps} steps` : "";
      svgEl("title", {}, rect).textContent =
        `${segment.kind}: ${fmtSeconds(end - start)}${tokens}${steps}` +
        (segment.first_step !== undefined ? ` (step ${segment.first_step})` : "");
    }
    const firstToken = timeline.events.find((e) => e.type === "first_token");
    if (firstToken && firstToken.t !== null) {
      const xf = x(timeline.arrival_time + firstToken.t);
      svgEl("path", { class: "mark-first-token", d: `M${xf} ${y + 2}l3 -0l-3 4l-3 -4z` }, g);
    }
    g.addEventListener("click", () => openDetail(timeline.sequence_id));
  });
}

async function pollRequests() {
  let data;
  try {
    data = await api(`/v1/requests?limit=${GANTT_MAX_ROWS}`);
  } catch (error) {
    if (!(error instanceof AuthError)) {
      $("gantt-note").textContent = "Request timelines unavailable: " + error.message;
    }
    throw error;
  }
  state.requests = data.data || [];
  drawGantt();
}

function drawGanttLegend() {
  const legend = $("gantt-legend");
  for (const [, label, color] of SEGMENT_KINDS) {
    const item = htmlEl("span");
    item.appendChild(htmlEl("span", { class: "sw", style: `background:${color}` }));
    item.appendChild(document.createTextNode(label));
    legend.appendChild(item);
  }
  const ft = htmlEl("span");
  ft.appendChild(htmlEl("span", { class: "sw", style: "background:#111827;width:6px" }));
  ft.appendChild(document.createTextNode("first token"));
  legend.appendChild(ft);
}

// ---- one request's timeline (the drawer) -------------------------------------------------------

let detailTimer = null;

async function openDetail(sequenceId) {
  state.selected = sequenceId;
  for (const row of document.querySelectorAll(".gantt-row")) {
    row.classList.toggle("selected", row.dataset.sequenceId === sequenceId);
  }
  const drawer = $("detail");
  drawer.hidden = false;
  drawer.dataset.requestId = "";
  drawer.dataset.loaded = "false";
  $("detail-id").textContent = sequenceId;
  $("detail-body").replaceChildren(htmlEl("p", { class: "muted" }, "loading…"));
  clearTimeout(detailTimer);
  await refreshDetail();
}

function closeDetail() {
  state.selected = null;
  clearTimeout(detailTimer);
  $("detail").hidden = true;
  for (const row of document.querySelectorAll(".gantt-row.selected")) row.classList.remove("selected");
}

async function refreshDetail() {
  const sequenceId = state.selected;
  if (!sequenceId) return;
  try {
    const timeline = await api(`/v1/requests/${encodeURIComponent(sequenceId)}/timeline`);
    if (state.selected !== sequenceId) return;
    renderDetail(timeline);
    if (timeline.state !== "finished") {
      detailTimer = setTimeout(refreshDetail, POLL_MS.detail);
    }
  } catch (error) {
    if (error instanceof AuthError) { showKeyPrompt(); return; }
    $("detail-body").replaceChildren(htmlEl("p", { class: "note bad" },
      "Could not load this timeline: " + error.message));
  }
}

function table(headers, rows) {
  const t = htmlEl("table", { class: "table" });
  const head = t.insertRow();
  for (const h of headers) head.appendChild(htmlEl("th", {}, h));
  for (const row of rows) {
    const tr = t.insertRow();
    for (const cell of row) tr.appendChild(htmlEl("td", {}, cell));
  }
  return t;
}

function describeEvent(event) {
  const skip = new Set(["t", "type"]);
  return Object.entries(event).filter(([k, v]) => !skip.has(k) && v !== null && v !== false)
    .map(([k, v]) => `${k}=${v}`).join(", ");
}

function renderDetail(timeline) {
  const drawer = $("detail");
  drawer.dataset.requestId = timeline.request_id;
  drawer.dataset.loaded = "true";
  $("detail-id").textContent = timeline.request_id;
  const s = timeline.summary || {};
  const body = $("detail-body");
  body.replaceChildren();

  const status = htmlEl("p");
  status.appendChild(htmlEl("span", { class: `badge ${timeline.state}` }, timeline.state));
  const finish = timeline.finish_reason ? ` · finish: ${timeline.finish_reason}` : "";
  const seq = timeline.sequence_id !== timeline.request_id ? ` · sequence ${timeline.sequence_id}` : "";
  status.appendChild(document.createTextNode(
    ` arrived ${new Date(timeline.arrival_time * 1000).toLocaleTimeString()}${finish}${seq}`));
  body.appendChild(status);
  body.appendChild(htmlEl("div", { class: "explanation", id: "detail-explanation" },
    s.explanation || "no explanation yet"));

  const cached = Object.entries(s.cached_tokens || {}).map(([k, v]) => `${v} (${k})`).join(", ");
  const facts = [
    ["prompt tokens", timeline.num_prompt_tokens], ["output tokens", timeline.num_output_tokens],
    ["cached tokens", cached || "0"], ["TTFT", fmtSeconds(s.ttft_s)],
    ["queue", fmtSeconds(s.queue_s)], ["prefill", fmtSeconds(s.prefill_s)],
    ["decode", fmtSeconds(s.decode_s)], ["end to end", fmtSeconds(s.e2e_s)],
    ["prefill chunks", s.num_prefill_chunks], ["decode steps", s.num_decode_steps],
    ["preemptions", s.num_preemptions], ["recomputed tokens", s.num_recomputed_tokens],
  ];
  const grid = htmlEl("div", { class: "kv-grid" });
  for (const [label, value] of facts) {
    const cell = htmlEl("div");
    cell.appendChild(htmlEl("span", {}, label));
    cell.appendChild(htmlEl("b", {}, value === undefined || value === null ? "–" : String(value)));
    grid.appendChild(cell);
  }
  body.appendChild(grid);

  const breakdown = s.ttft_breakdown;
  body.appendChild(htmlEl("h3", {}, "TTFT breakdown"));
  if (breakdown) {
    const colors = { admission_wait_s: "#a78bfa", queued_s: "#cbd5e1", in_steps_s: "#3b82f6",
      preempted_s: "#ef4444", between_steps_s: "#f59e0b" };
    const parts = Object.entries(breakdown).map(([k, v]) => ({ label: k.replace(/_s$/, ""),
      value: v || 0, text: fmtSeconds(v), color: colors[k] || "#a3a3a3" }));
    const bar = htmlEl("div", { class: "stackbar small", id: "detail-ttft-bar" });
    stackBar(bar, parts);
    body.appendChild(bar);
    body.appendChild(table(["part", "seconds"], parts.map((p) => [p.label.replace(/_/g, " "), p.text])));
  } else {
    body.appendChild(htmlEl("p", { class: "muted" }, "no first token yet"));
  }

  body.appendChild(htmlEl("h3", {}, "Segments"));
  body.appendChild(table(["kind", "start", "end", "tokens", "step"], timeline.segments.map((g) => [
    g.kind, fmtSeconds(g.start), g.end === null ? "open" : fmtSeconds(g.end),
    g.num_tokens === undefined ? "" : String(g.num_tokens),
    g.first_step === undefined ? (g.step === undefined ? "" : String(g.step))
      : (g.last_step !== undefined && g.last_step !== g.first_step
        ? `${g.first_step}–${g.last_step}` : String(g.first_step))])));

  body.appendChild(htmlEl("h3", {}, "Events"));
  body.appendChild(table(["t", "event", "details"], timeline.events.map((e) => [
    fmtSeconds(e.t), e.type, describeEvent(e)])));

  body.appendChild(htmlEl("h3", {}, "Inter-token latency"));
  const itl = timeline.itl;
  body.appendChild(itl ? table(["count", "mean", "p50", "p90", "p99", "max"], [[String(itl.count),
    fmtSeconds(itl.mean_s), fmtSeconds(itl.p50_s), fmtSeconds(itl.p90_s), fmtSeconds(itl.p99_s),
    fmtSeconds(itl.max_s)]]) : htmlEl("p", { class: "muted" }, "fewer than two tokens so far"));
  if (timeline.speculative) {
    const sp = timeline.speculative;
    body.appendChild(htmlEl("h3", {}, "Speculative decoding"));
    body.appendChild(htmlEl("p", {}, `${sp.num_accepted_tokens} of ${sp.num_draft_tokens} draft ` +
      `tokens accepted (${fmtPct(sp.acceptance_rate)}) in ${sp.num_drafts} drafts`));
  }
  if (timeline.grammar) {
    body.appendChild(htmlEl("h3", {}, "Grammar"));
    body.appendChild(htmlEl("p", {}, `compiled in ${fmtSeconds(timeline.grammar.wait_s)}`));
  }
  const raw = htmlEl("details");
  raw.appendChild(htmlEl("summary", {}, "raw JSON"));
  raw.appendChild(htmlEl("pre", {}, JSON.stringify(timeline, null, 2)));
  body.appendChild(raw);
}

// ---- start -------------------------------------------------------------------------------------

function start() {
  loadKey();
  drawGanttLegend();
  $("key-form").addEventListener("submit", submitKey);
  $("key-button").addEventListener("click", () => {
    $("key-prompt").hidden = false;
    $("key-input").focus();
  });
  $("detail-close").addEventListener("click", closeDetail);
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeDetail(); });
  window.addEventListener("resize", drawGantt);
  pollLoop("stats", pollStats, POLL_MS.stats);
  pollLoop("requests", pollRequests, POLL_MS.requests);
  pollLoop("memory", pollMemory, POLL_MS.memory);
}

start();
