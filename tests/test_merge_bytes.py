"""Merged files are byte for byte what they were: seeded multi-rank traces (nesting and crossing
spans, arguments, categories, launch entries, counters, drifting clocks, another tool's trace
with a flow) in both formats, merged into both formats, whole and with selections. The digests
below are of the files this merge wrote before its memory was brought down to columns; a change
to what merge writes must change them knowingly."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest

from gputrace.trace import chrome
from gputrace.trace.model import Process, Trace, Track

ROOT = str(Path(__file__).resolve().parent.parent)
BASE = 1_700_000_000_000_000_000
WORLD = 3


def rank_trace(rank: int, steps: int = 30, seed: int = 20) -> Trace:
    rng = random.Random(seed * 100 + rank)
    syncs = [
        {"at_ns": BASE, "offset_ns": rank * 3_217, "error_ns": 40 + rank},
        {"at_ns": BASE + 2_000_000_000, "offset_ns": rank * 3_217 + 900 * rank, "error_ns": 50},
    ]
    meta: dict[str, Any] = {
        "gputrace_version": "test",
        "rank": rank,
        "world_size": WORLD,
        "run_id": "bytes",
        "clock": {"sync_to_rank0": syncs},
    }
    t = Trace(dict(meta))
    p = t.add_process(Process(rank + 1, rank, f"rank {rank}", rank, meta))
    streams = [t.add_track(Track(p, 10 + i, f"cuda:0 stream {7 + i}", "cuda", 0, i)) for i in range(2)]
    host = t.add_track(Track(p, 1, "thread MainThread (host)", "cpu", None, 2))
    loader = t.add_track(Track(p, 2, "thread loader (host)", "cpu", None, 3))
    mem = t.add_track(Track(p, 3, "memory", "counter", None, 4))
    entries: list[int] = []
    s = BASE + rank * 1_111
    for k in range(steps):
        step_len = 1_000_000 + rng.randrange(200_000)
        t.add_span("step", host, s, s + step_len, {"step": k})
        entries.append(0)
        at = s + 1_000
        for name in ("data", "forward", "backward", "optimizer"):
            d = rng.randrange(50_000, 200_000)
            args = {"k": k, "nested": {"x": [1, 2.5, 'a"b']}} if rng.random() < 0.3 else None
            t.add_span(name, host, at, at + d, args, "host" if rng.random() < 0.5 else None)
            entries.append(0)
            g = at + rng.randrange(1_000, 30_000)
            t.add_span(f"{name}_kernel", streams[k % 2], g, g + d // 2, None, "kernel")
            entries.append(at + rng.randrange(0, 900))
            at += d + rng.randrange(1_000)
        # Crossing spans on one thread: the writer must lay them out on two lanes.
        a = s + rng.randrange(10_000, 500_000)
        t.add_span("prefetch", loader, a, a + 300_000, {"batch": k})
        t.add_span("decode", loader, a + 100_000, a + 450_000)
        entries += [0, 0]
        t.counters.append(mem, s, float(rng.randrange(1 << 30)))
        s += step_len + rng.randrange(5_000)
    t.spans.entry = array("q", entries)
    return t


def kineto(rank: int) -> bytes:
    return orjson.dumps(
        {
            "distributedInfo": {"rank": rank, "world_size": WORLD},
            "baseTimeNanoseconds": BASE - 1_000_000,
            "traceEvents": [
                {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
                {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.5, "dur": 2.25},
                {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 5000.25, "dur": 9000.5},
                {"ph": "f", "id": 1, "pid": 0, "tid": 7, "ts": 1000.5, "cat": "ac2g", "name": "ac2g", "bp": "e"},
                {"ph": "i", "name": "mark", "pid": 0, "tid": 7, "ts": 3000, "s": "t"},
            ],
        }
    )


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    perfetto = pytest.importorskip("gputrace.trace.perfetto")
    d = tmp_path_factory.mktemp("bytes")
    for fmt, ext in ((chrome, "json"), (perfetto, "pftrace")):
        (d / ext).mkdir()
        for r in range(WORLD):
            fmt.write(rank_trace(r), str(d / ext / f"trace_rank{r}.{ext}"))
        (d / ext / "gpu_trace.json").write_bytes(kineto(1))
    # Ranks of more spans than the writers put in one piece.
    (d / "big").mkdir()
    for r in range(2):
        chrome.write(rank_trace(r, steps=2_000), str(d / "big" / f"trace_rank{r}.json"))
    return d


CASES: dict[str, dict[str, Any]] = {
    "whole": {},
    "steps": {"steps": (3, 9)},
    "ranks and window": {"ranks": [0, 2], "window": (BASE + 5_000_000, BASE + 9_000_000)},
    "align on": {"align_on": "backward_kernel", "occurrence": 2},
}

#: sha256 of each merged file: (input format, case, output format) -> digest.
EXPECTED = {
    ("json", "whole", "json"): "936e9621722b471ac018aea0aababdd0177ab20af49b04265cb97fa6b9bd1936",
    ("json", "whole", "pftrace"): "2cab9511d03d3b3a875a804b739e91461ff53c0f9670ab8acbd9a0e97a9339c2",
    ("json", "steps", "json"): "137ff408072b3a9c2b6aff3e549966c94ec6eadcdd76d1ba255b62538f27f7f7",
    ("json", "steps", "pftrace"): "feba4a374a52dc4c75fc7881faef6339c9eb520124363c3facae1a17feb4548e",
    ("json", "ranks and window", "json"): "94e5641b21fe0b3566f528a5546cc5b1a3daf494387ad2e3190d5639224def83",
    ("json", "ranks and window", "pftrace"): "22572f52fccfedd3e274cb82dc5bfda73dd9d4bf9b36f6f7de1cbf624a381d48",
    ("json", "align on", "json"): "cc4e08dd28b4350cc622a6f2861cbf1e09d8453e15b19b41b11ee408fdee0d7a",
    ("json", "align on", "pftrace"): "4276dc561755f9b7dcce9710a5c8f786ca87bcc2f9ad666b0cb8a7861aed4035",
    ("pftrace", "whole", "json"): "82bb12cbe178d511db5c511d517ecb8cb08c67ccece30a2faeca6861f0be5d15",
    ("pftrace", "whole", "pftrace"): "79472be01a5626ec08937e21197c1019381bcc34465f9bab6b7f28e31a2252c8",
    ("pftrace", "steps", "json"): "fa44063052a91ac2eac8598a8f3469eb030d716bd855db80efe37b24737cb0bc",
    ("pftrace", "steps", "pftrace"): "38fe93e4248cb4babbbf1fd17cf68194a2715b41572ff75d197b0220309e367c",
    ("pftrace", "ranks and window", "json"): "32d216a411515c484564864fe9e2e0a869db80cdf14f2ef74c64ab824abd8ee9",
    ("pftrace", "ranks and window", "pftrace"): "42533906fb46081583f5f761f41d109a89be83776a4de31e061cbce89c9df334",
    ("pftrace", "align on", "json"): "736b145276de34a7ad874f90dcc7ae46382cec50dd1411251d5aa45a0d7e888d",
    ("big", "whole", "json"): "eaeb130463fc7e377a2c900a83e0505fb3db527c6fa703456365f44a5cc664f7",
    ("big", "whole", "pftrace"): "c1da3a7e6c53591efe344df682305246edc4151c487404dfc1b813b3afa735e5",
    ("big", "steps", "json"): "41828ebce0cbbe6aef3bc9575497575b8da3125f207f0edfeeb49e9bb7f6fd21",
    ("pftrace", "align on", "pftrace"): "ad29c424f126d7cce3ebf28e6df4afcf36a529abcec3b6d152012f026870fcee",
}


@pytest.fixture(scope="module")
def digests(inputs: Path) -> dict[tuple[str, str, str], str]:
    """Every case merged in one fresh interpreter with a fixed hash seed (the protobuf reader
    numbers a file's names in an order that follows string hashing), each output's sha256."""
    keys = sorted(EXPECTED)
    code = (
        "import hashlib, json, sys\n"
        "from gputrace import merge\n"
        "cases = json.loads(sys.argv[1])\n"
        "for src, case, ext, kw in cases:\n"
        "    kw = {k: (v if k == 'ranks' else tuple(v)) if isinstance(v, list) else v for k, v in kw.items()}\n"
        "    out = 'out-%s-%s.%s' % (src, case.replace(' ', '_'), ext)\n"
        "    merge.merge([src], out, workers=1, **kw)\n"
        "    print(hashlib.sha256(open(out, 'rb').read()).hexdigest())\n"
    )
    cases = json.dumps([[s, c, e, CASES[c]] for s, c, e in keys])
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", code, cases], cwd=inputs, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dict(zip(keys, r.stdout.split()))


@pytest.mark.parametrize("key", sorted(EXPECTED), ids=lambda k: "-".join(k))
def test_merged_bytes_are_unchanged(digests: dict[tuple[str, str, str], str], key: tuple[str, str, str]) -> None:
    assert digests[key] == EXPECTED[key]
