"""One configuration object. The API (`enable(**options)`), the environment and the CLI
are all built from the fields below, so each option is spelled once.

Environment: ``GPUTRACE=1`` or ``ENABLE_TIMERS=1`` turn recording on at import; every field
also reads ``GPUTRACE_<FIELD>`` (for example ``GPUTRACE_OUT_DIR=traces``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from gputrace.errors import ConfigError
from gputrace.trace import registry

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclasses.dataclass(frozen=True)
class Config:
    out_dir: str | None = dataclasses.field(
        default=None,
        metadata={"help": "directory where the trace is saved at interpreter exit (trace_rank{R}.json)"},
    )
    cuda: bool = dataclasses.field(
        default=True,
        metadata={"help": "time spans with CUDA events when a GPU is present; false puts every span on host tracks"},
    )
    max_pending: int = dataclasses.field(
        default=65536,
        metadata={"help": "spans held unresolved before gputrace resolves what the GPU has finished by itself"},
    )
    max_spans: int = dataclasses.field(
        default=20_000_000,
        metadata={"help": "resolved spans kept in memory; past it spans are counted as dropped in the trace"},
    )
    anchor_tries: int = dataclasses.field(
        default=5,
        metadata={"help": "reference-event round trips per clock anchor; the shortest is kept"},
    )
    anchor_every_ms: float = dataclasses.field(
        default=5.0,
        metadata={
            "help": "a flush takes a new clock anchor (a side-stream round trip, ~10 us) at most this often; a flush "
            "sooner leaves its spans for the next (save and a timer's read always resolve all); 0: every flush"
        },
    )
    format: str = dataclasses.field(
        default="json",
        metadata={"help": "format of the trace written to out_dir: json (Chrome trace) or perfetto (protobuf)"},
    )
    run_id: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "an id every rank of one job shares (default: the launcher's job id, else rank 0's at sync_clocks)"
        },
    )
    step_name: str = dataclasses.field(
        default="step",
        metadata={"help": "the span that marks one training step, for the step digest written beside the trace"},
    )
    launch_arrows: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "draw an arrow from the host moment each CUDA span was entered to the span (the launch "
            "queue); false leaves them out of the trace file (smaller), the step digest's launch lag stays"
        },
    )
    nvtx: bool = dataclasses.field(
        default=False,
        metadata={"help": "push and pop an NVTX range named like each span, so Nsight Systems shows the same ranges"},
    )
    open_every_s: float = dataclasses.field(
        default=1.0,
        metadata={
            "help": "while streaming, rewrite open_rank{R}.open (what each rank has open now) at most this often, "
            "in seconds; 0 turns it off"
        },
    )
    rank: int | None = dataclasses.field(
        default=None,
        metadata={"help": "rank of this process, when neither torch.distributed nor RANK gives it"},
    )
    report_every: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "every N steps the ranks' recent step times are gathered (one small collective, at the flush "
            "after the Nth step span ends) and rank 0 logs the slowest rank (logger gputrace.straggler); off by default"
        },
    )
    report_timeout: int = dataclasses.field(
        default=60,
        metadata={"help": "seconds a straggler report waits for the other ranks; past it reports stop"},
    )

    def replace(self, **options: Any) -> Config:
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return dataclasses.replace(self, **{k: _coerce(k, self._type(k), v) for k, v in options.items()})

    @classmethod
    def _type(cls, name: str) -> str:
        return next(str(f.type) for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        env = os.environ if environ is None else environ
        options: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = env.get(env_name(f.name))
            if value is not None:
                options[f.name] = value
        return cls().replace(**options)


def env_name(field: str) -> str:
    return "GPUTRACE_" + field.upper()


def enabled_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``GPUTRACE`` or the nanotron-compatible ``ENABLE_TIMERS`` turn recording on at import."""
    env = os.environ if environ is None else environ
    return any(_parse_bool(name, env.get(name, "")) for name in ("GPUTRACE", "ENABLE_TIMERS"))


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")


def _coerce(name: str, type_name: str, value: Any) -> Any:
    if value is None:
        if "None" in type_name:
            return None
        raise ConfigError(f"option {name} cannot be None")
    if type_name.startswith("bool"):
        return value if isinstance(value, bool) else _parse_bool(name, str(value))
    if type_name.startswith("int"):
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"option {name}={value!r}: expected an integer") from None
        if number < 0 or (name != "rank" and number == 0):
            raise ConfigError(f"option {name}={value!r}: expected a positive integer")
        return number
    if type_name.startswith("float"):
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"option {name}={value!r}: expected a number") from None
        if not seconds >= 0 or seconds == float("inf"):
            raise ConfigError(f"option {name}={value!r}: expected a number, 0 or more")
        return seconds
    if name == "format":
        fmt = str(value).strip().lower()
        if fmt not in registry.names():
            raise ConfigError(f"option format={value!r}: expected {' or '.join(registry.names())}")
        return fmt
    return str(value) if value is not None else None
