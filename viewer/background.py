"""The full document of a view drawn from digests, computed in a worker process while the page
is served from its first document (`viewer.first`).

Takes: a `data.DigestJob` (the files and the options of the document). Gives: `FullBuild`, which
starts one spawned worker process (merge's pool's spawn context: it neither forks the server nor
re-runs the caller's script) that computes the document exactly as `data.digest_view` does and
keeps it beside the digests (`cache`); the server waits on it (`wait`) and serves it once it is
`done`, or says the one line of its `error`. The worker runs at niceness +10 on the machine's
other core, so that the server, the first document and the page come first; it ends with the
view (`from_digests` gives what a view serves: the kept document, or the first one and the
build of the full one).

`GPUTRACE_VIEW_DELAY_S` (seconds, for tests and demonstrations of the page's two stages) makes
the worker wait that long before it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gputrace.errors import GputraceError

from . import data

DELAY_ENV = "GPUTRACE_VIEW_DELAY_S"
#: The worker's niceness, added to its parent's.
NICE = 10


def _compute(job: data.DigestJob, delay_s: float, conn: Any, parent: int) -> None:
    """(In the worker) send ("ok", head, body), or ("error", the reason in one line, None)."""
    with contextlib.suppress(OSError, AttributeError):
        # Below the server and the first document in the CPU's queue: on a busy machine the page
        # comes first, the full document with the time left over (the parent niced it already
        # where it could).
        if os.getpriority(os.PRIO_PROCESS, 0) < os.getpriority(os.PRIO_PROCESS, parent) + NICE:
            os.nice(NICE)
    # A view ended by a signal that runs no exit handler (SIGTERM, SIGKILL) leaves no orphan
    # computing behind it: the worker ends when its parent (`parent`, the view's pid: it may be
    # gone before this runs) is gone.
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    if delay_s > 0:
        time.sleep(delay_s)
    from gputrace.merge.run import no_cycle_collection

    try:
        with no_cycle_collection():  # a process of its own, holding no cycles: as merge reads
            head, body = job.compute()
        got: tuple[str, Any, Any] = ("ok", head, body)
    except GputraceError as e:
        got = ("error", one_line(str(e)), None)
    except Exception as e:  # noqa: BLE001 - the page and the log get one line, never a traceback
        got = ("error", one_line(f"{type(e).__name__}: {e}"), None)
    conn.send(got)
    conn.close()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def delay_from_env() -> float:
    try:
        return max(0.0, float(os.environ.get(DELAY_ENV, "0") or 0))
    except ValueError:
        return 0.0


class FullBuild:
    """The full document, computed by a worker process from the moment `start` is called."""

    def __init__(self, job: data.DigestJob, delay_s: float | None = None) -> None:
        self.job = job
        self.delay_s = delay_from_env() if delay_s is None else delay_s
        self.started = time.monotonic()
        self.seconds: float | None = None  # how long it took, once done
        self.head: dict[str, Any] | None = None
        self.body: bytes | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._listeners: list[Callable[[FullBuild], None]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._process: Any = None

    def start(self) -> FullBuild:
        # The pool's spawn context: no fork of a process that serves from threads, and the
        # caller's `__main__` not run again in the worker.
        from gputrace.merge.pool import _context

        ctx = _context()
        self.started = time.monotonic()
        recv, send = ctx.Pipe(duplex=False)
        process = ctx.Process  # type: ignore[attr-defined]
        self._process = process(target=_compute, args=(self.job, self.delay_s, send, os.getpid()), daemon=True)
        self._process.start()
        with contextlib.suppress(OSError, AttributeError):
            # Niced from its first instruction (its imports too), not only once it runs the job.
            os.setpriority(os.PRIO_PROCESS, self._process.pid, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
        send.close()  # the worker holds its end: the parent's read sees EOF if it dies
        self._thread = threading.Thread(target=self._wait, args=(recv,), daemon=True, name="gputrace-full")
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the worker (its document is not wanted)."""
        p = self._process
        if p is not None and p.is_alive():
            p.terminate()
            p.join(5)

    def _wait(self, conn: Any) -> None:
        try:
            kind, first, second = conn.recv()
        except (EOFError, OSError):
            kind, first, second = "error", "the process computing them ended unexpectedly (out of memory?)", None
        except BaseException as e:  # noqa: BLE001 - one line, never a traceback
            kind, first, second = "error", one_line(f"{type(e).__name__}: {e}"), None
        finally:
            conn.close()
        if self._process is not None:
            self._process.join(5)
        if kind == "error" and not threading.main_thread().is_alive():
            return  # the view is exiting (Ctrl-C) and ended its worker: nothing failed
        self._finish(kind, first, second)

    def _finish(self, kind: str, first: Any, second: Any) -> None:
        with self._lock:
            if kind == "ok":
                self.head, self.body = first, second
            else:
                self.error = first
            self.seconds = time.monotonic() - self.started
            self._done.set()
            listeners = list(self._listeners)
        for fn in listeners:
            fn(self)

    def on_done(self, fn: Callable[[FullBuild], None]) -> None:
        """Call `fn(self)` once it is done (at once, when it is)."""
        with self._lock:
            if not self._done.is_set():
                self._listeners.append(fn)
                return
        fn(self)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until it is done (at most `timeout` seconds); is it?"""
        return self._done.wait(timeout)


@dataclasses.dataclass
class Served:
    """What a view drawn from digests serves: a document (its small keys only where `body` holds
    the rest, `data.split`), and, where that is the first document, the build of the full one."""

    doc: dict[str, Any]
    body: bytes | None
    build: FullBuild | None


def from_digests(
    paths: Sequence[str],
    *,
    step: str = "step",
    skip_steps: int | None = None,
    require_step: bool = False,
    inputs: Iterable[str] = (),
) -> Served | None:
    """The view of many ranks from their digests (None: read the traces, `data.digest_inputs`):
    the document kept beside them when there is one; else the first document (`viewer.first`),
    with the full one being computed in a worker process, started first so that both run at
    once; else (where the first document cannot be made) the full one, computed here."""
    from . import first

    found = data.digest_inputs(paths, step)
    if found is None:
        return None
    job = data.DigestJob(found, step, skip_steps, require_step, [str(p) for p in inputs])
    kept = job.kept()
    if kept is not None:
        return Served(kept[0], kept[1], None)
    build = FullBuild(job).start()
    try:
        doc = first.document(job)
    except BaseException:
        build.stop()
        raise
    if doc is None:
        build.stop()
        head, body = job.compute()  # here: its errors are the command's, with their fixes
        return Served(head, body, None)
    return Served(doc, None, build)
