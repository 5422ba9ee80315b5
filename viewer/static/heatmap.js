// The rank x step heatmap: one cell per rank per step, coloured by the rank's busy time in the
// step (work before waiting in collectives) against the median of the other ranks in that step
// (with two ranks, the other one: a median over both would halve the gap). A black mark, the
// middle half of the cell each way at every size, is gputrace's verdict: that rank was the slowest in that step by more than the noise. Hover
// shows the numbers; a click shows that rank's step in the timeline. Drawn on one canvas (no DOM
// node per cell); with more steps than pixels, each column shows the worst step it covers.

import * as state from "./state.js";
import { el, fmtNs, fmtPct, fmtSigned } from "./util.js";

const SATURATE = 0.2; // busy time 20% off the median takes the scale's end colour
const BELOW = [[247, 247, 247], [146, 197, 222], [33, 102, 172]];
const ABOVE = [[247, 247, 247], [244, 165, 130], [178, 24, 43]];
export const MISSING = [210, 210, 210];
export const MARK = [0, 0, 0];
const BACKGROUND = [255, 255, 255];
const GUTTER = 70; // CSS px left of the cells: rank labels
const AXIS = 18; // CSS px above the cells: step numbers

// 256 colours from ratio 1 - SATURATE to 1 + SATURATE.
const LUT = (() => {
  const out = [];
  for (let i = 0; i < 256; i++) {
    const t = (i / 255) * 2 - 1;
    const stops = t >= 0 ? ABOVE : BELOW;
    const a = Math.abs(t);
    const seg = a < 0.5 ? 0 : 1;
    const u = seg === 0 ? a * 2 : (a - 0.5) * 2;
    out.push(stops[seg].map((c, j) => Math.round(c + (stops[seg + 1][j] - c) * u)));
  }
  return out;
})();

export function colour(ratio) {
  if (!(ratio >= 0)) return MISSING;
  const t = Math.max(-1, Math.min(1, (ratio - 1) / SATURATE));
  return LUT[Math.round((t + 1) * 127.5)];
}

