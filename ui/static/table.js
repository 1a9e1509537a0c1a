// Decisions panel: the newest routing decisions, filterable by cluster and policy; a click
// selects the request for the waterfall. New rows are prepended once a frame; the table never
// holds more than its row bound.

import { el, fmtScale, fmtTime, fmtTokens } from "./util.js";

export class DecisionTable {
  constructor({ body, clusterFilter, policyFilter, rows, prfaasClusters, tokenScale = 1, onSelect }) {
    this.tokenScale = tokenScale;
    this.body = body;
    this.clusterFilter = clusterFilter;
    this.policyFilter = policyFilter;
    this.rows = rows;
    this.prfaas = new Set(prfaasClusters);
    this.known = { cluster: new Set(), policy: new Set() };
    this.selected = null;
    body.addEventListener("click", (event) => {
      const row = event.target.closest("tr");
      if (row) this.select(row.dataset.request, onSelect);
    });
  }

  select(id, onSelect) {
    this.selected = id;
    for (const row of this.body.children) row.classList.toggle("selected", row.dataset.request === id);
    onSelect(id);
  }

  matches(decision) {
    const cluster = this.clusterFilter.value;
    const policy = this.policyFilter.value;
    return (!cluster || decision.cluster === cluster) && (!policy || decision.policy === policy);
  }

  /** Redraws from the model's ring (after a snapshot or a filter change). */
  rebuild(decisions) {
    this.body.replaceChildren();
    this.add(decisions);
  }

  /** Prepends `decisions` (oldest first), then trims the oldest rows beyond the bound. */
  add(decisions) {
    const fragment = document.createDocumentFragment();
    const start = Math.max(decisions.length - this.rows, 0);
    for (let i = decisions.length - 1; i >= start; i -= 1) {
      const decision = decisions[i];
      this.learn("cluster", decision.cluster, this.clusterFilter);
      this.learn("policy", decision.policy, this.policyFilter);
      if (this.matches(decision)) fragment.append(this.row(decision));
    }
    this.body.prepend(fragment);
    while (this.body.childElementCount > this.rows) this.body.lastElementChild.remove();
  }

  learn(kind, value, select) {
    if (this.known[kind].has(value)) return;
    this.known[kind].add(value);
    select.append(el("option", { value }, value));
  }

  row(d) {
    const remote = this.prfaas.has(d.cluster);
    // Cells cut at the column's width: the whole text on hover.
    const t = d.threshold === null ? "none"
      : `t = ${fmtTokens(d.threshold)} tokens served = ${fmtTokens(d.threshold / this.tokenScale)} ` +
        `at paper length (scale ${fmtScale(this.tokenScale)})`;
    const cells = [
      el("td", {}, fmtTime(d.ts)),
      el("td", { title: d.request_id }, d.request_id),
      el("td", {}, d.policy),
      el("td", { class: "num" }, fmtTokens(d.total_len)),
      el("td", { class: "num" }, fmtTokens(d.total_len - d.incremental_len)),
      el("td", { class: "num" }, fmtTokens(d.incremental_len)),
      el("td", { class: "num", title: t }, d.threshold === null ? "none" : fmtTokens(d.threshold)),
      el("td", {}, el("span", { class: `tag ${remote ? "remote" : "local"}` }, d.cluster)),
      el("td", { title: `${d.prefill_worker} → ${d.decode_worker}` }, `${d.prefill_worker} → ${d.decode_worker}`),
      el("td", { class: "reason", title: d.reason }, d.reason),
    ];
    const row = el("tr", { "data-request": d.request_id, "data-cluster": d.cluster }, ...cells);
    if (d.request_id === this.selected) row.classList.add("selected");
    return row;
  }
}
