// Charts panel: six small canvas line charts drawn by hand from the server's series points.

import { el, fmtPct, fmtScale, fmtSeconds, fmtTokens, rateUnit } from "./util.js";

const WINDOW_S = 120; // the charts show the last two minutes of event time

const CHARTS = [
  {
    id: "ttft", title: "TTFT p50 / p90", format: fmtSeconds,
    lines: [{ key: "ttft_p50_s", color: "--p50" }, { key: "ttft_p90_s", color: "--p90" }],
  },
  { id: "throughput", title: "throughput (req/s)", format: (v) => v.toFixed(2), lines: [{ key: "throughput_rps", color: "--decode" }] },
  {
    // Egress and bandwidth in the bandwidth's unit (Mbps for the demo link, Gbps for the
    // paper's), named in the title.
    id: "egress", title: "egress / bandwidth", format: (v) => v.toFixed(v >= 10 ? 0 : 2),
    unit: (points) => {
      const unit = rateUnit(Math.max(0, ...points.map((p) => p.bandwidth_gbps * 1e9)),
        Math.max(0, ...points.map((p) => p.egress_gbps * 1e9)));
      return { name: unit.name, factor: 1e9 / unit.per, keys: ["egress_gbps", "bandwidth_gbps"] };
    },
    lines: [{ key: "egress_gbps", color: "--full" }, { key: "bandwidth_gbps", color: "--muted", dashed: true }],
  },
  { id: "threshold", title: "threshold t (served tokens)", format: fmtTokens, lines: [{ key: "threshold", color: "--draining" }] },
  { id: "offload", title: "offloaded to PrfaaS", format: fmtPct, max: 1, lines: [{ key: "offload", color: "--prefill" }] },
  { id: "cache", title: "cache hit ratio", format: fmtPct, max: 1, lines: [{ key: "cache_hit", color: "--incremental" }] },
];

export class Charts {
  constructor(container, tokenScale = 1) {
    const style = getComputedStyle(document.documentElement);
    this.charts = CHARTS.map((spec) => new LineChart(container, withScale(spec, tokenScale), style));
  }

  render(points) {
    for (const chart of this.charts) chart.draw(points);
  }
}

/** The t chart's value also at paper length when the served lengths are scaled. */
function withScale(spec, scale) {
  if (spec.id !== "threshold" || scale === 1) return spec;
  return {
    ...spec,
    title: `threshold t (served tokens, scale ${fmtScale(scale)})`,
    value: (v) => `${fmtTokens(v)} (${fmtTokens(v / scale)} paper)`,
  };
}

class LineChart {
  constructor(container, spec, style) {
    this.spec = spec;
    this.colors = spec.lines.map((line) => style.getPropertyValue(line.color).trim() || "#333");
    this.value = el("b", { "data-testid": `chart-${spec.id}-value` });
    this.title = el("span", { "data-testid": `chart-${spec.id}-title` }, spec.title);
    this.canvas = el("canvas", { "data-testid": `chart-${spec.id}`, "data-points": "0" });
    const caption = el("figcaption", {}, this.title, this.value);
    container.append(el("figure", { class: "chart" }, caption, this.canvas));
  }

  draw(rawPoints) {
    const points = this.inUnit(rawPoints);
    const ctx = this.fit();
    const { width, height } = this.canvas;
    ctx.clearRect(0, 0, width, height);
    this.canvas.dataset.points = String(points.length);
    if (!points.length) return;
    const end = points[points.length - 1].ts;
    const visible = points.filter((p) => p.ts > end - WINDOW_S);
    const top = this.top(visible);
    this.grid(ctx, width, height, top);
    const x = (ts) => ((ts - (end - WINDOW_S)) / WINDOW_S) * width;
    const y = (v) => height - 4 - (v / top) * (height - 16);
    this.spec.lines.forEach((line, i) => this.line(ctx, visible, line, this.colors[i], x, y));
    const last = points[points.length - 1];
    const value = this.spec.value ?? this.spec.format;
    this.value.textContent = this.spec.lines
      .map((line) => (last[line.key] === null ? "-" : value(last[line.key])))
      .join(" / ") + (this.unitName ? ` ${this.unitName}` : "");
  }

  /** The points in the chart's unit, when it has one; the title names it. */
  inUnit(points) {
    if (!this.spec.unit || !points.length) return points;
    const { name, factor, keys } = this.spec.unit(points);
    if (name !== this.unitName) {
      this.unitName = name;
      this.title.textContent = `${this.spec.title} (${name})`;
    }
    if (factor === 1) return points;
    return points.map((p) => {
      const out = { ...p };
      for (const key of keys) if (out[key] !== null && out[key] !== undefined) out[key] *= factor;
      return out;
    });
  }

  fit() {
    const ratio = window.devicePixelRatio || 1;
    const width = Math.round(this.canvas.clientWidth * ratio) || 300;
    const height = Math.round(this.canvas.clientHeight * ratio) || 110;
    if (this.canvas.width !== width || this.canvas.height !== height) {
      this.canvas.width = width;
      this.canvas.height = height;
    }
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    this.ratio = ratio;
    return ctx;
  }

  top(points) {
    if (this.spec.max) return this.spec.max;
    let top = 0;
    for (const p of points) for (const line of this.spec.lines) top = Math.max(top, p[line.key] ?? 0);
    return top > 0 ? top * 1.15 : 1;
  }

  grid(ctx, width, height, top) {
    ctx.strokeStyle = "#eceff2";
    ctx.fillStyle = "#8a949e";
    ctx.lineWidth = 1;
    ctx.font = `${10 * this.ratio}px system-ui, sans-serif`;
    for (const f of [0.5, 1]) {
      const gy = height - 4 - f * (height - 16);
      ctx.beginPath();
      ctx.moveTo(0, gy);
      ctx.lineTo(width, gy);
      ctx.stroke();
      ctx.fillText(this.spec.format(top * f), 2, gy - 2);
    }
  }

  line(ctx, points, line, color, x, y) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.6 * this.ratio;
    ctx.setLineDash(line.dashed ? [4 * this.ratio, 3 * this.ratio] : []);
    ctx.beginPath();
    let pen = false;
    for (const p of points) {
      const v = p[line.key];
      if (v === null || v === undefined) {
        pen = false;
        continue;
      }
      if (pen) ctx.lineTo(x(p.ts), y(v));
      else ctx.moveTo(x(p.ts), y(v));
      pen = true;
    }
    ctx.stroke();
    ctx.setLineDash([]);
  }
}
