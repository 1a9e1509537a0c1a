// Request timeline: one request's phases (queued, prefill, transfer, decode) as a waterfall,
// with the TTFT marked and each migration (the break, and where the request continued) as a
// line across it; it keeps growing while the request is still running.

import { fmtBytes, fmtSeconds, fmtTokens, svgEl } from "./util.js";

const PHASES = ["queued", "prefill", "transfer", "decode"];
const WIDTH = 440;
const LEFT = 70; // room for the phase names
const ROW = 30;
const TOP = 14;

/** [{phase, start, end, worker}] from the phase events; an open phase runs until `now`. */
export function segments(phases, now) {
  const sorted = [...phases].sort((a, b) => a.ts - b.ts);
  const out = [];
  sorted.forEach((event, i) => {
    if (!PHASES.includes(event.phase)) return;
    const next = sorted[i + 1];
    out.push({ phase: event.phase, start: event.ts, end: next ? next.ts : now, worker: event.worker });
  });
  return out;
}

export class Waterfall {
  constructor(svg, title, detail) {
    this.svg = svg;
    this.title = title;
    this.detail = detail;
  }

  clear() {
    this.svg.replaceChildren();
    this.title.textContent = "click a decision";
    this.detail.textContent = "";
  }

  render(record, now) {
    this.svg.replaceChildren();
    if (!record) return;
    this.title.textContent = record.request_id;
    const parts = segments(record.phases, Math.max(now, ...record.phases.map((p) => p.ts)));
    if (!parts.length) {
      this.detail.textContent = "no phase events seen for this request yet";
      return;
    }
    const start = parts[0].start;
    const span = Math.max(parts[parts.length - 1].end - start, 1e-3);
    const scale = (t) => LEFT + ((t - start) / span) * (WIDTH - LEFT - 10);
    PHASES.forEach((phase, row) => {
      this.svg.append(svgEl("text", { x: 4, y: TOP + row * ROW + 14 }, phase));
    });
    for (const part of parts) this.bar(part, scale, record);
    for (const moved of record.migrations || []) this.migration(moved, scale);
    this.axis(span, scale, start);
    if (record.done && record.done.ok) {
      const x = scale(start + record.done.ttft_s);
      this.svg.append(svgEl("line", { class: "ttft", x1: x, x2: x, y1: TOP - 6, y2: TOP + 4 * ROW }));
      this.svg.append(svgEl("text", { class: "muted", x: x + 3, y: TOP - 2 }, `TTFT ${fmtSeconds(record.done.ttft_s)}`));
    }
    this.detail.textContent = describe(record);
  }

  bar(part, scale, record) {
    const row = PHASES.indexOf(part.phase);
    const x = scale(part.start);
    const width = Math.max(scale(part.end) - x, 1.5);
    const incremental = part.phase === "transfer" && record.flow && record.flow.incremental;
    this.svg.append(
      svgEl("rect", {
        class: `bar ${part.phase}${incremental ? " incremental" : ""}`,
        x, y: TOP + row * ROW + 2, width, height: 16, rx: 2, "data-testid": `waterfall-${part.phase}`,
      }, svgEl("title", {}, `${part.phase} on ${part.worker}: ${fmtSeconds(part.end - part.start)}`)),
    );
    const label = `${fmtSeconds(part.end - part.start)} · ${part.worker}`;
    const inside = width > 120;
    this.svg.append(svgEl("text", {
      class: inside ? "" : "muted", x: inside ? x + 4 : Math.min(x + width + 4, WIDTH - 120),
      y: TOP + row * ROW + 14, fill: inside ? "#fff" : undefined,
    }, label));
  }

  migration(moved, scale) {
    const x = scale(moved.ts);
    const where = `${moved.prefill_worker} → ${moved.decode_worker}`;
    this.svg.append(svgEl("line", {
      class: "migration", x1: x, x2: x, y1: TOP - 6, y2: TOP + 4 * ROW, "data-testid": "waterfall-migration",
    }, svgEl("title", {}, `migrated (${moved.reason}) from ${moved.failed_worker} after ` +
      `${moved.tokens_kept} tokens: continues on ${where}`)));
  }

  axis(span, scale, start) {
    const y = TOP + 4 * ROW + 6;
    for (const [f, anchor] of [[0, "start"], [0.5, "middle"], [1, "end"]]) {
      this.svg.append(svgEl("text", { class: "muted", x: scale(start + f * span), y: y + 10, "text-anchor": anchor },
        fmtSeconds(f * span)));
    }
  }
}

export function describe(record) {
  const parts = [];
  const d = record.decision;
  if (d) {
    parts.push(`${fmtTokens(d.total_len)} tokens, ${fmtTokens(d.total_len - d.incremental_len)} cached, ` +
      `${fmtTokens(d.incremental_len)} incremental → ${d.cluster} (${d.reason})`);
  }
  const f = record.flow;
  if (f) parts.push(`KV ${fmtBytes(f.bytes_total)} ${f.incremental ? "incremental" : "full"}` +
    `${f.via_link ? ` over ${f.via_link}` : " (intra-cluster)"}`);
  for (const moved of record.migrations || []) {
    parts.push(`migrated (${moved.reason}) from ${moved.failed_worker} after ${moved.tokens_kept} tokens ` +
      `→ ${moved.prefill_worker} / ${moved.decode_worker}`);
  }
  const done = record.done;
  if (done) {
    parts.push(done.ok ? `TTFT ${fmtSeconds(done.ttft_s)}, e2e ${fmtSeconds(done.e2e_s)}, ` +
      `${done.output_tokens} tokens out` : `failed: ${done.error}`);
  }
  // With tracing on, the request's trace id: paste it into Jaeger or Tempo.
  const trace = (d && d.trace_id) || (done && done.trace_id);
  if (trace) parts.push(`trace ${trace}`);
  return parts.join(" · ");
}
