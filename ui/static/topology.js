// Topology panel: cluster boxes with their worker chips, every link between a PrfaaS cluster
// and a PD cluster with its utilisation, and each KV transfer as a dot travelling from its
// prefill worker to its decode worker along its link, placed by the share of layers sent.

import { MAX_FLOWS } from "./model.js";
import { fmtBytes, fmtPct, fmtRate, rateUnit, svgEl } from "./util.js";

const WIDTH = 900;
const HEIGHT = 340;
const BOX_W = 320;
const LEFT_X = 10;
const RIGHT_X = WIDTH - 10 - BOX_W;
const LINK_Y = 170;
const ROLE_ORDER = { prefill: 0, draining: 1, decode: 2 };
const ANIMATED_FLOWS = 12; // beyond this many in flight, dots stop gliding (see style.css)
const LABELLED_FLOWS = 2; // size and layer progress written next to this many dots
const LANES = 5; // parallel transfers spread over this many tracks along the link

/** Cluster boxes: the PrfaaS clusters stacked on the left, the others on the right. */
export function clusterBoxes(names, prfaas) {
  const boxes = new Map();
  const sorted = [...new Set(names)].sort();
  for (const [side, x] of [[true, LEFT_X], [false, RIGHT_X]]) {
    const column = sorted.filter((name) => prfaas.has(name) === side);
    const height = (HEIGHT - 20) / Math.max(column.length, 1);
    column.forEach((name, index) => {
      boxes.set(name, { x, y: 10 + index * height, w: BOX_W, h: height - 6, prfaas: side });
    });
  }
  return boxes;
}

/** Where each link runs: from the right edge of its PrfaaS cluster's box, at the box's middle,
 * to the left edge of its PD cluster's box. `links` are [{name, a, b}], a the PrfaaS end;
 * a link without known ends goes from the PrfaaS cluster of its rank to the first PD one. */
export function placeLinks(links, boxes) {
  const left = [...boxes].filter(([, box]) => box.prfaas).map(([name]) => name);
  const right = [...boxes].filter(([, box]) => !box.prfaas).map(([name]) => name);
  return links.map((link, index) => {
    const a = link.a ?? left[index % Math.max(left.length, 1)];
    const b = link.b ?? right[0];
    const from = boxes.get(a);
    const to = boxes.get(b);
    const y0 = from ? from.y + from.h / 2 : LINK_Y;
    const y1 = to ? Math.min(Math.max(y0, to.y + 30), to.y + to.h - 10) : y0;
    return { name: link.name, a, b, x0: LEFT_X + BOX_W, y0, x1: RIGHT_X, y1 };
  });
}

/** The page's `data-links` ("name:a:b,..." from the topology) as [{name, a, b}]. */
export function parseLinks(text) {
  return (text || "").split(",").filter(Boolean).map((item) => {
    const [name, a, b] = item.split(":");
    return { name, a, b };
  });
}

/** The links to draw: the topology's (with their ends), then any other that reports. */
export function knownLinks(configured, reported) {
  const out = [...configured];
  for (const name of reported) if (!out.some((link) => link.name === name)) out.push({ name });
  return out;
}

export class Topology {
  constructor(svg, prfaasClusters, links = []) {
    this.svg = svg;
    this.prfaas = new Set(prfaasClusters);
    this.configuredLinks = links; // [{name, a, b}] from the topology
    this.linkViews = new Map(); // link name -> its drawn line, labels and geometry
    this.linkNames = "";
    this.chips = new Map(); // worker -> {group, x, y, w, h, ...}
    this.flowNodes = new Map(); // request_id -> <g>
    this.processes = new Map(); // process name -> supervisor state (up, down, restarting)
    this.layers = {
      clusters: svgEl("g"), link: svgEl("g"), chips: svgEl("g"), flows: svgEl("g"),
    };
    svg.append(...Object.values(this.layers));
  }

  render(model, now) {
    const links = knownLinks(this.configuredLinks, model.links.keys());
    const names = links.map((link) => link.name).join("\n");
    if (model.dirty.layout || names !== this.linkNames) this.layout(model, links);
    this.linkNames = names;
    for (const worker of model.workers.values()) this.updateChip(worker);
    for (const [name, view] of this.linkViews) this.updateLink(view, model.links.get(name));
    this.updateFlows(model.liveFlows(now));
  }

  layout(model, links) {
    const clusters = new Map();
    for (const worker of model.workers.values()) {
      if (!clusters.has(worker.cluster)) clusters.set(worker.cluster, []);
      clusters.get(worker.cluster).push(worker);
    }
    const ends = links.flatMap((link) => [link.a, link.b]).filter(Boolean);
    const boxes = clusterBoxes([...clusters.keys(), ...ends], this.prfaas);
    this.layers.clusters.replaceChildren();
    this.layers.chips.replaceChildren();
    this.layers.link.replaceChildren();
    this.chips.clear();
    this.linkViews.clear();
    for (const [name, box] of boxes) this.placeCluster(name, box, clusters.get(name) ?? []);
    for (const place of placeLinks(links, boxes)) this.linkViews.set(place.name, this.buildLink(place));
  }

