// The timeline: the Perfetto UI in an iframe, given the trace by postMessage (its embedding API:
// PING until PONG, then the trace as an ArrayBuffer) and moved by the other views (a posted
// time range, in seconds of trace time). Perfetto's JSON importer ignores baseTimeNanoseconds:
// its trace time is the events' ts (us) x 1000 ns, and the server writes ts from the document's
// base, so a time of the document (ns from that base) / 1e9 is the UI's time in seconds.
// A trace too large for the UI arrives as a time window around what the user asked to see.
//
// Which rank: the UI's postMessage API (v52: PING, a trace buffer, a time range) cannot scroll to
// a track or select a span. When the UI is served by the viewer itself (the same origin: a local
// build, `--perfetto-ui DIR` or gputrace[offline]), the page asks the UI's own objects to put the
// ranks in numeric order, open the clicked rank and select its span, which scrolls it into view.
// A UI on another origin (ui.perfetto.dev) gets the time range only, and the status line names
// the rank to look for; its processes are written as "rank 07" of 64, so their order is numeric
// there too when ranks have as many spans (the UI orders processes by size, then by name).

import { el, fmtCount, fmtNs } from "./util.js";

const PONG_TIMEOUT_MS = 20000;
// The asked range fills this share of the visible window. Without it the UI shows five times the
// range (twice its length padded on each side) or only centres it, so a step would look tiny.
const VIEW_SHARE = 0.8;

