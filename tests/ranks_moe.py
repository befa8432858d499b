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
    """Rank 1 calls with another top_k (``top_k``) or a bad index (``index``); then every rank
    makes a good call on the same op, which must still work (the group stays in step)."""
    import arfuse

    data = moe_inputs(0, 4, 8, 40, torch.float32)
    index, scales = data["index"], data["scales"]
    if rank == 1 and case == "top_k":
        index, scales = index[:, :4].contiguous(), scales[:, :4].contiguous()
    if rank == 1 and case == "index":
        index = index.clone()
        index[2, 5] = 40
    comm = arfuse.FusedAllReduce(max_token_num=16, hidden_dim=HIDDEN, dtype=torch.float32,
                                 backend=backend, strict=backend != "torch", timeout_s=10)
    first = outcome(lambda: comm.moe_finalize(data["expanded"], index, scales,
                                              residual=data["residual"],
                                              weight=data["weight"]))
    after = outcome(lambda: comm.moe_finalize(data["expanded"], data["index"],
                                              data["scales"]))
    comm.close()
    return [first, after]
