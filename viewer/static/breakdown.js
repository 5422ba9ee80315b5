// Where each rank's time went: a rank x name matrix of self time (each span's time less its
// children's on the same track), with each rank's idle time outside any span, its exposed
// collective time (no other work of the rank overlapping), its waiting for the last rank and its
// collective transfer, all from gputrace's statistics. A cell is shaded against the median of its
// column over ranks; a click shows that rank's instance (its slowest span of the name, or its
// step with the most of that part) in the timeline.

import { colour } from "./heatmap.js";
import * as state from "./state.js";
import { el, fmtNs } from "./util.js";

const NAMES = 12; // span names shown, by self time over all ranks

export function render(doc, element, bus) {
  element.replaceChildren();
  const st = doc.steps;
  const cols = doc.stats.columns;
  const at = Object.fromEntries(cols.map((c, i) => [c, i]));
  const n = doc.ranks.length;
  const parts = [];
  if (st && st.totals) {
    const t = st.totals;
    parts.push(
      { key: "idle", label: "idle", title: "time in the steps with no span of the rank open on any of its tracks", values: t.idle_ns, perStep: st.idle },
      { key: "exposed", label: "exposed collective", title: "collective time no other work of the rank overlaps (on another stream or thread)", values: t.exposed_collective_ns },
      { key: "wait", label: "waiting for the last rank", title: "inside collectives, before the last rank arrived", values: t.collective_wait_ns, perStep: st.coll_wait },
      { key: "transfer", label: "collective transfer", title: "inside collectives, after the last rank arrived", values: t.collective_transfer_ns, perStep: st.coll_transfer },
    );
    if (t.launch_lag_ns.some((v) => v !== null)) parts.push({ key: "lag", label: "launch lag (mean)", title: "how far the GPU ran behind the host: device start minus host entry", values: t.launch_lag_ns });
  }
  const names = doc.stats.names
    .filter((r) => r[at.self_total_ns] !== null && r[at.self_total_ns] !== undefined)
    .sort((a, b) => b[at.self_total_ns] - a[at.self_total_ns])
    .slice(0, NAMES)
    .map((r) => r[at.name]);
  if (!parts.length && !names.length) {
    element.append(el("p", { className: "empty", "data-testid": "breakdown-empty", text: "No step breakdown or self time in this trace (a trace with steps on every rank gives one)." }));
    return;
  }
  // Per rank slot: name -> its row of statistics on that rank.
  const byRank = doc.stats.by_rank.map((rows) => Object.fromEntries(rows.map((r) => [r[at.name], r])));
  const columns = [
    ...parts.map((p) => ({ label: p.label, title: p.title, value: (s) => (p.values[s] === undefined ? null : p.values[s]), part: p })),
    ...names.map((name) => ({
      label: name,
      title: `self time of '${name}': its spans' time less their children's on the same track`,
      value: (s) => (byRank[s][name] ? byRank[s][name][at.self_total_ns] : null),
      name,
    })),
  ];
  for (const c of columns) {
    const vs = [];
    for (let s = 0; s < n; s++) {
      const v = c.value(s);
      if (v !== null && v !== undefined) vs.push(v);
    }
    vs.sort((a, b) => a - b);
    c.median = vs.length ? (vs.length % 2 ? vs[(vs.length - 1) / 2] : (vs[vs.length / 2 - 1] + vs[vs.length / 2]) / 2) : null;
  }

  function show(c, s) {
    const rank = doc.ranks[s];
    if (c.name) {
      const row = byRank[s][c.name];
      if (!row) return;
      state.write({ tab: "breakdown", sel: `bd:${rank}:${c.name}` });
      bus.emit("zoom", {
        start: row[at.slowest_start_ns],
        end: row[at.slowest_end_ns],
        what: `rank ${rank}'s slowest '${c.name}' (${fmtNs(row[at.max_ns])})`,
        slot: s,
        span: { start: row[at.slowest_start_ns], end: row[at.slowest_end_ns], name: c.name },
      });
    } else if (c.part.perStep && c.part.perStep[s]) {
      const per = c.part.perStep[s];
      let k = 0;
      for (let j = 1; j < per.length; j++) if ((per[j] || 0) > (per[k] || 0)) k = j;
      const hm = document.getElementById("heatmap");
      if (hm.selectStep) hm.selectStep(rank, st.first + k);
      state.write({ tab: "breakdown" });
    }
  }

  const head = el("tr", {}, el("th", { scope: "col", text: "rank" }), columns.map((c) => el("th", { scope: "col", className: "num", title: c.title, text: c.label })));
  const body = [];
  for (let s = 0; s < n; s++) {
    const tds = columns.map((c, i) => {
      const v = c.value(s);
      const td = el("td", { className: "num", "data-col": i, text: v === null || v === undefined ? "–" : fmtNs(v) });
      if (v !== null && v !== undefined && c.median !== null) {
        const [r, g, b] = colour(c.median > 0 ? v / c.median : v > 0 ? Infinity : 1);
        td.style.background = `rgb(${r},${g},${b})`;
        if (r + g + b < 300) td.style.color = "#fff";
      }
      if (c.name || (c.part && c.part.perStep)) {
        td.classList.add("clickable");
        td.title = c.name ? `click: rank ${doc.ranks[s]}'s slowest '${c.name}' in the timeline` : `click: rank ${doc.ranks[s]}'s step with the most ${c.label}`;
        td.addEventListener("click", () => show(c, s));
      }
      return td;
    });
    body.push(el("tr", { "data-testid": "breakdown-row", "data-rank": doc.ranks[s] }, el("th", { scope: "row", text: doc.labels[s] }), tds));
  }
  // A link's selection: rank's slowest span of `name`.
  element.selectName = (rank, name) => {
    const s = doc.ranks.indexOf(rank);
    const c = columns.find((x) => x.name === name);
    if (s < 0 || !c) return false;
    show(c, s);
    return true;
  };
  element.append(
    el("p", { className: "lead", text: "Where each rank's time went: its idle and collective time, and the self time of the span names with the most (each span's time less its children's on the same track)." }),
    el("p", { className: "note", text: "A cell is shaded against the median of its column over the ranks (the heatmap's colours); a click shows it in the timeline." }),
    el("div", { className: "table-wrap" }, el("table", { className: "grid matrix", "data-testid": "breakdown-matrix" }, el("thead", {}, head), el("tbody", {}, body))),
  );
}