export function render(doc, element, bus) {
  element.replaceChildren();
  const st = doc.steps;
  if (!st || st.count === 0) {
    element.append(
      el("p", { className: "empty", "data-testid": "heatmap-empty", text: `No '${doc.step_name}' spans on every rank, so there are no steps to compare. Name the span that marks a training step with --step NAME.` }),
    );
    return;
  }
  const n = doc.ranks.length;
  const S = st.count;
  const ratio = new Float32Array(n * S).fill(NaN);
  for (let r = 0; r < n; r++) {
    const busy = st.busy[r];
    if (!busy) continue;
    const ref = st.ref && st.ref[r];
    for (let k = 0; k < S; k++) {
      const med = ref ? ref[k] : st.median[k];
      ratio[r * S + k] = med > 0 ? busy[k] / med : busy[k] > 0 ? Infinity : 1;
    }
  }
  const called = new Uint8Array(n * S);
  st.verdict.called.forEach((c, k) => {
    if (c && st.verdict.slot[k] >= 0) called[st.verdict.slot[k] * S + k] = 1;
  });

  const slowest = doc.ranks.map((r, i) => [r, st.times_slowest[i]]).filter(([, c]) => c > 0).sort((a, b) => b[1] - a[1]);
  const verdictLine = slowest.length
    ? "Called slowest: " + slowest.slice(0, 6).map(([r, c]) => `rank ${r} in ${c} of ${S} steps`).join("; ") + (slowest.length > 6 ? `; ${slowest.length - 6} more ranks` : "")
    : `No rank was slowest in any of the ${S} steps by more than the noise.`;
  const range = el("span", { "data-testid": "heatmap-range" });
  const controls = el(
    "div",
    { className: "controls" },
    range,
    el("button", { type: "button", text: "−", title: "show more steps", onclick: () => zoomBy(1.6, (view.s0 + view.s1) / 2) }),
    el("button", { type: "button", text: "+", title: "show fewer steps", onclick: () => zoomBy(1 / 1.6, (view.s0 + view.s1) / 2) }),
    el("button", { type: "button", text: "all steps", onclick: () => setView(0, S) }),
  );
  element.append(
    el("p", { className: "lead", "data-testid": "heatmap-verdict", text: verdictLine }),
    ...(doc.warmup_auto ? [el("p", { className: "note", "data-testid": "warmup-note", text: `${doc.notes[0].charAt(0).toUpperCase()}${doc.notes[0].slice(1)}.` })] : []),
    el("div", { className: "legend-row" }, legend(), controls),
    el("details", { className: "rule" }, el("summary", { text: "When is a rank called slowest?" }), el("p", { text: st.rule })),
  );
  const canvas = el("canvas", { "data-testid": "heatmap", "data-ranks": n, "data-steps": S, tabindex: 0 });
  // The step-time trend above the cells, on the same x axis: the mean over ranks of each part of
  // the step, stacked, so a step every rank took longer shows, and by which part.
  const tr = st.trend && st.trend.work.length === S ? st.trend : null;
  const trendCanvas = tr ? el("canvas", { "data-testid": "trend", "data-steps": S }) : null;
  // A first document (doc.partial) has the steps' times, not yet their breakdown: the trend and
  // the words about causes and phases come with the full document.
  const pending = doc.partial ? el("p", { className: "note computing", "data-testid": "heatmap-computing", text: "The step-time trend by part (work, idle, collective transfer and wait), the causes and the phases are being computed." }) : null;
  const wrap = el("div", { className: "heatmap-wrap" }, pending, tr ? trendLegend() : null, trendCanvas, canvas);
  const tip = el("div", { className: "tooltip", "data-testid": "heatmap-tooltip", hidden: true });
  element.append(wrap, tip);

  const view = { s0: 0, s1: S };
  let selected = null;
  let geo = null;

  function layout() {
    const dpr = window.devicePixelRatio || 1;
    const cssW = Math.max(240, wrap.clientWidth || element.clientWidth || 800);
    const rowCss = Math.max(1, Math.min(22, Math.floor(480 / n)));
    const plotCssW = cssW - GUTTER - 8;
    const plotCssH = rowCss * n;
    canvas.style.width = `${cssW}px`;
    canvas.style.height = `${plotCssH + AXIS + 4}px`;
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round((plotCssH + AXIS + 4) * dpr);
    geo = {
      dpr,
      x0: Math.round(GUTTER * dpr),
      y0: Math.round(AXIS * dpr),
      w: Math.round(plotCssW * dpr),
      h: Math.round(plotCssH * dpr),
    };
  }

  // The steps pixel column x covers, and the one it shows for rank r (the worst ratio).
  function columnSteps(x) {
    const m = view.s1 - view.s0;
    const a = view.s0 + Math.floor((x * m) / geo.w);
    const b = Math.max(a + 1, view.s0 + Math.floor(((x + 1) * m) / geo.w));
    return [a, Math.min(b, view.s1)];
  }
  function shown(r, a, b) {
    let best = a;
    let worst = -Infinity;
    let mark = 0;
    for (let k = a; k < b; k++) {
      const v = ratio[r * S + k];
      if (v > worst) {
        worst = v;
        best = k;
      }
      if (called[r * S + k]) mark = 1;
    }
    return [best, mark];
  }
  function rowOf(y) {
    return Math.min(n - 1, Math.floor((y * n) / geo.h));
  }
  // The device-pixel rows [y0, y1) of rank slot r: exactly the y for which rowOf(y) is r.
  function yBounds(r) {
    return [Math.ceil((r * geo.h) / n), Math.ceil(((r + 1) * geo.h) / n)];
  }
  // The device-pixel columns [x0, x1) that show step k: exactly the x whose columnSteps start at
  // or before k and end after it (with more steps than pixels, the one column it shares).
  function xBounds(k) {
    const m = view.s1 - view.s0;
    const x1 = Math.ceil(((k + 1 - view.s0) * geo.w) / m);
    const x0 = Math.min(Math.ceil(((k - view.s0) * geo.w) / m), x1 - 1);
    return [x0, Math.min(x1, geo.w)];
  }

  function draw() {
    layout();
    const ctx = canvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    const { w, h } = geo;
    const img = ctx.createImageData(w, h);
    const px = img.data;
    const m = view.s1 - view.s0;
    const wide = geo.w / m >= 6; // room for a gap between cells
    const rows = [];
    for (let r = 0; r < n; r++) rows.push(yBounds(r));
    const tall = rows.length && rows[0][1] - rows[0][0] >= 6;
    let x = 0;
    while (x < w) {
      const [a, b] = columnSteps(x);
      // The run of pixel columns that shows the same steps.
      let xe = x + 1;
      while (xe < w && columnSteps(xe)[0] === a && columnSteps(xe)[1] === b) xe++;
      for (let r = 0; r < n; r++) {
        const [k, mark] = shown(r, a, b);
        const c = colour(ratio[r * S + k]);
        const [y0, y1] = rows[r];
        const cw = xe - x;
        const ch = y1 - y0;
        // The mark: the middle half of the cell each way (at least a pixel), at every size, so a
        // marked cell keeps its colour around the mark however many steps are shown.
        const [mx0, mx1] = middleHalf(x, xe - (wide ? 1 : 0));
        const [my0, my1] = middleHalf(y0, y1 - (tall ? 1 : 0));
        for (let yy = y0; yy < y1; yy++) {
          for (let xx = x; xx < xe; xx++) {
            let col = c;
            if ((wide && xx === xe - 1) || (tall && yy === y1 - 1)) col = BACKGROUND;
            else if (mark && xx >= mx0 && xx < mx1 && yy >= my0 && yy < my1) col = MARK;
            const o = (yy * w + xx) * 4;
            px[o] = col[0];
            px[o + 1] = col[1];
            px[o + 2] = col[2];
            px[o + 3] = 255;
          }
        }
      }
      x = xe;
    }
    ctx.putImageData(img, geo.x0, geo.y0);
    drawLabels(ctx);
    if (tr) drawTrend();
    if (selected && selected.k >= view.s0 && selected.k < view.s1) {
      const [sx0, sx1] = xBounds(selected.k);
      const [sy0, sy1] = yBounds(selected.r);
      ctx.strokeStyle = "#1f6feb";
      ctx.lineWidth = 2 * geo.dpr;
      ctx.strokeRect(geo.x0 + sx0 - geo.dpr, geo.y0 + sy0 - geo.dpr, sx1 - sx0 + 2 * geo.dpr, sy1 - sy0 + 2 * geo.dpr);
    }
    range.textContent = `steps ${st.first + view.s0}–${st.first + view.s1 - 1} of ${st.first}–${st.first + S - 1}`;
    canvas.dataset.view = `${view.s0},${view.s1}`;
    if (element.onview) element.onview(view.s0, view.s1);
  }

  function drawLabels(ctx) {
    const { dpr } = geo;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#333";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    const rowCss = geo.h / dpr / n;
    const every = Math.max(1, Math.ceil(12 / rowCss));
    for (let r = 0; r < n; r += every) {
      ctx.fillText(`rank ${doc.ranks[r]}`, GUTTER - 6, AXIS + (r + 0.5) * rowCss);
    }
    ctx.textAlign = "center";
    ctx.textBaseline = "alphabetic";
    const m = view.s1 - view.s0;
    const wCss = geo.w / dpr;
    const tick = niceStep(m / Math.max(1, wCss / 60));
    for (let k = Math.ceil(view.s0 / tick) * tick; k < view.s1; k += tick) {
      const x = GUTTER + ((k - view.s0 + 0.5) * wCss) / m;
      ctx.fillText(String(st.first + k), x, AXIS - 5);
    }
  }

  // The trend: per pixel column, the step of the columns' steps with the longest mean step time.
  const TREND_CSS = 110;
  let trendGeo = null;
  function trendTotal(k) {
    return tr.work[k] + tr.idle[k] + tr.transfer[k] + tr.wait[k];
  }
  function trendShown(a, b) {
    let best = a;
    for (let k = a + 1; k < b; k++) if (trendTotal(k) > trendTotal(best)) best = k;
    return best;
  }
  function drawTrend() {
    const { dpr, x0, w } = geo;
    const cssW = canvas.width / dpr;
    trendCanvas.style.width = `${cssW}px`;
    trendCanvas.style.height = `${TREND_CSS}px`;
    trendCanvas.width = canvas.width;
    trendCanvas.height = Math.round(TREND_CSS * dpr);
    const top = Math.round(14 * dpr);
    const h = trendCanvas.height - top - Math.round(4 * dpr);
    let max = 0;
    for (let k = view.s0; k < view.s1; k++) max = Math.max(max, trendTotal(k));
    trendGeo = { top, h, max };
    const ctx = trendCanvas.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, trendCanvas.width, trendCanvas.height);
    const m = view.s1 - view.s0;
    const wide = w / m >= 6;
    let x = 0;
    while (x < w) {
      const [a, b] = columnSteps(x);
      let xe = x + 1;
      while (xe < w && columnSteps(xe)[0] === a && columnSteps(xe)[1] === b) xe++;
      const k = trendShown(a, b);
      let y = top + h;
      for (const [part, colour] of TREND_PARTS) {
        const ph = max > 0 ? Math.round((tr[part][k] * h) / max) : 0;
        if (ph <= 0) continue;
        ctx.fillStyle = colour;
        ctx.fillRect(x0 + x, y - ph, xe - x - (wide ? 1 : 0), ph);
        y -= ph;
      }
      x = xe;
    }
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#333";
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "top";
    ctx.fillText(fmtNs(max), GUTTER - 6, top / dpr);
    ctx.textBaseline = "bottom";
    ctx.fillText("0", GUTTER - 6, (top + h) / dpr);
    trendCanvas.dataset.max = String(max);
  }
  function trendHit(ev) {
    const rect = trendCanvas.getBoundingClientRect();
    const x = Math.floor((ev.clientX - rect.left) * geo.dpr) - geo.x0;
    if (x < 0 || x >= geo.w) return null;
    const [a, b] = columnSteps(x);
    return { k: trendShown(a, b), a, b };
  }
  function describeTrend({ k, a, b }) {
    const lines = [`step ${st.first + k}: ${fmtNs(trendTotal(k))} on average over the ranks`];
    if (b - a > 1) lines.push(`(the longest of steps ${st.first + a}–${st.first + b - 1} in this column)`);
    lines.push(`work inside spans ${fmtNs(tr.work[k])}, idle outside any span ${fmtNs(tr.idle[k])}`);
    lines.push(`collective transfer ${fmtNs(tr.transfer[k])}, waiting for the last rank ${fmtNs(tr.wait[k])}`);
    const v = st.verdict.slot[k];
    if (v >= 0) lines.push(`click: the step's slowest rank (${doc.labels[v]}) in the timeline`);
    return lines;
  }
  if (tr) {
    trendCanvas.addEventListener("mousemove", (ev) => {
      const h = trendHit(ev);
      if (!h) {
        tip.hidden = true;
        return;
      }
      tip.replaceChildren(...describeTrend(h).map((t) => el("div", { text: t })));
      tip.hidden = false;
      const tw = tip.offsetWidth;
      const left = ev.clientX + 14 + tw > window.innerWidth ? ev.clientX - 14 - tw : ev.clientX + 14;
      tip.style.left = `${Math.max(0, left)}px`;
      tip.style.top = `${ev.clientY + 14}px`;
    });
    trendCanvas.addEventListener("mouseleave", () => {
      tip.hidden = true;
    });
    trendCanvas.addEventListener("click", (ev) => {
      const h = trendHit(ev);
      if (h && st.verdict.slot[h.k] >= 0) select(st.verdict.slot[h.k], h.k);
    });
    // For tests: the device x of step k's column centre, and the parts' colours.
    trendCanvas.probe = {
      x(k) {
        const [x0, x1] = xBounds(k);
        return geo.x0 + Math.floor((x0 + x1 - 1) / 2);
      },
      parts: TREND_PARTS.map(([part, colour]) => [part, colour]),
      geo: () => trendGeo,
    };
  }

  function setView(s0, s1) {
    const m = Math.max(Math.min(S, 5), Math.min(S, Math.round(s1 - s0)));
    let a = Math.round(s0);
    a = Math.max(0, Math.min(S - m, a));
    view.s0 = a;
    view.s1 = a + m;
    draw();
    state.write({ steps: a === 0 && m === S ? null : `${st.first + a}-${st.first + a + m - 1}` });
  }
  function zoomBy(f, centre) {
    const m = view.s1 - view.s0;
    const nm = Math.max(1, m * f);
    setView(centre - ((centre - view.s0) * nm) / m, centre - ((centre - view.s0) * nm) / m + nm);
  }

  // Mouse position -> {r, k, a, b} (rank slot, step shown, steps covered), or null.
  function hit(ev) {
    const rect = canvas.getBoundingClientRect();
    const x = Math.floor((ev.clientX - rect.left) * geo.dpr) - geo.x0;
    const y = Math.floor((ev.clientY - rect.top) * geo.dpr) - geo.y0;
    if (x < 0 || y < 0 || x >= geo.w || y >= geo.h) return null;
    const r = rowOf(y);
    const [a, b] = columnSteps(x);
    const [k] = shown(r, a, b);
    return { r, k, a, b };
  }

  function describe({ r, k, a, b }) {
    const lines = [`${doc.labels[r]}, step ${st.first + k}`];
    if (b - a > 1) lines.push(`(the worst of steps ${st.first + a}–${st.first + b - 1} in this column)`);
    const busy = st.busy[r];
    if (!busy) {
      lines.push(`no '${st.name}' spans on this rank`);
      return lines;
    }
    const ref = st.ref && st.ref[r] ? st.ref[r][k] : st.median[k];
    const others = n === 2 ? "the other rank's" : n > 2 ? "the other ranks' median" : "its own";
    lines.push(`busy ${fmtNs(busy[k])}: ${fmtPct(ref ? (100 * (busy[k] - ref)) / ref : null)} against ${others} ${fmtNs(ref)}`);
    const cw = st.coll_wait && st.coll_wait[r] ? st.coll_wait[r][k] : null;
    const ct = st.coll_transfer && st.coll_transfer[r] ? st.coll_transfer[r][k] : null;
    if (cw !== null && cw !== undefined && ct !== null && ct !== undefined) {
      lines.push(`in collectives ${fmtNs(st.wait[r][k])}: waiting for the last rank ${fmtNs(cw)}, transfer ${fmtNs(ct)}`);
    } else {
      lines.push(`in collectives ${fmtNs(st.wait[r][k])}`);
    }
    const idle = st.idle && st.idle[r] ? st.idle[r][k] : null;
    if (idle !== null && idle !== undefined) lines.push(`idle outside any span ${fmtNs(idle)}`);
    lines.push(`the step took ${fmtNs(st.end[r][k] - st.start[r][k])}`);
    if (st.verdict.slot[k] === r) {
      const margin = st.verdict.margin_ns[k];
      const pct = fmtPct(st.verdict.margin_pct[k]);
      if (st.verdict.called[k]) lines.push(`called slowest in this step: ${fmtSigned(margin)} (${pct}) over the median, beyond the noise (${fmtNs(st.verdict.noise_ns[k])})`);
      else lines.push(`slowest in this step, but within the noise: ${fmtSigned(margin)} (${pct}); not called`);
    }
    lines.push("click: show this step of this rank in the timeline");
    return lines;
  }

  let drag = null;
  canvas.addEventListener("mousemove", (ev) => {
    if (drag) {
      const dx = ev.clientX - drag.x;
      if (Math.abs(dx) > 3) drag.moved = true;
      if (drag.moved) {
        const m = view.s1 - view.s0;
        setView(drag.s0 - (dx * geo.dpr * m) / geo.w, drag.s0 - (dx * geo.dpr * m) / geo.w + m);
      }
      return;
    }
    const h = hit(ev);
    if (!h) {
      tip.hidden = true;
      return;
    }
    tip.replaceChildren(...describe(h).map((t) => el("div", { text: t })));
    tip.hidden = false;
    const pad = 14;
    const tw = tip.offsetWidth;
    const left = ev.clientX + pad + tw > window.innerWidth ? ev.clientX - pad - tw : ev.clientX + pad;
    tip.style.left = `${Math.max(0, left)}px`;
    tip.style.top = `${ev.clientY + pad}px`;
  });
  canvas.addEventListener("mouseleave", () => {
    tip.hidden = true;
    drag = null;
  });
  canvas.addEventListener("mousedown", (ev) => {
    drag = { x: ev.clientX, s0: view.s0, moved: false };
  });
  canvas.addEventListener("mouseup", (ev) => {
    const d = drag;
    drag = null;
    if (d && d.moved) return;
    const h = hit(ev);
    if (h) select(h.r, h.k);
  });
  canvas.addEventListener(
    "wheel",
    (ev) => {
      const h = hit(ev);
      if (!h) return;
      ev.preventDefault();
      const rect = canvas.getBoundingClientRect();
      const x = ((ev.clientX - rect.left) * geo.dpr - geo.x0) / geo.w;
      zoomBy(ev.deltaY > 0 ? 1.25 : 0.8, view.s0 + x * (view.s1 - view.s0));
    },
    { passive: false },
  );

  // Keys: arrows move the selected cell, Enter or space shows it in the timeline.
  canvas.addEventListener("keydown", (ev) => {
    const cur = selected || { r: 0, k: view.s0 };
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (moves[ev.key]) {
      ev.preventDefault();
      const r = Math.max(0, Math.min(n - 1, cur.r + moves[ev.key][0]));
      const k = Math.max(0, Math.min(S - 1, cur.k + moves[ev.key][1]));
      selected = { r, k };
      if (k < view.s0 || k >= view.s1) setView(k - (view.s1 - view.s0) / 2, k + (view.s1 - view.s0) / 2);
      else draw();
      tip.replaceChildren(...describe({ r, k, a: k, b: k + 1 }).map((t) => el("div", { text: t })));
      const rect = canvas.getBoundingClientRect();
      const c = canvas.probe.centre(r, k);
      tip.hidden = false;
      tip.style.left = `${rect.left + c.x + 14}px`;
      tip.style.top = `${rect.top + c.y + 14}px`;
    } else if ((ev.key === "Enter" || ev.key === " ") && selected) {
      ev.preventDefault();
      select(selected.r, selected.k);
    }
  });
  canvas.addEventListener("blur", () => {
    tip.hidden = true;
  });

  function select(r, k) {
    selected = { r, k };
    draw();
    state.write({ tab: "heatmap", sel: `cell:${doc.ranks[r]}:${st.first + k}` });
    if (!st.start[r]) return;
    bus.emit("zoom", {
      start: st.start[r][k],
      end: st.end[r][k],
      what: `${doc.labels[r]}, step ${st.first + k}`,
      slot: r,
      span: { start: st.start[r][k], end: st.end[r][k], name: st.name },
    });
  }
  // A selection by rank and step number (a link's), brought into view.
  function selectStep(rank, number) {
    const r = doc.ranks.indexOf(rank);
    const k = number - st.first;
    if (r < 0 || !(k >= 0 && k < S)) return false;
    if (k < view.s0 || k >= view.s1) setView(k - (view.s1 - view.s0) / 2, k + (view.s1 - view.s0) / 2);
    select(r, k);
    return true;
  }

  // For tests and scripts: where a cell is drawn and what colour it has.
  canvas.probe = {
    centre(r, k) {
      if (k < view.s0 || k >= view.s1) return null;
      const [x0, x1] = xBounds(k);
      const [y0, y1] = yBounds(r);
      return { x: (geo.x0 + (x0 + x1) / 2) / geo.dpr, y: (geo.y0 + (y0 + y1) / 2) / geo.dpr };
    },
    pixel(r, k) {
      const [x0, x1] = xBounds(k);
      const [y0, y1] = yBounds(r);
      const d = canvas.getContext("2d").getImageData(geo.x0 + Math.floor((x0 + x1 - 1) / 2), geo.y0 + Math.floor((y0 + y1 - 1) / 2), 1, 1).data;
      return [d[0], d[1], d[2]];
    },
    // The cell's device pixels on the canvas: [x0, x1) x [y0, y1).
    bounds(r, k) {
      const [x0, x1] = xBounds(k);
      const [y0, y1] = yBounds(r);
      return { x0: geo.x0 + x0, x1: geo.x0 + x1, y0: geo.y0 + y0, y1: geo.y0 + y1 };
    },
    view: () => [view.s0, view.s1],
    setView,
    select,
  };

  const initial = /^(\d+)-(\d+)$/.exec(state.get("steps") || "");
  if (initial) {
    view.s0 = Math.max(0, Math.min(S - 1, Number(initial[1]) - st.first));
    view.s1 = Math.max(view.s0 + 1, Math.min(S, Number(initial[2]) - st.first + 1));
  }
  element.append(findings(doc, selectStep, bus));
  draw();
  element.selectStep = selectStep;
  if (window.ResizeObserver) {
    let lastW = wrap.clientWidth;
    new ResizeObserver(() => {
      if (wrap.clientWidth !== lastW && wrap.clientWidth > 0) {
        lastW = wrap.clientWidth;
        draw();
      }
    }).observe(wrap);
  }
  element.redraw = draw;
}