  placeCluster(name, box, workers) {
    const label = box.prfaas ? `${name} (PrfaaS cluster)` : `${name} (PD cluster)`;
    this.layers.clusters.append(
      svgEl("rect", { class: "cluster-box", x: box.x, y: box.y, width: box.w, height: box.h, rx: 6,
        "data-cluster": name }),
      svgEl("text", { class: "cluster-name", x: box.x + 10, y: box.y + 18 }, label),
    );
    workers.sort(
      (a, b) => (ROLE_ORDER[a.role] ?? 3) - (ROLE_ORDER[b.role] ?? 3) || a.worker.localeCompare(b.worker),
    );
    this.placeChips(name, workers, box.x + 10, box.y + 28, box.w - 20, box.h - 34);
  }

  placeChips(cluster, workers, x, y, width, height) {
    const count = workers.length;
    let cols = 1;
    while (cols < 6 && Math.ceil(count / cols) * 50 > height) cols += 1;
    const rows = Math.max(Math.ceil(count / cols), 1);
    const w = (width - (cols - 1) * 8) / cols;
    const h = Math.min(44, height / rows - 6);
    workers.forEach((worker, index) => {
      const col = Math.floor(index / rows);
      const row = index % rows;
      const chip = { x: x + col * (w + 8), y: y + row * (h + 6), w, h, cluster };
      chip.group = this.buildChip(worker, chip);
      this.chips.set(worker.worker, chip);
      this.layers.chips.append(chip.group);
    });
  }

  buildChip(worker, chip) {
    const short = worker.worker.startsWith(`${worker.cluster}-`)
      ? worker.worker.slice(worker.cluster.length + 1)
      : worker.worker;
    chip.name = svgEl("text", { x: 6, y: 14 }, short);
    chip.role = svgEl("text", { class: "role", x: 6, y: 28 });
    chip.queue = svgEl("rect", { class: "queue", x: 0, y: chip.h - 4, height: 4, width: 0 });
    chip.title = svgEl("title");
    return svgEl(
      "g",
      { class: "chip", transform: `translate(${chip.x},${chip.y})`, "data-worker": worker.worker },
      chip.title,
      svgEl("rect", { class: "body", width: chip.w, height: chip.h, rx: 4 }),
      chip.name,
      chip.role,
      chip.queue,
    );
  }

  /** The supervisor's states; a worker whose process is not up shows it on its chip. */
  setProcesses(states) {
    this.processes = states;
  }

  updateChip(worker) {
    const chip = this.chips.get(worker.worker);
    if (!chip) return;
    const process = this.processes.get(worker.worker) ?? "up";
    if (chip.process !== process) {
      chip.group.dataset.process = process;
      chip.process = process;
    }
    const state = `${worker.role} ${worker.busy ? "busy" : "idle"}${process === "up" ? "" : ` ${process}`}`;
    if (chip.state !== state) {
      chip.group.setAttribute("class", `chip ${state}`);
      chip.state = state;
    }
    const role = process === "up"
      ? `${worker.role} · q ${worker.queue_depth} · run ${worker.running}`
      : `${process.toUpperCase()} (${worker.role})`;
    if (chip.role.textContent !== role) chip.role.textContent = role;
    chip.queue.setAttribute("width", Math.min(worker.queue_depth / 8, 1) * chip.w);
    const model = worker.model ? `, ${worker.model}` : "";
    chip.title.textContent = `${worker.worker}: ${role}${model}, ${worker.cached_blocks} cached blocks`;
  }

  /** One link's line and labels; its name and parameters above, utilisation below. */
  buildLink(place) {
    const { x0, y0, x1, y1 } = place;
    const mid = (x0 + x1) / 2;
    const y = (y0 + y1) / 2;
    const label = (dy, extra = {}) => svgEl("text", { class: "link-label", x: mid, y: y + dy, ...extra });
    const view = {
      ...place,
      line: svgEl("line", { class: "link-line", x1: x0, y1: y0, x2: x1, y2: y1 }),
      // Above and below the five lanes of flow dots and their labels (about +-30 px).
      name: label(-62),
      params: label(-46, { "data-testid": "link-bandwidth" }),
      barBg: svgEl("rect", { class: "link-util-bg", x: x0 + 20, y: y + 30, width: x1 - x0 - 40, height: 8, rx: 4 }),
      bar: svgEl("rect", { class: "link-util", x: x0 + 20, y: y + 30, width: 0, height: 8, rx: 4 }),
      util: label(54, { "data-testid": "link-utilisation" }),
      extra: label(70, { class: "link-label muted" }),
    };
    const group = svgEl("g", { class: "link", "data-testid": "link", "data-link": place.name },
      view.line, view.name, view.params, view.barBg, view.bar, view.util, view.extra);
    this.layers.link.append(group);
    view.name.textContent = `${place.name}: no sample yet`;
    return view;
  }

