// A small SVG line chart for the dashboard: time on x, one or more series on y, shaded bands
// (e.g. while a stage is throttled) and horizontal reference lines (e.g. watermarks). No
// dependencies. The host element gets `data-points`: how many non-null values it drew, which
// is what the browser test waits for.
(() => {
  "use strict";
  const SVG = "http://www.w3.org/2000/svg"; // the SVG namespace name, not a download

  const fmt = {
    num(v) {
      if (v === null || v === undefined || Number.isNaN(v)) return "–";
      if (!Number.isFinite(v)) return v > 0 ? "∞" : "-∞";
      const a = Math.abs(v);
      if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
      if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
      if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
      if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
      if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
      if (a >= 1) return v.toFixed(1);
      if (a === 0) return "0";
      return v.toPrecision(2);
    },
    bytes(v) {
      if (v === null || v === undefined) return "–";
      const units = ["B", "KB", "MB", "GB", "TB"];
      let i = 0;
      while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
      return (i === 0 ? v.toFixed(0) : v.toFixed(v >= 100 ? 0 : 1)) + " " + units[i];
    },
    ms(v) {
      if (v === null || v === undefined) return "–";
      if (Math.abs(v) >= 60000) return (v / 60000).toFixed(1) + " min";
      if (Math.abs(v) >= 1000) return (v / 1000).toFixed(v >= 10000 ? 0 : 1) + " s";
      return v.toFixed(0) + " ms";
    },
    ratio(v) { return v === null || v === undefined ? "–" : v.toFixed(2); },
    clock(ms) {
      const d = new Date(ms);
      return d.toTimeString().slice(0, 8);
    },
  };

  function niceStep(range, n) {
    const raw = range / Math.max(1, n);
    const p = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * p;
  }

  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600,
    43200, 86400].map((s) => s * 1000);

  function el(name, attrs, parent) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  class LineChart {
    // opts: {series: [{key, label, color, dash}], unit: "num"|"bytes"|"ms"|"ratio",
    //        yMax: fixed top (e.g. 1 for a ratio), height, dots: draw a dot per value}
    constructor(host, opts) {
      this.host = host;
      this.opts = Object.assign({ unit: "num", height: 170, dots: false }, opts);
      this.data = { t: [], values: {}, bands: [], hlines: [] };
      host.classList.add("chart");
      this.legend = document.createElement("div");
      this.legend.className = "legend";
      host.appendChild(this.legend);
      this.svg = el("svg", { class: "plot", role: "img" }, host);
      this.tip = document.createElement("div");
      this.tip.className = "tip";
      host.appendChild(this.tip);
      this.svg.addEventListener("mousemove", (e) => this.hover(e));
      this.svg.addEventListener("mouseleave", () => { this.tip.style.display = "none"; this.render(); });
      new ResizeObserver(() => this.render()).observe(host);
    }

    format(v) { return fmt[this.opts.unit](v); }

    // data: {t: [ms], values: {key: [number|null]}, bands: [{from, to}], hlines: [{y, label}],
    //        domain: [t0, t1] (optional)}
    set(data) {
      this.data = Object.assign({ t: [], values: {}, bands: [], hlines: [] }, data);
      let n = 0;
      for (const s of this.opts.series) {
        for (const v of this.data.values[s.key] || []) if (v !== null && v !== undefined) n += 1;
      }
      this.host.dataset.points = String(n);
      this.render();
    }

    geometry() {
      const w = Math.max(200, this.host.clientWidth);
      const h = this.opts.height;
      const pad = { l: 56, r: 12, t: 8, b: 22 };
      const t = this.data.t;
      const [t0, t1] = this.data.domain || [t[0] ?? Date.now() - 60000, t[t.length - 1] ?? Date.now()];
      let top = this.opts.yMax ?? 0;
      if (this.opts.yMax === undefined) {
        for (const s of this.opts.series) {
          for (const v of this.data.values[s.key] || []) if (Number.isFinite(v) && v > top) top = v;
        }
        for (const l of this.data.hlines) if (Number.isFinite(l.y) && l.y > top) top = l.y;
      }
      if (top < (this.opts.minTop || 0)) top = this.opts.minTop;
      if (top <= 0) top = 1;
      const step = niceStep(top, 4);
      top = Math.ceil(top / step) * step;
      return {
        w, h, pad, t0, t1: t1 > t0 ? t1 : t0 + 1000, top, step,
        x(tm) { return pad.l + ((tm - this.t0) / (this.t1 - this.t0)) * (w - pad.l - pad.r); },
        y(v) { return h - pad.b - (Math.min(v, top) / top) * (h - pad.t - pad.b); },
      };
    }

    render(hoverIndex) {
      const svg = this.svg;
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      const g = this.geometry();
      svg.setAttribute("viewBox", `0 0 ${g.w} ${g.h}`);
      svg.setAttribute("width", g.w);
      svg.setAttribute("height", g.h);
      // Bands first, under everything.
      for (const b of this.data.bands) {
        const x0 = Math.max(g.pad.l, g.x(b.from));
        const x1 = Math.min(g.w - g.pad.r, g.x(b.to));
        if (x1 > x0) {
          el("rect", { x: x0, y: g.pad.t, width: x1 - x0, height: g.h - g.pad.t - g.pad.b,
            class: "band " + (b.kind || "") }, svg);
        }
      }
      // y grid and labels
      for (let v = 0; v <= g.top + 1e-9; v += g.step) {
        const y = g.y(v);
        el("line", { x1: g.pad.l, x2: g.w - g.pad.r, y1: y, y2: y, class: "gridline" }, svg);
        el("text", { x: g.pad.l - 6, y: y + 4, class: "ylab" }, svg).textContent = this.format(v);
      }
      // x ticks
      const span = g.t1 - g.t0;
      const xstep = TIME_STEPS.find((s) => span / s <= 6) || TIME_STEPS[TIME_STEPS.length - 1];
      for (let tm = Math.ceil(g.t0 / xstep) * xstep; tm <= g.t1; tm += xstep) {
        const x = g.x(tm);
        el("line", { x1: x, x2: x, y1: g.h - g.pad.b, y2: g.h - g.pad.b + 4, class: "axis" }, svg);
        const label = el("text", { x, y: g.h - 6, class: "xlab" }, svg);
        label.textContent = fmt.clock(tm);
      }
      el("line", { x1: g.pad.l, x2: g.w - g.pad.r, y1: g.h - g.pad.b, y2: g.h - g.pad.b,
        class: "axis" }, svg);
      for (const l of this.data.hlines) {
        if (!Number.isFinite(l.y)) continue;
        const y = g.y(l.y);
        el("line", { x1: g.pad.l, x2: g.w - g.pad.r, y1: y, y2: y, class: "hline" }, svg);
        el("text", { x: g.w - g.pad.r - 4, y: y - 3, class: "hlab" }, svg).textContent = l.label;
      }
      // Series: a path per run of non-null values.
      const t = this.data.t;
      for (const s of this.opts.series) {
        const vals = this.data.values[s.key] || [];
        let d = "";
        let pen = false;
        for (let i = 0; i < t.length; i += 1) {
          const v = vals[i];
          if (v === null || v === undefined || !Number.isFinite(v)) { pen = false; continue; }
          d += `${pen ? "L" : "M"}${g.x(t[i]).toFixed(1)},${g.y(v).toFixed(1)}`;
          pen = true;
          if (this.opts.dots) {
            el("circle", { cx: g.x(t[i]), cy: g.y(v), r: 2.5, fill: s.color }, svg);
          }
        }
        if (d) {
          el("path", { d, stroke: s.color, "stroke-dasharray": s.dash || "", class: "line" }, svg);
        }
      }
      if (hoverIndex !== undefined && t[hoverIndex] !== undefined) {
        const x = g.x(t[hoverIndex]);
        el("line", { x1: x, x2: x, y1: g.pad.t, y2: g.h - g.pad.b, class: "cursor" }, svg);
      }
      this.renderLegend(hoverIndex);
    }

    renderLegend(i) {
      const t = this.data.t;
      const at = i !== undefined ? i : t.length - 1;
      this.legend.textContent = "";
      for (const s of this.opts.series) {
        const vals = this.data.values[s.key] || [];
        let v = vals[at];
        if (i === undefined) { // newest non-null value
          for (let k = vals.length - 1; k >= 0; k -= 1) if (vals[k] !== null && vals[k] !== undefined) { v = vals[k]; break; }
        }
        const item = document.createElement("span");
        item.className = "key";
        const sw = document.createElement("i");
        sw.style.background = s.color;
        if (s.dash) sw.className = "dashed";
        item.append(sw, `${s.label} `);
        const b = document.createElement("b");
        b.textContent = this.format(v ?? null);
        item.append(b);
        this.legend.append(item);
      }
    }

    hover(e) {
      const t = this.data.t;
      if (!t.length) return;
      const g = this.geometry();
      const box = this.svg.getBoundingClientRect();
      const tm = g.t0 + ((e.clientX - box.left) * (g.w / box.width) - g.pad.l) /
        (g.w - g.pad.l - g.pad.r) * (g.t1 - g.t0);
      let best = 0;
      for (let i = 1; i < t.length; i += 1) if (Math.abs(t[i] - tm) < Math.abs(t[best] - tm)) best = i;
      this.render(best);
      this.tip.style.display = "block";
      this.tip.textContent = fmt.clock(t[best]);
    }
  }

  window.SluiceChart = { LineChart, fmt };
})();
