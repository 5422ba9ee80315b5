"""Which implementation runs, the C build (`gputrace._hot`, sources in `csrc/`) or the Python
twins: decided here, once, and nowhere else.

Takes: the environment at import (GPUTRACE_PURE_PYTHON set and not "0": the twins run), and
`use()` / `using()` (tests, to run both in one process).
Gives: `hot`, the C module in use (None: the Python twins), `UNUSED_BECAUSE` (why it is not), and
`on_switch(bind)`, through which each module with a C twin binds its implementation (or reads
`hot` at call time). A bind may refuse a build by raising ImportError (a layout that disagrees
with the one declared in Python): at import that fails the import, loudly, not a span mid-run.

A switch applies to handles made after it; the recorder in use goes on in the new implementation.
Switch with no span open: one open across a switch is closed by the implementation that opened it,
which no longer holds the recorder (it is not recorded).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

_PURE_ASKED = os.environ.get("GPUTRACE_PURE_PYTHON", "") not in ("", "0")


def _load() -> tuple[ModuleType | None, str | None]:
    """The C build and None, or None and why it is not loaded."""
    try:
        from gputrace import _hot
    except ImportError as e:
        return None, str(e)
    return _hot, None


_build: ModuleType | None = None  # the loaded build, once loaded (use(True) loads it on demand)
UNUSED_BECAUSE: str | None = "GPUTRACE_PURE_PYTHON is set" if _PURE_ASKED else None
"""Why the C build is not in use (None: it is), for the twin tests and bug reports."""
if not _PURE_ASKED:
    _build, UNUSED_BECAUSE = _load()
hot: ModuleType | None = _build
"""The C build in use, or None: the Python twins run."""

_binders: list[Callable[[ModuleType | None], None]] = []


def on_switch(bind: Callable[[ModuleType | None], None]) -> None:
    """Call `bind(hot)` now and again at every switch. Modules register at their import."""
    _binders.append(bind)
    bind(hot)


def use(c: bool) -> None:
    """Run the C build (`c`; ImportError where none loads) or the Python twins from now on, in
    this process, whatever GPUTRACE_PURE_PYTHON said at import."""
    global hot, _build, UNUSED_BECAUSE
    if c and _build is None:
        _build, why = _load()
        if _build is None:
            raise ImportError(f"gputrace: no C build to use: {why}")
    new = _build if c else None
    if new is hot:
        return
    old, old_why = hot, UNUSED_BECAUSE
    hot, UNUSED_BECAUSE = new, None if c else "gputrace.native.use(False)"
    try:
        for bind in _binders:
            bind(new)
    except BaseException:
        hot, UNUSED_BECAUSE = old, old_why
        for bind in _binders:
            bind(old)
        raise


def check_layout(hot: ModuleType, attribute: str, ours: object, what: str) -> None:
    """Raise ImportError unless the C build's `attribute` (the layout it was compiled to read) is
    `ours`, the layout declared in Python: a stale build fails at import, loudly, not mid-run."""
    theirs = getattr(hot, attribute, None)
    if theirs != ours:
        raise ImportError(
            f"gputrace's C build ({getattr(hot, '__file__', '_hot')}) was built from other sources: it reads "
            f"{what} {theirs!r}, this gputrace declares {ours!r}; rebuild it with `pip install -e .` "
            "(or set GPUTRACE_PURE_PYTHON=1)"
        )


@contextmanager
def using(c: bool) -> Iterator[None]:
    """`use(c)` for the block, then back to what was in use before."""
    before = hot is not None
    use(c)
    try:
        yield
    finally:
        use(before)
