"""Rank bodies for the MoE patterns: every rank's results (to compare across ranks and
backends), ranks that disagree on top_k, a rank with a bad index. Module level, so they can be
pickled."""

from __future__ import annotations

from typing import Any

import torch

from harness import outcome

HIDDEN = 96  # not a multiple of 64: the kernel's scalar tail runs too


def moe_inputs(rank: int, tokens: int, top_k: int, rows: int, dtype: torch.dtype,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """One rank's expert rows (different on every rank, the routing the same), and the
    residual and weight every rank shares."""
    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed + 1 + rank)
    index = torch.randint(-1, rows, (tokens, top_k), generator=shared, dtype=torch.int32)
    return {
        "expanded": torch.randn(rows, HIDDEN, generator=own).to(dtype),
        "index": index,
        "scales": torch.rand(tokens, top_k, generator=shared),
        "shared": torch.randn(tokens, HIDDEN, generator=own).to(dtype),
        "residual": torch.randn(tokens, HIDDEN, generator=shared).to(dtype),
        "weight": torch.rand(HIDDEN, generator=shared).to(dtype),
        "active": torch.randn(top_k, tokens, HIDDEN, generator=own).to(dtype),
        "scale_input": torch.rand(top_k, tokens, generator=shared),
        "token_input": torch.randn(tokens, HIDDEN, generator=own).to(dtype),
    }


def moe_results(rank: int, world: int, backend: str, dtype: torch.dtype,
                cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """Each case (pattern, tokens, capacity) on ``backend``: the bytes of every output and
    the op's counts, for the test to compare across ranks and with the torch backend."""
    import arfuse

    report = []
    for pattern, tokens, capacity in cases:
        data = moe_inputs(rank, tokens, 8, 40, dtype)
        with arfuse.FusedAllReduce(max_token_num=capacity, hidden_dim=HIDDEN, dtype=dtype,
                                   backend=backend, strict=backend != "torch",
                                   timeout_s=20) as comm:
            norm = {"residual": data["residual"], "weight": data["weight"], "eps": 1e-5}
            if pattern == "finalize":
                result = comm.moe_finalize(data["expanded"], data["index"], data["scales"],
                                           shared_expert_output=data["shared"],
                                           routed_scaling_factor=2.5, **norm)
            elif pattern == "finalize_fp8":
                result = comm.moe_finalize(data["expanded"], data["index"], data["scales"],
                                           quant="fp8", scale=0.25, **norm)
            elif pattern == "finalize_plain":
                result = comm.moe_finalize(data["expanded"], data["index"], data["scales"])
            else:
                result = comm.moe_reduce(data["active"], data["scale_input"],
                                         data["token_input"], **norm)
            # raw bytes: fp8 tensors do not survive pickling in this torch
            raw = [None if t is None else t.contiguous().view(torch.uint8).clone() for t in result]
            report.append({"outputs": raw,
                           "stats": comm.stats(), "backend": comm.backend})
    return report


def moe_disagreement(rank: int, world: int, backend: str, case: str) -> list[dict[str, Any]]:
    """Rank 1 calls with another top_k (``top_k``), a bad index (``index``), a flat index
    (``flat``) or a reduction's scales of the wrong shape (``reduce_scales``); then every rank
    makes a good call on the same op, which must still work (the group stays in step)."""
    import arfuse

    data = moe_inputs(0, 4, 8, 40, torch.float32)
    index, scales = data["index"], data["scales"]
    if rank == 1 and case == "top_k":
        index, scales = index[:, :4].contiguous(), scales[:, :4].contiguous()
    if rank == 1 and case == "index":
        index = index.clone()
        index[2, 5] = 40
    if rank == 1 and case == "flat":
        index = index.flatten()
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=HIDDEN, dtype=torch.float32,
                                 backend=backend, strict=backend != "torch", timeout_s=10)
    if case == "reduce_scales":
        scale_input = data["scale_input"]
        if rank == 1:
            scale_input = scale_input.t().contiguous()
        first = outcome(lambda: comm.moe_reduce(data["active"], scale_input,
                                                data["token_input"], residual=data["residual"],
                                                weight=data["weight"]))
    else:
        first = outcome(lambda: comm.moe_finalize(data["expanded"], index, scales,
                                                  residual=data["residual"],
                                                  weight=data["weight"]))
    after = outcome(lambda: comm.moe_finalize(data["expanded"], data["index"],
                                              data["scales"]))
    comm.close()
    return [first, after]


