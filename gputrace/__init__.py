"""gputrace: where the time goes in GPU training, rank by rank, on one timeline.

    import gputrace
    gputrace.enable()
    with gputrace.span("step"):
        ...
    gputrace.save("traces/")    # traces/trace_rank{R}.json, open in ui.perfetto.dev

Importing this package does not import torch, and loads the recorder only when a name from it
is first used, so that the command line starts fast. Type checkers see the real names (the
imports under TYPE_CHECKING); at run time `__getattr__` imports them on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gputrace import _startup
from gputrace.version import __version__

if TYPE_CHECKING:
    from gputrace._timer import TimerRecord as TimerRecord
    from gputrace._timer import Timers as Timers
    from gputrace._timer import timer as timer
    from gputrace.clock import HostClock as HostClock
    from gputrace.config import Config as Config
    from gputrace.config import enabled_from_env as enabled_from_env
    from gputrace.errors import ConfigError as ConfigError
    from gputrace.errors import GputraceError as GputraceError
    from gputrace.errors import GputraceWarning as GputraceWarning
    from gputrace.errors import MergeError as MergeError
    from gputrace.errors import TraceFormatError as TraceFormatError
    from gputrace.record import Span as Span
    from gputrace.record import TimerType as TimerType
    from gputrace.record import span as span
    from gputrace.session import disable as disable
    from gputrace.session import enable as enable
    from gputrace.session import flush as flush
    from gputrace.session import is_enabled as is_enabled
    from gputrace.session import last_report as last_report
    from gputrace.session import reset as reset
    from gputrace.session import save as save
    from gputrace.session import set_host_clock as set_host_clock
    from gputrace.session import sync_clocks as sync_clocks
    from gputrace.session import trace_dict as trace_dict

# The same names, for the imports at run time (a test keeps the two lists equal).
_EXPORTS = {
    "disable": "gputrace.session",
    "enable": "gputrace.session",
    "flush": "gputrace.session",
    "is_enabled": "gputrace.session",
    "last_report": "gputrace.session",
    "reset": "gputrace.session",
    "save": "gputrace.session",
    "set_host_clock": "gputrace.session",
    "sync_clocks": "gputrace.session",
    "trace_dict": "gputrace.session",
    "HostClock": "gputrace.clock",
    "Config": "gputrace.config",
    "enabled_from_env": "gputrace.config",
    "ConfigError": "gputrace.errors",
    "GputraceError": "gputrace.errors",
    "GputraceWarning": "gputrace.errors",
    "MergeError": "gputrace.errors",
    "TraceFormatError": "gputrace.errors",
    "Span": "gputrace.record",
    "TimerType": "gputrace.record",
    "span": "gputrace.record",
    "TimerRecord": "gputrace._timer",
    "Timers": "gputrace._timer",
    "timer": "gputrace._timer",
}
__all__ = [
    "Config",
    "ConfigError",
    "GputraceError",
    "GputraceWarning",
    "HostClock",
    "MergeError",
    "Span",
    "TimerRecord",
    "TimerType",
    "Timers",
    "TraceFormatError",
    "__version__",
    "disable",
    "enable",
    "enabled_from_env",
    "flush",
    "is_enabled",
    "last_report",
    "reset",
    "save",
    "set_host_clock",
    "span",
    "sync_clocks",
    "timer",
    "trace_dict",
]

if not TYPE_CHECKING:  # hidden from checkers, so that a misspelt name is an error there

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'gputrace' has no attribute {name!r}")
        if name in _SWITCHED:
            _forget_at_switch()
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value


#: Names whose value is the C build's or the Python twin's, whichever `gputrace.native` has in use.
_SWITCHED = ("span", "Span")
_forgetting: list[bool] = []


def _forget_at_switch() -> None:
    """Drop the cached names at every switch of implementation (tests switch in one process), so
    they are looked up again; registered once, when the first of them is asked for."""
    if _forgetting:
        return
    _forgetting.append(True)

    def forget(hot: object) -> None:
        for name in _SWITCHED:
            globals().pop(name, None)

    importlib.import_module("gputrace.native").on_switch(forget)


def __dir__() -> list[str]:
    return __all__


_startup.start()
