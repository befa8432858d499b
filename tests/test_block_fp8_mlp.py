"""A random-weight DeepSeek-style block-FP8 MLP (``block_fp8_mlp``: FP8 weights with 128x128
block scales, activations quantised per token group of 128 before each GEMM) on 2 gloo ranks:
the norm's quantisation fused into the all-reduce call (``quant="fp8_group"``) gives the same
greedy tokens and the same logits, to the bit, as the call without it followed by DeepSeek's
``act_quant`` in eager torch; every rank alike."""

from __future__ import annotations

import block_fp8_mlp as mlp
import pytest
import torch

import ranks_block_fp8
from harness import run_ranks, values

STEPS = 4


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_fused_group_quantisation_gives_the_unfused_models_tokens_and_bytes(
        backend: str) -> None:
    found = values(run_ranks(ranks_block_fp8.greedy_both_ways, 2, backend, 2, STEPS,
                             timeout=240))
    mine = found[0]
    assert mine["backend"] == backend
    assert len(mine["fused"]["tokens"]) == STEPS
    assert mine["fused"] == mine["unfused"]
    assert found[1] == mine
    # 3 calls per forward (two layers, the final norm), every one of them on the backend
    calls = 2 * 3 * STEPS
    assert mine["calls"]["calls"] == calls and mine["calls"]["unfused_over_capacity"] == 0
    assert mine["calls"]["fused"] == (calls if backend == "shm" else 0), mine["calls"]
    # the greedy picks are not one token over and over: the weights matter
    assert len(set(mine["fused"]["tokens"])) > 1, mine["fused"]["tokens"]


def test_the_weights_are_block_fp8_and_the_gemm_dequantises_them() -> None:
    """The helpers themselves: 128x128 block scales, codes within e4m3, and the GEMM equal to
    the product of the dequantised operands."""
    w = torch.randn(256, 512)
    codes, scales = mlp.weight_quant(w)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (2, 4)
    per_element = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)
    dequant = codes.float() * per_element
    # half an e4m3 step: 1/16 of the value, or 2^-10 of the block's scale where subnormal
    bound = torch.maximum(w.abs() / 16, per_element / 1024) * (1 + 1e-6)
    assert bool(((dequant - w).abs() <= bound).all())
    x = torch.randn(3, 512).bfloat16()
    a, s = mlp.act_quant(x)
    assert a.dtype == torch.float8_e4m3fn and s.shape == (3, 4)
    want = (a.float() * s.repeat_interleave(128, 1)) @ dequant.t()
    assert torch.equal(mlp.fp8_gemm(a, s, codes, scales), want.bfloat16())
