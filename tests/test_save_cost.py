"""A CUDA span's save, made cheaper without changing what it writes: the C encoder's chunks (the
save writes them as they come) join to the bytes it returns whole, and to the Python twin's; the
flow ids it counts in decimal cross a digit boundary as integers do; `entries_range`'s C loop
gives what its Python twin gives; and a fake-device run saved by `gputrace.save()` through the C
build holds exactly the spans and launch arrows that the Python encoder writes for it."""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest

import gputrace
from gputrace import native
from gputrace.trace import layout
from gputrace.trace.layout import LAUNCH_CAT, dumps

from .conftest import install
from .fakes import FakeDevice

needs_c = pytest.mark.skipif(native.hot is None, reason="the C build is not in use")


def columns(rng: random.Random, n: int) -> tuple[Any, ...]:
    """n spans of a few names on three tracks, their entries (0, a time, or now and then negative)
    and args (mostly none; some that orjson refuses and `dumps` cleans)."""
    names = array("l", (rng.randrange(4) for _ in range(n)))
    tracks = array("l", (rng.randrange(3) for _ in range(n)))
    starts = array("q", (1_000_000 + rng.randrange(10**9) for _ in range(n)))
    ends = array("q", (s + rng.randrange(10**6) for s in starts))
    entry = array("q", (rng.choice((0, s - rng.randrange(10**4), s + 5, -1)) for s in starts))
    args = [
        rng.choice((None, {}, {"i": 3}, {1: "non-str key"}, {"x": float("nan")})) if rng.random() < 0.1 else None
        for _ in range(n)
    ]
    return names, tracks, starts, ends, entry, args


@needs_c
@pytest.mark.parametrize("seed", range(3))
def test_the_encoders_chunks_join_to_its_whole_bytes(seed: int) -> None:
    rng = random.Random(seed)
    names, tracks, starts, ends, entry, args = columns(rng, 3000)
    name_json = [dumps(f"n{k}") for k in range(4)]
    cats = [b'"cuda"', b'"cpu"', b'"cuda"']

    def info(t: int) -> tuple[int, bytes]:
        return t + 3, cats[t]

    first = rng.choice((1, 9_995, (1 << 32) + 1, 10**12 - 7))  # flow ids that gain a digit on the way
    enc = (name_json, names, tracks, starts, ends, args, dumps, info, 1, 1_000_000, entry, 2, first)
    whole = native.hot.encode_rows(*enc)
    chunks: list[bytes] = []
    assert native.hot.encode_rows(*enc, chunks.append) is None
    assert len(chunks) > 3 and all(len(c) < (1 << 16) + 4096 for c in chunks)
    assert b"".join(chunks) == whole
    events = orjson.loads(b"[" + whole.rstrip(b",\n") + b"]")
    flows = [e["bind_id"] for e in events if e.get("flow_in")]
    assert flows == list(range(first, first + sum(1 for x in entry if x > 0)))


@pytest.mark.parametrize("seed", range(3))
def test_entries_range_c_and_python_agree(seed: int) -> None:
    rng = random.Random(seed)
    for n in (0, 1, 7, 5000):
        col = array("q", (rng.choice((0, 0, -rng.randrange(1, 10**6), rng.randrange(1, 10**18))) for _ in range(n)))
        py = layout._entries_range_py(col)
        assert py == (sum(1 for x in col if x > 0), min((x for x in col if x), default=0))
        if native.hot is not None:
            assert native.hot.entries_range(col) == py


def fake_run(steps: int = 40) -> None:
    """CUDA spans on a fake device: two streams, nested three deep, a flush a step; the steps
    with args."""
    fake = FakeDevice()
    install(fake)
    side = fake.new_stream()
    for k in range(steps):
        with gputrace.span("step", step=k):
            for j in range(3):
                with gputrace.span(f"layer{j}"):
                    with gputrace.span("aten::mm"):
                        fake.work(20_000)
                    fake.advance(2_000)
            with fake.stream(side), gputrace.span("nccl:all_reduce", collective=True):
                fake.work(50_000)
        fake.advance(400_000)
        gputrace.flush()


