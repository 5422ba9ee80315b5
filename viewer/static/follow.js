// `gputrace view DIR --follow`: polls follow.json (what the ranks' streamed traces and open files
// say now) and redraws: the step count, each rank's state, the verdict of the open files, and a
// rank x step heatmap of busy time over the window of recent steps the server keeps. The server
// computes every number; this page only draws. Text goes in with textContent only.

import { fmtNs } from "./util.js";

const LABEL_W = 64; // px for the rank labels left of the cells
const ROW_H = 14;

function cell(tr, text) {
  const td = document.createElement("td");
  td.textContent = text;
  tr.append(td);
}

function set(testid, text) {
  document.querySelector(`[data-testid=${testid}]`).textContent = text;
}

// The colour of a busy time against its step's median rank: pale at the median, red at 2x.
function shade(v, med) {
  if (v === null || v === undefined) return [235, 237, 241];
  const r = med > 0 ? Math.min(Math.max(v / med - 1, 0), 1) : 0;
  return [255, Math.round(236 - 190 * r), Math.round(222 - 190 * r)];
}

function median(values) {
  const v = values.filter((x) => x !== null && x !== undefined).sort((a, b) => a - b);
  if (!v.length) return null;
  const n = v.length;
  return n % 2 ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

function drawMap(doc) {
  const canvas = document.querySelector("[data-testid=follow-heatmap]");
  const ranks = doc.ranks;
  const width = doc.count - doc.first;
  const avail = Math.max(200, Math.min(window.innerWidth - 40, 1600) - LABEL_W);
  const cols = Math.max(1, Math.min(width, avail));
  const per = width > 0 ? width / cols : 1; // steps per column: a column shows the worst of its steps
  const cw = Math.max(1, Math.floor(avail / cols));
  canvas.width = LABEL_W + cols * cw;
  canvas.height = Math.max(ROW_H, ranks.length * ROW_H);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  const meds = [];
  for (let k = 0; k < width; k++) meds.push(median(ranks.map((r) => doc.busy[r][k])));
  const hung = new Set(doc.hung);
  ranks.forEach((r, i) => {
    ctx.fillStyle = hung.has(r) ? "#b42318" : "#1d2330";
    ctx.font = `${hung.has(r) ? "bold " : ""}11px system-ui, sans-serif`;
    ctx.fillText(`rank ${r}`, 2, i * ROW_H + ROW_H - 3);
    for (let c = 0; c < cols; c++) {
      let worst = null;
      let marked = false;
      for (let k = Math.floor(c * per); k < Math.max(Math.floor((c + 1) * per), Math.floor(c * per) + 1) && k < width; k++) {
        const v = doc.busy[r][k];
        if (v !== null && meds[k]) worst = worst === null ? v / meds[k] : Math.max(worst, v / meds[k]);
        if (doc.slowest[k] === r) marked = true;
      }
      const [R, G, B] = marked ? [0, 0, 0] : shade(worst === null ? null : worst, 1);
      ctx.fillStyle = `rgb(${R},${G},${B})`;
      ctx.fillRect(LABEL_W + c * cw, i * ROW_H + 1, cw, ROW_H - 2);
    }
  });
  canvas.dataset.ranks = String(ranks.length);
  canvas.dataset.steps = String(doc.count);
  canvas.dataset.first = String(doc.first);
  canvas.dataset.hung = doc.hung.join(",");
}

function drawRows(doc) {
  const body = document.querySelector("[data-testid=follow-rank-rows]");
  const rows = [];
  const hung = new Set(doc.hung);
  for (const r of doc.ranks) {
    const st = doc.state[r];
    const busy = doc.busy[r];
    const len = doc.step_ns[r];
    let last = busy.length - 1;
    while (last >= 0 && busy[last] === null) last--;
    const tr = document.createElement("tr");
    tr.setAttribute("data-testid", "follow-rank-row");
    tr.dataset.rank = String(r);
    if (hung.has(r)) tr.className = "hung";
    else if (st.stopped) tr.className = "stopped";
    cell(tr, `rank ${r}`);
    cell(tr, String(st.steps));
    cell(tr, last >= 0 ? fmtNs(busy[last]) : "–");
    cell(tr, last >= 0 ? fmtNs(len[last]) : "–");
    cell(tr, st.finished ? "finished" : st.stopped ? `stopped: nothing new for ${Math.round(st.idle_s)} s` : "running");
    const open = doc.open[String(r)];
    cell(tr, open ? (open.stack.length ? open.stack.join(" > ") : "–") + (hung.has(r) ? " (the others wait for it)" : "") : "");
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function status(doc) {
  const st = Object.values(doc.state);
  if (!st.length) return "no trace_rank*.json in the folder yet";
  if (st.every((s) => s.finished)) return "the run has finished";
  const stopped = doc.ranks.filter((r) => doc.state[r].stopped);
  if (stopped.length === doc.ranks.length) {
    const idle = Math.min(...st.map((s) => s.idle_s));
    return `stopped: no rank has written anything for ${Math.round(idle)} s (hung, or killed)`;
  }
  if (stopped.length) return `running; ranks ${stopped.join(", ")} have written nothing for ${doc.stale_s} s or more`;
  return "running";
}

function render(doc) {
  set("follow-title", doc.directory);
  set("follow-steps", String(doc.count));
  set("follow-step-name", doc.step_name);
  set("follow-ranks", String(doc.ranks.length));
  set("follow-status", status(doc));
  const verdict = document.querySelector("[data-testid=follow-verdict]");
  verdict.replaceChildren(...doc.verdict.map((line) => {
    const li = document.createElement("li");
    li.textContent = line;
    return li;
  }));
  drawMap(doc);
  drawRows(doc);
  document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
}

async function poll() {
  let wait = 1000;
  try {
    const res = await fetch("follow.json", { cache: "no-store" });
    if (!res.ok) throw new Error(`follow.json: ${res.status}`);
    const doc = await res.json();
    wait = doc.poll_ms || wait;
    render(doc);
  } catch (e) {
    set("follow-status", `the server does not answer (${e.message}); trying again`);
  }
  setTimeout(poll, wait);
}

poll();
