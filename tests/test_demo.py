"""The demo's progress reports and thread sizing (the CLI shows the reports; the library prints
nothing). The whole demo, ranks and all, runs in tests/test_cli.py."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from gputrace import demo


def test_train_reports_each_step_sizes_its_threads_and_prints_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    before = torch.get_num_threads()
    reports: list[tuple[int, int]] = []
    try:
        path = demo.train(str(tmp_path), 2, progress=lambda done, total: reports.append((done, total)))
        threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert reports == [(0, 2), (1, 2), (2, 2)]
    assert threads == demo.threads_per_rank(1, torch.cuda.is_available())
    assert Path(path).exists()
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_ranks_never_ask_for_more_threads_than_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "cores", lambda: 8)
    assert [demo.threads_per_rank(r, cuda=True) for r in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert [demo.threads_per_rank(r, cuda=False) for r in (1, 2, 16)] == [1, 1, 1]


def test_rank_progress_lines_are_read_apart_from_other_output() -> None:
    seen: list[tuple[int, int, int]] = []
    last: list[str] = []
    stderr = io.StringIO(
        "some warning from torch\n"
        f"{demo._PROGRESS} 0 3\n"
        f"{demo._PROGRESS} 1 3\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: boom\n"
    )
    demo._read_rank(1, stderr, last, lambda r, d, t: seen.append((r, d, t)))
    assert seen == [(1, 0, 3), (1, 1, 3)]
    assert last[-1] == "RuntimeError: boom"


def test_a_new_demo_removes_the_files_of_an_earlier_one(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from gputrace.cli import main

    stale = [tmp_path / "trace_rank1.json", tmp_path / "digest_rank1.digest", tmp_path / "merged.json"]
    for p in stale:
        p.write_text("{}")
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    r = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert not any(p.exists() for p in stale)
    assert keep.read_text() == "mine" and (tmp_path / "trace_rank0.json").exists()
    assert "removed 3 file(s)" in r.output


def test_two_ranks_without_numpy_share_one_run_id(tmp_path: Path) -> None:
    """torch does not require numpy; gputrace's collectives must not need it either (object
    collectives do, through tensor.numpy())."""
    import json
    import os
    import subprocess
    import sys

    fake = tmp_path / "no_numpy" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError('numpy is not installed here', name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "gputrace", "demo", "--ranks", "2", "--steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ids = {json.loads((out / f"trace_rank{k}.json").read_text())["metadata"]["run_id"] for k in range(2)}
    assert len(ids) == 1 and None not in ids
