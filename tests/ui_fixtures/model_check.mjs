// Node check of the page's model (no DOM): reads JSON-lines events on stdin, folds them in,
// and prints what the bounds and the ring buffer look like, for tests/test_ui_app.py.
import { readFileSync } from "node:fs";
import { Model, MAX_FLOWS } from "../../ui/static/model.js";
import { BoundedMap, Ring } from "../../ui/static/util.js";
import { describe, segments } from "../../ui/static/waterfall.js";
import { bpsToSlider, sliderToBps } from "../../ui/static/controls.js";

const events = readFileSync(0, "utf8").trim().split("\n").map((line) => JSON.parse(line));
const model = new Model({ tableRows: 50 });
let maxFlows = 0;
for (const event of events) {
  model.apply(event);
  maxFlows = Math.max(maxFlows, model.liveFlows(1e12).size);
}

// The ring against the obvious reference: an array trimmed from the front.
const ring = new Ring(7);
const reference = [];
let ringAgrees = true;
for (let i = 0; i < 40; i += 1) {
  ring.push(i);
  reference.push(i);
  if (reference.length > 7) reference.shift();
  ringAgrees &&= JSON.stringify(ring.toArray()) === JSON.stringify(reference) && ring.last() === i;
}
const bounded = new BoundedMap(3);
for (const key of "abcdef") bounded.set(key, key);

const phase = (ts, name) => ({ type: "phase", ts, request_id: "r", phase: name, worker: "w" });

// A migrated request: its attempts' phases (ids "m", "m.m1") and the migration, one record.
const migratedModel = new Model({ tableRows: 5 });
for (const event of [{ ...phase(0, "decode"), request_id: "m" }, { ...phase(2, "prefill"), request_id: "m.m1" },
  { type: "migrated", ts: 1, request_id: "m", reason: "decode_lost" }]) migratedModel.apply(event);
const migratedRecord = migratedModel.requests.get("m");
const phases = [phase(3, "decode"), phase(0, "queued"), phase(1, "prefill"), phase(2, "transfer")];
console.log(JSON.stringify({
  events: model.events,
  decisions: model.decisions.length,
  fresh: model.fresh.length,
  requests: model.requests.size,
  series: model.series.length,
  maxFlows,
  flowBound: MAX_FLOWS,
  workers: model.workers.size,
  ringAgrees,
  boundedKeys: [...bounded.keys()].join(""),
  lastDecision: model.decisions.last().request_id,
  waterfall: segments([...phases, phase(5, "finished")], 9).map((p) => [p.phase, p.start, p.end]),
  waterfallOpen: segments(phases, 9).map((p) => p.end),
  slider: [sliderToBps(575), bpsToSlider(2e9), sliderToBps(0), sliderToBps(1000)],
  migrated: [migratedModel.requests.size, migratedRecord.phases.length, migratedRecord.migrations.length],
  traced: describe({ done: { ok: false, error: "x", trace_id: "4bf92f35" } }),
  untraced: describe({ done: { ok: false, error: "x", trace_id: "" } }),
}));
