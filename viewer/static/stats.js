// The span statistics, as `gputrace summary` computes them: per span name over all ranks, or for
// one rank on demand; sortable by any column; a click on a row shows that name's slowest
// instance in the timeline.

import * as state from "./state.js";
import { el, fmtCount, fmtNs, sortableTable } from "./util.js";

export function render(doc, element, bus) {
  element.replaceChildren();
  const cols = doc.stats.columns;
  const at = Object.fromEntries(cols.map((c, i) => [c, i]));
  const allRows = doc.stats.names;
  if (!allRows.length) {
    element.append(el("p", { className: "empty", text: "The trace has no spans." }));
    return;
  }
  const multi = doc.ranks.length > 1;
  const filter = el("input", { type: "search", placeholder: "filter names", "aria-label": "filter span names", "data-testid": "stats-filter" });
  const scope = el(
    "select",
    { "aria-label": "ranks", "data-testid": "stats-scope" },
    el("option", { value: "all", text: multi ? `all ${doc.ranks.length} ranks` : "all ranks" }),
    ...doc.ranks.map((r, i) => el("option", { value: String(i), text: `rank ${r} alone` })),
  );
  const status = el("p", { className: "note", "data-testid": "stats-status" });
  const ns = (v) => fmtNs(v);
  const base = [
    { key: at.name, label: "name", num: false },
    { key: at.count, label: "count", num: true, fmt: fmtCount },
    { key: at.total_ns, label: "total", num: true, fmt: ns },
    { key: at.self_total_ns, label: "self", num: true, fmt: ns, title: "the total less the time of each span's children on its own track" },
    { key: at.mean_ns, label: "mean", num: true, fmt: ns },
    { key: at.p50_ns, label: "p50", num: true, fmt: ns },
    { key: at.p90_ns, label: "p90", num: true, fmt: ns },
    { key: at.p99_ns, label: "p99", num: true, fmt: ns },
    { key: at.max_ns, label: "max", num: true, fmt: ns, title: "the slowest instance: click a row to see it" },
  ];
  const spread = [
    { key: at.ranks, label: "ranks", num: true },
    { key: at.min_rank_total_ns, label: "least rank total", num: true, fmt: (v, row) => `${fmtNs(v)} (r${row[at.min_rank]})` },
    { key: at.max_rank_total_ns, label: "largest rank total", num: true, fmt: (v, row) => `${fmtNs(v)} (r${row[at.max_rank]})` },
    {
      key: at.imbalance,
      label: "imbalance",
      num: true,
      title: "largest per-rank total / least",
      fmt: (v) => (v === null ? "∞" : `${v.toFixed(2)}x`),
    },
  ];
  const holder = el("div");
  element.append(el("div", { className: "controls" }, filter, scope), status, holder);

  let table = null;
  let current = null;
  function show() {
    const one = scope.value !== "all";
    const rows = one ? doc.stats.by_rank[Number(scope.value)] : allRows;
    const q = filter.value.trim().toLowerCase();
    const shown = q ? rows.filter((r) => String(r[at.name]).toLowerCase().includes(q)) : rows;
    const columns = one || !multi ? base : base.concat(spread);
    if (!table || current !== columns) {
      current = columns;
      table = sortableTable({
        columns,
        rows: shown,
        testid: "stats-table",
        rowTestid: "stats-row",
        sortKey: at.total_ns,
        onRow: (row) => showSlowest(row),
        rowTitle: (row) => `click: show the slowest '${row[at.name]}' (rank ${row[at.slowest_rank]}) in the timeline`,
      });
      holder.replaceChildren(table);
    } else table.redraw(shown);
    status.textContent = `${fmtCount(shown.length)} span names${one ? ` on rank ${doc.ranks[Number(scope.value)]}` : ""}${q ? " matching the filter" : ""}; click a row to see its slowest instance`;
  }
  function showSlowest(row) {
    state.write({ tab: "stats", sel: `name:${scope.value}:${row[at.name]}` });
    const slot = doc.ranks.indexOf(row[at.slowest_rank]);
    bus.emit("zoom", {
      start: row[at.slowest_start_ns],
      end: row[at.slowest_end_ns],
      what: `the slowest '${row[at.name]}' (rank ${row[at.slowest_rank]}, ${fmtNs(row[at.max_ns])})`,
      slot: slot >= 0 ? slot : undefined,
      span: { start: row[at.slowest_start_ns], end: row[at.slowest_end_ns], name: row[at.name] },
    });
  }
  // A link's selection: the name's row in a scope ("all" or a rank slot), its slowest shown.
  element.selectName = (scopeValue, name) => {
    if ([...scope.options].some((o) => o.value === scopeValue)) scope.value = scopeValue;
    show();
    const rows = scope.value === "all" ? allRows : doc.stats.by_rank[Number(scope.value)];
    const row = rows.find((r) => r[at.name] === name);
    if (!row) return false;
    showSlowest(row);
    return true;
  };
  filter.addEventListener("input", show);
  scope.addEventListener("change", show);
  show();
}
