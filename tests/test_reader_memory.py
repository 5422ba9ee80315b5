"""The readers build columns as they read: reading a trace, or validating one, holds memory in
proportion to its events and within a bound of its size, not an object per event of the whole
file. Each read runs in a fresh process, whose peak resident memory (VmHWM, reset after the
imports) is what is measured; the same reads give the same trace as a whole-file parse."""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from gputrace.trace import chrome, perfetto
from gputrace.trace.model import Process, Trace, Track

EVENTS = 200_000
BASE = 1_700_000_000_000_000_000
#: What a reader may hold above what it held after its imports: 100 bytes an event or 1.5 times
#: the file's size, whichever is larger, and what one batch costs whatever the file's size (its
#: bytes, the events or protobuf messages parsed from them, the allocator's slack after them).
PER_EVENT = 100
PER_SIZE = 1.5
BATCH = 32 << 20

# What each child that measures its peak is run after: `status` reads /proc/self/status in bytes;
# `peak_from_here` gives the resident size now and starts the kernel's peak (VmHWM) again from it.
PEAK = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def peak_from_here():
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before
"""

CHILD = r"""
from gputrace import merge
from gputrace.trace import chrome, perfetto
from gputrace.validate import validate_file
op, path = sys.argv[1], sys.argv[2]
def merged(path):
    out = path + ".merged" + path[path.rindex("."):]
    merge.merge([path], out, workers=1)
    return out
read = {"chrome": chrome.read, "perfetto": perfetto.read, "validate": validate_file, "merge": merged}[op]
before = peak_from_here()
out = read(path)
peak = status("VmHWM:") - before
n = len(out.spans) if op in ("chrome", "perfetto") else out.spans if op == "validate" else len(chrome.read(out).spans)
print(json.dumps({"peak": peak, "n": n}))
"""


def big_trace(n: int) -> Trace:
    """One rank of `n` spans on four streams and a host thread, an argument on one in ten."""
    meta = {"gputrace_version": "test", "rank": 0, "world_size": 1, "run_id": "memory"}
    t = Trace(dict(meta))
    p = t.add_process(Process(1, 0, "rank 0", 0, meta))
    tracks = [t.add_track(Track(p, i + 1, f"cuda:0 stream {i}", "cuda", 0, i)) for i in range(4)]
    names = [t.intern(f"kernel_{k}") for k in range(37)]
    start = array("q", (BASE + k * 1_000 + (k * 7919) % 333 for k in range(n)))
    t.spans.extend(
        array("l", (names[k % 37] for k in range(n))),
        array("l", (tracks[k % 4] for k in range(n))),
        start,
        array("q", (s + 400 + k % 97 for k, s in enumerate(start))),
        [{"bytes": k} if k % 10 == 0 else None for k in range(n)],
    )
    return t


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("memory")
    t = big_trace(EVENTS)
    out = {"chrome": d / "big.json", "perfetto": d / "big.pftrace"}
    chrome.write(t, str(out["chrome"]))
    perfetto.write(t, str(out["perfetto"]))
    return out


def peak(op: str, path: Path) -> tuple[int, int]:
    r = subprocess.run([sys.executable, "-c", PEAK + CHILD, op, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    return got["peak"], got["n"]


@pytest.mark.parametrize(
    "op, fmt",
    [
        ("chrome", "chrome"),
        ("validate", "chrome"),
        ("perfetto", "perfetto"),
        ("validate", "perfetto"),
    ],
)
def test_a_read_holds_columns_not_the_file_parsed(files: dict[str, Path], op: str, fmt: str) -> None:
    path = files[fmt]
    size = path.stat().st_size
    held, n = peak(op, path)
    assert n == EVENTS
    bound = max(PER_SIZE * size, PER_EVENT * EVENTS) + BATCH
    # A whole-file parse holds ~1 KB an event (200 MB here): this fails by far if one comes back.
    assert held <= bound, (
        f"{op} of {size / 1e6:.1f} MB ({EVENTS:,} events) held {held / 1e6:.1f} MB > {bound / 1e6:.1f} MB"
    )


def test_a_merge_holds_about_one_ranks_columns(tmp_path: Path) -> None:
    """Merging a rank holds its columns and one piece of its encoded lines, not a copy of the
    columns and the whole output (3.4 times the file before). A larger rank than above, so the
    piece (a fixed cost) does not hide what grows with the events."""
    events = 3 * EVENTS
    path = tmp_path / "big.json"
    chrome.write(big_trace(events), str(path))
    size = path.stat().st_size
    held, n = peak("merge", path)
    assert n == events
    bound = max(PER_SIZE * size, PER_EVENT * events) + BATCH
    assert held <= bound, (
        f"merge of {size / 1e6:.1f} MB ({events:,} events) held {held / 1e6:.1f} MB > {bound / 1e6:.1f} MB"
    )


def test_batches_read_what_the_whole_file_gives(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Small batches and header, so every cut between events is taken somewhere.
    monkeypatch.setattr(chrome, "BATCH_BYTES", 4096)
    monkeypatch.setattr(chrome, "HEADER_BYTES", 512)
    path = str(files["chrome"])
    data = Path(path).read_bytes()
    batched = chrome.read(path)
    whole = chrome._build(path, *chrome.parse(path, data))
    for col in ("name", "track", "start", "end", "args", "cat"):
        assert list(getattr(batched.spans, col)) == list(getattr(whole.spans, col)), col
    assert batched.names == whole.names and batched.tracks == whole.tracks
    assert batched.processes == whole.processes and batched.metadata == whole.metadata
    monkeypatch.setattr(perfetto, "INFLATED_BATCH_BYTES", 4096)
    p = perfetto.read(str(files["perfetto"]))

    def rows(t: Trace) -> list[tuple[str, int, int, object]]:
        sp = t.spans
        return sorted(
            zip([t.names[i] for i in sp.name], sp.start, sp.end, map(repr, sp.args)), key=lambda r: (r[1], r[2], r[0])
        )

    assert rows(p) == rows(whole)


STATS_CHILD = r"""
from gputrace import heap, summary
from gputrace.trace import chrome, perfetto  # the readers' imports before the measure
from gputrace.viewer import data
op, path = sys.argv[1], sys.argv[2]
heap.map_large_blocks()  # as the commands (gputrace summary, gputrace view) set it
before = peak_from_here()
if op == "summary":
    steps = summary.summary_of_files([path]).steps.count
