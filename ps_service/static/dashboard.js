// syncps dashboard: polls the PS's monitoring API once a second and draws with plain SVG.
// No dependencies, no build step. Every fetch has a timeout; worker names go in as text, never HTML.
"use strict";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 4000;
const RATE_SAMPLES = 300;
const MAX_LOSS_POINTS = 20000;
const SVG_NS = "http://www.w3.org/2000/svg";
const PAD_L = 40, PAD_R = 12, PAD_T = 10, PAD_B = 24;  // CSS px around the plot area (left: at least)
const LOSS_SCALE_KEY = "syncps-loss-scale";  // localStorage: "log" (the default) or "linear"

const lossSteps = [], lossValues = [];
const rateTimes = [], rateValues = [];
let lastLossStep = -1;
let polls = 0;  // answered polls, shown as <body data-polls> (a test waits for the next render with it)

const $ = (id) => document.getElementById(id);

// With PS_MONITOR_TOKEN set, open the page as /#token=<token>: the token stays in this tab (sessionStorage),
// leaves the address bar, and goes to the API as a bearer header (the fragment is never sent to a server).
const TOKEN = (() => {
  const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
  if (m) {
    sessionStorage.setItem("syncps-token", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("syncps-token");
})();

async function getJSON(path) {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), FETCH_TIMEOUT_MS);
  try {
    const headers = TOKEN ? { Authorization: `Bearer ${TOKEN}` } : {};
    const resp = await fetch(path, { signal: ctl.signal, cache: "no-store", headers });
    if (resp.status === 401) throw new Error("unauthorized: open this page as /#token=<PS_MONITOR_TOKEN>");
    if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
    return await resp.json();
  } finally {
    clearTimeout(timer);
  }
}

const SUPERSCRIPT = { "-": "\u207B", 0: "\u2070", 1: "\u00B9", 2: "\u00B2", 3: "\u00B3", 4: "\u2074", 5: "\u2075",
  6: "\u2076", 7: "\u2077", 8: "\u2078", 9: "\u2079" };

// A number for people, never in e-notation: `digits` significant digits; below 0.001 and from a million on as
// 1.23×10⁻⁵ or 3.42×10⁸, from 100000 as a whole number with thousands separators.
function fmt(x, digits = 4) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  if (!Number.isFinite(x)) return x > 0 ? "\u221E" : "-\u221E";
  if (Math.abs(x) >= 1e5 && Math.abs(x) < 1e6) return Math.round(x).toLocaleString("en-US");
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e6)) {
    const [mant, exp] = x.toExponential(digits - 1).split("e");
    return `${Number(mant)}\u00D710${[...String(Number(exp))].map((c) => SUPERSCRIPT[c]).join("")}`;
  }
  return Number(x.toPrecision(digits)).toString();
}

function ms(seconds) { return seconds === null || seconds === undefined ? "-" : (1e3 * seconds).toFixed(1); }

// A duration for people: "0.5 ms", "42 ms", "3.2 s", "17 s", "2 min", "1 h 5 min", "2 d 3 h".
function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "-";
  s = Math.max(0, s);
  if (s < 0.00005) return "< 0.1 ms";
  if (s < 0.00995) return `${(1e3 * s).toFixed(1)} ms`;
  if (s < 0.9995) return `${Math.round(1e3 * s)} ms`;
  if (s < 9.95) return `${s.toFixed(1)} s`;
  s = Math.round(s);
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  return d ? `${d} d ${h} h` : h ? `${h} h ${m} min` : m ? `${m} min` : `${s} s`;
}

function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// "Nice" ticks over [lo, hi]: about `count` multiples of 1, 2 or 5 times a power of ten.
function linearTicks(lo, hi, count = 4) {
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((k) => k * mag).find((k) => k >= raw * (1 - 1e-9));
  if (!(step > 0 && Number.isFinite(step))) return [lo, hi];  // an empty or denormal range: its ends
  const ticks = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) ticks.push(i * step);
  return ticks;
}

// Ticks of a log axis over [lo, hi] (log10 units): decades (1, 2, 5 within each when it spans two or fewer),
// else nice linear values within the range; at least the ends.
function logTicks(lo, hi) {
  const span = hi - lo, every = Math.max(1, Math.ceil(span / 5)), mants = span <= 2 ? [1, 2, 5] : [1];
  let ticks = [];
  for (let d = Math.floor(lo / every) * every; d <= hi; d += every)
    for (const v of mants.map((m) => d + Math.log10(m))) if (v >= lo - 1e-9 && v <= hi + 1e-9) ticks.push(v);
  if (ticks.length < 2) ticks = linearTicks(10 ** lo, 10 ** hi, 3).filter((v) => v > 0).map(Math.log10);
  return ticks.length < 2 ? [lo, hi] : ticks;
}

