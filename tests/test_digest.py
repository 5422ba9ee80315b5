"""Step digests: written by real recordings beside their traces, and a summary read from them has
the same steps and collectives as one read from the full traces (real gloo processes included).

`python -m tests.test_digest worker OUT SHIFT_NS` is one rank of the gloo test (torchrun's
variables set): a short job whose rank 1 is a straggler and plays a host SHIFT_NS ahead; each
rank saves into OUT/rank{R} (a disk of its own), then the digests are gathered into OUT/rank0.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

import gputrace
from gputrace import digest, merge, session, stats, summary
from gputrace.cli import main
from gputrace.clock import HostClock
from gputrace.trace import digestfile
from gputrace.trace.model import Trace

from .conftest import _reset, run_rank_processes

ROOT = Path(__file__).resolve().parent.parent
EPOCH = 1_700_000_000_000_000_000
WORLD = 4
STEPS = 24
SLOW = 2  # the straggler of the in-process runs


# ---- recordings on a clock the test moves -------------------------------------------------------


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.t = 1_000_000_000

    def __call__(self) -> int:
        return self.t

    def to(self, t: int) -> None:
        assert t >= self.t
        self.t = t


def record_rank(out: Path, rank: int, streamed: bool = True) -> str:
    """One rank of a job on a shared timeline: every step starts at the same instant on every
    rank; fwd takes 1 ms +- jitter (rank SLOW 0.4 ms more every 5th step); then an all_reduce
    marked collective ends on every rank together; a data wait named like a collective but not
    marked, a barrier marked collective=False, and many small ops. The last rank saves inside an
    open step and an open all_reduce (unfinished spans). Flushes every 5 steps."""
    clock = Clock()
    gputrace.set_host_clock(HostClock(monotonic_ns=clock, realtime_ns=lambda: clock.t + EPOCH))
    options: dict[str, Any] = {"cuda": False, "rank": rank, "run_id": "digest-test"}
    if streamed:
        options["out_dir"] = str(out)
    gputrace.enable(**options)
    t0 = clock.t
    for k in range(STEPS):
        base = t0 + k * 3_000_000
        work = [1_000_000 + ((k * 7919 + r * 104729) % 20_000) for r in range(WORLD)]
        if k % 5 == 2:
            work[SLOW] += 400_000
        clock.to(base)
        with gputrace.span("step", step=k):
            with gputrace.span("wait_data"):
                clock.to(base + 1_000 * (rank + 1))
            with gputrace.span("fwd"):
                for i in range(6):
                    with gputrace.span("op", i=i):
                        clock.to(clock.t + 1_000 + 37 * i * (rank + 1) + 5 * k)
                clock.to(base + 2_000 * WORLD + work[rank])
            with gputrace.span("all_reduce", collective=True):
                clock.to(base + 2_000 * WORLD + max(work) + 50_000)
            with gputrace.span("barrier", collective=False):
                clock.to(clock.t + 3_000 + rank)
            with gputrace.span("opt"):
                clock.to(clock.t + 20_000 + 100 * k)
        if k % 5 == 4:
            gputrace.flush()
    if rank == WORLD - 1:
        clock.to(t0 + STEPS * 3_000_000)
        with gputrace.span("step", step=STEPS):
            with gputrace.span("all_reduce", collective=True):
                clock.to(clock.t + 10_000)
                path = gputrace.save(out)
    else:
        path = gputrace.save(out)
    _reset()
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """WORLD ranks recorded one after another in this process; the last one saved whole (not
    streamed), the others streamed flush by flush."""
    out = tmp_path_factory.mktemp("job")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("WORLD_SIZE", str(WORLD))
        for r in range(WORLD):
            record_rank(out, r, streamed=r != 1)
    finally:
        mp.undo()
        _reset()
    return out


# ---- comparing summaries ------------------------------------------------------------------------


def assert_same(full: stats.Summary, dig: stats.Summary, approximate: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Steps, collectives and counts equal; name statistics equal but for the percentiles of
    `approximate` names (estimated from histograms, within HIST_ERROR)."""
    assert dig.ranks == full.ranks
    assert dig.steps == full.steps
    assert dig.collectives == full.collectives
    assert dig.counts == full.counts
    assert [n.name for n in dig.names] == [n.name for n in full.names]

    def same(a: stats.NameStats, b: stats.NameStats) -> None:
        if a.name in approximate:
            for q in ("p50_ns", "p90_ns", "p99_ns"):
                x, y = getattr(a, q), getattr(b, q)
                assert abs(x - y) <= digest.HIST_ERROR * y + 1, (a.name, q, x, y)
            a = dataclasses.replace(a, p50_ns=b.p50_ns, p90_ns=b.p90_ns, p99_ns=b.p99_ns)
        assert a == b

    for a, b in zip(dig.names, full.names):
        same(a, b)
    for r in full.ranks:
        assert [x.name for x in dig.by_rank[r]] == [x.name for x in full.by_rank[r]]
        for a, b in zip(dig.by_rank[r], full.by_rank[r]):
            same(a, b)


