"""The shm kernel's scaling with intra-op threads per rank: ``arfuse bench`` at 1, 2, 4 and 8
threads per rank (each rank pinned to that many cores), 1-2048 tokens, shm beside DeepSpeed's
all-reduce at the same threads; one bench.json per thread count under --out. Calls with fewer
tokens than threads split their columns (csrc/parallel.h), from 64 KiB of the ranks' rows:
at 2 ranks a one-token call needs --hidden 16384 in bf16 to go parallel.

A 16-core machine (2 ranks x 8 threads): ``python benchmarks/thread_scaling.py``. A thread
count whose ranks do not fit the cores runs unpinned and says so (machine.ranks_pinned)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--tokens", default="1,4,64,256,1024,2048")
    parser.add_argument("--hidden", default="7168")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--backends", default="shm,deepspeed")
    parser.add_argument("--min-seconds", default="0.3")
    parser.add_argument("--out", default="benchmarks/results/thread-scaling")
    args = parser.parse_args()
    for threads in args.threads.split(","):
        out = Path(args.out) / f"threads{threads}"
        cmd = [sys.executable, "-m", "arfuse.cli", "bench", "--threads", threads, "--tokens",
               args.tokens, "--hidden", args.hidden, "--dtype", args.dtype, "--backends",
               args.backends, "--min-seconds", args.min_seconds, "--out", str(out)]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
