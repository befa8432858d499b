"""One rank of benchmarks/hosts.py (under torchrun on each namespace host): the hier backend,
the torch backend and gloo all_reduce alone, side by side, median seconds per call."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import arfuse

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _median(fn: Any, repeats: int) -> float:
    for _ in range(3):
        fn()
    dist.barrier()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(out: str, tokens: list[int], dtypes: list[str], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, hidden = dist.get_rank(), 4096
    rows: list[dict[str, Any]] = []
    for name in dtypes:
        dtype = DTYPES[name]
        ops = {b: arfuse.FusedAllReduce(max_token_num=max(tokens), hidden_dim=hidden,
                                        dtype=dtype, backend=b, timeout_s=120)
               for b in ("hier", "torch")}
        assert ops["hier"].backend == "hier", ops["hier"].plan.explain()
        weight = torch.ones(hidden, dtype=dtype)
        for t in tokens:
            x = torch.randn(t, hidden).to(dtype)
            residual = torch.randn(t, hidden).to(dtype)
            row: dict[str, Any] = {"dtype": name, "tokens": t}
            for b, op in ops.items():
                row[b] = _median(lambda op=op, x=x, r=residual, w=weight: op(
                    x, residual=r, weight=w), repeats)
            row["gloo_all_reduce"] = _median(lambda x=x: dist.all_reduce(x.clone()), repeats)
            elem, world, local = x.element_size(), dist.get_world_size(), 2
            # bytes over the link per call, each direction (docs/design.md 4, hier)
            row["link_bytes_torch"] = (world - 1) * t * hidden * elem
            row["link_bytes_hier"] = t * hidden * 4 + 32 * local
            rows.append(row)
        for op in ops.values():
            op.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3].split(","),
         int(sys.argv[4]))
