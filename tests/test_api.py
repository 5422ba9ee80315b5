"""The recording API in all its forms, on host tracks and on a fake device."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import orjson
import pytest

import gputrace
from gputrace import record
from gputrace.errors import ConfigError, GputraceError, GputraceWarning

from .conftest import install, run_py, spans_of
from .fakes import FakeDevice


def names_by_track(trace: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for e in sorted(spans_of(trace), key=lambda e: (e["start"], -e["end"])):
        out.setdefault(e["track"], []).append(e["name"])
    return out


def test_disabled_span_is_one_shared_do_nothing_object() -> None:
    assert not gputrace.is_enabled()
    assert gputrace.span("a") is gputrace.span("a")
    with gputrace.span("a"):
        pass
    with pytest.raises(GputraceError, match="enable"):
        gputrace.trace_dict()


def test_context_manager_nesting_and_args() -> None:
    gputrace.enable(cuda=False)
    with gputrace.span("step", step=3):
        with gputrace.span("fwd"):
            pass
        with gputrace.span("bwd"):
            pass
    spans = {e["name"]: e for e in spans_of(gputrace.trace_dict())}
    assert spans["step"]["args"] == {"step": 3}
    assert "args" not in spans["fwd"]
    for child in ("fwd", "bwd"):
        assert spans["step"]["start"] <= spans[child]["start"] <= spans[child]["end"] <= spans["step"]["end"]
    assert spans["fwd"]["end"] <= spans["bwd"]["start"]
    assert spans["step"]["tid"] == spans["fwd"]["tid"]


def test_decorator_forms_and_enabling_after_decoration() -> None:
    @gputrace.span
    def bare() -> int:
        return 1

    @gputrace.span("named")
    def named() -> int:
        return 2

    @gputrace.span("cpu one", timer_type="cpu", layer=4)
    def with_args() -> int:
        return 3

    assert (bare(), named(), with_args()) == (1, 2, 3)  # recording off: plain calls
    gputrace.enable(cuda=False)
    assert (bare(), named(), with_args()) == (1, 2, 3)
    spans = spans_of(gputrace.trace_dict())
    names = sorted(e["name"] for e in spans)
    assert names == sorted(["test_decorator_forms_and_enabling_after_decoration.<locals>.bare", "named", "cpu one"])
    assert next(e for e in spans if e["name"] == "cpu one")["args"] == {"layer": 4}
    assert bare.__name__ == "bare"


def test_start_end_handles_and_the_loop_idiom() -> None:
    gputrace.enable(cuda=False)
    outer = gputrace.span("epoch").start()
    for i in range(3):
        gputrace.span("iteration", i=i).start()
        gputrace.span("iteration").end()  # a fresh handle closes the innermost open one
    outer.end()
    spans = spans_of(gputrace.trace_dict())
    assert [e["name"] for e in spans].count("iteration") == 3
    its = sorted((e for e in spans if e["name"] == "iteration"), key=lambda e: e["start"])
    assert [e["args"]["i"] for e in its] == [0, 1, 2]
    assert all(a["end"] <= b["start"] for a, b in zip(its, its[1:]))


def test_end_without_start_warns_once_and_records_nothing() -> None:
    gputrace.enable(cuda=False)
    with pytest.warns(GputraceWarning, match="none is open"):
        gputrace.span("ghost").end()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gputrace.span("ghost").end()  # the second time: silent
    assert spans_of(gputrace.trace_dict()) == []


def test_exception_closes_the_span_and_marks_it() -> None:
    gputrace.enable(cuda=False)
    with pytest.raises(ValueError):
        with gputrace.span("outer"):
            with gputrace.span("inner", k=1):
                raise ValueError("boom")
    spans = {e["name"]: e for e in spans_of(gputrace.trace_dict())}
    assert spans["inner"]["args"] == {"k": 1, "error": "ValueError"}
    assert spans["outer"]["args"] == {"error": "ValueError"}
    assert record.ACTIVE is not None and record.ACTIVE.open_spans() == []


def test_spans_entered_the_ways_contextlib_enters_them() -> None:
    """ExitStack calls `type(cm).__enter__(cm)` and `type(cm).__exit__(cm, ...)`; the handle's
    own methods are called bound. Each records as a `with` does, recording on or off."""
    import contextlib

    for on in (False, True):
        if on:
            gputrace.enable(cuda=False)
        with contextlib.ExitStack() as stack:
            entered = stack.enter_context(gputrace.span("stacked", k=1))
            assert entered.name == "stacked"
        s = gputrace.span("unbound")
        assert type(s).__enter__(s) is s
        assert not type(s).__exit__(s, KeyError, KeyError(), None)
        b = gputrace.span("bound")
        assert b.__enter__() is b
        b.__exit__(None, None, None)
        with pytest.raises(TypeError):
            type(s).__exit__(s)  # __exit__ takes the exception's three values
    spans = {e["name"]: e for e in spans_of(gputrace.trace_dict())}
    assert sorted(spans) == ["bound", "stacked", "unbound"]
    assert spans["stacked"]["args"] == {"k": 1}
    assert spans["unbound"]["args"] == {"error": "KeyError"}
    assert "args" not in spans["bound"]


def test_a_span_made_after_many_closed_carries_nothing_of_theirs() -> None:
    """Closed spans' memory is reused for new ones: nothing of the old span may leak into a new
    one (its options, args, error, times, track, or its place in the collector's view)."""
    import gc

    gputrace.enable(cuda=False)
    for i in range(600):
        try:
            with gputrace.span("old", i=i, timer_type="cpu", cuda_sync=True):
                raise ValueError
        except ValueError:
            pass
    gputrace.flush()
    fresh = gputrace.span("fresh")
    assert (fresh.name, fresh.args, fresh.cuda, fresh.sync) == ("fresh", None, True, False)
    assert gc.is_tracked(fresh) and fresh.track is None
    with pytest.raises(AttributeError):
        fresh.t0  # noqa: B018 - a span not yet opened has no start
    t = threading.Thread(target=lambda: gputrace.span("new").start().end())
    t.start()
    t.join()
    with gputrace.span("plain"):
        pass
    spans = spans_of(gputrace.trace_dict())
    plain = [e for e in spans if e["name"] == "plain"]
    new = [e for e in spans if e["name"] == "new"]
    assert len(plain) == len(new) == 1 and "args" not in plain[0] and "args" not in new[0]
    assert new[0]["tid"] != plain[0]["tid"]
    assert plain[0]["start"] >= max(e["end"] for e in spans if e["name"] == "old")


def test_a_subclass_of_span_with_a_call_of_its_own_still_enters_and_exits() -> None:
    gputrace.enable(cuda=False)

    class Sub(gputrace.Span):  # type: ignore[misc,valid-type]
        def __call__(self, fn: object) -> object:
            return fn

    with Sub("sub") as s:
        assert s.name == "sub"
    assert Sub("x")(len) is len
    assert [e["name"] for e in spans_of(gputrace.trace_dict())] == ["sub"]


def test_the_c_handles_enter_and_exit_slots_cannot_be_made_by_hand() -> None:
    if record._hot is None:
        pytest.skip("the C build is not in use")
    slot = type(record._hot.Span.__dict__["__enter__"])
    with pytest.raises(TypeError):
        slot()


def test_threads_get_their_own_tracks() -> None:
    gputrace.enable(cuda=False)
    barrier = threading.Barrier(3)

    def work(tag: str) -> None:
        barrier.wait()
        for i in range(50):
            with gputrace.span(f"{tag}-outer"):
                with gputrace.span(f"{tag}-inner"):
                    pass

    threads = [threading.Thread(target=work, args=(t,), name=f"worker-{t}") for t in "ab"]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    by_track = names_by_track(gputrace.trace_dict())
    assert set(by_track) == {"thread worker-a (host)", "thread worker-b (host)"}
    assert by_track["thread worker-a (host)"] == ["a-outer", "a-inner"] * 50


def test_cuda_spans_on_a_fake_device_go_on_stream_tracks() -> None:
    fake = FakeDevice()
    install(fake)
    side = fake.new_stream()
    with gputrace.span("compute"):
        fake.work(1_000_000)
        with fake.stream(side), gputrace.span("copy"):
            fake.work(500_000)
        with gputrace.span("host work", timer_type=gputrace.TimerType.CPU):
            pass
    by_track = names_by_track(gputrace.trace_dict())
    assert by_track == {
        "cuda:0 default stream": ["compute"],
        "cuda:0 stream 1": ["copy"],
        "thread MainThread (host)": ["host work"],
    }
    # Copy and compute overlap in time across streams.
    spans = {e["name"]: e for e in spans_of(gputrace.trace_dict())}
    assert spans["copy"]["start"] < spans["compute"]["end"]


def test_the_hot_path_never_waits_on_the_device() -> None:
    fake = FakeDevice()
    rec = install(fake, max_pending=8)
    for _ in range(100):
        with gputrace.span("s"):
            fake.work(10_000)
        fake.advance(20_000)  # the host runs on; the device keeps up
    assert fake.device_syncs == 0  # auto-flushes ask events and anchor on the side stream
    assert fake.events_made < 100  # pooled: far fewer events than the 200 records
    assert len(rec.pending) < 100


def test_cuda_sync_option_synchronizes_around_each_record() -> None:
    fake = FakeDevice()
    install(fake)
    with gputrace.span("synced", cuda_sync=True):
        fake.work(1000)
    assert fake.device_syncs == 2


def test_spans_during_graph_capture_are_skipped_and_counted() -> None:
    fake = FakeDevice()
    install(fake)
    with gputrace.span("before"):
        pass
    fake.capturing = True
    with pytest.warns(GputraceWarning, match="capture"):
        with gputrace.span("captured"):
            pass
    fake.capturing = False
    trace = gputrace.trace_dict()
    assert [e["name"] for e in spans_of(trace)] == ["before"]
    assert trace["metadata"]["spans_skipped_in_cuda_graph_capture"] == 1


def test_open_spans_are_saved_as_unfinished(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gputrace.enable(cuda=False)
    s = gputrace.span("still running").start()
    path = gputrace.save(tmp_path)
    assert path.endswith("trace_rank0.json")
    trace = orjson.loads(Path(path).read_bytes())
    assert [e["args"] for e in spans_of(trace)] == [{"unfinished": True}]
    s.end()
    assert spans_of(gputrace.trace_dict())[0].get("args") is None


def test_disable_keeps_what_was_recorded_and_lets_open_spans_close() -> None:
    gputrace.enable(cuda=False)
    s = gputrace.span("a").start()
    gputrace.disable()
    s.end()
    with gputrace.span("not recorded"):
        pass
    gputrace.enable()
    assert [e["name"] for e in spans_of(gputrace.trace_dict())] == ["a"]


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        gputrace.enable(colour="blue")
    with pytest.raises(ConfigError, match="positive integer"):
        gputrace.enable(max_pending=0)
    with pytest.raises(ConfigError, match="expected an integer"):
        gputrace.Config.from_env({"GPUTRACE_MAX_PENDING": "lots"})


def test_save_into_an_unwritable_place_is_a_clear_error_and_overwrites_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    gputrace.enable(cuda=False)
    with gputrace.span("a"):
        pass
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    with pytest.raises(GputraceError, match="cannot write"):
        gputrace.save(blocker / "sub" / "t.json")
    assert blocker.read_text() == "keep me"


def test_environment_turns_recording_on_without_importing_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = (
        "import sys, gputrace\n"
        "assert gputrace.is_enabled()\n"
        "assert 'torch' not in sys.modules\n"
        "with gputrace.span('from env'):\n"
        "    pass\n"
    )
    r = run_py(code, {"ENABLE_TIMERS": "1", "GPUTRACE_OUT_DIR": str(tmp_path), "GPUTRACE_CUDA": "0"})
    assert r.returncode == 0, r.stderr
    trace = orjson.loads((tmp_path / "trace_rank0.json").read_bytes())  # saved at exit
    assert [e["name"] for e in spans_of(trace)] == ["from env"]


def test_import_and_help_do_not_import_torch() -> None:
    r = run_py("import sys, gputrace, gputrace.cli; print('torch' in sys.modules)")
    assert r.stdout.strip() == "False", r.stderr


def test_rank_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    gputrace.enable(cuda=False)
    trace = gputrace.trace_dict()
    assert trace["distributedInfo"] == {"rank": 3, "world_size": 8}
    assert trace["metadata"]["rank_source"] == "env"
    pid_names = [e for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert pid_names[0]["pid"] == 4 and pid_names[0]["args"]["name"].startswith("rank 3 (")


def test_a_forked_child_records_nothing_and_never_touches_the_device() -> None:
    import multiprocessing

    fake = FakeDevice()
    install(fake)
    with gputrace.span("parent"):
        fake.work(1000)

    def child(q) -> None:  # type: ignore[no-untyped-def]
        try:
            fake.unusable = True  # as in a forked child, any device call now raises
            with gputrace.span("in worker"):
                pass
            q.put(("ok", gputrace.is_enabled()))
        except BaseException as e:  # noqa: BLE001
            q.put(("error", repr(e)))

    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    result = q.get(timeout=60)
    p.join(60)
    assert result == ("ok", False)
    assert [e["name"] for e in spans_of(gputrace.trace_dict())] == ["parent"]