// Draw a line plot of (xs, ys) into svg in the svg's own CSS pixels, so labels keep their font size at any
// width (a resize redraws it); the plot starts right of its widest y label. scale "log" draws log10(y) when
// every y > 0, else linear; svg's data-scale says which was drawn. Returns that scale.
function plot(svg, xs, ys, { scale = "linear", cls = "line", xLabel = (x) => fmt(x) } = {}) {
  svg.plotArgs = [xs, ys, { scale, cls, xLabel }];
  const W = Math.max(200, svg.clientWidth), H = Math.max(120, svg.clientHeight);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  svg.setAttribute("data-points", String(xs.length));
  const useLog = scale === "log" && ys.every((y) => y > 0);
  svg.dataset.scale = useLog ? "log" : "linear";
  const right = W - PAD_R, top = PAD_T, bottom = H - PAD_B;
  const axes = (left) => svg.append(svgEl("line", { class: "axis", x1: left, y1: bottom, x2: right, y2: bottom }),
                                    svgEl("line", { class: "axis", x1: left, y1: top, x2: left, y2: bottom }));
  if (xs.length === 0) {
    axes(PAD_L);
    svg.append(svgEl("text", { class: "tick", x: PAD_L + 8, y: top + 16 }, "waiting for data"));
    return svg.dataset.scale;
  }
  const ty = useLog ? (y) => Math.log10(y) : (y) => y;
  let x0 = xs[0], x1 = xs[xs.length - 1];
  let y0 = Infinity, y1 = -Infinity;
  for (const y of ys) { const v = ty(y); if (v < y0) y0 = v; if (v > y1) y1 = v; }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { const d = useLog ? 0.1 : Math.abs(y0) / 10 || 0.5; y1 += d; y0 -= d; }
  const syv = (v) => bottom - ((v - y0) / (y1 - y0)) * (bottom - top);
  const label = (v) => svg.appendChild(svgEl("text", { class: "tick y", "text-anchor": "end",
                                                      "dominant-baseline": "middle" }, fmt(useLog ? 10 ** v : v, 3)));
  const ticks = (useLog ? logTicks(y0, y1) : linearTicks(y0, y1)).map((v) => [syv(v).toFixed(1), label(v)]);
  const left = Math.max(PAD_L, 10 + Math.ceil(Math.max(...ticks.map(([, t]) => t.getComputedTextLength()))));
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (right - left);
  axes(left);
  for (const [y, text] of ticks) {
    text.setAttribute("x", left - 5);
    text.setAttribute("y", y);
    svg.append(svgEl("line", { class: "grid", x1: left, y1: y, x2: right, y2: y }));
  }
  // one point per horizontal pixel at most: the path stays small whatever the history length
  const stride = Math.max(1, Math.floor(xs.length / (right - left)));
  const parts = [];
  const at = (i) => `${sx(xs[i]).toFixed(1)},${syv(ty(ys[i])).toFixed(1)}`;
  for (let i = 0; i < xs.length; i += stride) parts.push(`${parts.length ? "L" : "M"}${at(i)}`);
  if ((xs.length - 1) % stride) parts.push(`L${at(xs.length - 1)}`);
  if (xs.length === 1) svg.append(svgEl("circle", { class: cls, cx: sx(xs[0]), cy: syv(ty(ys[0])), r: 2.5 }));
  svg.append(svgEl("path", { class: cls, d: parts.join(" ") }),
             svgEl("text", { class: "tick", x: left, y: H - 6 }, xLabel(x0)),
             svgEl("text", { class: "tick", x: right, y: H - 6, "text-anchor": "end" }, xLabel(x1)));
  return svg.dataset.scale;
}

addEventListener("resize", () => {
  for (const svg of document.querySelectorAll("svg")) if (svg.plotArgs) plot(svg, ...svg.plotArgs);
});

// A table cell holding `content`: text (a number or string) or nodes (a fragment of names).
function cell(tr, content, title) {
  const td = document.createElement("td");
  td.append(content instanceof Node ? content : String(content));
  if (title) td.title = title;  // the whole text where the cell may cut it short
  tr.append(td);
}

// Worker names as text, each in a span.name that never breaks inside (names hold hyphens), joined by `sep`;
// `empty` when there are none.
function names(list, sep = ", ", empty = "-") {
  const frag = document.createDocumentFragment();
  if (!list.length) frag.append(empty);
  list.forEach((n, i) => {
    const span = document.createElement("span");
    span.className = "name";
    span.textContent = n;
    frag.append(...(i ? [sep, span] : [span]));
  });
  return frag;
}

