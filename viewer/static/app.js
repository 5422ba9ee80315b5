// The page: reads the document (inlined in an exported report, else from the server), fills the
// header, and renders each view into its section. The views talk to the timeline through a bus.
// The tab, the selection and the heatmap's range live in the URL (state.js): a link restores them.
// A first document (`partial`: a view of many ranks from their digests, while the server computes
// the full one) draws the heatmap at once; the views that need the full document say they are
// being computed, and the page asks the server for it (full.json, a long poll) and upgrades the
// views in place when it comes, or says in one line why it could not be computed.

import * as breakdown from "./breakdown.js";
import * as collectives from "./collectives.js";
import * as compare from "./compare.js";
import * as heatmap from "./heatmap.js";
import * as openNow from "./open.js";
import * as state from "./state.js";
import * as stats from "./stats.js";
import * as timeline from "./timeline.js";
import { el, fmtCount, fmtNs, makeBus } from "./util.js";

async function loadDocument() {
  const inline = document.getElementById("gputrace-data");
  if (inline) return JSON.parse(inline.textContent);
  const res = await fetch("data.json");
  if (!res.ok) throw new Error(`data.json: ${res.status} ${res.statusText}`);
  return res.json();
}

function facts(doc) {
  const parts = [`${doc.ranks.length} rank${doc.ranks.length === 1 ? "" : "s"}`];
  if (doc.steps) parts.push(`${fmtCount(doc.steps.count)} steps of '${doc.steps.name}'${doc.steps.skipped ? ` (first ${doc.steps.skipped} skipped)` : ""}`);
  if (doc.spans !== null && doc.spans !== undefined) parts.push(`${fmtCount(doc.spans)} spans`);
  parts.push(fmtNs(doc.duration_ns));
  const al = doc.alignment;
  if (al && al.per_rank) {
    // A rank with no offset measured (no clock sync) has no error bar, not one of 0 ns.
    const ranks = al.per_rank.filter((a) => a);
    const unmeasured = ranks.filter((a) => a.measured === false).length;
    const errs = ranks.filter((a) => a.measured !== false && typeof a.error_ns === "number").map((a) => a.error_ns);
    const method = al.method === "clock" ? "aligned by clock sync" : al.method === "none" ? "host clocks as recorded" : `aligned: ${al.method}`;
    if (unmeasured && unmeasured === ranks.length) {
      parts.push(al.method === "clock" ? "clocks not synced: host clocks as recorded, error unknown" : `${method}, error unknown`);
    } else {
      const bars = errs.length ? `error bars up to ±${fmtNs(Math.max(...errs))}` : "";
      const unsynced = unmeasured ? `${unmeasured} rank${unmeasured === 1 ? "" : "s"} not synced, error unknown` : "";
      const detail = [bars, unsynced].filter((x) => x).join("; ");
      parts.push(detail ? `${method} (${detail})` : method);
    }
  }
  return parts.join(" · ");
}

function tabs(doc) {
  const views = [
    ["heatmap", "Stragglers"],
    ["collectives", "Collectives"],
    ["breakdown", "Where the time went"],
    ["stats", "Span statistics"],
  ];
  if (doc.compare) views.push(["compare", "Compare"]);
  const bar = document.getElementById("tabs");
  const buttons = views.map(([id, label]) =>
    el("button", { type: "button", role: "tab", id: `tab-${id}`, "aria-controls": id, "data-testid": `tab-${id}`, text: label, onclick: () => show(id, true) }),
  );
  bar.replaceChildren(...buttons);
  function show(id, clicked) {
    if (clicked) state.write({ tab: id === "heatmap" ? null : id });
    for (const [v] of views) {
      const on = v === id;
      document.getElementById(v).hidden = !on;
      document.getElementById(`tab-${v}`).setAttribute("aria-selected", on ? "true" : "false");
    }
    const section = document.getElementById(id);
    if (section.redraw) section.redraw();
  }
  const wanted = state.get("tab");
  show(views.some(([v]) => v === wanted) ? wanted : "heatmap");
  return show;
}

// The selection a link carries, made again (after every view, the timeline included, listens).
function restore(show) {
  const sel = state.get("sel") || "";
  let m;
  if ((m = /^cell:(-?\d+):(-?\d+)$/.exec(sel))) {
    const hm = document.getElementById("heatmap");
    if (hm.selectStep) hm.selectStep(Number(m[1]), Number(m[2]));
  } else if ((m = /^coll:(\d+)$/.exec(sel))) {
    const co = document.getElementById("collectives");
    if (co.selectOccurrence) co.selectOccurrence(Number(m[1]));
  } else if ((m = /^bd:(-?\d+):([\s\S]*)$/.exec(sel))) {
    const bd = document.getElementById("breakdown");
    if (bd.selectName) bd.selectName(Number(m[1]), m[2]);
  } else if ((m = /^name:([^:]*):([\s\S]*)$/.exec(sel))) {
    const st = document.getElementById("stats");
    if (st.selectName) st.selectName(m[1], m[2]);
  }
  const tab = state.get("tab");
  if (tab) show(tab);
}

