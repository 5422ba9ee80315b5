"""The Chrome JSON writer and reader: golden output, exact timestamps, overflow lanes for spans
that cannot nest (also when written piece by piece), and values JSON cannot hold."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import orjson

from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track

GOLDEN = Path(__file__).parent / "golden"
BASE = 1_764_000_000_123_456_789


def small_trace() -> Trace:
    t = Trace({"gputrace_version": "test", "world_size": 4})
    p = t.add_process(Process(3, 2, "rank 2 (node7, NVIDIA H200)", 2, {"gputrace_version": "test"}))
    host = t.add_track(Track(p, 0, "thread MainThread (host)", "cpu", None, 0))
    default = t.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
    side = t.add_track(Track(p, 2, "cuda:0 stream 1", "cuda", 0, 1))
    t.add_span("step", default, BASE + 0, BASE + 10_000_001, {"step": 0})
    t.add_span("fwd", default, BASE + 1, BASE + 4_000_000)
    t.add_span("copy", side, BASE + 2_500, BASE + 3_000_999)
    t.add_span("late", default, BASE + 5_000_000, BASE + 12_000_000, {"note": "starts inside step, ends after it"})
    t.add_span("step", host, BASE + 7, BASE + 9)
    return t


def encoded(t: Trace) -> dict:
    return orjson.loads(chrome.encode(t))


def test_golden_file() -> None:
    got = orjson.dumps(encoded(small_trace()), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    golden = GOLDEN / "small_trace.json"
    if os.environ.get("REGEN_GOLDEN"):
        golden.write_bytes(got)
    assert got == golden.read_bytes()


def test_shape_perfetto_expects() -> None:
    data = chrome.encode(small_trace())
    assert data.startswith(b'{"baseTimeNanoseconds": ')
    assert b'"distributedInfo": {"rank": 2, "world_size": 4}' in data  # HTA's rank pattern: a space
    t = orjson.loads(data)
    assert t["baseTimeNanoseconds"] == BASE
    meta = {(e["name"], e["tid"]): e["args"] for e in t["traceEvents"] if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": "rank 2 (node7, NVIDIA H200)"}
    assert meta[("process_sort_index", 0)] == {"sort_index": 2}
    # Streams first, then their overflow lane, then host threads; no tid equals the pid (Perfetto
    # would draw that thread first as the process's main thread).
    tids = [tid for (name, tid) in meta if name == "thread_name"]
    order = sorted(tids, key=lambda tid: meta[("thread_sort_index", tid)]["sort_index"])
    assert [meta[("thread_name", tid)]["name"] for tid in order] == [
        "cuda:0 default stream",
        "cuda:0 default stream (overflow 1)",
        "cuda:0 stream 1",
        "thread MainThread (host)",
    ]
    assert 3 not in tids
    assert all(0 <= meta[("thread_sort_index", tid)]["sort_index"] < 2**31 for tid in tids)
    assert all(e["pid"] == 3 for e in t["traceEvents"])
    assert t["metadata"]["overflow_tracks"] == 1


def test_read_back_gives_the_same_spans_to_the_nanosecond() -> None:
    t = small_trace()
    back = chrome.read("mem", chrome.encode(t))
    assert back.ranks == [2]
    want = sorted((n, s, e) for n, _, s, e, _ in t.iter_spans())
    got = sorted((n, s, e) for n, _, s, e, _ in back.iter_spans())
    assert got == want


def test_timestamps_survive_perfettos_rounding_exactly() -> None:
    rng = random.Random(5)
    for _ in range(20_000):
        ns = rng.randrange(0, 10 * 3600 * 10**9)  # ten hours from the base
        text = b"%d.%03d" % (ns // 1000, ns % 1000)  # what the writer writes
        assert math.floor(float(text) * 1000 + 0.5) == ns  # Perfetto: llround(ts * 1000)


def nests_on_every_lane(starts: list[int], ends: list[int], lanes: list[int]) -> bool:
    for lane in set(lanes):
        rows = sorted((i for i in range(len(starts)) if lanes[i] == lane), key=lambda i: (starts[i], -ends[i]))
        stack: list[int] = []
        for i in rows:
            while stack and stack[-1] <= starts[i]:
                stack.pop()
            if stack and ends[i] > stack[-1]:
                return False
            stack.append(ends[i])
    return True


def test_misnested_span_goes_to_an_overflow_lane() -> None:
    # step [0, 10), fwd [1, 4) nest; late [5, 12) overlaps step partly: overflow.
    lanes = chrome.Layout().place([0, 0, 0, 0], [0, 1, 5, 12], [10, 4, 12, 13])
    assert lanes == [0, 0, 1, 0]


def test_lanes_nest_for_random_intervals_written_in_random_pieces() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randrange(1, 60)
        starts = [rng.randrange(0, 50) for _ in range(n)]
        ends = [s + rng.randrange(0, 20) for s in starts]
        order = list(range(n))
        if rng.random() < 0.5:
            order.sort(key=lambda i: (ends[i], -starts[i]))  # the order a recorder resolves them in
        else:
            rng.shuffle(order)
        layout = chrome.Layout()
        layout.MAX_KEPT = rng.choice([2, 256])  # joining kept spans must stay safe
        lanes = [0] * n
        k = 0
        while k < n:
            piece = order[k : k + rng.randrange(1, 10)]
            for i, lane in zip(
                piece, layout.place([0] * len(piece), [starts[i] for i in piece], [ends[i] for i in piece])
            ):
                lanes[i] = lane
            k += len(piece)
        assert nests_on_every_lane(starts, ends, lanes)


def test_spans_resolved_in_end_order_need_no_overflow_across_pieces() -> None:
    # A step and its children, split across pieces the way flushes split them.
    starts, ends = [], []
    for step in range(50):
        s = step * 100
        starts += [s + 1 + 10 * j for j in range(9)] + [s]
        ends += [s + 9 + 10 * j for j in range(9)] + [s + 99]
    layout = chrome.Layout()
    lanes: list[int] = []
    for k in range(0, len(starts), 7):
        lanes += layout.place([0] * len(starts[k : k + 7]), starts[k : k + 7], ends[k : k + 7])
    assert set(lanes) == {0}


def test_values_json_cannot_hold_are_written_not_fatal() -> None:
    t = Trace({"gputrace_version": "test"})
    p = t.add_process(Process(1, 0, "r", 0))
    tr = t.add_track(Track(p, 0, "t", "cpu"))
    weird = {"nan": float("nan"), "inf": float("inf"), "obj": object(), "surrogate": "\udc80", "html": "</script>"}
    t.add_span('na\u00efve "quoted"\n', tr, BASE, BASE + 5, weird)
    back = encoded(t)
    x = next(e for e in back["traceEvents"] if e["ph"] == "X")
    assert x["args"]["html"] == "</script>" and x["args"]["obj"].startswith("<object")
    assert x["name"] == 'na\u00efve "quoted"\n'


def test_counters_round_trip_as_perfetto_names_them() -> None:
    t = small_trace()
    c = t.add_track(Track(0, "m", "cuda:0 memory allocated", "counter", 0))
    t.counters.append(c, BASE + 10, 123456789.0)
    data = encoded(t)
    ev = next(e for e in data["traceEvents"] if e["ph"] == "C")
    assert ev["name"] == "cuda:0 memory" and ev["args"] == {"allocated": 123456789}
    back = chrome.read("mem", chrome.encode(t))
    assert [back.tracks[i].name for i in back.counters.track] == ["cuda:0 memory allocated"]
    assert list(back.counters.ts) == [BASE + 10]


def test_c_encoder_writes_what_the_python_loop_writes(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if chrome._encode_events is None:
        return  # the C extension is not built here (or GPUTRACE_PURE_PYTHON is set)
    rng = random.Random(11)
    t = Trace({"gputrace_version": "test"})
    p = t.add_process(Process(1, 0, "r", 0))
    tracks = [t.add_track(Track(p, i, f"cuda:0 stream {i}", "cuda", 0, i)) for i in range(3)]
    for i in range(3000):
        s = BASE + rng.randrange(0, 10**9)
        t.add_span(
            rng.choice(["a", "b\u00e9", 'c"q']),
            rng.choice(tracks),
            s,
            s + rng.randrange(0, 10**7),
            {"i": i} if i % 3 else None,
        )
    with_c = chrome.encode(t)
    monkeypatch.setattr(chrome, "_encode_events", None)
    assert chrome.encode(t) == with_c


def test_writes_behind_keep_their_order_and_report_a_failed_write(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Past its first bytes a save's writes run in the C build's writer thread: the file holds
    the pieces in order, and a write that fails (a full disk: /dev/full) fails the block."""
    import pytest

    from gputrace.trace import files

    made: list[int] = []
    if files._Writer is not None:  # count the threads made: the C build must use one here
        real = files._Writer

        def counting(fd: int) -> object:
            made.append(fd)
            return real(fd)

        monkeypatch.setattr(files, "_Writer", counting)
    rng = random.Random(5)
    pieces = [bytes([65 + i % 26]) * rng.randrange(1, 300_000) for i in range(60)]
    path = tmp_path / "out"
    with open(path, "wb") as f, files.writes_behind(f, after=100_000) as write:
        for p in pieces:
            write(p)
        write(bytearray(b"and a bytearray"))
    assert path.read_bytes() == b"".join(pieces) + b"and a bytearray"
    assert len(made) == (files._Writer is not None)
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with pytest.raises(OSError) as e:
        with open("/dev/full", "wb", buffering=0) as f, files.writes_behind(f, after=0) as write:
            for p in pieces:
                write(p)
    assert e.value.errno == 28  # ENOSPC
    assert len(made) == 2 * (files._Writer is not None)


