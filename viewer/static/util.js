// Small helpers shared by the views: building elements (text only, never markup), formatting
// durations the way `gputrace summary` does, and a sortable table.

// An element with attributes and children; strings become text nodes, so names from a trace can
// never become markup.
export function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else if (key === "className") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

// Durations as `gputrace summary` prints them (gputrace.stats.fmt_ns).
export function fmtNs(ns) {
  if (ns === null || ns === undefined || Number.isNaN(ns)) return "–";
  const sign = ns < 0 ? "-" : "";
  const a = Math.abs(ns);
  if (a >= 1e9) return `${sign}${(a / 1e9).toFixed(3)} s`;
  if (a >= 1e6) return `${sign}${(a / 1e6).toFixed(3)} ms`;
  if (a >= 1e3) return `${sign}${(a / 1e3).toFixed(1)} us`;
  return `${sign}${a.toFixed(0)} ns`;
}

export function fmtSigned(ns) {
  return (ns > 0 ? "+" : "") + fmtNs(ns);
}

export function fmtPct(p) {
  if (p === null || p === undefined) return "∞";
  return `${p > 0 ? "+" : ""}${p.toFixed(1)}%`;
}

export function fmtCount(n) {
  return Number(n).toLocaleString("en-US");
}

// A table whose columns sort on a click of their header. `columns`: [{key, label, num, fmt,
// title}]; `rows`: arrays or objects indexed by `key`. Only the first `limit` rows after sorting
// become DOM nodes; the caption says how many more there are.
export function sortableTable({ columns, rows, testid, rowTestid, limit = 500, sortKey, sortDesc = true, onRow, rowTitle, rowClass }) {
  const table = el("table", { "data-testid": testid, className: "grid" });
  const thead = el("thead");
  const tbody = el("tbody");
  const more = el("p", { className: "more", "data-testid": testid ? `${testid}-more` : undefined });
  let key = sortKey ?? columns[0].key;
  let desc = sortDesc;
  const head = el("tr");
  const ths = columns.map((c) => {
    const th = el("th", { scope: "col", title: c.title, className: c.num ? "num" : undefined, "data-key": String(c.key) });
    th.append(el("button", { type: "button", text: c.label, onclick: () => sortBy(c.key) }));
    head.append(th);
    return th;
  });
  thead.append(head);
  table.append(thead, tbody);

  function sortBy(k) {
    if (k === key) desc = !desc;
    else {
      key = k;
      desc = columns.find((c) => c.key === k).num !== false;
    }
    draw();
  }

  function value(row, c) {
    return c.value ? c.value(row) : row[c.key];
  }

  function draw() {
    const c = columns.find((x) => x.key === key);
    const order = rows.map((_, i) => i);
    order.sort((a, b) => {
      const va = value(rows[a], c);
      const vb = value(rows[b], c);
      let d;
      if (va === vb) d = 0;
      else if (va === null || va === undefined) d = 1;
      else if (vb === null || vb === undefined) d = -1;
      else if (typeof va === "string") d = va < vb ? -1 : 1;
      else d = va - vb;
      if (d === 0) return a - b;
      return desc ? -d : d;
    });
    ths.forEach((th, i) => th.setAttribute("aria-sort", columns[i].key === key ? (desc ? "descending" : "ascending") : "none"));
    const frag = document.createDocumentFragment();
    for (const i of order.slice(0, limit)) {
      const row = rows[i];
      const tr = el("tr", { "data-testid": rowTestid, title: rowTitle ? rowTitle(row) : undefined, className: rowClass ? rowClass(row) : undefined });
      if (onRow) {
        tr.tabIndex = 0;
        tr.classList.add("clickable");
        tr.addEventListener("click", () => onRow(row, tr));
        tr.addEventListener("keydown", (e) => {
          if (e.key === "Enter" || e.key === " ") {
            e.preventDefault();
            onRow(row, tr);
          }
        });
      }
      for (const col of columns) {
        const v = value(row, col);
        tr.append(el("td", { className: col.num ? "num" : undefined, text: col.fmt ? col.fmt(v, row) : v }));
      }
      frag.append(tr);
    }
    tbody.replaceChildren(frag);
    more.textContent = rows.length > limit ? `showing ${fmtCount(limit)} of ${fmtCount(rows.length)} rows (sort or filter to see others)` : "";
  }

  draw();
  const wrap = el("div", { className: "table-wrap" }, table, more);
  wrap.redraw = (newRows) => {
    rows = newRows;
    draw();
  };
  return wrap;
}

// Where a click in a view asks the timeline to go: a tiny event bus between the views.
export function makeBus() {
  const handlers = {};
  return {
    on(name, fn) {
      (handlers[name] ||= []).push(fn);
    },
    emit(name, value) {
      for (const fn of handlers[name] || []) fn(value);
    },
  };
}