// The open round's line: who pushed, who is awaited (the same list the workers table marks), who came late.
function renderRound(cr, waitReason) {
  const info = $("round-info");
  $("round-step").textContent = cr ? `step ${cr.step}, open ${duration(cr.open_for_seconds)}` : "";
  if (!cr) { info.textContent = waitReason ?? "no open round"; return; }
  const part = (cls, label, list, empty) => {
    const span = document.createElement("span");
    span.className = cls;
    span.append(`${label}: `, names(list, ", ", empty));
    return span;
  };
  info.replaceChildren(part("pushed", "pushed", cr.pushed_by, "nobody yet"), " | ",
                       part("awaited", "awaited", cr.awaited, "nobody"),
                       ...(cr.late.length ? [" | ", part("late", "late", cr.late, "")] : []));
}

function renderStatus(st) {
  const state = $("state");
  state.textContent = st.state.replaceAll("_", " ");
  state.className = `badge ${st.state}`;
  $("step").textContent = String(st.global_step);
  $("max-steps").textContent = st.max_steps === null ? "" : ` / ${st.max_steps}`;
  $("progress-bar").style.width = st.progress === null ? "0" : `${Math.min(100, 100 * st.progress)}%`;
  $("loss-last").textContent = fmt(st.loss.last, 3);
  $("loss-avg").textContent = `${fmt(st.loss.moving_average)} (${st.loss.moving_average_rounds} rounds)`;
  $("rps").textContent = fmt(st.throughput.rounds_per_second, 3);
  $("eps").textContent = fmt(st.throughput.examples_per_second, 3);
  $("gps").textContent = fmt(st.throughput.gradients_per_second, 3);
  renderClocks(st);
  $("workers-active").textContent = `${st.workers.active} active`;
  $("workers-detail").textContent = `${st.workers.expired} expired, ${st.workers.left} left, ${st.workers.membership_changes} changes`;
  const r = st.replicas_to_aggregate === null ? `R = live (${st.effective_replicas_to_aggregate ?? "-"})` : `R = ${st.replicas_to_aggregate}`;
  $("mode").textContent = st.training_mode === "sync"
    ? `${st.mode}, ${r}` + (st.total_num_replicas === null ? "" : `, N = ${st.total_num_replicas}`)
    : st.training_mode + (st.ssp_staleness === null ? "" : `, s = ${st.ssp_staleness}`);
  const opt = st.optimizer;
  $("optimizer").textContent = opt ? Object.entries(opt).map(([k, v]) => k === "name" ? v : `${k}=${v}`).join(" ") : "-";
  $("uptime").textContent = duration(st.uptime_seconds);
  const ck = st.checkpoint;
  $("checkpoint").textContent = ck ? `checkpoint step ${ck.step ?? "-"} (${ck.count ?? 0} written)` : "no checkpoint";
  renderPair(st.pair);
  renderRound(st.round, st.wait_reason);
  rateTimes.push(st.uptime_seconds);
  rateValues.push(st.throughput.rounds_per_second);
  if (rateTimes.length > RATE_SAMPLES) { rateTimes.shift(); rateValues.shift(); }
  plot($("rate-plot"), rateTimes, rateValues, { cls: "line rate", xLabel: (x) => `${Math.round(x)} s` });
}

// a hot-standby pair: this PS's role and term; on the primary its standby and the standby's lag
function renderPair(p) {
  $("pair-card").hidden = !p;
  if (!p) return;
  $("pair").textContent = `${p.role}, term ${p.term}`;
  $("pair-detail").textContent = p.election ? `election: ${p.election.needed} more vote(s) needed`
    : p.role === "standby" ? `${p.synced ? "in sync" : "catching up"}, ${p.applied} messages applied`
    : p.standby === "in_sync" ? `standby in sync, lag ${p.lag_rounds} (${p.lag_bytes} B)`
    : p.standby === "catching_up" ? "standby catching up" : `no standby: alone for ${duration(p.alone_seconds)}`;
}

// async/ssp: the slowest and fastest live clocks, their spread, and the staleness percentiles
function renderClocks(st) {
  const c = st.clocks, s = st.staleness;
  if (!c) {
    $("clocks").textContent = "sync";
    $("clocks-detail").textContent = "the barrier: every worker at the round's step";
    return;
  }
  $("clocks").textContent = c.live ? `${c.slowest}..${c.fastest}` : "-";
  $("clocks-detail").textContent = `spread ${c.spread} (max ${c.max_spread})` +
    (s && s.applied ? ` | staleness p50 ${s.p50}, p90 ${s.p90}, p99 ${s.p99}` : "");
}

