// tokenfab's web page: chat, completions with logprobs, live dashboard, bench viewer, doctor card.
// Plain JavaScript, no build step. Charts: uPlot (static/vendor/uplot, MIT). Every API call sends
// the key the user typed, as 'Authorization: Bearer KEY'; the page itself holds no key.
"use strict";

const $ = (sel) => document.querySelector(sel);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text != null) e.textContent = text; return e; };
const S = { key: sessionStorage.getItem("tokenfab-key") || "", model: null, bench: null, needsKey: false };
// What the tests (and curious users, in the console) read: per-reply timings and dashboard values.
window.tf = { timings: [], dash: {}, doctor: null };

// -- API access ------------------------------------------------------------------------------------
function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  if (S.key) h.Authorization = "Bearer " + S.key;
  return h;
}
async function api(path, opts) {
  opts = opts || {};
  const r = await fetch(path, Object.assign({}, opts, { headers: authHeaders(opts.headers) }));
  if (r.status === 401) needKey(S.key ? "That API key was refused; enter the right one." : "This server needs an API key.");
  return r;
}
async function errorText(r) {
  try { const j = await r.json(); return (j.error && j.error.message) || JSON.stringify(j); } catch (e) { return r.status + " " + r.statusText; }
}
function banner(text, isError) {
  const b = $("#banner");
  b.hidden = !text; b.textContent = text || ""; b.classList.toggle("error", !!isError);
}
function needKey(text) {
  S.needsKey = true; $("#key-box").hidden = false; banner(text, true); $("#api-key").focus();
}
async function connect() {
  const r = await api("/v1/models");
  if (r.ok) {
    const j = await r.json();
    S.model = j.data[0].id;
    $("#model-name").textContent = S.model + " · max_model_len " + j.data[0].max_model_len;
    banner("");
    if (!S.needsKey) $("#key-box").hidden = true;
  } else if (r.status !== 401) banner("cannot list models: " + await errorText(r), true);
}
$("#key-save").onclick = () => { S.key = $("#api-key").value.trim(); sessionStorage.setItem("tokenfab-key", S.key); connect(); };
$("#api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") $("#key-save").click(); });

// Server-sent events from a fetch response: yields each `data:` JSON object until [DONE].
async function* sse(resp) {
  const reader = resp.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, i); buf = buf.slice(i + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// -- tabs and sampling controls --------------------------------------------------------------------
for (const b of document.querySelectorAll("button.tab")) {
  b.onclick = () => {
    document.querySelectorAll("button.tab").forEach((x) => x.classList.toggle("active", x === b));
    document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.id === b.dataset.tab));
    if (b.dataset.tab === "dash") resizeCharts(Dash.charts, "#dash-charts");
    if (b.dataset.tab === "bench") resizeCharts(Bench.charts, "#bench-charts");
  };
}
const SAMPLING = [
  ["temperature", "Temperature", "0.7", "number", "0.05"], ["top_p", "Top-p", "1", "number", "0.05"],
  ["max_tokens", "Max tokens", "128", "number", "1"], ["seed", "Seed", "", "number", "1"],
  ["stop", "Stop strings (comma-separated)", "", "text", null],
];
for (const box of document.querySelectorAll(".sampling")) {
  for (const [name, label, value, type, step] of SAMPLING) {
    const l = el("label", null, label), i = el("input");
    i.type = type; i.value = value; i.id = box.dataset.for + "-" + name; if (step) i.step = step;
    l.appendChild(i); box.appendChild(l);
  }
}
function sampling(prefix) {
  const v = (n) => $("#" + prefix + "-" + n).value.trim();
  const body = {};
  if (v("temperature") !== "") body.temperature = Number(v("temperature"));
  if (v("top_p") !== "") body.top_p = Number(v("top_p"));
  if (v("max_tokens") !== "") body.max_tokens = Number(v("max_tokens"));
  if (v("seed") !== "") body.seed = Number(v("seed"));
  const stop = v("stop").split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  return body;
}
const fmtMs = (ms) => ms == null || !isFinite(ms) ? "–" : ms >= 100 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";

