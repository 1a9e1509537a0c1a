// Small helpers shared by the panels: a ring buffer, element builders, formatting, JSON calls.

/** A fixed-capacity buffer keeping the newest items: the page's memory never grows with time. */
export class Ring {
  constructor(capacity) {
    this.capacity = capacity;
    this.items = new Array(capacity);
    this.start = 0;
    this.length = 0;
  }

  push(item) {
    const end = (this.start + this.length) % this.capacity;
    this.items[end] = item;
    if (this.length < this.capacity) this.length += 1;
    else this.start = (this.start + 1) % this.capacity;
  }

  /** Oldest first. */
  toArray() {
    const out = new Array(this.length);
    for (let i = 0; i < this.length; i += 1) out[i] = this.items[(this.start + i) % this.capacity];
    return out;
  }

  last() {
    return this.length ? this.items[(this.start + this.length - 1) % this.capacity] : undefined;
  }

  clear() {
    this.start = 0;
    this.length = 0;
    this.items = new Array(this.capacity);
  }
}

/** A Map that forgets its oldest key beyond `capacity` (insertion order). */
export class BoundedMap extends Map {
  constructor(capacity) {
    super();
    this.capacity = capacity;
  }

  set(key, value) {
    if (!this.has(key) && this.size >= this.capacity) this.delete(this.keys().next().value);
    return super.set(key, value);
  }
}

const SVG_NS = "http://www.w3.org/2000/svg";

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

export function svgEl(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

export function fmtBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(value >= 100 || unit === 0 ? 0 : 1)} ${units[unit]}`;
}

/** A rate in bits per second; `zero` is what 0 means (a link's bandwidth 0 is "unshaped"). */
export function fmtBps(bps, zero = "unshaped") {
  if (!bps) return zero;
  if (bps >= 1e9) return `${(bps / 1e9).toFixed(bps >= 1e10 ? 0 : 2)} Gbps`;
  if (bps >= 1e6) return `${(bps / 1e6).toFixed(0)} Mbps`;
  return `${(bps / 1e3).toFixed(0)} kbps`;
}

/** The unit a link's rates print in, chosen by its configured bandwidth (or, unshaped, by
 * `fallback`), so that its bandwidth and its egress read in the same unit. */
export function rateUnit(bps, fallback = 0) {
  const ref = bps || fallback;
  if (ref >= 1e9) return { name: "Gbps", per: 1e9 };
  if (ref >= 1e6) return { name: "Mbps", per: 1e6 };
  return { name: "kbps", per: 1e3 };
}

/** A rate in the given unit, unit printed: 20 Mbps, 3.20 Mbps, 0.05 Gbps. */
export function fmtRate(bps, unit) {
  const value = (bps || 0) / unit.per;
  const digits = value >= 100 || Number.isInteger(value) ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${unit.name}`;
}

/** A token scale as a fraction where it is one: 0.03125 -> "1/32". */
export function fmtScale(scale) {
  const inverse = 1 / scale;
  return Math.abs(inverse - Math.round(inverse)) < 1e-6 ? `1/${Math.round(inverse)}` : `${scale}`;
}

/** t as served and at the paper length it stands for (served / scale). */
export function fmtThreshold(t, scale) {
  if (t === null || t === undefined) return "none (the policy has no t)";
  if (scale === 1) return `${fmtTokens(t)} tokens`;
  return `${fmtTokens(t)} tokens served = ${fmtTokens(t / scale)} at paper length (scale ${fmtScale(scale)})`;
}

export function fmtTokens(tokens) {
  if (tokens === null || tokens === undefined) return "-";
  if (tokens >= 1000) return `${(tokens / 1000).toFixed(tokens >= 10000 ? 1 : 2)}K`;
  return `${Math.round(tokens)}`;
}

export function fmtSeconds(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 1) return `${(seconds * 1000).toFixed(0)} ms`;
  return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
}

export function fmtPct(fraction) {
  return fraction === null || fraction === undefined ? "-" : `${(fraction * 100).toFixed(0)}%`;
}

/** Event time: wall-clock stamps as a time of day, virtual ones as seconds since the start. */
export function fmtTime(ts) {
  if (ts > 1e9) return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
  return `${ts.toFixed(1)} s`;
}

export async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store" });
  return answer(response);
}

// The page's CSRF token (ui/guard.py): every POST sends it back. Read when posting, so the
// module also loads where there is no document (the Node checks of tests/ui_fixtures).
const csrfToken = () => document.querySelector('meta[name="csrf-token"]')?.content ?? "";

export async function postJSON(url, body) {
  const response = await fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", "x-csrf-token": csrfToken() },
    body: JSON.stringify(body ?? {}),
  });
  return answer(response);
}

async function answer(response) {
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

/** The feed's mode (or "offline") in the top bar's mode badge, whose class colours it. */
export function showMode(mode) {
  const badge = document.getElementById("mode");
  badge.textContent = mode;
  badge.className = mode;
}
