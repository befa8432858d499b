"""The rank body of test_fuzz.py: fuzzed calls on a real two-rank shm group (module level,
so it can be pickled)."""

from __future__ import annotations

from typing import Any

import torch

from arfuse.scenarios import check_result, make_inputs, run_pattern


def fuzz_shm_calls(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case on both ranks, in the same order: the outcome class and the error (ValueError /
    TypeError must name the argument), or the worst error against the float64 reference."""
    import arfuse

    comm = arfuse.FusedAllReduce(max_token_num=48, hidden_dim=32, dtype=torch.bfloat16,
                                 timeout_s=20)
    out = [{"backend": comm.backend}]
    for i, case in enumerate(cases):
        out.append(_one_call(comm, case, rank, world, 1000 + i))
    comm.close()
    return out


def _one_call(comm: Any, case: dict[str, Any], rank: int, world: int,
              seed: int) -> dict[str, Any]:
    tokens, pattern = case["tokens"], case["pattern"]
    xs, residual, weight = make_inputs(seed, tokens, 32, "bf16", list(range(world)))
    x = xs[rank]
    bad = case.get("bad")
    kwargs: dict[str, Any] = {}
    if bad == "eps":
        kwargs = {"residual": residual, "weight": weight, "eps": case["value"]}
    elif bad == "scale":
        kwargs = {"residual": residual, "weight": weight, "quant": "fp8",
                  "scale": case["value"]}
    elif bad == "x_dtype":
        x = x.float()
    elif bad == "x_stride":
        x = torch.cat([x, x], dim=1)[:, ::2]
    elif bad == "weight_shape":
        kwargs = {"weight": weight[:-1]}
    elif bad == "out_overlap":
        kwargs = {"residual": residual, "weight": weight, "out": residual}
    try:
        if bad is None:
            result = run_pattern(comm, pattern, x, residual, weight)
            return {"ok": True, "ratio": check_result(pattern, "bf16", xs, residual, weight,
                                                      result)}
        comm(x, **kwargs)
        return {"ok": True, "ratio": 0.0}
    except (ValueError, TypeError) as exc:
        return {"ok": False, "type": type(exc).__name__, "error": str(exc)}
