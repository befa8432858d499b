"""The timing loop of ``arfuse bench``: every row warmed up, its call count set from one probe
call, then all rows interleaved in rounds; page faults counted per timed call."""

from __future__ import annotations

import os
import resource
import statistics
import time
from typing import Any

import torch

from .options import BenchOptions

ROUNDS = 5
WARMUP = 5

# a row: its call, and what restores its inputs before each call (None: nothing to restore);
# both take no arguments (the calls are lambdas over default arguments)
Row = tuple[Any, Any]


def iterations(seconds_per_call: float, opts: BenchOptions) -> int:
    """Timed calls of a row that takes ``seconds_per_call``: about ``min_seconds`` of them,
    at least 10, at most ``max_iters``."""
    return int(min(opts.max_iters, max(10, opts.min_seconds / max(seconds_per_call, 1e-7))))


def _warm_up(name: str, fn: Any, reset: Any, opts: BenchOptions, shm_warmup: int) -> int:
    """Warm the row up, then time one call (the slowest rank's time): its calls per round."""
    import torch.distributed as dist

    for _ in range(shm_warmup if name.startswith("shm") else WARMUP):
        if reset:
            reset()
        fn()
    if reset:
        reset()
    start = time.perf_counter()
    fn()
    probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    return max(2, iterations(float(probe.item()), opts) // ROUNDS)


def measure(rows: dict[str, Row], opts: BenchOptions, shm_warmup: int = WARMUP
            ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Per-call microseconds of every row, after warm-up, interleaved in rounds so that drift
    of a shared machine hits every row alike, and the page faults of its timed calls. Every
    rank runs the same counts (collectives)."""
    import torch.distributed as dist

    counts = {name: _warm_up(name, fn, reset, opts, shm_warmup)
              for name, (fn, reset) in rows.items()}
    times: dict[str, list[float]] = {name: [] for name in rows}
    faults: dict[str, int] = dict.fromkeys(rows, 0)
    dist.barrier()
    for _ in range(ROUNDS):
        for name, (fn, reset) in rows.items():
            for _ in range(counts[name]):
                if reset:
                    reset()
                f0 = minor_faults()
                t0 = time.perf_counter_ns()
                fn()
                elapsed = time.perf_counter_ns() - t0
                faults[name] += minor_faults() - f0
                times[name].append(elapsed / 1e3)
    return times, faults


def slowest_medians(rows: dict[str, list[float]]) -> dict[str, float]:
    """Each row's median over its calls, the slowest rank's (collective)."""
    import torch.distributed as dist

    medians = torch.tensor([statistics.median(times) for times in rows.values()],
                           dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(rows, medians.tolist(), strict=True))


def run_tag() -> int:
    """A number every rank of this run agrees on (rank 0's pid): names the run's files."""
    import torch.distributed as dist

    tag = torch.tensor([os.getpid()], dtype=torch.int64)
    dist.broadcast(tag, 0)
    return int(tag.item())


def minor_faults() -> int:
    """Page faults of this process so far: a row whose outputs come from fresh pages pays
    them inside its call (the allocator returned the previous call's memory to the system)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_us": statistics.median(ordered),
            "p90_us": ordered[min(len(ordered) - 1, int(0.9 * (len(ordered) - 1) + 0.5))],
            "iters": len(ordered)}
