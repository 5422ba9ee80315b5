// The collectives: every occurrence matched across ranks (by step, name and order in the step),
// who arrived last and how long each other rank waited for it; per rank, how often it was last,
// the wait it caused and the wait it suffered. All numbers come from gputrace's statistics.

import * as state from "./state.js";
import { el, fmtCount, fmtNs, fmtSigned, sortableTable } from "./util.js";

export function render(doc, element, bus) {
  element.replaceChildren();
  const co = doc.collectives;
  if (!co || co.count === 0) {
    element.append(
      el("p", {
        className: "empty",
        "data-testid": "collectives-empty",
        text: "No collectives in this trace. Mark them with span(name, collective=True), or name them like one (all_reduce, all_gather, reduce_scatter, broadcast, barrier...).",
      }),
    );
    return;
  }
  const n = doc.ranks.length;
  const pr = co.per_rank;
  const rankRows = doc.ranks.map((r, i) => ({
    slot: i,
    rank: r,
    times_last: pr.times_last[i],
    noisy: pr.times_last_within_noise[i],
    caused: pr.wait_caused_ns[i],
    suffered: pr.wait_suffered_ns[i],
  }));
  const worst = rankRows.slice().sort((a, b) => b.caused - a.caused || b.times_last - a.times_last)[0];
  const lead = worst.times_last
    ? `Rank ${worst.rank} arrived last in ${fmtCount(worst.times_last)} of ${fmtCount(co.count)} collectives, beyond the clock error, and kept the others waiting ${fmtNs(worst.caused)} in all.`
    : `No rank arrived last beyond the clock error in any of the ${fmtCount(co.count)} collectives.`;
  element.append(
    el("p", { className: "lead", "data-testid": "collectives-lead", text: lead }),
    el("details", { className: "rule" }, el("summary", { text: "How are collectives matched and the last arrival called?" }), el("p", { text: co.rule })),
    el("h3", { text: "Per rank" }),
    sortableTable({
      columns: [
        { key: "rank", label: "rank", num: true, fmt: (v) => `rank ${v}` },
        { key: "times_last", label: "times last", num: true, fmt: fmtCount, title: "arrived after every other rank by more than their clock errors" },
        { key: "noisy", label: "last within noise", num: true, fmt: fmtCount, title: "arrived last, but by less than the clock errors" },
        { key: "caused", label: "wait caused", num: true, fmt: fmtNs, title: "the others' waits in the collectives it arrived last in" },
        { key: "suffered", label: "wait suffered", num: true, fmt: fmtNs, title: "its own waits for the last arrival" },
      ],
      rows: rankRows,
      testid: "collectives-per-rank",
      rowTestid: "collectives-rank-row",
      sortKey: "caused",
      limit: 5000,
    }),
  );

  const occ = [];
  for (let j = 0; j < co.count; j++) {
    occ.push({
      j,
      step: co.step[j],
      name: co.names[co.name[j]],
      ordinal: co.ordinal[j],
      last: co.last_slot[j],
      margin: co.last_margin_ns[j],
      called: co.last_called[j],
      max_wait: co.max_wait[j],
    });
  }
  const lastFilter = el(
    "select",
    { "aria-label": "last arrival", "data-testid": "collectives-filter" },
    el("option", { value: "", text: "any rank last" }),
    ...doc.ranks.map((r, i) => el("option", { value: String(i), text: `rank ${r} last` })),
  );
  const detail = el("div", { className: "detail", "data-testid": "collective-detail" });
  const table = sortableTable({
    columns: [
      { key: "step", label: "step", num: true, fmt: (v) => (v === null ? "–" : String(v)) },
      { key: "name", label: "collective", num: false },
      { key: "ordinal", label: "#", num: true, title: "its order among collectives of this name in the step", fmt: (v) => String(v + 1) },
      { key: "last", label: "last to arrive", num: true, fmt: (v) => (v >= 0 ? `rank ${doc.ranks[v]}` : "–") },
      { key: "margin", label: "after the next", num: true, fmt: fmtNs, title: "the last arrival minus the one before it" },
      { key: "called", label: "called", num: true, fmt: (v) => (v ? "yes" : "within noise") },
      { key: "max_wait", label: "longest wait", num: true, fmt: fmtNs },
    ],
    rows: occ,
    testid: "collective-occurrences",
    rowTestid: "collective-row",
    sortKey: "max_wait",
    limit: 200,
    onRow: (row) => {
      showDetail(row.j);
      showRank(row.j, co.last_slot[row.j]);
    },
    rowTitle: () => "click: arrival order and waits, and the last arrival in the timeline",
  });
  lastFilter.addEventListener("change", () => {
    const v = lastFilter.value;
    table.redraw(v === "" ? occ : occ.filter((o) => o.last === Number(v)));
  });
  element.append(
    el("h3", { text: "Occurrences" }),
    el("div", { className: "controls" }, lastFilter),
    el("div", { className: "split" }, table, detail),
  );

  // The timeline on rank slot s's part in occurrence j (its span selected), the others around it.
  function showRank(j, s) {
    state.write({ tab: "collectives", sel: `coll:${j}` });
    if (s < 0 || co.arrival[s][j] === null) return;
    const step = co.step[j];
    const name = co.names[co.name[j]];
    bus.emit("zoom", {
      start: co.first[j],
      end: co.last[j],
      what: `${step === null ? "" : `step ${step}, `}'${name}' #${co.ordinal[j] + 1}, ${doc.labels[s]}${s === co.last_slot[j] ? " (last to arrive)" : ""}`,
      slot: s,
      span: { start: co.arrival[s][j], end: co.end[s][j], name },
    });
  }

  function showDetail(j) {
    const order = [];
    for (let s = 0; s < n; s++) if (co.arrival[s][j] !== null) order.push(s);
    order.sort((a, b) => co.arrival[a][j] - co.arrival[b][j] || b - a);
    const first = co.first[j];
    const lastEnd = co.last[j];
    const total = Math.max(1, lastEnd - first);
    const lastSlot = co.last_slot[j];
    const step = co.step[j];
    const head = `${step === null ? "outside the steps" : `step ${step}`}, '${co.names[co.name[j]]}' #${co.ordinal[j] + 1}`;
    const verdict = co.last_called[j]
      ? `${doc.labels[lastSlot]} arrived last, ${fmtSigned(co.last_margin_ns[j])} after the next rank (beyond the clock error)`
      : `${doc.labels[lastSlot]} arrived last, but only ${fmtNs(co.last_margin_ns[j])} after the next rank: within the clock error`;
    const rows = order.map((s) => {
      const a = co.arrival[s][j] - first;
      const w = co.wait[s][j];
      const bar = el("div", { className: "bar" });
      const waitPart = el("span", { className: "bar-wait", title: `waited ${fmtNs(w)}` });
      waitPart.style.left = `${(100 * a) / total}%`;
      waitPart.style.width = `${(100 * w) / total}%`;
      const runPart = el("span", { className: "bar-run", title: "in the collective after the last arrival" });
      runPart.style.left = `${(100 * (a + w)) / total}%`;
      runPart.style.width = `${(100 * Math.max(0, co.end[s][j] - co.arrival[s][j] - w)) / total}%`;
      bar.append(waitPart, runPart);
      return el(
        "tr",
        {
          "data-testid": "collective-arrival",
          className: s === lastSlot ? "last clickable" : "clickable",
          title: "click: this rank's part in the timeline",
          onclick: () => showRank(j, s),
        },
        el("td", { text: `rank ${doc.ranks[s]}` }),
        el("td", { className: "num", text: a === 0 ? "first" : `+${fmtNs(a)}` }),
        el("td", { className: "num", text: s === lastSlot ? "last" : fmtNs(w) }),
        el("td", { className: "bar-cell" }, bar),
      );
    });
    detail.replaceChildren(
      el("h4", { text: head }),
      el("p", { "data-testid": "collective-last", "data-slot": lastSlot, text: verdict }),
      el(
        "table",
        { className: "grid arrivals", "data-testid": "collective-order" },
        el("thead", {}, el("tr", {}, el("th", { text: "rank" }), el("th", { className: "num", text: "arrived" }), el("th", { className: "num", text: "waited" }), el("th", { text: "waiting, then running" }))),
        el("tbody", {}, rows),
      ),
      el("button", {
        type: "button",
        "data-testid": "collective-show",
        text: "show in the timeline",
        onclick: () => showRank(j, lastSlot),
      }),
    );
  }
  // Open on the occurrence with the longest wait.
  let longest = 0;
  for (let j = 1; j < co.count; j++) if (co.max_wait[j] > co.max_wait[longest]) longest = j;
  showDetail(longest);
  element.showDetail = showDetail;
  // A link's selection: occurrence j, its detail shown and its last arrival in the timeline.
  element.selectOccurrence = (j) => {
    if (!(j >= 0 && j < co.count)) return false;
    showDetail(j);
    showRank(j, co.last_slot[j]);
    return true;
  };
}