// [a, b) -> its middle half, at least one pixel.
function middleHalf(a, b) {
  const len = Math.max(1, b - a);
  const side = Math.max(1, Math.round(len / 2));
  const lo = a + Math.floor((len - side) / 2);
  return [lo, lo + side];
}

// The phases in which a rank stayed slowest, in words, and the worst steps; each a link to its
// cell (and the timeline).
function findings(doc, selectStep, bus) {
  const st = doc.steps;
  const box = el("div", { className: "findings" });
  const said = doc.causes || [];
  if (said.length) {
    box.append(
      el("div", {},
        el("h3", { text: "Causes" }),
        el("ul", { "data-testid": "causes" }, said.slice(0, 8).map((c) => el("li", { "data-testid": "cause", text: c }))),
        said.length > 8 ? el("p", { className: "more", text: `${said.length - 8} more in gputrace summary --json (steps.causes)` }) : null,
      ),
    );
  }
  const phases = doc.phases || [];
  if (phases.length) {
    box.append(
      el("div", {},
        el("h3", { text: "Phases" }),
        el("ul", { "data-testid": "phases" },
          phases.map((p) =>
            el("li", {},
              el("button", {
                type: "button",
                className: "link",
                "data-testid": "phase",
                text: p.words,
                title: "show the phase's first step of this rank",
                onclick: () => selectStep(p.rank, st.first + p.runs[0][0]),
              }),
            ),
          ),
        ),
      ),
    );
  }
  const worst = doc.worst || [];
  if (worst.length) {
    box.append(
      el("div", {},
        el("h3", { text: `Worst steps${worst.length > 1 ? ` (the ${worst.length} largest margins)` : ""}` }),
        el("ol", { "data-testid": "worst-steps" },
          worst.map((w) =>
            el("li", {},
              el("button", {
                type: "button",
                className: "link",
                "data-testid": "worst-step",
                "data-step": w.step,
                "data-rank": w.rank,
                text: `step ${w.step}: rank ${w.rank}, ${fmtSigned(w.busy_ns - w.ref_ns)} (${fmtPct(w.ref_pct)}) busier than ${doc.ranks.length === 2 ? "the other rank" : "the other ranks' median"}, ${fmtNs(w.ref_ns)}`,
                onclick: () => selectStep(w.rank, w.step),
              }),
            ),
          ),
        ),
      ),
    );
  }
  return box;
}

