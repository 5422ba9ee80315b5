"""`gputrace view DIR --follow`: the page of a run while it is written, in bounded memory.

Takes: the directory the ranks stream into (`trace_rank{R}.json`, appended flush by flush as
`gputrace.trace.chrome.StreamWriter` writes it, one event a line, and rewritten once when the
rank finishes; `open_rank{R}.open`, where each rank is now, as `gputrace.live` writes it).
Gives: `Follower`, which on each look reads only what each file gained since the last (from the
byte where it stopped; a file rewritten, by its finish, is read again from its start: the JSON
format's tail reader, `gputrace.trace.chrome.StreamTail`, reads and parses the lines) and keeps
per rank the last `window` step spans and the collective spans that meet them; `snapshot()`,
the page's document (the rank x step heatmap of busy time over that window, the slowest rank of
each step by the summary's rule, each rank's state, and the open files' verdict with the ranks
the others wait for); and `FollowViewer`, the viewer's server with the follow page
(`static/follow.html`, `follow.js`, which polls `/follow.json`).

Memory: O(ranks x (window + collective spans in the window)) whatever the run's length, plus
one read buffer (`READ_BYTES`) while a file is read: nothing grows with the steps a run has
done (benchmarks/follow_memory.py measures it over a million appended steps). The step spans
are matched across ranks by ordinal, as the summary matches them; busy time is the step less
its time inside collectives (spans marked `collective=True`, or named like one), so no clock
alignment is needed: every number is a duration on one rank's clock.

Only the JSON stream is followed: a Perfetto protobuf stream is one message per span with no
line to resume from, and is refused with the fix (stream JSON, or view it once it is finished).
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time
from bisect import bisect_left, bisect_right
from collections import deque
from typing import Any

import orjson

from gputrace.errors import GputraceError
from gputrace.stats import MARGIN_PCT, WAIT_NAMES
from gputrace.trace import chrome

from . import server

FORMAT = "gputrace-follow/1"
#: Steps per rank the page shows (the most recent).
WINDOW = 1000
#: Bytes read from one file in one piece.
READ_BYTES = 8 << 20
#: Collective spans kept per step of the window, at most (a step with more keeps its last ones).
COLLS_PER_STEP = 64
#: A file longer than this at the first look (a run followed after days) has its step spans
#: before its last TAIL_BYTES counted, not read: byte search in C, not a parse a line.
TAIL_BYTES = 64 << 20
#: A file that has not grown for this long is said to have stopped (a rank hung, or killed).
STALE_S = 10.0


class RankTail(chrome.StreamTail):
    """One rank's streamed trace, read as it grows (`chrome.StreamTail` reads the file): its
    step spans and the collective spans that meet the window's steps."""

    def __init__(self, path: str, rank: int, window: int, step_name: str) -> None:
        super().__init__(path, step_name, TAIL_BYTES, READ_BYTES)
        self.rank = rank
        self.step_name = step_name
        self.window = window
        self.steps: deque[tuple[int, int]] = deque(maxlen=window)  # (start, end) ns from the base
        self.count = 0  # step spans seen: the ordinal of the next
        self.colls: deque[tuple[int, int]] = deque(maxlen=window * COLLS_PER_STEP)

    def restart(self) -> None:
        self.steps.clear()
        self.count = 0
        self.colls.clear()

    def skipped(self, count: int) -> None:
        self.count = count

    def select(self, raw_name: bytes, marked: bool | None) -> int:
        """1: a step span; 2: a collective (marked so, or named like one where unmarked)."""
        kind = self._kind(raw_name)
        if kind == 1:
            return 1
        return 2 if (marked if marked is not None else kind == 2) else 0

    def span(self, kind: int, start: int, end: int) -> None:
        if kind == 1:
            self.steps.append((start, end))
            self.count += 1
            old = self.steps[0][0]
            colls = self.colls
            while colls and colls[0][1] < old:
                colls.popleft()
        else:
            self.colls.append((start, end))

    def _kind(self, raw: bytes) -> int:
        """1: the step span's name; 2: named like a collective; 0: neither."""
        try:
            name = orjson.loads(b'"' + raw + b'"')
        except orjson.JSONDecodeError:
            return 0
        return 1 if name == self.step_name else 2 if WAIT_NAMES.search(name) else 0

    def busy(self) -> tuple[list[int], list[int]]:
        """Per step of the window: its busy time (less its time in collectives), its length."""
        us: list[int] = []
        ue: list[int] = []
        for a, b in sorted(self.colls):
            if us and a <= ue[-1]:
                ue[-1] = max(ue[-1], b)
            else:
                us.append(a)
                ue.append(b)
        busy, length = [], []
        for a, b in self.steps:
            w = 0
            for j in range(bisect_right(ue, a), bisect_left(us, b)):
                w += min(ue[j], b) - max(us[j], a)
            busy.append(b - a - w)
            length.append(b - a)
        return busy, length


