// Processes: the supervisor's view of every service (up, down, restarting), polled once a
// second, with kill and restart buttons for the workshop. The topology marks a worker whose
// process is not up. Without a supervisor (`prfaas serve ui` alone) the list says so.

import { el, getJSON, postJSON } from "./util.js";

const POLL_MS = 1000;

export class Processes {
  constructor(root, onStates, say) {
    this.list = root.querySelector("#process-list");
    this.note = root.querySelector("#processes-note");
    this.onStates = onStates; // Map name -> state, for the topology's chips
    this.say = say;
    this.rows = new Map(); // name -> {li, state, text}
  }

  start() {
    this.poll();
    setInterval(() => this.poll(), POLL_MS);
  }

  async poll() {
    let answer;
    try {
      answer = await getJSON("api/control/processes");
    } catch (error) {
      this.note.textContent = `no supervisor (${error.message})`;
      return;
    }
    const processes = answer.processes || [];
    if (answer.supervised === false) {
      this.note.textContent = "not run by a supervisor";
      return;
    }
    this.note.textContent = processes.length ? `${processes.filter((p) => p.state === "up").length}/${processes.length} up` : "none";
    for (const process of processes) this.show(process);
    this.onStates(new Map(processes.map((p) => [p.name, p.state])));
  }

  show(process) {
    let row = this.rows.get(process.name);
    if (!row) row = this.build(process.name);
    row.li.dataset.state = process.state;
    row.li.className = `process ${process.state}`;
    const since = new Date(process.since * 1000).toLocaleTimeString([], { hour12: false });
    row.text.textContent = `${process.name}: ${process.state} · pid ${process.pid ?? "-"} · restarts ${process.restarts} · since ${since}`;
  }

  build(name) {
    const text = el("span", { class: "process-text" });
    const kill = el("button", { type: "button", "data-testid": `kill-${name}` }, "kill");
    const restart = el("button", { type: "button", "data-testid": `restart-${name}` }, "restart");
    kill.addEventListener("click", () => this.act(name, "kill"));
    restart.addEventListener("click", () => this.act(name, "restart"));
    const li = el("li", { "data-process": name, "data-testid": `process-${name}` }, text, kill, restart);
    this.list.append(li);
    const row = { li, text };
    this.rows.set(name, row);
    return row;
  }

  async act(name, action) {
    try {
      await postJSON(`api/control/processes/${encodeURIComponent(name)}/${action}`, {});
      this.say(`${action} ${name}: ok`);
    } catch (error) {
      this.say(`${action} ${name}: ${error.message}`, true);
    }
    this.poll();
  }
}
