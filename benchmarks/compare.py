"""Before and after in one run: `benchmarks/run.py` of two source trees, taking turns.

    python benchmarks/compare.py --base OLD_TREE [--rounds 4] [--quick] [--section NAME ...] [--build]

OLD_TREE is another checkout of gputrace (e.g. `git worktree add /tmp/old <commit>`). Each round
runs each tree's own `benchmarks/run.py` in a fresh process, in alternating order, so both see
the same machine at the same minutes; the table gives, per measurement both runs report, the
median over rounds of each tree's median and the ratio this/base, with the least and largest
per-round ratio (the noise the machine adds). `--build` builds each tree's C extension in place
first (the base tree needs its own).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROW = re.compile(r"^\| ([^|]+) \| ([^|]+) \| ([^|]+) \| [^|]* \| ([^|]*) \|")
_RATIO = re.compile(r"^([\d.]+)x of ")
_VALUE = re.compile(r"^(-?[\d,]*\.?\d+) (.+)$")
_SCALE = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}


def parse(stdout: str) -> dict[tuple[str, str], tuple[float, str]]:
    """The rows of run.py's final table: (group, measurement) -> (median, unit); a row compared
    with a floor measured in the same process also gives (group, "measurement / its floor") ->
    (ratio, "x"), which the machine's drift between processes does not move."""
    rows: dict[tuple[str, str], tuple[float, str]] = {}
    for line in stdout.splitlines():
        m = _ROW.match(line)
        if not m or m.group(1).strip() in ("group", "---"):
            continue
        v = _VALUE.match(m.group(3).strip())
        if v is None:
            continue
        value, unit = float(v.group(1).replace(",", "")), v.group(2)
        if unit in _SCALE:  # one unit per row whatever run.py chose to show
            value, unit = value * _SCALE[unit], "ns"
        rows[(m.group(1).strip(), m.group(2).strip())] = (value, unit)
        r = _RATIO.match(m.group(4).strip())
        if r is not None:
            rows[(m.group(1).strip(), m.group(2).strip() + " / its floor, same process")] = (float(r.group(1)), "x")
    return rows


def run(tree: str, args: list[str]) -> dict[tuple[str, str], tuple[float, str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "run.py"), *args]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{tree}: run.py failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return parse(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other source tree (the 'before')")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each tree, taking turns")
    ap.add_argument("--quick", action="store_true", help="run.py --quick")
    ap.add_argument("--section", action="append", default=[], help="run.py sections (default: all)")
    ap.add_argument("--build", action="store_true", help="build each tree's C extension in place first")
    ns = ap.parse_args()
    trees = {"base": os.path.abspath(ns.base), "this": HERE}
    if ns.build:
        for tree in trees.values():
            subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True)
    args = (["--quick"] if ns.quick else []) + [a for s in ns.section for a in ("--section", s)]
    got: dict[str, list[dict[tuple[str, str], tuple[float, str]]]] = {"base": [], "this": []}
    for r in range(ns.rounds):
        for name in ("base", "this") if r % 2 == 0 else ("this", "base"):
            got[name].append(run(trees[name], args))
            print(f"round {r + 1}/{ns.rounds}: {name} done", file=sys.stderr, flush=True)
    keys = [k for k in got["this"][0] if all(k in g for g in got["base"] + got["this"])]
    lines = [
        f"base: {trees['base']}; this: {trees['this']}; {ns.rounds} rounds, alternating",
        "",
        "| group | measurement | base | this | this/base | per-round range |",
        "|---|---|---|---|---|---|",
    ]
    for k in keys:
        unit = got["this"][0][k][1]
        b = [g[k][0] for g in got["base"]]
        t = [g[k][0] for g in got["this"]]
        per_round = [x / y for x, y in zip(t, b) if y]
        ratio = statistics.median(t) / statistics.median(b) if statistics.median(b) else float("nan")
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else ""
        d = 2 if unit == "x" else 1
        mb, mt = statistics.median(b), statistics.median(t)
        lines.append(f"| {k[0]} | {k[1]} | {mb:,.{d}f} {unit} | {mt:,.{d}f} {unit} | {ratio:.2f}x | {spread} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
