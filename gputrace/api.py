"""The public recording functions, kept under their earlier module name; they live in
`gputrace.session`."""

from gputrace.session import (  # noqa: F401
    SESSION,
    disable,
    enable,
    enable_from_env,
    flush,
    host_clock,
    is_enabled,
    reset,
    save,
    set_host_clock,
    sync_clocks,
    trace,
    trace_bytes,
    trace_dict,
)