def full_summary(paths: list[str], skip: int = 0) -> stats.Summary:
    return stats.summarize(merge.load(paths), "step", skip)


def digest_summary(paths: list[str], skip: int = 0) -> stats.Summary:
    return summary.summarize(summary.collect(summary.find(paths), "step"), "step", skip)[1]


# ---- the tests ----------------------------------------------------------------------------------


def test_a_recording_writes_its_digest_beside_its_trace(job: Path) -> None:
    files = sorted(os.listdir(job))
    assert files == (
        [f"digest_rank{r}.digest" for r in range(WORLD)]
        + [f"open_rank{r}.open" for r in range(WORLD) if r != 1]  # what each streamed rank has open
        + [f"trace_rank{r}.json" for r in range(WORLD)]
    )
    doc = orjson.loads((job / "digest_rank0.digest").read_bytes())
    assert doc["format"] == digestfile.FORMAT and doc["rank"] == 0 and doc["world_size"] == WORLD
    assert doc["run_id"] == "digest-test" and doc["step_name"] == "step"
    assert doc["trace"] == "trace_rank0.json" and doc["trace_bytes"] == os.path.getsize(job / "trace_rank0.json")
    names = doc["names"]
    rows = [names[k] for k in doc["spans"]["name"]]
    # Only the spans the step and collective analysis reads: steps, collectives marked or named
    # like one (marked collective=False included: the summary must see the mark); not fwd, op, opt.
    assert sorted(set(rows)) == ["all_reduce", "barrier", "step", "wait_data"]
    assert all(rows.count(n) == STEPS for n in set(rows))
    trace = merge.read_trace(str(job / "trace_rank0.json"))
    by_name: dict[str, list[int]] = {}
    for name, _, s, e, _ in trace.iter_spans():
        by_name.setdefault(name, []).append(e - s)
    st = doc["stats"]
    for name, ds in by_name.items():
        k = [i for i, n in enumerate(st["name"]) if names[n] == name]
        assert sum(st["count"][i] for i in k) == len(ds)
        assert sum(st["total"][i] for i in k) == sum(ds)
        assert max(st["max"][i] for i in k) == max(ds) and min(st["min"][i] for i in k) == min(ds)
    assert doc["warmup"] == {"steps": digest.WARMUP_STEPS + 1, "exact": True}
    # The rank's own metadata, as its trace's header carries it.
    header = orjson.loads((job / "trace_rank0.json").read_bytes())["metadata"]
    assert doc["metadata"] == header
    # The last rank saved inside an open step and all_reduce: unfinished rows, flagged.
    last = orjson.loads((job / f"digest_rank{WORLD - 1}.digest").read_bytes())
    assert last["unfinished"] == 2 and sum(1 for f in last["spans"]["flags"] if f & 4) == 2


