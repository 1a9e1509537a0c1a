// The live feed: server-sent events lined up with the snapshot by sequence number.
//
// The stream opens with `hello` (the feed holds every event after its seq); the page then
// fetches /api/snapshot and applies only the events after the snapshot's seq. A gap in the
// sequence (the browser fell behind and the server dropped its oldest events) or a `reset`
// (a replay started or stopped) makes the page fetch a fresh snapshot.

import { getJSON } from "./util.js";

const MAX_BUFFERED = 200; // batches held while a snapshot loads
const RESYNC_MIN_INTERVAL_MS = 3000; // after drops, at most one snapshot this often

export class Feed {
  // `base`: where the feed's routes are, relative to the page ("" for the single page,
  // "d/NAME/" for one deployment of the compare page).
  constructor({ onSnapshot, onEvents, onStatus, base = "" }) {
    this.base = base;
    this.onSnapshot = onSnapshot;
    this.onEvents = onEvents;
    this.onStatus = onStatus;
    this.expected = null; // next seq we want; null until a snapshot is in
    this.loading = false;
    this.buffer = [];
    this.dropped = 0;
    this.lastResync = 0;
  }

  start() {
    this.source = new EventSource(`${this.base}events`);
    this.source.addEventListener("hello", () => this.resync("hello"));
    this.source.addEventListener("reset", () => this.resync("reset"));
    this.source.onmessage = (message) => this.receive(JSON.parse(message.data));
    this.source.onerror = () => this.onStatus("offline");
  }

  /** Fetches the snapshot; `why` is "hello" (connected), "reset" (another run) or "gap". */
  async resync(why) {
    this.loading = true;
    this.buffer = [];
    this.lastResync = performance.now();
    try {
      const snapshot = await getJSON(`${this.base}api/snapshot`);
      this.expected = snapshot.seq + 1;
      this.onSnapshot(snapshot, why);
      this.onStatus(snapshot.mode);
      const held = this.buffer;
      this.buffer = [];
      this.loading = false;
      for (const batch of held) this.deliver(batch);
    } catch (error) {
      this.loading = false;
      this.onStatus("offline");
    }
  }

  receive(batch) {
    if (this.loading) {
      if (this.buffer.length < MAX_BUFFERED) this.buffer.push(batch);
      return;
    }
    if (this.expected !== null) this.deliver(batch);
  }

  deliver(batch) {
    let { first, events } = batch;
    const end = first + events.length;
    if (end <= this.expected) return; // all covered by the snapshot
    if (first < this.expected) {
      events = events.slice(this.expected - first);
      first = this.expected;
    } else if (first > this.expected) {
      this.dropped += first - this.expected;
      if (performance.now() - this.lastResync > RESYNC_MIN_INTERVAL_MS) {
        this.resync("gap");
        return;
      }
    }
    this.expected = end;
    this.onEvents(events);
  }
}
