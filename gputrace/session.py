"""The session: the one global of a recording process.

Takes: options (`Config`, from keyword arguments and the environment) and the user's calls
(enable, flush, save, reset, sync_clocks). Gives: the `Recorder` the hot path records into,
the host clock, the clock syncs, the memory counters, and the rank's trace as a `Trace`
written by `gputrace.trace`: streamed into the output directory flush by flush (crash-safe),
or written whole by `save()`.

Streaming (an output directory set): every flush appends what it resolved to
`trace_rank{R}.json` (or `.pftrace`), so a process killed at any instant leaves a file that
loads; SIGTERM and SIGINT append what is resolved, finish the file where the program would
otherwise die, and hand the signal on to the handler that was there before; the interpreter's
exit finishes the file. Resolved spans then leave memory at each flush: memory stays flat over
any number of steps.

The session owns the process-wide state (`gputrace.state.State`: the recorders, the misuse
warnings given, the gloo groups, the last digest written, the timers) and installs it in the
modules below (`record.install_state`), which never import this one; `dist` is handed what it
needs. What is written goes to sinks (`gputrace.sinks.Sink`), fed alike: while streaming, the
format's stream writer and the step digest (`digest.StreamDigest`); a trace saved whole feeds its
digest (`digest.TraceDigest`) while it reaches the disk.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import socket
import statistics
import threading
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from gputrace import live, record
from gputrace.clock import HostClock
from gputrace.config import Config
from gputrace.digest import StreamDigest, TraceDigest
from gputrace.dist import ClockSync, gloo_group, rank_info
from gputrace.dist import gather_digests as _gather_digests
from gputrace.dist import sync_clocks as _sync_clocks
from gputrace.errors import ConfigError, GputraceError, GputraceWarning
from gputrace.record import Recorder
from gputrace.resolve import SpanStore
from gputrace.sinks import Sink, StreamSink
from gputrace.state import State
from gputrace.straggler import Reporter
from gputrace.trace import chrome, registry
from gputrace.trace.model import CounterColumns, Process, SpanColumns, Trace, Track
from gputrace.version import __version__

_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None)) if s is not None)
# A stream's base lies this far before the session began: device spans are placed on the host
# clock within their anchors' error bars, so one can start a few microseconds "before" it.
_BASE_MARGIN_NS = 1_000_000
# Memory is sampled at a flush at most this often (and at every waiting flush, a save's among
# them): asking the caching allocator costs ~10 us, which flushes far apart never notice but
# steps of a millisecond would (100 spans a flush: ~100 ns a span at every flush, ~10 at this).
MEMORY_PERIOD_NS = 10_000_000


class Session:
    """Everything process-wide: the config, the recorder, the clocks and syncs, the output."""

    def __init__(self, state: State | None = None) -> None:
        # The process-wide state the modules below read (recorders, warnings given, the last
        # digest, gloo groups, timers): this session owns it and installs it there.
        self.state = state if state is not None else State()
        record.install_state(self.state)
        self.lock = threading.RLock()
        self.config = Config()
        self.clock: HostClock | None = None
        self.syncs: list[ClockSync] = []
        self.run_id: str | None = None
        self.started_ns = 0
        self.counter_names: list[str] = []  # counter track names, e.g. "cuda:0 memory allocated"
        self.counters = CounterColumns()
        self._memory_at = -MEMORY_PERIOD_NS  # when memory was last sampled (host clock, ns)
        self._skeleton: Any = None  # a stream chunk's process and tracks, while they last
        self.stream: Any = None  # a chrome or perfetto StreamWriter while streaming
        self.sinks: list[Sink] = []  # what each flush feeds while streaming: the stream, its digest
        self.saved = False
        self._atexit = False
        self._previous: dict[int, Any] = {}  # signal -> the handler before ours
        # Per thread: how deep it is in a flush, save or reset (`_critical`). A signal handler
        # runs in the main thread between any two bytecodes; inside one of those it waits there
        # (`_deferred`) and runs when the outermost ends, so it never writes a trace half written.
        self._inside = threading.local()
        self._deferred: tuple[int, Any] | None = None
        self.unwritten = 0  # spans the stream's file could not take (a full disk), dropped
        self._told_unwritable = False
        self.reporter: Reporter | None = None  # the straggler report, with report_every
        self.watcher: live.OpenWatcher | None = None  # keeps the open file while streaming

    # ---- on and off --------------------------------------------------------------------------

    @property
    def recorder(self) -> Recorder | None:
        return self.state.active  # type: ignore[no-any-return]

    def enable(self, **options: Any) -> None:
        with self.lock:
            rec = self.recorder
            # Again while a recorder exists: the options given change, the others stay.
            config = (self.config if rec is not None else Config.from_env()).replace(**options)
            if rec is not None:
                self._reconfigure(rec, config)
            self.config = config
            self._set_reporter(config)
            if rec is None:
                self._build()
            else:
                record.set_recorder(rec, rec)
            self._register_atexit()

    def _set_reporter(self, config: Config) -> None:
        """The straggler report as `report_every` says (one kept while its options stay)."""
        r = self.reporter
        if not config.report_every:
            self.reporter = None
        elif r is None or (r.every, r.step_name, r.timeout_s) != (
            config.report_every, config.step_name, config.report_timeout
        ):  # fmt: skip
            self.reporter = Reporter(config.report_every, config.step_name, config.report_timeout)

    def enable_from_env(self) -> None:
        """Recording on from the environment, at import. Building the recorder imports torch,
        which `import gputrace` and the CLI must not, so the first span builds it."""
        self.config = Config.from_env()
        self._set_reporter(self.config)
        self.state.lazy = self._build
        self._register_atexit()

    def _reconfigure(self, rec: Recorder, new: Config) -> None:
        old = self.config
        if new.cuda != old.cuda and rec.device is not None:
            raise ConfigError(
                "the cuda option cannot change once recording has begun on a GPU; set it in the first enable()"
            )
        if self.stream is not None and (new.rank != old.rank or new.format != old.format or new.out_dir != old.out_dir):
            # The file being streamed is finished where it is; the next flush starts the new one.
            self._finish_stream()
            self.stream = None
            self.sinks = []
        rec.config = new
        if new.nvtx != old.nvtx:
            rec.set_nvtx(new.nvtx)  # installed again by the caller
        rec.store.capacity = new.max_spans
        rec._check_at = len(rec.pending) + new.max_pending

    def disable(self) -> None:
        """Stop recording new spans. Open spans still close; what was recorded can still be saved."""
        self.state.lazy = None
        record.set_recorder(None, self.recorder)

    def is_enabled(self) -> bool:
        return self.state.recorder is not None or self.state.lazy is not None

    def host_clock(self) -> HostClock:
        if self.clock is None:
            self.clock = HostClock()
        return self.clock

    def set_host_clock(self, clock: HostClock) -> None:
        if self.recorder is not None:
            raise GputraceError("set_host_clock() must be called before enable()")
        self.clock = clock

    def _build(self) -> Recorder:
        with self.lock:
            rec = self.recorder
            if rec is None:
                device = None
                if self.config.cuda and _cuda_available():
                    from gputrace.cuda import CudaDevice

                    device = CudaDevice()
                record.bind_compile_check()
                rec = Recorder(self.config, device, self.host_clock())
                self.started_ns = self.host_clock().now()
                if self.run_id is None:
                    self.run_id = _run_id_from_env(self.config)
            self.state.lazy = None
            record.set_recorder(rec, rec)
            self._watch(rec)
            return rec

    def install(self, rec: Recorder) -> None:
        """Make `rec` the session's recorder (tests drive a recorder on a fake device)."""
        with self.lock:
            self.clock = rec.clock
            self.started_ns = rec.clock.now()
            self._skeleton = None
            record.set_recorder(rec, rec)
            self._watch(rec)

    def _watch(self, rec: Recorder) -> live.OpenWatcher | None:
        """The open file's thread, while streaming (an output directory set): see `gputrace.live`."""
        w = self.watcher
        if w is not None and w.rec is not rec:
            w.stop()
            w = self.watcher = None
        if w is None and self.config.out_dir and self.config.open_every_s > 0:
            w = self.watcher = live.OpenWatcher(self, rec, self.config.open_every_s)
            w.start()
        return w

    # ---- flush, stream, save -----------------------------------------------------------------

    def flush(self, wait: bool = False) -> int:
        """Resolve what the GPU has finished (all of it with `wait`), sample memory, and with an
        output directory append it all to the rank's file. Returns the spans resolved."""
        rec = self.recorder
        if rec is None:
            return 0
        with self._critical():
            n = rec.flush(wait=wait)
            self._sample_memory(rec, wait)
            if self.reporter is not None:
                self.reporter.flushed(rec)
            if self.config.out_dir:
                self._append(rec)
        return n

    def _critical(self) -> _Critical:
        """The session's lock, for a flush, save or reset of this thread. A signal caught inside
        (in the main thread) is handled when the outermost one ends: the file is whole by then.
        The block appends True to the list it is given once it has finished the trace (a save),
        so that the signal's handler need not write it again. A class, not a generator: a flush
        a step pays for it."""
        return _Critical(self)

    def _after_critical(self, done: list[bool]) -> None:
        if self._deferred is not None and threading.current_thread() is threading.main_thread():
            deferred, self._deferred = self._deferred, None
            self._handle_signal(*deferred, write=not done)

    def _sample_memory(self, rec: Recorder, always: bool) -> None:
        if rec.device is None:
            return
        memory = getattr(rec.device, "memory", None)
        if memory is None:
            return
        now = rec.clock.now()
        if not always and now - self._memory_at < MEMORY_PERIOD_NS:
            return
        self._memory_at = now
        for dev in sorted({t.device for t in rec.tracks if t.device is not None}):
            try:
                allocated, reserved = memory(dev)
            except Exception:  # noqa: BLE001 - a counter is never worth a failed flush
                return
            for what, value in (("allocated", allocated), ("reserved", reserved)):
                name = f"cuda:{dev} memory {what}"
                try:
                    track = self.counter_names.index(name)
                except ValueError:
                    track = len(self.counter_names)
                    self.counter_names.append(name)
                self.counters.append(track, now, float(value))

    def rank_trace(self, rec: Recorder, store: SpanStore | None = None, chunk: bool = False) -> Trace:
        """The recorder's resolved spans (and the session's counters) as a `Trace` of one
        process. The span columns are the store's own arrays, not copies. A `chunk` (what a
        flush appends to a stream) carries no metadata: the stream's header has it, and building
        it every flush would cost more as the run grows (it summarises every anchor)."""
        store = rec.store if store is None else store
        info = rank_info(self.config.rank)
        meta = self.metadata(rec, store) if not chunk else {"rank": info.rank}
        trace = Trace(meta)
        trace.metadata["world_size"] = info.world_size
        # A stream's chunks (one a flush) share their process and tracks while no track is new.
        key = (rec, info, len(rec.tracks), len(self.counter_names))
        skeleton = self._skeleton if chunk else None
        if skeleton is not None and skeleton[0] == key:
            trace.processes, trace.tracks = list(skeleton[1]), list(skeleton[2])
        else:
            label = self.process_label(rec, info.rank)
            p = trace.add_process(Process(info.rank + 1, info.rank, label, info.rank, meta))
            for t in rec.tracks:
                kind = "cpu" if t.device is None else "cuda"
                trace.add_track(Track(p, t.index, t.name, kind, t.device, t.ordinal))
            for name in self.counter_names:
                trace.add_track(Track(p, name, name, "counter", _device_of(name)))
            if chunk:
                self._skeleton = (key, list(trace.processes), list(trace.tracks))
        n_tracks = len(rec.tracks)
        trace.names = store.names
        trace._name_index = store._name_index
        trace.spans = SpanColumns.wrap(store.name, store.track, store.start, store.end, store.args)
        trace.spans.entry = store.entry
        c = self.counters
        if len(c):
            trace.counters.track.extend(t + n_tracks for t in c.track)
            trace.counters.ts.extend(c.ts)
            trace.counters.value.extend(c.value)
        return trace

    def process_label(self, rec: Recorder, rank: int) -> str:
        devices = self._devices(rec)
        used = sorted({t.device for t in rec.tracks if t.device is not None})
        label_dev = ", ".join(sorted({devices[d] for d in used})) if used else "cpu"
        return f"rank {rank} ({socket.gethostname()}, {label_dev})"

    def _devices(self, rec: Recorder) -> list[str]:
        # Asked once per recorder: every flush of a stream labels its chunk.
        cached = getattr(self, "_device_names", None)
        if cached is None or cached[0] is not rec:
            names = [rec.device.name(d) for d in range(rec.device.count())] if rec.device is not None else []
            cached = self._device_names = (rec, names)
        return cached[1]

    def metadata(self, rec: Recorder, store: SpanStore, unfinished: int = 0) -> dict[str, Any]:
        info = rank_info(self.config.rank)
        return {
            "gputrace_version": __version__,
            "run_id": self.run_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "rank": info.rank,
            "world_size": info.world_size,
            "local_rank": info.local_rank,
            "rank_source": info.source,
            "devices": self._devices(rec),
            "clock": self.clock_metadata(rec),
            "spans": self._spans_total(store) + unfinished,
            "spans_dropped": store.dropped,
            "spans_unwritten": self.unwritten,
            "spans_unfinished": unfinished,
            "spans_skipped_in_cuda_graph_capture": rec.skipped_in_capture,
            "options": {k: v for k, v in vars(self.config).items()},
        }

    def _spans_total(self, store: SpanStore) -> int:
        return (self.stream.spans_written if self.stream is not None else 0) + len(store)

    def clock_metadata(self, rec: Recorder) -> dict[str, Any]:
        devices = []
        for dev, tl in enumerate(rec.timelines):
            if tl.anchors:
                u = [a.uncertainty_ns for a in tl.anchors]
                devices.append(
                    {
                        "device": dev,
                        "anchors": len(u),
                        "uncertainty_ns_median": int(statistics.median(u)),
                        "uncertainty_ns_max": max(u),
                    }
                )
        return {
            "host": "CLOCK_MONOTONIC + realtime offset measured at start",
            "epoch_offset_ns": rec.clock.epoch_offset_ns,
            "test_shift_ns": rec.clock.shift_ns,
            "device_anchors": devices,
            "sync_to_rank0": [dataclasses.asdict(c) for c in self.syncs],
        }

    def stream_path(self, directory: str) -> str:
        rank = rank_info(self.config.rank).rank
        ext = registry.get(self.config.format).extension
        return os.path.join(directory, f"trace_rank{rank}{ext}")

    def _open_stream(self, rec: Recorder) -> Any:
        assert self.config.out_dir
        path = self.stream_path(self.config.out_dir)
        info = rank_info(self.config.rank)
        base = self.started_ns - _BASE_MARGIN_NS
        process = Process(info.rank + 1, info.rank, self.process_label(rec, info.rank), info.rank)
        header = self._header(rec, rec.store, 0)
        writer = _stream_class(self.config.format)
        try:
            self.stream = writer(path, base, process, header)
        except OSError as e:
            raise GputraceError(f"cannot write {path}: {e.strerror or e}") from None
        # The sinks every flush feeds, in this order: the digest is written once its trace is.
        step = self.config.step_name
        self.sinks = [
            StreamSink(self.stream, self.config.launch_arrows),
            StreamDigest(path, step, base, process.label, self._digest_written),
        ]
        watcher = self._watch(rec)
        if watcher is not None:
            with rec._lock:
                watcher.restart()  # a new stream: its ordinals start again
            self.sinks.append(live.OpenSink(watcher))
        self._install_signal_handlers()
        return self.stream

    def _header(self, rec: Recorder, store: SpanStore, unfinished: int) -> dict[str, Any]:
        info = rank_info(self.config.rank)
        return {
            "distributedInfo": {"rank": info.rank, "world_size": info.world_size},
            "metadata": self.metadata(rec, store, unfinished),
        }

    def _append(self, rec: Recorder, final: bool = False) -> None:
        """Append the resolved spans (and counters) to the stream; they then leave memory."""
        stream = self.stream if self.stream is not None and not self.stream.closed else None
        if stream is None and self.stream is not None and not len(rec.store) and not len(self.counters):
            if not self._header_changed(self.stream):
                return  # a finished file and nothing new: left as it is (a second save is free)
        if stream is None and self.stream is None:
            stream = self._open_stream(rec)
        elif stream is None:
            try:
                stream = self._resume(rec)
            except (OSError, GputraceError) as e:
                self._unwritable(rec, self.stream, e, len(self._take(rec)))
                return
        # The rows leave the recorder's store in one step: other threads go on resolving into it.
        # The open file's watcher counts them as they leave (its ordinals), under the same lock.
        store = self._take(rec)
        trace = self.rank_trace(rec, store, chunk=True)
        _clamp_to_base(trace, stream.base_ns)
        update = None
        told = (getattr(stream, "syncs_written", 0), getattr(stream, "run_id", None))
        if self._header_changed(stream):
            meta: dict[str, Any] = {"run_id": self.run_id, "clock_syncs": self._new_syncs(stream)}
            if self.unwritten:
                meta["spans_unwritten"] = self.unwritten
            update = {"metadata": meta}
        try:
            self.sinks[0].add(trace, update)  # the stream: the others take what it has written
        except OSError as e:
            stream.syncs_written, stream.run_id = told  # the update goes with the next chunk written
            self._unwritable(rec, stream, e, len(store))
            return
        stream.unwritten_told = self.unwritten
        for sink in self.sinks[1:]:
            sink.add(trace, update)
        self.counters = CounterColumns()

    def _take(self, rec: Recorder) -> SpanStore:
        """The resolved rows, out of the recorder's store (`Recorder.take_resolved`); the open
        file's watcher counts them as they leave (its ordinals), under the same lock."""
        watcher = self.watcher
        if watcher is None:
            return rec.take_resolved()
        with rec._lock:
            store = rec.take_resolved()
            watcher.count_taken(store)
        return store

    def _unwritable(self, rec: Recorder, stream: Any, error: BaseException, spans: int) -> None:
        """The stream's file cannot take this flush's spans (the disk is full, the file past its
        size limit): they are dropped and counted (`spans_unwritten`, in the header once the file
        takes a write again, and at save), with one warning; memory stays flat. The file keeps
        what it had: a write cut short is taken back (`AppendFile`)."""
        self.unwritten += spans
        self.counters = CounterColumns()
        if not self._told_unwritable:
            self._told_unwritable = True
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            warnings.warn(
                f"gputrace cannot write {stream.path}: {reason}; the spans of each flush that cannot be written are "
                "dropped and counted in the trace (spans_unwritten)",
                GputraceWarning,
                stacklevel=4,
            )

    def _header_changed(self, stream: Any) -> bool:
        return (
            getattr(stream, "syncs_written", 0) != len(self.syncs)
            or getattr(stream, "run_id", None) != self.run_id
            or getattr(stream, "unwritten_told", 0) != self.unwritten
        )

    def _new_syncs(self, stream: Any) -> list[dict[str, Any]]:
        done = getattr(stream, "syncs_written", 0)
        stream.syncs_written = len(self.syncs)
        stream.run_id = self.run_id
        return [dataclasses.asdict(c) for c in self.syncs[done:]]

    def _resume(self, rec: Recorder) -> Any:
        self.stream.resume()
        return self.stream

    def _finish_stream(self) -> str | None:
        """Append the open spans (marked unfinished) and write the final header."""
        stream = self.stream
        rec = self.recorder
        if stream is None or stream.closed or rec is None:
            return stream.path if stream is not None else None
        snapshot = rec.resolve_open()
        trace = self.rank_trace(rec, snapshot, chunk=True)
        _clamp_to_base(trace, stream.base_ns)
        trace.counters = CounterColumns()  # the last flush's chunk carried them
        unfinished = len(snapshot)
        try:
            self.sinks[0].add(trace)
        except OSError as e:
            self._unwritable(rec, stream, e, unfinished)
            unfinished = 0
        else:
            for sink in self.sinks[1:]:
                sink.add(trace)
        header = self._header(rec, rec.store, unfinished)
        header["metadata"]["spans"] = stream.spans_written
        header["metadata"]["overflow_tracks"] = stream.overflow_tracks()
        try:
            for sink in self.sinks:
                sink.finish(header)
        except OSError as e:  # the file as streamed stays, loadable
            raise GputraceError(f"cannot finish {stream.path}: {e.strerror or e}") from None
        return str(stream.path)

    def _digest_written(self, path: str) -> None:
        self.state.last_digest = path

    def save(self, path: str | os.PathLike[str] | None = None, format: str | None = None) -> str:
        """Write the trace; see `gputrace.save`."""
        target = os.fspath(path) if path is not None else self.config.out_dir
        if not target:
            raise GputraceError("save() needs a path, or the out_dir option (GPUTRACE_OUT_DIR)")
        rec = self.recorder
        if rec is None:
            raise GputraceError("nothing recorded: call gputrace.enable() (or set GPUTRACE=1) first")
        fmt = registry.for_path(target, format) if (format or not os.path.isdir(target)) else None
        is_file = registry.by_extension(target) is not None  # any registered extension: a file
        with self._critical() as done:
            self.flush(wait=True)
            if self.config.out_dir:  # streaming: the file is on disk already
                streamed = self._finish_stream()
                self.saved = True
                if streamed is None:
                    streamed = self.stream_path(self.config.out_dir)
                if not is_file:
                    target = os.path.join(target, os.path.basename(streamed))
                if os.path.abspath(target) != os.path.abspath(streamed):
                    _convert(streamed, target, fmt or registry.for_path(target))
                done.append(True)
                return target
            if not is_file:
                rank = rank_info(self.config.rank).rank
                ext = registry.get(format or registry.DEFAULT).extension
                target = os.path.join(target, f"trace_rank{rank}{ext}")
            trace = self.snapshot(rec)
            # The sinks of a trace saved whole: fed it while it reaches the disk, finished once
            # it is there.
            sinks: list[Sink] = [TraceDigest(target, self.config.step_name, self._digest_written)]
            fed: list[bool] = []

            def feed() -> None:
                fed.append(True)
                for sink in sinks:
                    sink.add(trace)

            write_trace(
                trace if self.config.launch_arrows else trace.without_entry(),
                target,
                fmt or registry.for_path(target),
                feed,
            )
            if not fed:
                feed()
            for sink in sinks:
                sink.finish({"metadata": trace.metadata})
            self.saved = True
            return target  # not `done`: a signal's handler still finishes a stream, if any

    def snapshot(self, rec: Recorder) -> Trace:
        """Everything recorded and not yet streamed, open spans included (closed at this moment
        in a throwaway store, marked `unfinished`)."""
        rec.flush(wait=True)
        snapshot = rec.resolve_open()
        # Other threads may be resolving into the store (a full pending list resolves on any
        # thread's span exit): their rows are copied in one step; alone, nothing can change it.
        store = rec.resolved_copy() if threading.active_count() > 1 else rec.store
        trace = self.rank_trace(rec, store)
        if len(snapshot):
            meta = self.metadata(rec, store, len(snapshot))
            trace.metadata.update(meta)
            trace.processes[0] = dataclasses.replace(trace.processes[0], metadata=trace.metadata)
            # The snapshot's rows join the store's columns in a copy (open spans are few); the
            # snapshot shares the store's names.
            full = SpanColumns()
            full.extend(trace.spans.name, trace.spans.track, trace.spans.start, trace.spans.end, trace.spans.args)
            full.extend(snapshot.name, snapshot.track, snapshot.start, snapshot.end, snapshot.args)
            full.entry = store.entry + snapshot.entry
            trace.spans = full
        return trace

    def reset(self) -> None:
        """Discard everything recorded so far and start a fresh trace (spans open now stay open
        and close into it). With an output directory, the rank's file starts again."""
        with self._critical():
            rec = self.recorder
            if rec is not None:
                rec.discard()
            for sink in self.sinks:
                sink.abandon()
            self.stream = None
            self.sinks = []
            self.counter_names = []
            self.counters = CounterColumns()
            self.saved = False
            self.unwritten, self._told_unwritable = 0, False
            if self.clock is not None:
                self.started_ns = self.clock.now()

    # ---- clocks across ranks -----------------------------------------------------------------

    def sync_clocks(self, group: Any = None, exchanges: int = 16) -> ClockSync | None:
        result = _sync_clocks(
            self.host_clock(), group, exchanges, recorder=self._recorder_now, gloo_groups=self.state.gloo_groups
        )
        if result is not None:
            self.syncs.append(result)
            if self.run_id is None:
                self.run_id = _shared_run_id(group, self.state.gloo_groups)
        return result

    def _recorder_now(self) -> Recorder | None:
        """The recorder, built now if recording is on from the environment and no span has built
        it yet (the clock sync's device refinement needs it)."""
        rec = self.recorder
        if rec is None and self.state.lazy is not None:
            rec = self.state.lazy()
        return rec

    def gather_digests(self, out_dir: str | None = None, group: Any = None, dst: int = 0) -> list[str]:
        """See `gather_digests`."""
        return _gather_digests(self.state.last_digest, out_dir or self.config.out_dir, group, dst,
                              gloo_groups=self.state.gloo_groups)  # fmt: skip

    # ---- exit and signals --------------------------------------------------------------------

    def close(self) -> None:
        """Back to a fresh session: the stream left as it is on disk, signal handlers handed
        back, recording off, the process-wide state cleared (what a test between two tests
        needs)."""
        for sink in self.sinks:
            sink.abandon()
        if self.watcher is not None:
            self.watcher.stop()
        for sig, previous in self._previous.items():
            try:
                signal.signal(sig, previous)
            except (ValueError, OSError, TypeError):
                pass
        registered = self._atexit
        state = self.state
        state.clear()
        self.__init__(state)  # type: ignore[misc]
        self._atexit = registered

    def _register_atexit(self) -> None:
        if not self._atexit:
            atexit.register(self._at_exit)
            self._atexit = True

    def _at_exit(self) -> None:
        rec = self.recorder
        if rec is None:
            return
        try:
            if self.config.out_dir:
                self.save()
            elif not self.saved and (len(rec.store) or rec.pending):
                warnings.warn(
                    "gputrace recorded spans that nothing will write: call gputrace.save(path), or set an output "
                    "directory (enable(out_dir=...) or GPUTRACE_OUT_DIR)",
                    GputraceWarning,
                    stacklevel=1,
                )
        except Exception as e:  # noqa: BLE001 - at exit a warning is all that can be done
            warnings.warn(f"gputrace could not save the trace at exit: {e}", GputraceWarning, stacklevel=1)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; exit still finishes the file
        for sig in _SIGNALS:
            if sig in self._previous:
                continue
            try:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                self._previous.pop(sig, None)

    def _on_signal(self, signum: int, frame: Any) -> None:
        rec = self.recorder
        if getattr(self._inside, "depth", 0):  # inside a flush, save or reset: handled when it ends
            self._deferred = (signum, frame)
            return
        if rec is not None and rec.busy_here():  # a resolve a span exit began: handled when it ends
            self._deferred = (signum, frame)
            rec.on_release(self._run_deferred)
            return
        self._handle_signal(signum, frame)

    def _run_deferred(self) -> None:
        """The signal deferred by `_on_signal` while the recorder was busy on this thread."""
        if getattr(self._inside, "depth", 0):
            return  # the session's own flush, save or reset handles it as it ends
        if threading.current_thread() is not threading.main_thread():
            rec = self.recorder  # another thread's flush ended first: the main thread's is next
            if rec is not None and self._deferred is not None:
                rec.on_release(self._run_deferred)
            return
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._handle_signal(*deferred)

    def _handle_signal(self, signum: int, frame: Any, write: bool = True) -> None:
        """What a SIGTERM or SIGINT does: with `write`, finish the file (the program dies of
        it) or flush (a handler of the program's own runs next); then the handler before ours."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        try:
            if not write:
                pass  # a save just finished the file
            elif previous == signal.SIG_DFL or previous is None:
                # The program dies of this signal: finish the file first.
                self.save()
            else:
                self.flush()
        except Exception as e:  # noqa: BLE001 - the signal must still be handled
            warnings.warn(f"gputrace could not finish the trace on signal {signum}: {e}", GputraceWarning, stacklevel=1)
        if previous == signal.SIG_DFL or previous is None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        elif callable(previous):
            previous(signum, frame)
        # SIG_IGN: ignored, as before


class _Critical:
    """`Session._critical()`'s context: this thread's depth of flush/save/reset, then the lock."""

    __slots__ = ("session", "depth", "done")

    def __init__(self, session: Session) -> None:
        self.session = session
        self.done: list[bool] = []

    def __enter__(self) -> list[bool]:
        inside = self.session._inside
        self.depth = depth = getattr(inside, "depth", 0)
        inside.depth = depth + 1
        try:
            self.session.lock.acquire()
        except BaseException:
            inside.depth = depth
            raise
        return self.done

    def __exit__(self, *exc: object) -> None:
        session = self.session
        session.lock.release()
        session._inside.depth = self.depth
        if self.depth == 0 and session._deferred is not None:
            session._after_critical(self.done)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # looking at traces on a laptop: host spans only
        return False
    return bool(torch.cuda.is_available())


def _stream_class(fmt: str) -> Any:
    """What opens a stream writer of the format called `fmt` (path, base_ns, process, header)."""
    return registry.get(fmt).stream_writer


def write_trace(trace: Trace, path: str, fmt: registry.Format, meanwhile: Callable[[], object] | None = None) -> None:
    """`trace` to `path` atomically in `fmt`; `meanwhile` runs before the file is in place (while
    the JSON file reaches the disk)."""
    fmt.write(trace, path, ordered=True, meanwhile=meanwhile)


def _convert(src: str, dst: str, fmt: registry.Format) -> None:
    if fmt is registry.detect(src):
        import shutil

        from gputrace.trace.files import atomic_writer

        with open(src, "rb") as f, atomic_writer(dst) as out:
            shutil.copyfileobj(f, out, 16 << 20)
        return
    write_trace(registry.read(src), dst, fmt)


def _clamp_to_base(trace: Trace, base: int) -> None:
    """A device span placed a few microseconds before the session began (anchor error) starts
    at the stream's base instead: a trace's times never lie before its base."""
    sp = trace.spans
    if len(sp) and min(sp.start) < base:
        for i in range(len(sp)):
            if sp.start[i] < base:
                sp.start[i] = base
                if sp.end[i] < base:
                    sp.end[i] = base


def _device_of(name: str) -> int | None:
    if name.startswith("cuda:"):
        try:
            return int(name[5:].split(" ", 1)[0])
        except ValueError:
            return None
    return None


def _run_id_from_env(config: Config) -> str | None:
    """An id every rank of one job shares: the option, then the launcher's job id. Without one a
    multi-rank run gets its id from rank 0 at sync_clocks(); a single process makes its own. A
    rank of unknown world size (`enable(rank=r)`, no WORLD_SIZE) has none: with no process group
    there is no id to share, and an id of rank 0's own would set it apart from the others."""
    if config.run_id:
        return config.run_id
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID"):
        value = os.environ.get(name)
        if value and value != "none":
            step = os.environ.get("SLURM_STEP_ID") if name == "SLURM_JOB_ID" else None
            return f"{value}.{step}" if step else value
    world = rank_info(config.rank).world_size
    if world is not None and world <= 1:
        return uuid.uuid4().hex
    return None


