"""What `import gputrace` does besides defining names, kept light: `gputrace --help` and
`import gputrace` must not import torch, nor the recorder.

- `GPUTRACE=1` / `ENABLE_TIMERS=1` turn recording on (the recorder is built by the first span).
- torch.compile support: once torch, and then torch._dynamo, are imported, the recorder tells
  Dynamo how to trace span() (see record.bind_compile_check). A meta-path finder catches those
  imports for programs that import gputrace first; nothing of gputrace's may run inside a
  Dynamo trace to do it later.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any


def _bind() -> None:
    from gputrace.record import bind_compile_check

    bind_compile_check()


class _AfterTorchImport:
    """Runs `_bind()` right after `import torch` and after `import torch._dynamo`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in ("torch", "torch._dynamo"):
            return None
        import importlib.machinery

        if fullname == "torch._dynamo":
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            try:
                _bind()
            except Exception as e:  # noqa: BLE001 - never break `import torch`
                from gputrace.errors import GputraceWarning

                warnings.warn(f"gputrace could not prepare torch.compile support: {e}", GputraceWarning, stacklevel=2)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def watch_for_torch() -> None:
    if "torch" in sys.modules:
        _bind()
    if "torch._dynamo" not in sys.modules and not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


def start() -> None:
    if os.environ.get("GPUTRACE") or os.environ.get("ENABLE_TIMERS"):
        from gputrace.config import enabled_from_env

        if enabled_from_env():
            from gputrace.session import enable_from_env

            enable_from_env()
    watch_for_torch()
