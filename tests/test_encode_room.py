"""The JSON encoder's room per event: an event with a launch arrow whose host entry lies at or
after the span's device start also writes its 19-digit `entry_ns`; every byte of it must be
reserved before the in-place writers run (written past its buffer, glibc aborts the process:
"realloc(): invalid next size")."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gputrace import native

CODE = r"""
from array import array
from gputrace import _hot
from gputrace.trace.layout import dumps
EPOCH = 1_700_000_000_000_000_000
n, nn = 600, 185  # 600 events: the first buffer is 64 KiB of heap; the name puts an event on its end
starts = array("q", [EPOCH + 3_600_000_000_000 + 1_000_000 * i for i in range(n)])
ends = array("q", [s + 12_345_678 for s in starts])
entry = array("q", [s + 5 for s in starts])  # measured entry after the GPU start (cuda_rank has these)
z = array("l", [0] * n)
track = lambda t: (3, b'"cuda"')
enc = ([dumps("k" * nn)], z, z, starts, ends, [None] * n, dumps, track, 1, EPOCH, entry, 2, 1_000_000)
whole = _hot.encode_rows(*enc)  # no `write`: StreamWriter.append, chrome.encode, trace_bytes()
chunks = []
_hot.encode_rows(*enc, chunks.append)
assert whole == b"".join(chunks)
print("ok")
"""


@pytest.mark.skipif(native.hot is None, reason="the C build is not in use")
def test_events_with_arrows_and_long_names_are_encoded_whole_and_in_chunks() -> None:
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-500:])
