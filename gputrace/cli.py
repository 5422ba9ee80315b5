"""The command line: parses arguments and calls the stages; nothing else.

A `GputraceError` (bad input, a wrong path, a corrupt trace) becomes one line on stderr and
exit status 2, never a traceback. Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from gputrace.errors import GputraceError
from gputrace.trace import registry
from gputrace.version import __version__

F = TypeVar("F", bound=Callable[..., Any])


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except GputraceError as e:
            click.echo(f"gputrace: error: {e}", err=True)
            sys.exit(2)

    return wrapper


@dataclasses.dataclass(frozen=True)
class Selection:
    """The selection options of `merge`, `summary` and `view`, parsed: `ranks`, `steps` and
    `window` as `gputrace.merge.Selection` takes them (None: all), `step` the step span's name as
    given (None: "step", if present), `skip_steps`, `allow_mixed`; `given`: any of ranks, steps
    or window was given."""

    ranks: frozenset[int] | None = None
    steps: tuple[int | None, int | None] | None = None
    window: tuple[int | None, int | None] | None = None
    step: str | None = None
    skip_steps: int = 0
    allow_mixed: bool = False
    given: bool = False

    @property
    def step_name(self) -> str:
        return self.step if self.step is not None else "step"


def selection_options(*, window: bool = True, skip_steps: bool = True, allow_mixed: bool = True) -> Callable[[F], F]:
    """The selection options, declared once for every command that selects (`window`,
    `skip_steps`, `allow_mixed`: False leaves that option off a command where it means nothing).
    The command gets them parsed, as one `selection` argument; a bad one is the usual one-line
    error."""
    options = [
        click.option("--ranks", default=None, metavar="LIST", help="only these ranks, e.g. 0-3,7"),
        click.option("--steps", default=None, metavar="A:B", help="only steps A to B (B exclusive), e.g. 100:200"),
        click.option(
            "--window", default=None, metavar="T0:T1", help="only this time window, e.g. 2s:3.5s from the start"
        )
        if window
        else None,
        click.option("--step", default=None, help="the span that marks one training step  [default: step, if present]"),
        click.option(
            "--skip-steps", default=0, type=click.IntRange(0), help="leave out each rank's first N steps (warm-up)"
        )
        if skip_steps
        else None,
        click.option("--allow-mixed", is_flag=True, help="take files of different runs or world sizes together anyway")
        if allow_mixed
        else None,
    ]

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        @_guard  # a bad selection is one line and exit status 2, like every other bad input
        def command(
            *args: Any,
            ranks: str | None = None,
            steps: str | None = None,
            window: str | None = None,
            step: str | None = None,
            skip_steps: int = 0,
            allow_mixed: bool = False,
            **kwargs: Any,
        ) -> Any:
            from gputrace.merge import parse_ranks, parse_steps, parse_window

            chosen = Selection(
                parse_ranks(ranks) if ranks else None,
                parse_steps(steps) if steps else None,
                parse_window(window) if window else None,
                step,
                skip_steps,
                allow_mixed,
                ranks is not None or steps is not None or window is not None,
            )
            return fn(*args, selection=chosen, **kwargs)

        wrapped: Any = command
        for option in reversed(options):
            if option is not None:
                wrapped = option(wrapped)
        return wrapped  # type: ignore[no-any-return]

    return decorate


def _mixed_runs_fix(fix: str) -> Callable[[F], F]:
    """For a command without --allow-mixed: files of different runs are refused with `fix` as
    the way out, not the --allow-mixed it does not have."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def command(*a: Any, **k: Any) -> Any:
            from gputrace.merge.sources import MixedRunsError

            try:
                return fn(*a, **k)
            except MixedRunsError as e:
                raise e.with_fix(fix) from None

        return command  # type: ignore[return-value]

    return decorate


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gputrace")
def main() -> None:
    """Where the time goes in GPU training, rank by rank, on one timeline."""


