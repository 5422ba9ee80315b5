"""NVTX ranges from the same spans (the `nvtx` option), so Nsight Systems shows gputrace's ranges.

Takes: the option, and the process's loaded CUDA libraries. Gives: `Ranges`, the push and pop
the hot path calls at every span's enter and exit (`HotState.nvtx`), or None where no NVTX is
found (with one warning). The C hot path calls the functions at `push_addr`/`pop_addr` directly
where a loaded library exports `nvtxRangePushA`/`nvtxRangePop`; otherwise, and in the Python
twin, it calls `push`/`pop` (torch's bindings). Off, nothing is looked up and spans pay nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

# Where nvtxRangePushA is looked for as a C symbol, in order: the CUDA toolkit's NVTX v3 library of
# real symbols, then the NVTX v2 library. (torch compiles NVTX v3 in, header-only: its libraries
# export no NVTX symbol; the one found sends ranges to the same tool, loaded by NVTX itself.)
_LIBRARIES = ("libnvtx3interop.so.1", "libnvToolsExt.so.1")


class Ranges:
    """An NVTX push (of a span's name) and pop: Python callables, and where found the C
    functions' addresses (0: call the Python ones)."""

    __slots__ = ("push", "pop", "push_addr", "pop_addr", "source")

    def __init__(
        self,
        push: Callable[[str], Any],
        pop: Callable[[], Any],
        push_addr: int = 0,
        pop_addr: int = 0,
        source: str = "",
    ) -> None:
        self.push, self.pop = push, pop
        self.push_addr, self.pop_addr = push_addr, pop_addr
        self.source = source

    def __repr__(self) -> str:
        return f"<gputrace NVTX ranges through {self.source}>"


def _torch_bindings() -> tuple[Callable[[str], Any], Callable[[], Any]] | None:
    torch: Any = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return None
    nvtx = getattr(torch._C, "_nvtx", None)  # absent from a build without CUDA
    if nvtx is None or not hasattr(nvtx, "rangePushA") or not hasattr(nvtx, "rangePop"):
        return None
    return nvtx.rangePushA, nvtx.rangePop


def _c_functions() -> tuple[int, int, str] | None:
    """The addresses of nvtxRangePushA and nvtxRangePop, and the library, or None."""
    for name in _LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
            push, pop = lib.nvtxRangePushA, lib.nvtxRangePop
        except (OSError, AttributeError):
            continue
        addrs = ctypes.cast(push, ctypes.c_void_p).value or 0, ctypes.cast(pop, ctypes.c_void_p).value or 0
        if all(addrs):
            return addrs[0], addrs[1], name
    return None


def _c_caller(push_addr: int, pop_addr: int) -> tuple[Callable[[str], Any], Callable[[], Any]]:
    """The C functions as Python callables (for the Python twin)."""
    push_c = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)(push_addr)
    pop_c = ctypes.CFUNCTYPE(ctypes.c_int)(pop_addr)

    def push(name: str) -> Any:
        return push_c(name.encode())

    return push, pop_c


def find(source: str = "auto") -> Ranges | None:
    """NVTX push and pop: "runtime" (C functions of a loaded CUDA library), "torch" (torch's
    bindings), or "auto" (the C functions where found, else torch's). None where none is found."""
    if source in ("auto", "runtime"):
        found = _c_functions() if _torch_bindings() is not None or source == "runtime" else None
        if found is not None:
            push, pop = _c_caller(found[0], found[1])
            return Ranges(push, pop, found[0], found[1], f"the C functions of {found[2]}")
        if source == "runtime":
            return None
    bindings = _torch_bindings()
    if bindings is None:
        return None
    return Ranges(bindings[0], bindings[1], source="torch's bindings (torch._C._nvtx)")
