// Where each rank is now (a live or killed run): the verdict in words and a row per rank, from the
// ranks' open files (gputrace.live, through viewer/data.py's `open`). Hidden for a run that
// finished cleanly or that wrote no open files.

import { el } from "./util.js";

function clock(ns) {
  if (ns === null || ns === undefined) return "";
  return new Date(ns / 1e6).toISOString().slice(11, 19);
}

export function render(doc, section) {
  const open = doc.open;
  if (!open || !open.verdict || open.verdict.length === 0) {
    section.hidden = true;
    return;
  }
  const rows = Object.entries(open.ranks).map(([rank, r]) =>
    el(
      "tr",
      { "data-testid": `open-rank-${rank}` },
      el("td", { text: rank }),
      el("td", { text: r.step === null ? "–" : String(r.step) }),
      el("td", { text: r.stack.join(" › ") || "–" }),
      el("td", { text: r.since_ns === null ? "" : `${clock(r.since_ns)} UTC` }),
      el("td", { text: r.device ? r.device.name : "" }),
      el("td", { text: r.finished ? "finished" : "" }),
    ),
  );
  section.replaceChildren(
    el("h3", { text: "Open now: where each rank is" }),
    ...open.verdict.map((line) => el("p", { className: "lead error", "data-testid": "open-verdict", text: line })),
    el(
      "table",
      { "data-testid": "open-table" },
      el("thead", {}, el("tr", {}, ...["rank", doc.step_name || "step", "open spans, outermost first", "innermost since", "GPU in", ""].map((h) => el("th", { text: h })))),
      el("tbody", {}, ...rows),
    ),
  );
  section.hidden = false;
}