def spans_and_flows(path: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """A saved JSON trace's spans (name, track name, start, end, args) and its arrows (the span's
    name, track, start; the source's time and entry argument), ids left out."""
    doc = orjson.loads(path.read_bytes())
    events = doc["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    source = {e["bind_id"]: e for e in events if e.get("cat") == LAUNCH_CAT}
    spans, flows = [], []
    for e in events:
        if e["ph"] != "X" or e.get("cat") == LAUNCH_CAT:
            continue
        spans.append((e["name"], tracks[(e["pid"], e["tid"])], e["ts"], e["dur"], e.get("args")))
        if e.get("flow_in"):
            s = source.pop(e["bind_id"])
            assert s["name"] == e["name"] and s["dur"] == 0 and s["ts"] < e["ts"]
            flows.append((e["name"], tracks[(e["pid"], e["tid"])], e["ts"], s["ts"], s.get("args")))
    assert not source  # every source ends at its span
    return sorted(spans, key=repr), sorted(flows, key=repr)


def test_a_saved_fake_device_run_holds_what_the_python_encoder_writes(tmp_path: Path, twins_restored: None) -> None:
    saved = {}
    for c in (True, False) if native._build is not None else (False,):
        native.use(c)
        fake_run()
        saved[c] = tmp_path / f"trace_rank0_{c}.json"
        gputrace.save(saved[c])
        gputrace.reset()
    spans, flows = spans_and_flows(saved[False])
    assert len(spans) == 40 * 8 and len(flows) == 40 * 8  # every CUDA span drawn with its arrow
    assert sum(1 for s in spans if s[4]) == 80  # the steps' and the collectives' args
    if True in saved:  # the C build's save (chunks written as they come) against the Python loops'
        assert spans_and_flows(saved[True]) == (spans, flows)
        assert saved[True].read_bytes() == saved[False].read_bytes()


@pytest.mark.parametrize("c", [True, False])
def test_a_large_rank_written_through_the_writer_is_its_encoded_bytes(c: bool, tmp_path: Path) -> None:
    """Past the first MiB the save's chunks go to the writer thread as they are encoded: the file
    is the bytes `encode` gives whole, in both builds."""
    from gputrace.trace import chrome

    from .test_flows import cuda_rank

    if c and native._build is None:
        pytest.skip("no C build")
    trace = cuda_rank(steps=1200)  # ~2.8 MB with an arrow a CUDA span
    with native.using(c):
        chrome.write(trace, str(tmp_path / "t.json"), ordered=True)
        whole = chrome.encode(trace, ordered=True)
    assert len(whole) > 2 << 20 and whole.count(b'"flow_out":true') > 5000
    assert (tmp_path / "t.json").read_bytes() == whole


@pytest.mark.parametrize("seed", range(3))
def test_int_deltas_c_and_python_agree(seed: int) -> None:
    from gputrace import digest_breakdown as db

    rng = random.Random(seed)
    for n in (0, 1, 9, 3000):
        a = [rng.randrange(-(10**18), 10**18) for _ in range(n)]
        b = [rng.randrange(-(10**18), 10**18) for _ in range(n)]
        base = rng.randrange(-(10**18), 10**18)
        for x, y in ((a, b), (array("q", a), array("q", b)), (a, None), (array("q", a), None)):
            py = db._deltas_py(x, y, base)
            assert py == [p - q for p, q in zip(a, b if y is not None else [base, *a[:-1]])]
            if native.hot is not None:
                got = native.hot.int_deltas(x, y, base)
                # A difference past 64 bits is left to the twin.
                assert got == py or (got is NotImplemented and any(abs(v) >= 1 << 63 for v in py))
                assert db.int_deltas(x, y, base) == py
    big = [(1 << 63) - 1, -(1 << 63)]
    assert db.int_deltas(big, [-1, 1]) == [1 << 63, -(1 << 63) - 1]  # past 64 bits: the twin's ints
    assert db.int_deltas(array("q", big), None, -5) == [(1 << 63) + 4, -(1 << 64) + 1]


@pytest.mark.parametrize("seed", range(3))
def test_span_total_c_and_python_agree(seed: int) -> None:
    from gputrace import digest_breakdown as db

    rng = random.Random(seed)
    starts = array("q", (rng.randrange(-(10**18), 10**18) for _ in range(2000)))
    ends = array("q", (s + rng.randrange(10**9) if s < 9 * 10**17 else s for s in starts))
    for lo, hi in ((0, 0), (0, 2000), (17, 1500), (1999, 2000)):
        py = db._span_total_py(ends, starts, lo, hi)
        assert py == sum(ends[lo:hi]) - sum(starts[lo:hi])
        assert db.span_total(ends, starts, lo, hi) == py
    huge = array("q", [(1 << 63) - 1] * 3)
    assert db.span_total(huge, array("q", [-1] * 3), 0, 3) == 3 << 63  # past 64 bits: the twin's int
    if native.hot is not None:
        assert native.hot.int_span_total(huge, array("q", [-1] * 3), 0, 3) is NotImplemented
        with pytest.raises(ValueError):
            native.hot.int_span_total(huge, huge, 0, 4)
