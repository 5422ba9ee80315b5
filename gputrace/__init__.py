"""gputrace: where the time goes in GPU training, rank by rank, on one timeline.

    import gputrace
    gputrace.enable()
    with gputrace.span("step"):
        ...
    gputrace.save("traces/")    # traces/trace_rank{R}.json, open in ui.perfetto.dev

Importing this package does not import torch, and loads the recorder only when a name from it
is first used, so that the command line starts fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from gputrace import _startup
from gputrace.version import __version__

_EXPORTS = {
    "disable": "gputrace.api",
    "enable": "gputrace.api",
    "flush": "gputrace.api",
    "is_enabled": "gputrace.api",
    "save": "gputrace.api",
    "set_host_clock": "gputrace.api",
    "sync_clocks": "gputrace.api",
    "trace_dict": "gputrace.api",
    "reset": "gputrace.api",
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
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gputrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return __all__


_startup.start()
