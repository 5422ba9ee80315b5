"""Columns that keep their rows outside their list storage (`PackedArgs` of a whole protobuf
read, `_NoCats`, `SparseArgs`): list operations, pickling (merge's worker processes send parts
back pickled) and copies answer as the rows they stand for."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest

from gputrace import merge
from gputrace.trace import perfetto
from gputrace.trace.model import PackedArgs, SparseArgs, _NoCats

from .test_packed_args import random_trace

ROWS = [None, {"a": 1}, {"a": 1}, None, {"s": "x", "n": 2**70}, None]


@pytest.mark.parametrize(
    "make", [PackedArgs, SparseArgs, lambda rows: _NoCats(len(rows))], ids=["packed", "sparse", "nocats"]
)
def test_list_operations_answer_from_the_rows(make) -> None:  # type: ignore[no-untyped-def]
    col = make(ROWS)
    rows = list(col)
    assert len(rows) == len(ROWS) and (rows == ROWS or rows == [None] * len(ROWS))
    assert col == rows and rows == col and col != rows + [None] and col != []
    assert col.count(None) == rows.count(None) and (None in col) == (None in rows)
    assert col.index(None) == rows.index(None)
    assert col.copy() == rows and type(col.copy()) is list
    assert col + [7] == rows + [7] and [7] + col == [7] + rows
    assert list(reversed(col)) == rows[::-1]
    for part in (slice(1, 4), slice(None, None, -1), slice(2, None), slice(5, 1), slice(-2, None)):
        assert col[part] == rows[part] and type(col[part]) is list, part  # a slice is a list, as a list's
    assert col[-1] == rows[-1] and col[0] == rows[0]
    for past in (len(rows), -len(rows) - 1):
        with pytest.raises(IndexError):
            col[past]
    back = pickle.loads(pickle.dumps(col, pickle.HIGHEST_PROTOCOL))
    assert type(back) is type(col) and list(back) == rows
    assert list(copy.copy(col)) == rows and list(copy.deepcopy(col)) == rows
    for change in (
        lambda c: c.__setitem__(0, None),
        lambda c: c.sort(),
        lambda c: c.insert(0, None),
        lambda c: c.pop(),
    ):
        with pytest.raises(TypeError):
            change(col)


def test_packed_args_are_appended_to_with_plus_equals() -> None:
    col = PackedArgs(ROWS[:2])
    col += [{"b": 2}]
    assert type(col) is PackedArgs and list(col) == [None, {"a": 1}, {"b": 2}]


def test_a_whole_protobuf_reads_args_column_answers_as_its_rows(tmp_path: Path) -> None:
    trace = random_trace(2, cats=True, ranks=(0,))
    perfetto.write(trace, str(tmp_path / "t.pftrace"))
    a = perfetto.read(str(tmp_path / "t.pftrace")).spans.args
    rows = list(a)
    assert type(a) is PackedArgs and any(rows) and None in rows
    assert a == rows and a.count(None) == rows.count(None) and a.copy() == rows and (None in a)


def test_protobuf_ranks_without_categories_merge_the_same_by_worker_processes(tmp_path: Path) -> None:
    """gputrace's own .pftrace files have no categories; a big run merges them in workers."""
    for r in (0, 1):
        perfetto.write(random_trace(r, cats=False, ranks=(r,)), str(tmp_path / f"trace_rank{r}.pftrace"))
    files = [str(tmp_path / f"trace_rank{r}.pftrace") for r in (0, 1)]
    for out in ("w1", "w2"):
        merge.merge(files, str(tmp_path / f"{out}.pftrace"), workers=int(out[1]))
    assert (tmp_path / "w1.pftrace").read_bytes() == (tmp_path / "w2.pftrace").read_bytes()
    for out in ("j1", "j2"):
        merge.merge(files, str(tmp_path / f"{out}.json"), workers=int(out[1]))
    assert (tmp_path / "j1.json").read_bytes() == (tmp_path / "j2.json").read_bytes()