// The views that need the full document, and what each shows until it comes.
const FULL_VIEWS = [
  ["collectives", collectives, "Who waited for whom in each collective"],
  ["breakdown", breakdown, "Where the time went, rank by rank"],
  ["stats", stats, "The span statistics"],
];

function computing(section, what) {
  section.replaceChildren(el("p", { className: "empty computing", "data-testid": "computing", text: `${what}: being computed from the ranks' digests; this view fills in by itself when it is ready.` }));
}

// Header and views from `doc` (the timeline is left as it is: it keeps what it loaded).
function draw(doc, bus) {
  document.title = `gputrace · ${doc.title}`;
  document.getElementById("title").textContent = doc.title;
  document.getElementById("facts").textContent = facts(doc);
  const notes = document.getElementById("notes");
  notes.replaceChildren(...doc.notes.map((note) => el("li", { text: note })));
  document.getElementById("notes-box").hidden = doc.notes.length === 0;
  openNow.render(doc, document.getElementById("open"), bus);
  const show = tabs(doc);
  heatmap.render(doc, document.getElementById("heatmap"), bus);
  for (const [id, view, what] of FULL_VIEWS) {
    const section = document.getElementById(id);
    section.redraw = null;
    if (doc.partial) computing(section, what);
    else view.render(doc, section, bus);
  }
  if (doc.compare) compare.render(doc, document.getElementById("compare"), bus);
  return show;
}

function status(text, error) {
  const line = document.getElementById("full-status");
  line.textContent = text;
  line.hidden = !text;
  line.classList.toggle("error", Boolean(error));
}

// Ask for the full document until it comes (the server holds each request until it is ready or
// a while has passed), then draw it; an error is said in one line.
async function follow(upgrade) {
  let failures = 0;
  for (;;) {
    let res;
    try {
      res = await fetch("full.json?wait=10");
    } catch (e) {
      if (++failures >= 5) return status("The full statistics could not be fetched: the viewer's server does not answer (was gputrace view stopped?).", true);
      await new Promise((ok) => setTimeout(ok, 1000));
      continue;
    }
    failures = 0;
    if (res.status === 202) continue;
    if (res.ok) return upgrade(await res.json());
    let reason = `${res.status} ${res.statusText}`;
    try {
      reason = (await res.json()).error || reason;
    } catch (e) {
      // Not the server's JSON: its status says it.
    }
    document.body.dataset.full = "error";
    for (const [id, , what] of FULL_VIEWS) {
      document.getElementById(id).replaceChildren(el("p", { className: "empty error", "data-testid": "not-computed", text: `${what}: not computed (see above).` }));
    }
    return status(`The full statistics could not be computed: ${reason}`, true);
  }
}

async function main() {
  let doc;
  try {
    doc = await loadDocument();
  } catch (err) {
    document.getElementById("facts").textContent = `could not read the viewer's data: ${err.message}`;
    return;
  }
  // While a document is drawn again the views' own restoring of a selection moves nothing else
  // (the timeline keeps what it shows).
  const all = makeBus();
  let quiet = false;
  const bus = { on: all.on, emit: (name, value) => (quiet ? undefined : all.emit(name, value)) };
  const show = draw(doc, bus);
  timeline.render(doc, document.getElementById("timeline"), bus);
  restore(show);
  // The sticky header's height, so a view scrolled into place stops below it.
  const head = document.getElementById("top");
  const fit = () => document.documentElement.style.setProperty("--head", `${head.offsetHeight}px`);
  fit();
  if (window.ResizeObserver) new ResizeObserver(fit).observe(head);
  document.body.dataset.ready = "1";
  window.gputraceReadyMs = performance.now();
  if (!doc.partial) {
    document.body.dataset.full = "1";
    return;
  }
  status("Computing the step breakdown, collectives, span statistics and causes; the heatmap's numbers are final.", false);
  document.body.dataset.full = "computing";
  await follow((full) => {
    quiet = true;
    try {
      restore(draw(full, bus));
    } finally {
      quiet = false;
    }
    status("", false);
    document.body.dataset.full = "1";
    window.gputraceFullMs = performance.now();
  });
}

main();
