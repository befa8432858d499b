"""arfuse's Python overhead per call, on top of the compiled shm kernel."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .options import EPS

CALLS = 4000
WARMUP_CALLS = 200


def python_overhead(comm: Any, weight: torch.Tensor, hidden: int) -> dict[str, float]:
    """What the op costs on top of its compiled kernel, 1 token, two ways, call by call:

    * ``overhead_us``: the op minus a direct Python call of the kernel (alternating, median of
      the paired differences: drift cancels within a pair): arfuse's Python layer;
    * ``outside_kernel_us``: the op minus the time the kernel reports for its own work in that
      call (outputs, exchange, epilogue): everything else, including the Python-to-C++ call
      and wrapping new output tensors, which any compiled torch op pays; also in place
      (``outside_kernel_inplace_us``), where no new tensors are wrapped."""
    ws = comm.workspace
    kernel = getattr(ws, "_comm", None)
    if kernel is None:
        return {}
    x = torch.randn(1, hidden).to(weight.dtype)
    residual = torch.randn(1, hidden).to(weight.dtype)
    x2, residual2 = x.clone(), residual.clone()
    kernel.set_timing(True)
    op_t: list[float] = []
    raw_t: list[float] = []
    diffs: list[float] = []
    outside: list[float] = []
    outside_inplace: list[float] = []
    for i in range(CALLS + WARMUP_CALLS):
        t0 = time.perf_counter_ns()
        comm(x, residual=residual, weight=weight, eps=EPS)
        t1 = time.perf_counter_ns()
        inside = kernel.last_call_seconds() * 1e6
        kernel.run(x, residual, weight, EPS, 0.0, 0, 0.0, None, None)
        t2 = time.perf_counter_ns()
        x2.copy_(x)
        residual2.copy_(residual)
        t3 = time.perf_counter_ns()
        comm(x2, residual=residual2, weight=weight, eps=EPS, out=x2, residual_out=residual2)
        t4 = time.perf_counter_ns()
        if i >= WARMUP_CALLS:
            op_t.append((t1 - t0) / 1e3)
            raw_t.append((t2 - t1) / 1e3)
            diffs.append(op_t[-1] - raw_t[-1])
            outside.append(op_t[-1] - inside)
            outside_inplace.append((t4 - t3) / 1e3 - kernel.last_call_seconds() * 1e6)
    kernel.set_timing(False)
    return {"op_median_us": statistics.median(op_t),
            "kernel_median_us": statistics.median(raw_t),
            "overhead_us": statistics.median(diffs),
            "outside_kernel_us": statistics.median(outside),
            "outside_kernel_inplace_us": statistics.median(outside_inplace),
            "calls": len(op_t)}
