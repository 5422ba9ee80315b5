"""The process-wide API: turn recording on and off, flush, save.

Takes: options (keyword arguments or the environment, through `Config`). Gives: the one
`Recorder` of the process, and trace files written from it.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import statistics
import threading
import warnings
from typing import Any

import orjson

from gputrace import record
from gputrace.clock import HostClock
from gputrace.config import Config
from gputrace.dist import ClockSync, rank_info
from gputrace.dist import sync_clocks as _sync_clocks
from gputrace.errors import GputraceError, GputraceWarning
from gputrace.export import ProcessInfo, TrackInfo, encode_trace, write
from gputrace.record import Recorder, Span
from gputrace.resolve import SpanStore, nest_rounding, resolve
from gputrace.version import __version__

_lock = threading.RLock()
_config = Config()
_clock: HostClock | None = None
_atexit_registered = False
_clock_syncs: list[ClockSync] = []


def enable(**options: Any) -> None:
    """Turn recording on (again), with options from `Config` on top of the environment's."""
    global _config
    with _lock:
        _config = Config.from_env().replace(**options)
        rec = record.ACTIVE
        if rec is not None:
            rec.config = _config
            record.set_recorder(rec, rec)
        else:
            _build()
        _register_atexit()


def enable_from_env() -> None:
    """Recording on from the environment, at import. Building the recorder imports torch, which
    `import gputrace` and the CLI must not, so the first span builds it."""
    global _config
    _config = Config.from_env()
    record.LAZY = _build
    _register_atexit()


def disable() -> None:
    """Stop recording new spans. Open spans still close; what was recorded can still be saved."""
    record.LAZY = None
    record.set_recorder(None, record.ACTIVE)


def is_enabled() -> bool:
    return record.RECORDER is not None or record.LAZY is not None


def set_host_clock(clock: HostClock) -> None:
    """Replace the host clock (a test seam: a clock shifted by a known amount plays a host whose
    clock is off). Only before recording starts."""
    global _clock
    if record.ACTIVE is not None:
        raise GputraceError("set_host_clock() must be called before enable()")
    _clock = clock


def host_clock() -> HostClock:
    global _clock
    if _clock is None:
        _clock = HostClock()
    return _clock


def _build() -> Recorder:
    with _lock:
        rec = record.ACTIVE
        if rec is None:
            device = None
            if _config.cuda:
                try:
                    import torch
                except ImportError:  # looking at traces on a laptop: host spans only
                    torch = None
                if torch is not None and torch.cuda.is_available():
                    from gputrace.cuda import CudaDevice

                    device = CudaDevice()
            record.bind_compile_check()
            rec = Recorder(_config, device, host_clock())
        record.LAZY = None
        record.set_recorder(rec, rec)
        return rec


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_save_at_exit)
        _atexit_registered = True


def _save_at_exit() -> None:
    if _config.out_dir and record.ACTIVE is not None:
        try:
            save(_config.out_dir)
        except Exception as e:  # noqa: BLE001 - at exit a warning is all that can be done
            warnings.warn(f"gputrace could not save the trace at exit: {e}", GputraceWarning, stacklevel=1)


def sync_clocks(group: Any = None, exchanges: int = 16) -> ClockSync | None:
    """Measure this rank's host clock against rank 0's (collective: every rank calls it).
    Call it once after init_process_group and again now and then in long runs: each estimate
    goes into the trace, and `gputrace merge` applies them. Works with NCCL (through a gloo
    side group) and gloo. Returns None without torch.distributed."""
    result = _sync_clocks(host_clock(), group, exchanges)
    if result is not None:
        _clock_syncs.append(result)
    return result


def flush() -> int:
    """Resolve the spans the GPU has finished, without draining it. Call it once a step (or
    every few seconds) in long runs: it re-anchors the clocks and keeps memory flat.
    Returns the number of spans resolved."""
    rec = record.ACTIVE
    return rec.flush(wait=False) if rec is not None else 0


def trace_dict() -> dict[str, Any]:
    """Everything recorded so far as a Chrome trace dict (waits for the GPU). Spans still open
    are included up to now, marked `unfinished`."""
    return orjson.loads(trace_bytes())


