// `view A --compare B`: what changed from run A (this page's) to run B, as `gputrace diff` says
// it: the step time, then per span name the median per occurrence in each run, the change and
// whether it lies within the runs' own spread (noise), the largest regression first. Every number
// comes from `gputrace.diff` (the document's `compare`); a click on a row shows that name's
// slowest instance in this run's timeline.

import { el, fmtCount, fmtNs, fmtPct, fmtSigned, sortableTable } from "./util.js";

function verdict(c) {
  if (c.noise) return "noise";
  return c.delta_ns > 0 ? "slower" : "faster";
}

function runLine(label, run) {
  const ranks = `${run.ranks.length} rank${run.ranks.length === 1 ? "" : "s"}`;
  const read = run.notes.length ? `; ${run.notes[0].split(/[:;]/)[0]}` : "";
  return `${label}: ${run.paths.join(" ")} (${ranks}${read})`;
}

export function render(doc, element, bus) {
  element.replaceChildren();
  const d = doc.compare;
  if (!d) {
    element.append(el("p", { className: "empty", text: "No run to compare with: gputrace view A --compare B shows one." }));
    return;
  }
  const lead = el("p", { className: "lead", "data-testid": "compare-lead" });
  const st = d.step;
  const changed = d.names.filter((c) => !c.noise);
  const worst = changed.find((c) => c.delta_ns > 0);
  const parts = [];
  if (st) {
    parts.push(`Step '${st.name}': ${fmtNs(st.a_ns)} → ${fmtNs(st.b_ns)}, ${fmtSigned(st.delta_ns)} (${fmtPct(st.delta_pct)}), ${st.noise ? "within the noise" : `${verdict(st)}, beyond the noise`} (±${fmtNs(st.noise_ns)}).`);
  }
  if (worst) parts.push(`Largest regression: '${worst.name}' ${fmtSigned(worst.delta_ns)} (${fmtPct(worst.delta_pct)}) per occurrence.`);
  else parts.push(changed.length ? "No span name is slower beyond the noise." : "Every span name's change is within the noise.");
  lead.textContent = parts.join(" ");
  if (st) lead.dataset.step = verdict(st);

  const slowest = new Map(doc.stats.names.map((r) => [r[doc.stats.columns.indexOf("name")], r]));
  const at = Object.fromEntries(doc.stats.columns.map((c, i) => [c, i]));
  const rows = d.names.map((c, i) => ({ ...c, order: i + 1, verdict: verdict(c) }));
  const columns = [
    { key: "order", label: "#", num: true, title: "the largest regression beyond the noise first, then the changes within it" },
    { key: "name", label: "name", num: false },
    { key: "a_ns", label: "A", num: true, fmt: fmtNs, title: "median per occurrence in run A, all ranks" },
    { key: "b_ns", label: "B", num: true, fmt: fmtNs, title: "median per occurrence in run B, all ranks" },
    { key: "delta_ns", label: "delta", num: true, fmt: fmtSigned },
    { key: "delta_pct", label: "delta %", num: true, fmt: fmtPct },
    { key: "verdict", label: "verdict", num: false },
    { key: "noise_ns", label: "noise", num: true, fmt: (v) => `±${fmtNs(v)}`, title: "the band a change must leave to be called one" },
    { key: "a_count", label: "count A", num: true, fmt: fmtCount },
    { key: "b_count", label: "count B", num: true, fmt: fmtCount },
  ];
  const table = rows.length
    ? sortableTable({
        columns,
        rows,
        testid: "compare-table",
        rowTestid: "compare-row",
        sortKey: "order",
        sortDesc: false,
        onRow: (row) => {
          const s = slowest.get(row.name);
          if (s) bus.emit("zoom", { start: s[at.slowest_start_ns], end: s[at.slowest_end_ns], what: `the slowest '${row.name}' of run A (rank ${s[at.slowest_rank]})` });
        },
        rowTitle: (row) => `click: show the slowest '${row.name}' of run A in the timeline`,
      })
    : el("p", { className: "note", text: "No span name besides the step is in both runs." });
  const only = [];
  if (d.only_a.length) only.push(`only in A: ${d.only_a.join(", ")}`);
  if (d.only_b.length) only.push(`only in B: ${d.only_b.join(", ")}`);
  const notes = [...d.notes, ...d.a.notes.slice(1).map((n) => `A: ${n}`), ...d.b.notes.slice(1).map((n) => `B: ${n}`)];
  element.append(
    el("p", { className: "note", "data-testid": "compare-runs" }, runLine("A", d.a), el("br"), runLine("B", d.b)),
    lead,
    table,
    only.length ? el("p", { className: "note", "data-testid": "compare-only", text: only.join("; ") }) : null,
    el("p", { className: "rule", "data-testid": "compare-rule", text: `rule: ${d.rule}` }),
    notes.length ? el("ul", { className: "note" }, ...notes.map((n) => el("li", { text: n }))) : null,
  );
}