def _shared_run_id(group: Any, gloo_groups: dict[int, object]) -> str | None:
    """Rank 0's id, given to every rank (a collective, called from sync_clocks)."""
    import torch
    import torch.distributed as dist

    g = gloo_group(dist, group, gloo_groups)  # through gloo, whatever the default is
    ranks = dist.get_process_group_ranks(g) if g is not None else list(range(dist.get_world_size()))
    # 128 bits as two int64 (object collectives would need numpy, which torch does not require).
    mine = uuid.uuid4().int
    box = torch.tensor([(mine >> 64) - (1 << 63), (mine & ((1 << 64) - 1)) - (1 << 63)], dtype=torch.int64)
    dist.broadcast(box, src=ranks[0], group=g)
    hi, lo = (int(v) + (1 << 63) for v in box.tolist())
    return f"{(hi << 64) | lo:032x}"


SESSION = Session()


# ---- the public functions ------------------------------------------------------------------------


def enable(**options: Any) -> None:
    """Turn recording on (again), with options from `Config` on top of the environment's. Called
    again while recording, it applies the new options (or raises `ConfigError` saying why it
    cannot)."""
    SESSION.enable(**options)


def enable_from_env() -> None:
    SESSION.enable_from_env()


def disable() -> None:
    """Stop recording new spans. Open spans still close; what was recorded can still be saved."""
    SESSION.disable()


