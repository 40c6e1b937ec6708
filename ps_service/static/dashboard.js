// syncps dashboard: polls the PS's monitoring API once a second and draws with plain SVG.
// No dependencies, no build step. Every fetch has a timeout; worker names go in as text, never HTML.
"use strict";

const POLL_MS = 1000;
const FETCH_TIMEOUT_MS = 4000;
const RATE_SAMPLES = 300;
const MAX_LOSS_POINTS = 20000;
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 600, H = 260, PAD_L = 56, PAD_R = 8, PAD_T = 8, PAD_B = 22;

const lossSteps = [], lossValues = [];
const rateTimes = [], rateValues = [];
let lastLossStep = -1;

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

function fmt(x, digits = 4) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(digits - 1);
  return Number(x.toPrecision(digits)).toString();
}

function ms(seconds) { return seconds === null || seconds === undefined ? "-" : (1e3 * seconds).toFixed(1); }

function duration(s) {
  s = Math.floor(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
}

function svgEl(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Draw a line plot of (xs, ys) into svg; logY when asked and every y > 0.
function plot(svg, xs, ys, { logY = false, cls = "line", xLabel = (x) => fmt(x) } = {}) {
  svg.replaceChildren();
  svg.setAttribute("data-points", String(xs.length));
  const left = PAD_L, right = W - PAD_R, top = PAD_T, bottom = H - PAD_B;
  svg.append(svgEl("line", { class: "axis", x1: left, y1: bottom, x2: right, y2: bottom }),
             svgEl("line", { class: "axis", x1: left, y1: top, x2: left, y2: bottom }));
  if (xs.length === 0) {
    svg.append(svgEl("text", { class: "tick", x: left + 8, y: top + 16 }, "waiting for data"));
    return;
  }
  const useLog = logY && ys.every((y) => y > 0);
  const ty = useLog ? (y) => Math.log10(y) : (y) => y;
  let x0 = xs[0], x1 = xs[xs.length - 1];
  let y0 = Infinity, y1 = -Infinity;
  for (const y of ys) { const v = ty(y); if (v < y0) y0 = v; if (v > y1) y1 = v; }
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y1 += 0.5; y0 -= 0.5; }
  const sx = (x) => left + ((x - x0) / (x1 - x0)) * (right - left);
  const sy = (y) => bottom - ((ty(y) - y0) / (y1 - y0)) * (bottom - top);
  // one point per horizontal pixel at most: the path stays small whatever the history length
  const stride = Math.max(1, Math.floor(xs.length / (right - left)));
  const parts = [];
  for (let i = 0; i < xs.length; i += stride) parts.push(`${parts.length ? "L" : "M"}${sx(xs[i]).toFixed(1)},${sy(ys[i]).toFixed(1)}`);
  if ((xs.length - 1) % stride) parts.push(`L${sx(xs[xs.length - 1]).toFixed(1)},${sy(ys[ys.length - 1]).toFixed(1)}`);
  svg.append(svgEl("path", { class: cls, d: parts.join(" ") }));
  const yTick = (v) => fmt(useLog ? 10 ** v : v, 3);
  svg.append(svgEl("text", { class: "tick", x: 2, y: top + 10 }, yTick(y1)),
             svgEl("text", { class: "tick", x: 2, y: bottom }, yTick(y0)),
             svgEl("text", { class: "tick", x: left, y: H - 4 }, xLabel(x0)),
             svgEl("text", { class: "tick", x: right - 40, y: H - 4 }, xLabel(x1)));
}

function cell(tr, text, title) {
  const td = document.createElement("td");
  td.textContent = text;
  if (title) td.title = title;  // the whole text where the cell may cut it short
  tr.append(td);
}

function renderStatus(st) {
  const state = $("state");
  state.textContent = st.state.replaceAll("_", " ");
  state.className = `badge ${st.state}`;
  $("step").textContent = String(st.global_step);
  $("max-steps").textContent = st.max_steps === null ? "" : ` / ${st.max_steps}`;
  $("progress-bar").style.width = st.progress === null ? "0" : `${Math.min(100, 100 * st.progress)}%`;
  $("loss-last").textContent = fmt(st.loss.last);
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
  const cr = st.round;
  $("round-step").textContent = cr ? `step ${cr.step}, open ${fmt(cr.open_for_seconds, 3)} s` : "";
  $("round-info").textContent = cr
    ? `pushed: ${cr.pushed_by.join(", ") || "nobody yet"} | awaited: ${cr.awaited.join(", ") || "nobody"}` +
      (cr.late.length ? ` | late: ${cr.late.join(", ")}` : "")
    : st.wait_reason ?? "no open round";
  rateTimes.push(st.uptime_seconds);
  rateValues.push(st.throughput.rounds_per_second);
  if (rateTimes.length > RATE_SAMPLES) { rateTimes.shift(); rateValues.shift(); }
  plot($("rate-plot"), rateTimes, rateValues, { cls: "line rate", xLabel: (x) => `${Math.round(x)} s` });
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

function renderWorkers(ws) {
  $("straggler").textContent = ws.straggler ?? "none";
  $("straggler").title = ws.straggler ?? "";
  const top = ws.workers.find((w) => w.name === ws.straggler);
  $("straggler-detail").textContent = top
    ? `slowed ${top.straggler_rounds} of the last ${ws.window_rounds} rounds by ${fmt(top.straggler_seconds, 3)} s`
    : `over the last ${ws.window_rounds} rounds`;
  const body = $("workers").tBodies[0];
  body.replaceChildren();
  for (const w of ws.workers) {
    const tr = document.createElement("tr");
    tr.className = [w.state, w.name === ws.straggler ? "straggler" : "", w.awaited ? "awaited" : ""].join(" ").trim();
    tr.dataset.name = w.name;
    const p = w.pushes, t = w.mean_seconds;
    const clock = w.blocked ? `${w.clock} (waits)` : w.clock ?? "-";
    [w.rank, w.name, w.awaited ? `${w.state} (awaited)` : w.state, w.transport ?? "-", w.last_step ?? "-", clock,
     w.staleness && w.staleness.mean !== null ? fmt(w.staleness.mean, 3) : "-", p.accepted, p.late, p.stale,
     p.duplicate, ms(t.fetch), ms(t.compute), ms(t.push), w.straggler_rounds, fmt(w.straggler_seconds, 3),
     `${fmt(w.last_seen_seconds_ago, 2)} s ago`].forEach((v, i) => cell(tr, String(v), i === 1 ? w.name : undefined));
    body.append(tr);
  }
}

function renderRounds(rs) {
  const body = $("rounds").tBodies[0];
  body.replaceChildren();
  for (const r of rs.rounds) {
    const tr = document.createElement("tr");
    const s = r.straggler;
    [r.step, ms(r.duration_seconds), r.reason, r.contributors.map((c) => c.name).join(" \u2192 "),
     s ? (s.kind === "never_arrived" ? `${s.name} (never came)` : s.name) : "-", s ? ms(s.waited_seconds) : "-",
     r.missing.join(", ") || "-", r.late.map((c) => c.name).join(", ") || "-", fmt(r.loss)]
      .forEach((v) => cell(tr, String(v)));
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
  const span = lossValues.length ? Math.max(...lossValues.slice(-2000)) / Math.max(1e-300, Math.min(...lossValues.slice(-2000))) : 1;
  const logY = span > 100;
  $("loss-scale").textContent = logY ? "(log scale)" : "";
  plot($("loss-plot"), lossSteps, lossValues, { logY, xLabel: (x) => String(Math.round(x)) });
}

async function poll() {
  try {
    const [st, ws, rs, curve] = await Promise.all([
      getJSON("v1/status"), getJSON("v1/workers"), getJSON("v1/rounds?limit=10"), getJSON(`v1/loss?since=${lastLossStep}`),
    ]);
    renderStatus(st);
    renderWorkers(ws);
    renderRounds(rs);
    renderLoss(curve);
    $("conn").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    // the PS may be restarting: say so on the page and try again (no console noise)
    $("state").textContent = "offline";
    $("state").className = "badge offline";
    $("conn").textContent = `cannot reach the PS (${err.name === "AbortError" ? "timeout" : err.message})`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