// One streamed request: calls onText(delta, chunk) per content chunk; returns timings.
async function streamRequest(path, body, ctrl, onText) {
  const t = { send: performance.now(), firstChunk: null, firstPaint: null, end: null, tokens: null, finish: null, aborted: false };
  let r;
  try {
    r = await api(path, { method: "POST", body: JSON.stringify(body), signal: ctrl.signal, headers: { "Content-Type": "application/json" } });
  } catch (e) { t.error = e.name === "AbortError" ? null : String(e); t.aborted = e.name === "AbortError"; t.end = performance.now(); return t; }
  if (!r.ok) { t.error = await errorText(r); t.status = r.status; t.end = performance.now(); return t; }
  try {
    for await (const chunk of sse(r)) {
      if (chunk.error) { t.error = chunk.error.message; break; }
      if (chunk.usage) t.tokens = chunk.usage.completion_tokens;
      const c = chunk.choices && chunk.choices[0];
      if (!c) continue;
      const text = c.delta ? c.delta.content : c.text;
      if (text) {
        onText(text, c);
        if (t.firstChunk == null) {
          t.firstChunk = performance.now();
          // The first frame painted after the text landed in the DOM.
          requestAnimationFrame(() => requestAnimationFrame(() => { t.firstPaint = performance.now(); }));
        }
      }
      if (c.finish_reason) t.finish = c.finish_reason;
    }
  } catch (e) {
    if (e.name === "AbortError") t.aborted = true; else t.error = String(e);
  }
  t.end = performance.now();
  return t;
}
function replyMeta(t) {
  if (t.error) return (t.status ? t.status + ": " : "") + t.error;
  const parts = [];
  if (t.firstChunk != null) parts.push("TTFT " + fmtMs(t.firstChunk - t.send));
  if (t.tokens > 1 && t.firstChunk != null && t.end > t.firstChunk) parts.push(((t.tokens - 1) / ((t.end - t.firstChunk) / 1000)).toFixed(1) + " tok/s");
  if (t.tokens != null) parts.push(t.tokens + " tokens");
  parts.push(t.aborted ? "stopped" : (t.finish || ""));
  return parts.filter(Boolean).join(" · ");
}

// -- chat ------------------------------------------------------------------------------------------
const Chat = { messages: [], ctrl: null };
function addMsg(role, text) {
  const m = el("div", "msg " + role);
  m.appendChild(el("span", "who", role));
  const t = el("span", "text", text); m.appendChild(t);
  const meta = el("div", "meta"); m.appendChild(meta);
  $("#chat-log").appendChild(m); $("#chat-log").scrollTop = 1e9;
  return { m, t, meta };
}
$("#chat-input").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); } });
$("#chat-clear").onclick = () => { Chat.messages = []; $("#chat-log").textContent = ""; };
$("#chat-stop").onclick = () => Chat.ctrl && Chat.ctrl.abort();
$("#chat-form").onsubmit = async (e) => {
  e.preventDefault();
  const text = $("#chat-input").value;
  if (!text.trim() || Chat.ctrl) return;
  $("#chat-input").value = "";
  Chat.messages.push({ role: "user", content: text });
  addMsg("user", text);
  const out = addMsg("assistant", "");
  out.m.classList.add("streaming");
  const sys = $("#system").value.trim();
  const body = Object.assign({ model: S.model, stream: true, stream_options: { include_usage: true },
    messages: (sys ? [{ role: "system", content: sys }] : []).concat(Chat.messages) }, sampling("chat"));
  Chat.ctrl = new AbortController();
  $("#chat-send").disabled = true; $("#chat-stop").disabled = false;
  let reply = "";
  const t = await streamRequest("/v1/chat/completions", body, Chat.ctrl, (d) => { reply += d; out.t.textContent = reply; $("#chat-log").scrollTop = 1e9; });
  Chat.ctrl = null;
  $("#chat-send").disabled = false; $("#chat-stop").disabled = true;
  out.m.classList.remove("streaming");
  if (t.error) { out.m.classList.add("error"); Chat.messages.pop(); }
  else Chat.messages.push({ role: "assistant", content: reply });
  // firstPaint lands a frame after the first chunk; wait for it before recording.
  await new Promise((res) => requestAnimationFrame(() => requestAnimationFrame(res)));
  out.meta.textContent = replyMeta(t);
  window.tf.timings.push(t);
};

