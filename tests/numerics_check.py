"""Assertions shared by the numerics tests of every backend."""

from __future__ import annotations

from typing import Any

import torch

from arfuse.pattern import quant_output

from reference import (
    FP8_SCALE,
    NVFP4_SCALE,
    Case,
    fp8_codes_independent,
    nvfp4_independent,
    swizzle_offset,
    ulp_eps,
)


def check_case(case: Case, per_rank: list[dict[str, Any]], backend: str) -> None:
    """Bit-identical ranks, float64 agreement, and exact quantisation of the op's own output."""
    first = per_rank[0]
    assert all(e["backend"] == backend for e in per_rank), [e["backend"] for e in per_rank]
    digests = {e["digest"] for e in per_rank}
    assert len(digests) == 1, f"{case}: ranks are not bit-identical"

    eps = ulp_eps(case.dtype)
    ref_out = first["ref_out"]
    out = first["out"].double()
    scale = ref_out.abs().amax().item() + 1e-30
    # the fp32 sum in rank order rounds once per addition: (ranks - 1) half-ulps of fp32 of the
    # magnitudes summed, on top of the rounding to the dtype (what dominates for 16-bit types)
    accumulation = (len(per_rank) - 1) * 2.0**-24 * first["ref_abs_sum"]
    if case.pattern == "plain":
        tol = eps * first["ref_abs_sum"] + accumulation + 1e-30
        assert torch.all((out - ref_out).abs() <= tol), \
            f"{case}: sum off by {(out - ref_out).abs().max().item()}"
        assert first["residual_out"] is None
        return
    res = first["residual_out"].double()
    ref_res = first["ref_residual_out"]
    # residual_out: the sum rounded, then the add rounded: an ulp of the magnitudes involved
    bound = eps * (first["ref_abs_sum"] + ref_res.abs()) + accumulation + 1e-30
    assert torch.all((res - ref_res).abs() <= bound), \
        f"{case}: residual_out off by {(res - ref_res).abs().max().item()}"
    # out: the norm of the rounded residual, rounded once more: a few ulp
    assert torch.allclose(out, ref_out, rtol=3 * eps, atol=3 * eps * scale), \
        f"{case}: out off by {(out - ref_out).abs().max().item()}"
    if case.quant == "fp8":
        expected = fp8_codes_independent(first["out_raw"], FP8_SCALE)
        got = first["quant_out"]
        mismatch = (expected != got).float().mean().item()
        assert mismatch <= 0.001, f"{case}: {mismatch:.4%} fp8 codes differ"
        dequant = got.view(torch.float8_e4m3fn).double() * FP8_SCALE
        assert torch.allclose(dequant, out, rtol=2.0**-4, atol=FP8_SCALE * 2.0**-9)
    elif case.quant == "nvfp4":
        codes, sfs = nvfp4_independent(first["out_raw"], NVFP4_SCALE)
        packed = first["quant_out"]
        assert packed.shape == (case.tokens, case.hidden // 2)
        unpacked = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(case.tokens,
                                                                          case.hidden)
        mismatch = (unpacked != codes).float().mean().item()
        assert mismatch <= 0.001, f"{case}: {mismatch:.4%} nvfp4 codes differ"
        got_sf = first["scale_out"]
        assert got_sf.dtype == torch.uint8
        assert tuple(got_sf.shape) == quant_output("nvfp4", case.layout).scale_shape(
            case.tokens, case.hidden)
        flat = got_sf.flatten()
        cols = case.hidden // 16
        for m in range(case.tokens):
            for k in range(cols):
                at = m * cols + k if case.layout == "linear" else swizzle_offset(m, k, cols)
                assert flat[at] == sfs[m, k], f"{case}: scale ({m},{k}) misplaced"
        if case.layout != "linear":
            written = torch.zeros_like(flat, dtype=torch.bool)
            for m in range(case.tokens):
                for k in range(cols):
                    written[swizzle_offset(m, k, cols)] = True
            assert torch.all(flat[~written] == 0), f"{case}: swizzle padding not zero"


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many units in the last place of ``b`` separate ``a`` from ``b``."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[b.dtype]
    _, exponent = torch.frexp(b.float())
    ulp = torch.ldexp(torch.ones_like(b, dtype=torch.float64), exponent.long() - bits)
    return ((a.double() - b.double()).abs() / ulp).round()
