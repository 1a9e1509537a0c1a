// Charts panel: six small canvas line charts drawn by hand from the server's series points.

import { drawGrid, drawLine, fitCanvas } from "./canvas.js";
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
    const { ctx, ratio } = fitCanvas(this.canvas);
    const { width, height } = this.canvas;
    ctx.clearRect(0, 0, width, height);
    this.canvas.dataset.points = String(points.length);
    if (!points.length) return;
    const end = points[points.length - 1].ts;
    const visible = points.filter((p) => p.ts > end - WINDOW_S);
    const top = this.top(visible);
    drawGrid(ctx, ratio, top, this.spec.format);
    const x = (p) => ((p.ts - (end - WINDOW_S)) / WINDOW_S) * width;
    const y = (v) => height - 4 - (v / top) * (height - 16);
    this.spec.lines.forEach((line, i) =>
      drawLine(ctx, ratio, visible, { ...line, color: this.colors[i], width: 1.6 }, x, y));
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

  top(points) {
    if (this.spec.max) return this.spec.max;
    let top = 0;
    for (const p of points) for (const line of this.spec.lines) top = Math.max(top, p[line.key] ?? 0);
    return top > 0 ? top * 1.15 : 1;
  }
}