def is_enabled() -> bool:
    return SESSION.is_enabled()


def set_host_clock(clock: HostClock) -> None:
    """Replace the host clock (a test seam: a clock shifted by a known amount plays a host whose
    clock is off). Only before recording starts."""
    SESSION.set_host_clock(clock)


def host_clock() -> HostClock:
    return SESSION.host_clock()


def flush() -> int:
    """Resolve the spans the GPU has finished, without draining it; with an output directory,
    append them to the rank's file. Call it once a step (or every few seconds) in long runs: it
    re-anchors the clocks and keeps memory flat. Returns the number of spans resolved (0 within
    `anchor_every_ms` of a flush that anchored, when not streaming: they wait for the next)."""
    return SESSION.flush()


def save(path: str | os.PathLike[str] | None = None, format: str | None = None) -> str:
    """Write the trace. A directory (or a path without a trace extension) gets
    `trace_rank{R}.json` (`.pftrace` with format="perfetto"). Without a path, the configured
    `out_dir`. `format`: "json" or "perfetto"; by default chosen by the extension. Returns the
    file written. With an output directory set (streaming), the streamed file is finished."""
    return SESSION.save(path, format)


def reset() -> None:
    """Discard everything recorded so far and start a fresh trace."""
    SESSION.reset()


def sync_clocks(group: Any = None, exchanges: int = 16) -> ClockSync | None:
    """Measure this rank's host clock against rank 0's (collective: every rank calls it).
    Call it once after init_process_group and again now and then in long runs: each estimate
    goes into the trace, and `gputrace merge` applies them. Works with NCCL (through a gloo
    side group) and gloo. Returns None without torch.distributed."""
    return SESSION.sync_clocks(group, exchanges)


