// The dashboard page: the feed folds events into the model as they come; the DOM is updated
// at most once per animation frame, only for the panels whose data changed, and each panel at
// its own pace (PANELS below).

import { Charts } from "./charts.js";
import { Controls } from "./controls.js";
import { Processes } from "./processes.js";
import { Feed } from "./feed.js";
import { Model } from "./model.js";
import { ReplayPanel } from "./replay.js";
import { DecisionTable } from "./table.js";
import { Topology, parseLinks } from "./topology.js";
import { saturation } from "./health.js";
import { fmtPct, fmtRate, fmtThreshold, getJSON, rateUnit, showMode } from "./util.js";
import { Waterfall } from "./waterfall.js";

const $ = (id) => document.getElementById(id);

const config = {
  prfaasClusters: (document.body.dataset.prfaasClusters || "prfaas").split(","),
  tableRows: Number(document.body.dataset.tableRows || 100),
  links: parseLinks(document.body.dataset.links),
  tokenScale: Number(document.body.dataset.tokenScale || 1),
};
const model = new Model(config);
const topology = new Topology($("topology"), config.prfaasClusters, config.links);
const charts = new Charts($("charts"), config.tokenScale);
const waterfall = new Waterfall($("waterfall"), $("waterfall-title"), $("waterfall-detail"));
const table = new DecisionTable({
  body: $("decisions-body"),
  clusterFilter: $("filter-cluster"),
  policyFilter: $("filter-policy"),
  rows: config.tableRows,
  prfaasClusters: config.prfaasClusters,
  tokenScale: config.tokenScale,
  onSelect: select,
});
const rate = { count: 0, perSecond: 0 };
let frameRequested = false;

const feed = new Feed({
  onSnapshot(snapshot, why) {
    const selected = model.selected;
    model.load(snapshot);
    // After a reset this is another run (a replay started or stopped): its request ids mean
    // other requests, so the selection goes; after a reconnection or a gap it stays.
    if (why === "reset") {
      table.selected = null;
      waterfall.clear();
    } else if (selected) {
      select(selected);
    }
    renderNow("table");
  },
  onEvents(events) {
    timed("apply", () => {
      for (const event of events) model.apply(event);
    });
    rate.count += events.length;
    schedule();
  },
  onStatus: showMode,
});

function schedule() {
  if (!frameRequested) {
    frameRequested = true;
    requestAnimationFrame(frame);
  }
}

// Milliseconds spent per panel, summed: the load test reads them (window.prfaasDashboard).
const timings = { apply: 0, top: 0, topology: 0, table: 0, charts: 0, waterfall: 0, frames: 0 };

function timed(name, work) {
  const start = performance.now();
  work();
  timings[name] += performance.now() - start;
}

// Each panel redraws at most this often (ms). A table rewritten 60 times a second is
// unreadable and repaints every row each time; four times a second reads well and costs little.
const PANELS = [
  {
    name: "top", every: 250, wanted: (d) => d.top, render: renderTop, clear: (d) => { d.top = false; },
  },
  {
    name: "topology", every: 100,
    wanted: (d) => d.layout || d.topology || model.flows.size > 0,
    render: (now) => {
      topology.render(model, now);
      $("flow-count").textContent = `${model.flows.size} flows`;
    },
    clear: (d) => { d.layout = d.topology = false; },
  },
  {
    name: "table", every: 250,
    wanted: (d) => d.rebuildTable || model.fresh.length > 0,
    render: renderTable,
    clear: (d) => { d.rebuildTable = false; },
  },
  {
    name: "charts", every: 0, wanted: (d) => d.charts,
    render: () => charts.render(model.series.toArray()),
    clear: (d) => { d.charts = false; },
  },
  {
    name: "waterfall", every: 100, wanted: (d) => d.waterfall && model.selected,
    render: () => waterfall.render(model.requests.get(model.selected), model.lastTs),
    clear: (d) => { d.waterfall = false; },
  },
];
for (const panel of PANELS) panel.last = -Infinity;

