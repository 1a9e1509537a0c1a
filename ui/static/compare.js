// The compare page: deployments side by side on the same arrivals (prfaas sim-dashboard --compare).
//
// Each column is one deployment drawn as the single page draws it (its own feed and model,
// its topology); the charts and the summary are the simulation's own samples, polled, one
// line per deployment. Every collection is bounded, whatever the speed or the run's length.

import { drawGrid, drawLine, fitCanvas } from "./canvas.js";
import { Feed } from "./feed.js";
import { Model } from "./model.js";
import { Topology } from "./topology.js";
import { Ring, el, fmtPct, fmtSeconds, getJSON, postJSON, showMode } from "./util.js";

const COLORS = ["#3b6ea8", "#c2571a", "#5b8f3a"];
const OFFERED_COLOR = "#8a949e";
const POLL_MS = 500;
const KEEP = 1200; // samples per deployment: twenty virtual minutes at one a second
const WINDOW_S = 600; // the charts show the last ten virtual minutes
const TOPOLOGY_EVERY_MS = 100;

const $ = (id) => document.getElementById(id);
const fmtRps = (v) => v.toFixed(2);

class Column {
  constructor(info, color) {
    this.info = info;
    this.color = color;
    this.root = document.querySelector(`[data-column="${info.name}"]`);
    this.root.querySelector(".swatch").style.background = color;
    const links = info.links.map(([name, a, b]) => ({ name, a, b }));
    this.model = new Model({ prfaasClusters: ["prfaas"], tableRows: 20, links, tokenScale: info.token_scale });
    this.topology = new Topology(this.root.querySelector("svg"), ["prfaas"], links);
    this.samples = new Ring(KEEP);
    this.lastDrawn = -Infinity;
    this.feed = new Feed({
      base: `d/${encodeURIComponent(info.name)}/`,
      onSnapshot: (snapshot) => {
        this.model.load(snapshot);
        this.model.dirty.layout = true;
        schedule();
      },
      onEvents: (events) => {
        for (const event of events) this.model.apply(event);
        schedule();
      },
      onStatus: (mode) => showMode(mode),
    });
  }

  drawTopology(now) {
    if (now - this.lastDrawn < TOPOLOGY_EVERY_MS) return false;
    this.lastDrawn = now;
    this.topology.render(this.model, now);
    this.model.dirty.layout = this.model.dirty.topology = false;
    return true;
  }

  showStats() {
    const last = this.samples.last();
    if (!last) return;
    const text = {
      queued: String(last.queued),
      in_flight: String(last.in_flight),
      completed_rps: fmtRps(last.completed_rps),
      ttft_p90_s: last.ttft_p90_s === null ? "-" : fmtSeconds(last.ttft_p90_s),
      slo_attained: last.slo_attained === null ? "-" : fmtPct(last.slo_attained),
      egress_gbps: this.info.links.length ? `${last.egress_gbps.toFixed(1)} Gbps` : "no link",
    };
    for (const node of this.root.querySelectorAll("[data-stat]")) node.textContent = text[node.dataset.stat];
  }
}

const CHARTS = [
  { id: "ttft", title: "TTFT P90 (s)", key: "ttft_p90_s", format: (v) => v.toFixed(1) },
  { id: "completed", title: "completed per second (grey: offered)", key: "completed_rps", offered: "offered_rps", format: fmtRps },
  { id: "slo", title: "within the SLO (queue ≤ 5 s, 40 tok/s)", key: "slo_attained", format: fmtPct, max: 1 },
  { id: "queued", title: "queued requests", key: "queued", format: (v) => v.toFixed(0) },
  { id: "egress", title: "link egress (Gbps)", key: "egress_gbps", format: (v) => v.toFixed(1) },
];

class CompareChart {
  constructor(container, spec) {
    this.spec = spec;
    this.value = el("b", { "data-testid": `chart-${spec.id}-value` });
    this.canvas = el("canvas", { "data-testid": `chart-${spec.id}`, "data-points": "0" });
    const caption = el("figcaption", {}, el("span", {}, spec.title), this.value);
    container.append(el("figure", { class: "chart" }, caption, this.canvas));
  }

  draw(columns) {
    const { ctx, ratio } = fitCanvas(this.canvas);
    const { width, height } = this.canvas;
    ctx.clearRect(0, 0, width, height);
    const series = columns.map((column) => column.samples.toArray());
    const end = Math.max(0, ...series.map((s) => (s.length ? s[s.length - 1].at : 0)));
    const visible = series.map((s) => s.filter((p) => p.at > end - WINDOW_S));
    this.canvas.dataset.points = String(visible.reduce((n, s) => n + s.length, 0));
    const lines = columns.map((column, i) => ({ points: visible[i], key: this.spec.key, color: column.color, width: 1.8 }));
    if (this.spec.offered && visible[0]) lines.unshift({ points: visible[0], key: this.spec.offered, color: OFFERED_COLOR, dashed: true, width: 1.8 });
    const top = this.spec.max ?? Math.max(1e-9, ...lines.flatMap((l) => l.points.map((p) => p[l.key] ?? 0))) * 1.15;
    const x = (p) => ((p.at - (end - WINDOW_S)) / WINDOW_S) * width;
    const y = (v) => height - 4 - (v / top) * (height - 16);
    drawGrid(ctx, ratio, top, this.spec.format);
    for (const line of lines) drawLine(ctx, ratio, line.points, line, x, y);
    this.value.textContent = columns
      .map((column) => {
        const last = column.samples.last();
        return last && last[this.spec.key] !== null ? this.spec.format(last[this.spec.key]) : "-";
      })
      .join(" / ");
  }
}

