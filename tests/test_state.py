"""The session as the one owner of process-wide state, and the sinks it feeds through one
protocol (the import graph: test_shape.py)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

import gputrace
from gputrace import digest, live, record, session
from gputrace.sinks import Sink, StreamSink
from gputrace.state import State
from gputrace.trace import chrome
from gputrace.trace.model import Trace

ROOT = Path(__file__).resolve().parent.parent


class ToySink:
    """A sink that remembers what it was fed."""

    def __init__(self) -> None:
        self.chunks: list[int] = []  # spans per chunk
        self.finished: list[dict[str, Any]] = []
        self.abandoned = 0

    def add(self, chunk: Trace, update: dict[str, Any] | None = None) -> None:
        self.chunks.append(len(chunk.spans))

    def finish(self, header: dict[str, Any]) -> None:
        self.finished.append(header)

    def abandon(self) -> None:
        self.abandoned += 1


def test_closing_the_session_resets_every_piece_of_state() -> None:
    s = session.SESSION
    state = s.state
    assert record.STATE is state  # the session's state is the one installed below it
    gputrace.enable(cuda=False)
    with gputrace.span("x"):
        pass
    gputrace.disable()
    gputrace.span("recording off")  # a shared disabled handle, remembered
    gputrace.timer("t")
    with pytest.warns(gputrace.GputraceWarning):
        record.warn_once("test-key", "a warning given once")
    record.capture_changed(+1)
    state.lazy = lambda: None
    state.last_digest = "somewhere.digest"
    state.gloo_groups[1] = object()
    assert state.active is not None and state.disabled and state.timers and "test-key" in state.warned
    assert state.captures == 1
    s.close()
    assert s.state is state and record.STATE is state
    assert state.recorder is None and state.active is None and state.lazy is None
    assert record.RECORDER is None and record.ACTIVE is None  # the hot path's copies follow
    assert state.captures == 0 and not state.warned and not state.disabled
    assert state.last_digest is None and not state.gloo_groups and not state.timers
    assert "t" not in gputrace.timer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record.warn_once("test-key", "given again after the reset")
    assert len(caught) == 1


def test_a_fresh_state_installs_with_recording_off() -> None:
    gputrace.enable(cuda=False)
    assert record.RECORDER is not None
    fresh = State()
    old = record.STATE
    try:
        record.install_state(fresh)
        assert record.RECORDER is None and record.ACTIVE is None
        with gputrace.span("nothing"):  # recording off: records nowhere
            pass
    finally:
        record.install_state(old)
    assert record.RECORDER is not None


def test_the_stream_and_its_digest_are_fed_as_sinks(tmp_path: Path) -> None:
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    with gputrace.span("step"):
        pass
    gputrace.flush()
    sinks = session.SESSION.sinks
    assert [type(x) for x in sinks] == [StreamSink, digest.StreamDigest, live.OpenSink]
    toy = ToySink()
    sinks.append(toy)
    checked: Sink = toy  # the protocol, as the type checker sees it
    assert checked is toy
    for _ in range(2):
        with gputrace.span("step"):
            with gputrace.span("fwd"):
                pass
        gputrace.flush()
    assert toy.chunks == [2, 2]
    path = gputrace.save()
    assert toy.chunks[:2] == [2, 2] and sum(toy.chunks) == 4  # then save's flush and the open spans (none)
    assert len(toy.finished) == 1 and toy.finished[0]["metadata"]["spans"] == 5
    assert len(chrome.read(path).spans) == 5
    written = digest.digest_path(path)
    assert os.path.isfile(written) and session.SESSION.state.last_digest == written
    gputrace.reset()
    assert toy.abandoned == 1 and session.SESSION.sinks == []


def test_a_failing_digest_costs_neither_the_flush_nor_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: digest.Builder, trace: Trace, lo: int = 0, hi: int | None = None) -> None:
        raise RuntimeError("no room")

    monkeypatch.setattr(digest.Builder, "add", broken)
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    with pytest.warns(gputrace.GputraceWarning, match="could not keep the step digest: no room"):
        with gputrace.span("step"):
            pass
        gputrace.flush()
    path = gputrace.save()
    assert len(chrome.read(path).spans) == 1
    assert not os.path.exists(digest.digest_path(path)) and session.SESSION.state.last_digest is None


def test_a_trace_saved_whole_gets_its_digest_through_a_sink(tmp_path: Path) -> None:
    gputrace.enable(cuda=False)
    with gputrace.span("step"):
        pass
    gputrace.save(str(tmp_path / "t.json"))
    assert session.SESSION.state.last_digest == str(tmp_path / "t.digest")
    assert os.path.isfile(str(tmp_path / "t.digest"))
