"""The nanotron-compatible timer facade, with exact durations from a fake clock."""

from __future__ import annotations

import logging
import pkgutil

import pytest

import gputrace
from gputrace import TimerType, timer

from .conftest import install, run_py, spans_of
from .fakes import FakeDevice

MS = 1_000_000


def test_cuda_timer_context_manager_start_end_and_values() -> None:
    fake = FakeDevice()
    install(fake)
    with timer("fwd"):
        fake.work(3 * MS)
    t = timer("fwd").start()
    fake.work(5 * MS)
    t.end()
    fake.advance(20 * MS)
    rec = timer("fwd")
    assert rec.call_count == 2
    assert rec.total_time == pytest.approx(8e-3, abs=1e-9)
    assert rec.average_time == pytest.approx(4e-3, abs=1e-9)
    assert rec.elapsed == pytest.approx(5e-3, abs=1e-9)
    assert [e["name"] for e in spans_of(gputrace.trace_dict())] == ["fwd", "fwd"]


def test_every_decorator_form() -> None:
    gputrace.enable(cuda=False)

    @timer
    def a() -> str:
        return "a"

    @timer("named")
    def b() -> str:
        return "b"

    @timer("cpu timer", timer_type=TimerType.CPU)
    def c() -> str:
        return "c"

    assert [a(), b(), b(), c()] == ["a", "b", "b", "c"]
    assert timer("named").call_count == 2
    assert timer("cpu timer").call_count == 1
    assert timer("test_every_decorator_form.<locals>.a").call_count == 1
    assert timer("named").total_time > 0


def test_strings_select_the_timer_type_and_a_mismatch_warns() -> None:
    gputrace.enable(cuda=False)
    assert timer("x", timer_type="cpu").timer_type is TimerType.CPU
    with pytest.warns(gputrace.GputraceWarning, match="exists as cpu"):
        timer("x", timer_type="cuda")


def test_log_and_log_all_print_on_the_asked_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gputrace.enable(cuda=False)
    with timer("opt"):
        pass
    timer.log("opt")
    timer.log_all()
    out = capsys.readouterr().out
    assert out.count("Timer 'opt' (cpu: recorded without CUDA): ") == 2 and "1 calls" in out  # cuda=False
    monkeypatch.setenv("RANK", "1")
    timer.log("opt")  # rank 0 only, and this is rank 1
    timer.log_all(rank=0)
    assert capsys.readouterr().out == ""
    timer.log_all(rank=None)
    assert "rank 1" in capsys.readouterr().out


def test_log_goes_to_a_given_logger(caplog: pytest.LogCaptureFixture) -> None:
    gputrace.enable(cuda=False)
    with timer("step"):
        pass
    with caplog.at_level(logging.INFO):
        timer.log("step", logger=logging.getLogger("train"))
    assert "Timer 'step'" in caplog.text


def test_enable_disable_reset_and_no_values_while_off() -> None:
    assert not timer.is_enabled()
    with timer("off"):
        pass
    with pytest.warns(gputrace.GputraceWarning, match="recording was never turned on"):
        assert timer("off").call_count == 0 and timer("off").total_time == 0.0
    timer.enable(cuda=False)
    assert timer.is_enabled() and gputrace.is_enabled()
    with timer("on"):
        pass
    assert timer("on").call_count == 1
    timer.reset("on")
    assert timer("on").call_count == 0 and timer("on").total_time == 0.0
    timer.disable()
    assert not gputrace.is_enabled()


def test_exception_in_timer_is_marked_and_counted() -> None:
    gputrace.enable(cuda=False)
    with pytest.raises(KeyError):
        with timer("bad"):
            raise KeyError("x")
    assert timer("bad").call_count == 1
    assert spans_of(gputrace.trace_dict())[0]["args"] == {"error": "KeyError"}


def test_cuda_sync_timers_synchronize_as_nanotron_does() -> None:
    fake = FakeDevice()
    install(fake)
    with timer("synced", cuda_sync=True):
        fake.work(MS)
    assert fake.device_syncs == 2


def test_no_module_of_the_package_is_named_like_a_public_name() -> None:
    # `import gputrace.<module>` sets that attribute of the package to the module.
    modules = {m.name for m in pkgutil.iter_modules(gputrace.__path__)}
    assert not modules & set(gputrace.__all__)


def test_the_public_timer_stays_the_timer_whatever_was_imported_before() -> None:
    r = run_py(
        """
import importlib, pkgutil, types
import gputrace
for m in pkgutil.walk_packages(gputrace.__path__, "gputrace."):
    if m.name != "gputrace.__main__":
        importlib.import_module(m.name)
from gputrace import timer
from gputrace._timer import Timers
shadowed = [n for n in gputrace.__all__ if isinstance(getattr(gputrace, n), types.ModuleType)]
assert not shadowed, shadowed
assert isinstance(timer, Timers), type(timer)
gputrace.enable(cuda=False)
with timer("fwd"):
    pass
assert gputrace.timer("fwd").call_count == 1
print("ok")
""",
        env={"PYTHONWARNINGS": "ignore"},
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_timers_read_or_logged_while_recording_was_never_on_hint_once(capsys: pytest.CaptureFixture[str]) -> None:
    with timer("fwd"):
        pass
    with pytest.warns(gputrace.GputraceWarning, match="recording was never turned on") as seen:
        assert timer("fwd").total_time == 0.0
        assert timer("fwd").elapsed == 0.0
        timer.log_all()
        timer.log("fwd")
    assert len(seen) == 1 and seen[0].filename == __file__  # points at the user's line
    assert capsys.readouterr().out == ""  # nothing recorded: nothing to print


def test_no_hint_once_recording_has_been_on() -> None:
    gputrace.enable(cuda=False)
    gputrace.disable()
    with timer("fwd"):  # off now, but it was on: the user knows
        pass
    assert timer("fwd").total_time == 0.0  # GputraceWarning is an error in this suite
    timer.log_all()
