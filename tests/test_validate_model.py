"""validate of a format without raw Chrome events (Perfetto protobuf; the toy format): what it
finds in files whose slices run backwards or cross, on tracks in any order, each finding as it
was worded before the check moved from a tuple a span to the columns."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from gputrace.cli import main
from gputrace.trace import registry
from gputrace.validate import format_report, validate_file

from . import toy_format

# (track, name, start, end) in file order: backwards spans, crossing ones, a track whose first
# span runs backwards, nesting at equal starts and ends, a track written in two runs.
SLICES = [
    ("b", "back", 500, 100),
    ("a", "outer", 0, 1_000),
    ("a", "inner", 100, 200),
    ("a", "cross", 900, 1_500),
    ("c", "same", 50, 80),
    ("c", "same2", 50, 80),
    ("c", "longer", 50, 90),
    ("b", "ok", 0, 10),
    ("b", "x", 5, 20),
    ("a", "back2", 40, 30),
    ("a", "late", 1_200, 1_300),
    ("c", "y", 85, 95),
] + [("d", f"s{k}", k * 10, k * 10 + 15) for k in range(30)]

#: What validate said of these files before (the same for both formats but the span numbers
#: and track names, which follow each reader's order).
CROSSING_D = [f"track 'd': span {i} partly overlaps the span it starts in" for i in range(13, 42, 2)]


def protobuf_file(path: Path) -> None:
    """SLICES as begin/end events of a Perfetto trace, each track's slices in the order given
    (a slice's end right after its begin, so the reader's stacks pair them as listed)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace()
    uuids = {name: k + 1 for k, name in enumerate(dict.fromkeys(t for t, *_ in SLICES))}
    for name, uuid in uuids.items():
        trace.packet.add(track_descriptor=pb.TrackDescriptor(uuid=uuid, name=name))
    for track, name, start, end in SLICES:
        for ts, kind in ((start, pb.TrackEvent.TYPE_SLICE_BEGIN), (end, pb.TrackEvent.TYPE_SLICE_END)):
            p = trace.packet.add(timestamp=ts, trusted_packet_sequence_id=1)
            p.track_event.type = kind
            p.track_event.track_uuid = uuids[track]
            if kind == pb.TrackEvent.TYPE_SLICE_BEGIN:
                p.track_event.name = name
    path.write_bytes(trace.SerializeToString())


def test_protobuf_findings_are_worded_and_counted_as_before(tmp_path: Path) -> None:
    pytest.importorskip("gputrace.trace.perfetto")
    path = tmp_path / "slices.pftrace"
    protobuf_file(path)
    report = validate_file(str(path))
    # The reader gives each track's spans together, tracks named by their uuid.
    assert (report.spans, report.tracks, report.own) == (len(SLICES), 4, False)
    assert report.errors == [
        "span 0 ('back') ends before it starts",
        "span 6 ('back2') ends before it starts",
        "track 'track 1': span 2 partly overlaps the span it starts in",
        "track 'track 2': span 5 partly overlaps the span it starts in",
        "track 'track 3': span 11 partly overlaps the span it starts in",
    ] + [e.replace("'d'", "'track 4'") for e in CROSSING_D]
    capped = validate_file(str(path), limit=2)
    assert capped.errors == [
        "span 0 ('back') ends before it starts",
        "span 6 ('back2') ends before it starts",
        "... and 18 more errors",
    ]
    r = CliRunner().invoke(main, ["validate", str(path)])
    assert r.exit_code == 1 and "partly overlaps" in r.output


def test_a_format_whose_tracks_come_in_several_runs_is_checked_the_same(tmp_path: Path, toy: registry.Format) -> None:
    tracks = list(dict.fromkeys(t for t, *_ in SLICES))
    lines = [toy_format.MAGIC]
    lines.append(b"H " + orjson.dumps({"baseTimeNanoseconds": 0, "distributedInfo": {}, "metadata": {}}) + b"\n")
    lines.append(b"P " + orjson.dumps([1, None, "p", 0, True, {}]) + b"\n")
    for k, t in enumerate(tracks):
        lines.append(b"T " + orjson.dumps([k, 0, k + 1, t, "other", None, k]) + b"\n")
    for t, name, start, end in SLICES:
        lines.append(b"S " + orjson.dumps([tracks.index(t), start, end, name, None, None]) + b"\n")
    path = tmp_path / "slices.toy"
    path.write_bytes(b"".join(lines))
    report = validate_file(str(path))
    assert (report.spans, report.tracks) == (len(SLICES), 4), format_report(report)
    # Tracks in the order of their first span that runs forwards: b's first one runs backwards.
    assert report.errors == [
        "span 0 ('back') ends before it starts",
        "span 9 ('back2') ends before it starts",
        "track 'a': span 3 partly overlaps the span it starts in",
        "track 'c': span 11 partly overlaps the span it starts in",
        "track 'b': span 8 partly overlaps the span it starts in",
        *CROSSING_D,
    ]
