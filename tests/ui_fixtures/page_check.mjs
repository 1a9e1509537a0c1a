// Node check of the page's pure parts (no DOM), for tests/test_ui_app.py: reads one JSON
// object on stdin {links, scale, workers, health} and prints how the topology panel lays out
// every cluster and link, how t and rates read, and the saturation hint.
import { readFileSync } from "node:fs";
import { saturation } from "../../ui/static/health.js";
import { clusterBoxes, knownLinks, parseLinks, placeLinks } from "../../ui/static/topology.js";
import { fmtRate, fmtThreshold, rateUnit } from "../../ui/static/util.js";

const input = JSON.parse(readFileSync(0, "utf8"));
const configured = parseLinks(input.links);
const links = knownLinks(configured, input.reported);
const ends = links.flatMap((link) => [link.a, link.b]).filter(Boolean);
const boxes = clusterBoxes([...input.workers.map((w) => w.cluster), ...ends], new Set(input.prfaas));
const unit = rateUnit(input.bandwidth_bps, input.throughput_bps);
console.log(JSON.stringify({
  boxes: Object.fromEntries(boxes),
  links: placeLinks(links, boxes),
  threshold: fmtThreshold(input.t, input.scale),
  rates: [fmtRate(input.bandwidth_bps, unit), fmtRate(input.throughput_bps, unit)],
  saturation: input.health.map((samples) => saturation(samples)),
}));
