"""The C loops of the page's first document and the steps' table (csrc/first.c) against their
Python twins, on random inputs: a digest's span rows to the rows the page draws
(`viewer.first._rows_py`), per step the largest, its rank and the median
(`stats_columns._columns_py`), and the other ranks' median (`viewer.findings._others_median_py`);
columns a digest's reader refuses are refused by both."""

from __future__ import annotations

import random
from array import array
from typing import Any

import pytest

from gputrace import native, stats_columns
from gputrace.viewer import findings, first

hot = native.hot
needs_c = pytest.mark.skipif(hot is None or not hasattr(hot, "first_rows"), reason="the C build is not in use")


def random_rows(rng: random.Random) -> tuple[Any, ...]:
    """A digest's span columns as the parsed file gives them: names (the step, waiting names,
    others; names made equal by cleaning), tracks, starts as deltas (out of order at times),
    durations, flags 0-7; the names' kinds and the tracks' count."""
    n = rng.choice([0, 1, 2, 50, 700])
    names_n = rng.randrange(1, 6)
    kinds = bytes(rng.choice([0, 1, 2]) for _ in range(names_n))
    n_tracks = rng.randrange(1, 5)
    name = [rng.randrange(names_n) for _ in range(n)]
    track = [rng.randrange(n_tracks) for _ in range(n)]
    start = [
        rng.choice([0, 5, rng.randrange(10**6), -rng.randrange(10**4) if rng.random() < 0.1 else 3]) for _ in range(n)
    ]
    dur = [rng.choice([0, rng.randrange(10**5)]) for _ in range(n)]
    flags = [rng.choice([0, 0, 1, 2, 3, 4, 5, 6, 7]) for _ in range(n)]
    base = rng.choice([0, 1_700_000_000_000_000_000, -(10**9)])
    return name, track, start, dur, flags, base, kinds, n_tracks


@needs_c
def test_a_digests_rows_read_by_c_are_the_python_twins() -> None:
    rng = random.Random(20)
    for _ in range(300):
        cols = random_rows(rng)
        assert hot.first_rows(*cols) == first._rows_py(*cols)  # type: ignore[union-attr]


@needs_c
@pytest.mark.parametrize(
    "damage",
    ["flags", "track", "name", "dur", "type", "length", "overflow", "time past 64 bits", "not a list"],
)
def test_rows_a_digests_reader_refuses_are_refused_by_both(damage: str) -> None:
    seed = 3
    name, track, start, dur, flags, base, kinds, n_tracks = random_rows(random.Random(seed))
    while len(name) < 3:
        seed += 1
        name, track, start, dur, flags, base, kinds, n_tracks = random_rows(random.Random(seed))
    cols: list[Any] = [list(name), list(track), list(start), list(dur), list(flags)]
    if damage == "flags":
        cols[4][1] = 8
    elif damage == "track":
        cols[1][0] = n_tracks
    elif damage == "name":
        cols[0][-1] = len(kinds)
    elif damage == "dur":
        cols[3][1] = -1
    elif damage == "type":
        cols[2][1] = 1.5
    elif damage == "length":
        cols[3].pop()
    elif damage == "overflow":
        cols[2][1] = 2**64
    elif damage == "time past 64 bits":  # each delta within 64 bits, their sum not
        cols[2][:3] = [2**62] * 3
    elif damage == "not a list":
        cols[0] = tuple(cols[0])
    for fn in (hot.first_rows, first._rows_py):  # type: ignore[union-attr]
        with pytest.raises(ValueError):
            fn(*cols, base, kinds, n_tracks)


def random_table(rng: random.Random) -> list[Any]:
    """Ranks' rows of a step table: busy times with ties, zeros, negatives, large values; lists
    or int64 arrays."""
    n = rng.choice([1, 2, 3, 4, 5, 8, 64])
    count = rng.choice([0, 1, 7, 300])
    pick = [0, 1, 1, 2, rng.randrange(10**6), -rng.randrange(10**3), 2**62, -(2**62), 2**63 - 1, -(2**63)]
    rows = [[rng.choice(pick) if rng.random() < 0.3 else rng.randrange(10**7) for _ in range(count)] for _ in range(n)]
    return [array("q", r) if rng.random() < 0.3 else r for r in rows]


@needs_c
def test_the_step_tables_columns_by_c_are_the_python_twins() -> None:
    rng = random.Random(21)
    for _ in range(300):
        rows = random_table(rng)
        count = len(rows[0])
        assert hot.first_columns(rows, count) == stats_columns._columns_py(rows, count)  # type: ignore[union-attr]
        if len(rows) >= 2:
            assert hot.first_others_median(rows, count) == findings._others_median_py(rows)  # type: ignore[union-attr]


def test_the_columns_and_the_others_median_are_what_they_say() -> None:
    """The twins' numbers by hand: per step the largest (the first rank holding it), the median
    (the floor of the middle two's mean), and each rank's others' median, through the public
    functions in whichever build is in use."""
    rows = [[5, 1, 9], [7, 1, -3], [5, 4, -4], [1, 2, 2]]
    assert stats_columns.columns(rows, 3) == ([7, 4, 9], [1, 2, 0], [5, 1, -1])
    assert findings.others_median(rows) == [[5, 2, -3], [5, 2, 2], [5, 1, 2], [5, 1, -3]]
    assert findings.others_median(rows[:2]) == [rows[1], rows[0]]
    assert stats_columns.columns([], 0) == ([], [], [])
    big = [[2**70, 1], [0, 2]]  # past 64 bits: the twin takes them
    assert stats_columns.columns(big, 2) == ([2**70, 2], [0, 1], [2**69, 1])