// -- completions with logprobs ---------------------------------------------------------------------
const Comp = { ctrl: null };
$("#complete-stop").onclick = () => Comp.ctrl && Comp.ctrl.abort();
$("#complete-send").onclick = async () => {
  if (Comp.ctrl) return;
  const box = $("#completion"); box.textContent = "";
  box.appendChild(el("span", "prompt", $("#prompt").value));
  const body = Object.assign({ model: S.model, prompt: $("#prompt").value, stream: true, logprobs: 5,
    stream_options: { include_usage: true } }, sampling("complete"));
  Comp.ctrl = new AbortController();
  $("#complete-send").disabled = true; $("#complete-stop").disabled = false;
  const t = await streamRequest("/v1/completions", body, Comp.ctrl, (text, c) => {
    const lp = c.logprobs;
    if (!lp || !lp.tokens) { box.appendChild(el("span", null, text)); return; }
    lp.tokens.forEach((tok, i) => {
      const s = el("span", "tok", tok);
      const p = Math.exp(lp.token_logprobs[i]);
      s.style.background = `rgba(37, 99, 235, ${(0.08 + 0.35 * (1 - p)).toFixed(2)})`;
      s.dataset.lp = JSON.stringify({ token: tok, logprob: lp.token_logprobs[i], top: lp.top_logprobs ? lp.top_logprobs[i] : null });
      box.appendChild(s);
    });
  });
  Comp.ctrl = null;
  $("#complete-send").disabled = false; $("#complete-stop").disabled = true;
  $("#complete-stats").textContent = replyMeta(t);
};
$("#completion").addEventListener("mousemove", (e) => {
  const tip = $("#tooltip"), s = e.target.closest(".tok");
  if (!s) { tip.hidden = true; return; }
  const d = JSON.parse(s.dataset.lp);
  const lines = [`${JSON.stringify(d.token)}  logprob ${d.logprob.toFixed(3)}  p ${(100 * Math.exp(d.logprob)).toFixed(1)}%`];
  if (d.top) for (const [tok, lp] of Object.entries(d.top).sort((a, b) => b[1] - a[1]))
    lines.push(`  ${JSON.stringify(tok).padEnd(16)} ${lp.toFixed(3)}  ${(100 * Math.exp(lp)).toFixed(1)}%`);
  tip.textContent = lines.join("\n"); tip.hidden = false;
  tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 14) + "px";
});
$("#completion").addEventListener("mouseleave", () => { $("#tooltip").hidden = true; });

// -- charts ----------------------------------------------------------------------------------------
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];
function chartWidth(sel) { const w = $(sel).clientWidth; return Math.max(420, Math.min(900, (w > 960 ? w / 2 : w) - 24)); }
function makeChart(container, title, series, opts) {
  const div = el("div", "chart"); $(container).appendChild(div);
  const o = Object.assign({ title, width: chartWidth(container), height: 220, series: [{}].concat(series.map((s, i) =>
    Object.assign({ stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true }, s))),
    axes: [{}, { size: 60 }], legend: { live: true } }, opts || {});
  return new uPlot(o, [[]].concat(series.map(() => [])), div);
}
function resizeCharts(charts, sel) { for (const c of charts) c.setSize({ width: chartWidth(sel), height: 220 }); }

