// Saturation hint: once a second (at each chart point) the page notes how many requests wait in
// the workers' queues and the TTFT p50; when, over the last WINDOW samples, the queues keep
// growing or the TTFT keeps rising, the mesh takes more than it serves and the page says so.

import { fmtSeconds } from "./util.js";

export const WINDOW = 15; // samples (one a second): longer than one slow prefill or transfer
const QUEUE_MIN = 4; // queued requests before growth counts (a burst of two is no trend)
const QUEUE_GROWTH = 3; // ... and by how many they grew over the window
const TTFT_MIN_S = 1; // TTFT p50 before a rise counts
const TTFT_FACTOR = 2; // ... and by how much it rose over the window

/** The hint for `samples` ([{ts, queued, ttft}], oldest first), or null when all is well. */
export function saturation(samples) {
  if (samples.length < WINDOW) return null;
  const recent = samples.slice(-WINDOW);
  const first = recent[0];
  const last = recent[recent.length - 1];
  const span = `over ${Math.round(last.ts - first.ts)} s`;
  const half = recent.slice(WINDOW / 2);
  // Growing: up over the window, and the second half never back down to where it started.
  if (last.queued >= QUEUE_MIN && last.queued - first.queued >= QUEUE_GROWTH &&
      half.every((s) => s.queued > first.queued)) {
    return `mesh saturated: queues growing (${first.queued} → ${last.queued} queued ${span}), lower the rate`;
  }
  const ttfts = recent.map((s) => s.ttft).filter((v) => v !== null && v !== undefined);
  if (ttfts.length >= WINDOW / 2) {
    const low = Math.min(...ttfts.slice(0, Math.ceil(ttfts.length / 2)));
    const now = ttfts[ttfts.length - 1];
    if (now >= TTFT_MIN_S && now >= TTFT_FACTOR * low) {
      return `mesh saturated: TTFT rising (${fmtSeconds(low)} → ${fmtSeconds(now)} ${span}), lower the rate`;
    }
  }
  return null;
}
