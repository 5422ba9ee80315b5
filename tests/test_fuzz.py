"""Fuzzing of the readers: random byte and structure mutations of real files (this module's own
small traces in both formats, a streamed and a merged one, and a step digest) through the
public read paths (`registry.read`, `validate_file`, `merge.load`, the summary of a folder).
Every mutant either reads or raises a `GputraceError`: no other exception, and no hang (each
mutant has a time limit).

The seeds are fixed, so a failure is reproducible: the message names the seed and the mutant.
A longer run: `python -m tests.test_fuzz 10` (ten times the mutants of the CI run), which prints
the counts.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputrace import digest, merge, summary
from gputrace.errors import GputraceError
from gputrace.trace import chrome, perfetto, registry
from gputrace.trace.model import Process, Trace, Track
from gputrace.validate import validate_file

BASE = 1_700_000_000_000_000_000
LIMIT_S = 5.0  # per mutant and read path: far above any honest read of these small files

#: Values that broke readers before: wrong types, numbers past int64 and uint64, deep nesting.
HOSTILE: list[Any] = [
    None,
    True,
    -1,
    0,
    2**63,
    2**64 - 1,
    -(2**63) - 1,
    10**30,
    1e308,
    -1e308,
    0.5,
    "",
    "x",
    "1" * 5000,
    "\udcff",
    [],
    [0] * 50,
    {},
    {"a": [1, {"b": None}]},
    [[[[[[[[[[[]]]]]]]]]]],
]


class Hang(BaseException):  # not an Exception: no `except Exception` on the way swallows it
    pass


def _ring(signum: int, frame: Any) -> None:
    raise Hang(f"no answer within {LIMIT_S} s")


# ---- the seed files -----------------------------------------------------------------------------


def rank_trace(rank: int, world: int = 2) -> Trace:
    meta = {"gputrace_version": "test", "rank": rank, "world_size": world, "run_id": "run-1"}
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    gpu = t.add_track(Track(p, 1, "cuda:0 default stream", "cuda", 0, 0))
    host = t.add_track(Track(p, 2, "thread MainThread (host)", "cpu", None, 1))
    for k in range(4):
        s = BASE + k * 10_000_000
        t.add_span("step", gpu, s, s + 9_000_000, {"step": k})
        t.add_span("fwd", gpu, s, s + 5_000_000)
        t.add_span("all_reduce", gpu, s + 6_000_000, s + 8_000_000, {"collective": True, "bytes": 1 << 20})
        t.add_span("host work", host, s, s + 1_000_000, {"nested": {"a": [1, 2.5, "x"]}})
    # Another tool's events carried through (an instant, a flow): JSON events, protobuf metadata.
    t.extra.append({"ph": "i", "name": "mark", "tid": 2, "s": "t", "ts_ns": BASE + 5_000, "process": p})
    t.extra.append({"ph": "X", "name": "other", "tid": 2, "ts_ns": BASE + 6_000, "dur_ns": 1_000, "process": p})
    memory = t.add_track(Track(p, "cuda:0 memory allocated", "cuda:0 memory allocated", "counter", 0))
    for k in range(4):
        t.counters.append(memory, BASE + k * 10_000_000, float(k << 20))
    return t


def seeds(d: Path) -> dict[str, Path]:
    """The files mutated: name -> path (built once into `d`)."""
    out: dict[str, Path] = {}
    for ext in (".json", ".pftrace"):
        path = d / f"trace_rank0{ext}"
        registry.for_path(str(path)).write(rank_trace(0), str(path))
        out[ext] = path
    stream = d / "stream" / "trace_rank0.json"
    stream.parent.mkdir()
    t = rank_trace(0)
    w = chrome.StreamWriter(str(stream), BASE, t.processes[0], {"metadata": dict(t.metadata)})
    w.append(t, range(len(t.spans)))
    w.abandon()
    out["stream"] = stream
    ranks = d / "ranks"
    ranks.mkdir()
    for r in range(2):
        chrome.write(rank_trace(r), str(ranks / f"trace_rank{r}.json"))
    merged = d / "merged.json"
    merge.merge([str(ranks)], str(merged))
    out["merged"] = merged
    merged_pb = d / "merged.pftrace"
    merge.merge([str(ranks)], str(merged_pb))
    out["merged.pftrace"] = merged_pb
    stream_pb = d / "stream" / "trace_rank0.pftrace"
    w = perfetto.StreamWriter(str(stream_pb), BASE, t.processes[0], {"metadata": dict(t.metadata)})
    w.append(t, range(len(t.spans)), range(len(t.counters)))
    w.abandon()
    out["stream.pftrace"] = stream_pb
    # Another tool's trace (torch.profiler's shape): flows, instants, counters, string ids.
    foreign = d / "foreign.json"
    us = BASE // 1000
    foreign.write_bytes(
        orjson.dumps(
            {
                "distributedInfo": {"rank": 0, "world_size": 1},
                "traceEvents": [
                    {"ph": "M", "name": "process_name", "pid": 7, "tid": 0, "args": {"name": "python"}},
                    {"ph": "M", "name": "thread_name", "pid": 7, "tid": 8, "args": {"name": "main"}},
                    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 7, "tid": 8, "ts": us, "dur": 5.5},
                    {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": "stream 7", "ts": us + 2, "dur": 3},
                    {"ph": "s", "id": 1, "name": "launch", "pid": 7, "tid": 8, "ts": us + 1, "cat": "ac2g"},
                    {"ph": "f", "id": 1, "name": "launch", "pid": 0, "tid": "stream 7", "ts": us + 2, "bp": "e"},
                    {"ph": "i", "name": "mark", "pid": 7, "tid": 8, "ts": us + 3, "s": "t"},
                    {"ph": "C", "name": "memory", "pid": 7, "ts": us + 4, "args": {"bytes": 1024}},
                    {"ph": "B", "name": "outer", "pid": 7, "tid": 9, "ts": us},
                    {"ph": "E", "pid": 7, "tid": 9, "ts": us + 9},
                ],
            }
        )
    )
    out["foreign"] = foreign
    dig = d / "dig" / "trace_rank0.json"
    dig.parent.mkdir()
    chrome.write(rank_trace(0), str(dig))
    written = digest.write_for_trace(rank_trace(0), str(dig), "step")
    assert written is not None
    out["digest"] = Path(written)
    return out


# ---- mutations ----------------------------------------------------------------------------------


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not b:
            b += rng.randbytes(8)
        op = rng.randrange(7)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] = rng.randrange(256)
        elif op == 1:
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 2:
            del b[i : i + rng.randint(1, 64)]
        elif op == 3:
            j = rng.randrange(len(b))
            b[i:i] = b[j : j + rng.randint(1, 256)]
        elif op == 4:
            del b[i:]
        elif op == 5:
            b[i] ^= 1 << rng.randrange(8)
        else:
            token = rng.choice([b"1e400", b"99999999999999999999999", b"[0,0]", b"{}", b'"x"', b"null", b"-1", b"}"])
            b[i : i + rng.randint(0, 4)] = token
    return bytes(b)


def _nodes(doc: Any) -> list[tuple[Any, ...]]:
    """Paths to the document's values (not below depth 12: a nested hostile value is one)."""
    out: list[tuple[Any, ...]] = []
    todo: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while todo:
        v, path = todo.pop()
        out.append(path)
        if len(path) < 12:
            if isinstance(v, dict):
                todo += [(x, (*path, k)) for k, x in v.items()]
            elif isinstance(v, list):
                todo += [(x, (*path, i)) for i, x in enumerate(v)]
    return out