const described = JSON.parse(document.body.dataset.columns);
const columns = described.map((info, i) => new Column(info, COLORS[i % COLORS.length]));
const charts = CHARTS.map((spec) => new CompareChart($("charts"), spec));
const state = { after: -1, summary: null, polls: 0, speed: null, charted: false };
let frameRequested = false;

$("legend").replaceChildren(
  ...columns.map((c) => el("span", { class: "legend-item" }, el("i", { style: `background:${c.color}` }), c.info.title)),
  el("span", { class: "legend-item" }, el("i", { style: `background:${OFFERED_COLOR}` }), "offered"),
);

function schedule() {
  if (!frameRequested) {
    frameRequested = true;
    requestAnimationFrame(frame);
  }
}

function frame(now) {
  frameRequested = false;
  let pending = false;
  for (const column of columns) {
    const wanted = column.model.dirty.layout || column.model.dirty.topology || column.model.flows.size > 0;
    if (wanted && !column.drawTopology(now)) pending = true;
  }
  if (state.charted) {
    for (const chart of charts) chart.draw(columns);
    for (const column of columns) column.showStats();
    state.charted = false;
  }
  if (pending) setTimeout(schedule, TOPOLOGY_EVERY_MS);
}

async function poll() {
  let answer;
  try {
    answer = await getJSON(`api/compare?after=${state.after}`);
  } catch (error) {
    say(`samples: ${error.message}`, true);
    return;
  }
  state.polls += 1;
  for (const column of columns) {
    for (const sample of answer.samples[column.info.name] || []) {
      column.samples.push(sample);
      state.after = Math.max(state.after, sample.at);
    }
  }
  state.summary = answer.summary;
  state.charted = true;
  showClock(answer);
  showSummary(answer.summary);
  schedule();
}

function showClock(answer) {
  const achieved = answer.achieved ? ` · running at ${answer.achieved.toFixed(1)}×` : "";
  $("clock").textContent = `${(answer.virtual_s / 60).toFixed(1)} min${achieved}`;
  const load = answer.load;
  $("offered").textContent = load ? (load.running ? `${load.rate.toFixed(2)} req/s` : "stopped") : "-";
  const speed = $("ctl-speed");
  if (answer.speed && answer.speed !== state.speed && document.activeElement !== speed) {
    state.speed = answer.speed;
    if (![...speed.options].some((o) => Number(o.value) === answer.speed)) speed.add(new Option(`${answer.speed}×`, answer.speed));
    speed.value = String(answer.speed);
  }
  $("drops").textContent = String(columns.reduce((n, c) => n + c.feed.dropped, 0));
}

/** The summary line: each deployment's completed rate over the window against the baseline's. */
function showSummary(summary) {
  const line = $("summary");
  const base = summary.baseline;
  const title = (name) => columns.find((c) => c.info.name === name)?.info.title ?? name;
  const others = columns.map((c) => c.info.name).filter((name) => name !== base && summary.ratios[name] !== null);
  if (!summary.window_s || !others.length || !summary.completed_rps[base]) return;
  const minutes = (summary.window_s / 60).toFixed(1);
  const parts = others.map((name) =>
    `${title(name)} completed ${summary.ratios[name].toFixed(2)}× ${title(base)} ` +
    `(${fmtRps(summary.completed_rps[name])} against ${fmtRps(summary.completed_rps[base])} req/s)`);
  line.textContent = `Over the last ${minutes} virtual minutes: ${parts.join("; ")}.`;
  line.dataset.ratio = String(summary.ratios[others[0]]);
  line.dataset.window = String(summary.window_s);
}

function say(text, error = false) {
  $("ctl-status").textContent = text;
  $("ctl-status").className = error ? "status error" : "status";
}

async function send(path, body) {
  try {
    await postJSON(`api/control/${path}`, body);
    say(`${path}: ${JSON.stringify(body)} ok`);
  } catch (error) {
    say(`${path}: ${error.message}`, true);
  }
}

$("ctl-start").addEventListener("click", () =>
  send("workload", { action: "start", rate: Number($("ctl-rate").value), kind: "mixed" }));
$("ctl-stop").addEventListener("click", () => send("workload", { action: "stop", rate: 1, kind: "mixed" }));
$("ctl-speed").addEventListener("change", (e) => send("speed", { speed: Number(e.target.value) }));

for (const column of columns) column.feed.start();
poll();
setInterval(poll, POLL_MS);
// For the browser tests and the curious.
window.prfaasCompare = {
  columns: columns.map((c) => ({ name: c.info.name, model: c.model, feed: c.feed, samples: c.samples })),
  state,
};
