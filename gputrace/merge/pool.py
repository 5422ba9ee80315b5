"""Merge's worker processes: tasks run in fresh interpreters, their results come back in order.

Takes: a picklable module-level function, its tasks (picklable values) and a number of
workers. Gives: the function's results in the order of the tasks (`ordered`), with at most
`ahead` tasks sent and not yet taken back, so that memory holds a few results, not all. An error
a task raised is raised here, as its own type (`GputraceError`s keep their message and fields),
and a worker that died (killed for memory) is a `GputraceError` that says what to try.

The pool is `concurrent.futures.ProcessPoolExecutor` on a start method that neither forks the
caller nor re-runs its script:
- `fork` copies a process that may hold threads (a viewer's server, a training script's data
  loaders and CUDA/NCCL threads, gputrace's own writer thread): a lock held by one of them at the
  fork stays held in the child forever (malloc, logging, the import lock), and CUDA cannot be
  used in a forked child at all. Python 3.12 warns about it, 3.14 no longer defaults to it.
- `spawn` and `forkserver` start fresh interpreters, but hand each child the parent's `__main__`
  to re-run as `__mp_main__` (`multiprocessing.spawn.prepare`; forkserver runs it once in its
  server): a user's training script would import torch again in every worker, or, unguarded by
  `if __name__ == "__main__"`, train again.
So: `spawn`, with the child told nothing of the parent's `__main__` (our tasks never refer to it).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import BaseContext, SpawnContext
from typing import Any, TypeVar

from gputrace.errors import GputraceError, MergeError, TraceFormatError

T = TypeVar("T")
R = TypeVar("R")

_launching = threading.local()  # set while this module starts a worker, in the thread that starts it
_install_lock = threading.Lock()
_installed: list[Callable[[str], dict[str, Any]]] = []


def _without_main(real: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def preparation_data(name: str) -> dict[str, Any]:
        data = real(name)
        if getattr(_launching, "active", False):
            # What makes the child re-run the parent's script (by path, or as a module by name).
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    return preparation_data


class _Process(multiprocessing.context.SpawnProcess):
    """A spawned worker whose launch hides the parent's `__main__` (pickled into the child, so
    defined here at the top of a module the child can import)."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        from multiprocessing import popen_spawn_posix, spawn

        with _install_lock:
            if not _installed:
                # The spawn launcher asks multiprocessing.spawn what the child prepares from; the
                # answer changes only in the thread that is starting one of these workers.
                _installed.append(spawn.get_preparation_data)
                spawn.get_preparation_data = _without_main(spawn.get_preparation_data)  # type: ignore[assignment]
        _launching.active = True
        try:
            return popen_spawn_posix.Popen(process_obj)  # launches the child here
        finally:
            _launching.active = False


class _Context(SpawnContext):
    Process = _Process


def _context() -> BaseContext:
    """A spawn context whose workers do not re-run the caller's `__main__` (see the docstring);
    plain spawn where there is no POSIX spawn launcher (Windows)."""
    try:
        from multiprocessing import popen_spawn_posix  # noqa: F401
    except ImportError:
        return multiprocessing.get_context("spawn")
    return _Context()


def ordered(
    fn: Callable[[T], R],
    tasks: Iterable[T],
    workers: int,
    ahead: int,
    initializer: Callable[[], object] | None = None,
) -> Iterator[R]:
    """`fn(task)` for each task, in `workers` processes, yielded in the tasks' order."""
    executor = ProcessPoolExecutor(workers, mp_context=_context(), initializer=initializer)
    pending: deque[Future[tuple[str, Any]]] = deque()
    it = iter(tasks)
    clean = False
    try:
        for task in it:
            pending.append(executor.submit(_call, fn, task))
            if len(pending) >= ahead:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
        clean = True
    finally:
        # On an error (or a consumer that stopped early), queued tasks are dropped and the
        # workers end after the task they run.
        executor.shutdown(wait=clean, cancel_futures=True)


def _call(fn: Callable[[Any], Any], task: Any) -> tuple[str, Any]:
    """In the worker: gputrace's errors travel as their fields (a `TraceFormatError` cannot be
    rebuilt from its message alone); any other error as itself."""
    try:
        return "ok", fn(task)
    except TraceFormatError as e:
        return "error", ("TraceFormatError", e.path, e.reason)
    except MergeError as e:
        return "error", ("MergeError", str(e), "")
    except GputraceError as e:
        return "error", ("GputraceError", str(e), "")


def _result(future: Future[tuple[str, Any]]) -> Any:
    try:
        kind, value = future.result()
    except BrokenProcessPool:
        raise GputraceError("a merge worker process ended unexpectedly (out of memory?); try --workers 1") from None
    if kind == "ok":
        return value
    name, first, second = value
    if name == "TraceFormatError":
        raise TraceFormatError(first, second)
    if name == "MergeError":
        raise MergeError(first)
    raise GputraceError(first)
