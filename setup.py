"""Builds the optional C hot path (gputrace._hot, limited API: one binary for Python >= 3.10).
Without a compiler gputrace installs and runs on its pure-Python path."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "gputrace._hot",
            ["gputrace/_hot.c"],
            define_macros=[("Py_LIMITED_API", "0x030A0000")],
            py_limited_api=True,
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