def _progress(quiet: bool) -> Any:
    """A progress line on stderr (merge reads ranks one at a time)."""
    if quiet:
        return None

    def show(what: str, done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done >= total else ""
        click.echo(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what:<12}", err=True, nl=False)
        if end:
            click.echo("", err=True)

    return show


@main.command()
@click.option("--out", "out_dir", default="gputrace-demo", show_default=True, help="directory for the traces")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1, 100000), help="training steps to record")
@click.option(
    "--ranks", default=1, show_default=True, type=click.IntRange(1, 64), help="processes (gloo on CPU, NCCL on GPUs)"
)
@_guard
def demo(out_dir: str, steps: int, ranks: int) -> None:
    """Train a small model with spans (GPU if present, else CPU), write and merge its traces."""
    import threading

    from gputrace import demo as demo_mod
    from gputrace import merge as merge_mod
    from gputrace.config import Config

    Config.from_env()  # a bad GPUTRACE_* setting fails here, before anything is removed
    try:  # before minutes of training, not after; a fresh run, never mixed with an earlier one
        os.makedirs(out_dir, exist_ok=True)
        removed = demo_mod.clear_previous(out_dir)
    except OSError as e:
        raise GputraceError(f"cannot write to {out_dir}: {e.strerror or e}") from None
    if removed:
        click.echo(f"gputrace demo: removed {len(removed)} file(s) of an earlier demo from {out_dir}", err=True)
    show = _progress(False)
    click.echo(f"gputrace demo: {steps} steps on {ranks} rank(s), starting (torch loads in a few seconds)", err=True)
    if ranks == 1:
        paths = [demo_mod.train(out_dir, steps, progress=lambda done, total: show("steps", done, total))]
        shown = paths[0]
    else:
        done_by_rank = [0] * ranks
        shown_done = [-1]
        lock = threading.Lock()

        def rank_progress(rank: int, done: int, total: int) -> None:
            with lock:  # called from one reader thread per rank
                done_by_rank[rank] = done
                if min(done_by_rank) != shown_done[0]:
                    shown_done[0] = min(done_by_rank)
                    show("steps, every rank", shown_done[0], total)

        paths = demo_mod.run_ranks(out_dir, steps, ranks, progress=rank_progress)
        shown = os.path.join(out_dir, "merged" + registry.get(registry.DEFAULT).extension)
        merge_mod.merge(paths, shown)
    click.echo(_summary_text(paths))
    for p in paths:
        click.echo(f"wrote {p}")
    if ranks > 1:
        click.echo(f"merged into {shown}")
    click.echo(f"look at it: gputrace view {out_dir}   (or drag {shown} onto https://ui.perfetto.dev)")


def _summary_text(
    paths: list[str],
    as_json: bool = False,
    selection: Selection | None = None,
    by_rank: bool = False,
    full: bool = False,
) -> str:
    import orjson

    from gputrace import heap, live, stats
    from gputrace.summary import summary_of_files

    heap.map_large_blocks()  # the command reads traces whole: freed large blocks go back at once
    sel = selection or Selection()
    opened = live.read_all(paths)  # a live or killed run: where each rank is, on top
    try:
        result = summary_of_files(
            paths,
            sel.step,
            sel.skip_steps,
            allow_mixed=sel.allow_mixed,
            full=full,
            ranks=sel.ranks,
            steps=sel.steps,
        )
    except GputraceError as e:
        if not opened:
            raise
        # Hung before its first flush: the open files are all there is.
        if as_json:
            return orjson.dumps(live.add_to_json({"notes": [str(e)]}, opened)).decode()
        return "\n".join(x for x in (live.text(opened), f"no summary: {e}") if x)
    if as_json:
        return orjson.dumps(live.add_to_json(stats.to_json(result), opened)).decode()
    return "\n\n".join(x for x in (live.text(opened), stats.table(result, by_rank=by_rank)) if x)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@selection_options(window=False)
@click.option("--by-rank", is_flag=True, help="a table per rank too, and every rank in the per-rank table")
@click.option("--full", is_flag=True, help="read the whole traces even where the ranks wrote step digests")
@_guard
def summary(paths: tuple[str, ...], as_json: bool, by_rank: bool, full: bool, selection: Selection) -> None:
    """Per-span statistics of per-rank traces or a merged one: totals, percentiles, the
    imbalance between ranks, the slowest rank of each step (when beyond the noise) and who
    waited for whom in each collective. Where every rank wrote a step digest beside its trace
    (or the ranks are many) the digests are read instead of the traces; the first note says
    which were read. --ranks and --steps read the full traces of the selection."""
    click.echo(_summary_text(list(paths), as_json, selection, by_rank, full))


