"""A recording process for the streaming tests: host spans, a flush per step, and after each
flush one line on stdout with the number of spans recorded so far (all resolved: host spans).

    python -m tests.stream_worker OUT_DIR STEPS [--handler] [--sleep-ms N] [--format F]

--handler installs a SIGTERM handler of the program's own before recording starts; it writes
"handler ran" to stdout and exits with status 3 (gputrace must call it, not replace it).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import gputrace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("steps", type=int)
    ap.add_argument("--handler", action="store_true")
    ap.add_argument("--sleep-ms", type=float, default=1.0)
    ap.add_argument("--format", default="json")
    a = ap.parse_args()
    if a.handler:

        def own(signum: int, frame: object) -> None:
            print("handler ran", flush=True)
            sys.exit(3)

        signal.signal(signal.SIGTERM, own)
    gputrace.enable(out_dir=a.out, cuda=False, format=a.format)
    n = 0
    for step in range(a.steps):
        with gputrace.span("step", step=step):
            for i in range(20):
                with gputrace.span("op", i=i):
                    n += 1
            time.sleep(a.sleep_ms / 1000)
        n += 1
        gputrace.flush()
        print(n, flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