def _hostile(rng: random.Random) -> Any:
    if rng.random() < 0.05:
        deep: Any = 0
        for _ in range(rng.choice([50, 900, 2000])):
            deep = [deep] if rng.random() < 0.5 else {"a": deep}
        return deep
    return copy.deepcopy(rng.choice(HOSTILE))  # a copy: later mutations change it in place


def mutate_json(rng: random.Random, data: bytes) -> bytes:
    """Replace, drop or duplicate a random value of the document (one of its events' fields, a
    header field, ...) with a hostile one; json (not orjson) writes ints past 64 bits."""
    try:
        doc = json.loads(data)
    except ValueError:
        return mutate_bytes(rng, data)
    for _ in range(rng.randint(1, 3)):
        nodes = _nodes(doc)
        path = rng.choice(nodes)
        if not path:
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        op = rng.randrange(4)
        if op == 0 and isinstance(parent, dict):
            del parent[key]
        elif op == 1 and isinstance(parent, list):
            parent.insert(key, parent[key])
        elif op == 2 and isinstance(parent, dict):
            parent[rng.choice(["ts", "dur", "pid", "tid", "ph", "name", "args", "x"])] = _hostile(rng)
        else:
            parent[key] = _hostile(rng)
    try:
        text = json.dumps(doc, allow_nan=True)
    except (RecursionError, ValueError):
        return mutate_bytes(rng, data)
    return text.encode("utf-8", "surrogatepass")


