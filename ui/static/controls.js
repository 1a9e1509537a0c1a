// Controls panel: every change is posted to the dashboard, which forwards it to the service
// that owns the setting (the link's control API, the router's admin API). The panel reads the
// current settings back every few seconds; the link's real state arrives as telemetry.

import { fmtBps, fmtSeconds, getJSON, postJSON } from "./util.js";

const REFRESH_MS = 5000;
// The bandwidth slider is logarithmic: 0..1000 spans 10 Mbps..100 Gbps.
const BW_LOG_MIN = 7;
const BW_LOG_SPAN = 4;

// Two significant digits: the slider lands on 2.0 Gbps, not 1.995262 Gbps.
export const sliderToBps = (value) => Number((10 ** (BW_LOG_MIN + (BW_LOG_SPAN * value) / 1000)).toPrecision(2));
export const bpsToSlider = (bps) => Math.round(((Math.log10(bps) - BW_LOG_MIN) / BW_LOG_SPAN) * 1000);

export class Controls {
  constructor(root, onState = () => {}) {
    this.$ = (id) => root.querySelector(`#${id}`);
    this.onState = onState; // every answer of api/control/state (the top bar's defaults)
    this.status = this.$("ctl-status");
    // The registered policies, from the source side (empty on a live mesh until the router says).
    this.policies = (document.body.dataset.policies || "").split(",").filter(Boolean);
    if (this.policies.length) fillSelect(this.$("ctl-policy"), this.policies, undefined);
    this.bind();
  }

  bind() {
    const bandwidth = this.$("ctl-bandwidth");
    bandwidth.addEventListener("input", () => this.showBandwidth());
    bandwidth.addEventListener("change", () =>
      this.send("link", { bandwidth_bps: sliderToBps(Number(bandwidth.value)) }));
    const delay = this.$("ctl-delay");
    delay.addEventListener("input", () => this.showDelay());
    delay.addEventListener("change", () => this.send("link", { delay_ms: Number(delay.value) }));
    const loss = this.$("ctl-loss");
    loss.addEventListener("input", () => this.showLoss());
    loss.addEventListener("change", () => this.send("link", { loss: Number(loss.value) / 1000 }));
    this.$("ctl-up").addEventListener("change", (e) => this.send("link", { up: e.target.checked }));
    this.$("ctl-policy").addEventListener("change", (e) => this.send("policy", { policy: e.target.value }));
    this.$("ctl-threshold-set").addEventListener("click", () => {
      const value = this.$("ctl-threshold").value;
      if (value !== "") this.send("threshold", { t: Number(value) });
    });
    this.$("ctl-threshold-clear").addEventListener("click", () => this.send("threshold", { t: null }));
    this.$("ctl-start").addEventListener("click", () =>
      this.send("workload", { action: "start", rate: Number(this.$("ctl-rate").value), kind: "mixed" }));
    this.$("ctl-stop").addEventListener("click", () => this.send("workload", { action: "stop" }));
    this.$("ctl-speed").addEventListener("change", (e) => this.send("speed", { speed: Number(e.target.value) }));
    const worker = () => encodeURIComponent(this.$("ctl-worker").value);
    this.$("ctl-drain").addEventListener("click", () => this.send(`workers/${worker()}/drain`, {}));
    this.$("ctl-to-prefill").addEventListener("click", () =>
      this.send(`workers/${worker()}/role`, { role: "prefill" }));
    this.$("ctl-to-decode").addEventListener("click", () =>
      this.send(`workers/${worker()}/role`, { role: "decode" }));
  }

  showBandwidth() {
    this.$("ctl-bandwidth-value").textContent = fmtBps(sliderToBps(Number(this.$("ctl-bandwidth").value)));
  }

  showDelay() {
    this.$("ctl-delay-value").textContent = `${this.$("ctl-delay").value} ms`;
  }

  showLoss() {
    this.$("ctl-loss-value").textContent = `${(Number(this.$("ctl-loss").value) / 10).toFixed(1)}%`;
  }

  async send(what, body) {
    this.say(`sending ${what}…`);
    try {
      await postJSON(`api/control/${what}`, body);
      this.say(`${what}: ${JSON.stringify(body)} ok`);
      this.refresh();
    } catch (error) {
      this.say(`${what}: ${error.message}`, true);
    }
  }

  say(text, error = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", error);
  }

  start() {
    this.refresh();
    setInterval(() => this.refresh(), REFRESH_MS);
  }

  async refresh() {
    let state;
    try {
      state = await getJSON("api/control/state");
    } catch (error) {
      this.say(`controls: ${error.message}`, true);
      return;
    }
    this.onState(state);
    if (state.link) this.showLink(state.link);
    if (state.router) this.showRouter(state.router);
    this.showSim(state.sim);
    const errors = Object.values(state.errors || {});
    if (errors.length && !this.status.textContent) this.say(errors.join("; "), true);
  }

  showLink(link) {
    const active = document.activeElement;
    if (link.bandwidth_bps && active !== this.$("ctl-bandwidth")) {
      this.$("ctl-bandwidth").value = bpsToSlider(link.bandwidth_bps);
    }
    if (active !== this.$("ctl-delay")) this.$("ctl-delay").value = link.delay_ms;
    if (active !== this.$("ctl-loss")) this.$("ctl-loss").value = link.loss * 1000;
    this.$("ctl-up").checked = link.up;
    this.showBandwidth();
    this.showDelay();
    this.showLoss();
  }

  // A simulation's clock: its speed control, and how far virtual time has run.
  showSim(sim) {
    this.$("ctl-sim").hidden = !sim;
    if (!sim) return;
    const speed = this.$("ctl-speed");
    if (sim.speed && document.activeElement !== speed) {
      if (![...speed.options].some((o) => Number(o.value) === sim.speed)) speed.add(new Option(`${sim.speed}×`, sim.speed));
      speed.value = String(sim.speed);
    }
    const achieved = sim.achieved ? ` · running at ${sim.achieved.toFixed(1)}×` : "";
    this.$("ctl-sim-clock").textContent = `t = ${sim.virtual_s.toFixed(0)} s${achieved}`;
  }

  showRouter(router) {
    fillSelect(this.$("ctl-policy"), router.policies || (this.policies.length ? this.policies : [router.policy]), router.policy);
    const workers = (router.workers || []).map((w) => (typeof w === "string" ? w : w.name));
    fillSelect(this.$("ctl-worker"), workers, this.$("ctl-worker").value || workers[0]);
    const t = this.$("ctl-threshold");
    if (document.activeElement !== t) t.placeholder = router.threshold_override ? "override" : "auto";
    this.showMeasured(router);
  }

  // The link as the router measures it from its own transfers, beside the rate set above,
  // and the waits prfaas-dynamic predicts for each side.
  showMeasured(router) {
    const link = Object.values(router.links || {})[0];
    const parts = [];
    if (link && link.available_bps > 0) {
      parts.push(`router measures ${fmtBps(link.available_bps)}${link.saturated ? " (saturated)" : ""}`);
    }
    const waits = router.waits;
    if (waits) parts.push(`predicted wait PrfaaS ${fmtSeconds(waits.prfaas_s)} · PD ${fmtSeconds(waits.pd_s)}`);
    this.$("ctl-link-measured").textContent = parts.join(" · ");
  }
}

function fillSelect(select, values, chosen) {
  const current = [...select.options].map((o) => o.value).join("\n");
  if (current !== values.join("\n")) {
    select.replaceChildren(...values.map((v) => new Option(v, v)));
  }
  if (chosen !== undefined && chosen !== null) select.value = chosen;
}
