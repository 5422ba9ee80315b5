"""gputrace: where the time goes in GPU training, rank by rank, on one timeline.

    import gputrace
    gputrace.enable()
    with gputrace.span("step"):
        ...
    gputrace.save("traces/")    # traces/trace_rank{R}.json, open in ui.perfetto.dev

Importing this package does not import torch.
"""

from gputrace.api import disable, enable, flush, is_enabled, save, set_host_clock, sync_clocks, trace_dict
from gputrace.clock import HostClock
from gputrace.config import Config, enabled_from_env
from gputrace.errors import ConfigError, GputraceError, GputraceWarning, MergeError, TraceFormatError
from gputrace.record import Span, TimerType, span
from gputrace.timer import TimerRecord, Timers, timer
from gputrace.version import __version__

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
    "flush",
    "is_enabled",
    "save",
    "set_host_clock",
    "span",
    "sync_clocks",
    "timer",
    "trace_dict",
]

from gputrace.record import watch_for_torch as _watch

_watch()  # torch.compile support is set up now, or right after `import torch`

if enabled_from_env():
    from gputrace.api import enable_from_env

    enable_from_env()