def mutate_protobuf(rng: random.Random, data: bytes) -> bytes:
    """Set a random field of a random packet (or of a packet inside a compressed bundle, which
    is inflated, changed and compressed again) to an extreme value, or nest compressed packets."""
    from google.protobuf.descriptor import FieldDescriptor as F
    from google.protobuf.message import DecodeError
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    try:
        msg = pb.Trace.FromString(data)
    except DecodeError:  # an earlier mutation's bytes
        return mutate_bytes(rng, data)
    if not msg.packet:
        return mutate_bytes(rng, data)
    packet = rng.choice(msg.packet)
    if packet.HasField("compressed_packets") and rng.random() < 0.7:
        try:
            inner = pb.Trace.FromString(zlib.decompress(packet.compressed_packets))
        except (zlib.error, DecodeError):  # an earlier mutation's bytes
            return mutate_bytes(rng, data)
        if rng.random() < 0.1:  # bundles inside bundles
            blob = inner.SerializeToString()
            for _ in range(rng.choice([2, 50, 2000])):
                blob = pb.Trace(packet=[pb.TracePacket(compressed_packets=zlib.compress(blob))]).SerializeToString()
            packet.compressed_packets = zlib.compress(blob)
            return bytes(msg.SerializeToString())
        packet.compressed_packets = zlib.compress(mutate_protobuf(rng, inner.SerializeToString()))
        return bytes(msg.SerializeToString())
    target: Any = packet
    for _ in range(6):  # down into a random set message field
        subs = [(fd, v) for fd, v in target.ListFields() if fd.type == F.TYPE_MESSAGE]
        if not subs or rng.random() < 0.3:
            break
        fd, v = rng.choice(subs)
        if fd.is_repeated:
            if not len(v):
                break
            target = v[rng.randrange(len(v))]
        else:
            target = v
    scalars = [fd for fd in target.DESCRIPTOR.fields if fd.type != F.TYPE_MESSAGE]
    if not scalars:
        return mutate_bytes(rng, data)
    fd = rng.choice(scalars)
    extremes: dict[int, list[Any]] = {
        F.TYPE_UINT64: [0, 2**64 - 1, 2**63, 1],
        F.TYPE_INT64: [-(2**63), 2**63 - 1, -1, 0],
        F.TYPE_SINT64: [-(2**63), 2**63 - 1, -1],
        F.TYPE_UINT32: [0, 2**32 - 1],
        F.TYPE_INT32: [-(2**31), 2**31 - 1, -1],
        F.TYPE_DOUBLE: [float("inf"), float("nan"), -1e308, 0.0],
        F.TYPE_BOOL: [True, False],
        F.TYPE_STRING: ["", "x" * 1000, "[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000, "\U0010ffff"],
        F.TYPE_BYTES: [b"", b"\xff" * 64, zlib.compress(b"\x00" * 100_000)],
    }
    try:
        if fd.type == F.TYPE_ENUM:
            value: Any = rng.choice([v.number for v in fd.enum_type.values] + [999])
        else:
            value = rng.choice(extremes.get(fd.type, [0]))
        if fd.is_repeated:
            getattr(target, fd.name).append(value)
        else:
            setattr(target, fd.name, value)
    except (TypeError, ValueError):
        return mutate_bytes(rng, data)
    return bytes(msg.SerializeToString())


def mutant(rng: random.Random, kind: str, data: bytes) -> bytes:
    r = rng.random()
    if r < 0.4:
        return mutate_bytes(rng, data)
    if kind.endswith(".pftrace"):
        for _ in range(rng.randint(1, 3)):
            data = mutate_protobuf(rng, data)
        return data
    return mutate_json(rng, data)


# ---- reading ------------------------------------------------------------------------------------


def read_paths(kind: str, path: Path) -> list[tuple[str, Callable[[], object]]]:
    """The public read paths a mutant of `kind` at `path` goes through."""
    p = str(path)
    if kind == "digest":
        return [
            ("summary of the folder", lambda: summary.summary_of_files([str(path.parent)])),
            ("summary of the digest", lambda: summary.summary_of_files([p])),
        ]
    return [
        ("registry.read", lambda: registry.read(p)),
        ("validate_file", lambda: validate_file(p)),
        ("merge.load", lambda: merge.load([p])),
        ("summary", lambda: summary.summary_of_files([p])),
    ]


def fuzz(seed: int, per_kind: int, work: Path, files: dict[str, Path]) -> tuple[Counter[str], list[str]]:
    """`per_kind` mutants of each seed file through every read path. Returns the outcomes'
    counts and a description of every failure (an exception not a GputraceError, or a hang)."""
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    failures: list[str] = []
    old = signal.signal(signal.SIGALRM, _ring)
    try:
        for kind, src in files.items():
            original = src.read_bytes()
            for k in range(per_kind):
                data = mutant(rng, kind, original)
                d = work / f"{kind.replace('.', '_')}-{seed}-{k}"
                d.mkdir()
                if kind == "digest":
                    shutil.copy(src.parent / "trace_rank0.json", d / "trace_rank0.json")
                    path = d / src.name
                else:
                    path = d / f"trace_rank0{'.pftrace' if kind.endswith('.pftrace') else '.json'}"
                path.write_bytes(data)
                for what, call in read_paths(kind, path):
                    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            call()
                        counts["read"] += 1
                    except GputraceError:
                        counts["refused"] += 1
                    except (Exception, Hang) as e:  # noqa: BLE001 - what the test looks for
                        counts["failed"] += 1
                        where = traceback.extract_tb(e.__traceback__)[-1]
                        failures.append(
                            f"seed {seed}, {kind} mutant {k}, {what}: {type(e).__name__}: {str(e)[:200]} "
                            f"({os.path.basename(where.filename)}:{where.lineno})"
                        )
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                shutil.rmtree(d)
    finally:
        signal.signal(signal.SIGALRM, old)
    return counts, failures


#: CI: mutants per seed file, per seed (3,200 mutants, 12,000 reads: about 30 s on two shared cores).
PER_KIND = 100
SEEDS = (1, 2, 3, 4)


@pytest.mark.parametrize("seed", SEEDS)
def test_every_mutant_reads_or_raises_a_gputrace_error(tmp_path: Path, seed: int) -> None:
    files = seeds(tmp_path / "seeds")
    work = tmp_path / "work"
    work.mkdir()
    counts, failures = fuzz(seed, PER_KIND, work, files)
    assert not failures, "\n".join(failures[:20])
    assert counts["read"] and counts["refused"], counts  # the mutations reach both outcomes


def main(argv: list[str]) -> int:
    """The longer run: `python -m tests.test_fuzz [times]` (times the CI's mutants)."""
    times = int(argv[0]) if argv else 10
    total: Counter[str] = Counter()
    every: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        files = seeds(Path(tmp) / "seeds")
        for seed in range(1000, 1000 + times * len(SEEDS)):
            work = Path(tmp) / f"work{seed}"
            work.mkdir()
            counts, failures = fuzz(seed, PER_KIND, work, files)
            total += counts
            every += failures
    mutants = times * len(SEEDS) * PER_KIND * len(files)
    print(f"{mutants} mutants, {sum(total.values())} reads in {time.perf_counter() - t0:.0f} s: {dict(total)}")
    for f in every:
        print(f)
    return 1 if every else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
