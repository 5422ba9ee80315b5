"""The C heap's handling of large blocks, for the stages that read a large trace whole.

Takes: nothing. Gives: `map_large_blocks()`, which tells glibc's malloc to map every block of
LARGE_BLOCK bytes and more on its own (`mallopt(M_MMAP_THRESHOLD)`), so that each is given back
to the system as soon as it is freed; elsewhere than glibc it does nothing.

Why: glibc maps large blocks at first, but raises that threshold to the size of each mapped block
freed (up to 32 MiB), and from then on takes blocks below it from the heap, whose freed middle it
does not give back. A read and the statistics make and free many such blocks (each batch's
columns as they grow, index columns, sorted copies, a track's lists): with the moving threshold a
`summary` of 3M events peaked 70-90 MB (25-30 B an event) higher than with a fixed one, for the
same objects (`benchmarks/reader_memory.py`, BENCHMARKS.md "Readers' memory"). Fixing it is
process-wide and stays: blocks of 128 KiB and more cost a map and an unmap each, which is small
beside what is done with them.
"""

from __future__ import annotations

import ctypes
import sys

#: Blocks of this many bytes and more are mapped on their own (glibc's initial threshold).
LARGE_BLOCK = 128 << 10
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_done = False


def map_large_blocks() -> bool:
    """Fix glibc's threshold for mapped blocks at LARGE_BLOCK (once a process); True where it was."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt here (not glibc): its heap keeps its own ways
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    _done = bool(mallopt(_M_MMAP_THRESHOLD, LARGE_BLOCK))
    return _done