export function render(doc, element, bus) {
  element.replaceChildren();
  const tl = doc.timeline;
  const ui = tl.ui;
  if (!ui) {
    const status = el("p", {
      className: "empty",
      "data-testid": "timeline-status",
      text: "This report carries no timeline (it makes no network request). Open the traces with `gputrace view` to see them in the Perfetto UI, linked to these views.",
    });
    element.append(status);
    bus.on("zoom", (z) => {
      status.textContent = `${z.what}: ${fmtNs(z.start)} to ${fmtNs(z.end)} after the trace's start. Open the traces with \`gputrace view\` to see it in the Perfetto UI.`;
    });
    return;
  }
  const origin = new URL(ui.src, location.href).origin;
  const status = el("span", { className: "status", "data-testid": "timeline-status", text: "starting the Perfetto UI…" });
  const download = el("a", { href: ui.download, download: ui.filename, "data-testid": "timeline-download", text: `download the trace (${doc.spans === null || doc.spans === undefined ? "" : `${fmtCount(doc.spans)} spans, `}JSON)` });
  const frame = el("iframe", { src: ui.src, title: "Perfetto UI", "data-testid": "timeline-frame" });
  element.append(
    el("div", { className: "timeline-head" }, el("strong", { text: "Timeline" }), el("span", { "data-testid": "timeline-source", text: ` from ${ui.label}` }), status, download),
    frame,
  );

  let ready = false;
  let loaded = null; // [lo, hi): the ns (from the base) that the UI holds, or null
  let loading = null; // the promise of the load in flight
  let wanted = null; // the latest zoom asked for
  let serial = 0;
  let loadedAt = 0; // when the UI was last given a trace

  function post(message) {
    frame.contentWindow.postMessage(message, origin);
  }

  const started = Date.now();
  const ping = setInterval(() => {
    if (ready) return clearInterval(ping);
    if (Date.now() - started > PONG_TIMEOUT_MS) {
      clearInterval(ping);
      status.textContent = `the Perfetto UI at ${ui.src.split("#")[0]} did not answer (it may need a network connection); every other view works without it, and the trace can be downloaded. For a timeline without the network: pip install gputrace[offline] (a local Perfetto UI build), or give one with gputrace view --perfetto-ui DIR|URL.`;
      status.classList.add("error");
      return;
    }
    try {
      post("PING");
    } catch (e) {
      // The frame may not have a window yet.
    }
  }, 150);

  window.addEventListener("message", (e) => {
    if (e.source !== frame.contentWindow || e.data !== "PONG" || ready) return;
    ready = true;
    clearInterval(ping);
    if (wanted) go(wanted);
    else loading = load(tl.whole ? null : tl.initial);
  });

  async function load(win) {
    const url = win ? `${ui.trace}?start=${win[0]}&end=${win[1]}` : ui.trace;
    status.textContent = win ? `loading ${fmtNs(win[0])}–${fmtNs(win[1])} of the trace into the Perfetto UI…` : "loading the trace into the Perfetto UI…";
    const res = await fetch(url);
    if (!res.ok) throw new Error(`${url}: ${res.status}`);
    const buffer = await res.arrayBuffer();
    const got = (res.headers.get("X-Gputrace-Window") || "").split(",").map(Number);
    loaded = got.length === 2 && got.every(Number.isFinite) ? got : [0, doc.duration_ns];
    post({ perfetto: { buffer, title: doc.title, keepApiOpen: true } });
    loadedAt = Date.now();
    arrange(loadedAt);
    status.textContent = tl.whole ? "the whole trace" : `the trace from ${fmtNs(loaded[0])} to ${fmtNs(loaded[1])} (it is too large for the Perfetto UI at once: a click in the views loads the part it shows)`;
    element.dataset.loaded = loaded.join(",");
  }

  async function go(z) {
    wanted = z;
    element.scrollIntoView({ block: "nearest" });
    if (!ready) {
      status.textContent = `${z.what}: shown once the Perfetto UI has started`;
      return;
    }
    const mine = ++serial;
    const start = z.start;
    const end = z.end > z.start ? z.end : z.start + 1000;
    if (!tl.whole && (!loaded || start < loaded[0] || end > loaded[1])) {
      const pad = Math.max(end - start, 1e6);
      loading = load([Math.max(0, Math.floor(start - pad)), Math.ceil(end + pad)]);
    } else if (!loaded && !loading) {
      loading = load(null);
    }
    if (loading) {
      try {
        await loading;
      } catch (err) {
        status.textContent = `could not load the trace: ${err.message}`;
        status.classList.add("error");
        return;
      }
    }
    if (mine !== serial) return;
    const message = { perfetto: { timeStart: start / 1e9, timeEnd: end / 1e9, viewPercentage: VIEW_SHARE } };
    post(message);
    if (z.slot !== undefined) reveal(z, mine);
    // The UI retries a range that arrives while it is still loading for 4 s only; a large load
    // takes longer, so after a load the range is posted again for a while.
    const since = loadedAt;
    for (const wait of [2000, 5000, 10000, 20000]) {
      setTimeout(() => {
        if (mine === serial && since === loadedAt && Date.now() - loadedAt < 25000) post(message);
      }, wait);
    }
    status.textContent = z.slot === undefined || perfettoApp() ? `showing ${z.what}` : `showing ${z.what}: look for '${rankName(z.slot)}' in the timeline (a Perfetto UI on another origin cannot be told which rank)`;
    element.dataset.zoom = `${start},${end}`;
  }

  // The UI's app object when the frame is of this page's origin and holds a loaded trace, else null.
  function perfettoApp() {
    try {
      const app = frame.contentWindow.app;
      return app && app.trace && app.trace.engine && app.trace.workspace ? app : null;
    } catch (e) {
      return null; // another origin
    }
  }

  function rankName(slot) {
    // As the timeline's trace names it (data.numbered): "rank 07 (host, cpu)" of 64 ranks.
    const width = String(Math.max(...doc.ranks)).length;
    return doc.labels[slot].replace(/^rank (\d+)\b/, (_, d) => `rank ${d.padStart(width, "0")}`);
  }

  // Rank groups in numeric order, once per trace the UI loads.
  const ordered = new WeakSet();
  function orderRanks(app) {
    const ws = app.trace.workspace;
    if (ordered.has(ws)) return;
    const nodes = ws.children.filter((c) => /^rank \d+/.test(c.name || ""));
    const rankOf = (c) => Number(/^rank (\d+)/.exec(c.name)[1]);
    const sorted = nodes.slice().sort((a, b) => rankOf(a) - rankOf(b));
    if (sorted.some((c, i) => c !== nodes[i])) {
      // Taken out and put back, in order, where the last of them stood.
      const all = ws.children;
      const after = all[all.indexOf(nodes[nodes.length - 1]) + 1];
      for (const c of nodes) ws.removeChild(c);
      for (const c of sorted) {
        if (after) ws.addChildBefore(c, after);
        else ws.addChildLast(c);
      }
    }
    ordered.add(ws);
  }

  // Once the UI holds the trace posted at `at`, its ranks in numeric order.
  async function arrange(at) {
    const until = Date.now() + 60000;
    await new Promise((res) => setTimeout(res, 300));
    while (at === loadedAt && Date.now() < until) {
      const app = perfettoApp();
      if (app && !app.isLoadingTrace && app.trace.workspace.children.length) {
        try {
          orderRanks(app);
        } catch (e) {
          // A UI build whose objects differ: its own order stands.
        }
        return;
      }
      await new Promise((res) => setTimeout(res, 200));
    }
  }

  // Open the clicked rank in the UI and select its span (the UI scrolls the track into view).
  async function reveal(z, mine) {
    const until = Date.now() + 60000;
    let app = perfettoApp();
    while ((!app || app.isLoadingTrace) && Date.now() < until) {
      await new Promise((res) => setTimeout(res, 200));
      if (mine !== serial) return;
      app = perfettoApp();
    }
    if (!app) return;
    try {
      orderRanks(app);
      const pid = doc.pids ? doc.pids[z.slot] : null;
      if (!Number.isInteger(pid)) return;
      // A process group is named "<process name> <pid>".
      const group = app.trace.workspace.children.find((c) => (c.name || "").endsWith(` ${pid}`));
      if (group && group.expand) group.expand();
      let id = null;
      if (z.span) {
        const a = Math.round(z.span.start);
        const d = Math.round(z.span.end - z.span.start);
        const sql = `select s.id as id from slice s join thread_track t on s.track_id = t.id join thread using (utid) join process p using (upid) where p.pid = ${pid} and s.ts between ${a - 1000} and ${a + 1000} and s.dur between ${d - 2000} and ${d + 2000} order by (s.name = '${String(z.span.name).replace(/'/g, "''")}') desc, abs(s.ts - ${a}) + abs(s.dur - ${d}), s.depth limit 1`;
        const res = await app.trace.engine.query(sql);
        const it = res.iter({});
        if (it.valid()) id = Number(it.get("id"));
      }
      if (mine !== serial) return;
      if (id !== null) {
        app.trace.selection.selectSqlEvent("slice", id, { scrollToSelection: true, switchToCurrentSelectionTab: false });
      } else if (group && group.reveal) {
        group.reveal();
      }
      element.dataset.revealed = `${doc.ranks[z.slot]},${id === null ? "" : id}`;
      status.textContent = `showing ${z.what}${id !== null ? ` (selected in ${rankName(z.slot)})` : ""}`;
    } catch (err) {
      // A UI build whose objects differ: the time range stands, the rank is named.
      status.textContent = `showing ${z.what}: look for '${rankName(z.slot)}' in the timeline`;
    }
  }


  bus.on("zoom", (z) => {
    go(z);
  });
}