def trace_bytes() -> bytes:
    """Everything recorded so far as Chrome trace JSON (waits for the GPU)."""
    rec = record.ACTIVE
    if rec is None:
        raise GputraceError("nothing recorded: call gputrace.enable() (or set GPUTRACE=1) first")
    with rec._lock:
        rec.flush(wait=True)
        store = rec.store
        nest_rounding(store, {t.index for t in rec.tracks if t.device is not None})
        snapshot = _open_span_snapshot(rec)
        info = rank_info(rec.config.rank)
        tracks = [TrackInfo(t.name, t.device is not None, t.device, t.ordinal) for t in rec.tracks]
        devices = [rec.device.name(d) for d in range(rec.device.count())] if rec.device is not None else []
        used = sorted({t.device for t in rec.tracks if t.device is not None})
        label_dev = ", ".join(sorted({devices[d] for d in used})) if used else "cpu"
        host = socket.gethostname()
        meta = {
            "gputrace_version": __version__,
            "hostname": host,
            "pid": os.getpid(),
            "rank": info.rank,
            "world_size": info.world_size,
            "local_rank": info.local_rank,
            "rank_source": info.source,
            "devices": devices,
            "clock": _clock_meta(rec),
            "spans": len(store) + len(snapshot),
            "spans_dropped": store.dropped,
            "spans_unfinished": len(snapshot),
            "spans_skipped_in_cuda_graph_capture": rec.skipped_in_capture,
            "options": {k: v for k, v in vars(rec.config).items()},
        }
        process = ProcessInfo(info.rank, info.world_size, f"rank {info.rank} ({host}, {label_dev})", meta)
        return encode_trace(
            store.names + snapshot.names,
            list(store.name) + [i + len(store.names) for i in snapshot.name],
            list(store.track) + list(snapshot.track),
            list(store.start) + list(snapshot.start),
            list(store.end) + list(snapshot.end),
            store.args + snapshot.args,
            tracks,
            process,
        )


def _open_span_snapshot(rec: Recorder) -> SpanStore:
    """Spans open now, closed at this moment in a throwaway store (the real ones stay open)."""
    snap = SpanStore(rec.config.max_spans)
    copies = []
    for s in rec.open_spans():
        c = Span(s.name, {**(s.args or {}), "unfinished": True})
        c.stack, c.parent, c.id, c.t0 = s.stack, s.parent, rec.store.id_of(s), s.t0
        if s.track.device is None:  # type: ignore[union-attr]
            c.t1 = rec.clock.monotonic_ns()
        else:
            c.gen, c.t1 = s.gen, rec._new_event()
            rec.device.record(c.t1, s.track.stream)  # type: ignore[union-attr]
        copies.append(c)
    if copies:
        if rec.device is not None:
            rec.device.synchronize()
            for dev in sorted({c.track.device for c in copies} - {None}):  # type: ignore[union-attr]
                rec._anchor(dev)  # type: ignore[arg-type]
        pools: list[list[Any]] = [[] for _ in rec.timelines]  # the originals keep their start events
        resolve(copies, rec.timelines, rec.clock, snap, pools)
    return snap


def _clock_meta(rec: Recorder) -> dict[str, Any]:
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
        "sync_to_rank0": [dataclasses.asdict(c) for c in _clock_syncs],
    }


def save(path: str | os.PathLike[str] | None = None) -> str:
    """Write the trace. A directory (or a path without `.json`) gets `trace_rank{R}.json`.
    Without a path, the configured `out_dir`. Returns the file written."""
    target = os.fspath(path) if path is not None else _config.out_dir
    if not target:
        raise GputraceError("save() needs a path, or the out_dir option (GPUTRACE_OUT_DIR)")
    data = trace_bytes()
    if os.path.isdir(target) or not target.endswith(".json"):
        rec = record.ACTIVE
        rank = rank_info(rec.config.rank if rec is not None else None).rank
        target = os.path.join(target, f"trace_rank{rank}.json")
    write(target, data)
    return target
