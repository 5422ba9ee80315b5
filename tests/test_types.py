"""The package is statically typed: `mypy --strict` (configured in pyproject.toml) finds nothing,
in the package and in the viewer, so type checkers see real signatures for users."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mypy")


@pytest.mark.parametrize("target", [[], ["viewer"]], ids=["gputrace", "viewer"])
def test_mypy_strict_finds_nothing(target: list[str], tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path), *target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