def last_report() -> dict[str, Any] | None:
    """The last straggler report (`report_every`), as a dict, on every rank: the window of
    steps, per rank its median step, busy and wait ns with its relative and individual scores,
    the slowest rank and by how much, the cause, and the line rank 0 logged. None before the
    first report, or without `report_every`."""
    r = SESSION.reporter
    return r.last if r is not None else None


def gather_digests(out_dir: str | None = None, group: Any = None, dst: int = 0) -> list[str]:
    """Collective (every rank of `group` calls it, after `gputrace.save()`): each rank's digest
    goes to rank `dst`, which writes them all into `out_dir` (default: its output directory) as
    `digest_rank{R}.digest`, so that `gputrace summary` there reads every rank without their
    traces. Returns the paths written (on `dst`; an empty list elsewhere)."""
    return SESSION.gather_digests(out_dir, group, dst)


def trace() -> Trace:
    """Everything recorded so far, not yet streamed, as a `Trace` (waits for the GPU)."""
    rec = SESSION.recorder
    if rec is None:
        raise GputraceError("nothing recorded: call gputrace.enable() (or set GPUTRACE=1) first")
    with SESSION._critical():
        return SESSION.snapshot(rec)


def trace_bytes() -> bytes:
    """Everything recorded so far as Chrome trace JSON (waits for the GPU)."""
    return chrome.encode(trace(), ordered=True)


def trace_dict() -> dict[str, Any]:
    """Everything recorded so far as a Chrome trace dict (waits for the GPU). Spans still open
    are included up to now, marked `unfinished`."""
    import orjson

    return orjson.loads(trace_bytes())  # type: ignore[no-any-return]
