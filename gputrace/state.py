"""The process-wide state of recording, in one object.

Takes: nothing (it imports nothing of gputrace). Gives: `State`, which the session owns (one
per process, `session.SESSION.state`) and installs into the modules below it
(`record.install_state`); they read and change it, never the session. Resetting it
(`State.clear`, then installing it again) is all that a fresh start needs, so a test resets one
object.

What it holds, and who reads it:
- the recorder spans record into (`recorder`, None while recording is off) and the one they
  close into and save from (`active`), and `lazy`, which builds the recorder on first use when
  the environment turned recording on: `record` (its hot path reads its own copies of the first
  two, which `record.set_recorder` keeps equal to these, as it keeps the C path's);
- `captures`, the CUDA graph captures under way; `warned`, the misuse warnings given once;
  `disabled`, the shared do-nothing handles of recording off (the C path holds the same dict);
- `last_digest`, the step digest this process wrote last (what `dist.gather_digests` sends);
- `gloo_groups`, the gloo side groups `dist` made, by the group they stand for;
- `timers`, the named timers of `gputrace.timer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class State:
    """Everything process-wide that the modules below the session keep between calls."""

    __slots__ = ("recorder", "active", "lazy", "captures", "warned", "disabled", "last_digest", "gloo_groups", "timers")

    recorder: Any  # record.Recorder | None (typed loosely: this module sits below record)
    active: Any
    lazy: Callable[[], Any] | None
    captures: int
    warned: set[str]
    disabled: dict[str, Any]
    last_digest: str | None
    gloo_groups: dict[int, object]
    timers: dict[str, Any]

    def __init__(self) -> None:
        self.warned = set()
        self.disabled = {}
        self.gloo_groups = {}
        self.timers = {}
        self.clear()

    def clear(self) -> None:
        """Back to a fresh process. The containers are emptied in place: the C path and the timer
        facade hold them, not copies."""
        self.recorder = None
        self.active = None
        self.lazy = None
        self.captures = 0
        self.last_digest = None
        self.warned.clear()
        self.disabled.clear()
        self.gloo_groups.clear()
        self.timers.clear()