  updateLink(view, link) {
    if (!link) return;
    view.name.textContent = link.up ? `${link.link} (${view.a} → ${view.b})` : `${link.link}: DOWN`;
    view.line.setAttribute("class", link.up ? "link-line" : "link-line down");
    // Bandwidth and egress in one unit, the bandwidth's, printed with both.
    const unit = rateUnit(link.bandwidth_bps, link.throughput_bps);
    const rate = link.bandwidth_bps ? fmtRate(link.bandwidth_bps, unit) : "unshaped";
    view.params.textContent = `${rate} · ${(link.delay_s * 1000).toFixed(0)} ms` +
      (link.loss ? ` · loss ${(link.loss * 100).toFixed(1)}%` : "");
    view.bar.setAttribute("width", Math.min(link.utilisation, 1) * (view.x1 - view.x0 - 40));
    view.util.textContent = `egress ${fmtRate(link.throughput_bps, unit)} of ${rate} (${fmtPct(link.utilisation)})`;
    view.extra.textContent = `queued ${fmtBytes(link.queued_bytes)} · stalls ${link.stalls}`;
  }

  updateFlows(flows) {
    for (const [id, node] of this.flowNodes) {
      if (!flows.has(id)) {
        node.remove();
        this.flowNodes.delete(id);
      }
    }
    this.layers.flows.classList.toggle("busy", flows.size > ANIMATED_FLOWS);
    const labelled = this.labelled(flows);
    let lane = 0;
    for (const [id, { flow, doneAt }] of flows) {
      let node = this.flowNodes.get(id);
      if (!node) {
        if (this.flowNodes.size >= MAX_FLOWS) continue;
        node = this.buildFlow(flow);
        this.flowNodes.set(id, node);
        this.layers.flows.append(node);
      }
      this.placeFlow(node, flow, doneAt !== null, lane, labelled.has(id));
      lane = (lane + 1) % LANES;
    }
  }

  /** The flows whose size and progress are written out: the furthest along, a few at most. */
  labelled(flows) {
    const moving = [...flows].filter(([, entry]) => entry.doneAt === null && entry.flow.layers_done > 0);
    moving.sort((a, b) => b[1].flow.layers_done / b[1].flow.layers_total - a[1].flow.layers_done / a[1].flow.layers_total);
    return new Set(moving.slice(0, LABELLED_FLOWS).map(([id]) => id));
  }

  buildFlow(flow) {
    const label = svgEl("text", { x: 8, y: -6 });
    const tip = svgEl("title");
    const node = svgEl("g", { class: "flow", "data-testid": "kv-flow", "data-request": flow.request_id },
      tip, svgEl("circle", { r: 6 }), label);
    node.label = label;
    node.tip = tip;
    return node;
  }

  placeFlow(node, flow, finished, lane, labelled) {
    const [x, y] = this.position(flow, lane);
    node.style.transform = `translate(${x}px, ${y}px)`;
    const kind = flow.incremental ? "incremental" : "full";
    node.setAttribute("class", `flow ${kind}${finished ? " done" : ""}`);
    const text = `${fmtBytes(flow.bytes_total)} ${kind} · L${flow.layers_done}/${flow.layers_total}`;
    node.label.textContent = labelled ? text : "";
    // Neighbouring tracks write above and below their dots, so labels do not overprint.
    node.label.setAttribute("y", lane % 2 ? 16 : -8);
    node.tip.textContent = `${flow.request_id}: ${flow.src} → ${flow.dst}, ${text}`;
  }

  /** Where a flow's dot sits: along src chip -> link -> dst chip, by layers sent. */
  position(flow, lane) {
    const src = this.chips.get(flow.src);
    const dst = this.chips.get(flow.dst);
    const progress = flow.phase === "done" ? 1 : flow.layers_done / Math.max(flow.layers_total, 1);
    const link = this.linkViews.get(flow.via_link) ?? this.linkViews.values().next().value
      ?? { x0: LEFT_X + BOX_W, y0: LINK_Y, x1: RIGHT_X, y1: LINK_Y };
    const a = src ? [src.x + src.w, src.y + src.h / 2] : [link.x0, link.y0];
    const b = dst ? [dst.x, dst.y + dst.h / 2] : [link.x1, link.y1];
    const offset = (lane - (LANES - 1) / 2) * 9;
    if (!flow.via_link) return [a[0] + (b[0] - a[0]) * progress, a[1] + (b[1] - a[1]) * progress];
    // Over the link most of the journey is on the line itself: 10% to reach it, 10% to leave.
    const points = [a, [link.x0, link.y0 + offset], [link.x1, link.y1 + offset], b];
    const stops = [0, 0.1, 0.9, 1];
    let i = 0;
    while (i < 2 && progress > stops[i + 1]) i += 1;
    const t = (progress - stops[i]) / (stops[i + 1] - stops[i]);
    const [p, q] = [points[i], points[i + 1]];
    return [p[0] + (q[0] - p[0]) * t, p[1] + (q[1] - p[1]) * t];
  }
}
