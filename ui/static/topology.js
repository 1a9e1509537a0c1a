// Topology panel: cluster boxes with their worker chips, the link with its utilisation, and
// each KV transfer as a dot travelling from its prefill worker to its decode worker, placed by
// the share of layers already sent.

import { MAX_FLOWS } from "./model.js";
import { fmtBps, fmtBytes, fmtPct, svgEl } from "./util.js";

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

export class Topology {
  constructor(svg, prfaasClusters) {
    this.svg = svg;
    this.prfaas = new Set(prfaasClusters);
    this.chips = new Map(); // worker -> {group, x, y, w, h, ...}
    this.flowNodes = new Map(); // request_id -> <g>
    this.processes = new Map(); // process name -> supervisor state (up, down, restarting)
    this.layers = {
      clusters: svgEl("g"), link: svgEl("g"), chips: svgEl("g"), flows: svgEl("g"),
    };
    svg.append(...Object.values(this.layers));
    this.buildLink();
  }

  render(model, now) {
    if (model.dirty.layout) this.layout(model);
    for (const worker of model.workers.values()) this.updateChip(worker);
    this.updateLink(model.links.values().next().value);
    this.updateFlows(model.liveFlows(now));
  }

  layout(model) {
    const left = [];
    const right = [];
    const clusters = new Map();
    for (const worker of model.workers.values()) {
      if (!clusters.has(worker.cluster)) clusters.set(worker.cluster, []);
      clusters.get(worker.cluster).push(worker);
    }
    for (const name of [...clusters.keys()].sort()) (this.prfaas.has(name) ? left : right).push(name);
    this.layers.clusters.replaceChildren();
    this.layers.chips.replaceChildren();
    this.chips.clear();
    this.placeColumn(left, LEFT_X, clusters);
    this.placeColumn(right, RIGHT_X, clusters);
  }

  placeColumn(names, x, clusters) {
    const height = (HEIGHT - 20) / Math.max(names.length, 1);
    names.forEach((name, index) => {
      const y = 10 + index * height;
      const label = this.prfaas.has(name) ? `${name} (PrfaaS cluster)` : `${name} (PD cluster)`;
      this.layers.clusters.append(
        svgEl("rect", { class: "cluster-box", x, y, width: BOX_W, height: height - 6, rx: 6 }),
        svgEl("text", { class: "cluster-name", x: x + 10, y: y + 18 }, label),
      );
      const workers = clusters.get(name).sort(
        (a, b) => (ROLE_ORDER[a.role] ?? 3) - (ROLE_ORDER[b.role] ?? 3) || a.worker.localeCompare(b.worker),
      );
      this.placeChips(name, workers, x + 10, y + 28, BOX_W - 20, height - 40);
    });
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
    chip.title.textContent = `${worker.worker}: ${role}, ${worker.cached_blocks} cached blocks`;
  }

  buildLink() {
    const x0 = LEFT_X + BOX_W;
    const x1 = RIGHT_X;
    const mid = (x0 + x1) / 2;
    this.link = {
      x0, x1,
      line: svgEl("line", { class: "link-line", x1: x0, y1: LINK_Y, x2: x1, y2: LINK_Y }),
      name: svgEl("text", { class: "link-label", x: mid, y: LINK_Y - 62 }),
      params: svgEl("text", { class: "link-label", x: mid, y: LINK_Y - 46, "data-testid": "link-bandwidth" }),
      barBg: svgEl("rect", { class: "link-util-bg", x: x0 + 20, y: LINK_Y + 30, width: x1 - x0 - 40, height: 8, rx: 4 }),
      bar: svgEl("rect", { class: "link-util", x: x0 + 20, y: LINK_Y + 30, width: 0, height: 8, rx: 4 }),
      util: svgEl("text", { class: "link-label", x: mid, y: LINK_Y + 54, "data-testid": "link-utilisation" }),
      extra: svgEl("text", { class: "link-label muted", x: mid, y: LINK_Y + 70 }),
    };
    const { line, name, params, barBg, bar, util, extra } = this.link;
    this.layers.link.append(line, name, params, barBg, bar, util, extra);
  }

  updateLink(link) {
    const view = this.link;
    if (!link) {
      view.name.textContent = "no link reported";
      return;
    }
    view.name.textContent = link.up ? link.link : `${link.link}: DOWN`;
    view.line.setAttribute("class", link.up ? "link-line" : "link-line down");
    view.params.textContent = `${fmtBps(link.bandwidth_bps)} · ${(link.delay_s * 1000).toFixed(0)} ms` +
      (link.loss ? ` · loss ${(link.loss * 100).toFixed(1)}%` : "");
    view.bar.setAttribute("width", Math.min(link.utilisation, 1) * (view.x1 - view.x0 - 40));
    view.util.textContent = `egress ${fmtBps(link.throughput_bps, "0 bps")} (${fmtPct(link.utilisation)})`;
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
    node.setAttribute("class", `flow ${flow.incremental ? "incremental" : ""}${finished ? " done" : ""}`);
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
    const a = src ? [src.x + src.w, src.y + src.h / 2] : [this.link.x0, LINK_Y];
    const b = dst ? [dst.x, dst.y + dst.h / 2] : [this.link.x1, LINK_Y];
    const offset = (lane - (LANES - 1) / 2) * 9;
    if (!flow.via_link) return [a[0] + (b[0] - a[0]) * progress, a[1] + (b[1] - a[1]) * progress];
    // Over the link most of the journey is on the line itself: 10% to reach it, 10% to leave.
    const points = [a, [this.link.x0, LINK_Y + offset], [this.link.x1, LINK_Y + offset], b];
    const stops = [0, 0.1, 0.9, 1];
    let i = 0;
    while (i < 2 && progress > stops[i + 1]) i += 1;
    const t = (progress - stops[i]) / (stops[i + 1] - stops[i]);
    const [p, q] = [points[i], points[i + 1]];
    return [p[0] + (q[0] - p[0]) * t, p[1] + (q[1] - p[1]) * t];
  }
}
