"""Builds the optional C hot path (gputrace._hot, limited API: one binary for Python >= 3.10).
Without a C compiler, or with GPUTRACE_PURE_PYTHON=1 set at install, gputrace installs and runs
on its pure-Python path. `c_build_expected()` is the one place that decides whether installing
builds the extension here; the twin tests ask it whether a missing build is an error."""

from __future__ import annotations

import glob
import os
import shutil
import sysconfig

from setuptools import Extension, setup


def c_build_expected() -> tuple[bool, str]:
    """(whether installing here builds gputrace._hot, why)."""
    if os.environ.get("GPUTRACE_PURE_PYTHON", "") not in ("", "0"):
        return False, "GPUTRACE_PURE_PYTHON is set"
    cc = (sysconfig.get_config_var("CC") or "").split()
    if not cc:
        return False, "this Python's build configuration names no C compiler"
    if shutil.which(cc[0]) is None:
        return False, f"no C compiler: {cc[0]} is not on PATH"
    header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    if not os.path.exists(header):
        return False, f"no Python headers: {header} is missing"
    return True, f"{cc[0]} and {header} are present"


if __name__ == "__main__":
    setup(
        ext_modules=[
            Extension(
                "gputrace._hot",
                # One extension from the C files of gputrace/csrc/, one per stage (hot.h is shared).
                sorted(glob.glob("gputrace/csrc/*.c")),
                depends=glob.glob("gputrace/csrc/*.h"),
                define_macros=[("Py_LIMITED_API", "0x030A0000")],
                py_limited_api=True,
                # A failed build still installs (pure Python); the twin tests then fail here.
                optional=True,
            )
        ]
        if c_build_expected()[0]
        else [],
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
