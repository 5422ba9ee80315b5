from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from gputrace import native, session
from gputrace.clock import HostClock
from gputrace.config import Config
from gputrace.record import Recorder

from .fakes import FakeDevice

EPOCH = 1_700_000_000_000_000_000  # the fake realtime clock's epoch offset

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def validate_written_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trace a test writes (saved or merged) must pass `gputrace validate`."""
    from gputrace.trace import files
    from gputrace.trace.digestfile import is_digest_path
    from gputrace.validate import format_report, validate_file

    real = files.publish

    def checked(tmp: str, path: str) -> None:
        real(tmp, path)
        if path.endswith(".json") and not is_digest_path(path):  # a digest is not a trace
            report = validate_file(path)
            assert report.ok, format_report(report)

    monkeypatch.setattr(files, "publish", checked)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with recording off and no recorder, and must leave none running."""
    for name in ("GPUTRACE", "ENABLE_TIMERS", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith("GPUTRACE_"):
            monkeypatch.delenv(name)
    _reset()
    yield
    _reset()


def _reset() -> None:
    # One object holds the process-wide state (recorders, captures, warnings given, disabled
    # handles, the last digest, gloo groups, timers): closing the session clears it.
    session.SESSION.close()


def fake_clock(fake: FakeDevice) -> HostClock:
    return HostClock(monotonic_ns=fake.monotonic_ns, realtime_ns=lambda: fake.now + EPOCH)


def install(fake: FakeDevice | None = None, **options: Any) -> Recorder:
    """A recorder driven by `fake` (None: host spans only, on the real clock), made current."""
    clock = fake_clock(fake) if fake is not None else HostClock()
    if fake is not None:  # each flush anchors, as flushes a real step apart do (tests of the period set it)
        options.setdefault("anchor_every_ms", 0)
    config = Config().replace(**options)
    rec = Recorder(config, fake, clock)
    session.SESSION.config = config
    session.SESSION.install(rec)
    return rec


def spans_of(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """X events with absolute `start`/`end` ns and the track name added (not the zero-length
    sources of launch arrows: they are not spans)."""
    base = trace["baseTimeNanoseconds"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    out = []
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e.get("cat") != "launch":
            start = base + round(e["ts"] * 1000)
            out.append(
                {**e, "start": start, "end": start + round(e["dur"] * 1000), "track": names[(e["pid"], e["tid"])]}
            )
    return out


def run_py(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout)


def read_json(path: Any) -> dict[str, Any]:
    """A Chrome trace file as the dict it holds (the object form; tests that read other forms
    use the trace model's reader)."""
    import orjson

    with open(path, "rb") as f:
        return orjson.loads(f.read())  # type: ignore[no-any-return]


def run_rank_processes(
    module_args: list[str], world: int, envs: list[dict[str, str | None]] | None = None, timeout: float = 240
) -> dict[int, dict[str, Any]]:
    """Start `world` real torch.distributed processes (`python -m <module_args>`, the torchrun
    variables set, a free port), wait for them, and return each one's last stdout line (JSON
    with a "rank") by rank. `envs`: extra variables per rank (None values are removed)."""
    import orjson

    from gputrace.demo import free_port, rank_environment

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    pythonpath = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    procs = []
    for r in range(world):
        env = {**os.environ, **rank_environment(r, world, port), "PYTHONPATH": pythonpath}
        for k, v in (envs[r] if envs else {}).items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", *module_args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=root,
            )
        )
    results = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stderr
        line = orjson.loads(stdout.strip().splitlines()[-1])
        results[line["rank"]] = line
    return results


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium for a module's page tests (skipped by the modules where it is absent)."""
    from .perfetto_ui import chromium

    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def still_ui(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A stand-in for the Perfetto UI that loads nothing, for pages whose timeline is not tested
    (the real UI's WebAssembly would take the machine's two cores)."""
    from gputrace.viewer import server

    d = tmp_path_factory.mktemp("still-ui")
    (d / "index.html").write_text("<!doctype html><title>no timeline here</title>")
    return server.resolve_ui(str(d))


#: The C and the pure-Python twin, for tests parametrized over both in one process (with
#: `twins_restored`, which puts the build in use back afterwards).
TWINS = [
    pytest.param(False, id="python"),
    pytest.param(True, id="c", marks=pytest.mark.skipif(native.hot is None, reason="the C build is not in use")),
]


@pytest.fixture()
def twins_restored() -> Iterator[None]:
    before = native.hot is not None
    yield
    session.reset()
    native.use(before)


def random_cover_columns(rng: Any) -> tuple[Any, ...]:
    """Random columns for the breakdown's cover loops (`digest_breakdown._cover_py` and its C
    twin): nested, overlapping, equal and inverted spans on a few tracks, other tools' (track -1)
    and left-out ones, a name mask, and steps (their starts as a sorted list, ends, tracks)."""
    from array import array

    n = rng.choice([0, 1, 60, 3000])
    names = array("l", (rng.randrange(6) for _ in range(n)))
    tracks = array("l", (-1 if rng.random() < 0.05 else rng.randrange(4) for _ in range(n)))
    starts = array("q", (rng.randrange(10**6) for _ in range(n)))
    ends = array("q", (s + rng.choice([0, -5, rng.randrange(10**3), rng.randrange(10**5)]) for s in starts))
    skip = bytes(rng.random() < 0.05 for _ in range(n)) if rng.random() < 0.5 else None
    mask = bytes(rng.random() < 0.3 for _ in range(6))
    ss = sorted(rng.randrange(10**6) for _ in range(rng.randrange(0, 20)))
    se = array("q", (s + rng.randrange(10**5) for s in ss))
    st = array("q", (rng.randrange(4) for _ in ss))
    return names, tracks, starts, ends, skip, mask, ss, se, st


@pytest.fixture
def toy() -> Iterator[Any]:
    """The toy format (tests/toy_format.py) registered for one test, and gone after it."""
    from gputrace.trace import registry

    from . import toy_format

    fmt = registry.register(registry.Format("toy", (".toy",), toy_format.recognise, "tests.toy_format"))
    try:
        yield fmt
    finally:
        registry.unregister("toy")
    assert "toy" not in registry.names()
