"""How `gputrace view` scales: a run of many ranks and steps, opened in headless Chromium.

    python benchmarks/viewer_scale.py [--ranks 64] [--steps 10000] [--dir DIR]

Writes `--ranks` per-rank files of `--steps` steps (step, compute, an all_reduce marked
collective=True, and a small copy: 4 spans a step) with the Chrome writer, one rank slow in every
7th step; files in `--dir` from an earlier run of the same size are reused. Then, in one run, it
times what `gputrace view` does before it serves (load and align the files, compute the
document with the statistics, encode it) and what the browser does after (the page until its
heatmap and table are interactive, a hover, a sort, the timeline's first window and a click's
window from the server), and prints a table. Target: the page interactive within 5 s.

First, `gputrace view` itself in a fresh process, as a user runs it: the seconds from the command
to its printed URL (with the CPU seconds the command and, from traces alone, its digests'
workers had used by then), to the page's first view in Chromium (the heatmap, from the first document)
and to the full document drawn in it (breakdown, collectives, statistics, causes), from the
digests beside the traces (the first view after the run, and again: the document is kept beside
the digests) and from the traces alone (a folder of hard links to them: the first view makes each
rank's digest beside its trace, in worker processes; then again). Targets: the URL within 2 s
from digests, 10 s from traces. `--root DIR` times another checkout's command (a `git archive
main` copy: before and after), `--repeat N` runs the table N times. `--cli-only` stops there.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import orjson  # noqa: E402

from gputrace import digest  # noqa: E402
from gputrace.trace import chrome, digestfile  # noqa: E402
from gputrace.trace.model import Process, Trace, Track  # noqa: E402
from gputrace.version import __version__  # noqa: E402
from gputrace.viewer import data, server  # noqa: E402

BASE = 1_700_000_000_000_000_000
CHROMIUM = "/usr/bin/chromium"


def write_rank(directory: str, rank: int, ranks: int, steps: int) -> str:
    meta = {"gputrace_version": __version__, "rank": rank, "world_size": ranks, "run_id": "viewer-bench"}
    trace = Trace(dict(meta))
    p = trace.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    compute = trace.add_track(Track(p, 1, "cuda:0 stream 7", "cuda", 0, 7))
    comm = trace.add_track(Track(p, 2, "cuda:0 stream 13", "cuda", 0, 13))
    coll = {"collective": True}
    t = BASE
    for k in range(steps):
        rng = random.Random(k)  # the same draws on every rank: the last arrival agrees
        work = [1_000_000 + rng.randrange(-10_000, 10_000) for _ in range(ranks)]
        if k % 7 == 3:
            work[ranks // 2] += 300_000
        end = t + max(work) + 100_000
        trace.add_span("step", compute, t, end)
        trace.add_span("h2d copy", compute, t, t + 20_000)
        trace.add_span("compute", compute, t + 20_000, t + work[rank])
        trace.add_span("all_reduce", comm, t + work[rank], end, coll)
        t = end + 10_000
    path = os.path.join(directory, f"trace_rank{rank}.json")
    chrome.write(trace, path)
    # Beside it, its step digest, as the recorder writes it (the page is drawn from these).
    digestfile.write(digest.from_trace(trace, "step", path), digestfile.digest_path(path))
    return path


def inputs(directory: str, ranks: int, steps: int) -> list[str]:
    stamp = os.path.join(directory, f"viewer-bench-{ranks}x{steps}-digests")
    paths = [os.path.join(directory, f"trace_rank{r}.json") for r in range(ranks)]
    if os.path.exists(stamp) and all(os.path.exists(p) for p in paths):
        return paths
    with ProcessPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(write_rank, [directory] * ranks, range(ranks), [ranks] * ranks, [steps] * ranks))
    open(stamp, "w").close()
    return paths


def traces_only(directory: str, ranks: int) -> str:
    """A folder beside `directory` with its trace files (hard links) and no digests."""
    bare = directory.rstrip("/") + "-traces-only"
    os.makedirs(bare, exist_ok=True)
    for r in range(ranks):
        src, dst = os.path.join(directory, f"trace_rank{r}.json"), os.path.join(bare, f"trace_rank{r}.json")
        if not os.path.exists(dst):
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
    return bare


def _cpu_s(pid: int, children: bool = False) -> float:
    """The CPU seconds (user + system) the process has used so far, its own (not its workers');
    `children`: those of its workers that have ended (the digests' workers, by the URL)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    at = 13 if children else 11
    return (int(fields[at]) + int(fields[at + 1])) / os.sysconf("SC_CLK_TCK")


def cli_view(page, folder: str, ui: str, root: str = ROOT) -> tuple[float, float, float, float, float]:  # type: ignore[no-untyped-def]
    """`gputrace view FOLDER` as a user runs it (the checkout at `root`), in a fresh process:
    seconds from the command to its printed URL (and the CPU seconds the command had used by then,
    its own), to the page's first view (the heatmap interactive) in Chromium, and to the full
    document drawn (breakdown, collectives, statistics, causes: at once where the first document
    is the full one); last, the CPU seconds of its workers that had ended by the URL (those that
    made digests)."""
    cmd = [sys.executable, "-m", "gputrace", "view", folder, "--no-browser", "--perfetto-ui", ui]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if m:
                break
        else:
            raise SystemExit(f"gputrace view {folder} printed no URL (exit {proc.wait()})")
        t_url = time.perf_counter() - t0
        cpu, workers = _cpu_s(proc.pid), _cpu_s(proc.pid, children=True)
        page.goto(m.group(1))
        page.wait_for_selector("body[data-ready='1']", timeout=300_000)
        t_first = time.perf_counter() - t0
        if page.get_attribute("body", "data-full") not in (None, "1"):
            page.wait_for_selector("body[data-full='1'], body[data-full='error']", timeout=600_000)
        return t_url, t_first, time.perf_counter() - t0, cpu, workers
    finally:
        proc.terminate()
        proc.wait()


def cli_table(directory: str, ranks: int, steps: int, root: str = ROOT, repeat: int = 1) -> None:
    """The command's own times: from the digests (first view after the run, and again with the
    document kept beside them), and from the traces alone."""
    from playwright.sync_api import sync_playwright

    ui = tempfile.mkdtemp()
    with open(os.path.join(ui, "index.html"), "w") as f:
        f.write("<!doctype html><title>no timeline</title>")
    if os.path.realpath(root) != os.path.realpath(ROOT):
        # An editable install maps gputrace.viewer to its own checkout's viewer/: a copy made with
        # `git archive` needs gputrace/viewer -> ../viewer to run its own.
        where = subprocess.run(
            [sys.executable, "-c", "import gputrace.viewer as v; print(v.__file__)"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if not os.path.realpath(where).startswith(os.path.realpath(root) + os.sep):
            raise SystemExit(f"{root}: its gputrace.viewer is {where}; link it: ln -s ../viewer {root}/gputrace/viewer")
    bare = traces_only(directory, ranks)
    rows = []
    load = [os.getloadavg()[0]]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for _ in range(repeat):
            for old in os.listdir(directory):  # the first view after the run: no document kept yet
                if old.startswith(".gputrace-view-"):
                    os.unlink(os.path.join(directory, old))
            for old in os.listdir(bare):  # traces alone: the digests and document an earlier view made go
                if old.startswith((".gputrace-view-", "digest_rank")):
                    os.unlink(os.path.join(bare, old))
            runs = [("digests, first view", directory), ("digests, again", directory)]
            runs += [("traces alone (their digests made)", bare), ("traces alone, again", bare)]
            for what, folder in runs:
                rows.append((what, *cli_view(page, folder, ui, root)))
                load.append(os.getloadavg()[0])
        browser.close()
    print(
        f"gputrace view (the command, a fresh process, {root}), {ranks} ranks x {steps:,} steps, {os.cpu_count()} cores"
    )
    head = f"{'from':<34} {'to the URL':>10} {'(its CPU)':>10} {'(workers)':>10} {'to the heatmap':>15}"
    print(f"{head} {'to the full document':>21}")
    for what, t_url, t_page, t_full, cpu, workers in rows:
        print(f"{what:<34} {t_url:>9.2f}s {cpu:>9.2f}s {workers:>9.2f}s {t_page:>14.2f}s {t_full:>20.2f}s")
    print(f"load average {min(load):.1f}-{max(load):.1f}")


def timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--cli-only", action="store_true", help="only the command's own times (no stage table)")
    ap.add_argument("--root", default=ROOT, help="the checkout whose `gputrace view` is timed (before/after)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the command's table")
    args = ap.parse_args()
    directory = args.dir or os.path.join(tempfile.gettempdir(), "gputrace-viewer-bench")
    os.makedirs(directory, exist_ok=True)
    paths = inputs(directory, args.ranks, args.steps)
    cli_table(directory, args.ranks, args.steps, os.path.abspath(args.root), args.repeat)
    if args.cli_only:
        return
    print()

    rows: list[tuple[str, float, str]] = []
    trace, t_load = timed(lambda: data.load(paths))
    rows.append(("load and align the files (merge.load)", t_load, f"{len(trace.spans):,} spans"))
    doc, t_doc = timed(lambda: data.document(trace, inputs=[directory]))
    rows.append(("the document (stats.summarize + columns)", t_doc, ""))
    blank = tempfile.mkdtemp()
    with open(os.path.join(blank, "index.html"), "w") as f:
        f.write("<!doctype html><title>no timeline</title>")
    viewer, t_enc = timed(lambda: server.Viewer(trace, doc, server.resolve_ui(blank), name="bench"))
    rows.append(("encode the document (JSON)", t_enc, f"{len(viewer.document) / 1e6:.1f} MB"))
    httpd = viewer.serve(0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    lo, hi = doc["timeline"]["initial"] or (0, doc["duration_ns"])
    body, t_first = timed(lambda: urllib.request.urlopen(f"{url}trace.json?start={lo}&end={hi}").read())
    rows.append(("the timeline's first window (server)", t_first, f"{len(body) / 1e6:.2f} MB"))
    mid = doc["steps"]["start"][args.ranks // 2][args.steps // 2]
    click = f"{url}trace.json?start={mid - 2_000_000}&end={mid + 4_000_000}"
    body, t_win = timed(lambda: urllib.request.urlopen(click).read())
    rows.append(("a click's timeline window (server)", t_win, f"{len(body) / 1e6:.2f} MB"))

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"], headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        loads = []
        for _ in range(3):
            t0 = time.perf_counter()
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=120_000)
            loads.append(time.perf_counter() - t0)
        rows.append(("page: open until heatmap and table are interactive", statistics.median(loads), "median of 3"))
        box = page.locator("[data-testid=heatmap]").bounding_box()
        c = page.evaluate("() => document.querySelector('[data-testid=heatmap]').probe.centre(5, 3)")
        hovers = []
        for dx in (0, 3, 6, 9, 12):
            page.mouse.move(box["x"] + 200, box["y"] + 1)
            t0 = time.perf_counter()
            page.mouse.move(box["x"] + c["x"] + dx, box["y"] + c["y"])
            page.wait_for_selector("[data-testid=heatmap-tooltip]:not([hidden])")
            hovers.append(time.perf_counter() - t0)
        rows.append(("page: hover shows a cell's numbers", statistics.median(hovers), "median of 5"))
        t0 = time.perf_counter()
        page.mouse.move(box["x"] + c["x"], box["y"] + c["y"])
        page.mouse.wheel(0, -400)
        page.evaluate("() => new Promise(requestAnimationFrame)")
        rows.append(("page: zoom the heatmap (wheel)", time.perf_counter() - t0, ""))
        page.click("[data-testid=tab-stats]")
        t0 = time.perf_counter()
        page.click("[data-testid=stats-table] th[data-key='1'] button")
        page.evaluate("() => new Promise(requestAnimationFrame)")
        rows.append(("page: sort the stats table", time.perf_counter() - t0, ""))
        page.click("[data-testid=tab-collectives]")
        t0 = time.perf_counter()
        page.locator("[data-testid=collective-row]").nth(3).click()
        page.evaluate("() => new Promise(requestAnimationFrame)")
        rows.append(("page: a collective's arrival order", time.perf_counter() - t0, f"{args.ranks} ranks"))
        heap = page.evaluate("() => performance.memory ? performance.memory.usedJSHeapSize : 0")
        browser.close()
    httpd.shutdown()
    httpd.server_close()

    ready = statistics.median(loads)
    size = f"{args.ranks} ranks x {args.steps:,} steps ({len(trace.spans):,} spans)"
    print(f"gputrace view, {size}, {os.cpu_count()} cores")
    print(f"{'stage':<52} {'seconds':>8}  note")
    for name, secs, note in rows:
        print(f"{name:<52} {secs:>8.3f}  {note}")
    print(f"{'page: JS heap after the above':<52} {heap / 1e6:>7.0f}M")
    serve = t_load + t_doc + t_enc
    shares = f"{t_load / serve:.0%} load, {t_doc / serve:.0%} document, {t_enc / serve:.0%} encode"
    print(f"\nbefore serving: {serve:.1f} s ({shares})")
    print(f"page interactive: {ready:.2f} s = {ready / 5:.2f} of the 5 s target")
    assert orjson.loads(viewer.document)["steps"]["count"] == args.steps


if __name__ == "__main__":
    main()
