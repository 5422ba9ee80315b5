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
    if rank:  # refined on the GPU: its CUDA streams go through a map of their own
        syncs[0]["device"] = {"at_ns": BASE, "offset_ns": rank * 3_000, "error_ns": 5}
        syncs[1]["device"] = {"at_ns": BASE + 2_000_000_000, "offset_ns": rank * 3_500, "error_ns": 5}
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
        chrome.write(rank_trace(r, steps=6_000), str(d / "big" / f"trace_rank{r}.json"))
    return d


CASES: dict[str, dict[str, Any]] = {
    "whole": {},
    "steps": {"steps": (3, 9)},
    "ranks and window": {"ranks": [0, 2], "window": (BASE + 5_000_000, BASE + 9_000_000)},
    "align on": {"align_on": "backward_kernel", "occurrence": 2},
}

#: sha256 of each merged file: (input format, case, output format) -> digest.
EXPECTED = {
    ("json", "whole", "json"): "e019395b5c8298abd89c94b30f03b44d2cba35e466908d818cc03de3a0a0bf05",
    ("json", "whole", "pftrace"): "a861278f9bf901e97d84bf53fe466dd331db0c902ae2aee3154aaf35e76fa97c",
    ("json", "steps", "json"): "f25708cc9b7f1b44d2cc1f828dbf6dda624a129b5b0df6b40dfec2b22b47d75b",
    ("json", "steps", "pftrace"): "6003e71ad694531261feed4195e27817111ac880559017294c59d985962c0aa9",
    ("json", "ranks and window", "json"): "3649ad2873996369057e2a5600b4b4f01e26fba2a32758fd13cfc63e445d8912",
    ("json", "ranks and window", "pftrace"): "d8331409f8c3e73dacb235211a4b8555dc0c0a22b48607b72b7e09293f8f2375",
    ("json", "align on", "json"): "38521d171be75a0490ab0e3ba06426641ea552d1b5cc845a5fc1b811276340bd",
    ("json", "align on", "pftrace"): "62422ed2f05ae5d2c3093b0afbd49434419cb431d4028619a800c2ca77cc9d97",
    ("pftrace", "whole", "json"): "62cb5b343e2d19ee8d0de889cdae8ce285cbe72523226033725df48fb7796c01",
    ("pftrace", "whole", "pftrace"): "16608f2852ef59384e8c759202439dab5879be28ee9aee58c28e49bcddc9889e",
    ("pftrace", "steps", "json"): "e919f2a83c77a2740253427a915db5f52a3c671acc2def9aef973850640b05e9",
    ("pftrace", "steps", "pftrace"): "7cef50d7943fec1a42b9d11e0cd8d8658d8e2ca7dd20fa06a439a126894c1283",
    ("pftrace", "ranks and window", "json"): "202719687345c82b639c1464344271f459b08f8dc49f9b7a2d776b384a84bde2",
    ("pftrace", "ranks and window", "pftrace"): "31296fda7d798d5127bd9e62874fc1e5c5ba67dfe1cabfd50c3ea4c8d3448ff9",
    ("pftrace", "align on", "json"): "68619053b4c3d757048e232435e624d6855b939562ac3f7c135a15f465e2d84d",
    ("big", "whole", "json"): "f5fae965de41eaa6111ae14570cd72ac88399f47e75fe501a27361c9a2afdd0e",
    ("big", "whole", "pftrace"): "69b611389e5017afd0e9a24b0102cb85184176899b1333748ac3cddfb807038d",
    ("big", "steps", "json"): "fa5a33aa68dcbdc4bc7766433ac024b9ecc0adc1df6ca188c591ef4cb2c53b37",
    ("pftrace", "align on", "pftrace"): "542e8e3dd4928be486682e0ee685c14a406347d9ec9e104db51b9c509815fa13",
}


@pytest.fixture(scope="module")
def digests(inputs: Path) -> dict[tuple[str, str, str], str]:
    """Every case merged in two fresh interpreters with different string hash seeds (the output
    must not follow hashing), each output's sha256, the same from both."""
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
    runs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=ROOT)
        r = subprocess.run([sys.executable, "-c", code, cases], cwd=inputs, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.split())
    assert runs[0] == runs[1], "merged bytes change with the string hash seed"
    return dict(zip(keys, runs[0]))


@pytest.mark.parametrize("key", sorted(EXPECTED), ids=lambda k: "-".join(k))
def test_merged_bytes_are_unchanged(digests: dict[tuple[str, str, str], str], key: tuple[str, str, str]) -> None:
    assert digests[key] == EXPECTED[key]
