"""Measure where the shm backend should switch from one-shot to two-shot.

Runs the fused op (all-reduce + residual + RMSNorm) in both modes, interleaved in rounds, for a
sweep of token counts, and prints the median latency of each and the crossover. The thresholds
in ``arfuse/backends/shm/workspace.py`` come from this script's results on the dev machine
(``benchmarks/results/xeon-avx512/shm-threshold-*.json``).

    python benchmarks/shm_threshold.py --world-size 2 --dtype bf16 --hidden 4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from shm_common import DTYPES, save, start_rank

from arfuse.launch import launch


@dataclass(frozen=True)
class Options:
    tokens: tuple[int, ...]
    hidden: int
    dtype: str
    rounds: int
    out: str


def body(rank: int, world: int, opts: Options) -> int:
    comm = start_rank(rank, world, max(opts.tokens), opts.hidden, opts.dtype)
    dtype = DTYPES[opts.dtype]
    ws = comm.workspace
    weight = torch.ones(opts.hidden, dtype=dtype)
    rows = []
    for tokens in opts.tokens:
        x = torch.randn(tokens, opts.hidden).to(dtype)
        residual = torch.randn(tokens, opts.hidden).to(dtype)
        iters = max(3, int(2e5 / (tokens * opts.hidden)))
        times: dict[str, list[float]] = {"oneshot": [], "twoshot": []}
        for _ in range(opts.rounds):
            for mode in times:
                ws.set_mode(mode)  # type: ignore[attr-defined]
                for _ in range(2):
                    comm(x, residual=residual, weight=weight)
                for _ in range(iters):
                    t0 = time.perf_counter_ns()
                    comm(x, residual=residual, weight=weight)
                    times[mode].append((time.perf_counter_ns() - t0) / 1e3)
        medians = {m: statistics.median(v) for m, v in times.items()}
        rows.append({"tokens": tokens, "bytes_per_rank": tokens * opts.hidden * x.element_size(),
                     **{f"{m}_us": v for m, v in medians.items()}})
    ws.set_mode(None)  # type: ignore[attr-defined]
    comm.close()
    if rank == 0:
        print(f"{'tokens':>7} {'KiB/rank':>9} {'one-shot us':>12} {'two-shot us':>12}  faster")
        for r in rows:
            faster = "one" if r["oneshot_us"] <= r["twoshot_us"] else "two"
            print(f"{r['tokens']:>7} {r['bytes_per_rank'] / 1024:>9.0f} {r['oneshot_us']:>12.1f} "
                  f"{r['twoshot_us']:>12.1f}  {faster}-shot")
        save(opts.out, world, opts.hidden, opts.dtype, rows)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or (f"benchmarks/results/shm_threshold-{args.dtype}-w{args.world_size}.json")
    opts = Options(tuple(int(t) for t in args.tokens.split(",")), args.hidden, args.dtype,
                   args.rounds, out)
    env = {"OMP_NUM_THREADS": "1", "ARFUSE_LOG": "warning"}
    return launch(body, args.world_size, opts, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
