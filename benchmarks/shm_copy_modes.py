"""Measure the shm kernel's copy into the shared slot: cached stores, streaming stores, and the
kernel's automatic choice, side by side.

The fused op runs in place (``out=x``, ``residual_out=residual``, as vLLM calls it) with its
inputs rewritten before every call, untimed. The three modes take turns in blocks of
consecutive calls (a call's cost depends on how the call before it stored, so turns of one call
would mix the modes), with the first calls of each block untimed; taking turns makes drift of a
shared machine hit the modes alike. ``auto`` is warmed up past its trial first, so the timed
calls run the mode the group decided; the table says which. Results are the same in every mode
(tests/test_shm.py checks it).

    python benchmarks/shm_copy_modes.py --world-size 2 --dtype fp32 --hidden 4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from shm_common import DTYPES, save, start_rank

from arfuse.launch import launch

MODES = ("cached", "streaming", "auto")
BLOCK = 20


@dataclass(frozen=True)
class Options:
    tokens: tuple[int, ...]
    hidden: int
    dtype: str
    calls: int
    out: str


def body(rank: int, world: int, opts: Options) -> int:
    comm = start_rank(rank, world, max(opts.tokens), opts.hidden, opts.dtype)
    dtype = DTYPES[opts.dtype]
    ws: object = comm.workspace
    weight = torch.ones(opts.hidden, dtype=dtype)
    rows = []
    for tokens in opts.tokens:
        x0 = torch.randn(tokens, opts.hidden).to(dtype)
        r0 = torch.randn(tokens, opts.hidden).to(dtype)
        x, residual = x0.clone(), r0.clone()

        def call(x: torch.Tensor = x, residual: torch.Tensor = residual,
                 x0: torch.Tensor = x0, r0: torch.Tensor = r0) -> float:
            x.copy_(x0)
            residual.copy_(r0)
            t0 = time.perf_counter_ns()
            comm(x, residual=residual, weight=weight, out=x, residual_out=residual)
            return (time.perf_counter_ns() - t0) / 1e3

        ws.set_copy_mode("auto")  # type: ignore[attr-defined]
        for _ in range(ws.copy_trial_calls + 2):  # type: ignore[attr-defined]
            call()
        for mode in ("cached", "streaming"):
            ws.set_copy_mode(mode)  # type: ignore[attr-defined]
            call()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(max(1, opts.calls // BLOCK)):
            for mode in MODES:
                ws.set_copy_mode(mode)  # type: ignore[attr-defined]
                call()
                call()
                times[mode].extend(call() for _ in range(BLOCK))
        size = tokens * opts.hidden * x.element_size()
        chosen = ws.copy_modes()  # type: ignore[attr-defined]
        bucket = max((b for b in chosen if b <= size), default=None)
        medians = {m: statistics.median(v) for m, v in times.items()}
        rows.append({"tokens": tokens, "bytes_per_rank": size,
                     "auto_chose": chosen.get(bucket, "?") if bucket is not None else "?",
                     **{f"{m}_us": v for m, v in medians.items()}})
    comm.close()
    if rank == 0:
        print(f"{opts.dtype}, hidden {opts.hidden}, world size {world}, in place, median us "
              f"of {opts.calls} calls per mode")
        print(f"{'tokens':>7} {'KiB/rank':>9} {'cached':>9} {'streaming':>10} {'auto':>9} "
              f"{'stream/cached':>14}  auto chose")
        for r in rows:
            print(f"{r['tokens']:>7} {r['bytes_per_rank'] / 1024:>9.0f} {r['cached_us']:>9.1f} "
                  f"{r['streaming_us']:>10.1f} {r['auto_us']:>9.1f} "
                  f"{r['streaming_us'] / r['cached_us']:>13.2f}x  {r['auto_chose']}")
        save(opts.out, world, opts.hidden, opts.dtype, rows)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or f"benchmarks/results/shm_copy_modes-{args.dtype}-w{args.world_size}.json"
    opts = Options(tuple(int(t) for t in args.tokens.split(",")), args.hidden, args.dtype,
                   args.calls, out)
    env = {"OMP_NUM_THREADS": "1", "ARFUSE_LOG": "warning"}
    return launch(body, args.world_size, opts, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
