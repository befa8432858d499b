"""Per-rank bodies for the multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from reference import DTYPES, EPS, FP8_SCALE, NVFP4_SCALE, Case, digest, inputs, reference


def numerics(rank: int, world: int, backend: str, cases: list[Case],
             max_tokens: int, mode: str | None = None) -> dict[Case, dict[str, Any]]:
    """Run every case; return per case a digest of the outputs and the errors vs float64."""
    import arfuse

    by_shape: dict[tuple[str, int], arfuse.FusedAllReduce] = {}
    results: dict[Case, dict[str, Any]] = {}
    for case in cases:
        key = (case.dtype, case.hidden)
        if key not in by_shape:
            by_shape[key] = arfuse.FusedAllReduce(
                max_token_num=max_tokens, hidden_dim=case.hidden, dtype=DTYPES[case.dtype],
                backend=backend, timeout_s=30)
            if mode is not None:
                by_shape[key].workspace.set_mode(mode)  # type: ignore[attr-defined]
        comm = by_shape[key]
        data = inputs(case, world)
        x = data["xs"][rank]
        kwargs: dict[str, Any] = {}
        if case.pattern != "plain":
            kwargs.update(weight=data["weight"], eps=EPS, weight_bias=case.weight_bias)
            if case.residual:
                kwargs["residual"] = data["residual"]
        if case.quant == "fp8":
            kwargs.update(quant="fp8", scale=FP8_SCALE)
        elif case.quant == "nvfp4":
            kwargs.update(quant="nvfp4", scale=NVFP4_SCALE, layout=case.layout)
        x_before = x.clone()
        res = comm(x, **kwargs)
        assert torch.equal(x, x_before), "the op modified its input"
        ref = reference(case, data)
        entry: dict[str, Any] = {
            "backend": comm.backend,
            "digest": digest(res.out, res.residual_out, res.quant_out, res.scale_out),
            "out": res.out.float().clone(),
            "ref_out": ref["out"],
            "residual_out": None if res.residual_out is None else res.residual_out.float(),
            "ref_residual_out": ref.get("residual_out"),
            "ref_abs_sum": ref["abs_sum"],
            "quant_out": None if res.quant_out is None else res.quant_out.view(torch.uint8),
            "scale_out": None if res.scale_out is None else res.scale_out.clone(),
            "out_raw": res.out.clone(),
            "path": getattr(comm.workspace, "path", ""),
        }
        results[case] = entry
    stats = {k: c.stats() for k, c in by_shape.items()}
    for comm in by_shape.values():
        comm.close()
    results[Case("stats", 0, 0, "plain")] = {"stats": stats}  # type: ignore[dict-item]
    return results


def negotiate_once(rank: int, world: int, backend: str | None, hidden: int = 64,
                   max_tokens: int = 16) -> dict[str, Any]:
    """Create a comm (faults come from the environment), run one call, report what happened."""
    import arfuse

    started = time.perf_counter()
    comm = arfuse.FusedAllReduce(max_token_num=max_tokens, hidden_dim=hidden,
                                 dtype=torch.float32, backend=backend)
    seconds = time.perf_counter() - started
    x = torch.full((2, hidden), float(rank + 1))
    out = comm(x).out
    ok = bool(torch.all(out == world * (world + 1) / 2))
    attempts = [a.describe() for a in comm.attempts]
    result = {"backend": comm.backend, "correct": ok, "attempts": attempts, "seconds": seconds,
              "pid": os.getpid()}
    comm.close()
    return result