function frame(now) {
  frameRequested = false;
  timings.frames += 1;
  let wait = Infinity;
  for (const panel of PANELS) {
    if (!panel.wanted(model.dirty)) continue;
    const due = panel.last + panel.every - now;
    if (due > 0) {
      wait = Math.min(wait, due);
      continue;
    }
    panel.last = now;
    timed(panel.name, () => panel.render(now));
    panel.clear(model.dirty);
  }
  if (wait < Infinity) setTimeout(schedule, wait);
}

function renderTable() {
  if (model.dirty.rebuildTable) table.rebuild(model.decisions.toArray());
  else table.add(model.fresh);
  model.fresh = [];
}

function renderTop() {
  const defaults = model.defaults;
  $("topbar-policy").textContent = model.policy ?? defaults.policy ?? "asking the router";
  // Until a decision or a threshold event says, t is what the router's admin state says.
  const t = model.policy !== null ? model.threshold : defaults.threshold;
  const known = model.policy !== null || defaults.policy !== null;
  $("topbar-threshold").textContent = known ? fmtThreshold(t, config.tokenScale) : "asking the router";
  const point = model.latestPoint();
  const offload = point && point.offload !== null ? fmtPct(point.offload) : null;
  $("topbar-offload").textContent = offload ?? (model.decisions.length ? "none in the last 10 s" : "no requests yet");
  renderLinks();
  const warning = saturation(model.health.toArray());
  $("saturation").hidden = warning === null;
  $("saturation").textContent = warning ?? "";
}

/** The top bar's link badge: each link's state and bandwidth, from its samples or, before
 * the first one, from the link's control API. */
function renderLinks() {
  const links = [...model.links.values()];
  if (!links.length && model.defaults.link) links.push(model.defaults.link);
  const text = links.map((link) => {
    const rate = link.bandwidth_bps ? fmtRate(link.bandwidth_bps, rateUnit(link.bandwidth_bps)) : "unshaped";
    const state = `${link.up ? "up" : "DOWN"} · ${rate}`;
    return links.length > 1 ? `${link.link} ${state}` : state;
  });
  $("topbar-link").textContent = text.length ? text.join("; ") : "asking the link";
  $("topbar-link").className = links.some((link) => !link.up) ? "down" : "";
}

/** The router's and the link's settings, read by the controls: the top bar's defaults. */
function showDefaults(state) {
  if (state.router) {
    model.defaults.policy = state.router.policy;
    model.defaults.threshold = state.router.threshold;
  }
  if (state.link) {
    const link = state.link;
    model.defaults.link = { link: link.name ?? "link", up: link.up, bandwidth_bps: link.bandwidth_bps };
  }
  model.dirty.top = true;
  schedule();
}

async function select(id) {
  model.selected = id;
  const known = model.requests.get(id);
  if (!known || !known.phases.length) {
    try {
      const view = await getJSON(`api/requests/${encodeURIComponent(id)}`);
      model.requests.set(id, view);
    } catch (error) {
      $("waterfall-detail").textContent = error.message;
    }
  }
  model.dirty.waterfall = true;
  renderNow("waterfall");
}

/** A user's action shows at the next frame, whatever the panel's pace. */
function renderNow(name) {
  PANELS.find((panel) => panel.name === name).last = -Infinity;
  schedule();
}

for (const filter of [$("filter-cluster"), $("filter-policy")]) {
  filter.addEventListener("change", () => {
    model.dirty.rebuildTable = true;
    renderNow("table");
  });
}

setInterval(() => {
  rate.perSecond = rate.count;
  rate.count = 0;
  $("topbar-rate").textContent = String(rate.perSecond);
  $("topbar-drops").textContent = String(feed.dropped);
}, 1000);

const controls = new Controls(document, showDefaults);
controls.start();
const showProcesses = (states) => {
  topology.setProcesses(states);
  model.dirty.topology = true;
  schedule();
};
new Processes(document, showProcesses, (text, error) => controls.say(text, error)).start();
new ReplayPanel(document).start();
feed.start();
window.prfaasDashboard = { model, feed, timings }; // for the browser tests and the curious