def moe_fast_and_checked(rank: int, world: int, dtype: torch.dtype) -> dict[str, Any]:
    """On shm, rank 1 takes the checked Python path for every MoE call and rank 0 the kernel's
    fast path: the signatures must match and the bytes be the same. Then every rank hands the
    fast path calls that the Python path refuses: each must be declined (None), not run."""
    import arfuse

    data = moe_inputs(0, 5, 8, 40, dtype)
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=HIDDEN, dtype=dtype,
                                 backend="shm", strict=True, timeout_s=20)
    fast = comm._fast_moe  # type: ignore[attr-defined]
    if rank == 1:
        comm._fast_moe = None  # type: ignore[attr-defined]
    norm = {"residual": data["residual"], "weight": data["weight"], "eps": 1e-5}
    results = [
        comm.moe_finalize(data["expanded"], data["index"], data["scales"],
                          shared_expert_output=data["shared"], routed_scaling_factor=2.5,
                          **norm),
        comm.moe_finalize(data["expanded"], data["index"], data["scales"].to(dtype)),
        comm.moe_finalize(data["expanded"], data["index"], data["scales"], quant="fp8",
                          scale=0.25, **norm),
        comm.moe_reduce(data["active"], data["scale_input"], data["token_input"], **norm),
    ]
    raw = [[None if t is None else t.contiguous().view(torch.uint8).clone() for t in r]
           for r in results]
    fast_calls = comm._fast_calls  # type: ignore[attr-defined]
    declined = {name: fast(*args, None, None, 1e-5, 0.0, None, None, "swizzled_128x4", None,
                           None, 0) is None
                for name, args in _refused_by_python(comm, data, dtype).items()}
    comm.close()
    return {"outputs": raw, "fast_calls": fast_calls, "declined": declined}


def _refused_by_python(comm: Any, data: dict[str, torch.Tensor],
                       dtype: torch.dtype) -> dict[str, tuple[Any, ...]]:
    """(rows, index, scales, add, routed) of calls arfuse.moe refuses (or, for the index past
    the rows and the tokens over capacity, that the Python path handles)."""
    rows, index, scales, shared = data["expanded"], data["index"], data["scales"], data["shared"]
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    past = index.clone()
    past[1, 2] = rows.shape[0]
    slot = comm.input_buffer(4)
    return {
        "flat index": (rows, index.flatten(), scales, None, 1.0),
        "int64 index": (rows, index.long(), scales, None, 1.0),
        "top_k 0": (rows, index[:, :0].contiguous(), scales[:, :0].contiguous(), None, 1.0),
        "scales shape": (rows, index, scales[:, :4].contiguous(), None, 1.0),
        "scales float64": (rows, index, scales.double(), None, 1.0),
        "rows dtype": (rows.to(other), index, scales, None, 1.0),
        "rows hidden": (torch.ones(40, HIDDEN + 1, dtype=dtype), index, scales, None, 1.0),
        "rows not contiguous": (torch.ones(HIDDEN, 40, dtype=dtype).t(), index, scales, None,
                                1.0),
        "shared shape": (rows, index, scales, shared[:4], 1.0),
        "routed inf": (rows, index, scales, shared, float("inf")),
        "routed str": (rows, index, scales, shared, "2"),
        "routed bool": (rows, index, scales, shared, True),
        "rows a list": ([[1.0]], index, scales, None, 1.0),
        "index past the rows": (rows, past, scales, shared, 1.0),
        "over capacity": (torch.ones(17 * 8, HIDDEN, dtype=dtype),
                          torch.zeros(17, 8, dtype=torch.int32), torch.ones(17, 8), None, 1.0),
        "rows in the shared segment": (slot, torch.zeros(5, 8, dtype=torch.int32), scales,
                                       None, 1.0),
        "reduce without token input": (data["active"], None, data["scale_input"], None, 1.0),
        "reduce scales shape": (data["active"], None, data["scale_input"].t().contiguous(),
                                data["token_input"], 1.0),
    }
