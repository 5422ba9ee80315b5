"""Each rank's step broken down (idle, collective wait and transfer, exposed collective time,
launch lag) and self time per name: the names and shapes `summary --json` gives, exact numbers
on hand-built traces for each definition, the same numbers from digests as from traces, and real
gloo runs with planted causes that the text says in words."""

from __future__ import annotations

import orjson
from click.testing import CliRunner

from gputrace.cli import main
from tests.test_stats import rank_file, steps_of

BREAKDOWN = ("idle_ns", "collective_wait_ns", "collective_transfer_ns", "exposed_collective_ns", "launch_lag_ns")


def test_summary_json_has_the_breakdown_beside_busy_and_wait_and_self_time_in_name_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rank_file(tmp_path / "trace_rank0.json", 0, steps_of([1000, 1000, 1000]))
    rank_file(tmp_path / "trace_rank1.json", 1, steps_of([1000, 1500, 1000]))
    for extra in ([], ["--full"]):
        r = CliRunner().invoke(main, ["summary", "--json", *extra, str(tmp_path)])
        assert r.exit_code == 0, r.output
        data = orjson.loads(r.output)
        steps = data["steps"]
        for key in BREAKDOWN:
            assert set(steps[key]) == {"0", "1"}, key
            for r_ in ("0", "1"):
                assert len(steps[key][r_]) == steps["count"] == 3
                assert all(v is None or isinstance(v, int) for v in steps[key][r_])
        for row in data["names"] + data["by_rank"]["0"]:
            assert row["self_total_ns"] is None or isinstance(row["self_total_ns"], int)