@main.command()
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option(
    "--fail-above",
    "fail_above",
    default=None,
    type=click.FloatRange(0),
    metavar="PCT",
    help="exit 1 when a span name (or the step) is slower in B by more than PCT percent, beyond the noise",
)
@selection_options(window=False)
@click.option("--full", is_flag=True, help="read the whole traces even where the ranks wrote step digests")
@_guard
def diff(a: str, b: str, as_json: bool, fail_above: float | None, full: bool, selection: Selection) -> None:
    """Compare run B with run A (each a directory, a trace file, a digest or a glob): per span
    name the median per occurrence in each, the change, and whether it lies within the runs' own
    spread (noise); the step time too; the largest regression first. Each run is read as
    `gputrace summary` reads it."""
    import orjson

    from gputrace import diff as diff_mod

    d = diff_mod.read(
        [a],
        [b],
        selection.step,
        selection.skip_steps,
        allow_mixed=selection.allow_mixed,
        full=full,
        ranks=sorted(selection.ranks) if selection.ranks is not None else None,
        steps=selection.steps,
    )
    if as_json:
        click.echo(orjson.dumps(diff_mod.to_json(d, fail_above)).decode())
    else:
        click.echo(diff_mod.table(d))
    if fail_above is not None:
        worse = diff_mod.regressed(d, fail_above)
        if worse:
            if not as_json:
                names = ", ".join(f"{c.name} {c.delta_pct:+.1f}%" for c in worse)
                click.echo(f"gputrace diff: slower by more than {fail_above:g}% beyond the noise: {names}", err=True)
            sys.exit(1)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--out", required=True, help="the merged trace to write (.json, or .pftrace for protobuf)")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(registry.names()),
    default=None,
    help="the output's format  [default: by the extension of --out]",
)
@click.option(
    "--align",
    type=click.Choice(["clock", "none"]),
    default="clock",
    show_default=True,
    help="clock: apply the offsets sync_clocks() measured; none: trust the host clocks",
)
@click.option(
    "--align-on",
    "align_on",
    default=None,
    metavar="NAME",
    help="align the ends of the n-th span NAME (a collective) across ranks instead",
)
@click.option(
    "--occurrence", default=1, show_default=True, type=click.IntRange(1), help="which NAME span, with --align-on"
)
@click.option("--rank-from-filename", is_flag=True, help="take each rank from 'rank<N>' in its file name")
@selection_options(skip_steps=False)
@click.option("--workers", default=None, type=click.IntRange(1), help="processes reading ranks  [default: by size]")
@click.option("-q", "--quiet", is_flag=True, help="no progress bar")
@_guard
def merge(
    paths: tuple[str, ...],
    out: str,
    fmt: str | None,
    align: str,
    align_on: str | None,
    occurrence: int,
    rank_from_filename: bool,
    selection: Selection,
    workers: int | None,
    quiet: bool,
) -> None:
    """Merge per-rank traces (files, directories or globs) into one aligned timeline; a
    torch.profiler trace of a rank joins that rank."""
    from gputrace import heap
    from gputrace import merge as merge_mod
    from gputrace.trace.files import check_target

    check_target(out)  # before minutes of reading ranks, not after
    heap.map_large_blocks()  # ranks read whole one after another: freed large blocks go back at once
    meta = merge_mod.merge(
        paths,
        out,
        align,
        align_on,
        occurrence,
        rank_from_filename,
        _progress(quiet),
        fmt=fmt,
        allow_mixed=selection.allow_mixed,
        ranks=selection.ranks,
        steps=selection.steps,
        window=selection.window,
        step_name=selection.step_name,
        workers=workers,
    )
    per_rank = list(meta["alignment"].get("per_rank", {}).items())
    shown = per_rank if len(per_rank) <= 16 else per_rank[:8]
    for rank, a in shown:
        note = "; ".join(a.get("notes", []))
        dev = a.get("device")
        # No offset measured: an error of 0 would read as exact, so none is shown.
        offset = (
            "offset not measured, error unknown"
            if a.get("measured") is False
            else f"offset {a['offset_ns'] / 1e3:+.1f} us +- {a['error_ns'] / 1e3:.1f} us"
        )
        click.echo(
            f"rank {rank}: {offset}"
            + (f", device {dev['offset_ns'] / 1e3:+.1f} us +- {dev['error_ns'] / 1e3:.1f} us" if dev else "")
            + (f" ({note})" if note else "")
        )
    if len(shown) < len(per_rank):
        rest = [a for _, a in per_rank[len(shown) :]]
        measured = [a for a in rest if a.get("measured") is not False]
        parts = []
        if measured:
            lo, hi = min(a["offset_ns"] for a in measured), max(a["offset_ns"] for a in measured)
            worst = max(a["error_ns"] for a in measured)
            parts.append(f"offsets {lo / 1e3:+.1f} to {hi / 1e3:+.1f} us, errors up to {worst / 1e3:.1f} us")
        if len(measured) < len(rest):
            parts.append(f"{len(rest) - len(measured)} with no offset measured (error unknown)")
        click.echo(f"... {len(rest)} more ranks: {'; '.join(parts)}")
    for note in meta.get("notes", []):
        click.echo(f"note: {note}")
    click.echo(f"wrote {out}")