else:  # what `gputrace view` computes its page from
    st = data.document(summary.load_for_statistics([path]))["steps"]
    steps = st["count"] + st["skipped"]
print(json.dumps({"peak": status("VmHWM:") - before, "steps": steps}))
"""


def stepped_trace(n: int) -> Trace:
    """`big_trace` with a step span on the host every 100 spans (the statistics' whole work:
    steps, their breakdown, the spans' cover)."""
    t = big_trace(n)
    host = t.add_track(Track(0, 9, "thread MainThread (host)", "cpu", None, 9))
    step = t.intern("step")
    k = array("q", range(0, n, 100))
    t.spans.extend(
        array("l", [step] * len(k)),
        array("l", [host] * len(k)),
        array("q", (BASE + i * 1_000 for i in k)),
        array("q", (BASE + i * 1_000 + 99_000 for i in k)),
        [{"step": j} for j in range(len(k))],
    )
    return t


@pytest.mark.parametrize("fmt", ["chrome", "perfetto"])
@pytest.mark.parametrize("op", ["summary", "view"])
def test_summary_and_the_views_page_hold_columns_not_argument_dicts(tmp_path: Path, op: str, fmt: str) -> None:
    """`summary` and the page of `gputrace view` read a trace for the statistics alone (a span's
    `collective`, `unfinished` and `cover` arguments, no categories) and hold within 100 bytes an
    event above their imports and one batch, where reading every argument and the statistics'
    index columns held ~145."""
    events = 3 * EVENTS
    path = tmp_path / ("big.json" if fmt == "chrome" else "big.pftrace")
    (chrome if fmt == "chrome" else perfetto).write(stepped_trace(events), str(path))
    r = subprocess.run(
        [sys.executable, "-c", PEAK + STATS_CHILD, op, str(path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["steps"] == events // 100
    bound = PER_EVENT * events + BATCH // 2
    assert got["peak"] <= bound, (
        f"{op} of {path.stat().st_size / 1e6:.1f} MB ({events:,} events) held {got['peak'] / 1e6:.1f} MB "
        f"> {bound / 1e6:.1f} MB"
    )


WHOLE_CHILD = r"""
from gputrace import heap, merge
from gputrace.trace import perfetto
from gputrace.viewer import data
op, path = sys.argv[1], sys.argv[2]
heap.map_large_blocks()  # as the commands (gputrace merge, gputrace view) set it
before = peak_from_here()
if op == "timeline":  # what the view's timeline reads: the whole trace, every argument
    t = data.load([path])
else:
    out = path + ".merged.pftrace"
    merge.merge([path], out, workers=1)
peak = status("VmHWM:") - before
if op != "timeline":
    t = perfetto.read(out)
print(json.dumps({"peak": peak, "n": len(t.spans), "args": sum(a is not None for a in t.spans.args)}))
"""


@pytest.mark.parametrize("op", ["timeline", "merge"])
def test_a_whole_protobuf_read_holds_no_dict_a_span(tmp_path: Path, op: str) -> None:
    """Merge and the view's timeline read a protobuf trace whole, every argument and category:
    within 80 bytes an event above the imports and half a batch, where a dict of arguments a
    span that has them and a pointer a span for the arguments and for the categories held ~100
    (a larger trace than above, so what grows with the events is not hidden by what does not)."""
    events = 5 * EVENTS
    path = tmp_path / "big.pftrace"
    trace = stepped_trace(events)
    perfetto.write(trace, str(path))
    r = subprocess.run(
        [sys.executable, "-c", PEAK + WHOLE_CHILD, op, str(path)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["n"] == len(trace.spans) and got["args"] == sum(a is not None for a in trace.spans.args)
    bound = 80 * events + BATCH // 2
    assert got["peak"] <= bound, (
        f"{op} of {path.stat().st_size / 1e6:.1f} MB ({events:,} events) held {got['peak'] / 1e6:.1f} MB "
        f"> {bound / 1e6:.1f} MB"
    )