// -- live dashboard from /metrics ------------------------------------------------------------------
function parseProm(text) {
  const v = {}, b = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([^{\s]+)(\{[^}]*\})?\s+(\S+)/);
    if (!m) continue;
    const name = m[1].replace(/^tokenfab:/, ""), val = Number(m[3]);
    if (name.endsWith("_bucket")) {
      const le = Number((m[2].match(/le="([^"]+)"/) || [])[1]);
      (b[name.slice(0, -7)] = b[name.slice(0, -7)] || []).push([le, val]);
    } else if (!name.endsWith("_created")) {
      const key = name === "request_success_total" ? name + ":" + ((m[2] || "").match(/finished_reason="([^"]+)"/) || [, ""])[1] : name;
      v[key] = (v[key] || 0) + val;
    }
  }
  return { t: performance.now() / 1000, v, b };
}
function quantile(before, after, hist, q) {
  const a = after.b[hist] || [], prev = new Map(before ? (before.b[hist] || []) : []);
  const cum = a.map(([le, c]) => [le, c - (prev.get(le) || 0)]);
  if (!cum.length || cum[cum.length - 1][1] <= 0) return null;
  const rank = q * cum[cum.length - 1][1];
  let lo = 0, loC = 0;
  for (const [le, c] of cum) {
    if (c >= rank) return le === Infinity ? lo : lo + (le - lo) * (c > loC ? (rank - loC) / (c - loC) : 1);
    lo = le; loC = c;
  }
  return lo;
}
const Dash = { hist: [], charts: [], series: null, timer: null, RATE_S: 5, PCT_S: 30, KEEP: 300 };
function dashCharts() {
  const time = { scales: { x: { time: true } } };
  Dash.charts = [
    makeChart("#dash-charts", "Requests", [{ label: "running" }, { label: "waiting" }], time),
    makeChart("#dash-charts", "KV-cache usage (%)", [{ label: "KV %" }], Object.assign({ scales: { x: { time: true }, y: { range: [0, 100] } } })),
    makeChart("#dash-charts", "Generation (tok/s)", [{ label: "tok/s" }], time),
    makeChart("#dash-charts", "Latency (ms, last 30 s)", [{ label: "TTFT p50" }, { label: "TTFT p99" }, { label: "TPOT p50" }, { label: "TPOT p99" }], time),
  ];
  Dash.series = Dash.charts.map((c) => c.data.map(() => []));
}
function ago(seconds) {
  const now = Dash.hist[Dash.hist.length - 1];
  for (let i = Dash.hist.length - 1; i >= 0; i--) if (now.t - Dash.hist[i].t >= seconds) return Dash.hist[i];
  return Dash.hist[0];
}
async function pollMetrics() {
  let r;
  try { r = await api("/metrics"); } catch (e) { return; }
  if (!r.ok) return;
  const s = parseProm(await r.text());
  Dash.hist.push(s);
  if (Dash.hist.length > Dash.KEEP) Dash.hist.shift();
  const v = s.v, rb = ago(Dash.RATE_S), pb = ago(Dash.PCT_S);
  const dt = s.t - rb.t;
  const rate = (k) => dt > 0 ? ((v[k] || 0) - (rb.v[k] || 0)) / dt : 0;
  const pct = (h, q) => { const x = quantile(pb === s ? null : pb, s, h, q); return x == null ? null : x * 1000; };
  const queries = v.prefix_cache_queries_total || 0;
  const d = {
    running: v.num_requests_running || 0, waiting: v.num_requests_waiting || 0,
    kv: 100 * (v.kv_cache_usage_perc || 0), genTokS: rate("generation_tokens_total"),
    ttftP50: pct("time_to_first_token_seconds", 0.5), ttftP99: pct("time_to_first_token_seconds", 0.99),
    tpotP50: pct("inter_token_latency_seconds", 0.5), tpotP99: pct("inter_token_latency_seconds", 0.99),
    preemptions: v.num_preemptions_total || 0, preemptRate: rate("num_preemptions_total"),
    prefixHit: queries ? 100 * (v.prefix_cache_hits_total || 0) / queries : null,
    finished: (v["request_success_total:stop"] || 0) + (v["request_success_total:length"] || 0),
    aborted: v["request_success_total:abort"] || 0, samples: Dash.hist.length,
  };
  window.tf.dash = d;
  const cards = [
    ["Running", d.running.toFixed(0)], ["Waiting", d.waiting.toFixed(0)], ["KV-cache usage", d.kv.toFixed(1) + " %"],
    ["Generation tok/s (5 s)", d.genTokS.toFixed(1)], ["TTFT p50 / p99", fmtMs(d.ttftP50) + " / " + fmtMs(d.ttftP99)],
    ["TPOT p50 / p99", fmtMs(d.tpotP50) + " / " + fmtMs(d.tpotP99)], ["Preemptions", d.preemptions.toFixed(0) + (d.preemptRate ? ` (${d.preemptRate.toFixed(2)}/s)` : "")],
    ["Prefix-cache hit rate", d.prefixHit == null ? "–" : d.prefixHit.toFixed(1) + " %"], ["Finished / aborted", d.finished + " / " + d.aborted],
  ];
  const box = $("#dash-numbers"); box.textContent = "";
  for (const [k, val] of cards) { const c = el("div", "num"); c.appendChild(el("div", "v", val)); c.appendChild(el("div", "k", k)); c.dataset.key = k; box.appendChild(c); }
  const t = Date.now() / 1000;
  const rows = [[t, d.running, d.waiting], [t, d.kv], [t, d.genTokS], [t, d.ttftP50, d.ttftP99, d.tpotP50, d.tpotP99]];
  rows.forEach((row, i) => {
    const data = Dash.series[i];
    row.forEach((x, j) => { data[j].push(x); if (data[j].length > Dash.KEEP) data[j].shift(); });
    if ($("#dash").classList.contains("active")) Dash.charts[i].setData(data);
  });
}