function niceStep(x) {
  const p = Math.pow(10, Math.floor(Math.log10(Math.max(1, x))));
  for (const m of [1, 2, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

// The trend's parts, bottom up, and their colours.
const TREND_PARTS = [
  ["work", "#8c9bb5"],
  ["idle", "#d4d4d4"],
  ["transfer", "#4e9a5b"],
  ["wait", "#e8833a"],
];
const TREND_WORDS = { work: "work inside spans", idle: "idle outside any span", transfer: "collective transfer", wait: "waiting for the last rank" };

function trendLegend() {
  return el(
    "div",
    { className: "legend-box", "data-testid": "trend-legend" },
    el("span", { text: "Step time, mean over ranks:" }),
    TREND_PARTS.map(([part, colour]) => {
      const sw = el("span", { className: "swatch" });
      sw.style.background = colour;
      return el("span", { className: "legend-item" }, sw, ` ${TREND_WORDS[part]}`);
    }),
  );
}

function legend() {
  const w = 160;
  const c = el("canvas", { className: "legend", width: w, height: 10 });
  const ctx = c.getContext("2d");
  for (let i = 0; i < w; i++) {
    const [r, g, b] = colour(1 - SATURATE + (2 * SATURATE * i) / (w - 1));
    ctx.fillStyle = `rgb(${r},${g},${b})`;
    ctx.fillRect(i, 0, 1, 10);
  }
  const mark = el("span", { className: "swatch mark" });
  return el(
    "div",
    { className: "legend-box" },
    el("span", { text: `busy −${SATURATE * 100}%` }),
    c,
    el("span", { text: `+${SATURATE * 100}% vs the other ranks' median in the step` }),
    mark,
    el("span", { text: "called slowest (beyond the noise)" }),
  );
}