@pytest.mark.parametrize("skip", [0, 3, 16])
def test_summary_from_digests_equals_summary_from_traces(job: Path, skip: int) -> None:
    paths = [str(job / f"trace_rank{r}.json") for r in range(WORLD)]
    full = full_summary(paths, skip)
    dig = digest_summary(paths, skip)
    assert full.steps is not None and full.collectives is not None
    assert full.steps.times_slowest[SLOW] >= (STEPS - skip) // 5 - 1 and full.steps.verdicts  # a real straggler
    slow = [o for o in full.collectives.occurrences if o.name == "all_reduce" and o.step % 5 == 2]
    assert slow and all(o.last_rank == SLOW and o.last_called for o in slow)
    assert any(o.waits_ns[0] > 0 for o in full.collectives.occurrences)
    # Steps, step and collective name rows are every span of those names: exact; fwd, op and
    # opt come from the aggregates.
    assert_same(full, dig, approximate={"fwd", "op", "opt"})
    assert set(dig.notes) == set(full.notes)
    assert any("unfinished" in n for n in dig.notes) and dig.counts[WORLD - 1].unfinished == 2
    if skip:
        assert any(f"({sum(c.warmup for c in full.counts.values()):,} spans)" in n for n in dig.notes)


def chunks(trace: Trace, size: int) -> list[Trace]:
    """`trace` cut into chunks of `size` spans, in order (as flushes hand them over)."""
    out = []
    sp = trace.spans
    for k in range(0, len(sp), size):
        part = Trace(dict(trace.metadata))
        part.processes, part.tracks, part.names = trace.processes, trace.tracks, trace.names
        for i in range(k, min(k + size, len(sp))):
            part.spans.append(sp.name[i], sp.track[i], sp.start[i], sp.end[i], sp.args[i])
        out.append(part)
    return out


def pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest's loops in Python (their references) rather than C."""
    monkeypatch.setattr(digest, "_rows_c", None)
    monkeypatch.setattr(digest, "_fold_c", None)


@pytest.mark.parametrize("loops", ["c", "python"])
def test_small_batches_give_the_digest_of_the_whole_trace(
    job: Path, monkeypatch: pytest.MonkeyPatch, loops: str
) -> None:
    """Fed in chunks and worked through a few spans at a time (steps arriving across batches,
    spans buffered until the warm-up steps are known, aggregates folded many times), the digest
    is the one made from the whole trace at once; with the C loops or the Python ones."""
    path = str(job / f"trace_rank{WORLD - 1}.json")  # with unfinished spans
    trace = merge.read_trace(path)
    whole = digest.from_trace(trace, "step")
    if loops == "python":
        pure_python(monkeypatch)
    elif digest._fold_c is None:
        pytest.skip("the C build is not in use")
    monkeypatch.setattr(digest, "BATCH_SPANS", 7)
    b = digest.Builder("step")
    for part in chunks(trace, 13):
        b.add(part)
    doc = b.document(dict(trace.rank_process(WORLD - 1).metadata), trace.metadata["base_ns"], "x")
    for key in ("spans", "stats", "warmup", "unfinished", "negative", "names", "tracks"):
        assert doc[key] == whole[key], key


