// The page's model: what the panels draw, folded from the snapshot and the live events.
//
// Events are applied as they arrive (cheap, bounded); the DOM is touched only once a frame,
// for the panels marked dirty. Every collection has a fixed bound, so an hour-long run or a
// burst of thousands of events costs the page no more memory or DOM than a quiet minute.

import { WINDOW } from "./health.js";
import { BoundedMap, Ring } from "./util.js";

export const MAX_FLOWS = 48; // KV flows in flight drawn at once
const MAX_POINTS = 600; // chart points (ten minutes at one a second)
const MAX_REQUESTS = 400; // requests whose events the waterfall can still show
const DONE_FLOW_LINGER_MS = 700; // a finished flow stays this long to fade out

export class Model {
  constructor(config) {
    this.config = config;
    // What the controls read from the router and the link before any event says (the top
    // bar shows these until the first decision or link sample); kept across resets.
    this.defaults = { policy: null, threshold: null, link: null };
    this.reset();
  }

  reset() {
    this.decisions = new Ring(this.config.tableRows);
    this.fresh = []; // decisions not yet drawn (newest last)
    this.workers = new Map();
    this.links = new Map();
    this.flows = new Map(); // request_id -> {flow, doneAt}
    this.series = new Ring(MAX_POINTS);
    this.requests = new BoundedMap(MAX_REQUESTS); // request_id -> {decision, phases, flow, done}
    this.policy = null;
    this.threshold = null;
    this.health = new Ring(WINDOW); // {ts, queued, ttft} at each chart point (health.js)
    this.selected = null; // the request the waterfall shows
    this.lastTs = 0;
    this.events = 0;
    this.dirty = { top: true, topology: true, layout: true, table: true, charts: true, waterfall: true };
  }

  load(snapshot) {
    this.reset();
    this.mode = snapshot.mode;
    this.policy = snapshot.policy;
    this.threshold = snapshot.threshold;
    for (const decision of snapshot.decisions) this.decisions.push(decision);
    for (const worker of snapshot.workers) this.workers.set(worker.worker, worker);
    for (const link of snapshot.links) this.links.set(link.link, link);
    for (const flow of snapshot.flows) this.flows.set(flow.request_id, { flow, doneAt: null });
    for (const point of snapshot.series) this.series.push(point);
    this.dirty.rebuildTable = true;
  }

  apply(event) {
    this.events += 1;
    if (event.ts > this.lastTs) this.lastTs = event.ts;
    const handler = HANDLERS[event.type];
    if (handler) handler(this, event);
  }

  request(id) {
    let record = this.requests.get(id);
    if (!record) {
      record = { request_id: id, decision: null, phases: [], flow: null, done: null, migrations: [] };
      this.requests.set(id, record);
    }
    return record;
  }

  touchRequest(id) {
    if (id === this.selected) this.dirty.waterfall = true;
  }

  /** Flows to draw; forgets finished ones that have faded, and the oldest beyond the bound. */
  liveFlows(now) {
    for (const [id, entry] of this.flows) {
      if (entry.doneAt !== null && now - entry.doneAt > DONE_FLOW_LINGER_MS) this.flows.delete(id);
    }
    while (this.flows.size > MAX_FLOWS) this.flows.delete(this.flows.keys().next().value);
    return this.flows;
  }

  latestPoint() {
    return this.series.last();
  }

  /** Requests waiting in the workers' queues now. */
  queued() {
    let total = 0;
    for (const worker of this.workers.values()) total += worker.queue_depth;
    return total;
  }
}

/** The router's id of a request from one of its attempts' ids ("req-…-7.m1": services/contract/events.py). */
export function baseRequestId(id) {
  const match = /^(.*)\.m\d+$/.exec(id);
  return match ? match[1] : id;
}

const HANDLERS = {
  decision(model, event) {
    model.decisions.push(event);
    model.fresh.push(event);
    if (model.fresh.length > model.config.tableRows) model.fresh.shift();
    model.policy = event.policy;
    model.threshold = event.threshold;
    model.request(event.request_id).decision = event;
    model.touchRequest(event.request_id);
    model.dirty.table = model.dirty.top = true;
  },
  worker(model, event) {
    const before = model.workers.get(event.worker);
    if (!before || before.role !== event.role || before.cluster !== event.cluster) {
      model.dirty.layout = true;
    }
    model.workers.set(event.worker, event);
    model.dirty.topology = true;
  },
  role(model, event) {
    const worker = model.workers.get(event.worker);
    if (worker) model.workers.set(event.worker, { ...worker, role: event.new });
    model.dirty.layout = model.dirty.topology = true;
  },
  link(model, event) {
    model.links.set(event.link, event);
    model.dirty.topology = model.dirty.top = true;
  },
  kvflow(model, event) {
    const finished = event.phase === "done" || event.phase === "failed";
    const entry = model.flows.get(event.request_id);
    if (entry || !finished) {
      model.flows.set(event.request_id, { flow: event, doneAt: finished ? performance.now() : null });
    }
    const id = baseRequestId(event.request_id);
    model.request(id).flow = event;
    model.touchRequest(id);
    model.dirty.topology = true;
  },
  phase(model, event) {
    // A migrated request's attempts are one timeline.
    const id = baseRequestId(event.request_id);
    const record = model.request(id);
    if (record.phases.length < 32) record.phases.push(event);
    model.touchRequest(id);
  },
  migrated(model, event) {
    const record = model.request(event.request_id);
    if (record.migrations.length < 32) record.migrations.push(event);
    model.touchRequest(event.request_id);
  },
  done(model, event) {
    model.request(event.request_id).done = event;
    model.touchRequest(event.request_id);
  },
  threshold(model, event) {
    model.policy = event.policy;
    model.threshold = event.new;
    model.dirty.top = true;
  },
  series(model, event) {
    model.series.push(event);
    model.health.push({ ts: event.ts, queued: model.queued(), ttft: event.ttft_p50_s });
    model.dirty.charts = model.dirty.top = true;
  },
};
