// Charts panel: six small canvas line charts drawn by hand from the server's series points.

import { el, fmtPct, fmtSeconds, fmtTokens } from "./util.js";

const WINDOW_S = 120; // the charts show the last two minutes of event time

const CHARTS = [
  {
    id: "ttft", title: "TTFT p50 / p90", format: fmtSeconds,
    lines: [{ key: "ttft_p50_s", color: "--p50" }, { key: "ttft_p90_s", color: "--p90" }],
  },
  { id: "throughput", title: "throughput (req/s)", format: (v) => v.toFixed(2), lines: [{ key: "throughput_rps", color: "--decode" }] },
  {
    id: "egress", title: "egress (Gbps) / bandwidth", format: (v) => v.toFixed(2),
    lines: [{ key: "egress_gbps", color: "--full" }, { key: "bandwidth_gbps", color: "--muted", dashed: true }],
  },
  { id: "threshold", title: "threshold t (tokens)", format: fmtTokens, lines: [{ key: "threshold", color: "--draining" }] },
  { id: "offload", title: "offloaded to PrfaaS", format: fmtPct, max: 1, lines: [{ key: "offload", color: "--prefill" }] },
  { id: "cache", title: "cache hit ratio", format: fmtPct, max: 1, lines: [{ key: "cache_hit", color: "--incremental" }] },
];

export class Charts {
  constructor(container) {
    const style = getComputedStyle(document.documentElement);
    this.charts = CHARTS.map((spec) => new LineChart(container, spec, style));
  }

  render(points) {
    for (const chart of this.charts) chart.draw(points);
  }
}

class LineChart {
  constructor(container, spec, style) {
    this.spec = spec;
    this.colors = spec.lines.map((line) => style.getPropertyValue(line.color).trim() || "#333");
    this.value = el("b");
    this.canvas = el("canvas", { "data-testid": `chart-${spec.id}`, "data-points": "0" });
    const caption = el("figcaption", {}, el("span", {}, spec.title), this.value);
    container.append(el("figure", { class: "chart" }, caption, this.canvas));
  }

  draw(points) {
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
    this.value.textContent = this.spec.lines
      .map((line) => (last[line.key] === null ? "-" : this.spec.format(last[line.key])))
      .join(" / ");
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
