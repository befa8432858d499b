"""Quantisation at the edges: saturation, the e4m3 subnormal range, e2m1 ties, empty and
underflowing NVFP4 blocks, negative zero. The torch reference is checked against the
independent implementations; the shm kernel's bytes against the torch reference."""

from __future__ import annotations

import pytest
import torch

from arfuse import quant as q

import ranks_numerics
from harness import run_ranks, values
from reference import E2M1, fp8_codes_independent, nvfp4_independent


def fp8_edges() -> torch.Tensor:
    special = [0.0, -0.0, 1e-9, -1e-9, 2.0**-10, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-7 * 0.75,
               0.015625, 0.0156, 1.0625, 1.1875, 447.0, 448.0, 460.0, 464.0, 500.0, 1e30,
               -1e30, float("inf"), float("-inf"), -3.3, 2.0**-6 * 1.0625]
    row = torch.tensor(special + [0.0] * (32 - len(special)))
    return torch.stack([row, -row, row * 0.37, row * 3.1])


def nvfp4_edges() -> torch.Tensor:
    blocks = [
        [0.0] * 16,                                               # amax 0: scale 0, codes 0
        [1e-12] * 16,                                             # block scale underflows to 0
        [6.0 * v / 6.0 for v in E2M1] + [-v for v in E2M1],       # exact grid points
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2,         # every tie point
        [-0.0] + [0.001 * i for i in range(15)],
        [100.0, -100.0] + [1.0] * 14,
    ]
    row = torch.tensor([v for b in blocks for v in b] + [0.5] * 32)
    return torch.stack([row, row * 0.61, -row * 1.7])


def test_fp8_reference_matches_independent() -> None:
    x = fp8_edges()
    for scale in (1.0, 0.0625, 3.0):
        got = q.fp8_quantize(x, scale).view(torch.uint8)
        assert torch.equal(got, fp8_codes_independent(x, scale)), scale


def test_nvfp4_reference_matches_independent() -> None:
    x = nvfp4_edges().to(torch.bfloat16)
    for gs in (448.0 * 6.0 / 6.0, 1.0, 37.5):
        packed, scales = q.nvfp4_quantize(x, gs, "linear")
        codes, sfs = nvfp4_independent(x, gs)
        assert torch.equal(torch.stack([packed & 15, packed >> 4], -1).reshape(codes.shape),
                           codes), gs
        assert torch.equal(scales, sfs), gs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shm_kernel_fp8_edges_match_reference(dtype: torch.dtype) -> None:
    x = fp8_edges().to(dtype)
    for result in values(run_ranks(ranks_numerics.quant_edges, 2, x, "fp8", 0.5, "linear")):
        assert result["backend"] == "shm"
        expected = q.fp8_quantize(result["out"], 0.5).view(torch.uint8)
        assert torch.equal(result["quant_out"], expected)


@pytest.mark.parametrize("layout", ["linear", "swizzled_128x4"])
def test_shm_kernel_nvfp4_edges_match_reference(layout: str) -> None:
    x = nvfp4_edges().to(torch.bfloat16)
    for result in values(run_ranks(ranks_numerics.quant_edges, 2, x, "nvfp4", 448.0, layout)):
        assert result["backend"] == "shm"
        packed, scales = q.nvfp4_quantize(result["out"], 448.0, layout)
        assert torch.equal(result["quant_out"], packed)
        assert torch.equal(result["scale_out"], scales)