def test_the_c_and_python_loops_make_the_same_digest(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if digest._fold_c is None:
        pytest.skip("the C build is not in use")
    traces = [merge.read_trace(str(job / f"trace_rank{r}.json")) for r in range(WORLD)]
    fast = [digest.from_trace(t, "step") for t in traces]
    pure_python(monkeypatch)
    assert [digest.from_trace(t, "step") for t in traces] == fast


@pytest.mark.parametrize("loops", ["c", "python"])
def test_other_tools_spans_do_not_count_towards_the_warm_up_buffer(monkeypatch: pytest.MonkeyPatch, loops: str) -> None:
    """Only the spans the statistics keep wait for the warm-up split: a rank with many other
    tools' (or inverted) spans still splits its warm-up exactly."""
    from array import array

    if loops == "python":
        pure_python(monkeypatch)
    monkeypatch.setattr(digest, "BATCH_SPANS", 1)  # each chunk worked through as it comes
    monkeypatch.setattr(digest, "BUFFER_SPANS", 70)  # the 64 kept spans of the first 16 steps fit
    b = digest.Builder("step")
    t = Trace({})
    from gputrace.trace.model import Process, Track

    own = t.add_process(Process(1, 0, "rank 0", 0))
    other = t.add_process(Process(99, None, "python3", None))
    t.add_track(Track(own, 1, "host", "cpu", None, 0))
    t.add_track(Track(other, 2, "kineto", "cpu", None, 0))
    op, step = t.intern("op"), t.intern("step")
    clock = 1_000
    for k in range(digest.WARMUP_STEPS + 3):
        for _ in range(3):
            t.spans.append(op, 0, clock, clock + 10, None)
            t.spans.append(op, 1, clock, clock + 5, None)  # another tool's
            t.spans.append(op, 0, clock + 9, clock + 1, None)  # inverted
            clock += 20
        t.spans.append(step, 0, clock - 60, clock, None)
        b.add(t)
        t.spans = type(t.spans).wrap(array("l"), array("l"), array("q"), array("q"), [])
    doc = b.document({"rank": 0}, 0, "rank 0")
    assert doc["warmup"] == {"steps": digest.WARMUP_STEPS + 1, "exact": True}
    assert doc["negative"] == 3 * (digest.WARMUP_STEPS + 3)
    ops = [i for i, n in enumerate(doc["stats"]["name"]) if doc["names"][n] == "op"]
    assert sum(doc["stats"]["count"][i] for i in ops) == 3 * (digest.WARMUP_STEPS + 3)
    assert len({doc["stats"]["bucket"][i] for i in ops}) == digest.WARMUP_STEPS + 1  # steps 0-15, the rest


def test_the_c_fold_takes_any_name_and_gives_huge_durations_to_python() -> None:
    from array import array

    if digest._fold_c is None:
        pytest.skip("the C build is not in use")
    args: tuple[Any, ...] = (array("l", [-1, 0]), array("l", [0, 0]), array("q", [0, 0]), array("q", [5, 7]))
    rest = (None, array("q"), 0, 1, digest._BOUND_COLUMN)
    assert digest._fold_c(*args, *rest) == digest._fold_py(*args, *rest)
    wide = (array("l", [0]), array("l", [0]), array("q", [-(2**62) - 10]), array("q", [2**62]))
    assert digest._fold_c(*wide, *rest) is NotImplemented
    assert digest._fold_spans(*wide, *rest)[1] == [1]  # counted, by Python's ints


@pytest.mark.parametrize("seed", range(8))
def test_the_c_loops_give_what_their_python_references_give(seed: int) -> None:
    """Random columns with other tools' spans, inverted and left-out ones, zero and huge
    durations, warm-up buckets by step starts or one bucket for all."""
    import random
    from array import array

    if digest._fold_c is None or digest._rows_c is None:
        pytest.skip("the C build is not in use")
    rng = random.Random(seed)
    n = rng.choice([0, 1, 50, 3000])
    names = array("l", (rng.randrange(6) for _ in range(n)))
    tracks = array("l", (rng.choice([0, 1, 2, -1]) if rng.random() < 0.1 else rng.randrange(3) for _ in range(n)))
    starts = array("q", (rng.randrange(10**12) for _ in range(n)))
    huge = 2**61 if seed % 2 else 2**40  # totals past 2^63 ns in some runs
    ends = array("q", (s + rng.choice([0, -5, rng.randrange(10**3), rng.randrange(10**9), huge]) for s in starts))
    skip = bytes(rng.random() < 0.05 for _ in range(n)) if rng.random() < 0.5 else None
    steps = array("q", sorted(rng.randrange(10**12) for _ in range(rng.randrange(0, 18))))
    mask = bytes(rng.random() < 0.4 for _ in range(6))
    assert digest._rows_c(names, tracks, starts, ends, mask) == digest._rows_py(names, tracks, starts, ends, mask)
    for bucket in (-1, 0, digest._REST):
        args = (names, tracks, starts, ends, skip, steps, bucket, digest._NB, digest._BOUND_COLUMN)
        c, py = digest._fold_c(*args), digest._fold_py(*args)
        if c is NotImplemented:  # a total past 2^63 ns
            assert max(py[2]) >= 2**63
            continue
        assert c == py
        if n > 100:
            assert len(c[0]) > 1 and sum(c[1]) > n // 2


def test_a_run_too_long_to_wait_for_its_steps_is_not_split(job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [str(job / f"trace_rank{r}.json") for r in range(WORLD)]
    monkeypatch.setattr(digest, "BATCH_SPANS", 16)
    monkeypatch.setattr(digest, "BUFFER_SPANS", 30)  # less than the 17 steps the split waits for

    def chunked(p: str) -> digestfile.RankDigest:
        b = digest.Builder("step")
        trace = merge.read_trace(p)
        for part in chunks(trace, 16):
            b.add(part)
        meta = dict(trace.rank_process(trace.ranks[0]).metadata)
        return digestfile.from_document(b.document(meta, trace.metadata["base_ns"], "r", p), p)

    digests = [chunked(p) for p in paths]
    assert not any(d.warmup_exact for d in digests)
    _, s = summary.summarize(digests, "step", 0)
    assert_same(full_summary(paths), s, approximate={"fwd", "op", "opt"})
    with pytest.raises(gputrace.GputraceError, match="summarized already"):
        summary.summarize(digests, "step", 0)
    # A trace digested whole (fed in batches) keeps its warm-up exact while its first steps fit
    # the buffer, as they do by default.
    monkeypatch.setattr(digest, "BUFFER_SPANS", 1 << 18)
    whole = digestfile.from_document(digest.from_trace(merge.read_trace(paths[0])), paths[0])
    monkeypatch.setattr(digest, "BUFFER_SPANS", 30)
    _, s = summary.summarize([whole, *map(chunked, paths[1:])], "step", 3)
    full = full_summary(paths, 3)
    assert s.steps == full.steps and s.collectives == full.collectives
    assert any("ranks 1-3 include their warm-up" in n for n in s.notes)
    assert s.counts[0] == full.counts[0] and s.counts[1].warmup == 0


def test_warm_up_beyond_what_the_digest_splits_is_said(job: Path) -> None:
    paths = [str(job / f"trace_rank{r}.json") for r in range(WORLD)]
    skip = digest.WARMUP_STEPS + 2
    full = full_summary(paths, skip)
    dig = digest_summary(paths, skip)
    assert dig.steps == full.steps and dig.collectives == full.collectives
    assert any("include their warm-up" in n for n in dig.notes)
    assert all(c.warmup == 0 for c in dig.counts.values())  # not told apart, and not claimed to be


def test_the_command_reads_digests_and_says_so(job: Path) -> None:
    r = CliRunner().invoke(main, ["summary", "--json", str(job)])
    assert r.exit_code == 0, r.output
    dig = orjson.loads(r.output)
    assert dig["notes"][0].startswith(f"read from the ranks' digests ({WORLD} ranks)")
    assert "percentiles are approximate" in dig["notes"][0]
    r = CliRunner().invoke(main, ["summary", "--json", "--full", str(job)])
    assert r.exit_code == 0, r.output
    full = orjson.loads(r.output)
    assert full["notes"][0] == "read from the full traces"
    assert dig["steps"] == full["steps"] and dig["collectives"] == full["collectives"]
    assert dig["counts"] == full["counts"] and dig["notes"][1:] == full["notes"][1:]
    # A selection reads the full traces of what it selects, and only those.
    r = CliRunner().invoke(main, ["summary", "--json", "--ranks", "1-2", "--steps", "2:4", str(job)])
    assert r.exit_code == 0, r.output
    sel = orjson.loads(r.output)
    assert sel["ranks"] == [1, 2] and sel["steps"]["count"] == 2
    assert sel["notes"][0].startswith("read from the full traces of ranks 1-2 and steps 2:4")
    table = CliRunner().invoke(main, ["summary", str(job)]).output
    assert "rank 2 was slowest most often" in table and "note: read from the ranks' digests" in table


def test_a_stale_or_missing_digest_is_computed_from_its_trace(
    tmp_path: Path, job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for f in os.listdir(job):
        (tmp_path / f).write_bytes((job / f).read_bytes())
    (tmp_path / "digest_rank1.digest").unlink()
    with open(tmp_path / "trace_rank2.json", "ab") as f:
        f.write(b" ")  # the trace changed after its digest was written
    paths = [str(tmp_path / f"trace_rank{r}.json") for r in range(WORLD)]
    s = summary.summary_of_files(paths)  # not every rank has one: few ranks, so the full traces
    assert s.notes[0] == "read from the full traces"
    monkeypatch.setattr(summary, "DIGEST_MIN_RANKS", 2)  # many ranks: digests, the others computed
    s = summary.summary_of_files(paths)
    assert "ranks 1-2 had no digest as new as their trace" in s.notes[0]
    assert_same(full_summary(paths), dataclasses.replace(s, notes=s.notes[1:]), approximate={"fwd", "op", "opt"})
    # A digest cut short (the machine went down before it reached the disk) is made again too.
    (tmp_path / "digest_rank3.digest").write_bytes(b"")
    s = summary.summary_of_files(paths)
    assert "ranks 1-3 had no digest as new as their trace" in s.notes[0]
    assert_same(full_summary(paths), dataclasses.replace(s, notes=s.notes[1:]), approximate={"fwd", "op", "opt"})


def test_digests_follow_merge_checks(tmp_path: Path, job: Path) -> None:
    """Mixed runs and the same rank twice are the errors merge makes of them."""
    d0 = digestfile.read(str(job / "digest_rank0.digest"))
    other = tmp_path / "digest_rank0.digest"
    other.write_bytes((job / "digest_rank0.digest").read_bytes())
    with pytest.raises(gputrace.MergeError, match="rank 0 appears twice"):
        summary.load([d0, digestfile.read(str(other))])
    doc = orjson.loads((job / "digest_rank1.digest").read_bytes())
    doc["metadata"]["run_id"] = "another-run"
    with pytest.raises(gputrace.MergeError, match="different runs"):
        summary.load(
            [digestfile.read(str(job / "digest_rank0.digest")), digestfile.from_document(doc, "x/digest_rank1.digest")]
        )
    bad = tmp_path / "cut" / "digest_rank0.digest"
    bad.parent.mkdir()
    bad.write_bytes((job / "digest_rank0.digest").read_bytes()[:500])
    r = CliRunner().invoke(main, ["summary", str(bad)])
    assert r.exit_code == 2 and "not a gputrace digest" in r.output and r.output.count("\n") == 1


def test_a_step_name_other_than_the_digests_reads_the_traces(job: Path) -> None:
    paths = [str(job / f"trace_rank{r}.json") for r in range(WORLD)]
    s = summary.summary_of_files(paths, step="fwd")
    assert s.notes[0].startswith("read from the full traces (the digests mark steps with 'step'")
    assert s.steps is not None and s.steps.name == "fwd"


def test_the_step_name_option_marks_the_digests_steps(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False, step_name="iteration")
    for i in range(3):
        with gputrace.span("iteration", i=i):
            with gputrace.span("fwd"):
                time.sleep(0.0002)
    gputrace.save()
    doc = orjson.loads((tmp_path / "digest_rank0.digest").read_bytes())
    assert doc["step_name"] == "iteration" and len(doc["spans"]["name"]) == 3
    s = summary.summary_of_files([str(tmp_path)])  # no --step: the digests' own step name
    assert s.steps is not None and s.steps.name == "iteration" and s.steps.count == 3
    assert s.notes[0].startswith("read from the ranks' digests (1 rank)")
    _reset()
    # Digests of a run without its step spans: asked for, they are an error that names the spans.
    gputrace.enable(out_dir=str(tmp_path / "nosteps"), cuda=False, step_name="iteration")
    for _ in range(3):
        with gputrace.span("fwd"):
            time.sleep(0.0002)
        with gputrace.span("bwd"):
            pass
    gputrace.save()
    with pytest.raises(stats.UnknownStepError, match="no span is named 'iteration'.*: 'fwd', 'bwd'"):
        summary.summary_of_files([str(tmp_path / "nosteps")], step="iteration")


def test_a_perfetto_stream_writes_its_digest_too(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False, format="perfetto")
    for i in range(20):
        with gputrace.span("step", i=i):
            with gputrace.span("fwd"):
                time.sleep(0.0001)
            with gputrace.span("all_gather"):
                pass
        if i % 6 == 5:
            gputrace.flush()
    trace = gputrace.save()
    assert trace.endswith("trace_rank0.pftrace") and (tmp_path / "digest_rank0.digest").is_file()
    assert_same(full_summary([trace]), digest_summary([trace]), approximate={"fwd"})


def test_sigterm_finishes_the_trace_and_writes_the_digest(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stream_worker", str(tmp_path), "100000", "--sleep-ms", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for _ in range(30):
        assert proc.stdout.readline()
    proc.terminate()
    proc.communicate(timeout=60)
    trace = str(tmp_path / "trace_rank0.json")
    d = digestfile.read(str(tmp_path / "digest_rank0.digest"))
    assert d.trace_bytes == os.path.getsize(trace)
    assert_same(full_summary([trace]), digest_summary([trace]), approximate={"op"})


# ---- real gloo processes ------------------------------------------------------------------------

SHIFT = 30_000_000  # rank 1's host clock runs 30 ms ahead


def worker(out: str, shift_ns: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        gputrace.set_host_clock(HostClock(shift_ns=shift_ns))
    mine = os.path.join(out, f"rank{rank}")
    gputrace.enable(cuda=False, out_dir=mine)
    gputrace.sync_clocks(exchanges=8)
    t = torch.ones(1000)
    for i in range(8):
        with gputrace.span("step", step=i):
            with gputrace.span("compute"):
                time.sleep(0.002 + 0.010 * rank)  # rank 1 is the straggler, by more than a loaded machine's noise
            with gputrace.span("all_reduce"):
                dist.all_reduce(t)
        gputrace.flush()
    gputrace.sync_clocks(exchanges=8)
    gputrace.save()
    written = session.gather_digests(out_dir=os.path.join(out, "rank0"))
    print(orjson.dumps({"rank": rank, "gathered": written}).decode(), flush=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    out = tmp_path_factory.mktemp("gloo")
    return out, run_rank_processes(["tests.test_digest", "worker", str(out), str(SHIFT)], 2)


@pytest.mark.dist
def test_gloo_ranks_summary_from_digests_equals_full(gloo: tuple[Path, dict[int, Any]]) -> None:
    out, results = gloo
    paths = [str(out / "rank0" / "trace_rank0.json"), str(out / "rank1" / "trace_rank1.json")]
    full = full_summary(paths)
    dig = digest_summary(paths)
    assert full.steps is not None and full.steps.times_slowest == {0: 0, 1: 8}
    assert full.collectives is not None and len(full.collectives.occurrences) == 8
    # The shift is aligned away in both (the same maps): arrivals are within milliseconds.
    assert all(abs(o.arrivals[0] - o.arrivals[1]) < SHIFT / 2 for o in full.collectives.occurrences)
    assert_same(full, dig, approximate={"compute"})
    assert set(dig.notes) == set(full.notes)


@pytest.mark.dist
def test_gather_brings_every_digest_to_rank_0(gloo: tuple[Path, dict[int, Any]]) -> None:
    out, results = gloo
    home = out / "rank0"
    assert sorted(results[0]["gathered"]) == [str(home / "digest_rank0.digest"), str(home / "digest_rank1.digest")]
    assert results[1]["gathered"] == []
    # The same digest (the process's exit saved once more: its header says how the rank was found).
    there = orjson.loads((out / "rank1" / "digest_rank1.digest").read_bytes())
    here = orjson.loads((home / "digest_rank1.digest").read_bytes())
    for key in ("rank", "run_id", "spans", "stats", "names", "tracks", "base_ns"):
        assert here[key] == there[key]
    assert here["metadata"]["clock"] == there["metadata"]["clock"]
    # Rank 0's directory alone: its trace and both digests; the summary needs no other disk.
    r = CliRunner().invoke(main, ["summary", "--json", str(home)])
    assert r.exit_code == 0, r.output
    here = orjson.loads(r.output)
    paths = [str(out / "rank0" / "trace_rank0.json"), str(out / "rank1" / "trace_rank1.json")]
    full = stats.to_json(full_summary(paths))
    assert here["ranks"] == [0, 1] and here["steps"] == full["steps"] and here["collectives"] == full["collectives"]
    r = CliRunner().invoke(main, ["summary", "--json", "--full", str(home)])  # the traces here: rank 0's alone
    assert r.exit_code == 0, r.output
    assert orjson.loads(r.output)["ranks"] == [0]
    assert "1 digests without their traces here are left out" in orjson.loads(r.output)["notes"][0]


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]))