// -- doctor card -----------------------------------------------------------------------------------
async function runDoctor() {
  const out = $("#doctor-out"), hw = $("#doctor-hw").value.trim();
  out.textContent = "diagnosing (a few seconds of metrics) ...";
  const r = S.bench
    ? await api("/doctor", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ hardware: hw || null, bench: S.bench }) })
    : await api("/doctor" + (hw ? "?hardware=" + encodeURIComponent(hw) : ""));
  if (!r.ok) { out.textContent = "doctor: " + await errorText(r); return; }
  const doc = await r.json();
  window.tf.doctor = doc;
  out.textContent = "";
  const m = doc.measured;
  if (m) out.appendChild(el("div", "dim", `over ${m.seconds.toFixed(1)} s: ${m.running.toFixed(1)} running, ${m.waiting_after} waiting, KV ${(100 * m.kv_usage).toFixed(0)} %, ${m.generation_tok_s.toFixed(0)} tok/s, ${m.preemptions} preemptions` + (S.bench ? " · with the loaded bench result" : "")));
  if (!doc.findings.length) out.appendChild(el("p", null, "No bottleneck stands out in what was measured."));
  for (const f of doc.findings) {
    const box = el("div", "finding"); box.dataset.kind = f.kind;
    box.appendChild(el("h4", null, f.title));
    const ev = el("ul"); f.evidence.forEach((x) => ev.appendChild(el("li", null, x))); box.appendChild(ev);
    box.appendChild(el("strong", null, "Change:"));
    const ad = el("ul"); f.advice.forEach((x) => ad.appendChild(el("li", null, x))); box.appendChild(ad);
    out.appendChild(box);
  }
  for (const n of doc.notes || []) out.appendChild(el("div", "dim", "note: " + n));
}
$("#doctor-run").onclick = runDoctor;
let doctorTimer = null;
$("#doctor-auto").onchange = (e) => { clearInterval(doctorTimer); if (e.target.checked) { runDoctor(); doctorTimer = setInterval(runDoctor, 10000); } };

