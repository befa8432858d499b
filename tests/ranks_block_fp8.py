"""Rank bodies for the block-FP8 MLP (``block_fp8_mlp``). Module level, so they can be
pickled."""

from __future__ import annotations

from typing import Any

import block_fp8_mlp as mlp
import torch

PROMPT = [5, 17, 42, 3, 88, 61]


def greedy_both_ways(rank: int, world: int, backend: str, layers: int,
                     steps: int) -> dict[str, Any]:
    """Greedy tokens and the last logits' bytes with the quantisation fused into the arfuse
    call (``quant="fp8_group"``) and with the call unquantised then ``act_quant`` in eager
    torch, on ``backend``; the op's backend and fused-call count."""
    import arfuse

    model = mlp.make_model(rank, world, layers)
    with arfuse.FusedAllReduce(max_token_num=len(PROMPT) + steps, hidden_dim=mlp.HIDDEN,
                               dtype=torch.bfloat16, backend=backend, strict=True) as comm:
        found: dict[str, Any] = {"backend": comm.backend}
        for name, fused in (("fused", True), ("unfused", False)):
            tokens, logits = mlp.greedy(model, comm, PROMPT, steps, fused)
            found[name] = {"tokens": tokens,
                           "logits": logits.contiguous().view(torch.int32).flatten().tolist()}
        found["calls"] = comm.stats()
    return found
