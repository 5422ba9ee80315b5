"""The JSON format's tail reader (`chrome.StreamTail`): a rank's stream read as the session
appends it, each span once, unwanted spans left unparsed, and the file read again from its
start when the finished trace is written over it."""

from __future__ import annotations

from pathlib import Path

import gputrace
from gputrace.trace import chrome


class Spans(chrome.StreamTail):
    def __init__(self, path: str) -> None:
        super().__init__(path, counted="step", tail_bytes=1 << 30, read_bytes=256)
        self.got: list[tuple[int, int, int]] = []
        self.asked: list[tuple[bytes, bool | None]] = []
        self.restarts = 0

    def select(self, raw_name: bytes, marked: bool | None) -> int:
        self.asked.append((raw_name, marked))
        return {b"step": 1, b"all_reduce": 2}.get(raw_name, 0)

    def span(self, kind: int, start: int, end: int) -> None:
        self.got.append((kind, start, end))

    def restart(self) -> None:
        self.got.clear()
        self.restarts += 1


def steps(n: int) -> None:
    for i in range(n):
        with gputrace.span("step", step=i):
            with gputrace.span("work"):
                pass
            with gputrace.span("all_reduce", collective=True):
                pass
        gputrace.flush()


def test_the_tail_reads_each_appended_span_once_and_again_after_a_rewrite(tmp_path: Path) -> None:
    gputrace.enable(cuda=False, out_dir=str(tmp_path))
    tail = Spans(str(tmp_path / "trace_rank0.json"))
    tail.read()  # not there yet: nothing
    assert tail.got == [] and tail.offset == 0
    steps(3)
    tail.read()
    assert [k for k, _, _ in tail.got] == [2, 1] * 3 and tail.base_ns is not None and not tail.finished
    first = list(tail.got)
    assert all(0 <= s <= e for _, s, e in first)
    steps(2)
    tail.read()
    assert tail.got[:6] == first and len(tail.got) == 10  # read on from where it stopped
    # Each name asked once (for each marking), "work" among them but never parsed.
    names = (b"all_reduce", b"step", b"work")
    assert len(tail.asked) == 9 and set(tail.asked) == {(n, m) for n in names for m in (None, True, False)}
    streamed = sorted((k, e - s) for k, s, e in tail.got)
    gputrace.save()  # the finished file, written over the stream
    tail.read()
    assert tail.restarts == 1 and tail.finished
    assert sorted((k, e - s) for k, s, e in tail.got) == streamed  # the same spans, each once


def test_a_file_of_endless_lines_is_not_held(tmp_path: Path) -> None:
    """A trace not written one event a line (a whole trace on one line, another tool's, or a
    hostile file): the reader holds at most about one line's limit, then leaves the file unread,
    on the first read of a long file (its tail) and while it grows, until it is rewritten."""
    import tracemalloc

    class Small(chrome.StreamTail):
        MAX_LINE = 1 << 20

    path = tmp_path / "trace_rank0.json"
    path.write_bytes(b'{"traceEvents": [\n' + b"x" * (24 << 20))
    for tail_bytes in (1 << 30, 4 << 20):  # read from the start; a long file's tail
        tail = Small(str(path), counted="step", tail_bytes=tail_bytes, read_bytes=256 << 10)
        tracemalloc.start()
        try:
            tail.read()
            with open(path, "ab") as f:
                f.write(b"y" * (4 << 20))  # it grows
            tail.read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert tail.not_a_stream and tail.partial == b""
        assert peak < 8 << 20, peak  # a few times the line limit, of a 24-28 MB file
        path.write_bytes(b'{"traceEvents": [\n' + b"x" * (24 << 20))
    # rewritten as a stream: read again
    path.unlink()
    gputrace.enable(out_dir=str(tmp_path), cuda=False)
    try:
        steps(3)
        tail = Spans(str(path))
        tail.read()
        assert not tail.not_a_stream and [k for k, _, _ in tail.got].count(1) == 3
    finally:
        gputrace.disable()
