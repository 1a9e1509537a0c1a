// Replay panel: pick a recorded event log and play it back (the server replays it into the
// dashboard with its original timing, scaled by the speed); "live" returns to the live feed.

import { fmtSeconds, getJSON, postJSON } from "./util.js";

const POLL_MS = 1000;

export class ReplayPanel {
  constructor(root) {
    this.$ = (id) => root.querySelector(`#${id}`);
    this.status = this.$("replay-status");
    this.state = "idle";
    this.$("replay-play").addEventListener("click", () => this.command({
      action: "play", name: this.$("replay-log").value, speed: this.speed(),
    }));
    this.$("replay-pause").addEventListener("click", () =>
      this.command({ action: this.state === "paused" ? "resume" : "pause" }));
    this.$("replay-live").addEventListener("click", () => this.command({ action: "stop" }));
    this.$("replay-speed").addEventListener("change", () => {
      if (this.state === "playing" || this.state === "paused") {
        this.command({ action: "speed", speed: this.speed() });
      }
    });
  }

  speed() {
    return Number(this.$("replay-speed").value);
  }

  async start() {
    await this.refresh(true);
    setInterval(() => {
      if (this.state !== "idle") this.refresh(false);
    }, POLL_MS);
  }

  async refresh(withLogs) {
    try {
      const { logs, status } = await getJSON("api/replay");
      if (withLogs) {
        this.$("replay-log").replaceChildren(...logs.map((log) => new Option(
          `${log.name} (${Math.ceil(log.size_bytes / 1024)} KiB)`, log.name)));
      }
      this.show(status);
    } catch (error) {
      this.say(`replay: ${error.message}`, true);
    }
  }

  async command(body) {
    try {
      this.show(await postJSON("api/replay", body));
    } catch (error) {
      this.say(`replay: ${error.message}`, true);
    }
  }

  show(status) {
    this.state = status.state;
    this.$("replay-pause").textContent = status.state === "paused" ? "resume" : "pause";
    if (status.state === "idle") {
      this.say("live feed");
      return;
    }
    this.say(`${status.name}: ${status.state} at ${status.speed}× · ` +
      `${fmtSeconds(status.position_s)} of ${fmtSeconds(status.duration_s)} · ` +
      `${status.published}/${status.events} events`);
  }

  say(text, error = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", error);
  }
}
