"""The viewer's server under many connections on loopback: idle ones and busy ones.

    python benchmarks/viewer_clients.py [--idle 500] [--clients 50,500] [--requests 2]
                                        [--timeout S] [--settings old,new]

Starts the server of `gputrace view` (a small trace of 4 ranks) in a child process, once per
setting: `new`, the server as it ships (a per-connection timeout, a backlog of 1024, a cap on
threads), and `old`, the same server with the settings it had before (no timeout, a backlog of
5, no cap). `--timeout` shortens the new timeout so the run stays short. For each setting it
  - opens `--idle` connections that send nothing, and counts the server's threads a second later
    and again once the timeout has passed, and how many of those sockets the server still holds;
  - runs `--clients` concurrent clients, each making `--requests` real requests in turn (connect,
    GET /data.json, read the whole response), and gives the p50/p99/max latency of a request;
  - runs the busiest of those again while the idle connections are held (opened anew).
Prints one table. Bounded: every wait has a deadline, and the child is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import inspect, sys
sys.path.insert(0, {root!r})
from gputrace.trace.model import Process, Trace, Track
from gputrace.viewer import data, server

t = Trace({{"merged": True}})
for r in range(4):
    p = t.add_process(Process(r + 1, r, f"rank {{r}}", r, {{}}))
    tr = t.add_track(Track(p, 2, "cuda:0 default stream", "cuda", 0, 2))
    for k in range(200):
        s = 1_700_000_000_000_000_000 + k * 10_000_000
        t.add_span("step", tr, s, s + 9_000_000, {{"step": k}})
        t.add_span("compute", tr, s, s + 6_000_000 + 1000 * r)
viewer = server.Viewer(t, data.document(t), server.resolve_ui("https://ui.perfetto.dev"), name="bench")
settings = {settings!r}
accepted = inspect.signature(viewer.serve).parameters
httpd = viewer.serve(0, **{{k: v for k, v in settings.items() if k in accepted}})
print(httpd.server_address[1], sorted(k for k in settings if k in accepted), flush=True)
httpd.serve_forever()
"""


def threads_of(pid: int) -> str:
    """The process's threads and resident memory, as "N (M MB)"."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            found[key] = value.split()
    return f"{found['Threads'][0]} ({int(found['VmRSS'][0]) / 1024:.0f} MB)"


def open_idle(port: int, n: int, deadline: float = 40.0) -> tuple[list[socket.socket], float]:
    """`n` connections opened at once that send nothing (those not made within `deadline` s are
    dropped), and the seconds it took."""

    async def connect_all() -> list[socket.socket]:
        loop = asyncio.get_running_loop()

        async def one() -> socket.socket | None:
            s = socket.socket()
            s.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), deadline)
                return s
            except (OSError, asyncio.TimeoutError):
                s.close()
                return None

        return [s for s in await asyncio.gather(*(one() for _ in range(n))) if s is not None]

    t0 = time.perf_counter()
    socks = asyncio.run(connect_all())
    return socks, time.perf_counter() - t0


def still_open(socks: list[socket.socket]) -> int:
    """How many of `socks` the server has not closed (a closed one reads EOF at once)."""
    n = 0
    for s in socks:
        s.setblocking(False)
        try:
            n += s.recv(1) != b""
        except BlockingIOError:
            n += 1
        except OSError:
            pass
    return n


async def one_request(port: int, deadline: float) -> float:
    t0 = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), deadline)
    writer.write(f"GET /data.json HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    await writer.drain()
    body = await asyncio.wait_for(reader.read(), deadline)
    writer.close()
    if not body.startswith(b"HTTP/1.0 200"):
        raise RuntimeError(body[:80])
    return time.perf_counter() - t0


async def clients(port: int, n: int, requests: int, deadline: float) -> tuple[list[float], int]:
    failed = 0

    async def client() -> list[float]:
        nonlocal failed
        out = []
        for _ in range(requests):
            try:
                out.append(await one_request(port, deadline))
            except (OSError, asyncio.TimeoutError, RuntimeError):
                failed += 1
        return out

    done = await asyncio.gather(*(client() for _ in range(n)))
    return [x for d in done for x in d], failed


def latency(port: int, n: int, requests: int, deadline: float) -> str:
    lat, failed = asyncio.run(clients(port, n, requests, deadline))
    if not lat:
        return f"all {failed} failed"
    lat.sort()
    p = [lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 for q in (0.5, 0.99)]
    shown = f"p50 {p[0]:.0f} ms, p99 {p[1]:.0f} ms, max {lat[-1] * 1e3:.0f} ms"
    return shown + (f", {failed} failed" if failed else "")


def run(setting: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    settings = (
        {"timeout": None, "backlog": 5, "max_threads": None}
        if setting == "old"
        else ({"timeout": args.timeout} if args.timeout is not None else {})
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=ROOT, settings=settings)],
        stdout=subprocess.PIPE,
        text=True,
    )
    rows: list[tuple[str, str]] = []

    def row(what: str, value: str) -> None:
        print(f"  {setting}: {what}: {value}", file=sys.stderr, flush=True)
        rows.append((what, value))

    try:
        assert child.stdout is not None
        port_line = child.stdout.readline().split(maxsplit=1)
        port = int(port_line[0])
        applied = port_line[1].strip() if len(port_line) > 1 else "[]"
        row("settings passed to serve()", applied)
        from gputrace.viewer import server

        timeout = args.timeout if args.timeout is not None else getattr(server, "IDLE_TIMEOUT_S", 20)
        base = threads_of(child.pid)
        socks, took = open_idle(port, args.idle)
        row(f"{args.idle} idle connections: opened, in", f"{len(socks)} in {took:.1f} s")
        time.sleep(1.0)
        row(f"server threads (memory) 1 s later; at rest: {base}", threads_of(child.pid))
        time.sleep(timeout + 2.0)
        held = still_open(socks)
        row(
            f"{timeout + 3:.0f} s later: idle sockets the server holds, its threads",
            f"{held}, {threads_of(child.pid)}",
        )
        for s in socks:
            s.close()
        time.sleep(0.5)
        for n in args.clients:
            row(f"{n} busy clients x {args.requests} requests: latency", latency(port, n, args.requests, 30))
        socks, _ = open_idle(port, args.idle)
        time.sleep(0.5)
        n = max(args.clients)
        row(f"{n} busy clients while {len(socks)} idle sockets are held", latency(port, n, args.requests, 30))
        for s in socks:
            s.close()
    finally:
        child.kill()
        child.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--clients", default="50,500")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=None, help="the new setting's timeout  [default: as shipped]")
    ap.add_argument("--settings", default="old,new")
    args = ap.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    # A `timeout` around this script sends SIGTERM: exit through the `finally` that stops the child.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.path.insert(0, ROOT)
    table: dict[str, list[tuple[str, str]]] = {}
    for setting in args.settings.split(","):
        print(f"running {setting} ...", file=sys.stderr, flush=True)
        table[setting] = run(setting, args)
    names = list(table)
    print(f"| measurement | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for i, (what, _) in enumerate(table[names[0]]):
        print(f"| {what} | {' | '.join(table[s][i][1] for s in names)} |")


if __name__ == "__main__":
    main()