// -- bench viewer ----------------------------------------------------------------------------------
const Bench = { charts: [] };
const METRICS = [["ttft", "TTFT"], ["tpot", "TPOT"], ["itl", "ITL"], ["e2el", "E2E latency"]];
function runLabel(run) { return "rate " + run.request_rate + (run.max_concurrency ? ", conc " + run.max_concurrency : ""); }
function series(run, metric) {
  const ok = run.requests.filter((r) => r.success);
  const xs = metric === "itl" ? ok.flatMap((r) => r.itl_ms) : ok.map((r) => r[metric + "_ms"]).filter((x) => x != null);
  return xs.sort((a, b) => a - b);
}
function showBench(result) {
  if (!result || result.schema !== "tokenfab.bench.serve") throw new Error("not a `tokenfab bench serve --out` result (schema " + (result && result.schema) + ")");
  S.bench = result;
  Bench.charts.forEach((c) => c.destroy()); Bench.charts = [];
  $("#bench-charts").textContent = "";
  const cfg = result.config, runs = result.runs;
  $("#bench-summary").textContent = `${cfg.model} at ${cfg.base_url} · ${cfg.dataset} · ${runs.length} run(s) · ` +
    runs.map((r) => `${runLabel(r)}: ${r.summary.completed} ok, ${r.summary.output_throughput.toFixed(1)} out tok/s, P99 TTFT ${fmtMs(r.summary.p99_ttft_ms)}`).join(" | ");
  const haveRecords = runs.some((r) => r.requests && r.requests.length);
  if (haveRecords) {
    for (const [m, name] of METRICS) {
      const cols = runs.map((r) => { const xs = series(r, m); return [xs, xs.map((_, i) => (i + 1) / xs.length)]; });
      if (!cols.some((c) => c[0].length)) continue;
      const data = uPlot.join(cols);
      const c = makeChart("#bench-charts", name + " CDF (ms)", runs.map((r) => ({ label: runLabel(r) })), { scales: { x: { time: false }, y: { range: [0, 1] } } });
      c.setData(data); Bench.charts.push(c);
    }
  } else $("#bench-charts").appendChild(el("p", "dim", "CDFs need the per-request records: run bench without --no-requests."));
  const run = runs[runs.length - 1];
  const buckets = run.buckets.filter((b) => b.completed);
  for (const [m, name] of METRICS.filter(([m]) => m !== "itl")) {
    if (!buckets.length) break;
    const xs = buckets.map((_, i) => i);
    // Side by side: P50 left of the bucket's tick, P99 right of it.
    const bar = (align) => uPlot.paths.bars({ size: [0.3, 50], align });
    const c = makeChart("#bench-charts", `${name} P50 / P99 by prompt length (ms), ${runLabel(run)}`,
      [{ label: "P50", fill: COLORS[0] + "aa", paths: bar(-1), points: { show: false } },
       { label: "P99", fill: COLORS[1] + "aa", paths: bar(1), points: { show: false } }],
      { scales: { x: { time: false, range: [-0.6, buckets.length - 0.4] }, y: { range: (u, lo, hi) => [0, hi * 1.1] } },
        axes: [{ values: (u, ticks) => ticks.map((t) => Number.isInteger(t) && buckets[t] ? buckets[t].bucket : ""), splits: () => xs }, { size: 60 }] });
    c.setData([xs, buckets.map((b) => b["median_" + m + "_ms"]), buckets.map((b) => b["p99_" + m + "_ms"])]);
    Bench.charts.push(c);
  }
}
$("#bench-file").onchange = (e) => {
  const f = e.target.files[0];
  if (!f) return;
  f.text().then((txt) => { try { showBench(JSON.parse(txt)); banner(""); } catch (err) { banner("bench viewer: " + err.message, true); } });
};

// -- start -----------------------------------------------------------------------------------------
dashCharts();
connect();
pollMetrics();
Dash.timer = setInterval(pollMetrics, 1000);
window.addEventListener("resize", () => { resizeCharts(Dash.charts, "#dash-charts"); resizeCharts(Bench.charts, "#bench-charts"); });