class Follower:
    """A directory's ranks, followed (see the module's docstring)."""

    def __init__(self, directory: str, step_name: str = "step", window: int = WINDOW, stale_s: float = STALE_S) -> None:
        if not os.path.isdir(directory):
            raise GputraceError(
                f"--follow {directory}: not a directory; give the folder the ranks stream into (their out_dir)"
            )
        pftrace = glob.glob(os.path.join(directory, "trace_rank*.pftrace"))
        if pftrace and not glob.glob(os.path.join(directory, "trace_rank*.json")):
            raise GputraceError(
                f"--follow {directory}: the ranks stream Perfetto protobuf ({os.path.basename(pftrace[0])}), which "
                "cannot be followed; record with format=json to follow a run, or view it once it has finished"
            )
        self.directory = directory
        self.step_name = step_name
        self.window = window
        self.stale_s = stale_s
        self.tails: dict[int, RankTail] = {}
        self.lock = threading.Lock()

    def _scan(self) -> None:
        for path in glob.glob(os.path.join(self.directory, "trace_rank*.json")):
            rank = os.path.basename(path)[len("trace_rank") : -len(".json")]
            if rank.isdigit() and int(rank) not in self.tails:
                self.tails[int(rank)] = RankTail(path, int(rank), self.window, self.step_name)
        for t in self.tails.values():
            t.read()

    def snapshot(self) -> dict[str, Any]:
        """Read what was appended, and the page's document."""
        with self.lock:
            self._scan()
            return self._document()

    def _document(self) -> dict[str, Any]:
        ranks = sorted(self.tails)
        count = max((self.tails[r].count for r in ranks), default=0)
        first = max(0, count - self.window)
        width = count - first
        busy: dict[str, list[int | None]] = {}
        length: dict[str, list[int | None]] = {}
        now = time.monotonic()
        state: dict[str, Any] = {}
        for r in ranks:
            t = self.tails[r]
            b, n = t.busy()
            lo = t.count - len(b)  # the ordinal of the rank's first kept step
            row_b: list[int | None] = [None] * width
            row_n: list[int | None] = [None] * width
            for i, (bi, ni) in enumerate(zip(b, n)):
                k = lo + i - first
                if 0 <= k < width:
                    row_b[k], row_n[k] = bi, ni
            busy[str(r)], length[str(r)] = row_b, row_n
            idle = now - t.grew_at
            state[str(r)] = {
                "steps": t.count,
                "finished": t.finished,
                "idle_s": round(idle, 1),
                "stopped": not t.finished and idle > self.stale_s,
            }
        slowest: list[int | None] = []
        for k in range(width):
            col: list[tuple[int, int]] = []
            for r in ranks:
                v_rk = busy[str(r)][k]
                if v_rk is not None:
                    col.append((v_rk, r))
            if len(col) < 2:
                slowest.append(None)
                continue
            v = sorted(x for x, _ in col)
            m = len(v)
            med = v[m // 2] if m % 2 else (v[m // 2 - 1] + v[m // 2]) // 2
            top, who = max(col, key=lambda c: (c[0], -c[1]))
            slowest.append(who if med > 0 and 100.0 * (top - med) / med > MARGIN_PCT else None)
        doc: dict[str, Any] = {
            "format": FORMAT,
            "directory": os.path.abspath(self.directory),
            "step_name": self.step_name,
            "ranks": ranks,
            "count": count,
            "first": first,
            "window": self.window,
            "busy": busy,
            "step_ns": length,
            "slowest": slowest,
            "state": state,
            "stale_s": self.stale_s,
            "open": {},
            "verdict": [],
            "hung": [],
        }
        self._open(doc)
        return doc

    def _open(self, doc: dict[str, Any]) -> None:
        """Where each rank is now, from the open files (`gputrace.live`), when the ranks write
        them: the verdict in words, and the ranks that hold the others (not in a collective
        while others are, and still so after `stale_s`)."""
        from gputrace import live

        try:
            states = live.read_all([self.directory])
        except GputraceError as e:  # a file half replaced, or not one of ours: said, not fatal
            doc["verdict"] = [f"the open files cannot be read: {e}"]
            return
        if not states:
            return
        now = time.time_ns()
        doc["open"] = live.as_json(states)
        doc["verdict"] = live.verdict(states, now)
        waiting = [s for s in states.values() if s.collective is not None]
        if waiting:
            stale = self.stale_s * 1e9
            doc["hung"] = sorted(
                r
                for r, s in states.items()
                if s.collective is None and s.stack and not s.finished and now - s.stack[-1].since_ns > stale
            )


class FollowViewer:
    """What `_FollowHandler` serves: the follow page, its files, and `/follow.json`."""

    def __init__(self, follower: Follower, poll_ms: int = 1000) -> None:
        self.follower = follower
        self.poll_ms = poll_ms
        self.assets = server.static_assets()
        self.csp = server.page_csp(None)
        self.ui = server.UISource("url", "", "")  # no timeline: /ui/ serves nothing
        self.document = b"{}"

    def follow_json(self) -> bytes:
        doc = self.follower.snapshot()
        doc["poll_ms"] = self.poll_ms
        return orjson.dumps(doc)

    def serve(self, port: int = 0, *, timeout: float | None = server.IDLE_TIMEOUT_S) -> Any:
        """A server on 127.0.0.1 (port 0: a free one), not yet serving (as `Viewer.serve`)."""
        handler: type[_FollowHandler] = type("Handler", (_FollowHandler,), {"viewer": self, "timeout": timeout})
        server_class: type[server._Server] = type("Server", (server._Server,), {"request_queue_size": server.BACKLOG})
        try:
            httpd = server_class(("127.0.0.1", port), handler, server.MAX_THREADS)
        except OSError as e:
            raise GputraceError(
                f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}; "
                "choose another --port, or leave it out for a free one"
            ) from None
        handler.port = httpd.server_address[1]
        return httpd


class _FollowHandler(server._Handler):
    viewer: FollowViewer  # type: ignore[assignment]

    def _route(self, head: bool) -> None:
        host = self.headers.get("Host", "")
        path = self.path.split("?", 1)[0]
        if host in (f"127.0.0.1:{self.port}", f"localhost:{self.port}"):
            v = self.viewer
            if path in ("/", "/index.html"):
                body, ctype = v.assets["follow.html"]
                return self._send(200, body, ctype, head, page=True)
            if path == "/follow.json":
                return self._send(200, v.follow_json(), "application/json", head, page=True)
            if path in ("/data.json", "/trace.json") or path.startswith("/ui/"):
                return self._not_found(head)
        with contextlib.suppress(ConnectionError):
            super()._route(head)  # the other static files, and the refusals
