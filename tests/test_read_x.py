"""The Chrome JSON reader's C loop over plain X events (csrc/readx.c) against its Python twin (the
loop in `chrome._Builder.add`): random traces of every kind of event, read whole and for named
arguments alone, give the same trace in both builds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputrace import native
from gputrace.trace import chrome
from gputrace.trace.model import Trace

from .conftest import TWINS


def random_events(rng: random.Random, n: int) -> list[Any]:
    """Mostly plain X events on a few threads and names; among them, anything a file may hold:
    new threads and names, float times (halfway cases of the ns rounding too), times that are
    not numbers or past 64 bits, flows and launch arrows, B/E pairs, metadata, counters, other
    phases, pids that cannot be keys, arguments of every shape, categories."""
    out: list[Any] = []
    names = ["step", "fwd", "all_reduce", "h2d", "ü name"]
    for k in range(n):
        roll = rng.random()
        pid = rng.choice([1, 1, 1, 2, "p", None]) if rng.random() < 0.97 else [1]
        tid = rng.choice([7, 7, 13, 0, "t"])
        if roll < 0.8:
            e: dict[str, Any] = {"ph": "X", "pid": pid, "tid": tid, "name": rng.choice(names)}
            e["ts"] = rng.choice(
                [
                    k * 10,
                    k * 10 + 0.5,
                    k * 10 + 0.0625,
                    k * 10 + 0.1875,
                    k * 10 + 0.0005,
                    k * 10 + 0.123456789,
                    1.5e20,
                    True,
                    "1",
                    None,
                ]
                if rng.random() < 0.2
                else [k * 10, k * 10 + 0.25]
            )
            if rng.random() < 0.9:
                e["dur"] = rng.choice([3, 2.0005, 0, 1e18, -1, None] if rng.random() < 0.2 else [3, 7])
            if rng.random() < 0.1:
                e["name"] = rng.choice([f"new {k}", 5, None, ""])
            elif rng.random() < 0.05:
                del e["name"]
            a = rng.random()
            if a < 0.3:
                e["args"] = {"collective": rng.random() < 0.5, "bytes": k}
            elif a < 0.4:
                e["args"] = rng.choice([{}, [], None, "x", {"unfinished": True}, {"bytes": 1}])
            c = rng.random()
            if c < 0.5:
                e["cat"] = rng.choice(["cuda", "cpu", "gpu_op", 3, None, "launch"])
            if rng.random() < 0.03:
                e["bind_id"] = k
                e["cat"] = rng.choice(["launch", "cuda"])
            out.append(e)
        elif roll < 0.85:
            ts = k * 10
            out.append({"ph": "B", "pid": pid, "tid": tid, "name": "outer", "ts": ts, "args": {"collective": True}})
            out.append({"ph": "E", "pid": pid, "tid": tid, "ts": ts + 5})
        elif roll < 0.9:
            out.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": f"thread {tid}"}})
        elif roll < 0.93:
            out.append({"ph": "C", "pid": 1, "name": "mem", "ts": k * 10, "args": {"used": k}})
        elif roll < 0.96:
            out.append({"ph": "i", "pid": 1, "tid": tid, "name": "mark", "ts": k * 10})
        else:
            out.append(rng.choice([[], "x", {"ph": "X"}, {"ph": 5, "ts": 1}]))
    return out


def _state(t: Trace) -> Any:
    sp = t.spans
    return (
        list(sp.name),
        list(sp.track),
        list(sp.start),
        list(sp.end),
        list(sp.args),
        list(sp.cat),
        t.names,
        [(tr.name, tr.tid, tr.kind, tr.process) for tr in t.tracks],
        [(p.pid, p.label) for p in t.processes],
        t.extra,
        (list(t.counters.track), list(t.counters.ts), list(t.counters.value)),
        t.metadata,
    )


@pytest.mark.parametrize("seed", range(12))
def test_a_trace_read_by_the_c_loop_is_the_python_loops(seed: int, tmp_path: Path, twins_restored: None) -> None:
    if native.hot is None and native.UNUSED_BECAUSE:
        native.use(True)  # ImportError where no build loads: the twin test cannot run
    rng = random.Random(seed)
    events = random_events(rng, rng.choice([20, 300, 30_000]))
    path = tmp_path / "trace_rank0.json"
    doc = {"traceEvents": events, "baseTimeNanoseconds": rng.choice([0, 1_700_000_000_000_000_000])}
    path.write_bytes(orjson.dumps(doc))
    got = {}
    for c in (True, False):
        native.use(c)
        assert (chrome._read_x_rows is not None) == c
        got[c] = (
            _state(chrome.read(str(path))),
            _state(chrome.read_spans(str(path), None, ("collective", "unfinished"))),
        )
    assert got[True] == got[False]


@pytest.mark.parametrize("c", TWINS)
def test_the_reader_in_either_build_reads_a_written_trace_back(c: bool, tmp_path: Path, twins_restored: None) -> None:
    """A trace the writer wrote, read back: the same spans (the readers' round trip, in both
    builds)."""
    from gputrace.trace.model import Process, Track

    native.use(c)
    t = Trace({"rank": 0, "world_size": 1, "run_id": "x"})
    p = t.add_process(Process(1, 0, "rank 0", 0, {}))
    cuda = t.add_track(Track(p, 7, "cuda:0 stream 7", "cuda", 0, 7))
    for k in range(5_000):
        t.add_span(
            "step" if k % 2 else "all_reduce",
            cuda,
            10_000 * k,
            10_000 * k + 777,
            {"collective": True} if k % 2 == 0 else None,
        )
    path = tmp_path / "trace_rank0.json"
    chrome.write(t, str(path))
    back = chrome.read(str(path))
    assert list(back.spans.start) == list(t.spans.start) and list(back.spans.end) == list(t.spans.end)
    assert [back.names[i] for i in back.spans.name] == [t.names[i] for i in t.spans.name]
    assert back.spans.args == t.spans.args
