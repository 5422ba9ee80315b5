"""Record the sample traces on GPUs: a 2-GPU NCCL run and a 1-GPU run of `gputrace demo`.

    python samples/record.py OUTDIR      (on a machine with two GPUs)
"""

from __future__ import annotations

import os
import sys

from gputrace import demo, merge


def main(out: str) -> None:
    two = os.path.join(out, "h200x2-nccl")
    paths = demo.run_ranks(two, steps=8, ranks=2)
    merge.merge(paths, os.path.join(two, "merged.json"))
    one = os.path.join(out, "h200x1")
    os.environ.update({"LOCAL_RANK": "0"})
    demo.train(one, steps=8)


if __name__ == "__main__":
    main(sys.argv[1])