@main.command()
@click.argument("paths", nargs=-1, required=True)
@_guard
def validate(paths: tuple[str, ...]) -> None:
    """Check traces (gputrace's or another tool's, JSON or protobuf) against the rules Perfetto's
    importer applies. Every file is reported; the exit status is 1 if any has errors (a file that
    cannot be read has, with the reason), 2 if a path names no file."""
    from gputrace.errors import NotAFile, TraceFormatError
    from gputrace.trace.registry import expand
    from gputrace.validate import format_report, validate_file

    def unreadable(path: str, e: GputraceError) -> str:
        reason = e.reason if isinstance(e, TraceFormatError) else str(e).removeprefix(f"{path}: ")
        return f"{getattr(e, 'path', path)}: INVALID: {reason}"

    bad = 0
    missing = False
    seen: set[str] = set()
    for arg in paths:
        try:
            found = expand([arg])
        except GputraceError as e:  # a wrong path: exit 2 (as in every command) once all are reported
            click.echo(unreadable(arg, e), err=True)
            missing = True
            continue
        for path in found:
            if path in seen:
                continue
            seen.add(path)
            try:
                report = validate_file(path)
            except NotAFile as e:  # a FIFO or a device named as a trace: a wrong path too
                click.echo(unreadable(path, e), err=True)
                missing = True
                continue
            except GputraceError as e:
                click.echo(unreadable(path, e))
                bad += 1
                continue
            click.echo(format_report(report))
            bad += not report.ok
    if missing:
        sys.exit(2)
    if bad:
        sys.exit(1)


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--port", default=0, type=click.IntRange(0, 65535), help="port on 127.0.0.1  [default: a free one]")
@click.option("--no-browser", is_flag=True, help="print the URL instead of opening a browser")
@click.option(
    "--perfetto-ui",
    "perfetto_ui",
    metavar="DIR|URL",
    help="the Perfetto UI for the timeline  [default: a local build if installed, else ui.perfetto.dev]",
)
@click.option("--export", "export", metavar="FILE.html", help="write one self-contained HTML report and exit")
@click.option(
    "--compare",
    "compare",
    metavar="B",
    default=None,
    help="another run (directory, trace file or digest): a tab shows what `gputrace diff` says of it",
)
@click.option("--follow", is_flag=True, help="watch a run as it is written: DIR is the folder its ranks stream into")
@selection_options(allow_mixed=False)
@_guard
@_mixed_runs_fix(
    "view one run at a time: move the earlier run's files away or name one run's files (or merge them "
    "anyway with gputrace merge --allow-mixed, and view the merged file)"
)
def view(
    paths: tuple[str, ...],
    port: int,
    no_browser: bool,
    perfetto_ui: str | None,
    export: str | None,
    follow: bool,
    selection: Selection,
    compare: str | None = None,
) -> None:
    """Look at traces in the browser: which rank was slow in which step, who waited in which
    collective, span statistics, each linked to the Perfetto timeline; with --compare, the
    change from this run to another, name by name."""
    if follow:
        return _follow(paths, port, no_browser, export, selection)
    from click.core import ParameterSource

    from gputrace.trace.files import check_target, write_atomic
    from gputrace.trace.registry import expand
    from gputrace.viewer import background, data, report, server

    if export:
        check_target(export)  # before the traces are read, not after
    if compare is not None:
        from gputrace.diff import check

        check([compare], "B")  # before the traces are read, not after
    ui = None if export else server.resolve_ui(perfetto_ui)
    files = expand(paths)
    sel = selection
    require_step = sel.step is not None
    # --skip-steps not given: the viewer leaves out warm-up steps that are outliers, and says so.
    given = click.get_current_context().get_parameter_source("skip_steps") is not ParameterSource.DEFAULT
    skip_steps = sel.skip_steps if given else None
    # Many ranks: the page from their step digests, the timeline from the files a window at a time;
    # served, its first document while the full one is computed behind it.
    opts = {"step": sel.step_name, "skip_steps": skip_steps, "require_step": require_step, "inputs": paths}
    got = None if sel.given or not export else data.digest_view(paths, **opts)
    served = None if sel.given or export else background.from_digests(paths, **opts)
    # Served, the document stays encoded as the digests' view gave it (its small keys aside).
    doc, body = (data.join(*got), None) if got is not None else (served.doc, served.body) if served else (None, None)
    trace = None
    if doc is not None:
        click.echo(f"gputrace view: read the step digests of {len(doc['ranks'])} ranks", err=True)
    else:
        from gputrace import heap
        from gputrace.summary import load_for_statistics

        heap.map_large_blocks()  # freed large blocks go back at once (the page's read, then the timeline's)
        click.echo(f"gputrace view: reading {len(files)} trace file{'s' if len(files) != 1 else ''}", err=True)
        # The page's numbers from the traces read for the statistics alone; the timeline's trace,
        # with every argument, read when the timeline first asks (the two never held at once).
        wanted = {"ranks": sel.ranks, "steps": sel.steps, "window": sel.window, "step_name": sel.step_name}
        doc = data.document(
            load_for_statistics(files, **wanted),
            step=sel.step_name,
            skip_steps=skip_steps,
            require_step=require_step,
            inputs=paths,
        )
        trace = functools.partial(data.load, files, **wanted)
    if compare is not None:
        doc["compare"] = data.compare(
            list(paths), [compare], step=sel.step, skip_steps=sel.skip_steps, ranks=sel.ranks, steps=sel.steps
        )
    doc["open"] = data.open_section(paths)  # a live or killed run: where each rank is
    if export:
        write_atomic(export, report.html(doc))
        click.echo(f"wrote {export}")
        return
    assert ui is not None
    viewer = (
        server.Viewer(trace, doc, ui, name=doc["title"])
        if trace is not None
        else server.WindowedViewer(files, doc, ui, name=doc["title"], body=body)
    )
    if served is not None and served.build is not None:
        viewer.follow(served.build, {k: doc[k] for k in ("compare", "open") if k in doc})
        served.build.on_done(_say_full)
    # The viewer holds the document encoded: the decoded one (the first document's columns, a
    # hundred MB at 64 ranks x 10k steps) goes now, not when the view ends.
    del doc, got, served, body
    _serve(viewer, port, ui, no_browser)


