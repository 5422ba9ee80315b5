// The view's state in the page's URL (after the #), so a link restores what was on screen: the
// tab, the selection (a heatmap cell, a collective, a span name) and the heatmap's range of steps.
// Keys: tab=heatmap|collectives|breakdown|stats; sel=cell:RANK:STEP | coll:INDEX | name:SCOPE:NAME
// (the statistics) | bd:RANK:NAME (the breakdown matrix);
// steps=FIRST-LAST (step numbers). Written with replaceState: the back button leaves the page.

export function read() {
  try {
    return new URLSearchParams(location.hash.slice(1));
  } catch (e) {
    return new URLSearchParams();
  }
}

export function get(key) {
  return read().get(key);
}

// Sets (or, for null, removes) keys and rewrites the URL's fragment.
export function write(patch) {
  const p = read();
  for (const [k, v] of Object.entries(patch)) {
    if (v === null || v === undefined) p.delete(k);
    else p.set(k, String(v));
  }
  const hash = p.toString();
  try {
    history.replaceState(history.state, "", hash ? `#${hash}` : location.pathname + location.search);
  } catch (e) {
    // A page whose URL cannot change (an opaque origin): the view still works, unlinked.
  }
}
