// The dashboard. Polls GET /v1/status (with its per-second history) every second and
// GET /v1/dead-letters every few seconds; the metric explorer asks GET /v1/metrics,
// /v1/metrics/{name} and /v1/metrics/{name}/series. Everything is same-origin; a bearer token,
// when the API asks for one, is kept in this browser's localStorage.
(() => {
  "use strict";
  const { LineChart, fmt } = window.SluiceChart;
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  const DEAD_POLL_MS = 3000;
  const KEEP_S = 600; // the server keeps 10 minutes of samples
  const TOKEN_KEY = "sluice.token";

  const state = {
    token: localStorage.getItem(TOKEN_KEY) || "",
    samples: [],
    lastPoll: 0,
    status: null,
    metrics: [],
    spanS: 300,
  };

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(path) {
    const headers = { Accept: "application/json" };
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    let r;
    try {
      r = await fetch(path, { headers, cache: "no-store" });
    } catch (e) {
      throw new ApiError(0, "the server does not answer");
    }
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    const message = body && body.error ? body.error.message : `HTTP ${r.status}`;
    if (r.status === 401) {
      askForToken(state.token ? "that token was refused" : "");
      throw new ApiError(401, message);
    }
    if (!r.ok) throw new ApiError(r.status, message);
    return body;
  }

  // -- token -------------------------------------------------------------------------------------

  function askForToken(why) {
    $("token-bar").hidden = false;
    $("token-error").textContent = why;
  }

  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.token = $("token").value.trim();
    localStorage.setItem(TOKEN_KEY, state.token);
    $("token-bar").hidden = true;
    loadMetrics();
    poll(true);
  });

  function showError(text) {
    const bar = $("error-bar");
    bar.hidden = !text;
    bar.textContent = text || "";
  }

  // -- charts ------------------------------------------------------------------------------------

  const C = {
    rates: new LineChart($("chart-rates"), {
      series: [
        { key: "input", label: "input", color: "#2b6cb0" },
        { key: "admitted", label: "admitted", color: "#805ad5", dash: "5 3" },
        { key: "processed", label: "processed", color: "#2f855a" },
      ],
    }),
    backlog: new LineChart($("chart-backlog"), {
      unit: "bytes",
      series: [{ key: "bytes", label: "backlog", color: "#dd6b20" }],
    }),
    fresh: new LineChart($("chart-freshness"), {
      unit: "ms",
      minTop: 100,
      series: [
        { key: "p50", label: "p50", color: "#3182ce" },
        { key: "p99", label: "p99", color: "#c53030" },
      ],
    }),
    ratio: new LineChart($("chart-ratio"), {
      unit: "ratio",
      yMax: 1,
      series: [
        { key: "ingest", label: "ingest", color: "#2b6cb0" },
        { key: "spark", label: "spark", color: "#805ad5" },
      ],
    }),
    ingest: stageChart("chart-stage-ingest"),
    spark: stageChart("chart-stage-spark"),
    series: new LineChart($("chart-series"), { dots: true, series: [] }),
  };

  function stageChart(id) {
    return new LineChart($(id), {
      series: [
        { key: "measured", label: "measured", color: "#2b6cb0" },
        { key: "rate", label: "throttle", color: "#c53030" },
        { key: "origin", label: "origin", color: "#718096", dash: "4 3" },
      ],
    });
  }

  function mergeHistory(items) {
    const last = state.samples.length ? state.samples[state.samples.length - 1].t : 0;
    for (const s of items) if (s.t > last) state.samples.push(s);
    const newest = state.samples.length ? state.samples[state.samples.length - 1].t : 0;
    while (state.samples.length && state.samples[0].t < newest - KEEP_S * 1000) state.samples.shift();
  }

  function bands(samples, flag, kind) {
    const out = [];
    let from = null;
    samples.forEach((s, i) => {
      const on = flag(s);
      if (on && from === null) from = s.t;
      const next = samples[i + 1];
      if (from !== null && (!on || !next)) {
        out.push({ from, to: on ? s.t + 1000 : s.t, kind });
        from = null;
      }
    });
    return out;
  }

  function stage(s, name) { return (s.stages || {})[name] || {}; }

  function renderCharts() {
    const all = state.samples;
    if (!all.length) return;
    const newest = all[all.length - 1].t;
    // The span chosen, or less while the history is shorter: the lines fill the width.
    const domain = [Math.max(newest - state.spanS * 1000, all[0].t), newest];
    if (domain[1] - domain[0] < 30000) domain[0] = newest - 30000;
    const samples = all.filter((s) => s.t >= domain[0]);
    const t = samples.map((s) => s.t);
    const col = (f) => samples.map(f);
    C.rates.set({ t, domain, values: {
      input: col((s) => s.input_per_s),
      admitted: col((s) => s.admitted_per_s),
      processed: col((s) => s.processed_per_s),
    } });
    const st = state.status;
    C.backlog.set({ t, domain,
      values: { bytes: col((s) => s.backlog.bytes) },
      hlines: st ? [
        { y: st.backlog.high_watermark, label: `high ${fmt.bytes(st.backlog.high_watermark)}` },
        { y: st.backlog.low_watermark, label: `low ${fmt.bytes(st.backlog.low_watermark)}` },
      ] : [],
      bands: bands(samples, (s) => stage(s, "spark").over, "over"),
    });
    C.fresh.set({ t, domain, values: { p50: col((s) => s.fresh.p50), p99: col((s) => s.fresh.p99) } });
    C.ratio.set({ t, domain, values: {
      ingest: col((s) => stage(s, "ingest").ratio ?? null),
      spark: col((s) => stage(s, "spark").ratio ?? null),
    } });
    for (const name of ["ingest", "spark"]) {
      C[name].set({ t, domain,
        values: {
          measured: col((s) => stage(s, name).emitted_per_s ?? null),
          rate: col((s) => stage(s, name).rate ?? null),
          origin: col((s) => stage(s, name).origin ?? null),
        },
        bands: bands(samples, (s) => stage(s, name).bp, "throttled"),
      });
    }
  }

  // -- status tables -----------------------------------------------------------------------------

  function text(id, value) { $(id).textContent = value; }

  function td(value, cls) {
    const cell = document.createElement("td");
    cell.textContent = value;
    if (cls) cell.className = cls;
    return cell;
  }

  function renderLog(backlog, log) {
    const kafka = log.kind === "kafka";
    const n = backlog.entries === null || backlog.entries === undefined ? "–" : backlog.entries.toLocaleString();
    text("t-backlog", `${backlog.bytes_estimated ? "≈ " : ""}${fmt.bytes(backlog.bytes)}`);
    text("t-backlog-entries", `${n} ${kafka ? "records of lag" : "entries"} · high ${fmt.bytes(backlog.high_watermark)}`);
    let where = kafka ? `kafka ${log.topic} · group ${log.group_id}` : "redis streams";
    if (kafka && log.lag) {
      const parts = Object.entries(log.lag).sort((a, b) => Number(a[0]) - Number(b[0]));
      where += ` · lag by partition ${parts.map(([p, v]) => `${p}: ${v.toLocaleString()}`).join(", ")}`;
    }
    if (log.state === "waiting") where = `waiting for the log (${log.reason}): ${log.message || ""}`;
    const line = $("t-log");
    line.textContent = where;
    line.className = log.state === "waiting" ? "bad" : "muted";
  }

  function renderStatus(st) {
    const p = st.pipeline || { state: "unknown" };
    const badge = $("pipeline-state");
    badge.textContent = `pipeline ${p.state.replaceAll("_", " ")}`;
    badge.className = `badge ${p.state}`;
    badge.title = p.last_error || "";
    const flow = st.flow || {};
    text("controller", `backpressure ${flow.controller || "?"} · redis ${fmt.bytes(st.redis ? st.redis.used_memory : null)}`);
    text("updated", `updated ${fmt.clock(Date.now())}`);

    const newest = state.samples[state.samples.length - 1];
    const recent = newest && Date.now() - newest.t < 5000 ? newest : {};
    const rates = st.rates || {};
    const pick = (v, fallback) => (v !== null && v !== undefined ? v : fallback);
    text("t-input", fmt.num(pick(recent.input_per_s, rates.input_events_per_s)));
    text("t-admitted", fmt.num(pick(recent.admitted_per_s, rates.admitted_events_per_s)));
    text("t-processed", fmt.num(pick(recent.processed_per_s, st.processed_events_per_s)));
    renderLog(st.backlog, st.log || {});
    text("t-fresh", `${fmt.ms(st.freshness_ms.p50)} / ${fmt.ms(st.freshness_ms.p99)}`);
    const audit = st.audit;
    const tile = $("t-audit").parentElement;
    if (audit) {
      const b = audit.books;
      const idle = !b.events_in && !audit.batches_ok;
      text("t-audit", idle ? "–" : b.balanced ? "balanced ✓" : "unbalanced ✗");
      text("t-audit-detail", idle ? "no events yet" : `${audit.batches_ok.toLocaleString()} batches complete`);
      tile.className = `tile ${idle ? "" : b.balanced ? "good" : "bad"}`;
      renderBooks(audit, st.consistency);
    }
    renderStages(flow);
    renderProcesses(st.roles || {});
    renderTiming(st.timing || {});
  }

  const SPARK_PHASES = new Set(["latestOffset", "queryPlanning", "walCommit", "commitOffsets"]);
  const PHASE_COLORS = ["#2b6cb0", "#3182ce", "#63b3ed", "#38a169", "#68d391", "#d69e2e",
    "#dd6b20", "#e53e3e", "#805ad5", "#b794f4", "#2c7a7b", "#a0aec0"];

  function renderTiming(timing) {
    const recent = timing.recent || {};
    const phases = timing.phases || [];
    const med = recent.phases_ms || {};
    const total = phases.reduce((a, p) => a + (med[p] || 0), 0);
    const bar = $("phases-bar");
    bar.textContent = "";
    const body = $("phases").tBodies[0];
    body.textContent = "";
    phases.forEach((p, i) => {
      const ms = med[p];
      if (total > 0 && ms) {
        const seg = document.createElement("span");
        seg.style.width = `${(100 * ms) / total}%`;
        seg.style.background = PHASE_COLORS[i % PHASE_COLORS.length];
        seg.title = `${p}: ${fmt.ms(ms)}`;
        bar.append(seg);
      }
      const row = body.insertRow();
      const who = p === "other" ? "the rest" : SPARK_PHASES.has(p) ? "Spark (durationMs)" : "Sluice";
      const name = td(p);
      name.style.borderLeft = `6px solid ${PHASE_COLORS[i % PHASE_COLORS.length]}`;
      row.append(name, td(ms === undefined ? "–" : fmt.ms(ms), "num"), td(who));
    });
    if (!recent.batches) body.innerHTML = "<tr><td colspan=3 class=muted>no batch in the last 10 s</td></tr>";
  }

  function renderProcesses(roles) {
    const body = $("processes").tBodies[0];
    body.textContent = "";
    for (const p of roles.processes || []) {
      const row = body.insertRow();
      const leads = p.lease_age_ms !== null && p.lease_age_ms !== undefined;
      const what = leads ? "running the queries" : p.role === "standby" ? (p.warm ? "warm" : "warming up") : "";
      row.append(
        td(p.role, p.role === "leader" ? "state-ok" : ""), td(p.host), td(String(p.pid), "num"),
        td(leads ? String(p.epoch) : "–", "num"), td(leads ? fmt.ms(p.lease_age_ms) : "–", "num"),
        td(what),
      );
    }
    if (!body.rows.length) body.innerHTML = "<tr><td colspan=6 class=muted>no sluice run process</td></tr>";
  }

  function renderStages(flow) {
    const body = $("stages").tBodies[0];
    body.textContent = "";
    for (const [name, s] of Object.entries(flow.stages || {})) {
      const q = s.queue || {};
      let queue = "–";
      if ("write_ms" in q) queue = `write ${fmt.ms(q.write_ms)}, mem ${fmt.bytes(q.used_memory)}`;
      else if (s.queue) queue = `${(q.entries || 0).toLocaleString()} entries, ${fmt.bytes(q.bytes)}`;
      let st = s.overloaded ? "overloaded" : "ok";
      if (s.backpressure) st = "throttled" + (s.overloaded ? ", overloaded" : "");
      const row = body.insertRow();
      row.append(
        td(name), td(String(s.tasks)), td(st, `state-${st.split(",")[0]}`),
        td(s.rate === null ? (s.tasks ? "unlimited" : "–") : fmt.num(s.rate), "num"),
        td(s.origin_rate === null ? "–" : fmt.num(s.origin_rate), "num"),
        td(fmt.num(s.measured_rate), "num"),
        td(fmt.ratio(s.backpressure_ratio), "num"),
        td(queue),
      );
    }
    const list = $("timeline");
    list.textContent = "";
    for (const ev of (flow.timeline || []).slice(0, 10)) {
      const li = document.createElement("li");
      const rate = ev.rate === null || ev.rate === undefined ? "unlimited" : `${fmt.num(ev.rate)}/s`;
      li.textContent = `${fmt.clock(ev.changed_ms)} ${ev.task}: ` +
        `${ev.backpressure ? "throttled" : "free"}, rate ${rate}`;
      list.append(li);
    }
    if (!list.children.length) list.innerHTML = "<li class=muted>no throttle so far</li>";
  }

  function renderBooks(audit, consistency) {
    const b = audit.books;
    const c = consistency;  // the newest `sluice consistency` report, or null
    const when = c && Number.isFinite(c.at_ms)
      ? ` · ${new Date(c.at_ms).toISOString().slice(0, 16).replace("T", " ")} UTC` : "";
    const checked = c
      ? `${(c.matched || 0).toLocaleString()} matched, ${(c.mismatched || 0).toLocaleString()} mismatched,`
        + ` ${(c.missing || 0).toLocaleString()} missing${when}`
      : "no report yet";
    const rows = [
      ["events admitted (from the streams)", b.events_admitted],
      ["events in (decoded)", b.events_in],
      ["  aggregated", b.aggregated],
      ["  dead-lettered", b.dead_lettered],
      ["  expired", b.expired],
      ["in = aggregated + dead-lettered + expired",
        b.balanced ? "✓ balanced" : `✗ off by ${b.events_in - b.aggregated - b.dead_lettered - b.expired}`],
      ["batches audited complete", audit.batches_ok],
      ["failed attempts, replayed", audit.failed_attempts],
      ["sampled answers checked offline", checked],
    ];
    const body = $("books").tBodies[0];
    body.textContent = "";
    for (const [label, v] of rows) {
      const row = body.insertRow();
      const cell = td(label.trim(), label.startsWith("  ") ? "indent" : "");
      row.append(cell, td(typeof v === "number" ? v.toLocaleString() : v, "num"));
      if (label.startsWith("in =")) row.className = "sum";
    }
    body.dataset.balanced = String(b.balanced);
  }

  async function pollDead() {
    try {
      const d = await api("/v1/dead-letters?limit=8");
      const by = Object.entries(d.by_reason).map(([r, n]) => `${r} ${n.toLocaleString()}`).join(", ");
      text("dead-summary", `${d.total.toLocaleString()} in the stream${by ? " · by reason: " + by : ""}`);
      const body = $("dead").tBodies[0];
      body.textContent = "";
      for (const it of d.items) {
        const row = body.insertRow();
        const reason = td("");
        const chip = document.createElement("span");
        chip.className = "reason";
        chip.textContent = it.reason;
        reason.append(chip);
        const raw = it.raw.length > 140 ? it.raw.slice(0, 139) + "…" : it.raw;
        const rawCell = td(raw, "raw");
        rawCell.title = it.raw;
        row.append(td(fmt.clock(it.written_ms)), td(it.entry_id), reason, td(it.field || "–"), rawCell);
      }
      if (!d.items.length) body.innerHTML = "<tr><td colspan=5 class=muted>none: every event so far was good</td></tr>";
    } catch (e) { /* the status poll reports errors */ }
    setTimeout(pollDead, DEAD_POLL_MS);
  }

  async function poll(once) {
    try {
      const since = state.lastPoll ? Math.ceil((Date.now() - state.lastPoll) / 1000) + 3 : KEEP_S;
      const st = await api(`/v1/status?history=${Math.min(KEEP_S, since)}`);
      state.lastPoll = Date.now();
      state.status = st;
      mergeHistory(st.history || []);
      renderStatus(st);
      renderCharts();
      showError("");
    } catch (e) {
      if (e.status !== 401) showError(`cannot read the status: ${e.message}`);
      const badge = $("pipeline-state");
      badge.textContent = e.status === 401 ? "token needed" : "API down";
      badge.className = "badge down";
    }
    if (!once) setTimeout(() => poll(false), POLL_MS);
  }

  $("span").addEventListener("change", (ev) => {
    state.spanS = Number(ev.target.value);
    renderCharts();
  });

  // -- metric explorer ---------------------------------------------------------------------------

  const DURATION_MS = { ms: 1, s: 1000, m: 60000, h: 3600000, d: 86400000, w: 604800000 };

  function parseDuration(s) {
    const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$/.exec(s);
    return m ? Math.round(Number(m[1]) * DURATION_MS[m[2]]) : null;
  }

  function spell(ms) {
    const parts = [];
    for (const [u, size] of [["d", 86400000], ["h", 3600000], ["m", 60000], ["s", 1000]]) {
      if (ms >= size) { parts.push(`${Math.floor(ms / size)}${u}`); ms %= size; }
    }
    if (ms || !parts.length) parts.push(`${ms}ms`);
    return parts.join(" ");
  }

  function when(ms) {
    const d = new Date(ms);
    const day = d.toDateString() === new Date().toDateString() ? "" : d.toISOString().slice(0, 10) + " ";
    const frac = ms % 1000 ? "." + String(ms % 1000).padStart(3, "0") : "";
    return `${day}${d.toTimeString().slice(0, 8)}${frac}`;
  }

  function gcd(a, b) { return b ? gcd(b, a % b) : a; }

  function definition(name) { return state.metrics.find((m) => m.name === name); }

  function sliceOf(def) {
    if (def.kind === "metric") return def.slice_ms;
    return def.inputs.map((n) => definition(n).slice_ms).reduce((a, b) => (a * b) / gcd(a, b));
  }

  async function loadMetrics() {
    try {
      const { metrics } = await api("/v1/metrics");
      state.metrics = metrics;
      const select = $("metric");
      const chosen = select.value;
      select.textContent = "";
      for (const kind of ["metric", "derived"]) {
        const group = document.createElement("optgroup");
        group.label = kind === "metric" ? "metrics" : "derived";
        for (const m of metrics.filter((x) => x.kind === kind)) group.append(new Option(m.name, m.name));
        if (group.children.length) select.append(group);
      }
      if (chosen && definition(chosen)) select.value = chosen;
      describeMetric();
    } catch (e) {
      if (e.status !== 401) $("explore-error").textContent = `cannot list the metrics: ${e.message}`;
    }
  }

  function describeMetric() {
    const def = definition($("metric").value);
    if (!def) return;
    const keys = $("keys");
    const old = Object.fromEntries([...keys.querySelectorAll("input")].map((i) => [i.dataset.field, i.value]));
    keys.textContent = "";
    for (const field of def.key) {
      const label = document.createElement("label");
      label.append(`${field} `);
      const input = document.createElement("input");
      input.dataset.field = field;
      input.placeholder = `a ${field} value`;
      input.size = 14;
      input.value = old[field] || "";
      input.setAttribute("aria-label", field);
      label.append(input);
      keys.append(label);
    }
    let about;
    if (def.kind === "metric") {
      about = `${def.agg}${def.value ? " of " + def.value : ""}${def.filter ? " where " + def.filter : ""}` +
        ` per ${def.key.join(" + ")}; slices of ${def.resolutions.join(", ")}, kept ${def.retention}`;
      if (def.q) about += `; quantiles ${[].concat(def.q).join(", ")}`;
    } else {
      about = `derived: ${def.expr}, per ${def.key.join(" + ")}, over the same window`;
    }
    text("metric-about", about);
  }

  $("metric").addEventListener("change", describeMetric);
  for (const b of $("presets").querySelectorAll("button")) {
    b.addEventListener("click", () => {
      $("window").value = b.dataset.w;
      explore();
    });
  }
  $("explore").addEventListener("submit", (ev) => { ev.preventDefault(); explore(); });

  function showValue(v) {
    if (v === null || v === undefined) return ["null", "no data in the covered interval"];
    if (typeof v === "object") {
      return [Object.entries(v).map(([q, x]) => `q${q} = ${x === null ? "null" : fmtExact(x)}`).join("   "), ""];
    }
    return [fmtExact(v), ""];
  }

  function fmtExact(v) {
    return typeof v === "number" ? v.toLocaleString(undefined, { maximumFractionDigits: 6 }) : String(v);
  }

  async function explore() {
    const name = $("metric").value;
    const def = definition(name);
    const out = $("answer");
    $("explore-error").textContent = "";
    if (!def) return;
    const params = new URLSearchParams();
    for (const input of $("keys").querySelectorAll("input")) {
      if (!input.value.trim()) {
        $("explore-error").textContent = `type a value for \`${input.dataset.field}\``;
        return;
      }
      params.append("key", input.value.trim());
    }
    const windowText = $("window").value.trim();
    params.set("window", windowText);
    for (const b of $("presets").querySelectorAll("button")) b.classList.toggle("on", b.dataset.w === windowText);
    const path = `/v1/metrics/${encodeURIComponent(name)}`;
    let a;
    out.dataset.state = "loading";
    try {
      a = await api(`${path}?${params}`);
    } catch (e) {
      out.hidden = true;
      out.dataset.state = "error";
      $("explore-error").textContent = e.message;
      return;
    }
    const [value, note] = showValue(a.value);
    text("answer-value", value);
    text("answer-what", `${name} for ${a.key.join(" + ")}${note ? " · " + note : ""}`);
    text("answer-window", `(${when(a.start)}, ${when(a.end)}]  ·  the last ${spell(a.end - a.start)}`);
    text("answer-covered", `[${when(a.covered_start)}, ${when(a.covered_end)})  ·  ${spell(a.covered_end - a.covered_start)}: the whole slices the window touches`);
    params.set("end", String(a.end));
    text("answer-url", `GET ${path}?${params}`);
    Object.assign(out.dataset, {
      metric: name, key: JSON.stringify(a.key), value: JSON.stringify(a.value), end: String(a.end),
      coveredStart: String(a.covered_start), coveredEnd: String(a.covered_end), state: "done",
    });
    out.hidden = false;
    await loadSeries(path, params, def, a);
  }

  async function loadSeries(path, params, def, a) {
    const windowMs = a.end - a.start;
    const base = sliceOf(def);
    const step = base * Math.max(1, Math.ceil(windowMs / 120 / base));
    params.set("step", `${step}ms`);
    try {
      const s = await api(`${path}/series?${params}`);
      const t = s.points.map((p) => p.start);
      const first = s.points.find((p) => p.value !== null);
      const isMap = first && typeof first.value === "object";
      const keys = isMap ? Object.keys(first.value) : ["value"];
      const colors = ["#2b6cb0", "#c53030", "#2f855a", "#805ad5", "#dd6b20"];
      C.series.opts.series = keys.map((k, i) => ({ key: k, label: isMap ? `q${k}` : def.name, color: colors[i % colors.length] }));
      const values = {};
      for (const k of keys) {
        values[k] = s.points.map((p) => (p.value === null ? null : isMap ? p.value[k] : p.value));
      }
      C.series.set({ t, values, domain: [s.start, s.end] });
      text("series-about", `${s.points.length} points, one per ${spell(s.step_ms)}`);
    } catch (e) {
      text("series-about", `no series: ${e.message}`);
    }
  }

  window.sluiceDashboard = { state, charts: C, explore };
  loadMetrics();
  poll(false);
  pollDead();
})();
