"""New output tensors when the token count changes from call to call, as continuous batching
changes it: the shm op on two ranks, bf16, hidden 4096, cycling through 40 token counts (33-72);
median µs per call and minor page faults per call.

    python benchmarks/varying_tokens.py                       # this tree
    PYTHONPATH=/tmp/old/src python benchmarks/varying_tokens.py  # another, for comparison
"""

from __future__ import annotations

import resource
import statistics
import time

import torch
from shm_common import start_rank

from arfuse.launch import launch

HIDDEN = 4096
COUNTS = list(range(33, 73))
ROUNDS = 20


def body(rank: int, world: int, _: object) -> int:
    comm = start_rank(rank, world, max(COUNTS), HIDDEN, "bf16")
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)
    xs = {t: torch.randn(t, HIDDEN).to(torch.bfloat16) for t in COUNTS}
    residuals = {t: torch.randn(t, HIDDEN).to(torch.bfloat16) for t in COUNTS}
    for t in COUNTS * 3:  # warm-up, the copy-mode trials included
        comm(xs[t], residual=residuals[t], weight=weight)
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _round in range(ROUNDS):
        for t in COUNTS:
            t0 = time.perf_counter_ns()
            result = comm(xs[t], residual=residuals[t], weight=weight)
            times.append((time.perf_counter_ns() - t0) / 1e3)
            del result  # the layer consumed it
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    if rank == 0:
        print(f"{len(COUNTS)} token counts ({COUNTS[0]}-{COUNTS[-1]}), new outputs: median "
              f"{statistics.median(times):.1f} us per call, {faults / len(times):.2f} page "
              "faults per call")
    comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(launch(body, 2, None, env={"OMP_NUM_THREADS": "1",
                                                 "ARFUSE_LOG": "warning"}))
