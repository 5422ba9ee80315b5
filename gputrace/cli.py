"""The command line: parses arguments and calls the stages; nothing else.

A `GputraceError` (bad input, a wrong path, a corrupt trace) becomes one line on stderr and
exit status 2, never a traceback. Importing this module does not import torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from gputrace.errors import GputraceError
from gputrace.version import __version__


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    import functools

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except GputraceError as e:
            click.echo(f"gputrace: error: {e}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gputrace")
def main() -> None:
    """Where the time goes in GPU training, rank by rank, on one timeline."""


@main.command()
@click.option("--out", "out_dir", default="gputrace-demo", show_default=True, help="directory for the traces")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1, 100000), help="training steps to record")
@_guard
def demo(out_dir: str, steps: int) -> None:
    """Train a small model with spans (GPU if present, else CPU) and write its trace."""
    from gputrace import demo as demo_mod
    from gputrace.stats import durations_by_name, name_stats, table
    from gputrace.traceio import read_trace

    path = demo_mod.run(out_dir, steps)
    click.echo(table(name_stats(durations_by_name(read_trace(path)))))
    click.echo(f"\nwrote {path}")
    click.echo("open it: drag the file onto https://ui.perfetto.dev (or `gputrace merge` several ranks first)")


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@_guard
def summary(paths: tuple[str, ...], as_json: bool) -> None:
    """Per-span-name statistics of one or more traces."""
    import orjson

    from gputrace.stats import durations_by_name, name_stats, table
    from gputrace.traceio import read_trace

    durations: dict[str, list[int]] = {}
    for p in paths:
        for name, ds in durations_by_name(read_trace(p)).items():
            durations.setdefault(name, []).extend(ds)
    rows = name_stats(durations)
    if as_json:
        click.echo(orjson.dumps([r.__dict__ for r in rows]).decode())
    else:
        click.echo(table(rows))


if __name__ == "__main__":  # pragma: no cover
    main()
