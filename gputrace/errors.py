"""The error hierarchy. The CLI turns any `GputraceError` into one line and exit status 2."""

from __future__ import annotations


class GputraceError(Exception):
    """Base of every error gputrace raises on purpose."""


class ConfigError(GputraceError):
    """An unknown option, or an option or environment variable with a bad value."""


class TraceFormatError(GputraceError):
    """A trace file that cannot be read: missing, corrupt, truncated or not a gputrace trace."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class NotAFile(TraceFormatError):
    """A path that names no trace file at all (missing, a directory, a FIFO, a device): a wrong
    argument rather than a damaged trace."""


class MergeError(GputraceError):
    """Traces that cannot be merged as asked (a duplicate or missing rank, nothing to merge...)."""


class GputraceWarning(UserWarning):
    """Misuse that gputrace tolerates: the span is recorded as well as it can be, and the user told once."""
