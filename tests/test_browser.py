"""Traces loaded into the real Perfetto UI in headless Chromium, checked by SQL on Perfetto's
own tables: no import errors, every slice, the right process and thread names."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

import gputrace
from gputrace import merge

from . import perfetto_ui
from .conftest import install
from .fakes import FakeDevice
from .test_dist import run_ranks

pytestmark = pytest.mark.browser
SAMPLES = Path(__file__).resolve().parent.parent / "samples"

why_not = perfetto_ui.available()
if why_not:
    pytestmark = [pytestmark, pytest.mark.skip(reason=why_not)]  # type: ignore[assignment]


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with perfetto_ui.perfetto_ui(tmp_path_factory.mktemp("ui")) as u:
        yield u


def x_events(path: Path) -> int:
    from gputrace.trace import chrome

    return len(chrome.read(str(path)).spans)


def test_per_rank_trace_with_streams_and_misuse(ui, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = FakeDevice(read_ns=500)
    install(fake)
    side = fake.new_stream()
    for i in range(5):
        with gputrace.span("step", step=i):
            with gputrace.span("fwd"):
                fake.work(2_000_000)
            with fake.stream(side), gputrace.span("copy"):
                fake.work(500_000)
            with gputrace.span("host", timer_type="cpu"):
                pass
    outer = gputrace.span("outer", timer_type="cpu").start()
    inner = gputrace.span("inner \u2713 </script>", timer_type="cpu", text='q"uote\nnl').start()
    with pytest.warns(gputrace.GputraceWarning):
        outer.end()
    fake.advance(10_000)
    inner.end()
    gputrace.span("open at save", timer_type="cpu").start()
    fake.advance(50_000_000)
    path = Path(gputrace.save(tmp_path))
    r = ui.report(path)
    assert r["errors"] == []
    launches = sum(e.get("cat") == "launch" for e in orjson.loads(path.read_bytes())["traceEvents"])
    assert x_events(path) == 5 * 4 + 3 and launches > 0  # the CUDA spans' launch arrows start on slices too
    assert r["slices"] == x_events(path) + launches
    assert r["processes"] == ["rank 0 (" + __import__("socket").gethostname() + ", Fake GPU 0)"]
    assert r["threads"] == sorted(
        [
            "cuda:0 default stream",
            "cuda:0 stream 1",
            "launches (host)",
            "thread MainThread (host)",
            "thread MainThread (host) (overflow 1)",
        ]
    )


def test_merged_gloo_ranks(ui, tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "ranks"
    run_ranks(out, 20_000_000)
    merged = tmp_path / "merged.json"
    merge.merge([str(out)], str(merged))
    for path, processes in [(out / "trace_rank1.json", 1), (merged, 2)]:
        r = ui.report(path)
        assert r["errors"] == [], path
        assert r["slices"] == x_events(path)
        assert len(r["processes"]) == processes
        assert all(p.startswith("rank ") for p in r["processes"])


def test_deep_nesting_loads(ui, tmp_path) -> None:  # type: ignore[no-untyped-def]
    gputrace.enable(cuda=False)
    hs = [gputrace.span("d", level=i).start() for i in range(200)]
    for h in reversed(hs):
        h.end()
    path = gputrace.save(tmp_path)
    r = ui.report(path)
    assert r["errors"] == [] and r["slices"] == 200 and r["max_depth"] == 199


@pytest.mark.parametrize("sample", sorted(str(p.relative_to(SAMPLES)) for p in SAMPLES.glob("*/*.json")))
def test_gpu_samples(ui, sample) -> None:  # type: ignore[no-untyped-def]
    path = SAMPLES / sample
    r = ui.report(path)
    assert r["errors"] == []
    assert r["slices"] == x_events(path)
    assert all(p.startswith("rank ") and "NVIDIA H200" in p for p in r["processes"])
    assert any(t.startswith("cuda:") for t in r["threads"])