// The table of workers; `awaited`: the names the open round waits for, from the same /v1/status answer as the
// round's line (a second request would see the core later: a round may have closed in between).
function renderWorkers(ws, awaited) {
  $("straggler").textContent = ws.straggler ?? "none";
  $("straggler").title = ws.straggler ?? "";
  const top = ws.workers.find((w) => w.name === ws.straggler);
  $("straggler-detail").textContent = top
    ? `slowed ${top.straggler_rounds} of the last ${ws.window_rounds} rounds by ${duration(top.straggler_seconds)}`
    : `over the last ${ws.window_rounds} rounds`;
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of ws.workers) {
    const tr = document.createElement("tr");
    const isAwaited = awaited.has(w.name);
    tr.className = [w.state, w.name === ws.straggler ? "straggler" : "", isAwaited ? "awaited" : ""].join(" ").trim();
    tr.dataset.name = w.name;
    const p = w.pushes, t = w.mean_seconds;
    const clock = w.blocked ? `${w.clock} (waits)` : w.clock ?? "-";
    const state = !isAwaited ? w.state : w.state === "active" ? "awaited" : `${w.state}, awaited`;
    [w.rank, names([w.name]), state, w.transport ?? "-", w.last_step ?? "-", clock,
     w.staleness && w.staleness.mean !== null ? fmt(w.staleness.mean, 3) : "-", p.accepted, p.late, p.stale,
     p.duplicate, ms(t.fetch), ms(t.compute), ms(t.push), w.straggler_rounds,
     w.straggler_rounds ? duration(w.straggler_seconds) : "-", `${duration(w.last_seen_seconds_ago)} ago`]
      .forEach((v, i) => cell(tr, v, i === 1 ? w.name : undefined));
    body.append(tr);
  }
}

function renderRounds(rs) {
  const body = $("rounds").tBodies[0];
  body.replaceChildren();
  for (const r of rs.rounds) {
    const tr = document.createElement("tr");
    const s = r.straggler;
    const straggler = s ? names([s.name]) : "-";
    if (s && s.kind === "never_arrived") straggler.append(" (never came)");
    [r.step, ms(r.duration_seconds), r.reason, names(r.contributors.map((c) => c.name), " \u2192 "), straggler,
     s ? ms(s.waited_seconds) : "-", names(r.missing), names(r.late.map((c) => c.name)), fmt(r.loss)]
      .forEach((v) => cell(tr, v));
    body.append(tr);
  }
}

function renderLoss(curve) {
  if (curve.global_step < lastLossStep) {  // a new job (the PS restarted without a checkpoint): start over
    lossSteps.length = 0; lossValues.length = 0; lastLossStep = -1;
  }
  for (let i = 0; i < curve.steps.length; i++) {
    if (curve.steps[i] > lastLossStep) {
      lossSteps.push(curve.steps[i]);
      lossValues.push(curve.loss[i]);
      lastLossStep = curve.steps[i];
    }
  }
  if (lossSteps.length > MAX_LOSS_POINTS) {
    lossSteps.splice(0, lossSteps.length - MAX_LOSS_POINTS);
    lossValues.splice(0, lossValues.length - MAX_LOSS_POINTS);
  }
  drawLoss();
}

// The loss curve on the scale the "log scale" box asks for (remembered in localStorage; log by default); a
// curve with a loss <= 0 cannot be drawn on a log scale: drawn linear, and the caption says why.
function drawLoss() {
  const wantLog = $("loss-log").checked;
  const drawn = plot($("loss-plot"), lossSteps, lossValues,
                     { scale: wantLog ? "log" : "linear", xLabel: (x) => String(Math.round(x)) });
  $("loss-scale").textContent = wantLog && drawn !== "log" ? "log impossible (a loss \u2264 0): linear" : "";
}

function setupLossScale() {
  const box = $("loss-log");
  let saved = null;
  try { saved = localStorage.getItem(LOSS_SCALE_KEY); } catch { /* storage off: the default, this page only */ }
  box.checked = saved !== "linear";
  box.addEventListener("change", () => {
    try { localStorage.setItem(LOSS_SCALE_KEY, box.checked ? "log" : "linear"); } catch { /* storage off */ }
    drawLoss();
  });
}

async function poll() {
  try {
    const [st, ws, rs, curve] = await Promise.all([
      getJSON("v1/status"), getJSON("v1/workers"), getJSON("v1/rounds?limit=10"), getJSON(`v1/loss?since=${lastLossStep}`),
    ]);
    renderStatus(st);
    renderWorkers(ws, new Set(st.round ? st.round.awaited : []));
    renderRounds(rs);
    renderLoss(curve);
    $("conn").textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.polls = String(++polls);
  } catch (err) {
    // the PS may be restarting: say so on the page and try again (no console noise)
    $("state").textContent = "offline";
    $("state").className = "badge offline";
    $("conn").textContent = `cannot reach the PS (${err.name === "AbortError" ? "timeout" : err.message})`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

setupLossScale();
poll();
