"""What a recording session writes to: its sinks, through one protocol.

Takes: the rank's trace as it is resolved, in chunks (each a `Trace` of one process: what one
flush resolved, or a whole trace saved at once), in the order written, then the final header.
Gives: `Sink`, the protocol every sink follows, and `StreamSink`, a format's stream writer
(`gputrace.trace.chrome.StreamWriter`, `gputrace.trace.perfetto.StreamWriter`) adapted to it.
The session registers its sinks (the stream, the step digest: `gputrace.digest.StreamDigest`,
`TraceDigest`) and feeds them all alike; a new sink is one class here and one registration there.
"""

from __future__ import annotations

from typing import Any, Protocol

from gputrace.trace.model import Trace


class Sink(Protocol):
    """Something the session feeds: `add` each chunk in the order written (`update`: what the
    stream's header gains with it, for the sinks that keep a header), `finish` when the trace is
    complete (with its final header), `abandon` when it is dropped unfinished (reset, close)."""

    def add(self, chunk: Trace, update: dict[str, Any] | None = None) -> None: ...

    def finish(self, header: dict[str, Any]) -> None: ...

    def abandon(self) -> None: ...


class StreamSink:
    """A format's stream writer as a sink: each chunk's spans and counters appended to the file,
    the header written at `finish`, the file left as it is on `abandon`."""

    def __init__(self, writer: Any, launch_arrows: bool = True) -> None:
        self.writer = writer
        self.launch_arrows = launch_arrows  # False: the chunks' entry times are not written

    def add(self, chunk: Trace, update: dict[str, Any] | None = None) -> None:
        if not self.launch_arrows and chunk.spans.entry is not None:
            chunk = chunk.without_entry()
        self.writer.append(chunk, range(len(chunk.spans)), range(len(chunk.counters)), update)

    def finish(self, header: dict[str, Any]) -> None:
        self.writer.finish(header)

    def abandon(self) -> None:
        self.writer.abandon()
