"""The C resolve loop against its Python reference, on the same recorded spans: rows, ids, args,
the children's extents, dropped counts and the events handed back must all be equal."""

from __future__ import annotations

import random
from typing import Any

import pytest

import gputrace
from gputrace import record, resolve

from .conftest import install
from .fakes import FakeDevice

pytestmark = pytest.mark.skipif(resolve._resolve_c is None, reason="the C resolve loop is not built or not in use")


class Owner:
    def __init__(self) -> None:
        self.ns: list[int] = []

    def add_ns(self, ns: int) -> None:
        self.ns.append(ns)


def workload(seed: int, max_spans: int) -> dict[str, Any]:
    """A seeded mix of device and host spans: nested, misnested, with args, errors and an owner,
    flushed now and then with and without a limit; returns everything resolve produced."""
    rng = random.Random(seed)
    fake = FakeDevice(rate=1.000002, read_ns=7)
    rec = install(fake, max_spans=max_spans)
    owner = Owner()
    side = fake.new_stream()
    for step in range(40):
        open_: list[Any] = []
        for _ in range(rng.randrange(1, 12)):
            if open_ and rng.random() < 0.45:
                s = open_.pop(rng.randrange(len(open_))) if rng.random() < 0.1 else open_.pop()
                fake.work(rng.randrange(0, 50_000))
                s.__exit__(ValueError if rng.random() < 0.1 else None, None, None)
            else:
                kind = rng.random()
                args = {"i": step} if rng.random() < 0.3 else None
                if kind < 0.2:
                    s = record.OptSpan(f"h{rng.randrange(3)}", args, False, False, owner)
                elif kind < 0.3:
                    with fake.stream(side):
                        s = record.Span(f"side{rng.randrange(2)}", args)
                        s.__enter__()
                        fake.work(rng.randrange(0, 30_000))
                        s.__exit__(None, None, None)
                    continue
                else:
                    s = record.Span(f"d{rng.randrange(4)}", args)
                s.__enter__()
                open_.append(s)
            fake.advance(rng.randrange(0, 20_000))
        while open_:
            fake.work(rng.randrange(0, 10_000))
            open_.pop().__exit__(None, None, None)
        fake.advance(rng.randrange(0, 200_000))
        if rng.random() < 0.6:
            rec.flush(wait=rng.random() < 0.3, limit=rng.choice([None, 3, 17]))
    rec.flush(wait=True)
    st = rec.store
    return {
        "names": list(st.names),
        "columns": [list(c) for c in (st.name, st.track, st.start, st.end, st.id, st.parent)],
        "args": list(st.args),
        "dropped": st.dropped,
        "last_id": st._last_id,
        "extent": dict(st.child_extent),
        "pools": [len(p) for p in rec.pools],
        "owner": owner.ns,
    }


@pytest.mark.filterwarnings("ignore::gputrace.errors.GputraceWarning")  # the misnests are on purpose
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_spans", [1_000_000, 150])
def test_the_c_loop_resolves_as_the_python_one(seed: int, max_spans: int, monkeypatch: pytest.MonkeyPatch) -> None:
    c = workload(seed, max_spans)
    gputrace.reset()
    monkeypatch.setattr(resolve, "_resolve_c", None)
    py = workload(seed, max_spans)
    assert len(c["columns"][0]) > 50
    assert c == py


def test_spans_of_another_type_go_to_the_python_loop() -> None:
    fake = FakeDevice()
    rec = install(fake)
    s = record.PySpan("py")
    c = record.Span("c")
    with c:
        s.stack, s.parent, s.t0, s.t1 = c.stack, None, c.t0, c.t0
    assert resolve._resolve_c([s], 0, rec.store, rec.timelines, rec.pools, 0) is NotImplemented
    assert len(rec.store) == 0