def test_the_writer_thread_writes_every_byte_in_order_through_interrupted_partial_writes() -> None:
    """A pipe read in random small reads makes partial writes; a timer signal every 0.2 ms makes
    interrupted ones. Every byte arrives, in order."""
    import hashlib
    import signal
    import threading

    import pytest

    hot = pytest.importorskip("gputrace._hot")
    r, w = os.pipe()
    got = hashlib.sha256()
    rng = random.Random(1)

    def read() -> None:
        while b := os.read(r, rng.randrange(1, 70_000)):
            got.update(b)

    reader = threading.Thread(target=read)
    reader.start()
    old = signal.signal(signal.SIGALRM, lambda *a: None)
    signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
    want = hashlib.sha256()
    try:
        writer = hot.Writer(w, 1 << 20)
        for i in range(200):
            piece = bytes([i % 251]) * rng.randrange(1, 400_000)
            want.update(piece)
            writer.write(piece)
        writer.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(w)
        reader.join()
        os.close(r)
    assert got.digest() == want.digest()
    bad = hot.Writer(os.open(os.devnull, os.O_RDONLY))  # a descriptor that takes no writes
    with pytest.raises(OSError):
        bad.write(b"x")
        bad.close()


def test_a_save_onto_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    """The whole writer path on a device that takes no bytes: a one-line error, no file."""
    import pytest

    from gputrace.errors import GputraceError
    from gputrace.trace import files

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with pytest.raises(GputraceError, match="cannot write"):
        with files.atomic_writer(str(tmp_path / "t.json")) as f:
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, f.fileno())
            os.close(full)
            with files.writes_behind(f, after=0) as write:
                write(b"x" * 3_000_000)
    assert not list(tmp_path.iterdir())