def _say_full(build: Any) -> None:
    if build.error is None:
        click.echo(f"gputrace view: the full document is ready ({build.seconds:.1f} s): the page shows it", err=True)
    else:
        click.echo(f"gputrace view: the full document could not be computed: {build.error}", err=True)


def _follow(paths: tuple[str, ...], port: int, no_browser: bool, export: str | None, sel: Selection) -> None:
    from gputrace.viewer.follow import Follower, FollowViewer

    if len(paths) != 1:
        raise GputraceError("--follow takes one folder: the out_dir the ranks stream into")
    if export or sel.given or sel.skip_steps:
        raise GputraceError("--follow shows the latest steps of every rank: leave out --export and the selections")
    viewer = FollowViewer(Follower(paths[0], step_name=sel.step_name))
    _serve(viewer, port, None, no_browser)


def _serve(viewer: Any, port: int, ui: Any, no_browser: bool) -> None:
    httpd = viewer.serve(port)
    url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    shown = f"timeline from {ui.label}" if ui is not None else "following the run"
    click.echo(f"gputrace view: {url} ({shown}; Ctrl-C stops)")
    if not no_browser:
        import webbrowser

        webbrowser.open(url)  # the socket already listens: the browser's request waits for serve_forever
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        click.echo("gputrace view: stopped")
    finally:
        httpd.server_close()


if __name__ == "__main__":  # pragma: no cover
    main()
